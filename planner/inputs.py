"""The model and training shape a plan is for, read through the project's own flags.

Three ways in, one way through: a ``--preset`` (Megatron flags), a Hugging Face ``config.json``
(``training/hf/config.py`` turns it into a ``TransformerConfig``, whose fields become Megatron flags
as ``--use-checkpoint-args`` derives them), and Megatron's model flags as ``pretrain_gpt.py`` takes
them, which come last and override. The flags are parsed by ``training.arguments.parser.parse_args`` and
checked by ``validate_args``, so the planner reads exactly the model training would build.

The parallel layout is the planner's to choose, so its flags are taken out of the base command line;
a size the user gave (``--tensor-model-parallel-size 8``) stays fixed in the search. What a runnable
command needs and the user did not give (a data source, a tokenizer, ``--train-iters``, ``--lr``) is
filled with mock data and placeholders, and said so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass, field

import torch

from planner.model_spec import ModelSpec
from planner.presets import preset_flags
from training.arguments.data_parallel_flags import instances_problem
from training.arguments.parser import parse_args
from training.arguments.schema import BY_DEST, BY_OPTION
from training.arguments.schema import flag_name as _flag
from training.checkpoint.model_args import checkpoint_model_args
from training.hf.config import transformer_config_from_hf
from training.run import build_run
from training.tokenizer import build_tokenizer

__all__ = ["PLANNED_DESTS", "PlanInput", "read_input"]

PLANNED_DESTS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "num_virtual_stages_per_pipeline_rank": "vpp",
    "pipeline_schedule": "schedule",
    "micro_batch_size": "micro_batch_size",
    "recompute_granularity": "recompute",
}
"""Flags the search chooses; given on the command line, they fix that dimension."""
_MEGATRON_FSDP_DTYPES = (
    "megatron_fsdp_main_params_dtype",
    "megatron_fsdp_main_grads_dtype",
    "megatron_fsdp_grad_comm_dtype",
)
"""Megatron-FSDP's dtype flags the planner models: they change the model's numbers (:class:`ModelSpec`),
and every candidate carries them (they need ``--use-megatron-fsdp``, a planned flag)."""
_ALSO_PLANNED = (
    "pipeline_model_parallel_layout",
    "num_layers_per_virtual_pipeline_stage",
    "sequence_parallel",
    "recompute_method",
    "recompute_num_layers",
    "use_distributed_optimizer",
    "use_megatron_fsdp",
    "data_parallel_sharding_strategy",
    "data_parallel_sharding_scope",
    "num_distributed_optimizer_instances",
    "outer_dp_sharding_strategy",
    "suggested_communication_unit_size",
    *_MEGATRON_FSDP_DTYPES,
    "overlap_grad_reduce",
    "overlap_param_gather",
    "global_batch_size",
)
_PLACEHOLDERS = {"train_iters": ("--train-iters", "100"), "lr": ("--lr", "3e-4")}


@dataclass
class PlanInput:
    """The model, the base command line every candidate extends, and what the user fixed."""

    spec: ModelSpec
    base_flags: list[str]
    """``pretrain_gpt.py`` flags without the planned ones."""
    global_batch_size: int
    fixed: dict[str, object] = field(default_factory=dict)
    """Search dimensions the user fixed: tp, pp, cp, ep, vpp, schedule, micro_batch_size, recompute,
    dp_sharding (``--use-megatron-fsdp`` with its strategy), dp_sharding_scope, and HSDP's instances
    (``--num-distributed-optimizer-instances``) and outer_dp_sharding (``--outer-dp-sharding-strategy``)."""
    distributed_optimizer_allowed: bool = False
    """``--use-distributed-optimizer``: ZeRO-1 wherever DP x CP > 1 (ZeRO-2/3 still where it does not fit)."""
    notes: list[str] = field(default_factory=list)
    """What was filled in, and why (printed above the table)."""
    args: argparse.Namespace | None = None
    """The base flags parsed and validated at one rank (what builds the model's layers)."""


def _option_arity(option: str) -> int | None:
    """Values an option takes: 0 (bool), 1, or None for a list (up to the next flag)."""
    flag = BY_OPTION.get(option.split("=", 1)[0])
    if flag is None or flag.kind is bool:
        return 0
    return None if flag.nargs == "*" else 1


def _strip(argv: list[str], dests: set[str]) -> list[str]:
    """``argv`` without the flags (and their values) whose destination is in ``dests``."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        option = token.split("=", 1)[0]
        flag = BY_OPTION.get(option)
        arity = _option_arity(option) if token.startswith("--") and "=" not in token else 0
        end = i + 1
        if arity == 1:
            end = i + 2
        elif arity is None:
            while end < len(argv) and not argv[end].startswith("--"):
                end += 1
        if flag is None or flag.dest not in dests:
            out += argv[i:end]
        i = end
    return out


def _hf_flags(path: str) -> list[str]:
    """Megatron flags describing a Hugging Face ``config.json``'s model (its vocabulary included)."""

    with open(path) as f:
        hf = json.load(f)
    config, vocab, max_positions = transformer_config_from_hf(hf, where=path)
    manifest = {"model": {"config": config.to_dict(), "max_sequence_length": max_positions}}
    values = checkpoint_model_args(manifest, argparse.Namespace(**{d: None for d in BY_DEST}))
    flags: list[str] = []
    for dest, value in values.items():
        flags += _spelled(dest, value)
    precision = {"bfloat16": ["--bf16"], "float16": ["--fp16"]}
    flags += precision.get(str(config.params_dtype).removeprefix("torch."), [])
    return flags + ["--vocab-size", str(vocab - 1), "--tokenizer-type", "NullTokenizer"]


def _spelled(dest: str, value) -> list[str]:
    """``dest = value`` as command-line tokens (nothing where it is the flag's default)."""
    flag = BY_DEST[dest]
    if value is None or value == flag.default:
        return []
    if flag.kind is bool:
        return [flag.name] if value == flag.stores(flag.name) else [flag.negation] if flag.negation else []
    return [flag.name, str(value)]


def _runnable(argv: list[str], args: argparse.Namespace, notes: list[str]) -> list[str]:
    """What a ``pretrain_gpt.py`` command needs and ``argv`` lacks: mock data, a tokenizer, placeholders."""
    given = set(args.explicit_args)
    extra: list[str] = []
    if not {"data_path", "mock_data", "train_data_path"} & given:
        extra.append("--mock-data")
        notes.append("no data source given: the flags use --mock-data (add your --data-path)")
    if "tokenizer_type" not in given:
        extra += ["--tokenizer-type", "NullTokenizer"]
    missing = [flag for dest, flag in _PLACEHOLDERS.items() if dest not in given]
    if "train_samples" in given:
        missing = [f for f in missing if f[0] != "--train-iters"]
    for option, value in missing:
        extra += [option, value]
    if missing:
        notes.append("placeholders in the flags: " + " ".join(f"{o} {v}" for o, v in missing))
    return argv + extra


def _vocab(args: argparse.Namespace) -> int:
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ValueError(
                "--vocab-size is needed to plan with NullTokenizer (the ids before end-of-document)"
            )
        return args.vocab_size + 1

    return build_tokenizer(
        args.tokenizer_type,
        args.tokenizer_model,
        vocab_size=args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
    ).vocab_size


def _fixed_sharding(given: argparse.Namespace) -> dict[str, str]:
    """The strategy and scope the user fixed: ``--use-megatron-fsdp`` (Megatron's default strategy,
    optim_grads_params) or its ``--data-parallel-sharding-strategy``, and ``--data-parallel-sharding-scope``
    (the flag checks of ``pretrain_gpt.py`` refuse what does not go together)."""
    fixed = {}
    if given.use_megatron_fsdp or given.data_parallel_sharding_strategy is not None:
        fixed["dp_sharding"] = given.data_parallel_sharding_strategy or (
            "optim_grads_params" if given.use_megatron_fsdp else "no_shard"
        )
    if given.data_parallel_sharding_scope != "auto":
        fixed["dp_sharding_scope"] = given.data_parallel_sharding_scope
    return fixed


def _fixed_instances(given: argparse.Namespace, strategy: str | None) -> dict:
    """HSDP as the user fixed it: ``--num-distributed-optimizer-instances`` (``instances``) and
    ``--outer-dp-sharding-strategy`` (``outer_dp_sharding``), refused with the training flags' own line
    where they cannot go with the strategy (whether N divides DP x CP is the search's, per split)."""
    instances, outer = given.num_distributed_optimizer_instances, given.outer_dp_sharding_strategy
    problem = instances_problem(
        instances,
        outer,
        strategy=strategy or ("optim" if given.use_distributed_optimizer else "no_shard"),
        distributed=strategy != "no_shard",
    )
    if problem is not None:
        raise ValueError(problem)
    fixed: dict[str, object] = {}
    if "num_distributed_optimizer_instances" in given.explicit_args:
        fixed["instances"] = instances
    if "outer_dp_sharding_strategy" in given.explicit_args:
        fixed["outer_dp_sharding"] = outer
    if given.suggested_communication_unit_size is not None:
        fixed["communication_unit_size"] = given.suggested_communication_unit_size
    dtypes = [(_flag(d), getattr(given, d)) for d in _MEGATRON_FSDP_DTYPES if d in given.explicit_args]
    if dtypes:
        fixed["megatron_fsdp_dtypes"] = tuple(token for pair in dtypes for token in pair)
    return fixed


def read_input(
    megatron_argv: list[str], *, preset: str | None = None, hf_config: str | None = None
) -> PlanInput:
    """The model and training shape of ``preset`` / ``hf_config`` / ``megatron_argv`` (later ones win)."""

    argv = (preset_flags(preset) if preset else []) + (_hf_flags(hf_config) if hf_config else [])
    argv = argv + list(megatron_argv)
    notes: list[str] = []
    given = parse_args(argv)
    fixed = {key: getattr(given, dest) for dest, key in PLANNED_DESTS.items() if dest in given.explicit_args}
    if given.pipeline_model_parallel_layout:
        fixed["layout"] = given.pipeline_model_parallel_layout
    if given.global_batch_size is None:
        raise ValueError("--global-batch-size is needed to plan: it fixes the microbatches per step")
    fixed.update(_fixed_sharding(given))
    fixed.update(_fixed_instances(given, fixed.get("dp_sharding")))
    base = _runnable(_strip(argv, set(PLANNED_DESTS) | set(_ALSO_PLANNED)), given, notes)
    with contextlib.redirect_stdout(None):  # the flag checks' notes, for one rank: not the plan's
        distributed = given.use_distributed_optimizer or fixed.get("dp_sharding", "no_shard") != "no_shard"
        sharded = ["--use-distributed-optimizer"] if distributed else []  # --fp8-param-gather needs it
        if "megatron_fsdp_dtypes" in fixed:  # the model's numbers, as the training flags derive them
            sharded = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"]
            sharded += fixed["megatron_fsdp_dtypes"]
        run = build_run(
            parse_args(base + sharded + ["--micro-batch-size", "1", "--global-batch-size", "1"]), 1
        )
    spec = ModelSpec.from_config(
        run.model,
        vocab_size=_vocab(run.args),
        seq_length=run.gpt.seq_length,
        max_position_embeddings=run.gpt.max_position_embeddings,
        name=preset or hf_config or "",
    ).with_(
        grads_in_fp32=run.ddp.grad_reduce_in_fp32,
        main_params_in_model_dtype=run.optimizer.main_params_dtype != torch.float32,
        grad_comm_bytes=None if run.ddp.grad_comm_dtype is None else run.ddp.grad_comm_dtype.itemsize,
    )
    return PlanInput(
        spec=spec,
        base_flags=base,
        global_batch_size=given.global_batch_size,
        fixed=fixed,
        distributed_optimizer_allowed=given.use_distributed_optimizer,
        notes=notes,
        args=run.args,
    )

"""Joint validation of the parsed flags, before any process group: ``derive_args``.

``derive_args(args, world_size)`` checks the flags together and returns the values they imply
(data-parallel size, microbatch count, virtual pipeline size, FFN size, ...) by name, leaving
``args`` as parsed; :mod:`training.run` puts them into the run's typed objects. It runs before
``torch.distributed`` exists and is a pure function of its inputs (with a batch ramp, also of the
``--load`` checkpoint's consumed samples, read from its manifest), so every rank raises the same
single ``ValueError`` naming the flags and numbers to change. ``validate_args`` is Megatron's name
for the same check, returning a new namespace with the derived values (what ``get_args()`` gives).

The model's rules are the configs' own (``core.transformer.rules``, ``...context_parallel.rules``,
``...moe.rules``): they return structured problems, which :func:`command_line_message` says with
Megatron's flag names where ``TransformerConfig`` says them with its field names, so the command line
and the Python API refuse the same configurations. The other flag groups are checked in their own
modules (batch sizes, the learning-rate schedule, the virtual pipeline, data, precision and sharding).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

from core.device import computes_on_cuda
from core.model_parallel_config import parallel_size_problems
from core.problems import Problem, problem
from core.tensor_parallel.fp8_config import fp8_problems
from core.transformer.context_parallel.rules import context_parallel_problems
from core.transformer.cuda_graphs import cuda_graph_problems, cuda_graphs_off_line, local_graph_problems
from core.transformer.moe.moe_config import parse_moe_layer_freq
from core.transformer.moe.rules import moe_problems
from core.transformer.rules import decoder_problems, size_problems
from training.arguments.data_flags import check_data_flags
from training.arguments.data_parallel_flags import derive_precision_and_data_parallel
from training.arguments.schema import BY_OPTION, COVERAGE
from training.arguments.schema import flag_name as _flag
from training.arguments.virtual_pipeline import derive_virtual_pipeline
from training.data.batch_sizes import check_run_batches, derive_batch_sizes
from training.lr_schedule import check_schedule
from training.reporting.logging_utils import print_line

__all__ = ["command_line_message", "derive_args", "megatron_namespace", "validate_args"]

REQUIRED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
    "train_iters",
    "lr",
)
"""Flags Megatron has no default for (the tiny demo fills them in when it is on)."""


class _Resolving:
    """The flags as parsed, with the values validation derives kept apart in ``derived``.

    Reads see a derived value first, then the parsed flag; writes go to ``derived`` only, so the
    checks below read as if they filled in a namespace while the parsed ``args`` is never changed.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "derived", {})

    def __getattr__(self, name: str) -> Any:
        return self.derived[name] if name in self.derived else getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.derived[name] = value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


_FIELD_FLAGS = {"moe_layer_freq": "moe_layer_pattern"}
"""Config fields whose flag has another ``dest`` (the flag holds Megatron's text, the field its value)."""


def command_line_message(problem: Problem) -> str:
    """A config's problem as the command line says it: with Megatron's flag names for the fields."""
    return problem.render(lambda field: _flag(_FIELD_FLAGS.get(field, field)), command_line=True)


def _refuse_first(problems: list[Problem]) -> None:
    if problems:
        raise ValueError(command_line_message(problems[0]))


def _as_config(args: argparse.Namespace) -> _Resolving:
    """The flags as a ``TransformerConfig`` would hold them, for its rules: query groups resolved as
    ``--group-query-attention`` says, the MoE layer pattern as given."""
    view = _Resolving(args)
    view.num_query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    view.moe_layer_freq = args.moe_layer_pattern
    return view


def _rank0_note(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print_line(f"NOTE: {message}")


_AT_LEAST = {
    1: (
        "seq_length",
        "max_position_embeddings",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "log_interval",
        "eval_interval",
        "save_interval",
        "exit_interval",
        "vocab_size",
        "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank",
        "microbatch_group_size_per_vp_stage",
        "recompute_num_layers",
        "lr_decay_iters",
        "train_samples",
        "lr_decay_samples",
        "lr_wsd_decay_iters",
        "lr_wsd_decay_samples",
        "max_consecutive_skipped_iterations",
        "distributed_timeout_minutes",
        "bucket_size",
        "hysteresis",
        "loss_scale_window",
    ),
    0: (
        "ckpt_step",
        "eval_iters",
        "lr_warmup_iters",
        "lr",
        "min_lr",
        "weight_decay",
        "clip_grad",
        "init_method_std",
        "manual_gc_interval",
        "exit_duration_in_mins",
        "lr_warmup_samples",
        "decoupled_lr",
        "decoupled_min_lr",
        "start_weight_decay",
        "end_weight_decay",
        "num_workers",
        "profile_step_start",
    ),
}
"""Lower bounds of flags the command line bounds itself (the parallel and decoder sizes are their
configs' rules: ``parallel_size_problems``, ``size_problems``)."""
_FRACTIONS = ("lr_warmup_fraction", "adam_beta1", "adam_beta2")
"""Fractions the command line checks itself (the decoder's dropouts are its config's rules)."""


def _check_required(args: argparse.Namespace) -> None:
    """Outside the tiny demo, Megatron's required flags, and a tokenizer for the given data."""
    if args.using_default_model:
        return
    missing = [_flag(d) for d in REQUIRED if getattr(args, d) is None]
    if args.train_samples is not None and "--train-iters" in missing:
        missing.remove("--train-iters")  # a sample-based run: --train-samples gives the length
    if args.tokenizer_type is None:
        missing.append(_flag("tokenizer_type"))
    if missing:
        them = "it" if len(missing) == 1 else "them"
        off_by = args.tiny_demo_off_by
        raise ValueError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: Megatron has no default "
            f"for {them}, and the tiny demo that fills {them} in is off because {', '.join(off_by)} "
            f"{'was' if len(off_by) == 1 else 'were'} given"
        )


def _check_supported_values(args: argparse.Namespace) -> None:
    """Flags Trident takes at one value only (``works_only`` in the schema's coverage table)."""
    for option, entry in COVERAGE.items():
        if entry.only and option in BY_OPTION:
            value = getattr(args, BY_OPTION[option].dest)
            _require(
                value in entry.only,
                f"{option} {value}: Trident supports only {' or '.join(map(str, entry.only))}, "
                f"because {entry.reason}",
            )


def _check_ranges(args: argparse.Namespace) -> None:
    """The parallel and decoder sizes by their configs' rules (the decoder's given; the others are derived
    later), then the rest."""
    _refuse_first(parallel_size_problems(args) + size_problems(args))
    for low, dests in _AT_LEAST.items():
        for dest in dests:
            value = getattr(args, dest)
            _require(value is None or value >= low, f"{_flag(dest)} must be >= {low}, got {value}")
    for dest in _FRACTIONS:
        value = getattr(args, dest)
        _require(value is None or 0 <= value < 1, f"{_flag(dest)} must be in [0, 1), got {value}")
    _require(args.adam_eps > 0, f"--adam-eps must be > 0, got {args.adam_eps}")


def _check_model(args: argparse.Namespace, tp: int) -> None:
    """Megatron's derived sizes, the decoder config's rules, and the switches only flags have."""
    _derive_ffn(args)
    if args.sequence_parallel and tp == 1:
        _rank0_note(
            "--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it "
            "(as Megatron does)"
        )
        args.sequence_parallel = False
    _refuse_first(decoder_problems(_as_config(args), seq_length=args.seq_length))
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    _require(
        not (args.swiglu and args.openai_gelu),
        "--openai-gelu and --swiglu exclude each other: SwiGLU's gate uses SiLU, not GELU",
    )
    _require(
        args.add_position_embedding or args.position_embedding_type != "learned_absolute",
        "--no-position-embedding needs --position-embedding-type rope (as in Megatron, where it is "
        "deprecated); for a model with no position information at all use --position-embedding-type none",
    )
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.seq_length <= args.max_position_embeddings,
            f"--seq-length ({args.seq_length}) must be <= --max-position-embeddings "
            f"({args.max_position_embeddings}) with --position-embedding-type learned_absolute",
        )


def _derive_ffn(args: argparse.Namespace) -> None:
    """Megatron's default FFN size: 4h, or with SwiGLU 2/3 of it (the same parameters) rounded down to 64."""
    if args.ffn_hidden_size is None:
        hidden = args.hidden_size
        args.ffn_hidden_size = int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden
        _require(
            args.ffn_hidden_size > 0,
            f"--swiglu with --hidden-size {hidden} gives an FFN size of 0 "
            "(int(8*hidden/3/64)*64); give --ffn-hidden-size",
        )


def _check_moe(args: argparse.Namespace, world_size: int) -> None:
    """The MoE config's rules, with the world size and training's; ``moe_layer_freq`` parsed (Megatron's)."""
    _refuse_first(moe_problems(_as_config(args), world_size=world_size, training=True))
    experts = args.num_moe_experts is not None
    args.moe_layer_freq = parse_moe_layer_freq(args.moe_layer_pattern) if experts else 1


def _apply_old_recompute_flags(args: argparse.Namespace) -> None:
    """``--checkpoint-activations`` (Megatron's old full recompute) and ``--recompute-activations``
    (selective) set the recompute flags, which must then not be given too."""
    for dest, settings in (
        ("checkpoint_activations", ("full", "uniform", 1)),
        ("recompute_activations", ("selective", None, None)),
    ):
        if not getattr(args, dest):
            continue
        given = [
            d
            for d in ("recompute_granularity", "recompute_method", "recompute_num_layers")
            if getattr(args, d)
        ]
        _require(
            not given,
            f"{_flag(dest)} sets {_flag('recompute_granularity')} {settings[0]}: do not give "
            f"{', '.join(map(_flag, given))} with it",
        )
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers = settings


def _check_validation(args: argparse.Namespace) -> None:
    """Result validation's flags (training/faults/validation.py): the checks and the injector act only
    when results are validated, and an injection needs a check to inject into."""
    mode, rate = args.rerun_mode, args.error_injection_rate
    _require(rate >= 0, f"--error-injection-rate must be >= 0 (0: no injection), got {rate}")
    for dest in ("check_for_spiky_loss", "check_for_large_grads"):
        _require(
            not getattr(args, dest) or mode == "validate_results",
            f"{_flag(dest)} acts only with --rerun-mode validate_results (here: {mode})",
        )
    if rate:
        _require(
            mode == "validate_results",
            f"--error-injection-rate {rate} injects into validated results: it needs --rerun-mode "
            f"validate_results (here: {mode})",
        )
        checks = ("check_for_nan_in_loss_and_grad", "check_for_spiky_loss", "check_for_large_grads")
        _require(
            any(getattr(args, dest) for dest in checks),
            f"--error-injection-rate {rate} injects into a validated result, but no check is on: add "
            "--check-for-nan-in-loss-and-grad, --check-for-spiky-loss or --check-for-large-grads",
        )


def _check_cuda_graphs(args: argparse.Namespace) -> None:
    """``--enable-cuda-graph`` is Megatron's older ``--cuda-graph-impl local`` (the two together are refused).
    Where the run computes on CUDA, the graphs' own rules; elsewhere nothing is captured: the model is
    built without graphs and ``args.cuda_graphs_note`` is the run's one line saying so (with what a run
    on CUDA would refuse), so that nothing else changes."""
    _refuse_first(cuda_graph_problems(_as_config(args), local=False))
    if args.enable_cuda_graph:
        args.cuda_graph_impl, args.enable_cuda_graph = "local", False
    on_cuda = local_graph_problems(_as_config(args))
    if args.cuda_graph_impl != "none" and args.data_parallel_sharding_strategy == "optim_grads_params":
        on_cuda.append(_GRAPHS_UNDER_ZERO3)
    args.cuda_graphs_note = None
    if args.cuda_graph_impl == "none" or computes_on_cuda(args.distributed_backend):
        _refuse_first(on_cuda)
        return
    note = cuda_graphs_off_line(args.cuda_graph_impl, "cpu", "gloo")
    if on_cuda:
        note += f"; with CUDA it would refuse: {command_line_message(on_cuda[0])}"
    args.cuda_graphs_note, args.cuda_graph_impl = note, "none"


_GRAPHS_UNDER_ZERO3 = problem(
    "{cuda_graph_impl} local does not work with {data_parallel_sharding_strategy} optim_grads_params: a layer's "
    "parameters are freed after each use and gathered into new memory, and a graph reads the addresses it "
    "captured",
    "cuda_graph_impl",
    "data_parallel_sharding_strategy",
)


def _check_profile(args: argparse.Namespace) -> None:
    """``--profile``'s steps in order, its ranks in the run."""
    if args.profile:
        start, end = args.profile_step_start, args.profile_step_end
        _require(start < end, f"--profile-step-start ({start}) must be < --profile-step-end ({end})")
        outside = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
        _require(
            not outside, f"--profile-ranks {outside} are not ranks of this run (world size {args.world_size})"
        )


def derive_args(args: argparse.Namespace, world_size: int | None = None) -> dict[str, Any]:
    """Check the flags together; the values they imply, by name. One ``ValueError`` naming flags and numbers.

    Call it before creating any process group with ``world_size`` (default ``$WORLD_SIZE`` or 1).
    Derives ``world_size``, ``data_parallel_size``, ``num_microbatches``,
    ``virtual_pipeline_model_parallel_size``, ``params_dtype`` and ``pipeline_dtype``, and the flags
    whose default depends on others (``global_batch_size``, ``kv_channels``, ``ffn_hidden_size``,
    ``save_interval``, ``split``, ``train_iters`` of a sample-based run, ...). ``args`` is not changed.
    """
    import torch

    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    flags = _Resolving(args)  # reads see derived values first; writes go to flags.derived
    _check_required(flags)
    _check_supported_values(flags)
    _check_ranges(flags)
    tp, pp, cp = (
        flags.tensor_model_parallel_size,
        flags.pipeline_model_parallel_size,
        flags.context_parallel_size,
    )
    _require(
        world_size % (tp * pp * cp) == 0,
        f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
        f"--pipeline-model-parallel-size ({pp})"
        + (f" x --context-parallel-size ({cp})" if cp > 1 else "")
        + f" = {tp * pp * cp}",
    )
    flags.world_size, flags.data_parallel_size = world_size, world_size // (tp * pp * cp)
    _apply_old_recompute_flags(flags)
    _check_model(flags, tp)
    _refuse_first(context_parallel_problems(_as_config(flags), seq_length=flags.seq_length))
    _check_moe(flags, world_size)
    problems = fp8_problems(flags)  # the config's own rules, already worded with the flags
    _require(not problems, "; ".join(problems))
    derive_virtual_pipeline(flags, pp)
    derive_batch_sizes(flags, pp, flags.data_parallel_size)
    _require(flags.min_lr <= flags.lr, f"--min-lr ({flags.min_lr}) must be <= --lr ({flags.lr})")
    _require(
        not (flags.override_opt_param_scheduler and flags.use_checkpoint_opt_param_scheduler),
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive: "
        "give at most one",
    )
    check_schedule(flags)
    _check_cuda_graphs(flags)
    check_run_batches(flags, pp, flags.data_parallel_size)
    if flags.save_interval is None:
        flags.save_interval = flags.train_iters  # --save-interval defaults to the run's length
    _require(
        not flags.async_save or flags.save,
        "--async-save writes the --save checkpoints in the background, but no --save directory is given",
    )
    check_data_flags(flags)
    _check_profile(flags)
    _check_validation(flags)
    derive_precision_and_data_parallel(flags)
    flags.params_dtype = torch.bfloat16 if flags.bf16 else torch.float16 if flags.fp16 else torch.float32
    flags.pipeline_dtype = flags.params_dtype
    return flags.derived


def megatron_namespace(args: argparse.Namespace, derived: dict[str, Any]) -> argparse.Namespace:
    """Megatron's view of a validated run: a copy of ``args`` with the derived values set on it.

    This is what ``get_args()`` returns to user code (model and dataset providers); Trident's own
    code reads the typed objects of :class:`training.run.Run` instead.
    """
    namespace = copy.copy(args)
    vars(namespace).update(derived)
    return namespace


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Megatron's ``validate_args``: :func:`derive_args`, returned as a new namespace (``args`` unchanged)."""
    return megatron_namespace(args, derive_args(args, world_size))

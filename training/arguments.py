"""Command-line arguments with Megatron-LM's flag names, plus one validation pass before any process group.

``parse_args`` reads ``--config FILE`` (YAML or TOML; keys are flag names with dashes or underscores)
and then the command line, which overrides the file. ``validate_args(args, world_size)`` (in
:mod:`training.argument_checks`) checks the flags together and fills the derived values.

Flags have Megatron's dests, defaults and meaning (``FLAGS``), except where the tiny default model
(``TINY_GPT``) fills in a value that was not given: with no flags at all, ``pretrain_gpt.py`` trains a
4-layer, 128-wide GPT for 100 iterations on CPU. ``args.using_default_model`` and
``args.using_default_data`` record whether the model-size and data flags came from that table.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass
from typing import Any

from core.model_parallel_config import PIPELINE_SCHEDULES

__all__ = ["FLAGS", "TINY_GPT", "load_config", "parse_args", "transformer_config_from_args"]

TOKENIZER_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "NullTokenizer")


@dataclass(frozen=True)
class Flag:
    """One command-line flag: names (the first is canonical), kind, Megatron's default and help.

    ``kind`` is ``int``, ``float``, ``str``, ``"true"`` (store_true) or ``"false"`` (store_false).
    """

    names: str | tuple[str, ...]
    kind: Any
    default: Any
    help: str
    dest: str | None = None
    choices: tuple | None = None
    nargs: str | None = None

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.names,) if isinstance(self.names, str) else self.names

    @property
    def key(self) -> str:
        return self.dest or self.flags[0].lstrip("-").replace("-", "_")


F = Flag
FLAGS: tuple[Flag, ...] = (
    # --- parallelism
    F("--tensor-model-parallel-size", int, 1, "Ranks each layer's weights are split over (TP)."),
    F("--pipeline-model-parallel-size", int, 1, "Pipeline stages per model replica (PP)."),
    F("--num-layers-per-virtual-pipeline-stage", int, None, "Decoder layers per virtual pipeline stage."),
    F("--num-virtual-stages-per-pipeline-rank", int, None, "Virtual stages (model chunks) per rank."),
    F("--pipeline-model-parallel-layout", str, None, "Layout string, e.g. 'Et*3|(tt|)*29,m|L'."),
    F(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        int,
        None,
        "Contiguous microbatches per virtual stage (default: PP size).",
        dest="microbatch_group_size_per_vp_stage",
    ),
    F("--pipeline-schedule", str, "1f1b", "Trident: non-interleaved schedule.", choices=PIPELINE_SCHEDULES),
    F("--sequence-parallel", "true", False, "Shard activations along the sequence over the TP group."),
    F("--overlap-grad-reduce", "true", False, "Overlap the data-parallel gradient all-reduce with backward."),
    F(
        "--use-distributed-optimizer",
        "true",
        False,
        "Shard optimizer state over data-parallel ranks (ZeRO-1).",
    ),
    F(
        "--overlap-param-gather",
        "true",
        False,
        "Distributed optimizer: overlap the parameter all-gather with the next forward.",
    ),
    F("--ddp-bucket-size", int, None, "Elements per gradient bucket (default max(40M, 1M x DP))."),
    F("--grad-reduce-in-bf16", "true", False, "Accumulate and reduce gradients in bf16 (with --bf16)."),
    F(
        "--accumulate-allreduce-grads-in-fp32",
        "true",
        False,
        "Accumulate and reduce gradients in fp32 (always so with --bf16 unless --grad-reduce-in-bf16).",
    ),
    # --- model
    F("--num-layers", int, None, "Decoder layers."),
    F("--hidden-size", int, None, "Hidden size."),
    F("--ffn-hidden-size", int, None, "MLP hidden size (4*hidden, or int(8*hidden/3/64)*64 with --swiglu)."),
    F("--num-attention-heads", int, None, "Attention heads."),
    F("--group-query-attention", "true", False, "Use grouped-query attention."),
    F("--num-query-groups", int, 1, "Key/value head groups with --group-query-attention."),
    F("--kv-channels", int, None, "Per-head dimension (default hidden/heads)."),
    F("--seq-length", int, None, "Sequence length."),
    F("--max-position-embeddings", int, None, "Positions of the learned position embedding (default seq)."),
    F(
        "--position-embedding-type",
        str,
        "learned_absolute",
        "Position embedding.",
        choices=("learned_absolute", "rope", "none"),
    ),
    F("--normalization", str, "LayerNorm", "Normalization layer.", choices=("LayerNorm", "RMSNorm")),
    F("--swiglu", "true", False, "SwiGLU MLP (gated linear unit with SiLU)."),
    F("--untie-embeddings-and-output-weights", "true", False, "Separate input embedding and output head."),
    F("--disable-bias-linear", "false", True, "No biases in linear layers.", dest="add_bias_linear"),
    F("--make-vocab-size-divisible-by", int, 128, "Pad the vocabulary to a multiple of this (x TP)."),
    F("--init-method-std", float, 0.02, "Std of the normal weight initialisation."),
    F("--hidden-dropout", float, 0.1, "Dropout on hidden states."),
    F("--attention-dropout", float, 0.1, "Dropout on attention probabilities."),
    F("--bf16", "true", False, "Parameters and activations in bfloat16."),
    F("--fp16", "true", False, "Parameters and activations in float16, with loss scaling."),
    F("--loss-scale", float, None, "A constant loss scale; without it --fp16 scales dynamically."),
    F("--initial-loss-scale", float, 2.0**32, "Dynamic loss scaling: the starting scale."),
    F("--min-loss-scale", float, 1.0, "Dynamic loss scaling: the smallest scale."),
    F("--loss-scale-window", float, 1000, "Dynamic loss scaling: steps without overflow before it doubles."),
    F("--hysteresis", int, 2, "Dynamic loss scaling: overflows tolerated before it halves."),
    F("--attention-softmax-in-fp32", "true", False, "Attention masking and softmax in fp32 (16-bit runs)."),
    F("--recompute-granularity", str, None, "Activation recomputation.", choices=("full", "selective")),
    F("--recompute-method", str, None, "Which layers to recompute.", choices=("uniform", "block")),
    F("--recompute-num-layers", int, None, "Layers per recompute unit (uniform) or per stage (block)."),
    F("--calculate-per-token-loss", "true", False, "Normalise the loss by the step's token count."),
    # --- training and optimizer
    F("--micro-batch-size", int, None, "Samples per microbatch per data-parallel rank."),
    F("--global-batch-size", int, None, "Samples per step over all data-parallel ranks."),
    F("--train-iters", int, None, "Training iterations."),
    F("--lr", float, None, "Peak learning rate."),
    F("--min-lr", float, 0.0, "Learning rate floor."),
    F("--lr-decay-style", str, "linear", "Decay after warm-up.", choices=("constant", "linear", "cosine")),
    F("--lr-warmup-iters", int, 0, "Linear warm-up iterations."),
    F("--lr-warmup-fraction", float, None, "Warm-up as a fraction of the decay iterations."),
    F("--lr-decay-iters", int, None, "Decay iterations (default --train-iters)."),
    F("--weight-decay", float, 0.01, "Weight decay."),
    F("--clip-grad", float, 1.0, "Clip the global gradient L2 norm to this (0: off)."),
    F("--adam-beta1", float, 0.9, "Adam beta1."),
    F("--adam-beta2", float, 0.999, "Adam beta2."),
    F("--adam-eps", float, 1e-08, "Adam epsilon."),
    F("--seed", int, 1234, "Random seed (python, numpy, torch)."),
    F(
        ("--check-for-nan-in-loss-and-grad",),
        "true",
        False,
        "Raise on a NaN/inf loss or gradient (Megatron's behaviour); by default Trident counts and skips the step.",
    ),
    F(
        ("--no-check-for-nan-in-loss-and-grad",),
        "false",
        False,
        "Skip NaN/inf steps instead of raising (default).",
        dest="check_for_nan_in_loss_and_grad",
    ),
    F("--max-consecutive-skipped-iterations", int, 10, "Trident: abort after this many skipped steps."),
    F("--exit-interval", int, None, "Exit after an iteration divisible by this."),
    F("--exit-signal-handler", "true", False, "On SIGTERM, save a checkpoint and exit."),
    # --- checkpointing
    F("--save", str, None, "Checkpoint directory to save to."),
    F("--load", str, None, "Checkpoint directory to load from."),
    F(("--save-interval", "--persistent-save-interval"), int, None, "Iterations between checkpoints."),
    F("--no-load-optim", "true", None, "Do not load optimizer and scheduler state."),
    F("--no-load-rng", "true", None, "Do not load RNG states."),
    F("--finetune", "true", False, "Load weights only and start at iteration 0."),
    # --- evaluation and logging
    F("--eval-interval", int, 1000, "Iterations between evaluations."),
    F("--eval-iters", int, 100, "Iterations per evaluation."),
    F("--log-interval", int, 100, "Iterations between log lines."),
    F("--log-throughput", "true", False, "Accepted for Megatron scripts: Trident always logs TFLOP/s."),
    F("--peak-tflops", float, None, "Trident: peak TFLOP/s per device for MFU (default: known GPUs)."),
    F("--log-params-norm", "true", False, "Log the parameters' global L2 norm."),
    F("--log-num-zeros-in-grad", "true", False, "Log the number of zero gradient elements."),
    F("--log-memory-to-tensorboard", "true", False, "Write the mem-* keys to W&B every iteration."),
    F("--wandb-project", str, "", "W&B project ('' = no W&B)."),
    F("--wandb-exp-name", str, "", "W&B run name."),
    F("--wandb-save-dir", str, "", "W&B local directory."),
    # --- data and tokenizer
    F("--data-path", str, None, "Prefixes, or 'weight prefix weight prefix ...'.", nargs="*"),
    F("--split", str, None, "Train,valid,test weights, e.g. 969,30,1 (default with --data-path: 969,30,1)."),
    F("--eod-mask-loss", "true", False, "Mask the loss on end-of-document tokens."),
    F("--tokenizer-type", str, None, "Tokenizer.", choices=TOKENIZER_TYPES),
    F("--tokenizer-model", str, None, "SentencePiece model file (default: the project's own)."),
    F("--vocab-size", int, None, "Vocabulary size for NullTokenizer."),
    F("--config", str, None, "Trident: YAML or TOML file of flags; the command line overrides it."),
)
del F

TINY_GPT: dict[str, Any] = {
    # The default run: what a flag not given on the command line or in --config is set to.
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "seq_length": 128,
    "micro_batch_size": 4,
    "train_iters": 100,
    "lr": 1e-3,
    "lr_decay_style": "cosine",
    "lr_warmup_iters": 10,
    "log_interval": 10,
    "eval_interval": 50,
    "eval_iters": 5,
    "tokenizer_type": "GPTSentencePieceTokenizer",
    "seed": 1234,
}
SAME_AS: dict[str, str] = {"max_position_embeddings": "seq_length", "save_interval": "train_iters"}
"""Flags that default to another flag's final value."""
MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
)

_BY_DEST: dict[str, Flag] = {}
_BY_NAME: dict[str, Flag] = {}
for _f in FLAGS:
    _BY_DEST.setdefault(_f.key, _f)
    for _n in _f.flags:
        _BY_NAME[_n.lstrip("-")] = _f


def flag_name(dest: str) -> str:
    """The canonical flag (e.g. ``--num-layers``) of the dest ``dest``."""
    return _BY_DEST[dest].flags[0]


def build_parser() -> argparse.ArgumentParser:
    """The parser; absent flags stay absent from its namespace so that "given" is visible."""
    parser = argparse.ArgumentParser(description="Trident (Megatron-style) GPT training", allow_abbrev=False)
    for f in FLAGS:
        default = TINY_GPT.get(
            f.key, f"same as {flag_name(SAME_AS[f.key])}" if f.key in SAME_AS else f.default
        )
        kw: dict[str, Any] = {"dest": f.key, "default": argparse.SUPPRESS, "help": f"{f.help} [{default}]"}
        if f.kind in ("true", "false"):
            kw["action"] = "store_true" if f.kind == "true" else "store_false"
        else:
            kw.update(type=f.kind, choices=f.choices, nargs=f.nargs)
        parser.add_argument(*f.flags, **kw)
    return parser


def _convert(f: Flag, name: str, value: Any, where: str) -> Any:
    """A config-file value as the flag's dest would hold it after the same flag on the command line."""
    bad = ValueError(
        f"{where}: key '{name}' ({f.flags[0]}) expects {getattr(f.kind, '__name__', 'a bool')}"
        + (" list" if f.nargs else "")
        + f", got {value!r}"
    )
    if f.kind in ("true", "false"):
        if not isinstance(value, bool):
            raise bad
        return value if (f.kind == "true" or name.replace("-", "_") == f.key) else not value
    if f.nargs:
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, (str, int, float)) for v in items):
            raise bad
        return [str(v) for v in items]
    if isinstance(value, bool) or (f.kind is int and isinstance(value, float)):
        raise bad
    try:
        value = f.kind(value)
    except (TypeError, ValueError):
        raise bad from None
    if f.choices and value not in f.choices:
        raise ValueError(f"{where}: key '{name}' must be one of {list(f.choices)}, got {value!r}")
    return value


def load_config(path: str) -> dict[str, Any]:
    """Flag values (by dest) from a YAML or TOML file; one level of tables/sections is flattened."""
    where = f"config file {path}"
    try:
        with open(path, "rb") as fh:
            text = fh.read()
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror})") from None
    if path.endswith(".toml"):
        import tomllib  # Python >= 3.11

        try:
            raw = tomllib.loads(text.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{where}: cannot parse it as TOML: {err}") from None
    else:
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{where}: cannot parse it as YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(  # noqa: TRY004 -- a bad file is a bad value, like every other config error
            f"{where}: expected a mapping of flag names to values, got {type(raw).__name__}"
        )
    items: list[tuple[str, Any]] = []
    for key, value in raw.items():
        if isinstance(value, dict):  # a [section] grouping flags
            items += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            items.append((str(key), value))
    values: dict[str, Any] = {}
    for shown, value in items:
        name = shown.rsplit(".", 1)[-1].strip().lstrip("-").replace("_", "-")
        f = _BY_NAME.get(name) or _BY_DEST.get(name.replace("-", "_"))
        if f is None or f.key == "config":
            close = difflib.get_close_matches(name, _BY_NAME, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"{where}: unknown key '{shown}'{hint}; keys are flag names such as "
                f"'tensor-model-parallel-size' or 'tensor_model_parallel_size'"
            )
        if value is not None:
            values[f.key] = _convert(f, name, value, where)
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron-named flags from ``--config`` and the command line (which wins), defaults filled in."""
    cli = vars(build_parser().parse_args(argv))
    given = load_config(cli["config"]) if cli.get("config") else {}
    given.update(cli)
    values = {f.key: f.default for f in FLAGS}
    values.update({k: v for k, v in TINY_GPT.items() if k not in given})
    if "lr_warmup_fraction" in given and "lr_warmup_iters" not in given:
        values["lr_warmup_iters"] = 0  # the tiny default must not clash with a given fraction
    values.update(given)
    for dest, source in SAME_AS.items():
        if dest not in given:
            values[dest] = values[source]
    args = argparse.Namespace(**values)
    args.using_default_model = not any(k in given for k in MODEL_FLAGS)
    args.using_default_data = "data_path" not in given
    args.explicit_args = sorted(given)
    return args


def transformer_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``TransformerConfig`` (Megatron's field names) from validated args.

    Sequence length and position count are ``GPTModel`` arguments, not config fields: pass
    ``args.max_position_embeddings`` as its ``max_sequence_length``.
    """
    import torch.nn.functional as F

    if not hasattr(args, "data_parallel_size"):
        raise ValueError("call validate_args(args, world_size) first")
    keys = (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "sequence_parallel",
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "kv_channels",
        "normalization",
        "add_bias_linear",
        "hidden_dropout",
        "attention_dropout",
        "init_method_std",
        "attention_softmax_in_fp32",
        "bf16",
        "params_dtype",
        "pipeline_dtype",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "pipeline_model_parallel_layout",
        "calculate_per_token_loss",
        "microbatch_group_size_per_vp_stage",
        "pipeline_schedule",
        "position_embedding_type",
        "untie_embeddings_and_output_weights",
        "make_vocab_size_divisible_by",
        "seed",
    )
    config = {key: getattr(args, key) for key in keys}
    config["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    config["gated_linear_unit"] = args.swiglu
    config["activation_func"] = F.silu if args.swiglu else F.gelu
    return config

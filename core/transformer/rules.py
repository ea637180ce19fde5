"""What a decoder's config refuses, stated once for ``TransformerConfig`` and the command line.

Sizes against tensor parallelism and each other, RoPE, recomputation and the loss fusion. The config
reports these problems with its field names, ``training.arguments.checks`` with Megatron's flags.
Where the command line has long worded a rule its own way (scripts and tests match that line), the
problem carries that wording beside the API's, over the same fields and values.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from core.problems import Problem, problem

RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
RECOMPUTE_GRANULARITIES = get_args(RecomputeGranularity)
RECOMPUTE_METHODS = get_args(RecomputeMethod)

_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")


def size_problems(config: Any) -> list[Problem]:
    """The sizes below 1: nothing else can be checked against them. A size still None is derived
    from the others later (the command line checks its flags before deriving them)."""
    return [
        problem(f"{{{name}}} must be >= 1, got {{value}}", name, value=value)
        for name in _SIZES
        if (value := getattr(config, name)) is not None and value < 1
    ]


def decoder_problems(config: Any, *, seq_length: int | None = None) -> list[Problem]:
    """The invalid settings of a decoder ``config`` whose sizes are all >= 1, first first.

    With ``seq_length`` (a ``GPTModel`` argument, not a field), also its cut under sequence parallelism.
    """
    out = _head_problems(config)
    if config.position_embedding_type == "rope":
        out += _rope_problems(config)
    elif config.rope_scaling:
        out.append(
            problem(
                "{rope_scaling} needs {position_embedding_type} 'rope', got {kind!r}",
                "rope_scaling",
                "position_embedding_type",
                kind=config.position_embedding_type,
            )
        )
    out += _range_problems(config) + _sequence_problems(config, seq_length)
    if config.cross_entropy_fusion_impl == "linear" and not config.cross_entropy_loss_fusion:
        out.append(
            problem(
                "{cross_entropy_fusion_impl} linear needs {cross_entropy_loss_fusion} (it says how that "
                "fusion is done)",
                "cross_entropy_fusion_impl",
                "cross_entropy_loss_fusion",
            )
        )
    return out + recompute_problems(config)


def _head_problems(config: Any) -> list[Problem]:
    tp, heads, groups = config.tensor_model_parallel_size, config.num_attention_heads, config.num_query_groups
    tp_name = "tensor_model_parallel_size"
    out = [
        problem(f"{{{a}}} ({{x}}) must be divisible by {{{b}}} ({{y}})", a, b, x=x, y=y)
        for a, x, b, y in (
            ("num_attention_heads", heads, tp_name, tp),
            ("num_attention_heads", heads, "num_query_groups", groups),
            ("num_query_groups", groups, tp_name, tp),
        )
        if x % y
    ]
    kv = config.kv_channels
    if kv is None and config.hidden_size % heads:
        out.append(
            problem(
                "{hidden_size} ({hidden}) must be divisible by {num_attention_heads} ({heads}) when "
                "{kv_channels} is not set",
                "hidden_size",
                "num_attention_heads",
                "kv_channels",
                command_line="{hidden_size} ({hidden}) must be divisible by {num_attention_heads} ({heads}) "
                "unless {kv_channels} is given",
                hidden=config.hidden_size,
                heads=heads,
            )
        )
    if kv is not None and kv < 1:
        out.append(problem("{kv_channels} must be >= 1, got {kv}", "kv_channels", kv=kv))
    if config.ffn_hidden_size % tp:
        out.append(
            problem(
                "{ffn_hidden_size} ({ffn}) must be divisible by {tensor_model_parallel_size} ({tp})",
                "ffn_hidden_size",
                tp_name,
                ffn=config.ffn_hidden_size,
                tp=tp,
            )
        )
    return out


def _rope_problems(config: Any) -> list[Problem]:
    head = (
        config.kv_channels
        if config.kv_channels is not None
        else config.hidden_size // config.num_attention_heads
    )
    percent, base = config.rotary_percent, config.rotary_base
    if not 0.0 < percent <= 1.0:
        return [
            problem("{rotary_percent} must be in (0, 1], got {percent}", "rotary_percent", percent=percent)
        ]
    if base <= 0:
        return [problem("{rotary_base} must be > 0, got {base}", "rotary_base", base=base)]
    factor = config.rope_scaling_factor
    if config.rope_scaling and factor < 1.0:
        return [
            problem("{rope_scaling_factor} must be >= 1, got {factor}", "rope_scaling_factor", factor=factor)
        ]
    rotary_dim = int(head * percent)
    if rotary_dim < 2 or rotary_dim % 2:
        return [
            problem(
                "{rotary_percent} ({percent}) x {kv_channels} ({head}) gives {dim} rotary channels; "
                "RoPE needs an even number >= 2",
                "rotary_percent",
                "kv_channels",
                percent=percent,
                head=head,
                dim=rotary_dim,
            )
        ]
    return []


def _range_problems(config: Any) -> list[Problem]:
    out = [
        problem(f"{{{name}}} must be in [0, 1), got {{value}}", name, value=value)
        for name in ("attention_dropout", "hidden_dropout")
        if not 0.0 <= (value := getattr(config, name)) < 1.0
    ]
    multiple, epsilon = config.make_vocab_size_divisible_by, config.layernorm_epsilon
    if multiple < 1:
        out.append(
            problem(
                "{make_vocab_size_divisible_by} must be >= 1, got {value}",
                "make_vocab_size_divisible_by",
                value=multiple,
            )
        )
    if epsilon <= 0:
        out.append(
            problem("{layernorm_epsilon} must be > 0, got {value}", "layernorm_epsilon", value=epsilon)
        )
    return out


def _sequence_problems(config: Any, seq: int | None) -> list[Problem]:
    tp = config.tensor_model_parallel_size
    if seq is None or not config.sequence_parallel or seq % tp == 0:
        return []
    return [
        problem(
            "{seq_length} ({seq}) must be divisible by {tensor_model_parallel_size} ({tp}) with "
            "{sequence_parallel}",
            "seq_length",
            "tensor_model_parallel_size",
            "sequence_parallel",
            seq=seq,
            tp=tp,
        )
    ]


_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers")
_FULL_NEEDS = (
    "{recompute_granularity} full needs {recompute_method} (uniform or block) and {recompute_num_layers}"
)


def recompute_problems(config: Any) -> list[Problem]:
    """Selective recomputation takes no method or layer count; full needs both; none takes neither."""
    granularity, method, count = (getattr(config, name) for name in _RECOMPUTE)
    values = {"granularity": granularity, "method": method, "count": count}
    if granularity is None:
        if method is None and count is None:
            return []
        return [
            problem(
                "{recompute_method} ({method!r}) and {recompute_num_layers} ({count}) need "
                "{recompute_granularity}='full'",
                *_RECOMPUTE,
                command_line="{recompute_method} and {recompute_num_layers} need "
                "{recompute_granularity} full",
                **values,
            )
        ]
    if granularity == "selective":
        if method is None and count is None:
            return []
        return [
            problem(
                "{recompute_granularity}='selective' takes no {recompute_method} ({method!r}) or "
                "{recompute_num_layers} ({count})",
                *_RECOMPUTE,
                command_line="{recompute_granularity} selective takes neither {recompute_method} nor "
                "{recompute_num_layers}",
                **values,
            )
        ]
    if granularity != "full":
        return [
            problem(
                "{recompute_granularity} must be one of {choices} or None, got {granularity!r}",
                *_RECOMPUTE,
                choices=RECOMPUTE_GRANULARITIES,
                **values,
            )
        ]
    if method not in RECOMPUTE_METHODS:
        return [
            problem(
                "{recompute_granularity}='full' needs {recompute_method} 'uniform' or 'block', "
                "got {method!r}",
                *_RECOMPUTE,
                command_line=_FULL_NEEDS,
                **values,
            )
        ]
    if count is None or count < 1:
        return [
            problem(
                "{recompute_granularity}='full' needs {recompute_num_layers} >= 1, got {count}",
                *_RECOMPUTE,
                command_line=_FULL_NEEDS,
                **values,
            )
        ]
    return []

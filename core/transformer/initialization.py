"""Parameter initialisation that depends only on (seed, parameter name), never on the split.

Each parameter carries an ``init_rule`` attribute set by the layer that creates it ("normal",
"scaled_normal", "zeros" or "ones"). :func:`initialize_by_name` builds the FULL tensor on the CPU
in fp32 from a generator seeded with ``(config.seed, crc32(name))`` and copies this rank's
``shard_of`` it. The same seed therefore gives the same full weights under any TP/PP/VPP split
(a weight's name, with its global layer number, is the same in every split), and a TP shard is
exactly the slice of that full weight, which is what makes split-vs-single-device tests and
resharding checkpoints exact. Two optional attributes refine the rule:

* ``init_name``: draw from another name's generator, so a tied output layer on the last pipeline
  stage starts identical to the first stage's word embedding;
* ``init_valid_rows``: only the first rows are real (a padded vocabulary); they are drawn with the
  unpadded shape and the padding rows are zero, so the real rows do not depend on how much padding
  the TP size requires.

A rank's MoE experts are stacked: one 3-D parameter per projection (``experts.linear_fc1.weight``
``[local experts, out, in]``), marked by :func:`mark_stacked` with the global index of its first
slice. Each slice is still a tensor of its own name, the one the per-expert layout had
(``experts.local_experts.{global index}.linear_fc1.weight``, :func:`unstacked`): it is initialised
from that name's generator, so an expert starts the same at every expert-parallel size, and
checkpoints store it under that name.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    param_is_tensor_parallel,
    shard_of,
    tp_rank,
    tp_world_size,
)
from core.transformer.transformer_config import TransformerConfig

INIT_RULES = ("normal", "scaled_normal", "zeros", "ones")
STACKED_EXPERTS = "local_experts"
"""The name part under which a stacked parameter's slices are named, each by its global index."""


def deferred_init(weight: torch.Tensor) -> None:
    """Placeholder ``init_method`` for tensor-parallel layers: the model initialises by name afterwards."""


def mark_init(
    param: nn.Parameter | None, rule: str, *, name: str | None = None, valid_rows: int | None = None
) -> None:
    """Record how ``param`` is initialised (a no-op for a missing optional parameter such as a bias)."""
    if param is None:
        return
    if rule not in INIT_RULES:
        raise ValueError(f"init rule must be one of {INIT_RULES}, got {rule!r}")
    param.init_rule = rule
    if name is not None:
        param.init_name = name
    if valid_rows is not None:
        param.init_valid_rows = valid_rows


def mark_stacked(param: nn.Parameter | None, first: int) -> None:
    """Record that ``param`` stacks experts ``first, first + 1, ...`` along its first dimension."""
    if param is not None:
        param.stacked_first = first


def unstacked(
    name: str, param: torch.Tensor, value: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The logical tensors parameter ``name`` holds, as ``(name, tensor)``: itself, or for a stacked
    parameter ``...experts.linear_fc1.weight`` each slice ``i`` as
    ``...experts.local_experts.{first + i}.linear_fc1.weight``. ``value``: a tensor shaped like
    ``param`` (its gradient, say) to cut instead; slices are views."""
    value = param if value is None else value
    first = getattr(param, "stacked_first", None)
    if first is None:
        return [(name, value)]
    parts = name.split(".")
    owner, leaf = parts[:-2], parts[-2:]
    return [
        (".".join([*owner, STACKED_EXPERTS, str(first + i), *leaf]), piece)
        for i, piece in enumerate(value.unbind(0))
    ]


def logical_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`unstacked` over ``named`` (``module.named_parameters()``): every tensor under its own name."""
    for name, param in named:
        yield from unstacked(name, param)


def linear_pair(
    config: TransformerConfig,
    column_size: int,
    row_size: int,
    *,
    column_bias: bool,
    column_stride: int = 1,
    tp_group: ProcessGroup | None = None,
) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    """The ``Column -> Row`` projections of an attention or MLP block (one all-reduce each way):
    ``hidden -> column_size`` split by output features, ``row_size -> hidden`` by input features, over
    ``tp_group`` (None: ``parallel_state``'s, Megatron's default).

    Both are initialised later by name (weights "normal" and "scaled_normal", biases zero); the row
    layer's bias is ``config.add_bias_linear``.
    """
    deferred = {
        "config": config,
        "init_method": deferred_init,
        "perform_initialization": False,
        "tp_group": tp_group,
    }
    column = ColumnParallelLinear(
        config.hidden_size,
        column_size,
        bias=column_bias,
        gather_output=False,
        stride=column_stride,
        **deferred,
    )
    row = RowParallelLinear(
        row_size, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True, **deferred
    )
    mark_init(column.weight, "normal")
    mark_init(column.bias, "zeros")
    mark_init(row.weight, "scaled_normal")
    mark_init(row.bias, "zeros")
    return column, row


def name_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator that owns parameter ``name`` for ``seed``."""
    return torch.Generator().manual_seed((seed * 2**32 + zlib.crc32(name.encode())) % 2**63)


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the whole tensor a (possibly TP-sharded) parameter is a piece of."""
    shape = list(param.shape)
    if param_is_tensor_parallel(param):
        shape[param.partition_dim % param.dim()] *= tp_size
    return tuple(shape)


def full_init_tensor(
    name: str,
    param: torch.Tensor,
    config: TransformerConfig,
    tp_size: int,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The full fp32 CPU tensor parameter ``name`` starts from (identical in every split); ``shape``:
    a slice's of a stacked parameter (``param`` still says the rule)."""
    rule = getattr(param, "init_rule", None)
    if rule is None:
        raise ValueError(f"parameter {name!r} has no init_rule; its layer must call mark_init")
    shape = full_shape(param, tp_size) if shape is None else shape
    if rule == "zeros":
        return torch.zeros(shape)
    if rule == "ones":
        return torch.ones(shape)
    std = config.init_method_std
    if rule == "scaled_normal":
        std /= math.sqrt(2.0 * config.num_layers)
    rows = getattr(param, "init_valid_rows", shape[0])
    full = torch.zeros(shape)
    generator = name_generator(config.seed, getattr(param, "init_name", name))
    full[:rows].normal_(0.0, std, generator=generator)
    return full


@torch.no_grad()
def initialize_by_name(
    module: nn.Module, config: TransformerConfig, tp_group: ProcessGroup | None = None
) -> None:
    """Fill every parameter of ``module`` with its shard of the full tensor its name determines
    (this rank's shard in ``tp_group``; None: ``parallel_state``'s).

    Call it on the root of the naming scheme (the GPTModel), so that names are the global ones. A
    parameter on the meta device (``init_model_with_meta_device``) has no memory yet: it gets a
    :class:`DeferredInit` instead (``param.deferred_init``), which whoever gives it memory calls.
    """
    rank, size = tp_rank(tp_group), tp_world_size(tp_group)
    for name, param in module.named_parameters():
        if param.is_meta:
            param.deferred_init = DeferredInit(name, config, rank, size)
        else:
            fill_by_name(name, param, param, config, rank, size)


@torch.no_grad()
def fill_by_name(
    name: str, param: torch.Tensor, out: torch.Tensor, config: TransformerConfig, rank: int, size: int
) -> None:
    """Write parameter ``name``'s initial values (TP rank ``rank`` of ``size``) into ``out``, a tensor of
    ``param``'s shape: the parameter itself, or the memory a meta parameter is given."""
    if getattr(param, "stacked_first", None) is not None:  # slice by slice, each from its own name
        for slice_name, piece in unstacked(name, param, out):
            piece.copy_(full_init_tensor(slice_name, param, config, 1, tuple(piece.shape)))
        return
    full = full_init_tensor(name, param, config, size)
    out.copy_(shard_of(full, param, rank, size).to(device=out.device, dtype=out.dtype))


@dataclass(frozen=True)
class DeferredInit:
    """The initialisation a parameter built on the meta device is owed: called with the parameter and
    the memory it is given (``out``, its shape, any device), it writes exactly the values
    :func:`initialize_by_name` would have written at construction (they depend only on the seed and
    the name). The data-parallel wrapper calls it as it lays each bucket out, so a rank never holds
    more than the bucket it is building (:mod:`core.distributed.grad_buffer`)."""

    name: str
    config: TransformerConfig
    tp_rank: int
    tp_size: int

    def __call__(self, param: torch.Tensor, out: torch.Tensor) -> None:
        fill_by_name(self.name, param, out, self.config, self.tp_rank, self.tp_size)

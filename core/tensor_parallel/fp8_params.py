"""Weights held in FP8 (``--fp8-param-gather``): no 16-bit copy, and the parameter all-gather moves one
byte an element.

Under the distributed optimizer each data-parallel rank steps fp32 main copies of its shard of every
parameter, then the updated shards are all-gathered into the model's parameter buffers. With
``fp8_param_gather`` the weight of every dense FP8 linear layer is held in E4M3 with one float32 scale
(:class:`Fp8Weight`), and the step ends differently:

1. the optimizer steps its fp32 shards as usual;
2. :func:`cast_held_weights`: each held weight's amax is the maximum over the ranks holding its pieces
   (one all-reduce of a few floats over the layer's amax group, TP x DP x CP, whose ranks all hold the
   same layers), so every rank scales with the whole weight's amax; each rank casts its own shard into
   the weight's buffer;
3. the buffers are all-gathered as bytes: half of bf16's traffic. (Under ZeRO-3 the persistent shard
   is FP8 and each layer gathers its bytes before it runs.)

The layer's forward multiplies the held weight with its scale as it is (:meth:`Fp8State.weight_fp8`);
its weight gradient goes straight into ``main_grad`` (autograd never holds a gradient of an FP8 tensor).

Under the blockwise recipe a weight is held in 128 x 128 tiles, one scale each (``Fp8Weight.tiled``): the
values and scales :func:`~core.tensor_parallel.fp8_blockwise.quantize_tiles` gives. A tile lies within one
tensor-parallel shard, so each tile's amax is reduced over the ranks holding the same shard (DP x CP, or
the expert-data-parallel group), from each rank's part of the tile: a data-parallel shard is a flat range,
which may start and end inside a row, and so inside a tile.

The weight is scaled from its own current amax under every recipe; the delayed recipe's histories keep
ruling the inputs and output gradients. (Transformer Engine scales a delayed FP8 weight from its history;
the current amax costs one small all-reduce a step and casts every value that fits.)

The optimizer's fp32 main copies start from the values the weights had before they were cast
(:attr:`Fp8Weight.high_precision`, Megatron's "preserve the high-precision init value"), and a checkpoint
stores those main values in the model's dtype (:func:`high_precision_weights`): resuming, resharding and
exporting read the master weights, never the FP8 ones.

Routed MoE experts (FP8 on the loop path, not under ``--moe-grouped-gemm``) are stacked, one
``[experts, out, in]`` parameter per projection: held in E4M3 with one scale per expert (slice), each
from that expert's amax reduced over the ranks holding its replicas (the expert-data-parallel group,
where the experts' delayed amaxes are reduced too: experts are never tensor-parallel here). A layer runs
expert ``j`` on slice ``j`` with its own scale (:func:`held_slices`); the slices' weight gradients go
into slice ``j`` of the stack's ``main_grad``, the first of a step zeroing the whole stack, and the stack
reports its gradient once (a stack no token reached in a step is zeroed with the bucket's unwritten
gradients). A checkpoint stores each expert's master values under its own name, as for 16-bit experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from core.device import current_device
from core.tensor_parallel.fp8 import (
    E4M3,
    FP8_MAX,
    Fp8State,
    _cast,
    amax_of,
    held_weight,
    quantize,
)
from core.tensor_parallel.fp8_blockwise import (
    BLOCK,
    BlockCast,
    cast_in_tiles,
    dequantize_blocks,
    saturated_cast,
    scale_from_amax,
    tile_amaxes,
)

__all__ = [
    "Fp8Weight",
    "cast_held_weights",
    "dequantized",
    "held_fp8_weights",
    "held_slices",
    "held_weight",
    "hold_weights_in_fp8",
    "is_stack",
]


@dataclass(eq=False)
class Fp8Weight:
    """What a weight held in FP8 carries beside its E4M3 values (``param.fp8_weight``)."""

    scale_inv: torch.Tensor
    """The float32 scalar its values are multiplied by to dequantise (the same on every rank); for a
    stacked expert weight ``[experts, out, in]``, one per expert (``[experts]``). Held in tiles
    (``tiled``), one per 128 x 128 tile: ``[out / 128, in / 128]``, or ``[experts, out / 128, in / 128]``."""
    dtype: torch.dtype
    """The model's dtype, which the weight had before: checkpoints store the master values in it."""
    amax_group: ProcessGroup | None
    """Where its amax is reduced: every rank of the group holds the same layers (held in tiles: the same
    tensor-parallel shard of them, as a tile lies within one)."""
    high_precision: torch.Tensor | None = None
    """The values it was cast from (at construction, or by a load), until the optimizer takes them as
    its main copy."""
    casts: int = 0
    """How many times its values were written (a layer's cached transposed copy is of one cast)."""
    tiled: bool = False
    """Held in 128 x 128 tiles, each with its own scale (``--fp8-recipe blockwise``), else one scale per
    weight (or expert)."""


def _reduced_max(amaxes: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    return amaxes


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return scale_from_amax(amax, FP8_MAX[E4M3])


def _holdable(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter, ProcessGroup | None, bool]]:
    """Every weight :func:`hold_weights_in_fp8` holds, with its name, amax group and whether it is held in
    tiles: each dense FP8 linear layer's (TP x DP x CP; in tiles, DP x CP) and each FP8 routed-expert
    stack's (the experts' group: expert data parallel)."""
    held = []
    for module in modules:
        for name, child in module.named_modules():
            state, weight = getattr(child, "fp8_state", None), getattr(child, "weight", None)
            if weight is None or held_weight(weight) is not None:
                continue
            if isinstance(state, Fp8State) and not state.expert:
                tiled = state.recipe.blockwise  # a tile lies within one TP shard: no TP peer shares it
                group = state.amax_group if state.amax_group is not None or tiled else state.tp_group
            elif isinstance(state, nn.ModuleDict) and len(state) == weight.shape[0]:  # stacked experts
                first = next(iter(state.values()))
                group, tiled = first.amax_group, first.recipe.blockwise
            else:
                continue
            name = f"{name}.weight" if name else "weight"
            if tiled and (weight.shape[-2] % BLOCK or weight.shape[-1] % BLOCK):
                raise ValueError(
                    f"cannot hold {name} {tuple(weight.shape)} in FP8 in whole {BLOCK}x{BLOCK} tiles"
                )
            held.append((name, weight, group, tiled))
    return held


def is_stack(param: torch.Tensor) -> bool:
    """A routed-expert stack ``[experts, out, in]`` (one scale, or one grid of tiles, per expert), not a
    dense weight ``[out, in]``."""
    return param.dim() == 3


def _matrix(values: torch.Tensor) -> torch.Tensor:
    """The matrix a weight's tiles cover: ``[out, in]``; a stack's ``[experts * out, in]`` (``out`` is a
    multiple of 128, so no tile spans two experts)."""
    return values.reshape(-1, values.shape[-1])


def _scale_shape(shape: torch.Size, tiled: bool) -> tuple[int, ...]:
    """:attr:`Fp8Weight.scale_inv`'s shape for a weight of ``shape``."""
    if tiled:
        return (*shape[:-2], shape[-2] // BLOCK, shape[-1] // BLOCK)
    return (shape[0],) if len(shape) == 3 else ()


def _amax(values: torch.Tensor, tiled: bool) -> torch.Tensor:
    """The amax of each scale's values, flat: a dense weight's (``[1]``), each expert's, or each tile's."""
    values = values.detach()
    if tiled:
        return tile_amaxes(_matrix(values)).reshape(-1)
    if is_stack(values):
        return torch.linalg.vector_norm(values.flatten(1), float("inf"), dim=1).float()
    return amax_of(values).reshape(1)


def _quantized(values: torch.Tensor, scale: torch.Tensor, tiled: bool) -> torch.Tensor:
    """``values`` in E4M3 with ``scale`` in its :func:`_scale_shape`: one, one per expert, or one per tile."""
    if tiled:
        scales = scale.reshape(-1, values.shape[-1] // BLOCK)
        return cast_in_tiles(_matrix(values), scales, E4M3).view(values.shape)
    if scale.dim() == 0:
        return quantize(values, scale, E4M3)
    flat = values.detach().reshape(scale.numel(), -1)
    return _cast(flat, scale.view(-1, 1), E4M3, False)[0].view(values.shape)


def hold_weights_in_fp8(modules: Iterable[nn.Module]) -> list[str]:
    """Hold the weight of every dense FP8 linear layer, and every FP8 routed-expert stack, of ``modules``
    in E4M3 (see the module docstring); returns their names. Call after
    :func:`~core.tensor_parallel.fp8.set_amax_group` and before the data-parallel wrapper lays the
    parameters out (it then gives them a one-byte buffer of their own)."""
    held = _holdable(modules)
    for _, param, group, tiled in held:  # every held weight's metadata first: its cast below reads it
        scale_inv = torch.ones(_scale_shape(param.shape, tiled), device=current_device())
        param.fp8_weight = Fp8Weight(scale_inv, param.dtype, group, tiled=tiled)
        if param.is_meta:  # --init-model-with-meta-device: cast when the buffer gives it memory
            param.deferred_init = _CastAfter(param.deferred_init)
            param.data = torch.empty(param.shape, dtype=E4M3, device="meta")
    for group, members in _by_group((p, g) for _, p, g, _ in held if not p.is_meta):
        metas = [held_weight(p) for p in members]
        amaxes = [_amax(p, meta.tiled) for p, meta in zip(members, metas)]
        reduced = _reduced_max(torch.cat(amaxes), group).split([a.numel() for a in amaxes])
        for param, meta, amax in zip(members, metas, reduced):
            scale = _scale(amax.view_as(meta.scale_inv))
            high = param.detach().clone()
            param.data = _quantized(high, scale, meta.tiled)
            meta.scale_inv, meta.high_precision = scale.reciprocal(), high
    return [name for name, *_ in held]


@dataclass(frozen=True)
class _CastAfter:
    """The deferred initialisation of a weight held in FP8 and built on the meta device: its values in the
    model's dtype, then cast as :func:`hold_weights_in_fp8` casts them (the amax reduced over the amax
    group, one all-reduce per weight, in the order every rank of the group lays its buckets out)."""

    values: Callable[[nn.Parameter, torch.Tensor], None]
    """The weight's own deferred initialisation (in the model's dtype)."""

    @torch.no_grad()
    def __call__(self, param: nn.Parameter, out: torch.Tensor) -> None:
        meta = held_weight(param)
        high = torch.empty(param.shape, dtype=meta.dtype, device=out.device)
        self.values(param, high)
        amax = _reduced_max(_amax(high, meta.tiled), meta.amax_group)
        scale = _scale(amax.view_as(meta.scale_inv))
        out.copy_(_quantized(high, scale, meta.tiled))
        meta.scale_inv.copy_(scale.reciprocal())
        meta.high_precision = high


def _by_group(pairs: Iterable[tuple[nn.Parameter, ProcessGroup | None]]) -> Iterator[tuple]:
    """``(group, [params])`` in first-seen order: one collective per group, the same order on every rank."""
    groups: dict[int, tuple[ProcessGroup | None, list[nn.Parameter]]] = {}
    for param, group in pairs:
        groups.setdefault(id(group), (group, []))[1].append(param)
    yield from groups.values()


def _spans(param: nn.Parameter, start: int, count: int) -> list[tuple[int | None, int, int]]:
    """The pieces of the flat range ``[start, start + count)`` of ``param`` that share a scale, as
    ``(expert or None, lo, hi)`` positions in the range: the whole range, or one per expert it meets."""
    if not is_stack(param):
        return [(None, 0, count)]
    size = math.prod(param.shape[1:])  # (shape only: a ZeRO-3 parameter between uses has no values)
    first, last = start // size, (start + count - 1) // size
    return [
        (j, max(start, j * size) - start, min(start + count, (j + 1) * size) - start)
        for j in range(first, last + 1)
    ]


@dataclass(frozen=True)
class _RangeRows:
    """A flat range of a weight's :func:`_matrix` ``[rows, cols]`` as the whole rows it meets, zero-padded:
    the tiles of a shard that starts or ends inside a row."""

    blocks: torch.Tensor
    """float32 ``[rows met, cols / 128, 128]``."""
    tile_rows: torch.Tensor
    """The tile row of each row met."""
    lead: int
    """Where the range starts in the first row."""

    @classmethod
    def of(cls, flat: torch.Tensor, start: int, cols: int) -> _RangeRows:
        # Built for the amaxes and again for the cast: kept across the all-reduce, every held weight's
        # float32 copy of its range would be alive at once.
        first, lead = divmod(start, cols)
        rows = -(-(lead + flat.numel()) // cols)
        padded = torch.zeros(rows * cols, dtype=torch.float32, device=flat.device)
        padded[lead : lead + flat.numel()] = flat
        tile_rows = torch.arange(first, first + rows, device=flat.device) // BLOCK
        return cls(padded.view(rows, cols // BLOCK, BLOCK), tile_rows, lead)

    def tile_amaxes(self, tiles: torch.Tensor) -> torch.Tensor:
        """``tiles`` (zeros ``[tile rows, cols / 128]``) holding the amax of the range's part of each tile."""
        amaxes = self.blocks.abs().amax(dim=-1)
        return tiles.scatter_reduce_(0, self.tile_rows.unsqueeze(1).expand_as(amaxes), amaxes, "amax")

    def cast(self, scales: torch.Tensor, count: int) -> torch.Tensor:
        """The range's ``count`` values in E4M3, each times its tile's scale (``scales`` as the tiles)."""
        values = saturated_cast(self.blocks, scales[self.tile_rows].unsqueeze(-1), E4M3)
        return values.view(-1)[self.lead : self.lead + count]


def _shard_amaxes(param: nn.Parameter, start: int | None, main: torch.Tensor | None) -> torch.Tensor:
    """The amax of each scale's part of this rank's fp32 range (0 where it has none), flat: one, one per
    expert of a stack, or one per tile."""
    meta = held_weight(param)
    out = torch.zeros(meta.scale_inv.numel(), device=meta.scale_inv.device)
    if main is None or not main.numel():
        return out
    if meta.tiled:
        cols = param.shape[-1]
        _RangeRows.of(main, start, cols).tile_amaxes(out.view(-1, cols // BLOCK))
        return out
    for expert, lo, hi in _spans(param, start, main.numel()):
        out[expert or 0] = amax_of(main[lo:hi])
    return out


@torch.no_grad()
def cast_held_weights(pieces: Sequence[tuple]) -> None:
    """Cast every held weight from the fp32 values this rank steps for it: ``pieces`` lists each held
    weight of the rank's model chunks, in the same order on every rank, with ``(start, main, model)``:
    where the range this rank owns starts in the weight, its fp32 values and the same range of the
    weight's E4M3 values (None, None, None when it owns none). Collective over each weight's amax group.
    The caller then all-gathers the buffers."""
    ranges = {id(p): (start, main, model) for p, start, main, model in pieces}
    for group, members in _by_group((p, held_weight(p).amax_group) for p, *_ in pieces):
        amaxes = [_shard_amaxes(p, *ranges[id(p)][:2]) for p in members]
        reduced = _reduced_max(torch.cat(amaxes), group).split([a.numel() for a in amaxes])
        for param, amax in zip(members, reduced):
            start, main, model = ranges[id(param)]
            meta = held_weight(param)
            scale = _scale(amax.view_as(meta.scale_inv))
            if main is not None and main.numel():
                _cast_range(param, start, main, model, scale)
            meta.scale_inv.copy_(scale.reciprocal())
            meta.casts += 1


def _cast_range(param: nn.Parameter, start: int, main: torch.Tensor, model: torch.Tensor, scale) -> None:
    """Write this rank's range of a held weight (``model``, E4M3) from its fp32 values ``main``."""
    if held_weight(param).tiled:
        cols = param.shape[-1]
        model.copy_(_RangeRows.of(main, start, cols).cast(scale.view(-1, cols // BLOCK), main.numel()))
        return
    for expert, lo, hi in _spans(param, start, main.numel()):
        piece = scale if expert is None else scale[expert]
        model[lo:hi].copy_(quantize(main[lo:hi].reshape(1, -1), piece, E4M3).view(-1))


def dequantized(param: nn.Parameter) -> torch.Tensor:
    """A held weight's values in the model's dtype (what the forward multiplies with)."""
    meta = held_weight(param)
    if meta.tiled:
        cols = param.shape[-1]
        blocks = BlockCast(_matrix(param.detach()), meta.scale_inv.reshape(-1, cols // BLOCK), tiled=True)
        return dequantize_blocks(blocks).view(param.shape).to(meta.dtype)
    scale_inv = meta.scale_inv.view(-1, *[1] * (param.dim() - 1)) if is_stack(param) else meta.scale_inv
    return (param.detach().float() * scale_inv).to(meta.dtype)


class _HeldSlices(torch.autograd.Function):
    """A held expert stack's slices, as views; its backward runs once the slices' weight gradients are
    in the stack's ``main_grad`` (the layers put them there), and reports the stack's gradient once."""

    @staticmethod
    def forward(ctx, stack):
        ctx.set_materialize_grads(False)
        ctx.stack = stack  # not saved for backward: a ZeRO-3 gather may write the values in between
        return tuple(stack.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        stack = ctx.stack
        report = getattr(stack, "grad_accumulated", None)
        if report is not None:
            report(stack)
            stack.grad_added_to_main_grad = True
        # (nothing returned: an FP8 tensor gets no gradient of its own)


def _slice_claim(stack: nn.Parameter, index: int):
    """Slice ``index``'s ``claim_main_grad``: the stack's claim; its first write of a step zeroes the
    whole stack's ``main_grad`` (an expert no token reaches gets a zero gradient), so every slice adds."""

    def claim(piece: torch.Tensor) -> bool:
        parent = getattr(stack, "claim_main_grad", None)
        if parent is not None and parent(stack):
            stack.main_grad.zero_()
        piece.main_grad = stack.main_grad[index]  # ZeRO-2/3 give the bucket its memory in the claim
        return False

    return claim


def _report_nothing(piece: torch.Tensor) -> None:
    """A slice's ``grad_accumulated``: the stack reports once, when all its slices are in."""


def held_slices(stack: nn.Parameter) -> tuple[torch.Tensor, ...]:
    """Expert ``j``'s weight of a held stack, for each ``j``: slice ``j`` in E4M3 with its own scale
    (``fp8_weight``), whose weight gradient goes into slice ``j`` of the stack's ``main_grad``."""
    meta = held_weight(stack)
    pieces = _HeldSlices.apply(stack)
    for j, piece in enumerate(pieces):
        piece.fp8_weight = replace(meta, scale_inv=meta.scale_inv[j], high_precision=None)
        if hasattr(stack, "main_grad"):
            piece.main_grad = stack.main_grad  # its slice once claimed (ZeRO-2/3 have no memory before)
            piece.claim_main_grad = _slice_claim(stack, j)
            piece.grad_accumulated = _report_nothing
    return pieces


def held_fp8_weights(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Every weight of ``modules`` held in FP8, with its name, in module order."""
    out = []
    for module in modules:
        module = getattr(module, "module", module)
        for name, param in module.named_parameters():
            if held_weight(param) is not None:
                out.append((name, param))
    return out

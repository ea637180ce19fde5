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

The weight is scaled from its own current amax under both recipes; the delayed recipe's histories keep
ruling the inputs and output gradients. (Transformer Engine scales a delayed FP8 weight from its history;
the current amax costs one small all-reduce a step and casts every value that fits.)

The optimizer's fp32 main copies start from the values the weights had before they were cast
(:attr:`Fp8Weight.high_precision`, Megatron's "preserve the high-precision init value"), and a checkpoint
stores those main values in the model's dtype (:func:`high_precision_weights`): resuming, resharding and
exporting read the master weights, never the FP8 ones. Routed MoE experts keep 16-bit weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from core.device import current_device
from core.tensor_parallel.fp8 import E4M3, FP8_MAX, Fp8State, _scale_from_amax, amax_of, held_weight, quantize

__all__ = [
    "Fp8Weight",
    "cast_held_weights",
    "dequantized",
    "held_fp8_weights",
    "held_weight",
    "hold_weights_in_fp8",
]


@dataclass(eq=False)
class Fp8Weight:
    """What a weight held in FP8 carries beside its E4M3 values (``param.fp8_weight``)."""

    scale_inv: torch.Tensor
    """The float32 scalar its values are multiplied by to dequantise (the same on every rank)."""
    dtype: torch.dtype
    """The model's dtype, which the weight had before: checkpoints store the master values in it."""
    amax_group: ProcessGroup | None
    """Where its amax is reduced: every rank of the group holds the same layers."""
    high_precision: torch.Tensor | None = None
    """The values it was cast from (at construction, or by a load), until the optimizer takes them as
    its main copy."""
    casts: int = 0
    """How many times its values were written (a layer's cached transposed copy is of one cast)."""


def _reduced_max(amaxes: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    return amaxes


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return _scale_from_amax(amax, FP8_MAX[E4M3], 0)


def hold_weights_in_fp8(modules: Iterable[nn.Module]) -> list[str]:
    """Hold the weight of every dense FP8 linear layer of ``modules`` in E4M3 (see the module docstring);
    returns their names. Call after :func:`~core.tensor_parallel.fp8.set_amax_group` and before the
    data-parallel wrapper lays the parameters out (it then gives them a one-byte buffer of their own)."""
    held: list[tuple[str, nn.Parameter, ProcessGroup | None]] = []
    for module in modules:
        for name, child in module.named_modules():
            state = getattr(child, "fp8_state", None)  # routed experts: a dict of states, kept 16-bit
            if not isinstance(state, Fp8State) or state.expert or held_weight(child.weight) is not None:
                continue
            group = state.amax_group if state.amax_group is not None else state.tp_group
            held.append((f"{name}.weight" if name else "weight", child.weight, group))
    on_meta = [(p, g) for _, p, g in held if p.is_meta]  # init_model_with_meta_device: cast when given memory
    for param, group in on_meta:
        param.fp8_weight = Fp8Weight(torch.ones((), device=current_device()), param.dtype, group)
        param.deferred_init = _CastAfter(param.deferred_init)
        param.data = torch.empty(param.shape, dtype=E4M3, device="meta")
    for group, members in _by_group((p, g) for _, p, g in held if not p.is_meta):
        amaxes = _reduced_max(torch.stack([amax_of(p) for p in members]), group)
        for param, amax in zip(members, amaxes):
            scale = _scale(amax)
            high = param.detach().clone()
            param.data = quantize(high, scale, E4M3)
            param.fp8_weight = Fp8Weight(scale.reciprocal(), high.dtype, group, high_precision=high)
    return [name for name, _, _ in held]


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
        scale = _scale(_reduced_max(amax_of(high).reshape(1), meta.amax_group)[0])
        out.copy_(quantize(high, scale, E4M3))
        meta.scale_inv.copy_(scale.reciprocal())
        meta.high_precision = high


def _by_group(pairs: Iterable[tuple[nn.Parameter, ProcessGroup | None]]) -> Iterator[tuple]:
    """``(group, [params])`` in first-seen order: one collective per group, the same order on every rank."""
    groups: dict[int, tuple[ProcessGroup | None, list[nn.Parameter]]] = {}
    for param, group in pairs:
        groups.setdefault(id(group), (group, []))[1].append(param)
    yield from groups.values()


@torch.no_grad()
def cast_held_weights(pieces: list[tuple[nn.Parameter, torch.Tensor | None, torch.Tensor | None]]) -> None:
    """Cast every held weight from the fp32 values this rank steps for it: ``pieces`` lists each held
    weight of the rank's model chunks, in the same order on every rank, with ``(main, model)``: the fp32
    range this rank owns and the same range of the weight's E4M3 values (None, None when it owns none).
    Collective over each weight's amax group. The caller then all-gathers the buffers."""
    ranges = {id(p): (main, model) for p, main, model in pieces}
    for group, members in _by_group((p, held_weight(p).amax_group) for p, _, _ in pieces):
        local = [ranges[id(p)][0] for p in members]
        zero = torch.zeros((), device=members[0].device)
        amaxes = torch.stack([amax_of(m) if m is not None and m.numel() else zero for m in local])
        amaxes = _reduced_max(amaxes, group)
        for param, amax in zip(members, amaxes):
            main, model = ranges[id(param)]
            scale = _scale(amax)
            if main is not None and main.numel():
                model.copy_(quantize(main.reshape(1, -1), scale, E4M3).view_as(model))
            meta = held_weight(param)
            meta.scale_inv.copy_(scale.reciprocal())
            meta.casts += 1


def dequantized(param: nn.Parameter) -> torch.Tensor:
    """A held weight's values in the model's dtype (what the forward multiplies with)."""
    meta = held_weight(param)
    return (param.detach().float() * meta.scale_inv).to(meta.dtype)


def held_fp8_weights(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Every weight of ``modules`` held in FP8, with its name, in module order."""
    out = []
    for module in modules:
        module = getattr(module, "module", module)
        for name, param in module.named_parameters():
            if held_weight(param) is not None:
                out.append((name, param))
    return out

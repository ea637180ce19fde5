"""The autograd-aware collectives that move activations into and out of tensor-parallel regions.

Each mapping is a pair of conjugate operations: whatever the forward does to activations, the
backward does its adjoint to gradients (identity <-> all-reduce, split <-> all-gather,
reduce-scatter <-> all-gather). Layers are built by composing them, so the communication of a
tensor-parallel model can be read off its forward pass.

Two layouts are involved. "Tensor-parallel" tensors are split along the last (hidden) dimension;
"sequence-parallel" tensors are split along the first (sequence) dimension of ``[s, b, h]``.
With one rank every mapping is the identity: nothing is communicated, and the public entry points add
no autograd node (at TP=1 each cost a Python call forward and another backward: 11-15% of a tiny
GPT's forward and backward on a CPU). Inputs are never modified in place: a reduction works on a
copy, so a caller (or autograd) may still hold the original.
"""

from __future__ import annotations

from collections.abc import Callable

import einops
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core import comm_time
from core.parallel_state import group_size
from core.tensor_parallel.utils import all_gather_single, reduce_scatter_single, resolve_tp_group


def _check_divisible(tensor: torch.Tensor, dim: int, world_size: int, layout: str) -> int:
    """Size of one rank's share of ``dim``, or a ValueError raised (on every rank alike) before any collective."""
    size = tensor.shape[dim]
    if size % world_size:
        raise ValueError(
            f"cannot split the {layout} dimension (dim {dim}, size {size}) of a tensor of shape "
            f"{tuple(tensor.shape)} evenly over tensor_model_parallel_size ({world_size})"
        )
    return size // world_size


# --------------------------------------------------------------------------------------------------
# Raw collectives (no autograd)
# --------------------------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    stamp = comm_time.start()
    dist.all_reduce(out, group=group)
    comm_time.stop("TP", stamp)
    return out


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, x.dim() - 1, world, "hidden (last)")
    return torch.chunk(x, world, dim=-1)[dist.get_rank(group)].contiguous()


def _split_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, 0, world, "sequence (first)")
    return torch.chunk(x, world, dim=0)[dist.get_rank(group)].contiguous()


def _gather_stacked(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x`` stacked in group-rank order."""
    x = x.contiguous()
    out = torch.empty((group_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    stamp = comm_time.start()
    all_gather_single(out, x, group=group)  # concatenated along dim 0: the form every backend takes
    comm_time.stop("TP", stamp)
    return out.view(group_size(group), *x.shape)


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return einops.rearrange(_gather_stacked(x, group), "r ... h -> ... (r h)")


def _gather_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return einops.rearrange(_gather_stacked(x, group), "r s ... -> (r s) ...")


def _reduce_scatter_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    shard = _check_divisible(x, 0, world, "sequence (first)")
    out = torch.empty((shard, *x.shape[1:]), dtype=x.dtype, device=x.device)
    stamp = comm_time.start()
    reduce_scatter_single(out, x.contiguous(), group=group)
    comm_time.stop("TP", stamp)
    return out


# --------------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------------


Collective = Callable[[torch.Tensor, ProcessGroup | None], torch.Tensor]


def conjugate_function(
    name: str, forward: Collective, backward: Collective, doc: str
) -> type[torch.autograd.Function]:
    """An autograd Function running ``forward(x, group)`` and, on the gradient, its adjoint ``backward``.

    One definition for every mapping that is a collective one way and its dual the other, so a new
    mapping is a (forward, backward) pair rather than another class; ``apply(x, group)`` as usual.
    """

    def forward_(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def backward_(ctx, grad):
        return backward(grad, ctx.group), None

    methods = {
        "__doc__": doc,
        "__module__": forward.__module__,
        "forward": staticmethod(forward_),
        "backward": staticmethod(backward_),
    }
    return type(name, (torch.autograd.Function,), methods)


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (each rank holds part of the input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce of partial sums. Backward: identity (every rank needs the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_ScatterToRegion = conjugate_function(
    "_ScatterToRegion",
    _split_last,
    _gather_last,
    "Forward: keep this rank's slice of the last dim. Backward: all-gather the slices' gradients.",
)
_GatherFromRegion = conjugate_function(
    "_GatherFromRegion",
    _gather_last,
    _split_last,
    "Forward: all-gather along the last dim. Backward: keep this rank's slice of the gradient.",
)
_ScatterToSequenceRegion = conjugate_function(
    "_ScatterToSequenceRegion",
    _split_first,
    _gather_first,
    "Forward: keep this rank's slice of the sequence. Backward: all-gather along the sequence.",
)
_ReduceScatterToSequenceRegion = conjugate_function(
    "_ReduceScatterToSequenceRegion",
    _reduce_scatter_first,
    _gather_first,
    "Forward: sum partial results and keep this rank's sequence slice. Backward: all-gather.",
)


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all-gather along the sequence.

    Backward: reduce-scatter when the consumer is tensor-parallel (each rank's gradient covers the
    whole sequence but only its own partial contribution), plain split when the gradient is
    already complete on every rank (``tensor_parallel_output_grad=False``).
    """

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


# --------------------------------------------------------------------------------------------------
# Public, Megatron-named entry points
# --------------------------------------------------------------------------------------------------


Mapping = Callable[..., torch.Tensor]
"""``mapping(input_, tp_group=None)``: Megatron's signature for the entry points below."""


def _tp_mapping(name: str, function: type[torch.autograd.Function], doc: str) -> Mapping:
    """The entry point ``name``: ``function`` applied to ``input_`` in the (resolved) TP group."""

    def mapping(input_: torch.Tensor, tp_group: ProcessGroup | None = None) -> torch.Tensor:
        group = resolve_tp_group(tp_group)
        if group_size(group) == 1:  # the identity both ways: no autograd node (its Python backward costs)
            return input_
        return function.apply(input_, group)

    mapping.__name__ = mapping.__qualname__ = name
    mapping.__doc__ = doc
    return mapping


copy_to_tensor_model_parallel_region = _tp_mapping(
    "copy_to_tensor_model_parallel_region",
    _CopyToRegion,
    "Enter a TP region with a replicated input: identity forward, all-reduce backward.",
)
reduce_from_tensor_model_parallel_region = _tp_mapping(
    "reduce_from_tensor_model_parallel_region",
    _ReduceFromRegion,
    "Leave a TP region by summing partial results: all-reduce forward, identity backward.",
)
scatter_to_tensor_model_parallel_region = _tp_mapping(
    "scatter_to_tensor_model_parallel_region",
    _ScatterToRegion,
    "Keep this rank's slice of the last dim forward; all-gather the gradient backward.",
)
gather_from_tensor_model_parallel_region = _tp_mapping(
    "gather_from_tensor_model_parallel_region",
    _GatherFromRegion,
    "All-gather along the last dim forward; keep this rank's slice of the gradient backward.",
)
scatter_to_sequence_parallel_region = _tp_mapping(
    "scatter_to_sequence_parallel_region",
    _ScatterToSequenceRegion,
    "Keep this rank's slice of the sequence (dim 0) forward; all-gather the gradient backward.",
)
reduce_scatter_to_sequence_parallel_region = _tp_mapping(
    "reduce_scatter_to_sequence_parallel_region",
    _ReduceScatterToSequenceRegion,
    "Sum partial results and keep this rank's sequence slice forward; all-gather the gradient backward.",
)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True, tp_group: ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along the sequence (dim 0) forward; reduce-scatter (or split) the gradient backward.

    Pass ``tensor_parallel_output_grad=False`` when the gathered tensor feeds replicated
    computation, whose gradient is already identical and complete on every rank.
    """
    return _GatherFromSequenceRegion.apply(input_, resolve_tp_group(tp_group), tensor_parallel_output_grad)

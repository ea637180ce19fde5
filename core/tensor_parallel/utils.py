"""Tensor-parallel bookkeeping: which group, which shard, and how a full tensor maps onto shards.

A sharded parameter carries Megatron's three attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``). They are the whole contract between a layer and the code
that builds, saves or reshards its weights: :func:`shard_of` cuts this rank's piece out of a full
tensor and :func:`gather_full` puts the pieces back together, so initialisation and checkpoints can
be written against full tensors and stay independent of the tensor-parallel size.
"""

from __future__ import annotations

import einops
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core import parallel_state
from core.parallel_state import group_rank, group_size

_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (>= 2.3) have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------------
# Groups and sizes
# --------------------------------------------------------------------------------------------------


def resolve_tp_group(tp_group: ProcessGroup | None = None) -> ProcessGroup | None:
    """The group to communicate over: ``tp_group`` if given, else parallel_state's TP group.

    Returns None in a process without torch.distributed, which every helper here treats as a
    tensor-parallel world of one (so a model can be built and run in a plain Python process).
    """
    if tp_group is not None:
        return tp_group
    if not dist.is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def tp_world_size(tp_group: ProcessGroup | None = None) -> int:
    """Number of ranks in the (resolved) tensor-parallel group."""
    group = resolve_tp_group(tp_group)
    return group_size(group)


def tp_rank(tp_group: ProcessGroup | None = None) -> int:
    """This process's position in the (resolved) tensor-parallel group."""
    group = resolve_tp_group(tp_group)
    return group_rank(group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a ValueError naming ``what`` and both sizes if it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_model_parallel_size ({denominator})"
        )
    return numerator // denominator


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[first, last)`` vocabulary ids owned by ``rank`` when the vocabulary is split evenly."""
    per_rank = divide(global_vocab_size, world_size, "vocabulary size")
    return rank * per_rank, (rank + 1) * per_rank


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Equal chunks of ``tensor`` along its last dimension (Megatron's helper, e.g. for fused QKV)."""
    divide(tensor.shape[-1], num_partitions, "last dimension")
    chunks = torch.chunk(tensor, num_partitions, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


# --------------------------------------------------------------------------------------------------
# Parameter attributes
# --------------------------------------------------------------------------------------------------


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1
) -> None:
    """Mark ``param`` as (not) split along ``dim`` so initialisers, optimizers and checkpoints know."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Give an unmarked parameter the "replicated on every TP rank" attributes."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the TP attributes (e.g. onto an fp32 main parameter made from a bf16 model parameter)."""
    for name in _TP_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` holds only this rank's shard of a larger tensor."""
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group: ProcessGroup | None = None) -> bool:
    """True for one copy of every parameter: all shards, but replicated ones only on TP rank 0.

    Lets gradient-norm and parameter-count code count each element once across the TP group.
    """
    return param_is_tensor_parallel(param) or tp_rank(tp_group) == 0


# --------------------------------------------------------------------------------------------------
# Full tensor <-> shard
# --------------------------------------------------------------------------------------------------


def _stride_pattern(param: torch.Tensor, full_dim_size: int, tp_size: int) -> tuple[int, int]:
    """(partition_dim, stride) of ``param``, after checking the full size splits into tp x stride pieces."""
    dim = param.partition_dim % param.dim()
    stride = getattr(param, "partition_stride", 1)
    if full_dim_size % (tp_size * stride):
        raise ValueError(
            f"dimension {dim} of the full tensor ({full_dim_size}) is not divisible by "
            f"tensor_model_parallel_size ({tp_size}) x partition_stride ({stride})"
        )
    return dim, stride


def shard_of(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The part of ``full`` that rank ``tp_rank`` of ``tp_size`` holds in a parameter shaped like ``param``.

    Follows Megatron's striding: the partition dimension is cut into ``tp_size * stride`` equal
    blocks and rank ``r`` holds blocks ``r, r + tp_size, ...`` concatenated (stride 1 is a plain
    equal split). A parameter that is not tensor-parallel gets the whole tensor.
    """
    if not param_is_tensor_parallel(param) or tp_size == 1:
        return full
    dim, stride = _stride_pattern(param, full.shape[param.partition_dim], tp_size)
    moved = full.movedim(dim, 0)
    blocks = einops.rearrange(moved, "(s r c) ... -> r (s c) ...", s=stride, r=tp_size)
    return blocks[tp_rank].movedim(0, dim).contiguous()


def gather_full(
    param: torch.Tensor, tp_group: ProcessGroup | None = None, *, tensor: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather a sharded parameter into the full tensor on every TP rank (inverse of :func:`shard_of`).

    ``tensor`` gathers something shaped like the shard instead of the parameter itself (its
    gradient, or an optimizer state). Replicated parameters come back as a detached copy.
    """
    local = (param if tensor is None else tensor).detach()
    group = resolve_tp_group(tp_group)
    tp_size = group_size(group)
    if not param_is_tensor_parallel(param) or tp_size == 1:
        return local.clone()
    dim = param.partition_dim % local.dim()
    stride = getattr(param, "partition_stride", 1)
    moved = local.movedim(dim, 0).contiguous()
    gathered = torch.empty(
        (tp_size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device
    )
    all_gather_single(gathered, moved, group=group)
    full = einops.rearrange(gathered, "(r s c) ... -> (s r c) ...", r=tp_size, s=stride)
    return full.movedim(0, dim).contiguous()

"""The global gradient norm of a model split over TP x PP x DP (x EP) ranks, and clipping by it.

The norm must be the single-device model's norm, so every weight is counted exactly once:

* a TP-sharded parameter (``tensor_model_parallel``) holds a distinct piece on each TP rank, all
  counted; a replicated one (biases of row-parallel layers, norms) is counted on TP rank 0 only;
* a tied word embedding held by the first and the last pipeline stage is counted on the first;
  the last stage's copy is marked ``shared`` (Megatron) or ``shared_embedding`` with PP > 1;
* gradients are already reduced over data parallelism, so a replica counts on data-parallel rank 0
  only; an MoE expert (``allreduce = False``, never TP-split) counts on the first rank of its
  expert-data-parallel group, whatever its tensor-parallel rank (expert parallelism puts other
  experts on the other TP ranks). With the distributed optimizer each rank counts its own shard
  of the reduced gradients instead;
* the squared sums are then added up over every rank (one all-reduce), which counts each weight
  once however the experts and the dense layers are laid out (Megatron reduces the dense part over
  TP x PP and the experts over expert TP x EP x PP; the sum is the same).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core.device import current_device
from core.parallel_state import ParallelGroups
from core.tensor_parallel.utils import param_is_tensor_parallel


def param_is_not_shared(param: torch.Tensor, groups: ParallelGroups | None = None) -> bool:
    """False for the second copy of a tied weight (the last stage's output layer with PP > 1).
    ``groups``: the model's process groups (None: one process)."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "shared_embedding", False) and groups is not None:
        pp_size = groups.size("pp")
        return not (pp_size > 1 and groups.rank_in("pp") == pp_size - 1)
    return True


def param_counts_for_norm(
    param: torch.Tensor, *, sharded: bool = False, groups: ParallelGroups | None = None
) -> bool:
    """Whether this rank counts ``param`` in global norms: not a tied copy, not a TP duplicate, not a
    data-parallel replica (``sharded``: the distributed optimizer, whose ranks hold disjoint shards).
    ``groups``: the model's process groups (None: one process, which counts everything)."""
    if not param_is_not_shared(param, groups):
        return False
    if groups is None:
        return True
    if not getattr(param, "allreduce", True):  # an MoE expert
        return sharded or groups.rank_in("expt_dp") == 0
    owned = param_is_tensor_parallel(param) or groups.rank_in("tp") == 0
    return owned and (sharded or groups.rank_in("dp_cp") == 0)


def grad_stats_group(groups: ParallelGroups | None = None) -> ProcessGroup | None:
    """The group norm statistics are summed over: every rank of the job, or None alone."""
    return dist.group.WORLD if groups is not None else None


def get_grad_norm_fp32(
    grads_for_norm: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    grad_stats_parallel_group: ProcessGroup | None = None,
) -> float:
    """The ``norm_type`` norm of all these gradients together, over every rank of the group, as a
    Python number (Megatron's API: one read from the device; :func:`get_grad_norm_tensor` keeps it there)."""
    return float(get_grad_norm_tensor(grads_for_norm, norm_type, grad_stats_parallel_group))


def get_grad_norm_tensor(
    grads_for_norm: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    grad_stats_parallel_group: ProcessGroup | None = None,
    *,
    offsets: Sequence[int] | None = None,
) -> torch.Tensor:
    """The global norm as a 0-dim float64 tensor on the gradients' device, never read by the host.

    Each rank passes only the gradients it counts (see :func:`param_counts_for_norm`). The L2 norm
    does not depend on how the model is split (see :func:`_sum_of_squares`); ``offsets`` says where
    each tensor starts in its flattened parameter (a data-parallel shard of it: the distributed
    optimizer; default 0, the whole parameter). Every rank of the group must call this (it is a
    collective), even one with no gradients. A NaN or Inf in any gradient makes the norm
    non-finite, which is how the optimizer finds a step to skip.
    """
    pairs = [
        (g.detach(), at)
        for g, at in zip(grads_for_norm, offsets if offsets is not None else itertools.repeat(0))
        if g is not None and g.numel()
    ]
    grads = [g for g, _ in pairs]
    group = grad_stats_parallel_group
    communicate = group is not None and dist.get_world_size(group) > 1
    device = grads[0].device if grads else current_device()
    total = torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        if grads:
            total = torch.stack(torch._foreach_norm(grads, math.inf)).max().double()
        if communicate:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    if norm_type == 2.0:
        total = _sum_of_squares(grads, [at for _, at in pairs], device)
    elif grads:
        norms = torch._foreach_norm([g.float() for g in grads], norm_type)
        total = torch.stack(norms).double().pow(norm_type).sum()
    if communicate:
        dist.all_reduce(total, group=group)
    return total.pow(1.0 / norm_type)


def _foreach_norm_takes_dtype() -> bool:
    try:  # the dtype argument arrived in torch 2.4; pyproject allows 2.3
        torch._foreach_norm([torch.zeros(1)], 2.0, dtype=torch.float64)
    except (TypeError, RuntimeError):
        return False
    return True


_FOREACH_NORM_DTYPE = _foreach_norm_takes_dtype()
NORM_BLOCK = 128
"""Elements a CPU norm sums in fp32 before the sums go on in float64, counted from each parameter's
first element (see :func:`_sum_of_squares_in_blocks`)."""
_CHUNK_ELSEWHERE = 1 << 24
"""Elements converted to float64 at a time on a GPU whose torch (< 2.4) cannot accumulate in float64
inside ``torch._foreach_norm``: a 128 MiB temporary at most."""


def _sum_of_squares(tensors: list[torch.Tensor], offsets: list[int], device: torch.device) -> torch.Tensor:
    """The sum of every element's square as a float64 tensor, the same however the elements are split.

    fp32 accumulation is off by ~1e-5 relative for a million elements (torch's CPU norm by 1e-3
    for GPT-2's embedding), and differently for a tensor and for its pieces. The sum must not
    depend on how the elements are cut (a whole parameter, or data-parallel shards of it: the
    distributed optimizer), so that the clipping factor and hence every step are the same either
    way. On a GPU ``torch._foreach_norm`` accumulates each tensor in float64 in one multi-tensor
    kernel, at the cost of an fp32 norm; a CPU sums fixed blocks in fp32 and the blocks in float64
    (:func:`_sum_of_squares_in_blocks`), as fast, where converting to float64 cost 3.5x that.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    if device.type == "cpu":
        return _sum_of_squares_in_blocks(tensors, offsets)
    if _FOREACH_NORM_DTYPE:
        return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64)).square().sum()
    return _sum_of_squares_in_pieces(tensors, device, _CHUNK_ELSEWHERE)


def _sum_of_squares_in_blocks(tensors: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
    """The sum on a CPU: each block of ``NORM_BLOCK`` elements at a multiple of ``NORM_BLOCK`` in its
    parameter summed in fp32, the blocks' sums and the partial blocks at a tensor's ends in float64.

    A block's fp32 sum is the same wherever it is computed, so a parameter and its data-parallel
    shards agree except for a block a shard boundary cuts (summed exactly in float64 on each side):
    a difference of an fp32 rounding of 128 elements' share of the total, ~1e-13 relative at GPT-2
    small, and the order of the float64 additions. Accuracy: at most a block's fp32 error (~1e-7),
    2e-9 relative for a million Gaussian elements and 3e-11 at GPT-2 small, where fp32 throughout is
    off by 2e-5 and 1e-3. A NaN or Inf gradient gives a non-finite norm, as does a block of fp32
    squares that overflows: an element above ~1e18, which a diverged model reaches when its loss has
    long been Inf (reading the sum on the host to redo it in float64 would make every step wait).
    Elements below ~1e-19 count as zero.
    """
    blocks, edges = _blocks_and_edges(tensors, offsets)
    norms = [torch.linalg.vector_norm(b.view(-1, NORM_BLOCK), dim=1) for b in blocks]
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    if norms:
        total = torch.cat(norms).double().square().sum()
    if edges:
        edge = torch.cat(edges).double()
        total = total + torch.dot(edge, edge)
    return total


_JOINED = 1 << 15
"""Whole blocks of a tensor smaller than this are joined with other small tensors' into one copy (in
cache) and normed by one call: a model's many biases and norms then cost one call, not one each."""


def _blocks_and_edges(
    tensors: list[torch.Tensor], offsets: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors' runs of whole blocks (1-D, multiples of ``NORM_BLOCK`` long; small ones joined) and
    the partial blocks at their ends, for :func:`_sum_of_squares_in_blocks`."""
    blocks, small, edges = [], [], []
    for tensor, offset in zip(tensors, offsets):
        flat = tensor.reshape(-1)
        head = min(-offset % NORM_BLOCK, flat.numel())
        whole = (flat.numel() - head) // NORM_BLOCK * NORM_BLOCK
        if whole:
            (small if whole < _JOINED else blocks).append(flat[head : head + whole])
        edges += [e for e in (flat[:head], flat[head + whole :]) if e.numel()]
    if small:
        blocks.append(torch.cat(small))
    return blocks, edges


def _sum_of_squares_in_pieces(tensors: list[torch.Tensor], device: torch.device, chunk: int) -> torch.Tensor:
    """The sum accumulated in float64, converting ``chunk`` elements to float64 at a time."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    pieces = [t.reshape(-1)[i : i + chunk] for t in tensors for i in range(0, t.numel(), chunk)]
    batch: list[torch.Tensor] = []  # small pieces are joined: one conversion for many
    size = 0
    for piece in [*pieces, None]:
        if batch and (piece is None or size + piece.numel() > chunk):
            joined = (torch.cat(batch) if len(batch) > 1 else batch[0]).double()
            total += torch.dot(joined, joined)
            batch, size = [], 0
        if piece is not None:
            batch.append(piece)
            size += piece.numel()
    return total


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Megatron's factor ``min(max_norm / (total_norm + 1e-6), 1)`` as a float64 device tensor."""
    return (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0)


def clip_grad_by_total_norm_fp32(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: float | torch.Tensor
) -> float | torch.Tensor:
    """Scale ``grads`` in place so that their global norm is at most ``max_norm``; return the factor.

    Megatron's rule: ``coeff = max_norm / (total_norm + 1e-6)``, applied only when below 1. With a
    tensor ``total_norm`` the factor stays on the device (a multiply by 1 when nothing is clipped).
    Every rank clips all its gradients, duplicates included, with the same global norm.
    """
    grads = [g for g in grads if g is not None]
    if isinstance(total_norm, torch.Tensor):
        coeff = clip_coefficient(max_norm, total_norm)
        if grads:
            torch._foreach_mul_(grads, coeff.to(grads[0].dtype))
        return coeff
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)
    return min(coeff, 1.0)


def count_zeros_fp32(
    grads_for_norm: Iterable[torch.Tensor], grad_stats_parallel_group: ProcessGroup | None = None
) -> int:
    """How many gradient elements are exactly zero across the model (each weight counted once)."""
    return int(count_zeros_tensor(grads_for_norm, grad_stats_parallel_group))


def count_zeros_tensor(
    grads_for_norm: Iterable[torch.Tensor], grad_stats_parallel_group: ProcessGroup | None = None
) -> torch.Tensor:
    """:func:`count_zeros_fp32` as a 0-dim float64 device tensor (read it when logging)."""
    grads = [g for g in grads_for_norm if g is not None]
    zeros = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else current_device())
    for g in grads:
        zeros += g.numel() - torch.count_nonzero(g)
    group = grad_stats_parallel_group
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(zeros, group=group)
    return zeros

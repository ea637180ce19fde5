"""The end-of-step gradient reductions every parallel layout needs (Megatron's ``finalize_model_grads``).

1. Data parallel: chunks wrapped in a data-parallel module finish their (possibly overlapped)
   bucket reductions; plain chunks get their gradients all-reduced over the DP group here (an MoE
   expert's over the expert-data-parallel group, still divided by the DP size).
   Every step below works on ``param.main_grad`` (the wrapper's buffer) when a parameter has one,
   else on ``param.grad``.
2. Sequence parallel: norm weights see only this rank's sequence shard, so their gradients are
   summed over the tensor-parallel group (parameters marked ``sequence_parallel``).
3. Tied embeddings: the first stage's word embedding and the last stage's output weight are one
   weight held twice; their gradients are summed over the embedding group so both copies take the
   same step (parameters marked ``shared_embedding``).
4. Per-token loss: the step's token count lives on the stage that computes the loss (the last
   rank, or rank 0 under ZBV's V placement) and is 0 elsewhere; its maximum over the pipeline is
   summed over the data-parallel ranks, and every gradient is divided by it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.parallel_state import ParallelGroups


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """Where ``param``'s gradient lives: this rank's reduced shard of it under ZeRO-2/3 (identically cut
    on every rank of a tensor-parallel or embedding group), else the buffer view ``main_grad`` if it
    has one, else ``.grad``."""
    shard = getattr(param, "main_grad_shard", None)
    if shard is not None:
        return shard
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _grads(
    chunks: Iterable[torch.nn.Module], attribute: str | None = None, *, expert: bool | None = None
) -> list[torch.Tensor]:
    """Gradients of the chunks' parameters (marked ``attribute``; only experts' or only others')."""
    grads = []
    for chunk in chunks:
        for p in chunk.parameters():
            g = _grad_of(p)
            if g is None or (attribute is not None and not getattr(p, attribute, False)):
                continue
            if expert is None or expert == (not getattr(p, "allreduce", True)):
                grads.append(g)
    return grads


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` with one flat all-reduce (empty ones, a ZeRO-2/3 rank's share of a
    parameter it owns none of, are left out: every rank of the group holds the same sizes)."""
    grads = [g for g in grads if g.numel()]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_model_grads(
    model_chunks: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    *,
    groups: ParallelGroups | None = None,
) -> None:
    """Reduce gradients across DP, TP (sequence-parallel norms) and the embedding group; scale by tokens.

    ``groups``: the process groups to reduce over (default: ``parallel_state``'s).
    """
    chunks = list(model_chunks)
    per_token = num_tokens is not None
    groups = ps.groups_or_default(groups)
    if groups is None:  # one process, nothing to reduce
        if per_token:
            scale_by_num_tokens(chunks, num_tokens)
        return
    wrapped = [c for c in chunks if hasattr(c, "finish_grad_sync")]
    for chunk in wrapped:
        chunk.finish_grad_sync()
    plain = [c for c in chunks if not hasattr(c, "finish_grad_sync")]
    dp_size = groups.size("dp_cp")
    if plain:
        if not per_token and dp_size > 1:  # average over replicas, as data-parallel training does
            for g in _grads(plain):
                g.div_(dp_size)
        _all_reduce_coalesced(_grads(plain, expert=False), groups.dp_cp)
        # An MoE expert's replicas are the expert-data-parallel group (see DistributedDataParallel),
        # which includes the tensor-parallel ranks: each routed its own sequence shard to it.
        expert_grads = _grads(plain, expert=True)
        if expert_grads and groups.expt_dp is None:
            raise RuntimeError(
                "expert gradients but no expert data-parallel group (groups built without MoE)"
            )
        _all_reduce_coalesced(expert_grads, groups.expt_dp)
    if groups.size("tp") > 1:
        _all_reduce_coalesced(_grads(chunks, "sequence_parallel"), groups.tp)
    if groups.size("pp") > 1 and groups.embd is not None:
        _all_reduce_coalesced(_grads(chunks, "shared_embedding"), groups.embd)
    if per_token:
        scale_by_num_tokens(chunks, num_tokens, groups=groups)


def scale_by_num_tokens(
    chunks: list[torch.nn.Module], num_tokens: torch.Tensor, *, groups: ParallelGroups | None = None
) -> None:
    """Divide every gradient by the step's token count (all stages, all data-parallel ranks).

    ``num_tokens`` is the count on the rank holding the loss stage and 0 (or the same count) on the
    other pipeline ranks; its maximum over the pipeline works whichever rank holds the loss. The
    count stays on the device (no host wait): a step whose loss covers no token gets NaN gradients,
    which the optimizer's finite check skips, as in Megatron.
    """
    tokens = num_tokens.detach().clone().to(torch.float64).reshape(())
    groups = ps.groups_or_default(groups)
    if groups is not None and groups.size("pp") > 1:
        dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=groups.pp)
    if groups is not None and groups.size("dp_cp") > 1:
        dist.all_reduce(tokens, group=groups.dp_cp)
    for g in _grads(chunks):
        g.div_(tokens.to(g.dtype))

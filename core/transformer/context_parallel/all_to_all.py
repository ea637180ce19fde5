"""The two collective forms of context-parallel attention: ``a2a`` (Ulysses) and ``allgather``.

``a2a`` (DeepSpeed-Ulysses, Megatron's ``--cp-comm-type a2a``): an all-to-all over the CP group
trades the sequence split for a head split, so each rank holds the whole sequence for ``1/N`` of the
heads; attention runs locally, as without CP, and a second all-to-all trades back. Two all-to-alls
of q, k, v and the output per layer, whatever ``N``; heads and key/value groups must divide by
``N``.

``allgather`` (Megatron's ``--cp-comm-type allgather``): keys and values are gathered from every
CP rank, and each rank attends its own queries to the whole sequence, masked by the positions its
chunks hold. The backward reduces the key/value gradients back to their owners.

Both hand the attention itself to ``local_attention(q, k, v, attention_mask)``, keys and values
still in their groups (the caller's attention, so GQA, dropout and softmax options work as without CP);
the gathered sequence is put back in natural order first (``sharding.gather_order_index``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from core.tensor_parallel.mappings import conjugate_function
from core.transformer.context_parallel.sharding import gather_order_index, positions_on_this_cp_rank

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` ``[N, ...]``: slice ``j`` goes to rank ``j``; returns the slices received, by source."""
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


def heads_to_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, h, s/N, d]`` split by sequence -> ``[b, h/N, s, d]`` split by head (sequence in rank order)."""
    size = dist.get_world_size(group)
    b, h, s, d = tensor.shape
    parts = _all_to_all(tensor.view(b, size, h // size, s, d).transpose(0, 1), group)
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def sequence_to_heads(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`."""
    size = dist.get_world_size(group)
    b, h, s, d = tensor.shape
    parts = _all_to_all(tensor.view(b, h, size, s // size, d).permute(2, 0, 1, 3, 4), group)
    return parts.transpose(0, 1).reshape(b, h * size, s // size, d)


_HeadsToSequence = conjugate_function(
    "_HeadsToSequence",
    heads_to_sequence,
    sequence_to_heads,
    "Sequence split -> head split; back in backward.",
)
_SequenceToHeads = conjugate_function(
    "_SequenceToHeads",
    sequence_to_heads,
    heads_to_sequence,
    "Head split -> sequence split; back in backward.",
)


def a2a_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    local_attention: LocalAttention,
) -> torch.Tensor:
    """Ulysses attention: ``query`` ``[b, heads, s/N, d]``, ``key``/``value`` ``[b, groups, s/N, d]``."""
    size = dist.get_world_size(group)
    chunk = query.shape[2] // 2
    natural = gather_order_index(size, chunk, device=query.device)
    back = torch.argsort(natural)
    q, k, v = (_HeadsToSequence.apply(t, group).index_select(2, natural) for t in (query, key, value))
    context = local_attention(q, k, v, None)
    return _SequenceToHeads.apply(context.index_select(2, back), group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2); the backward sums the gradients and keeps this rank's part."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=2)[dist.get_rank(ctx.group)], None


def allgather_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    local_attention: LocalAttention,
) -> torch.Tensor:
    """Each rank's queries over every rank's keys and values, gathered (module docstring)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = query.shape[2]
    natural = gather_order_index(size, local // 2, device=query.device)
    k, v = (_GatherSequence.apply(t, group).index_select(2, natural) for t in (key, value))
    positions = positions_on_this_cp_rank(local * size, size, rank, device=query.device)
    masked = torch.arange(local * size, device=query.device)[None, :] > positions[:, None]
    return local_attention(query, k, v, masked)

"""Context parallelism: a sequence split over the ranks of the CP group, attention across them.

Everything outside attention works token by token, so it runs unchanged on each rank's part of the
sequence. Attention needs the whole sequence; :func:`context_parallel_attention` computes it with
one of Megatron's ``--cp-comm-type`` forms:

* ``p2p``: ring attention, key/value blocks passed round the ranks while each block's attention is
  computed, partial results merged by their log-sum-exp (``ring.py``);
* ``a2a``: Ulysses, all-to-alls that trade the sequence split for a head split (``all_to_all.py``);
* ``allgather``: keys and values gathered from every rank (``all_to_all.py``).

Which tokens a rank holds is Megatron's causal load balancing (``sharding.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.transformer.context_parallel.all_to_all import LocalAttention, a2a_attention, allgather_attention
from core.transformer.context_parallel.ring import RingTimings, ring_attention, ring_timings
from core.transformer.context_parallel.rules import CP_COMM_TYPES, context_parallel_problems
from core.transformer.context_parallel.sharding import (
    check_divisible,
    get_batch_on_this_cp_rank,
    held_chunks,
    positions_on_this_cp_rank,
    slice_sequence,
)

__all__ = [
    "CP_COMM_TYPES",
    "RingTimings",
    "a2a_attention",
    "allgather_attention",
    "check_divisible",
    "context_parallel_attention",
    "context_parallel_problems",
    "get_batch_on_this_cp_rank",
    "held_chunks",
    "positions_on_this_cp_rank",
    "ring_attention",
    "ring_timings",
    "slice_sequence",
]


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    comm_type: str,
    group: dist.ProcessGroup,
    local_attention: LocalAttention,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the sequence the CP ``group`` holds.

    ``query`` ``[b, heads, s/N, d]``, ``key``/``value`` ``[b, groups, s/N, d]`` (not repeated for
    GQA), each rank's two load-balanced chunks. ``local_attention(q, k, v, mask)`` is the attention
    ``a2a`` and ``allgather`` run on their gathered operands (``mask``: True where not allowed), with
    its own dropout; ``dropout_p`` is the ring's.
    """
    if comm_type == "p2p":
        return ring_attention(query, key, value, group, dropout_p=dropout_p)
    if comm_type == "a2a":
        return a2a_attention(query, key, value, group, local_attention)
    if comm_type == "allgather":
        return allgather_attention(query, key, value, group, local_attention)
    raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {comm_type!r}")

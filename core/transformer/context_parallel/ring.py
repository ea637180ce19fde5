"""Ring attention (Megatron's ``--cp-comm-type p2p``): key/value blocks travel round the CP ranks.

Each of the ``N`` CP ranks holds two chunks of the sequence (``sharding.py``). In ``N`` steps every
rank attends its queries to every rank's keys and values: at step ``j`` it holds the block of rank
``i - j`` and already sends it on to rank ``i + 1`` while it computes, so the transfer hides behind
the attention of the block in hand. The causal load balancing makes every step after the first
half a block's work on every rank: a block from an earlier rank is seen entirely by both query
chunks but only its first chunk is needed; a block from a later rank is seen only by the second
query chunk, entirely. Partial results merge by their log-sum-exp (:class:`_Merger`).

The backward is a ring too. Key/value blocks travel as in the forward; each rank computes its
queries' gradient share against the block in hand (``block_attention``: the fused backward fed the
*final* output and lse), and the block's key/value gradient accumulator travels with it, each rank
adding its share, until one last hop brings every accumulator home.

:func:`ring_timings` records, per step, the seconds spent in attention and the seconds spent
waiting for blocks, which ``tools/bench/context_parallel.py`` reports as the ring's overlap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from core import comm_time
from core.transformer.context_parallel.block_attention import attention_with_lse, attention_with_lse_backward
from core.transformer.dropout import sharded_rng


@dataclass
class RingTimings:
    """Seconds spent computing attention blocks and waiting for blocks to arrive (both passes)."""

    attention: float = 0.0
    waiting: float = 0.0
    steps: list[tuple[float, float]] = field(default_factory=list)


_TIMINGS: list[RingTimings] = []


@contextmanager
def ring_timings() -> Iterator[RingTimings]:
    """Time every ring attention call inside the block (CPU clocks: on CUDA, kernels run asynchronously)."""
    timings = RingTimings()
    _TIMINGS.append(timings)
    try:
        yield timings
    finally:
        _TIMINGS.remove(timings)


class _Clock:
    def __init__(self) -> None:
        self.on = bool(_TIMINGS)
        self.start = time.perf_counter()

    def lap(self, what: str) -> None:
        if self.on:
            now = time.perf_counter()
            for timings in _TIMINGS:
                setattr(timings, what, getattr(timings, what) + now - self.start)
            self.start = now


class RingExchange:
    """Send a tensor to the next CP rank while receiving its twin from the previous one.

    On NCCL the pair is one ``batch_isend_irecv`` (with two ranks, next and previous are the same
    peer, and separate calls could each wait for the other); elsewhere plain ``isend``/``irecv``.
    ``tag`` keeps the key/value and gradient transfers of one backward apart.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.group, self.size, self.rank = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self.batched = dist.get_backend(group) == "nccl"

    def start(self, tensor: torch.Tensor, tag: int) -> _Pending:
        received = torch.empty_like(tensor)
        if self.batched:
            ops = [
                dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
            ]
            works = dist.batch_isend_irecv(ops)
        else:
            works = [
                dist.isend(tensor, self.next, group=self.group, tag=tag),
                dist.irecv(received, self.prev, group=self.group, tag=tag),
            ]
        return _Pending(works, received, tensor)


class _Pending:
    def __init__(self, works: list, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.works, self.received, self.sent = works, received, sent  # keep ``sent`` alive until done

    def wait(self) -> torch.Tensor:
        stamp = comm_time.start()
        for work in self.works:
            work.wait()
        comm_time.stop("CP", stamp)
        return self.received


_KV, _GRAD = 7, 8


def _block(step: int, rank: int, size: int) -> str:
    """What the queries of ``rank`` do with the block that arrives at ``step`` (module docstring)."""
    if step == 0:
        return "diagonal"
    return "first_keys" if (rank - step) % size < rank else "second_queries"


def _expand(tensor: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """Key/value groups repeated for their query heads: ``[b, g, s, d] -> [b, g * n, s, d]``."""
    if heads_per_group == 1:
        return tensor
    b, g, s, d = tensor.shape
    return tensor[:, :, None].expand(b, g, heads_per_group, s, d).reshape(b, g * heads_per_group, s, d)


def _fold(grad: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """The reverse of :func:`_expand` for gradients: sum each group's query heads."""
    if heads_per_group == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // heads_per_group, heads_per_group, s, d).sum(2)


class _Merger:
    """Running output and lse of the local queries, merged block by block in fp32."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.out, self.lse = out.to(lse.dtype), lse

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice) -> None:
        old_out, old_lse = self.out[:, :, rows], self.lse[:, :, rows]
        new_lse = torch.logaddexp(old_lse, lse)
        merged = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + out.to(old_out.dtype) * torch.exp(
            lse - new_lse
        ).unsqueeze(-1)
        self.out[:, :, rows], self.lse[:, :, rows] = merged, new_lse


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, by ring (module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, ring: RingExchange, heads_per_group: int, scale: float, dropout):
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        half = query.shape[-2] // 2
        kv = torch.stack((key, value))
        clock = _Clock()
        merger = None
        for step in range(ring.size):
            pending = ring.start(kv, _KV) if step < ring.size - 1 else None
            kind = _block(step, ring.rank, ring.size)
            q, k, v, rows = _operands(kind, query, kv, half, heads_per_group)
            out, lse = attention_with_lse(
                q, k, v, causal=kind == "diagonal", scale=scale, dropout=_step_dropout(dropout, ring, step)
            )
            if merger is None:
                merger = _Merger(out, lse)
            else:
                merger.add(out, lse, rows)
            clock.lap("attention")
            if pending is not None:
                kv = pending.wait()
                clock.lap("waiting")
        out = merger.out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, merger.lse)
        ctx.ring, ctx.heads_per_group, ctx.scale, ctx.dropout = ring, heads_per_group, scale, dropout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring, n, scale = ctx.ring, ctx.heads_per_group, ctx.scale
        grad_out, half = grad_out.contiguous(), query.shape[-2] // 2
        grad_query = torch.zeros_like(query, dtype=lse.dtype)
        kv, accumulated, clock = torch.stack((key, value)), None, _Clock()
        for step in range(ring.size):
            pending_kv = ring.start(kv, _KV) if step < ring.size - 1 else None
            kind = _block(step, ring.rank, ring.size)
            q, k, v, rows = _operands(kind, query, kv, half, n)
            dq, dk, dv = attention_with_lse_backward(
                grad_out[:, :, rows], q, k, v, out[:, :, rows], lse[:, :, rows],
                causal=kind == "diagonal", scale=scale, dropout=_step_dropout(ctx.dropout, ring, step),
            )  # fmt: skip
            grad_query[:, :, rows] += dq
            share = torch.zeros_like(kv, dtype=lse.dtype)
            keys = slice(0, half) if kind == "first_keys" else slice(None)
            share[0][:, :, keys], share[1][:, :, keys] = _fold(dk, n), _fold(dv, n)
            clock.lap("attention")
            if accumulated is not None:
                share += accumulated.wait()
            accumulated = ring.start(share, _GRAD)  # the last hop brings each block's gradient home
            if pending_kv is not None:
                kv = pending_kv.wait()
            clock.lap("waiting")
        grad_kv = accumulated.wait()
        clock.lap("waiting")
        return (
            grad_query.to(query.dtype),
            grad_kv[0].to(key.dtype),
            grad_kv[1].to(value.dtype),
            None,
            None,
            None,
            None,
        )


def _operands(kind: str, query: torch.Tensor, kv: torch.Tensor, half: int, heads_per_group: int):
    """The query rows, keys and values one step computes with, and which query rows it updates."""
    key, value = kv[0], kv[1]
    if kind == "first_keys":
        key, value = key[:, :, :half], value[:, :, :half]
    rows = slice(half, None) if kind == "second_queries" else slice(None)
    q = query[:, :, rows]
    return q, _expand(key, heads_per_group).contiguous(), _expand(value, heads_per_group).contiguous(), rows


def _step_dropout(
    dropout: tuple[float, int] | None, ring: RingExchange, step: int
) -> tuple[float, int] | None:
    """The (probability, seed) of one step's block: its own seed per rank and step, the same in backward."""
    if dropout is None:
        return None
    p, seed = dropout
    return p, (seed + 1_000_003 * ring.rank + step) % 2**62


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention over the sequence held by ``group``'s ranks (each with its two chunks).

    ``query`` ``[b, heads, s/N, d]``; ``key`` and ``value`` ``[b, groups, s/N, d]`` with ``heads`` a
    multiple of ``groups`` (GQA: groups travel unrepeated). Returns ``[b, heads, s/N, d]``.
    ``dropout_p``: attention dropout; the masks' seed is drawn from this TP rank's stream (so
    recomputation, which replays that stream, draws the same masks).
    """
    heads, groups = query.shape[1], key.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dropout = None
    if dropout_p > 0.0:
        with sharded_rng():
            dropout = (dropout_p, int(torch.randint(0, 2**62, (1,)).item()))
    return RingAttention.apply(query, key, value, RingExchange(group), heads // groups, scale, dropout)

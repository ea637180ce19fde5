"""Context-parallel attention on real gloo ranks against full attention, and the sequence cutting.

Every rank builds the same full q, k, v (same seed), keeps its two load-balanced chunks, runs
ring / all-to-all / all-gather attention over its CP group, and compares its output and the
gradients of its chunks with full causal attention computed on one rank.
"""

from __future__ import annotations

import pytest
import torch

from core.transformer.context_parallel import block_attention as blocks
from core.transformer.context_parallel import (
    get_batch_on_this_cp_rank,
    held_chunks,
    positions_on_this_cp_rank,
    slice_sequence,
)
from core.transformer.context_parallel.sharding import chunk_order, gather_order_index

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------------------------------
# Sequence cutting (no processes)
# --------------------------------------------------------------------------------------------------


def test_rank_i_holds_chunks_i_and_2n_minus_1_minus_i():
    assert [held_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert chunk_order(2) == [0, 3, 1, 2]
    assert positions_on_this_cp_rank(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert positions_on_this_cp_rank(16, 4, 0).tolist() == [0, 1, 14, 15]
    with pytest.raises(
        ValueError, match=r"sequence length 12 is not divisible by 2 x context_parallel_size \(8\)"
    ):
        positions_on_this_cp_rank(12, 4, 0)


def test_batch_cut_per_rank_reassembles_the_sequence():
    seq, cp = 24, 3
    batch = {
        "tokens": torch.arange(2 * seq).view(2, seq),
        "labels": torch.arange(2 * seq).view(2, seq) + 1000,
        "loss_mask": torch.rand(2, seq),
        "attention_mask": torch.rand(2, 1, seq, seq) > 0.5,
        "position_ids": None,
    }
    parts = [get_batch_on_this_cp_rank(batch, cp_size=cp, cp_rank=r) for r in range(cp)]
    natural = gather_order_index(cp, seq // (2 * cp))
    for key in ("tokens", "labels", "loss_mask"):
        gathered = torch.cat([p[key] for p in parts], dim=1)
        assert torch.equal(gathered[:, natural], batch[key])
        for r, part in enumerate(parts):
            assert torch.equal(part[key], batch[key][:, positions_on_this_cp_rank(seq, cp, r)])
    assert parts[1]["attention_mask"].shape == (2, 1, seq // cp, seq)
    assert torch.equal(
        parts[1]["attention_mask"], batch["attention_mask"][:, :, positions_on_this_cp_rank(seq, cp, 1)]
    )
    assert parts[0]["position_ids"] is None
    assert get_batch_on_this_cp_rank(batch, cp_size=1, cp_rank=0)["tokens"] is batch["tokens"]
    assert torch.equal(
        slice_sequence(batch["tokens"], cp, 2), batch["tokens"][:, positions_on_this_cp_rank(seq, cp, 2)]
    )


# --------------------------------------------------------------------------------------------------
# One block with its log-sum-exp (no processes)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("force_math", [False, True])
def test_blocks_with_the_final_lse_give_the_full_gradients(force_math, monkeypatch):
    """Two key blocks merged by lse equal full attention; their backwards fed the final output and
    lse add up to full attention's gradients (fused CPU kernel and the plain fallback alike)."""
    monkeypatch.setattr(blocks, "FORCE_MATH", force_math)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=gen) for _ in range(3))
    expected_backend = "math" if force_math or blocks._CPU_FLASH is None else "cpu_flash"
    assert blocks.backend(q) == expected_backend
    grad = torch.randn(2, 3, 8, 16, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    reference.backward(grad)
    scale = 16**-0.5
    # queries 4..7 against keys 0..3 (all visible) and keys 4..7 (causal)
    out_a, lse_a = blocks.attention_with_lse(q[:, :, 4:], k[:, :, :4], v[:, :, :4], causal=False, scale=scale)
    out_b, lse_b = blocks.attention_with_lse(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], causal=True, scale=scale)
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp().unsqueeze(-1) + out_b * (lse_b - lse).exp().unsqueeze(-1)
    assert rel(out, reference[:, :, 4:].detach()) <= TOL
    rows = slice(4, None)
    dq_a, dk_a, _ = blocks.attention_with_lse_backward(
        grad[:, :, rows], q[:, :, rows], k[:, :, :4], v[:, :, :4], out, lse, causal=False, scale=scale
    )
    dq_b, _, dv_b = blocks.attention_with_lse_backward(
        grad[:, :, rows], q[:, :, rows], k[:, :, 4:], v[:, :, 4:], out, lse, causal=True, scale=scale
    )
    assert rel(dq_a + dq_b, full[0].grad[:, :, rows]) <= TOL
    assert rel(dv_b, full[2].grad[:, :, 4:]) <= TOL  # keys 4..7 are seen by queries 4..7 only
    assert dk_a.shape == (2, 3, 4, 16)


# --------------------------------------------------------------------------------------------------
# CP attention on real ranks
# --------------------------------------------------------------------------------------------------

SEQ, HEADS, DIM = 16, 4, 8


def _cp_attention_rank(rank, world_size, cases):
    """Each case (comm_type, cp, groups, backend): max relative difference of out, dq, dk, dv."""
    from core import parallel_state as ps
    from core.transformer.attention import core_attention
    from core.transformer.context_parallel import context_parallel_attention

    results = []
    for comm_type, cp, groups, math in cases:
        blocks.FORCE_MATH = math
        ps.initialize_model_parallel(context_parallel_size=cp)
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(2, HEADS, SEQ, DIM, generator=gen)
        k, v = (torch.randn(2, groups, SEQ, DIM, generator=gen) for _ in range(2))
        grad = torch.randn(2, HEADS, SEQ, DIM, generator=gen)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        n = HEADS // groups
        reference = core_attention(
            full[0], full[1].repeat_interleave(n, 1), full[2].repeat_interleave(n, 1), None, 0.0
        )
        reference.backward(grad)
        cp_rank = ps.get_context_parallel_rank()
        mine = [slice_sequence(t, cp, cp_rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(
            *mine,
            comm_type=comm_type,
            group=ps.get_context_parallel_group(),
            local_attention=lambda q_, k_, v_, mask: core_attention(q_, k_, v_, mask, 0.0),
        )
        out.backward(slice_sequence(grad, cp, cp_rank, seq_dim=2))
        cut = [
            slice_sequence(t, cp, cp_rank, seq_dim=2) for t in (reference.detach(), *(f.grad for f in full))
        ]
        results.append(max(rel(a, b) for a, b in zip((out.detach(), *(m.grad for m in mine)), cut)))
        ps.destroy_model_parallel()
    blocks.FORCE_MATH = False
    return results


CASES = [  # (comm_type, cp, key/value groups, plain-math blocks)
    ("p2p", 2, 2, False),
    ("p2p", 4, 4, False),
    ("p2p", 4, 1, True),
    ("a2a", 2, 2, False),
    ("a2a", 4, 4, False),
    ("allgather", 4, 2, False),
]


def test_context_parallel_attention_matches_full_attention(ranks):
    results = ranks(4).run(_cp_attention_rank, CASES, timeout=60)
    for case, *per_rank in zip(CASES, *results):
        assert max(per_rank) <= TOL, f"{case}: relative differences per rank {per_rank}"

"""Context parallelism in one process: the sequence cutting (which chunks a rank holds, a batch cut per
rank), the block attention with its log-sum-exp merged as the ring merges it, and the configs' refusals.
Attention and models on real ranks: tests/dist/test_context_parallel.py."""

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
from tests.support.context_parallel import TOL, rel


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


def test_core_configs_refuse_what_context_parallelism_cannot_run():
    from core.model_parallel_config import ModelParallelConfig
    from core.transformer import TransformerConfig

    with pytest.raises(
        ValueError, match=r"^variable_seq_lengths is not supported with context_parallel_size 2: "
    ):
        ModelParallelConfig(variable_seq_lengths=True, context_parallel_size=2)
    sizes = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(
        ValueError, match=r"cp_comm_type must be one of \('p2p', 'a2a', 'allgather'\), got 'ring'$"
    ):
        TransformerConfig(**sizes, cp_comm_type="ring")
    with pytest.raises(
        ValueError, match=r"cp_comm_type gives 3 types for 2 layers; give one or one per layer$"
    ):
        TransformerConfig(**sizes, cp_comm_type=["p2p", "a2a", "p2p"])
    config = TransformerConfig(**sizes, context_parallel_size=2, cp_comm_type=["p2p", "a2a"])
    assert [config.cp_comm_type_of(layer) for layer in (0, 1)] == ["p2p", "a2a"]


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


def test_dropped_blocks_merge_and_differentiate_like_dropout_on_the_whole_row():
    """Blocks with their own dropout masks, merged by lse, equal dropout applied to the full softmax row
    with those masks side by side; each block's backward regenerates its mask."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    drop_a, drop_b, scale = (0.3, 11), (0.3, 12), 0.5
    rows = slice(4, None)
    out_a, lse_a = blocks.attention_with_lse(
        q[:, :, rows], k[:, :, :4], v[:, :, :4], causal=False, scale=scale, dropout=drop_a
    )
    out_b, lse_b = blocks.attention_with_lse(
        q[:, :, rows], k[:, :, 4:], v[:, :, 4:], causal=True, scale=scale, dropout=drop_b
    )
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp().unsqueeze(-1) + out_b * (lse_b - lse).exp().unsqueeze(-1)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    shape = torch.empty(1, 2, 4, 4, dtype=torch.float64)
    keep = torch.cat([blocks._dropout_scale(shape, drop_a), blocks._dropout_scale(shape, drop_b)], dim=-1)
    assert 0 < (keep == 0).float().mean() < 0.6
    scores = (full[0][:, :, rows] @ full[1].transpose(-2, -1) * scale).masked_fill(
        torch.ones(4, 8, dtype=torch.bool).tril(4).logical_not(), float("-inf")
    )
    reference = (scores.softmax(-1) * keep) @ full[2]
    reference.backward(grad[:, :, rows])
    assert rel(out, reference.detach()) <= 1e-12
    backward = {"scale": scale, "grad_out": grad[:, :, rows], "query": q[:, :, rows], "out": out, "lse": lse}
    dq_a, dk_a, dv_a = blocks.attention_with_lse_backward(
        key=k[:, :, :4], value=v[:, :, :4], causal=False, dropout=drop_a, **backward
    )
    dq_b, dk_b, dv_b = blocks.attention_with_lse_backward(
        key=k[:, :, 4:], value=v[:, :, 4:], causal=True, dropout=drop_b, **backward
    )
    assert rel(dq_a + dq_b, full[0].grad[:, :, rows]) <= 1e-12
    assert rel(torch.cat([dk_a, dk_b], 2), full[1].grad) <= 1e-12
    assert rel(torch.cat([dv_a, dv_b], 2), full[2].grad) <= 1e-12


def test_pipeline_shape_check_names_the_context_parallel_split():
    from core.pipeline_parallel.actions import Action, ActionKind
    from core.pipeline_parallel.hooks import ScheduleSettings
    from core.pipeline_parallel.mailbox import Mailbox, PipelineShapeError
    from core.pipeline_parallel.schedule_rules import placement_for

    settings = ScheduleSettings(hidden_size=64, context_parallel_size=2)
    assert settings.tensor_shape(32, 2) == (16, 2, 64)
    mailbox = Mailbox(
        pp_rank=0,
        placement=placement_for("1f1b", 2),
        links=None,
        shape=settings.tensor_shape(32, 2),
        dtype=torch.float32,
        variable_shapes=False,
        record=None,
        shape_origin=settings.describe_tensor_shape(32, 2),
    )
    mailbox.output_of(Action(ActionKind.F, 0), torch.zeros(32, 2, 64))  # the whole sequence: wrong
    with pytest.raises(PipelineShapeError, match=r"expects shape \(16, 2, 64\) and dtype float32 \(\[seq_length "
                       r"32 / context_parallel_size 2, micro_batch_size 2, hidden_size 64\]\)"):  # fmt: skip
        mailbox.send(Action(ActionKind.SEND_F, 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_blocks_with_lse_match_the_plain_computation(dtype):
    """What one GPU can check of CP (which needs two): the per-block attention with its lse, forward
    and the backward fed the final output and lse, on CUDA's kernels against fp64 on the CPU."""
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 256, 64, generator=gen).to(dtype).double() for _ in range(4))
    cuda = [t.to("cuda", dtype) for t in (q, k, v, grad)]  # the same values: only the kernels differ
    assert blocks.backend(cuda[0]) == ("cuda_efficient" if dtype == torch.float32 else "cuda_flash")
    tol, lse_tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-4)
    for causal, keys in ((True, slice(None)), (False, slice(0, 128))):
        args = {"causal": causal, "scale": 0.125}
        ref = blocks._math_forward(q, k[:, :, keys], v[:, :, keys], causal, 0.125)
        out, lse = blocks.attention_with_lse(cuda[0], cuda[1][:, :, keys], cuda[2][:, :, keys], **args)
        assert lse.shape == (2, 4, 256) and lse.dtype == torch.float32
        assert rel(out.double().cpu(), ref[0]) <= tol and rel(lse.double().cpu(), ref[1]) <= lse_tol
        grads = blocks.attention_with_lse_backward(
            cuda[3], cuda[0], cuda[1][:, :, keys], cuda[2][:, :, keys], out, lse, **args
        )
        expected = blocks._math_backward(grad, q, k[:, :, keys], v[:, :, keys], ref[0], ref[1], causal, 0.125)
        for got, want in zip(grads, expected):
            assert rel(got.double().cpu(), want) <= tol

"""``--attention-softmax-in-fp32``: 16-bit attention with the masking and softmax done in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.transformer.attention import core_attention


def _qkv(dtype: torch.dtype, scale: float = 1.0):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, 16, 8, generator=gen) * scale).to(dtype) for _ in range(3)]


def test_fp32_softmax_path_is_attention_and_closer_to_fp32_than_the_16_bit_path():
    reference = F.scaled_dot_product_attention(*_qkv(torch.float32), is_causal=True)
    for dtype in (torch.float16, torch.bfloat16):
        plain = core_attention(*_qkv(dtype), None, 0.0)
        fp32_softmax = core_attention(*_qkv(dtype), None, 0.0, softmax_in_fp32=True)
        assert fp32_softmax.dtype == dtype
        error = (fp32_softmax.float() - reference).norm() / reference.norm()
        assert error < (2e-3 if dtype == torch.float16 else 1e-2), (dtype, error)
        assert error <= (plain.float() - reference).norm() / reference.norm() * 1.5
    # fp32 inputs already have an fp32 softmax: the flag changes nothing.
    q, k, v = _qkv(torch.float32)
    assert torch.equal(
        core_attention(q, k, v, None, 0.0, softmax_in_fp32=True), core_attention(q, k, v, None, 0.0)
    )


def test_fp32_softmax_keeps_large_fp16_scores_finite_and_honours_the_mask():
    q, k, v = _qkv(torch.float16, scale=30.0)  # scores around 2e3: their softmax in fp16 loses mass
    mask = torch.zeros(1, 1, 16, 16, dtype=torch.bool)
    mask[..., 0] = True  # nobody may attend to position 0 (position 0 then attends to nothing)
    out = core_attention(q, k, v, mask, 0.0, softmax_in_fp32=True)
    reference = core_attention(q.float(), k.float(), v.float(), mask, 0.0)
    assert torch.isfinite(out).all() and torch.equal(out[:, :, 0].float(), reference[:, :, 0])  # zeros
    assert (out.float() - reference).norm() / reference.norm() < 2e-3

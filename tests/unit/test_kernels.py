"""The faster small kernels compute what the written-out versions computed (fp32, within 1e-6).

Each reference below is the plain formula the layers used before (einops rearranges, repeated key and
value heads, RoPE from fp32 angles per call, the norms in fp32, SwiGLU through autograd), applied to
the same parameters; the layer's output and every gradient must match it.
"""

from __future__ import annotations

import contextlib

import einops
import pytest
import torch
import torch.nn.functional as F

import core.transformer.attention as attention_module
from core.transformer import TransformerLayer
from core.transformer.initialization import initialize_by_name
from core.transformer.mlp import swiglu
from core.transformer.rope import RotaryEmbedding, apply_rotary
from models.gpt import gpt2_config, llama_config

SEQ, BATCH = 8, 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ref_rotary(x, positions, inv_freq):
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    r = cos.shape[-1]
    rotated, passed = x[..., :r], x[..., r:]
    first, second = einops.rearrange(rotated, "... (two d) -> two ... d", two=2)
    out = rotated * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((out, passed), dim=-1)


def _ref_norm(norm, x):
    gamma = norm.weight + 1 if norm.zero_centered_gamma else norm.weight
    if hasattr(norm, "bias"):
        return F.layer_norm(x.float(), x.shape[-1:], gamma.float(), norm.bias.float(), norm.eps).to(x.dtype)
    x32 = x.float()
    return gamma * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def _ref_attention(attn, x, inv_freq):
    mixed = F.linear(x, attn.linear_qkv.weight, attn.linear_qkv.bias)
    n = attn.heads_per_group
    grouped = einops.rearrange(mixed, "s b (g m d) -> b g m s d", g=attn.groups_per_rank, d=attn.kv_channels)
    q = einops.rearrange(grouped[:, :, :n], "b g n s d -> b (g n) s d")
    k, v = grouped[:, :, n], grouped[:, :, n + 1]
    if inv_freq is not None:
        positions = torch.arange(x.shape[0])
        q, k = _ref_rotary(q, positions, inv_freq), _ref_rotary(k, positions, inv_freq)
    k, v = (einops.repeat(t, "b g s d -> b (g n) s d", n=n) for t in (k, v))
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = F.linear(einops.rearrange(context, "b h s d -> s b (h d)"), attn.linear_proj.weight)
    return out if attn.linear_proj.bias is None else out + attn.linear_proj.bias


def _ref_layer(layer, x, inv_freq):
    x = x + _ref_attention(layer.self_attention, _ref_norm(layer.input_layernorm, x), inv_freq)
    mlp = layer.mlp
    h = F.linear(_ref_norm(layer.pre_mlp_layernorm, x), mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    if mlp.gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        h = mlp.activation_func(gate) * up
    else:
        h = mlp.activation_func(h)
    out = F.linear(h, mlp.linear_fc2.weight)
    return x + (out if mlp.linear_fc2.bias is None else out + mlp.linear_fc2.bias)


SIZES = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 48}
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
CONFIGS = {
    "llama-gqa": lambda: llama_config(num_query_groups=2, **SIZES),
    "llama-mha-partial-rope": lambda: llama_config(rotary_percent=0.5, **SIZES),
    "llama-gqa-1p": lambda: llama_config(num_query_groups=2, layernorm_zero_centered_gamma=True, **SIZES),
    "gpt2": lambda: gpt2_config(**NO_DROPOUT, **SIZES),
    "gpt2-gqa-1p": lambda: gpt2_config(
        num_query_groups=2, layernorm_zero_centered_gamma=True, **NO_DROPOUT, **SIZES
    ),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_layer_equals_the_written_out_layer_forward_and_backward(case):
    config = CONFIGS[case]()
    config.init_method_std = 0.2
    layer = TransformerLayer(config, 0)
    initialize_by_name(layer, config)
    with torch.no_grad():  # norms away from their initial ones and zeros
        for name, p in layer.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    x = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad_out = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(1))
    rope = None
    if config.position_embedding_type == "rope":
        rope = RotaryEmbedding(config.rotary_dim, config.rotary_base)
    rotary = None if rope is None else rope.for_length(SEQ, torch.float32)

    out = layer(x, rotary)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], grad_out)
    ref = _ref_layer(layer, x, None if rope is None else rope.inv_freq)
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()], grad_out)
    assert _rel(out, ref) <= 1e-6
    names = ["input", *(n for n, _ in layer.named_parameters())]
    for name, g, r in zip(names, grads, ref_grads):
        assert _rel(g, r) <= 1e-6, (case, name, _rel(g, r))


def test_rope_tables_are_cached_on_the_device_in_the_compute_dtype():
    rope = RotaryEmbedding(8, 10000.0, device="cpu")
    cos, sin = rope.for_length(5, torch.bfloat16)
    again, _ = rope.for_length(3, torch.bfloat16)
    assert cos.dtype == torch.bfloat16 and cos.shape == (5, 8)
    assert again.data_ptr() == cos.data_ptr()  # a view of the same table: no kernel per microbatch
    exact_cos, exact_sin = rope(torch.arange(5))
    assert torch.equal(rope.for_length(5, torch.float32)[0], exact_cos)
    assert torch.equal(rope.for_length(5, torch.float32)[1], exact_sin)
    assert torch.equal(cos, exact_cos.bfloat16()) and torch.equal(sin, exact_sin.bfloat16())
    longer, _ = rope.for_length(40, torch.float32)  # grows past the first table
    assert torch.equal(longer, rope(torch.arange(40))[0])
    x = torch.randn(2, 3, 4, 5, 8, generator=torch.Generator().manual_seed(0))  # [b, g, n, s, d]
    per_sample = torch.stack([torch.arange(5), torch.arange(5).flip(0)])
    expected = _ref_rotary(x, per_sample.view(2, 1, 1, 5), rope.inv_freq)
    assert _rel(apply_rotary(x, *rope(per_sample)), expected) <= 1e-6


def test_swiglu_function_gives_autograds_numbers_exactly():
    x = torch.randn(SEQ, BATCH, 2 * 24, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad = torch.randn(SEQ, BATCH, 24, generator=torch.Generator().manual_seed(1))
    gate, up = torch.chunk(x, 2, dim=-1)
    reference = F.silu(gate) * up
    (expected,) = torch.autograd.grad(reference, x, grad)
    out = swiglu(x)
    (got,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, reference) and torch.equal(got, expected)


@contextlib.contextmanager
def _count_attention_paths():
    calls = {"sdpa": 0, "written_out": 0}
    sdpa, written = F.scaled_dot_product_attention, attention_module._attention_softmax_in_fp32

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    def counting_written(*args, **kwargs):
        calls["written_out"] += 1
        return written(*args, **kwargs)

    attention_module.F.scaled_dot_product_attention = counting_sdpa
    attention_module._attention_softmax_in_fp32 = counting_written
    try:
        yield calls
    finally:
        attention_module.F.scaled_dot_product_attention = sdpa
        attention_module._attention_softmax_in_fp32 = written


def test_attention_softmax_in_fp32_keeps_sdpa_where_its_softmax_is_fp32():
    """Flash and SDPA's math fallback reduce in fp32 already; scores are written out only where SDPA
    could reduce in 16 bits."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, 16, 8, generator=gen).bfloat16() for _ in range(2))
    with _count_attention_paths() as calls:
        attention_module.core_attention(q, k, v, None, 0.0, softmax_in_fp32=True)
    assert calls == {"sdpa": 1, "written_out": 0}
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with _count_attention_paths() as calls:
            attention_module.core_attention(q, k, v, None, 0.0, softmax_in_fp32=True)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    assert calls == {"sdpa": 0, "written_out": 1}


def test_fused_loss_never_holds_an_fp32_copy_of_the_logits():
    """Output layer + loss, forward and backward, bf16: the plain loss peaks at the logits plus two fp32
    copies (5x the logits' bytes), the fused one at the logits plus one 1 MiB fp32 slice (and the
    output layer's small weight and input gradients, 0.4 MiB here), the output layer inside the loss
    (``--cross-entropy-fusion-impl linear``) at a slice and the gradients, never the logits."""
    from tools.bench.cross_entropy import loss_step, peak_bytes

    tokens, vocab, hidden = 1024, 4096, 16
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.1).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    logits_bytes = tokens * vocab * 2
    plain = peak_bytes(loss_step("plain", h, w, target), torch.device("cpu"))
    fused = peak_bytes(loss_step("fused", h, w, target, slice_bytes=2**20), torch.device("cpu"))
    linear = peak_bytes(loss_step("linear", h, w, target, slice_bytes=2**20), torch.device("cpu"))
    assert plain >= 5 * logits_bytes
    assert fused <= logits_bytes + 1.5 * 2**20 and fused <= 0.35 * plain, (plain, fused)
    print(f"peaks: plain {plain}, fused {fused}, linear {linear} bytes; logits {logits_bytes}")
    assert linear < 0.35 * logits_bytes, (linear, logits_bytes)  # a 1 MiB slice and the gradients

"""core.transformer without processes: config validation, attention pieces, recomputation with dropout.

The multi-rank checks (TP/SP/PP parity, recomputation under TP=2 x PP=2) live in test_gpt_model.py,
which shares one pool of 8 ranks.
"""

from __future__ import annotations

import pytest
import torch

import core.transformer.attention as attention_module
from core.tensor_parallel import model_parallel_seed
from core.transformer import TransformerConfig, TransformerLayer, apply_rotary, core_attention
from core.transformer.rope import RotaryEmbedding
from models.gpt import GPTModel, gpt2_config, llama_config
from tests.support.configs import full_recompute, tiny_config

VOCAB, SEQ = 64, 8


# --------------------------------------------------------------------------------------------------
# Config validation
# --------------------------------------------------------------------------------------------------

BASE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"num_attention_heads": 6, "hidden_size": 36, "tensor_model_parallel_size": 4},
            (
                "num_attention_heads (6) must be divisible by tensor_model_parallel_size (4); "
                "num_query_groups (6) must be divisible by tensor_model_parallel_size (4)"
            ),
        ),
        ({"num_query_groups": 3}, "num_attention_heads (4) must be divisible by num_query_groups (3)"),
        (
            {"num_query_groups": 2, "tensor_model_parallel_size": 4},
            "num_query_groups (2) must be divisible by tensor_model_parallel_size (4)",
        ),
        (
            {"hidden_size": 30},
            "hidden_size (30) must be divisible by num_attention_heads (4) when kv_channels is not set",
        ),
        (
            {"ffn_hidden_size": 66, "tensor_model_parallel_size": 4},
            "ffn_hidden_size (66) must be divisible by tensor_model_parallel_size (4)",
        ),
        (
            {"normalization": "BatchNorm"},
            "normalization must be one of ('LayerNorm', 'RMSNorm'), got 'BatchNorm'",
        ),
        (
            {"position_embedding_type": "alibi"},
            "position_embedding_type must be one of ('learned_absolute', 'rope', 'none'), got 'alibi'",
        ),
        (
            {"position_embedding_type": "rope", "rotary_percent": 0.2},
            "rotary_percent (0.2) x kv_channels (8) gives 1 rotary channels; RoPE needs an even number >= 2",
        ),
        ({"hidden_dropout": 1.0}, "hidden_dropout must be in [0, 1), got 1.0"),
        (
            {"recompute_granularity": "full"},
            "recompute_granularity='full' needs recompute_method 'uniform' or 'block', got None",
        ),
        (
            {"recompute_granularity": "full", "recompute_method": "uniform"},
            "recompute_granularity='full' needs recompute_num_layers >= 1, got None",
        ),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            "recompute_granularity='selective' takes no recompute_method (None) or recompute_num_layers (1)",
        ),
        (
            {"recompute_method": "block"},
            "recompute_method ('block') and recompute_num_layers (None) need recompute_granularity='full'",
        ),
        ({"num_layers": 0}, "num_layers must be >= 1, got 0"),
    ],
)
def test_invalid_config_raises_one_clear_error(overrides, message):
    with pytest.raises(ValueError) as err:
        TransformerConfig(**{**BASE, **overrides})
    assert str(err.value) == "invalid TransformerConfig: " + message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as err:
        TransformerConfig(**{**BASE, "num_query_groups": 3, "tensor_model_parallel_size": 2})
    assert str(err.value) == (
        "invalid TransformerConfig: num_attention_heads (4) must be divisible by "
        "num_query_groups (3); num_query_groups (3) must be divisible by "
        "tensor_model_parallel_size (2)"
    )


def test_derived_defaults_follow_megatron():
    config = TransformerConfig(**BASE)
    assert (config.ffn_hidden_size, config.kv_channels, config.num_query_groups) == (128, 8, 4)
    assert TransformerConfig(**BASE, tensor_model_parallel_size=2).padded_vocab_size(50257) == 50432
    assert TransformerConfig(**BASE, bf16=True).params_dtype == torch.bfloat16
    llama = llama_config(num_layers=2, hidden_size=4096, num_attention_heads=32)
    assert llama.ffn_hidden_size == 11008 and llama.gated_linear_unit and llama.normalization == "RMSNorm"


# --------------------------------------------------------------------------------------------------
# Attention pieces
# --------------------------------------------------------------------------------------------------


def test_grouped_query_attention_matches_an_explicit_softmax():
    torch.manual_seed(0)
    config = tiny_config("llama", num_layers=1, ffn_hidden_size=32, init_method_std=0.3)
    layer = TransformerLayer(config, 0)
    from core.transformer.initialization import initialize_by_name

    initialize_by_name(layer, config)
    attn = layer.self_attention
    x = torch.randn(SEQ, 2, 32)
    mixed = attn.linear_qkv(x)[0]
    q, k, v = attn.split_qkv(mixed)
    assert q.shape == (2, 2, 2, SEQ, 8) and k.shape == v.shape == (2, 2, SEQ, 8)
    assert all(t.untyped_storage().data_ptr() == mixed.untyped_storage().data_ptr() for t in (q, k, v))
    q = q.flatten(1, 2)
    k_rep, v_rep = (t.repeat_interleave(2, dim=1) for t in (k, v))  # heads 0,1 -> group 0; 2,3 -> group 1
    scores = q @ k_rep.transpose(-1, -2) / 8**0.5
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v_rep
    padding = torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool)  # Megatron's mask: True = masked
    for keys, values in ((k, v), (k_rep, v_rep)):  # grouped (SDPA shares the heads) or repeated
        assert torch.allclose(core_attention(q, keys, values, None, 0.0), expected, atol=1e-6)
        assert torch.allclose(core_attention(q, keys, values, padding, 0.0), expected, atol=1e-6)


def test_no_position_embedding_builds_neither_table_nor_rope():
    model = GPTModel(
        gpt2_config(num_layers=1, hidden_size=32, num_attention_heads=4, position_embedding_type="none"),
        VOCAB,
        SEQ,
    )
    assert model.embedding.position_embeddings is None and model.rotary_pos_emb is None
    assert model(torch.zeros(1, SEQ, dtype=torch.long)).shape == (1, SEQ, 128)


def test_partial_rotary_leaves_the_other_channels_alone():
    rope = RotaryEmbedding(4, 10000.0)
    cos, sin = rope(torch.arange(SEQ))
    x = torch.randn(1, 2, SEQ, 8)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:]) and torch.equal(
        out[:, :, 0], x[:, :, 0]
    )  # position 0 is identity
    assert torch.allclose(out[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1), atol=1e-6)  # a rotation


# --------------------------------------------------------------------------------------------------
# Recomputation replays dropout exactly (single process; TP=2 x PP=2 in test_gpt_model.py)
# --------------------------------------------------------------------------------------------------

RECOMPUTE = {
    "full-uniform-2": full_recompute("uniform", 2),
    "full-uniform-1": full_recompute("uniform", 1),
    "full-block-2": full_recompute("block", 2),
    "selective": {"recompute_granularity": "selective"},
}


def _loss_and_grads(kind: str, dropout: float, **recompute):
    """One forward and backward; also counts decoder-layer forwards and core-attention calls (recomputes show)."""
    build = gpt2_config if kind == "gpt" else llama_config
    config = build(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        init_method_std=0.1,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **recompute,
    )
    model = GPTModel(config, VOCAB, SEQ)
    calls = {"layers": 0, "core": 0}
    for layer in model.decoder.layers.values():
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__("layers", calls["layers"] + 1))
    original = attention_module.core_attention

    def counting(*args):
        calls["core"] += 1
        return original(*args)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    model_parallel_seed(2024)
    attention_module.core_attention = counting
    try:
        loss = model(tokens, labels=torch.roll(tokens, -1, 1)).mean()
        loss.backward()
    finally:
        attention_module.core_attention = original
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_recompute_gives_the_same_loss_and_gradients_with_dropout_on(kind):
    loss, grads, calls = _loss_and_grads(kind, 0.1)
    assert calls == {"layers": 3, "core": 3}
    assert not torch.equal(loss, _loss_and_grads(kind, 0.0)[0]), (
        "dropout had no effect; the test would be vacuous"
    )
    for name, recompute in RECOMPUTE.items():
        loss_r, grads_r, calls_r = _loss_and_grads(kind, 0.1, **recompute)
        layers = {"full-uniform-2": 6, "full-uniform-1": 6, "full-block-2": 5, "selective": 3}[name]
        assert calls_r == {"layers": layers, "core": 5 if name == "full-block-2" else 6}, name
        assert torch.equal(loss_r, loss), name
        for param, grad in grads.items():
            assert torch.equal(grads_r[param], grad), f"{name}: {param}"


def test_recompute_needs_the_tracker_replay(monkeypatch):
    """Without restoring the model-parallel RNG tracker, recomputed attention dropout draws new masks."""
    import contextlib

    import core.transformer.recompute as recompute_module

    _, grads, _ = _loss_and_grads("llama", 0.1)
    monkeypatch.setattr(recompute_module, "_replay_tracker", lambda store: contextlib.nullcontext())
    _, grads_r, _ = _loss_and_grads("llama", 0.1, **RECOMPUTE["selective"])
    assert any(not torch.equal(grads_r[n], g) for n, g in grads.items())

"""GPT-2, LLaMA and Mixtral as configurations of one TransformerConfig, plus a few named sizes.

    config = llama_config(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=64, tensor_model_parallel_size=2)
    config = preset("gpt2-small", pipeline_model_parallel_size=2)

Any keyword is a TransformerConfig field and overrides the style's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

from core.transformer.transformer_config import TransformerConfig, openai_gelu


def gpt2_config(**overrides: Any) -> TransformerConfig:
    """GPT-2: LayerNorm, tanh-approximate GELU, learned absolute positions, biases, tied embeddings."""
    fields: dict[str, Any] = {
        "normalization": "LayerNorm",
        "layernorm_epsilon": 1e-5,
        "activation_func": openai_gelu,
        "gated_linear_unit": False,
        "add_bias_linear": True,
        "position_embedding_type": "learned_absolute",
        "untie_embeddings_and_output_weights": False,
        "attention_dropout": 0.1,
        "hidden_dropout": 0.1,
        **overrides,
    }
    return TransformerConfig(**fields)


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4h (same parameter count as a 4h MLP), rounded up to ``multiple_of``."""
    size = int(2 * 4 * hidden_size / 3)
    return -(-size // multiple_of) * multiple_of


def llama_config(**overrides: Any) -> TransformerConfig:
    """LLaMA: RMSNorm, SwiGLU, RoPE (rotate-half), optional GQA, no biases, untied output, no dropout."""
    fields: dict[str, Any] = {
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-5,
        "activation_func": F.silu,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "position_embedding_type": "rope",
        "rotary_base": 10000.0,
        "untie_embeddings_and_output_weights": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        **overrides,
    }
    if fields.get("ffn_hidden_size") is None and fields.get("hidden_size"):
        fields["ffn_hidden_size"] = llama_ffn_hidden_size(fields["hidden_size"])
    return TransformerConfig(**fields)


def mixtral_config(**overrides: Any) -> TransformerConfig:
    """Mixtral: LLaMA with every MLP an MoE layer of 8 experts, top-2 (softmax over the chosen two),
    the GShard/Switch balancing loss at 1e-2 as in Megatron's Mixtral script, tokens sent by all-to-all."""
    fields: dict[str, Any] = {
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
        "moe_token_dispatcher_type": "alltoall",
        **overrides,
    }
    return llama_config(**fields)


STYLES: dict[str, Callable[..., TransformerConfig]] = {
    "gpt2": gpt2_config,
    "llama": llama_config,
    "mixtral": mixtral_config,
}

NAMED_SIZES: dict[str, tuple[str, dict[str, int]]] = {
    "gpt2-tiny": ("gpt2", {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}),
    "gpt2-small": ("gpt2", {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12}),
    "gpt2-medium": ("gpt2", {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16}),
    "llama-tiny": (
        "llama",
        {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 64,
        },
    ),
    "mixtral-tiny": (
        "mixtral",
        {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 32,
        },
    ),
    "tinyllama-1.1b": (
        "llama",
        {
            "num_layers": 22,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_query_groups": 4,
            "ffn_hidden_size": 5632,
        },
    ),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A style ("gpt2", "llama", "mixtral") or a named size ("gpt2-small", "llama-tiny", ...), with overrides."""
    if name in STYLES:
        return STYLES[name](**overrides)
    if name not in NAMED_SIZES:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(STYLES) + sorted(NAMED_SIZES)}")
    style, sizes = NAMED_SIZES[name]
    return STYLES[style](**{**sizes, **overrides})

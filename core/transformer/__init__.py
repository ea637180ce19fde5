"""Megatron's ``megatron.core.transformer``: config, attention (MHA/GQA, RoPE), MLP, norms, block."""

from core.transformer.attention import SelfAttention, core_attention
from core.transformer.initialization import initialize_by_name, mark_init
from core.transformer.mlp import MLP
from core.transformer.norms import LayerNorm, RMSNorm, build_norm
from core.transformer.recompute import checkpoint
from core.transformer.rope import RotaryEmbedding, apply_rotary
from core.transformer.transformer_block import TransformerBlock
from core.transformer.transformer_config import TransformerConfig, openai_gelu
from core.transformer.transformer_layer import TransformerLayer

__all__ = [
    "MLP",
    "LayerNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
    "apply_rotary",
    "build_norm",
    "checkpoint",
    "core_attention",
    "initialize_by_name",
    "mark_init",
    "openai_gelu",
]

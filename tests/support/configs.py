"""The tiny models the single-process tests build, and Megatron's full-recompute setting.

``tiny_config("gpt")`` is GPT-2 with 2 layers of 32, 4 heads and no dropout; ``tiny_config("llama")``
is LLaMA with the same sizes and 2 query groups. Both draw their weights with std 0.2, large enough
that a wrong gradient or a swapped head shows. ``overrides`` change any field.
"""

from __future__ import annotations

from typing import Any

from core.transformer import TransformerConfig
from models.gpt import gpt2_config, llama_config

TINY_SIZES = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "init_method_std": 0.2}


def tiny_config(kind: str, **overrides: Any) -> TransformerConfig:
    """The tiny GPT-2 (``kind="gpt"``) or LLaMA (``"llama"``) of this module's docstring."""
    if kind == "gpt":
        return gpt2_config(**{**TINY_SIZES, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})
    return llama_config(**{**TINY_SIZES, "num_query_groups": 2, **overrides})


def full_recompute(method: str, num_layers: int) -> dict[str, Any]:
    """Megatron's full activation recomputation: ``recompute_method`` 'uniform' or 'block' over ``num_layers``."""
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": num_layers}

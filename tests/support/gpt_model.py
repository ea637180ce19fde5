"""What the GPTModel tests share (one process in tests/unit, real ranks in tests/dist): the tiny GPT-2
and LLaMA configs, their sizes and microbatches, and the relative error."""

from __future__ import annotations

import torch

from core.transformer.transformer_config import TransformerConfig
from models.gpt import gpt2_config, llama_config
from tests.support.pipeline_toy import make_microbatches

VOCAB, SEQ, MBS, MICROBATCHES = 60, 8, 2, 2  # VOCAB pads to 64: padding is exercised in every split


WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def make_config(kind: str, **overrides) -> TransformerConfig:
    """The tiny GPT-2 or LLaMA (GQA: 4 heads, 2 groups) every GPTModel test uses; dropout off."""
    common = {
        "num_layers": 4,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "make_vocab_size_divisible_by": 16,
        "init_method_std": 0.1,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "seed": 7,
        **overrides,
    }
    if kind == "gpt":
        return gpt2_config(**common)
    return llama_config(**{"num_query_groups": 2, "ffn_hidden_size": 48, **common})


def make_batches(count: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, labels, loss_mask) microbatches of these sizes; masks drop a quarter of the tokens."""
    return make_microbatches(count, MBS, SEQ, variable=False, seed=seed, vocab=VOCAB)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return ((a - b).norm() / b.norm()).item()

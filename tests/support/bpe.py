"""GPT-2 style byte-level BPE tokenizers trained in the test itself (no download), ``<|endoftext|>`` their one
special token: the vocab.json/merges.txt that Megatron's GPT2BPETokenizer reads, or a Hugging Face folder."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import ByteLevelBPETokenizer

TRICKY_TEXTS = [
    "Hello world, it's 2024!",
    "  leading spaces\tand\ttabs\n\nnew lines   ",
    "naïve café — ünïcödé ✓ 你好",
]
"""Texts where tokenizers part ways: punctuation and digits, runs of white space, non-ASCII letters."""


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 1, save_to: Path | None = None
) -> ByteLevelBPETokenizer:
    """A byte-level BPE trained on ``texts``; with ``save_to``, its vocab.json and merges.txt written there."""
    from tokenizers import (
        ByteLevelBPETokenizer,  # imported here: a test module that only may need it still collects
    )

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=["<|endoftext|>"]
    )
    if save_to is not None:
        trainer.save_model(str(save_to))
    return trainer

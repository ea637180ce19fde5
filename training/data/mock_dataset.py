"""``--mock-data``: Megatron's generated token documents, served like an indexed dataset.

Megatron's ``MockGPTLowLevelDataset`` makes 100000 documents whose lengths are drawn from
``numpy.random.default_rng(0).integers(1, 4096)``; document ``i`` of length ``n`` is the tokens
``(1, 2, ..., n - 1) % vocab_size`` followed by the end-of-document token. ``MockIndexedDataset``
has the same lengths and tokens and the ``IndexedDataset`` interface (``sequence_lengths``,
``get``), so ``GPTDataset`` splits, shuffles and windows it exactly as a real file, with nothing
read from disk.
"""

from __future__ import annotations

import numpy as np

NUM_DOCUMENTS = 100_000
MAX_DOCUMENT_LENGTH = 4096
SEED = 0


class MockIndexedDataset:
    """Megatron's mock documents for a tokenizer with ``vocab_size`` ids and end-of-document ``eod``."""

    prefix = "mock"
    in_memory = True
    """``GPTDataset`` builds its indices in memory for it unless given a cache directory."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = int(vocab_size), int(eod)
        rng = np.random.default_rng(seed=SEED)
        self.sequence_lengths = rng.integers(1, MAX_DOCUMENT_LENGTH, size=NUM_DOCUMENTS, dtype=np.int32)
        self.dtype = np.int64

    def __len__(self) -> int:
        return NUM_DOCUMENTS

    @property
    def num_documents(self) -> int:
        return NUM_DOCUMENTS

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == size - 1] = self.eod
        return tokens

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def cache_identity(self) -> dict:
        """What the cached indices of a split of it depend on."""
        return {"mock": NUM_DOCUMENTS, "seed": SEED, "vocab_size": self.vocab_size, "eod": self.eod}

"""A tiny Megatron indexed dataset on disk, for the tests that train from ``--data-path``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

__all__ = ["tiny_indexed_dataset"]


def tiny_indexed_dataset(directory: Path) -> str:
    """40 documents of 40 token ids below 1000 (a NullTokenizer --vocab-size 1000), seeded; the prefix."""
    prefix = str(directory / "tiny_text_document")
    builder = IndexedDatasetBuilder(data_file_path(prefix), np.int32)
    rng = np.random.default_rng(0)
    for _ in range(40):
        builder.add_item(rng.integers(0, 1000, 40).tolist())
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix

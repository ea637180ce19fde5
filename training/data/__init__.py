"""Trident's data pipeline: default corpus, tokenizer training, Megatron indexed datasets, GPT samples.

The torch-dependent dataset classes are imported lazily, so the preprocessing tools (and their
worker processes) start without importing torch.
"""

from __future__ import annotations

import importlib

from training.data.corpus import build_default_corpus, default_cache_dir
from training.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from training.data.samplers import MegatronPretrainingSampler, dp_microbatch_indices
from training.data.tokenizer_training import default_tokenizer, train_sentencepiece

_LAZY = {
    "GPTDataset": "training.data.gpt_dataset",
    "BlendedDataset": "training.data.blended_dataset",
    "build_train_valid_test_datasets": "training.data.builder",
    "parse_data_path": "training.data.builder",
}

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "build_default_corpus",
    "build_train_valid_test_datasets",
    "default_cache_dir",
    "default_tokenizer",
    "dp_microbatch_indices",
    "optimal_dtype",
    "parse_data_path",
    "train_sentencepiece",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'training.data' has no attribute {name!r}")

"""Blending several datasets by weight, as Megatron-LM's ``BlendedDataset`` does.

Sample ``i`` of the blend goes to the dataset that is furthest behind its share: the one with
the largest ``weight * max(i, 1) - samples_taken_so_far`` (first one on ties). For any prefix
of the blend the counts are therefore within one sample of ``weight * length``, and the order
is fully deterministic (no random draw).

The two index builders are the same loops as megatron-core's C++ helpers (``helpers.cpp``), compiled
by numba on first use (``training/data/jit.py``), so a blend of hundreds of millions of samples
takes seconds instead of the hour a Python loop needs; ``tools/bench/index.py`` measures them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from training.data.gpt_dataset import IndexCache
from training.data.jit import compiled


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64 (Megatron's ``normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return (w / w.sum()).tolist()


def fill_blending_indices(weights, dataset_index, dataset_sample_index) -> None:
    """Fill both index arrays in place by the rule above (numba compiles it; the interpreter runs it too)."""
    taken = np.zeros(len(weights), dtype=np.int64)
    for i in range(len(dataset_index)):
        scale = max(float(i), 1.0)
        best, best_error = 0, weights[0] * scale - taken[0]
        for d in range(1, len(weights)):
            error = weights[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1


def _fill_exhaustive_blending_indices(weights, sizes, dataset_index, dataset_sample_index):
    taken = np.zeros(len(weights), dtype=np.int64)
    for i in range(len(dataset_index)):
        scale = max(float(i), 1.0)
        best, best_error = -1, -np.inf
        for d in range(len(weights)):
            if taken[d] < sizes[d]:
                error = weights[d] * scale - taken[d]
                if best < 0 or error > best_error:
                    best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` samples: which dataset (int16) and which of its samples (int64)."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    compiled(fill_blending_indices)(
        np.asarray(weights, dtype=np.float64), dataset_index, dataset_sample_index
    )
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`build_blending_indices` with weights ``sizes``, taking exactly ``sizes[d]`` from each."""
    counts = np.asarray(sizes, dtype=np.int64)
    total = int(counts.sum())
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    weights = np.asarray([int(s) / total for s in sizes], dtype=np.float64)
    compiled(_fill_exhaustive_blending_indices)(weights, counts, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples taken from ``datasets`` in proportion to ``weights`` (see module doc).

    With ``size=None`` every sample of every dataset is used exactly once (weights = lengths).
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int | None,
        *,
        cache_dir: str | os.PathLike | None = None,
        description: dict | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ValueError(f"cannot blend {len(datasets)} datasets (at most 32766)")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        arrays = None
        cache = None
        if cache_dir is not None and description is not None:
            desc = {"class": "BlendedDataset", "weights": self.weights, "size": size, **description}
            cache = IndexCache(cache_dir, "BlendedDataset", desc)
            arrays = cache.load(["dataset_index", "dataset_sample_index"])
        self.built_anew_on_cache_miss = arrays is None
        if arrays is None:
            if size is None:
                built = build_exhaustive_blending_indices([len(d) for d in self.datasets])
            else:
                built = build_blending_indices(self.weights, size)
            arrays = dict(zip(["dataset_index", "dataset_sample_index"], built))
            if cache is not None:
                cache.save(arrays)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_bounds()

    def _check_bounds(self) -> None:
        for d, dataset in enumerate(self.datasets):
            taken = self.dataset_sample_index[self.dataset_index == d]
            if len(taken) and int(taken.max()) >= len(dataset):
                raise ValueError(
                    f"the blend takes {int(taken.max()) + 1} samples from dataset {d}, which has only "
                    f"{len(dataset)}: build that dataset with more samples"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a blend of {len(self)}")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

"""Train/valid/test GPT datasets from ``--data-path`` and ``--split``, with Megatron's semantics.

* ``--data-path A`` or ``--data-path 0.3 A 0.7 B`` (weights optional, normalised; without
  weights several prefixes are blended in proportion to their sizes). Numbers among items that
  are not such pairs (``0.5 A 0.5``: a prefix missing) are refused, not read as prefixes named ``0.5``.
* ``--split 969,30,1``: the weights are normalised and each split gets the contiguous range
  ``[round(lo * N), round(hi * N))`` of every dataset's N documents (sequences); a zero-width
  split gets no dataset (None).
* Blending: dataset ``d`` is asked for ``ceil(ceil(n * w_d) * 1.005)`` samples of a split that
  needs ``n`` (the small surplus keeps the blend from running past its end), and the blend is
  ``sum_d ceil(n * w_d)`` samples long.
* ``build_per_split_datasets``: Megatron's ``--train-data-path``/``--valid-data-path``/
  ``--test-data-path``, each split from its own data.
* A split that rounds to no documents is None too when it is not used (0 samples asked of it), with
  one warning: ``969,30,1`` leaves a small dataset no test documents, and training never reads them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from training.data.blended_dataset import BlendedDataset, normalize
from training.data.gpt_dataset import GPTDataset
from training.data.indexed_dataset import IndexedDataset
from training.reporting.logging_utils import print_line

SPLIT_NAMES = ("train", "valid", "test")
MID_LEVEL_DATASET_SURPLUS = 0.005


def parse_data_path(data_path: str | Sequence[str | float]) -> tuple[list[str], list[float] | None]:
    """``["0.3", "A", "0.7", "B"]`` -> ``(["A", "B"], [0.3, 0.7])``; ``["A", "B"]`` -> ``(["A", "B"], None)``."""
    items = [data_path] if isinstance(data_path, (str, os.PathLike)) else list(data_path)
    if not items:
        raise ValueError("no dataset prefix given")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except (TypeError, ValueError):
            weights = None
        if weights is not None:
            if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(
                    f"blend weights must be finite numbers >= 0 with a positive sum, got {items[0::2]}"
                )
            return [os.fspath(p).strip() for p in items[1::2]], weights
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"expected 'weight prefix' pairs or prefixes, got {items}")
    numbers = [os.fspath(item) for item in items if _is_number(os.fspath(item))]
    if numbers:  # not pairs (those returned above), yet with weights: not prefixes named "0.5" either
        count = f"{len(items)} item" + ("s" if len(items) > 1 else "")
        problem = f"one is missing ({count})" if len(items) % 2 else "a weight is out of place"
        raise ValueError(
            f"{' '.join(map(os.fspath, items))} looks like 'weight prefix' pairs with weights "
            f"{', '.join(numbers)}, but {problem}; give a prefix after every weight (e.g. 0.3 A 0.7 B), "
            "or prefixes only"
        )
    return [os.fspath(p).strip() for p in items], None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> ``[0.969, 0.03, 0.001]``: train, valid, test weights, normalised.

    Missing trailing weights are 0; ``/`` separates as well as ``,`` (Megatron's older form). Every
    weight must be a finite number >= 0 and their sum positive; anything else raises ``ValueError``
    naming ``--split`` (Megatron pulls the digits out of the string, so ``1,2,x`` became ``1,2``).
    """
    text = str(split).strip()
    hint = "expected up to three comma-separated weights, e.g. 969,30,1"
    pieces = [piece.strip() for piece in re.split(r"[,/]", text)]
    if len(pieces) > 3:
        raise ValueError(f"--split {text!r}: {hint}")
    values = []
    for piece in pieces:
        try:
            value = float(piece)
        except ValueError:
            raise ValueError(f"--split {text!r}: {piece!r} is not a number; {hint}") from None
        if not math.isfinite(value) or value < 0:
            problem = "negative" if value < 0 else "not finite"
            raise ValueError(f"--split {text!r}: weight {piece} is {problem}; {hint}")
        values.append(value)
    if sum(values) <= 0:
        raise ValueError(f"--split {text!r}: the weights sum to 0, so no split gets any data; {hint}")
    return normalize(values + [0.0] * (3 - len(values)))


def split_bounds(split: str) -> list[tuple[float, float] | None]:
    """Each split's ``(lo, hi)`` fraction of the documents, or None for an empty split."""
    bounds, lo = [], 0.0
    for fraction in parse_split(split):
        hi = lo + fraction
        bounds.append((lo, hi) if hi > lo else None)
        lo = hi
    return bounds


def split_document_indices(num_documents: int, split: str) -> list[np.ndarray | None]:
    """The document indices of each split (Megatron rounds each boundary to the nearest integer)."""
    out = []
    for bound in split_bounds(split):
        if bound is None:
            out.append(None)
        else:
            beg, end = (round(b * float(num_documents)) for b in bound)
            out.append(np.arange(beg, end, dtype=np.int32))
    return out


def build_train_valid_test_datasets(
    data_prefixes_with_weights: str | Sequence[str | float],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] = (None, None, None),
    eod_token: int | None = None,
    eod_mask_loss: bool = False,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    open_dataset: Callable[[str], IndexedDataset] = IndexedDataset,
) -> list[GPTDataset | BlendedDataset | None]:
    """The train, valid and test datasets (None for a split of zero width).

    ``num_samples[i]`` is how many samples split ``i`` must provide (``None``: one epoch). With
    a single prefix the split is a :class:`GPTDataset`; with several, a :class:`BlendedDataset`
    over one ``GPTDataset`` per prefix. ``cache_dir`` holds the index caches (default: a
    ``cache`` directory next to each dataset). With ``vocab_size`` (the tokenizer's), each sample is
    checked to hold only ids below it as it is read. ``open_dataset`` opens a prefix (a
    ``MockIndexedDataset`` for ``--mock-data``, an ``IndexedDataset`` without memory maps for
    ``--no-mmap-bin-files``).
    """
    prefixes, weights = parse_data_path(data_prefixes_with_weights)
    sizes = list(num_samples)
    if len(sizes) != 3:
        raise ValueError(f"num_samples needs one entry per split (train, valid, test), got {sizes}")
    common = {"seq_length": seq_length, "seed": seed, "eod_token": eod_token, "vocab_size": vocab_size}
    splits = _Splits(split, sizes, open_dataset, cache_dir, dict(common, eod_mask_loss=eod_mask_loss))
    if len(prefixes) == 1:
        single = splits.of_prefix(prefixes[0], sizes)
        splits.warn_unused()
        return single
    targets = None
    if weights is not None:
        weights = normalize(weights)
        for name, size in zip(SPLIT_NAMES, sizes):
            if size is None and split_bounds(split)[SPLIT_NAMES.index(name)] is not None:
                raise ValueError(f"blending with weights needs a sample count for the {name} split")
        targets = [[math.ceil((s or 0) * w) for s in sizes] for w in weights]
        buffers = [[math.ceil(t * (1 + MID_LEVEL_DATASET_SURPLUS)) for t in row] for row in targets]
    else:
        buffers = [[None, None, None] for _ in prefixes]
    parts = [splits.of_prefix(prefix, counts) for prefix, counts in zip(prefixes, buffers)]
    splits.warn_unused()
    return [_blend([p[i] for p in parts], i, weights, targets, sizes[i], cache_dir) for i in range(3)]


class _Splits:
    """Cuts one prefix's documents into the three splits, and remembers the empty splits nobody reads."""

    def __init__(
        self, split: str, sizes: list[int | None], open_dataset: Callable, cache_dir, common: dict
    ) -> None:
        self.split, self.sizes, self.open_dataset, self.cache_dir = split, sizes, open_dataset, cache_dir
        self.common = common  # GPTDataset's keyword arguments
        self.unused_empty: dict[str, list[str]] = {}

    def of_prefix(self, prefix: str, counts: Sequence[int | None]) -> list[GPTDataset | None]:
        indexed = self.open_dataset(prefix)
        datasets = []
        for name, docs, count, asked in zip(
            SPLIT_NAMES, split_document_indices(len(indexed), self.split), counts, self.sizes
        ):
            if docs is not None and len(docs) == 0 and asked == 0:
                self.unused_empty.setdefault(name, []).append(f"{prefix} ({len(indexed)} documents)")
                docs = None
            datasets.append(
                None
                if docs is None
                else GPTDataset(
                    indexed, docs, count, split_name=name, cache_dir=self.cache_dir, **self.common
                )
            )
        return datasets

    def warn_unused(self) -> None:
        """One warning (rank 0) for the empty splits that are never read."""
        if self.unused_empty and os.environ.get("RANK", "0") == "0":
            where = "; ".join(f"{name} split of {', '.join(p)}" for name, p in self.unused_empty.items())
            print_line(f"WARNING: --split {self.split} leaves no documents in the {where}; it is not used")


def _blend(members: list, i: int, weights, targets, asked: int | None, cache_dir) -> BlendedDataset | None:
    """Split ``i`` of every prefix blended: by the given weights, else by the members' sizes."""
    if any(m is None for m in members):
        return None
    if weights is not None:
        split_weights, size = weights, sum(row[i] for row in targets)
    else:
        split_weights = [len(m) for m in members]
        size = None if asked is None else min(asked, sum(split_weights))
    description = {"datasets": [m.cache_files[0].name for m in members], "split_name": SPLIT_NAMES[i]}
    blend_cache = cache_dir if cache_dir is not None else members[0].cache_files[0].parent
    return BlendedDataset(members, split_weights, size, cache_dir=blend_cache, description=description)


def build_per_split_datasets(
    paths: Sequence[str | Sequence[str | float] | None],
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] = (None, None, None),
    **kwargs,
) -> list[GPTDataset | BlendedDataset | None]:
    """``--train-data-path``/``--valid-data-path``/``--test-data-path``: each split from its own
    prefixes (or "weight prefix ..." blend), all of their documents, no ``--split``; None where no
    path is given. ``kwargs`` as for :func:`build_train_valid_test_datasets`."""
    datasets: list[GPTDataset | BlendedDataset | None] = []
    for i, path in enumerate(paths):
        if path is None:
            datasets.append(None)
            continue
        only_this = ",".join("1" if j == i else "0" for j in range(3))
        counts = [num_samples[i] if j == i else 0 for j in range(3)]
        datasets.append(
            build_train_valid_test_datasets(path, only_this, seq_length, seed, counts, **kwargs)[i]
        )
    return datasets

"""GPT pretraining samples: Megatron-LM's ``GPTDataset`` over an indexed dataset.

The documents of one split (a contiguous range of the indexed dataset's sequences) are
shuffled per epoch with the seed and concatenated; sample ``k`` is the window of
``seq_length + 1`` tokens starting at token ``k * seq_length`` of that stream (consecutive
samples share one token: the last label of one is the first input of the next). Epochs are
added until the stream holds the requested number of samples; the last partial window is
dropped. A seeded permutation of the samples is the order in which they are served.

Three arrays describe this, built as Megatron builds them (same ``RandomState`` call sequence,
so the same seed gives the same arrays as Megatron-LM):

* ``document_index`` [epochs * docs] int32: the shuffled documents, epoch after epoch;
* ``sample_index`` [samples + 1, 2]: (position in ``document_index``, token offset) where
  each sample starts; sample ``k`` runs to the start of sample ``k + 1`` inclusive;
* ``shuffle_index`` [samples] uint32: the serving order.

They are cached as ``.npy`` files keyed by a hash of everything they depend on, written
atomically, so a second construction (or another rank) loads instead of rebuilding.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import torch

from training.data.corpus import atomic_write_bytes
from training.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from training.data.jit import compiled
from training.errors import DataError

# Below this fraction of an epoch, the last epoch is shuffled separately (Megatron's rule) so
# its few samples are not spread over the whole run.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled (the final epoch apart if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def _fill_sample_index(lengths, document_index, seq_length, index):
    doc, start = 0, 0  # the stream position where document_index[doc] starts
    for k in range(len(index)):
        position = k * seq_length
        while doc + 1 < len(document_index) and start + lengths[document_index[doc]] <= position:
            start += lengths[document_index[doc]]
            doc += 1
        index[k, 0] = doc
        index[k, 1] = position - start
    index[0, 0] = 0  # Megatron anchors the first sample at (0, 0), even on an empty first document
    index[0, 1] = 0


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    """Start (document-index position, offset) of every ``seq_length + 1`` window, plus the end.

    Equal to Megatron's ``helpers.build_sample_idx`` with ``drop_last_partial_sequence`` and the
    extra token: window ``k`` starts at stream token ``k * seq_length``, located in the last document
    that starts at or before that token (empty documents are stepped over). One compiled pass over
    samples and documents, as Megatron's C++ helper.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    big = max(len(document_index), int(sequence_lengths.max(initial=0))) > np.iinfo(np.int32).max
    index = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    compiled(_fill_sample_index)(lengths, np.asarray(document_index), np.int64(seq_length), index)
    return index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class IndexCache:
    """``.npy`` arrays in ``cache_dir`` named by a hash of a JSON description of their inputs."""

    def __init__(self, cache_dir: str | os.PathLike, kind: str, description: dict) -> None:
        self.description = json.dumps(description, indent=2, sort_keys=True)
        digest = hashlib.md5(self.description.encode()).hexdigest()
        self.base = Path(cache_dir) / f"{digest}-{kind}"

    def path(self, name: str) -> Path:
        return Path(f"{self.base}-{name}.npy")

    def load(self, names: list[str]) -> dict[str, np.ndarray] | None:
        """The cached arrays (memory-mapped), or None if any is missing."""
        if not all(self.path(n).is_file() for n in names):
            return None
        return {n: np.load(self.path(n), mmap_mode="r") for n in names}

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            buf = io.BytesIO()
            np.save(buf, array)
            atomic_write_bytes(self.path(name), buf.getvalue())
        atomic_write_bytes(Path(f"{self.base}-description.json"), self.description.encode())


def _file_identity(prefix: str) -> dict:
    """What makes a cache stale if the data files are rewritten."""
    st = os.stat(index_file_path(prefix))
    return {"path": os.path.abspath(prefix), "idx_bytes": st.st_size, "idx_mtime_ns": st.st_mtime_ns}


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length GPT samples drawn from the documents ``indices`` of an indexed dataset.

    ``dataset[i]`` is a dict of ``[seq_length]`` tensors, as Megatron's ``GPTDataset`` returns
    them (without the attention mask: attention is causal): ``tokens`` (int64 inputs),
    ``labels`` (the inputs shifted by one), ``loss_mask`` (float; 0 where the *input* token is
    ``eod_token`` when ``eod_mask_loss``) and ``position_ids`` (``0 .. seq_length - 1``).
    ``built_anew_on_cache_miss`` tells whether the indices were built (True) or loaded. With
    ``vocab_size``, every sample's ids are checked to lie in ``[0, vocab_size)`` as it is read (a
    max and a min over ``seq_length + 1`` ids; the whole dataset is never scanned).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        indices: np.ndarray,
        num_samples: int | None,
        *,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        eod_token: int | None = None,
        eod_mask_loss: bool = False,
        cache_dir: str | os.PathLike | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if seq_length < 2:
            raise ValueError(f"--seq-length must be at least 2, got {seq_length}")
        if eod_mask_loss and eod_token is None:
            raise ValueError("eod_mask_loss needs the tokenizer's eod_token")
        self.indexed = indexed
        self.indices = np.asarray(indices, dtype=np.int32)
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.seed = seed
        self.split_name = split_name
        self.eod_token = eod_token
        self.eod_mask_loss = eod_mask_loss
        self.vocab_size = vocab_size
        self.tokens_per_epoch = int(np.sum(indexed.sequence_lengths[self.indices], dtype=np.int64))
        if self.tokens_per_epoch < 2:
            raise DataError(
                f"the {split_name} split of {indexed.prefix} has {len(self.indices)} documents and "
                f"{self.tokens_per_epoch} tokens: too few to draw samples from (adjust --split)"
            )
        in_memory = cache_dir is None and getattr(indexed, "in_memory", False)  # --mock-data
        if cache_dir is None:
            cache_dir = Path(indexed.prefix).parent / "cache" / "GPTDataset_indices"
        identity = getattr(indexed, "cache_identity", None)
        description = {
            "class": "GPTDataset",
            "dataset": identity() if identity is not None else _file_identity(indexed.prefix),
            "split": split_name,
            "documents": [int(self.indices[0]), int(self.indices[-1]) + 1, len(self.indices)],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "extra_token": 1,
        }
        cache = IndexCache(cache_dir, f"GPTDataset-{split_name}", description)
        names = ["document_index", "sample_index", "shuffle_index"]
        arrays = None if in_memory else cache.load(names)
        self.built_anew_on_cache_miss = arrays is None
        if arrays is None:
            arrays = dict(zip(names, self._build_indices()))
            if not in_memory:
                cache.save(arrays)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.cache_files = [cache.path(n) for n in names]

    def _num_epochs(self) -> int:
        if self.num_samples is None:
            return 1
        needed = self.num_samples * self.seq_length + 1
        return max(1, -(-needed // self.tokens_per_epoch))

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        num_epochs = self._num_epochs()
        separate_final_epoch = False
        if num_epochs > 1:
            before_final = ((num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length
            from_final = self.num_samples - before_final
            per_epoch = (self.tokens_per_epoch - 1) // self.seq_length
            assert 0 <= from_final <= per_epoch + 1
            separate_final_epoch = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(
            self.indexed.sequence_lengths, document_index, self.seq_length, num_epochs, self.tokens_per_epoch
        )
        total = len(sample_index) - 1
        shuffle_index = build_shuffle_index(before_final if separate_final_epoch else total, total, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (int64)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a {self.split_name} dataset of {len(self)}")
        k = int(self.shuffle_index[idx])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[k], self.sample_index[k + 1]
        seq = self.document_index
        if doc_beg == doc_end:
            parts = [self.indexed.get(int(seq[doc_beg]), int(off_beg), int(off_end - off_beg) + 1)]
        else:
            parts = [self.indexed.get(int(seq[doc_beg]), int(off_beg))]
            parts += [self.indexed.get(int(seq[i])) for i in range(doc_beg + 1, doc_end)]
            parts.append(self.indexed.get(int(seq[doc_end]), 0, int(off_end) + 1))
        tokens = np.concatenate(parts).astype(np.int64)
        if self.vocab_size is not None and (tokens.max() >= self.vocab_size or tokens.min() < 0):
            self._raise_out_of_vocabulary(idx, parts, [int(seq[d]) for d in range(doc_beg, doc_end + 1)])
        return tokens

    def _raise_out_of_vocabulary(self, idx: int, parts: list[np.ndarray], documents: list[int]) -> None:
        """Name the file, the document and the id: ``F.embedding`` would only say "index out of range"."""
        for part, document in zip(parts, documents):
            bad = part[(part >= self.vocab_size) | (part < 0)]
            if len(bad):
                break
        raise DataError(
            f"token id {int(bad[0])} in {data_file_path(self.indexed.prefix)} (sequence {document}, "
            f"{self.split_name} sample {idx}) is outside the tokenizer's {self.vocab_size} ids: the data "
            "was preprocessed with another tokenizer; rerun tools/preprocess_data.py with this "
            "run's --tokenizer-model (or --vocab-size)"
        )

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.sample_tokens(idx))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod_token] = 0.0
        position_ids = torch.arange(self.seq_length, dtype=torch.int64)
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}

"""Megatron-LM's memory-mapped indexed dataset (``.bin`` + ``.idx``), read and written.

The format is Megatron's byte for byte, so data preprocessed for Megatron-LM loads here and the
other way round. ``P.bin`` is the concatenation of every sequence's token ids in one numpy dtype
(little-endian, no header). ``P.idx`` is, in order:

=========================  ======================================================
``b"MMIDIDX\\x00\\x00"``     9-byte magic
``<Q`` version             always 1
``<B`` dtype code          see :data:`DTYPE_CODES`
``<Q`` sequence count      ``S``
``<Q`` document count      ``D + 1`` (the document index starts with a 0)
int32[S]                   sequence lengths, in tokens
int64[S]                   sequence pointers: byte offset of each sequence in ``.bin``
int64[D + 1]               document index: document ``d`` is sequences
                           ``[doc[d], doc[d + 1])``
=========================  ======================================================

With whole-document preprocessing (no sentence splitting) each non-empty document is one
sequence; an empty document owns no sequence, so its two bounds are equal.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from training.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34
_REBUILD = "rerun tools/preprocess_data.py to rebuild the pair"

# Megatron's ``DType`` enum: the code stored in the .idx header for each token dtype.
DTYPE_CODES: dict[type[np.number], int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
_DTYPE_FROM_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: type[np.number] | np.dtype) -> int:
    """The header code of a token dtype (``np.uint16`` -> 8, ``np.int32`` -> 4)."""
    return DTYPE_CODES[np.dtype(dtype).type]


def dtype_from_code(code: int) -> type[np.number]:
    """The token dtype of a header code; a clear error for codes Megatron does not define."""
    try:
        return _DTYPE_FROM_CODE[code]
    except KeyError:
        raise ValueError(f"unknown indexed-dataset dtype code {code}; known: {sorted(_DTYPE_FROM_CODE)}")


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's choice of token dtype: uint16 when the vocabulary has fewer than 65500 ids."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str | os.PathLike) -> str:
    """``prefix + ".bin"`` (the prefix is not a directory and has no extension)."""
    return os.fspath(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    """``prefix + ".idx"``."""
    return os.fspath(prefix) + ".idx"


def encode_index(
    dtype: type[np.number], sequence_lengths: Iterable[int], document_indices: Iterable[int]
) -> bytes:
    """The complete ``.idx`` file contents for the given sequences and documents."""
    lengths = np.asarray(list(sequence_lengths), dtype=np.int32)
    docs = np.asarray(list(document_indices), dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    header = INDEX_MAGIC + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", dtype_code(dtype))
    header += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs))
    return header + lengths.tobytes() + pointers.tobytes() + docs.tobytes()


class IndexedDataset:
    """Read-only, memory-mapped view of a ``prefix.bin``/``prefix.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapping, zero-copy);
    ``ds.get(i, offset, length)`` a slice of it. With ``mmap=False`` (``--no-mmap-bin-files``) the
    ``.bin`` file is read with plain file reads instead (the ``.idx`` is still mapped). Pickles by path, so it can cross process
    boundaries (data-loader workers) cheaply.
    """

    def __init__(self, prefix: str | os.PathLike, *, mmap: bool = True) -> None:
        self.prefix = os.fspath(prefix)
        self.mmap = mmap
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise DataError(
                    f"indexed dataset file {p} not found (--data-path prefix {self.prefix!r}; "
                    "a prefix names both P.bin and P.idx, without the suffix)"
                )
        idx_bytes = os.path.getsize(idx_path)
        if idx_bytes < HEADER_BYTES:
            what = (
                "is empty"
                if idx_bytes == 0
                else f"has {idx_bytes} bytes, fewer than its {HEADER_BYTES}-byte header"
            )
            raise DataError(f"index file {idx_path} {what}: {_REBUILD}")
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        if bytes(self._idx[: len(INDEX_MAGIC)]) != INDEX_MAGIC:
            raise DataError(f"{idx_path} is not a Megatron indexed-dataset index (bad magic)")
        version, code, num_seq, num_doc = struct.unpack_from("<QBQQ", bytes(self._idx[9:HEADER_BYTES]))
        if version != INDEX_VERSION:
            raise DataError(f"{idx_path}: unsupported index version {version} (expected 1)")
        try:
            self.dtype = dtype_from_code(code)
        except ValueError as err:
            raise DataError(f"{idx_path}: {err}") from None
        expected = HEADER_BYTES + num_seq * (4 + 8) + num_doc * 8
        if idx_bytes != expected:
            state = "is truncated" if idx_bytes < expected else "is corrupt"
            raise DataError(
                f"index file {idx_path} {state}: it has {idx_bytes} bytes but its header describes "
                f"{num_seq} sequences and {max(num_doc - 1, 0)} documents ({expected} bytes); {_REBUILD}"
            )
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, num_seq, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, num_seq, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._idx, np.int64, num_doc, offset)
        if num_doc == 0 or self.document_indices[-1] != num_seq:
            raise DataError(f"{idx_path}: document index does not end at the sequence count {num_seq}")
        self._check_data_size(idx_path, bin_path)
        size = os.path.getsize(bin_path)
        self._bin_path = bin_path
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if size and mmap else np.zeros(0, np.uint8)

    def _check_data_size(self, idx_path: str, bin_path: str) -> None:
        """The ``.bin`` holds exactly the tokens the ``.idx`` describes (O(1): the last sequence's end)."""
        itemsize = np.dtype(self.dtype).itemsize
        num_tokens = 0
        if len(self.sequence_lengths):
            num_tokens = int(self.sequence_pointers[-1]) // itemsize + int(self.sequence_lengths[-1])
        expected, size = num_tokens * itemsize, os.path.getsize(bin_path)
        if size == expected:
            return
        name = np.dtype(self.dtype).name
        problem = (
            f"data file {bin_path} has {size} bytes but {idx_path} describes {num_tokens} {name} "
            f"tokens ({expected} bytes)"
        )
        if size > expected and num_tokens and size % num_tokens == 0 and size // num_tokens in (2, 4, 8):
            hint = (
                f"the .bin holds {size // num_tokens}-byte token ids where the .idx says {itemsize}-byte "
                f"{name}: the two files were not written together"
            )
        elif size < expected:
            hint = f"the .bin is truncated; {_REBUILD}"
        else:
            hint = f"the .bin and .idx were not written together; {_REBUILD}"
        raise DataError(f"{problem}: {hint}")

    def __len__(self) -> int:
        """Number of sequences (documents, for whole-document preprocessing)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if no length)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        itemsize = np.dtype(self.dtype).itemsize
        start = int(self.sequence_pointers[idx]) + offset * itemsize
        if not self.mmap:  # --no-mmap-bin-files: one read per call, as Megatron's file reader
            with open(self._bin_path, "rb", buffering=0) as f:
                f.seek(start)
                return np.frombuffer(f.read(length * itemsize), self.dtype, length)
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def __getstate__(self) -> tuple[str, bool]:
        return self.prefix, self.mmap

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.__init__(state[0], mmap=state[1])

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        """Whether both files of the pair exist."""
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` incrementally and the matching ``.idx`` on :meth:`finalize`.

    Both files are written under temporary names and renamed into place only by
    ``finalize``, so an interrupted run never leaves a truncated pair behind, nor clobbers an
    existing one.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype: type[np.number] = np.int32) -> None:
        self.bin_path = Path(bin_path)
        self.dtype = np.dtype(dtype).type
        dtype_code(self.dtype)  # validate early
        self._tmp_bin = self.bin_path.with_name(f".{self.bin_path.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 (stays open until finalize)
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (call :meth:`end_document` to close the document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last one)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Iterable[int] | np.ndarray, lengths: Iterable[int]) -> None:
        """Append a document made of sequences of the given lengths (``[]`` for an empty one)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != arr.size:
            raise ValueError(f"document has {arr.size} tokens but its sequence lengths sum to {sum(lengths)}")
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.end_document()

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Write the index and move both files into place."""
        self._file.close()
        idx_path = Path(idx_path)
        tmp_idx = idx_path.with_name(f".{idx_path.name}.{os.getpid()}.tmp")
        tmp_idx.write_bytes(encode_index(self.dtype, self.sequence_lengths, self.document_indices))
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

    def __del__(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None and not f.closed:  # abandoned without finalize: drop the partial file
            f.close()
            try:
                os.unlink(self._tmp_bin)
            except OSError:
                pass

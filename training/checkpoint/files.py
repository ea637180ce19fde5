"""Checkpoint files: atomic writes, a streaming safetensors writer with checksums, checked reads.

Every file is written under a temporary name in its directory (``.<name>.<random>.tmp``, created
with the usual ``0o666 & ~umask`` permissions so that teammates can read a run), fsynced and renamed
over the target: a reader sees the old file or the whole new one, never half of one. A killed save
can leave such temporary files behind; :func:`remove_stale_temp_files` deletes them and nothing else.

safetensors has no streaming writer, and a checkpoint converter must not hold a whole file in
memory, so :class:`TensorFileWriter` writes the (simple, documented) safetensors layout itself: the
header first, its offsets computed from the shapes declared up front, then each tensor's bytes at
its offset as it arrives, hashing as it goes. ``safetensors.safe_open`` and ``load_file`` read the result. Reads
go through :func:`read_piece` with plain ``readinto`` (no mmap, so a reader's memory is what it
holds, not the file) and verify each piece's checksum.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from training.checkpoint.format import CheckpointError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "TensorFileWriter",
    "atomic_write",
    "checksum",
    "file_layout",
    "flatten_state",
    "fsync_dir",
    "probe_writable",
    "read_header",
    "read_piece",
    "remove_stale_temp_files",
    "temp_path",
    "unflatten_state",
    "write_text",
]

TEMP_SUFFIX = ".tmp"
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


def checksum(data: bytes | memoryview) -> str:
    """xxh3-64 of ``data`` as 16 hex digits (several GB/s: cheap next to the disk)."""
    return xxhash.xxh3_64_hexdigest(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (little-endian, row-major), as safetensors stores them.

    For a contiguous CPU tensor this is a view of its memory (reading into it fills the tensor).
    """
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


# --------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------


def temp_path(path: str) -> str:
    """A fresh temporary name next to ``path`` (``.<name>.<8 hex>.tmp``, which startup cleans)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _open_new(path: str, mode: str = "wb"):
    """Create ``path`` exclusively with mode 0o666 filtered by the umask, like any other new file."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), mode)


def fsync_dir(path: str) -> None:
    """Make the renames in directory ``path`` durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """``write(fh)`` into a temporary file next to ``path``, fsync it, rename it over ``path``."""
    tmp = temp_path(path)
    try:
        with _open_new(tmp, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def write_text(path: str, text: str) -> None:
    """Atomically replace ``path`` with a file holding ``text``."""
    atomic_write(path, lambda fh: fh.write(text), mode="w")


def remove_stale_temp_files(root: str) -> list[str]:
    """Delete temporary files left by killed saves in ``root`` and its ``iter_*`` directories.

    Only names this module creates (``.<name>.<8 hex>.tmp``) are touched; finished files, and so
    every complete checkpoint, are left alone. Returns the paths removed.
    """
    removed = []
    directories = [root] + [
        os.path.join(root, d)
        for d in sorted(os.listdir(root))
        if (d.startswith("iter_") or d == "release") and os.path.isdir(os.path.join(root, d))
    ]
    for directory in directories:
        for name in os.listdir(directory):
            stem = name[: -len(TEMP_SUFFIX)] if name.endswith(TEMP_SUFFIX) else ""
            token = stem.rsplit(".", 1)[-1]
            if name.startswith(".") and len(token) == 8 and all(c in "0123456789abcdef" for c in token):
                os.unlink(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
    return removed


def probe_writable(directory: str, flag: str = "--save") -> None:
    """Create ``directory`` if needed and write, fsync and delete a file in it; OSError -> CheckpointError.

    Each caller uses its own file name, so every rank of a job can probe the same directory at once.
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{flag} {directory} is not a directory: it is a regular file")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = temp_path(os.path.join(directory, ".write_probe"))
        with _open_new(probe) as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
        os.unlink(probe)
    except OSError as err:
        raise CheckpointError(f"{flag} {directory} is not writable: {err.strerror or err}") from None


# --------------------------------------------------------------------------------------------------
# Writing safetensors files tensor by tensor
# --------------------------------------------------------------------------------------------------


def file_layout(
    entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[torch.dtype, tuple[int, ...], int]], int]:
    """A safetensors file's header bytes, ``{key: (dtype, shape, data offset)}`` and total size, for
    tensors declared as ``(key, dtype, shape)`` in file order (offsets count from the end of the header)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    slots: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
    offset = 0
    for key, dtype, shape in entries:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        slots[key] = (dtype, tuple(shape), offset)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    head = len(text).to_bytes(8, "little") + text
    return head, slots, len(head) + offset


class TensorFileWriter:
    """One safetensors file whose tensors are declared up front and then written in any order.

    ``entries`` are ``(key, dtype, shape)`` in file order; the header (with every offset) is written
    at once, and :meth:`write` puts each tensor's bytes at its own offset, so a tensor can be
    written whenever it is at hand. :meth:`close` checks every tensor was written, fsyncs and
    renames the file into place, and returns its record for the manifest:
    ``{"bytes": n, "checksum": header hash, "pieces": {key: {"checksum": h}}}``. Leaving a ``with``
    block by an exception removes the temporary file.
    """

    def __init__(
        self,
        path: str,
        entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self._header, self._slots, self.nbytes = file_layout(entries, metadata)
        self._pieces: dict[str, dict[str, str]] = {}
        self._tmp = temp_path(path)
        self._fh = _open_new(self._tmp)
        self._fh.write(self._header)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write declared tensor ``key`` (same dtype and shape as declared) at its place in the file."""
        if key not in self._slots or key in self._pieces:
            raise ValueError(
                f"{self.path}: tensor {key!r} was "
                + ("written twice" if key in self._pieces else "not declared")
            )
        dtype, shape, offset = self._slots[key]
        if (tensor.dtype, tuple(tensor.shape)) != (dtype, shape):
            raise ValueError(
                f"{self.path}: tensor {key!r} was declared {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        data = tensor_bytes(tensor)
        self._fh.seek(len(self._header) + offset)
        self._fh.write(data)
        self._pieces[key] = {"checksum": checksum(data)}

    def close(self, *, sync_dir: bool = True) -> dict[str, Any]:
        """Finish the file (fsync, rename into place) and return its manifest record.

        ``sync_dir=False`` leaves the directory's fsync (which makes the rename durable) to the
        caller, who can then do it once for many files with :func:`fsync_dir`.
        """
        missing = [key for key in self._slots if key not in self._pieces]
        if missing:
            raise ValueError(f"{self.path}: tensors {missing[:3]} were declared but never written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.path)
        if sync_dir:
            fsync_dir(os.path.dirname(self.path))
        pieces = {key: self._pieces[key] for key in self._slots}
        return {"bytes": self.nbytes, "checksum": checksum(self._header), "pieces": pieces}

    def abort(self) -> None:
        """Remove the unfinished file, even when closing it fails (a full disk fails the flush too)."""
        try:
            if not self._fh.closed:
                self._fh.close()
        except OSError:
            pass
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def read_header(path: str, expected: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The safetensors header of ``path`` after checking the file is whole.

    ``expected`` is the file's manifest record: its size and header checksum are then verified too.
    Entries get their absolute data offset under ``"start"``.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    bad = f"checkpoint file {path} is truncated or corrupt"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{bad}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CheckpointError(f"{bad}: its header claims {n} bytes but the file has {size}")
        raw = fh.read(n)
    if expected is not None and expected.get("bytes") not in (None, size):
        raise CheckpointError(
            f"{bad}: the manifest records {expected['bytes']} bytes but the file has {size}"
        )
    if expected is not None and expected.get("checksum") not in (None, checksum(head + raw)):
        raise CheckpointError(f"checkpoint file {path} is corrupt: its header does not match its checksum")
    try:
        header = json.loads(raw)
        end = 0
        for key, info in header.items():
            if key != "__metadata__":
                info["start"] = 8 + n + info["data_offsets"][0]
                end = max(end, info["data_offsets"][1])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise CheckpointError(f"{bad}: its safetensors header cannot be parsed") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{bad}: its header describes {8 + n + end} bytes but the file has {size}")
    return header


def _locate(path: str, header: Mapping[str, Any], key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, absolute start, bytes) of tensor ``key`` in a file whose header was read."""
    info = header.get(key)
    if info is None:
        raise CheckpointError(f"checkpoint file {path} has no tensor '{key}'")
    dtype = _TORCH_DTYPES.get(info["dtype"])
    if dtype is None:
        raise CheckpointError(f"checkpoint file {path}: tensor '{key}' has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    return dtype, tuple(info["shape"]), info["start"], end - begin


def read_rows_into(
    path: str,
    header: Mapping[str, Any],
    key: str,
    runs: Sequence[tuple[int, torch.Tensor]],
    *,
    expected_checksum: str | None = None,
) -> None:
    """Read rows of tensor ``key`` straight into memory: each run is ``(first row, destination)``.

    A destination is a contiguous tensor of whole rows (dim 0); no intermediate buffer is made.
    With ``expected_checksum`` the runs must cover the tensor in order; its bytes are hashed as
    they arrive and a mismatch names the file, the tensor and the word checksum.
    """
    _, shape, start, nbytes = _locate(path, header, key)
    rows = shape[0] if shape else 1
    row_bytes = nbytes // rows if rows else 0
    hasher = xxhash.xxh3_64() if expected_checksum is not None else None
    covered = 0
    with open(path, "rb", buffering=0) as fh:
        for first, dest in runs:
            if hasher is not None and first != covered:
                raise ValueError(
                    f"verifying '{key}' needs its rows in order: got row {first}, expected {covered}"
                )
            view = tensor_bytes(dest) if dest.numel() else memoryview(b"")
            fh.seek(start + first * row_bytes)
            got = fh.readinto(view) if len(view) else 0
            if got != len(view):
                raise CheckpointError(f"checkpoint file {path} is truncated: tensor '{key}' is cut short")
            if hasher is not None:
                hasher.update(view)
            covered = first + (len(view) // row_bytes if row_bytes else rows)
    if hasher is not None and (covered != rows or hasher.hexdigest() != expected_checksum):
        raise CheckpointError(
            f"checkpoint file {path}: the bytes of tensor '{key}' do not match their checksum "
            "(the file is corrupt; --no-verify-checkpoint skips this check)"
        )


def read_piece(
    path: str,
    header: Mapping[str, Any],
    key: str,
    *,
    expected_checksum: str | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Tensor ``key`` of the file, or only its rows ``[a, b)`` along dim 0 (one contiguous read).

    With ``expected_checksum`` the whole piece is read and verified before ``rows`` are cut from it.
    """
    dtype, shape, _, _ = _locate(path, header, key)
    if rows is None or expected_checksum is not None or not shape:
        out = torch.empty(shape, dtype=dtype)
        read_rows_into(path, header, key, [(0, out)], expected_checksum=expected_checksum)
        return out if rows is None or not shape else out[rows[0] : rows[1]]
    out = torch.empty((rows[1] - rows[0], *shape[1:]), dtype=dtype)
    read_rows_into(path, header, key, [(rows[0], out)])
    return out


# --------------------------------------------------------------------------------------------------
# Nested states (RNG) as tensors plus a JSON skeleton
# --------------------------------------------------------------------------------------------------


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], str]:
    """A nested state as its tensors (keyed by path, e.g. ``tracker/model-parallel-rng/cpu``) and a JSON skeleton."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = path or "."
            while key in tensors:
                key += "#"
            tensors[key] = obj
            return {"__tensor__": key}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: enc(v, f"{path}/{k}".lstrip("/")) for k, v in obj.items()}
            for k in obj:
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    raise TypeError(f"cannot store dict key {k!r} at '{path}' without pickle")
            return {"__dict__": [[k, enc(v, f"{path}/{k}".lstrip("/"))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            items = [enc(v, f"{path}/{i}".lstrip("/")) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else {"__tuple__": items}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalar
            return obj.item()
        raise TypeError(
            f"cannot store {type(obj).__name__} at '{path}' without pickle; use tensors, "
            "numbers, strings, lists and dicts"
        )

    skeleton = json.dumps(enc(state, ""))
    return tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: str) -> Any:
    """Inverse of :func:`flatten_state`."""

    def dec(obj: Any) -> Any:
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(dec(v) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: dec(v) for k, v in obj["__dict__"]}
        return {k: dec(v) for k, v in obj.items()}

    return dec(json.loads(skeleton))

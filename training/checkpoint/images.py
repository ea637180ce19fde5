"""A checkpoint file laid out whole in host memory, written with direct I/O: the asynchronous path.

An asynchronous save copies every tensor into host memory anyway, so it copies each straight to its
place in a :class:`FileImage`: one page-aligned buffer holding the file exactly as
:class:`~training.checkpoint.files.TensorFileWriter` would write it (same header, same offsets, so
the same bytes and checksums). :func:`write_image` then hands the whole buffer to the kernel with
``O_DIRECT``: the disk reads it by DMA, with no copy into the page cache. That copy is what a
buffered write spends its CPU on (about 1 s per GB here, against 0.03 s with direct I/O, and 0.1 s for
the checksums), CPU a training step on the same cores would otherwise lose; and a 3 GB checkpoint no
longer evicts the dataset's pages from the cache. Where the file system refuses ``O_DIRECT`` (tmpfs,
some FUSE mounts) or the platform lacks it, the same buffer is written through the page cache.

The file is still written under a temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Mapping

import torch

from training.checkpoint.files import checksum, file_layout, temp_path, tensor_bytes

__all__ = ["ALIGN", "FileImage", "write_image"]

ALIGN = 4096
"""Direct I/O needs buffer addresses, file offsets and lengths in multiples of the block size."""
_CHUNK = 64 << 20  # bytes per write call: large, and a multiple of ALIGN


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class FileImage:
    """One safetensors file in an aligned host buffer (pinned when its tensors come from a GPU).

    :meth:`layout` places tensors declared as ``(key, dtype, shape)``; the buffer is kept and reused
    by the next layout that fits in it. :meth:`slot` is the bytes of one tensor, to copy into.
    """

    def __init__(self, capacity: int, pin: bool) -> None:
        raw = torch.empty(_aligned(capacity) + ALIGN, dtype=torch.uint8, pin_memory=pin)
        start = -raw.data_ptr() % ALIGN
        self.buffer = raw[start : start + _aligned(capacity)]
        self.pinned = pin
        self.header = b""
        self.nbytes = 0
        self._slots: dict[str, tuple[int, int]] = {}

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def layout(
        self, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
    ) -> None:
        """Lay out a file of these tensors (it must fit: see :func:`image_size`) and write its header."""
        header, slots, nbytes = file_layout(entries, metadata)
        if nbytes > self.capacity:
            raise ValueError(f"a file of {nbytes} bytes does not fit an image of {self.capacity}")
        self.header, self.nbytes = header, nbytes
        self._slots = {}
        for key, (dtype, shape, offset) in slots.items():
            start = len(header) + offset
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self._slots[key] = (start, start + size)
        self.buffer[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def slot(self, key: str) -> torch.Tensor:
        """The bytes of tensor ``key`` in the file (a view of the buffer)."""
        start, end = self._slots[key]
        return self.buffer[start:end]

    def record(self) -> dict:
        """The manifest's record of the file, as ``TensorFileWriter.close`` returns it."""
        pieces = {key: {"checksum": checksum(tensor_bytes(self.slot(key)))} for key in self._slots}
        return {"bytes": self.nbytes, "checksum": checksum(self.header), "pieces": pieces}


def image_size(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]) -> int:
    """Bytes of the file these tensors make."""
    return file_layout(entries, metadata)[2]


def _open_direct(path: str) -> tuple[int, bool]:
    """Create ``path`` exclusively (mode 0o666 & ~umask) for writing; (fd, whether direct I/O is on)."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o666), True
        except OSError as err:
            if err.errno != errno.EINVAL:  # EINVAL: this file system does not do direct I/O
                raise
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), False


def _write_all(fd: int, data: memoryview, direct: bool) -> None:
    offset = 0
    while offset < len(data):
        written = os.write(fd, data[offset : offset + _CHUNK])
        offset += written
        if direct and offset % ALIGN and offset < len(data):  # a short write: finish through the cache
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            direct = False


def write_image(path: str, image: FileImage) -> dict:
    """Write ``image`` to ``path`` atomically (temporary name, fsync, rename; the directory's fsync is
    the caller's); its manifest record, checksums computed from the buffer."""
    record = image.record()
    tmp = temp_path(path)
    fd, direct = _open_direct(tmp)
    try:
        length = _aligned(image.nbytes) if direct else image.nbytes
        _write_all(fd, memoryview(image.buffer[:length].numpy()), direct)
        if length != image.nbytes:
            os.ftruncate(fd, image.nbytes)  # direct I/O wrote whole blocks
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return record

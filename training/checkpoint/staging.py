"""Host copies of a rank's checkpoint tensors: saving never allocates device memory.

A save writes the live tensors (the optimizer state as views, never cloned on the device, which
cost 12 bytes per parameter at once and ran large models out of memory) through host memory that
:class:`HostStaging` allocates once and reuses for every later save of the run, pinned when the
tensors live on a GPU so the copies run at full bandwidth:

* an asynchronous save (:meth:`HostStaging.stage`) copies every tensor, since training changes the
  live tensors while the copies are written: straight to its place in an image of its file
  (:class:`~training.checkpoint.images.FileImage`), which the writer hands to the disk with direct
  I/O. GPU copies are queued on the current stream and followed by an event that the writer, not
  the training thread, waits for; the next optimizer step, queued after them on the same stream,
  cannot change the state before they have read it. CPU tensors are copied by the writer thread
  (:meth:`HostStaging.copy_in`, a memcpy that releases the GIL) while the next iteration's forward
  and backward run, which only read them; the next optimizer step, the first thing to change them,
  waits for those copies (:meth:`HostStaging.wait_copied`, from a step pre-hook the saver installs).
  Copying on the training thread instead was most of an asynchronous save's stall on a CPU host.
* a synchronous save (:meth:`HostStaging.to_host`) needs no copy of a CPU tensor: training waits
  while the live tensor is written, so resident memory does not grow. A GPU tensor goes through one
  pinned buffer the size of the largest tensor, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from training.checkpoint.format import CheckpointError, iteration_dir
from training.checkpoint.images import ALIGN, FileImage, image_size

__all__ = ["FileToWrite", "HostStaging", "SaveRequest", "available_host_memory"]


@dataclass
class FileToWrite:
    """One safetensors file of this rank: its tensors in file order and what the manifest says of them."""

    tensors: dict[str, torch.Tensor]
    tp_rank: int
    metadata: dict[str, str]
    flat: dict[str, tuple[int, int]] = field(default_factory=dict)
    """``[start, end)`` of the TP shard that each 1-D piece holds (distributed optimizer)."""
    whole: frozenset[str] = frozenset()
    """Tensors not split over TP (an MoE expert's optimizer state on any TP rank): their pieces are
    TP shard 0, as the format has every unsplit tensor's, whichever TP rank writes them."""
    image: FileImage | None = None
    """The whole file in host memory, tensors copied in (an asynchronous save); None: write ``tensors``."""


@dataclass
class SaveRequest:
    """This rank's part of one checkpoint, as ``save.describe`` captured it at the save."""

    root: str
    iteration: int
    files: dict[str, FileToWrite]
    local: dict[str, Any]
    """What this rank tells rank 0 for the manifest, less the files' records (known once written)."""
    tokenizer: Mapping[str, Any] | None
    """``{"type", "files"}`` for rank 0 to copy in; None on the other ranks."""
    manifest: dict[str, Any]
    """Everything the manifest says of the run, frozen at the save (JSON values)."""
    commits: bool = False
    """This rank writes the manifest and the tracker (the first rank of every group)."""

    @property
    def path(self) -> str:
        return iteration_dir(self.root, self.iteration)


def available_host_memory() -> int | None:
    """Bytes the kernel could give this process without swapping (``MemAvailable``); None off Linux."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} bytes"


def _entries(tensors) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]


class HostStaging:
    """Reused host memory for one rank's checkpoint tensors (see the module docstring)."""

    def __init__(self) -> None:
        self._images: dict[str, FileImage] = {}
        self._bounce: torch.Tensor | None = None
        self._event = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied = threading.Event()
        self._copied.set()

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        bounce = 0 if self._bounce is None else self._bounce.numel()
        return bounce + sum(image.capacity for image in self._images.values())

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` readable by the host until the next call: itself on the CPU, else a copy in the
        reused pinned buffer (a synchronous save's path: one tensor at a time)."""
        if tensor.device.type == "cpu":
            return tensor
        size = _nbytes(tensor)
        if self._bounce is None or self._bounce.numel() < size:
            self._bounce = torch.empty(size, dtype=torch.uint8, pin_memory=tensor.is_cuda)
        host = self._bounce[:size].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)
        return host

    def stage(self, request: SaveRequest) -> SaveRequest:
        """``request`` with every file as a :class:`FileImage` that will hold copies of its tensors:
        GPU copies are queued now, CPU ones left to :meth:`copy_in`. Images are made at the first
        save, after checking the host can hold them, and reused."""
        self._check_room(request)
        files, cuda, pending = {}, False, []
        for name, spec in request.files.items():
            image = self._image(name, spec)
            for key, tensor in spec.tensors.items():
                source = tensor.detach()
                source = source if source.is_contiguous() else source.contiguous()
                source = source.reshape(-1).view(torch.uint8)
                if source.is_cuda:
                    image.slot(key).copy_(source, non_blocking=True)
                    cuda = True
                else:
                    pending.append((image.slot(key), source))
            files[name] = dataclasses.replace(spec, image=image)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._pending = pending
        if pending:
            self._copied.clear()
        return dataclasses.replace(request, files=files)

    def copy_in(self) -> None:
        """The writer's first step: copy the CPU tensors of the last :meth:`stage` into their images
        (releasing the GIL) and wait for its GPU copies. Whatever happens, :meth:`wait_copied` returns."""
        try:
            pending, self._pending = self._pending, []
            for slot, source in pending:
                np.copyto(slot.numpy(), source.numpy())
        finally:
            self._copied.set()
        if self._event is not None:
            self._event.synchronize()

    def wait_copied(self) -> None:
        """Block until :meth:`copy_in` has copied the CPU tensors (before anything changes them)."""
        self._copied.wait()

    def _image(self, name: str, spec) -> FileImage:
        entries = _entries(spec.tensors)
        pin = any(t.is_cuda for t in spec.tensors.values())
        image = self._images.get(name)
        if image is None or image.capacity < image_size(entries, spec.metadata) or image.pinned != pin:
            # room for a header that grows a little between saves (the RNG file's JSON skeleton)
            image = FileImage(image_size(entries, spec.metadata) + ALIGN, pin)
            self._images[name] = image
        image.layout(entries, spec.metadata)
        return image

    def _check_room(self, request: SaveRequest) -> None:
        """Refuse, naming the numbers, images the host cannot hold alongside the node's other ranks."""
        new = 0
        for name, spec in request.files.items():
            size = image_size(_entries(spec.tensors), spec.metadata)
            if name not in self._images or self._images[name].capacity < size:
                new += size
        available = available_host_memory()
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if available is None or new * ranks <= available:
            return
        raise CheckpointError(
            f"--async-save: staging checkpoint {request.path} in host memory needs {_size(new)} on this "
            f"rank (x {ranks} ranks on this node), but only {_size(available)} is available; save "
            "without --async-save (it writes the live tensors and needs no copy), or split the state "
            "over more ranks (TP, PP, --use-distributed-optimizer)"
        )

"""Count the bytes of live tensor storage, op by op: the measure the dry run and the real run share.

:class:`LiveBytes` is a ``TorchDispatchMode``: every ATen op's outputs pass through it, so every
storage a step allocates, in forward, in autograd's backward or in the optimizer, is seen once
(views share their base's storage and count once). A weak reference to each storage takes its bytes
off again when the last tensor using it dies. ``peak`` is the largest total seen after any op,
which is what ``torch.cuda.max_memory_allocated`` measures on a GPU, minus the caching allocator's
rounding and any scratch space a fused kernel allocates for itself.

Under ``FakeTensorMode`` the storages are fake (no memory behind them) but their sizes are real, so
the same count runs for a 405B model on a laptop. A fake tensor cannot say what it holds, so with
``answer_scalars`` every ``.item()`` answers 1 (True for a boolean): a finite gradient norm, a token
count, Adam's step count. The caller takes care of the one question where 1 means trouble (the fp16
loss scaler's overflow check). The random generators' states are real tensors; copies of them stay
real (the RNG tracker swaps them in and out around dropout and recomputation).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]

_SCALAR = torch.ops.aten._local_scalar_dense.default
_CLONE = torch.ops.aten.clone.default


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes and their peak while the mode is entered (see the module docstring)."""

    def __init__(self, *, answer_scalars: bool = False) -> None:
        super().__init__()
        self.answer_scalars = answer_scalars
        self.live = 0
        self.peak = 0
        self.peak_label = ""
        self.label = ""
        """What the caller says is running (e.g. ``"0F3"``); recorded with the peak."""
        self._storages: dict[int, tuple[weakref.ref, list[int]]] = {}

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak, self.peak_label = self.live, self.label

    @contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Name what runs inside, so a peak reached there says where it was."""
        before, self.label = self.label, label
        try:
            yield
        finally:
            self.label = before

    def _track(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors
            return
        key, size = id(storage), storage.nbytes()
        known = self._storages.get(key)
        if known is not None and known[0]() is storage:
            grown = size - known[1][0]  # resized in place (resize_, out= ops)
            if not grown:
                return
            known[1][0] = size
            self.live += grown
        else:
            cell = [size]

            def gone(_ref: weakref.ref, key: int = key, cell: list[int] = cell) -> None:
                self.live -= cell[0]
                if key in self._storages and self._storages[key][0] is _ref:
                    del self._storages[key]

            self._storages[key] = (weakref.ref(storage, gone), cell)
            self.live += size
        if self.live > self.peak:
            self.peak, self.peak_label = self.live, self.label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.answer_scalars:
            if func is _SCALAR:
                return True if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
            if func is _CLONE and not isinstance(args[0], FakeTensor):  # a generator's state stays real
                with _disable_current_modes():
                    return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

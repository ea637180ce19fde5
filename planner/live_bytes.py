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
loss scaler's overflow check). What is real stays real: an op whose inputs are all real tensors runs
on them (the random generators' states, which the RNG tracker swaps around dropout and
recomputation; the balanced routing the dry run gives MoE layers, whose token counts decide every
expert's shapes), and an all-gather of real tensors gives every rank the same share.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from core.distributed.sharded_bucket import observe_resizes

__all__ = ["LiveBytes"]

_SCALAR = torch.ops.aten._local_scalar_dense.default
_ALL_GATHER = getattr(getattr(torch.ops, "c10d", None), "_allgather_base_", None)
_ALL_GATHER = _ALL_GATHER.default if _ALL_GATHER is not None else None


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

    def __enter__(self):
        """Also count the resizes of ZeRO-2/3's buckets while inside (they free and re-allocate their full
        buckets with ``UntypedStorage.resize_``, which does not pass through the dispatcher): the buckets
        report each one (:func:`core.distributed.sharded_bucket.observe_resizes`)."""
        self._resizes = observe_resizes(self._track_storage)
        self._resizes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.__exit__(None, None, None)

    def _track(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors
            return
        self._track_storage(storage)

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
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
        kwargs = kwargs or {}
        if self.answer_scalars:
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
                out = _real(func, args, kwargs)
                self._track_all(out)
                return out
            if func is _SCALAR:
                return True if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        out = func(*args, **kwargs)
        self._track_all(out)
        return out

    def _track_all(self, out) -> None:
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)


def _real(func, args, kwargs):
    """An op on real tensors only, run for real; an all-gather over the fake process group (which
    moves nothing) gives every rank's share as this rank's: the ranks are alike in a dry run."""
    with _disable_current_modes():
        out = func(*args, **kwargs)
        if func is _ALL_GATHER:
            gathered, mine = args[0], args[1]
            gathered.view(-1, mine.numel()).copy_(mine.reshape(1, -1))
    return out

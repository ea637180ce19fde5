"""Count the calls that make the host wait for a CUDA device, on a CPU run.

On a GPU the host queues kernels and runs ahead; it stops and waits for the device when it needs a
value (``item``, ``tolist``, ``bool``/``float``/``int``/``format`` of a tensor, ``numpy``), an output
whose size depends on the data (``nonzero``, ``masked_select``, ``unique``), or a copy that is not
asynchronous (``.cpu()``, ``.to(device)`` without ``non_blocking=True``, ``torch.tensor(data,
device=...)``). On a CPU run none of these waits, but the code makes the same calls, so a
``TorchFunctionMode`` that sees every tensor call counts them. What it cannot tell on a CPU is a
host tensor from a device one: a ``.tolist()`` of a host-side index is counted too; the stack of
each call says where it came from (``HostWaitCounter.where``).

    with HostWaitCounter() as counter:
        pretrain(..., iteration_hook=counter.next_iteration)
    counter.per_iteration()   # {iteration: number of waits}; setup counts in iteration 1
"""

from __future__ import annotations

import traceback
from collections import defaultdict

import torch
from torch.overrides import TorchFunctionMode

READS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__format__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
}
"""Calls that need a value from the device (or an output sized by one)."""

COPIES = {"cpu", "cuda", "to", "copy_", "tensor", "as_tensor"}
"""Calls that copy between host and device; they wait unless ``non_blocking=True`` (see :func:`_copies`)."""


def _copies(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether this copy-like call moves data between host and device and waits for it.

    ``cpu()``/``cuda()`` always move (a no-op where the tensor is there already, but the code asks
    for a move). ``to(...)`` moves when it names a device; ``torch.tensor``/``as_tensor`` copy
    Python data to a device when they name one. ``copy_`` is a move only between tensors on
    different devices, which a CPU run cannot see, so it is not counted.
    """
    if kwargs.get("non_blocking") or (name == "to" and len(args) > 2 and args[2] is True):
        return False
    if name in ("cpu", "cuda"):
        return True
    if name == "to":
        return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
    if name in ("tensor", "as_tensor"):
        return kwargs.get("device") is not None
    return False


class HostWaitCounter(TorchFunctionMode):
    """Records every call that would make the host wait on CUDA, per iteration of the training loop.

    ``next_iteration`` is the ``iteration_hook`` of ``pretrain()``: the calls before the first hook
    belong to iteration 1 (with setup), those after hook ``i`` to iteration ``i + 1`` (the last
    iteration's hook is followed by the end of training, counted as iteration N + 1).
    """

    def __init__(self) -> None:
        super().__init__()
        self.iteration = 1
        self.calls: dict[int, list[tuple[str, str]]] = defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name in COPIES and _copies(name, args, kwargs)):
            self.calls[self.iteration].append((name, _caller()))
        return func(*args, **kwargs)

    def next_iteration(self, state) -> None:
        self.iteration = state.iteration + 1

    def per_iteration(self) -> dict[int, int]:
        return {i: len(c) for i, c in sorted(self.calls.items())}

    def count(self, iteration: int) -> int:
        return len(self.calls.get(iteration, []))

    def where(self, iteration: int) -> list[str]:
        """``name at file:line`` of each wait in ``iteration`` (for an assertion message)."""
        return [f"{name} at {where}" for name, where in self.calls.get(iteration, [])]


def _caller() -> str:
    """The innermost project frame that made the call (not torch's own)."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_waits.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"

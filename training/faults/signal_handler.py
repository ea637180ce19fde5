"""SIGTERM as a request to save and stop: Megatron's ``--exit-signal-handler``, agreed across ranks."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from core.device import current_device

if TYPE_CHECKING:
    from typing_extensions import Self


class SignalHandler:
    """Records SIGTERM (or ``sig``) inside a ``with`` block instead of dying, so the loop can save and exit.

    ``signals_received()`` is a collective (an all-gather of one flag per rank, like Megatron's
    ``DistributedSignalHandler``): call it on every rank at the same iteration and stop if ``any``.
    """

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> Self:
        self.received = False
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = True

    def signals_received(self) -> list[bool]:
        """Whether each rank has received the signal (just this rank's flag without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return [self.received]
        flag = torch.tensor([int(self.received)], device=current_device())
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, flag)
        return [bool(f.item()) for f in flags]

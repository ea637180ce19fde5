"""Waiting for ranks spawned with ``multiprocessing``: a result, or a clear error as soon as one dies."""

from __future__ import annotations

import queue as queues
import time
from typing import Any

__all__ = ["first_result"]


def first_result(queue, procs: list, timeout: float, what: str) -> Any:
    """The first result a rank puts in ``queue``; a ``RuntimeError`` as soon as one of ``procs`` exits
    with an error (instead of waiting out ``timeout``), a ``TimeoutError`` after it. ``what`` names
    the ranks in the message (``"calibration"``, ``"benchmark"``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a {what} rank failed (exit codes {dead}); see its traceback above"
                ) from None
    raise TimeoutError(f"{what} ranks did not finish within {timeout:.0f} s")

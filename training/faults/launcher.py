"""A worker process's relation to its launcher: it ends when torchrun is gone, and it ends without the
interpreter's finalization (where gloo's threads can abort it)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

PR_SET_PDEATHSIG = 1
_launcher_watched = False


def watch_launcher(poll_seconds: float = 1.0) -> None:
    """Under torchrun, send this process SIGTERM when torchrun (its parent) dies."""
    global _launcher_watched
    if "TORCHELASTIC_RUN_ID" not in os.environ or _launcher_watched:
        return
    _launcher_watched = True
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    def watch() -> None:
        # The parent-death signal alone misses a parent that died before prctl, and exists on Linux only.
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="trident-launcher-watch", daemon=True).start()


def end_process(code: int | str | None = 0) -> NoReturn:
    """End this process with ``code`` (as ``sys.exit`` reads it), skipping the interpreter's finalization.

    A gloo worker thread drops a finished collective's tensors a moment after the caller's ``wait``
    returned. If that moment falls in the interpreter's finalization, the thread cannot take the GIL
    and the process aborts ("terminate called without an active exception", SIGABRT) after its work
    is done, so torchrun reports a failed job. An entry point therefore does what finalization would
    (join the remaining non-daemon threads, run the ``atexit`` handlers, flush) and ends with
    ``os._exit``.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # What finalization does first: the threading module's own exit hooks (they stop idle thread pools,
    # e.g. inductor's compile workers, which would otherwise wait for work forever), then a join of every
    # non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


@contextlib.contextmanager
def ending_the_process() -> Iterator[None]:
    """The entry point's block: when it ends, normally or with ``SystemExit``, :func:`end_process`."""
    try:
        yield
    except SystemExit as stop:
        end_process(stop.code)
    end_process(0)

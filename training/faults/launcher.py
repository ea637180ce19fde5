"""A torchrun worker whose torchrun is gone ends too: the parent-death signal and a watching thread."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

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

"""Run control the training loop consults between steps: ``--manual-gc`` and ``--exit-duration-in-mins``."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator


class ManualGC:
    """``--manual-gc``: Python's collector off, and a full collection at the same points on every rank.

    A collection pauses a rank for a moment; left to the automatic collector, the ranks pause at
    different times and every collective waits for the slowest. Collecting at fixed steps lines the
    pauses up. Use as a context manager around training; it turns the collector back on at exit.
    """

    def __init__(self, *, enabled: bool, interval: int, around_eval: bool) -> None:
        self.enabled, self.interval, self.around_eval = enabled, interval, around_eval

    def __enter__(self) -> None:
        if self.enabled:
            gc.disable()
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.enabled:
            gc.enable()

    def after_step(self, iteration: int) -> None:
        """Collect after every ``--manual-gc-interval``-th step."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Collect before and after an evaluation (unless ``--no-manual-gc-eval``)."""
        if self.enabled and self.around_eval:
            gc.collect()
        yield
        if self.enabled and self.around_eval:
            gc.collect()


class ExitTimer:
    """``--exit-duration-in-mins``: true once the run has lasted that long on any rank.

    ``any_rank`` reduces a local bool over all ranks (a MAX all-reduce), so every rank stops after
    the same step and the checkpoint they save together is complete.
    """

    def __init__(self, minutes: float | None, any_rank: Callable[[bool], bool]) -> None:
        self.minutes, self.any_rank = minutes, any_rank
        self.start = time.monotonic()

    def expired(self) -> bool:
        if self.minutes is None:
            return False
        return self.any_rank(time.monotonic() - self.start > 60 * self.minutes)

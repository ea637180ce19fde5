"""Run a function on N real ranks: spawned processes, a gloo process group, a fresh file rendezvous.

``RankPool`` keeps its processes (and their process group) alive between calls, so a test module
pays the spawn and rendezvous cost once. Any failure or timeout tears the pool down; the next call
starts a new one, so one broken test never poisons the next.

    pool = RankPool(4)
    results = pool.run(fn, arg, timeout=60)   # fn(rank, world_size, arg) on every rank
    pool.close()

The function must be importable by name (a module-level function), as ``spawn`` pickles it.
A rank's exception is re-raised here with that rank's traceback; a rank that does not answer
within ``timeout`` seconds fails the call with the ranks still running named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT = 120.0


class RankFailure(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _worker(rank: int, world_size: int, init_file: str, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outcome = (rank, True, fn(rank, world_size, *args, **kwargs))
        except BaseException:  # noqa: BLE001 - a rank reports every failure to the parent
            outcome = (rank, False, traceback.format_exc())
        # Tear the task's groups down before reporting: the parent starts the next task only when
        # every rank has reported, so no rank builds new groups while a peer still destroys old ones.
        _reset_parallel_state()
        results.put(outcome)
    dist.destroy_process_group()


def _reset_parallel_state() -> None:
    import sys

    ps = sys.modules.get("core.parallel_state")
    if ps is not None and getattr(ps, "model_parallel_is_initialized", lambda: False)():
        ps.destroy_model_parallel()


class RankPool:
    """``world_size`` spawned ranks sharing one gloo process group, reused across calls."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list[mp.Process] = []

    def _start(self, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="trident-ranks-")
        init_file = os.path.join(self._tmpdir, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(timeout, what="process-group start-up")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline_left = timeout
        import time

        end = time.monotonic() + timeout
        while len(values) + len(failures) < self.world_size:
            deadline_left = end - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(0.05, min(deadline_left, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in values]
                if dead or deadline_left <= 0:
                    pending = sorted(set(range(self.world_size)) - set(values) - set(failures))
                    self.close(force=True)
                    if failures:
                        break
                    if dead:
                        raise RankFailure(
                            f"{what}: rank(s) {dead} died without reporting (exit codes "
                            f"{[self._procs[r].exitcode for r in dead] if self._procs else '?'})"
                        )
                    raise TimeoutError(
                        f"{what}: rank(s) {pending} did not finish within {timeout:.0f}s "
                        "(deadlock or hang); the rank pool was torn down"
                    )
                continue
            if ok:
                values[rank] = value
            else:
                failures[rank] = value
                # Give the other ranks a moment to report their own errors, then stop waiting:
                # a rank that raised usually leaves its peers blocked in a collective.
                end = min(end, time.monotonic() + 2.0)
        if failures:
            self.close(force=True)
            first = min(failures)
            others = sorted(set(failures) - {first})
            raise RankFailure(
                f"{what}: rank {first} raised"
                + (f" (also ranks {others})" if others else "")
                + f":\n{failures[first]}"
            )
        return [values[r] for r in range(self.world_size)]

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
        if not self._procs:
            self._start(timeout=max(timeout, 60.0))
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout, what=getattr(fn, "__name__", "task"))

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """One-shot form of ``RankPool``: spawn, run ``fn`` on every rank, tear down."""
    pool = RankPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()

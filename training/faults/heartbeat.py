"""The heartbeat watchdog around a run: a rank that stops answering ends the job, named.

:func:`begin` starts :class:`core.watchdog.Watchdog` once ``torch.distributed`` is up, :func:`phase`
tells it what the main thread is doing, :func:`end` stops it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from core import parallel_state as ps
from core.pipeline_parallel.hooks import ScheduleHooks
from core.pipeline_parallel.position import SchedulePosition
from core.watchdog import HEARTBEAT_KEY, Heartbeat, Watchdog
from training.faults import reporting
from training.faults.injection import inject

TEST_TIMEOUT_ENV = "TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS"
TEST_GROUP_TIMEOUT_ENV = "TRIDENT_TEST_PROCESS_GROUP_TIMEOUT_SECONDS"
_generation = 0  # pretrain() calls so far; every rank counts the same, so their store keys match


def distributed_timeout_seconds(minutes: float) -> float:
    """``--distributed-timeout-minutes`` in seconds."""
    return float(minutes) * 60.0


def process_group_timeout_minutes(minutes: float) -> float:
    """The process groups' timeout: ``--distributed-timeout-minutes``, or in a test that waits for a
    backend's timeout ``TRIDENT_TEST_PROCESS_GROUP_TIMEOUT_SECONDS`` (the flag counts whole minutes)."""
    override = os.environ.get(TEST_GROUP_TIMEOUT_ENV)
    return float(override) / 60.0 if override else float(minutes)


def _watchdog_timeout(minutes: float) -> tuple[float, str]:
    override = os.environ.get(TEST_TIMEOUT_ENV)
    if override:
        return float(override), f"{TEST_TIMEOUT_ENV}={override}"
    return distributed_timeout_seconds(minutes), f"--distributed-timeout-minutes {minutes}"


def _end_silently_or_report(message: str) -> None:
    """The watchdog found a silent rank: the job's one report, then this process ends at once.

    The main thread is blocked inside a collective that will not return, so the process cannot
    unwind; ``os._exit`` ends it without waiting for it.
    """
    reporting.dump_flight_recorder()
    if reporting.claim():
        watchdog = reporting.watchdog  # every rank still answering writes its post-mortem first
        notes = reporting.post_mortem(watchdog.silent_ranks()) if watchdog is not None else ()
        reporting.print_error(f"{reporting.prog()}: error: {message}")
        for note in notes:
            reporting.print_error(note)
        reporting.announce_printed()
    else:
        reporting.wait_until_printed()
    _exit_now(reporting.EXIT_FAILURE)


def _end_quietly() -> None:
    """Another rank reported the job's error while this one waits for it: nothing will come."""
    if not reporting.claimed():
        reporting.dump_flight_recorder()
        reporting.wait_until_printed()
        _exit_now(reporting.EXIT_FAILURE)


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def begin(timeout_minutes: float) -> None:
    """A run starts (torch.distributed is up): a fresh report claim, and the watchdog for a world > 1.

    ``timeout_minutes``: ``--distributed-timeout-minutes``, how long a silent rank may stay silent.
    """
    global _generation
    from torch.distributed import PrefixStore, distributed_c10d

    _generation += 1
    dist = reporting.distributed()
    if dist is None:
        reporting.use_store(None, 0)
        return
    job = ps.attempt_store()  # this launch attempt's keys, which a restarted attempt can read
    store = PrefixStore(f"trident/run{_generation}", job or distributed_c10d._get_default_store())
    reporting.use_store(store, dist.get_rank())
    timeout, setting = _watchdog_timeout(timeout_minutes)
    reporting.watchdog = Watchdog(
        store,
        dist.get_rank(),
        dist.get_world_size(),
        timeout,
        on_silent=_end_silently_or_report,
        on_reported_elsewhere=_end_quietly,
        timeout_setting=setting,
    ).start()


def last_beats(attempt: int) -> list[float]:
    """Wall times of each rank's last heartbeat in launch attempt ``attempt`` (rank order; empty
    outside torchrun). A restarted process's previous attempt ran one ``pretrain()``: its first run."""
    from torch.distributed import PrefixStore

    job = ps.attempt_store(attempt)
    if job is None:
        return []
    store, beats = PrefixStore("trident/run1", job), []
    while store.check([key := HEARTBEAT_KEY.format(rank=len(beats))]):
        beats.append(Heartbeat.decode(store.get(key)).wall_time)
    return beats


def end() -> None:
    """The run is over (successfully or not): stop the watchdog, leaving a ``done`` heartbeat."""
    if reporting.watchdog is not None:
        reporting.watchdog.stop()
        reporting.watchdog = None
    reporting.position = None


def _schedule_begins(position: SchedulePosition) -> None:
    watchdog = reporting.watchdog
    if watchdog is not None:
        position.iteration = watchdog.iteration
        watchdog.at(position)


def watched(hooks: ScheduleHooks) -> ScheduleHooks:
    """``hooks`` that keep a :class:`SchedulePosition` the run's watchdog follows, so that a hang names
    the action and the message every rank waits for, and each rank's post-mortem holds its table (the
    same hooks when no watchdog runs: a world of one)."""
    if reporting.watchdog is None:
        return hooks
    reporting.position = SchedulePosition(on_begin=_schedule_begins)
    return dataclasses.replace(hooks, position=reporting.position)


def phase(what: str, iteration: int | None = None, point: str | None = None) -> None:
    """The main thread starts ``what`` (of ``iteration``); the watchdog's measure of progress.

    ``point``: the fault-injection point this is (``training.faults.injection``), if any."""
    if reporting.watchdog is not None:
        reporting.watchdog.enter(what, iteration)
    if point is not None:
        inject(point, iteration)

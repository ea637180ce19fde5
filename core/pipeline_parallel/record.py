"""What a run of a schedule did, for tests, timelines and benchmarks.

Times are taken by the record's clock. On a CPU that is the host's ``time.perf_counter``. On a GPU
the host only queues the work, so its clock says when a kernel was launched, not when it ran:
:class:`CudaClock` records CUDA events on the current stream instead, read (one wait) when the
record is turned into seconds by :meth:`ScheduleRecord.timed`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from core.pipeline_parallel.placement import Placement


class Event(NamedTuple):
    """One timed thing a rank did: a table action (``kind`` its name), or a wait for a received message
    (``WAIT_F`` an activation, ``WAIT_B`` a gradient; ``chunk`` the one that needs it). ``start`` and
    ``end`` are the clock's stamps: seconds on the host clock, CUDA events on :class:`CudaClock`."""

    kind: str
    microbatch: int
    chunk: int
    start: Any
    end: Any


class HostClock:
    """The host's time in seconds: when the work ran, on a CPU."""

    name = "host"

    def now(self) -> float:
        return time.perf_counter()

    def seconds(self, origin: float, stamp: float) -> float:
        return stamp - origin


class CudaClock:
    """CUDA events on the current stream: when the GPU got to that point, not when the host queued it."""

    name = "cuda"

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, origin: torch.cuda.Event, stamp: torch.cuda.Event) -> float:
        stamp.synchronize()
        return origin.elapsed_time(stamp) / 1e3


def clock_for(device: torch.device) -> HostClock | CudaClock:
    """The clock that says when work on ``device`` ran."""
    return CudaClock() if device.type == "cuda" else HostClock()


@dataclass
class ScheduleRecord:
    """Pass one to a schedule (``record=``) to have it filled."""

    events: list[Event] = field(default_factory=list)
    clock: HostClock | CudaClock = field(default_factory=HostClock)
    comm_log: list[tuple] = field(default_factory=list)  # as simulator.comm_logs describes
    peak_in_flight: int = 0
    num_tokens: torch.Tensor | None = None
    start: Any = 0.0  # the clock's stamps around the whole schedule
    end: Any = 0.0
    finalized: Any = None
    """The clock's stamp when ``finalize_model_grads`` returned (the data-parallel reduction waited for,
    TP and tied-weight gradient reductions): its span from ``end`` is the step's exposed reduction."""
    tables: tuple | None = None  # every rank's complete table, as run
    placement: Placement | None = None

    def timed(self, origin) -> list[Event]:
        """The events in seconds since ``origin`` (a stamp of the same clock). A compute action that
        waited for its input starts where that wait (its own event, just before it) ended."""
        events: list[Event] = []
        for event in self.events:
            start, end = self.clock.seconds(origin, event.start), self.clock.seconds(origin, event.end)
            previous = events[-1] if events else None
            if (
                previous is not None
                and previous.kind.startswith("WAIT")
                and not event.kind.startswith("WAIT")
            ):
                start = max(start, previous.end)
            events.append(Event(event.kind, event.microbatch, event.chunk, start, end))
        return events

"""What a run of a schedule did, for tests, timelines and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from core.pipeline_parallel.placement import Placement


class Event(NamedTuple):
    """One timed thing a rank did: a table action (``kind`` its name), or a wait for a received message
    (``WAIT_F`` an activation, ``WAIT_B`` a gradient; ``chunk`` the one that needs it)."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class ScheduleRecord:
    """Pass one to a schedule (``record=``) to have it filled."""

    events: list[Event] = field(default_factory=list)
    comm_log: list[tuple] = field(default_factory=list)  # as simulator.comm_logs describes
    peak_in_flight: int = 0
    num_tokens: torch.Tensor | None = None
    start: float = 0.0
    end: float = 0.0
    tables: tuple | None = None  # every rank's complete table, as run
    placement: Placement | None = None

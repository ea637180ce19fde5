"""Time schedule tables without processes: makespan, bubble, peak in-flight activations, deadlocks.

Each rank runs its table in order; an action starts when its rank is free and its inputs exist:
``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs ``B(mb, s+1)`` (the last stage needs its own
forward). Sends are asynchronous, as in the executor, so a rank never waits for a receiver. If no
rank can start its next action, the tables deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.pipeline_parallel.schedule_tables import Action, stage_of

Cost = float | Callable[[Action, int], float]


class ScheduleDeadlock(RuntimeError):
    """The tables wait on each other in a cycle."""


@dataclass
class SimulationResult:
    makespan: float
    busy: list[float]  # compute time per rank
    peak_in_flight: list[int]  # max microbatch-chunks forwarded but not yet backwarded, per rank
    start_times: list[list[float]]  # per rank, per action in table order

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the makespan."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def _cost(cost: Cost, action: Action, rank: int) -> float:
    return cost(action, rank) if callable(cost) else float(cost)


def simulate(
    tables: list[list[Action]],
    vpp_size: int = 1,
    forward_cost: Cost = 1.0,
    backward_cost: Cost = 2.0,
    comm_latency: float = 0.0,
) -> SimulationResult:
    """Run the tables on an ideal machine; raises ``ScheduleDeadlock`` naming the stuck actions.

    ``forward_cost``/``backward_cost`` are numbers or ``f(action, rank)``; ``comm_latency`` is added to
    every dependency that crosses ranks.
    """
    pp = len(tables)
    last_stage = pp * vpp_size - 1
    finished: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> finish time
    cursor = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    in_flight, peak = [0] * pp, [0] * pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    remaining = sum(len(t) for t in tables)
    while remaining:
        progressed = False
        for rank in range(pp):
            while cursor[rank] < len(tables[rank]):
                action = tables[rank][cursor[rank]]
                stage = stage_of(rank, action.chunk, pp)
                ready = _ready_time(action, stage, last_stage, pp, finished, comm_latency)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                duration = _cost(forward_cost if action.kind == "F" else backward_cost, action, rank)
                clock[rank] = start + duration
                busy[rank] += duration
                finished[(action.kind, action.microbatch, stage)] = clock[rank]
                starts[rank].append(start)
                in_flight[rank] += 1 if action.kind == "F" else -1
                peak[rank] = max(peak[rank], in_flight[rank])
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(tables[r][cursor[r]]) for r in range(pp) if cursor[r] < len(tables[r])}
            raise ScheduleDeadlock(f"schedule deadlocks: every rank waits (rank: next action) {stuck}")
    return SimulationResult(max(clock), busy, peak, starts)


def _ready_time(
    action: Action,
    stage: int,
    last_stage: int,
    pp: int,
    finished: dict[tuple[str, int, int], float],
    comm_latency: float,
) -> float | None:
    mb = action.microbatch
    if action.kind == "F":
        if stage == 0:
            return 0.0
        dep, crosses = ("F", mb, stage - 1), pp > 1
    else:
        if stage == last_stage:
            dep, crosses = ("F", mb, stage), False
        else:
            if ("F", mb, stage) not in finished:
                return None
            dep, crosses = ("B", mb, stage + 1), pp > 1
    if dep not in finished:
        return None
    return finished[dep] + (comm_latency if crosses else 0.0)


def ideal_bubble_fraction(schedule: str, pp_size: int, num_microbatches: int, vpp_size: int = 1) -> float:
    """The textbook bubble with equal forward and backward costs: (p-1)/(v m + p-1)."""
    v = vpp_size if schedule == "interleaved" else 1
    return (pp_size - 1) / (v * num_microbatches + pp_size - 1)

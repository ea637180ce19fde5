"""Time complete schedule tables without processes: makespan, bubble, peak in-flight, deadlocks.

Each rank runs its complete table in order (see :mod:`~core.pipeline_parallel.lowering`). A send
costs nothing and never waits; its message arrives ``comm_latency`` later. A receive is only
posted, except that with variable shapes it waits for the shape. A compute action starts when its
rank is free and its inputs are there: ``F`` needs its stage's input, ``B``/``I`` the output
gradient and its own forward, ``W`` its own ``I``. If no rank can take its next action, the tables
deadlock. :mod:`~core.pipeline_parallel.rendezvous` checks the same tables' posting order against
NCCL's stricter rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.pipeline_parallel.actions import (
    COMPUTE,
    RECEIVES,
    RECV_F,
    SENDS,
    Action,
    B,
    F,
    I,
    ScheduleDeadlock,
    W,
)
from core.pipeline_parallel.lowering import lower
from core.pipeline_parallel.messages import input_message, is_remote, message_of, output_message
from core.pipeline_parallel.placement import Placement

Cost = float | Callable[[Action, int], float]


@dataclass
class SimulationResult:
    makespan: float
    busy: list[float]  # compute time per rank
    peak_in_flight: list[int]  # max microbatch-chunks forwarded but not yet backwarded (B or W), per rank
    start_times: list[list[float]]  # per rank, per action of ``tables``
    end_times: list[list[float]]
    tables: list[list[Action]]  # the complete tables that were simulated

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the makespan."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


@dataclass(frozen=True)
class _Costs:
    forward: Cost
    backward: Cost
    backward_input: Cost | None
    backward_weight: Cost | None

    def of(self, action: Action, rank: int) -> float:
        if action.kind == F:
            return _value(self.forward, action, rank)
        if action.kind == B:
            return _value(self.backward, action, rank)
        split = self.backward_input if action.kind == I else self.backward_weight
        if split is None:  # half of a fused backward each
            return _value(self.backward, action, rank) / 2
        return _value(split, action, rank)


def _value(cost: Cost, action: Action, rank: int) -> float:
    return cost(action, rank) if callable(cost) else float(cost)


def as_placement(placement: Placement | int, pp_size: int) -> Placement:
    """An int means Megatron's loop placement with that many virtual stages."""
    return placement if isinstance(placement, Placement) else Placement(pp_size, placement)


def simulate(
    tables: list[list[Action]],
    placement: Placement | int = 1,
    forward_cost: Cost = 1.0,
    backward_cost: Cost = 2.0,
    comm_latency: float = 0.0,
    *,
    input_cost: Cost | None = None,
    weight_cost: Cost | None = None,
    variable_shapes: bool = False,
) -> SimulationResult:
    """Run the tables on an ideal machine; raises ``ScheduleDeadlock`` naming the stuck actions.

    Compute-only tables are lowered first (default lookahead). Costs are numbers or
    ``f(action, rank)``; a split backward costs half a fused one each unless ``input_cost`` /
    ``weight_cost`` say otherwise; ``comm_latency`` is added to every message between ranks.
    """
    place = as_placement(placement, len(tables))
    if len(tables) > 1 and all(a.kind in COMPUTE for t in tables for a in t):  # compute tables
        tables = lower(tables, place, variable_shapes=variable_shapes)
    run = _Run(tables, place, _Costs(forward_cost, backward_cost, input_cost, weight_cost), variable_shapes)
    while run.remaining:
        moved = [run.advance(rank, comm_latency) for rank in range(len(tables))]  # every rank, each round
        if not any(moved):
            waiting = {r: run.cursor[r] for r, t in enumerate(tables) if run.cursor[r] < len(t)}
            stuck = {r: str(tables[r][step]) for r, step in waiting.items()}
            raise ScheduleDeadlock(
                f"schedule deadlocks: every rank waits (rank: next action) {stuck}", tables, waiting
            )
    return SimulationResult(max(run.clock), run.busy, run.peak, run.starts, run.ends, tables)


class _Run:
    """The simulation's state: where each rank is in its table, and when each input is ready.

    Every action is first reduced to what it waits for and what it makes ready (keys: messages,
    and ``("F" | "I", microbatch, stage)`` for a stage's own forward and input gradient), so the
    main loop is dictionary lookups only.
    """

    def __init__(self, tables: list[list[Action]], placement: Placement, costs: _Costs, variable: bool):
        pp = len(tables)
        self.steps = [[_step(a, r, placement, costs, variable) for a in t] for r, t in enumerate(tables)]
        self.cursor, self.clock, self.busy = [0] * pp, [0.0] * pp, [0.0] * pp
        self.in_flight, self.peak = [0] * pp, [0] * pp
        self.starts: list[list[float]] = [[] for _ in range(pp)]
        self.ends: list[list[float]] = [[] for _ in range(pp)]
        self.ready: dict[object, float] = {}
        self.remaining = sum(len(t) for t in tables)

    def advance(self, rank: int, latency: float) -> bool:
        """Run this rank's actions until one must wait; whether any ran."""
        steps, ready, moved = self.steps[rank], self.ready, False
        while self.cursor[rank] < len(steps):
            needs, makes, sends, duration, delta = steps[self.cursor[rank]]
            start = self.clock[rank]
            for key in needs:
                at = ready.get(key)
                if at is None:
                    return moved
                start = max(start, at)
            self.clock[rank] = end = start + duration
            self.busy[rank] += duration
            for key in makes:
                ready[key] = end
            if sends is not None:
                ready[sends] = end + latency
            self.in_flight[rank] += delta
            self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
            self.starts[rank].append(start)
            self.ends[rank].append(end)
            self.cursor[rank] += 1
            self.remaining -= 1
            moved = True
        return moved


def _step(action: Action, rank: int, place: Placement, costs: _Costs, variable: bool) -> tuple:
    """(waits for, makes ready, sends, duration, change of in-flight microbatches) of one action."""
    kind, mb = action.kind, action.microbatch
    if kind in SENDS:
        return (), (), message_of(action, rank, place), 0.0, 0
    if kind in RECEIVES:  # only a variable-length activation waits (for its shape)
        needs = (message_of(action, rank, place),) if variable and kind == RECV_F else ()
        return needs, (), None, 0.0, 0
    stage = place.stage(rank, action.chunk)
    if kind == W:
        return (("I", mb, stage),), (), None, costs.of(action, rank), -1
    needs = [m] if (m := input_message(action, rank, place)) is not None else []
    makes = [("F" if kind == F else "I", mb, stage)]
    if kind != F:
        needs.append(("F", mb, stage))
    out = output_message(action, rank, place)
    if out is not None and not is_remote(out, place):
        makes.append(out)  # handed over within the rank
    delta = 1 if kind == F else -1 if kind == B else 0
    return tuple(needs), tuple(makes), None, costs.of(action, rank), delta

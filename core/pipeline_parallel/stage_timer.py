"""Time compute tables many times over, with costs per stage: the simulator's rules, compiled once.

The planner times each table shape with many cost sets (one per candidate, three microbatch counts
each), every cost depending only on the action's kind, rank and chunk. :func:`simulate` would lower
the tables and reduce every action to what it waits for again each time; here that happens once.

Timing needs no lowering: sends and receives take no time and (with fixed shapes) wait for nothing,
and lowering places a send right after its producer, so a message between ranks is ready
``comm_latency`` after its producer ends, and one within a rank when it ends. Which action waits for which does not depend on
the costs either, so one cost-free pass finds an order in which every action runs after its inputs;
each timing is then one loop over that order, with the same additions and maxima as
:func:`~core.pipeline_parallel.simulator.simulate` (so the same floats, ``tests/unit/test_plan.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core.pipeline_parallel.actions import Action, ActionKind, B, F, I, ScheduleDeadlock, W
from core.pipeline_parallel.placement import Placement

__all__ = ["StageTimer", "Timing"]

_OWN_F, _OWN_I, _ACTIVATION, _GRADIENT = range(4)  # the slots of one (microbatch, stage)


@dataclass
class Timing:
    """Start and end of every compute action (per rank, in table order) and each rank's busy time."""

    start_times: list[list[float]]
    end_times: list[list[float]]
    busy: list[float]
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the makespan (as :class:`SimulationResult` says it)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


class StageTimer:
    """Compute tables (``F``/``B``/``I``/``W`` only) and their placement, ready to be timed."""

    def __init__(self, tables: list[list[Action]], placement: Placement):
        self.tables = tables
        stages = self._num_stages = placement.num_stages
        microbatches = 1 + max((a.microbatch for t in tables for a in t), default=0)
        self._sink = 4 * microbatches * stages  # the slot nobody reads
        self._remote = [placement.rank(s) != placement.rank(s + 1) for s in range(stages - 1)]
        self._cost_keys: list[tuple[ActionKind, int, int]] = []
        index: dict[tuple[ActionKind, int, int], int] = {}
        steps = []
        for rank, table in enumerate(tables):
            row = []
            for action in table:
                key = (action.kind, rank, action.chunk)
                if key not in index:
                    index[key] = len(self._cost_keys)
                    self._cost_keys.append(key)
                stage = placement.stage(rank, action.chunk)
                row.append((rank, index[key], *self._links(action, stage)))
            steps.append(row)
        self._order = _run_order(steps, tables, self._sink + 1)

    def _links(self, action: Action, stage: int) -> tuple[tuple[int, ...], int, int, bool]:
        """(slots it waits for, slot it makes, slot of the message it makes, whether that message is
        remote); what an action does not make goes to the sink. Slots ``4 * (microbatch * stages +
        stage) + what``: the neighbouring stage's slots of a microbatch are 4 away."""
        kind, last, sink = action.kind, self._num_stages - 1, self._sink
        here = 4 * (action.microbatch * self._num_stages + stage)
        if kind == W:
            return (here + _OWN_I,), sink, sink, False
        if kind == F:
            needs = (here - 4 + _ACTIVATION,) if stage > 0 else ()
            if stage == last:
                return needs, here + _OWN_F, sink, False
            return needs, here + _OWN_F, here + _ACTIVATION, self._remote[stage]
        if kind not in (B, I):
            raise ValueError(f"StageTimer takes compute tables; {action} is a communication action")
        needs = (here + 4 + _GRADIENT, here + _OWN_F) if stage < last else (here + _OWN_F,)
        if stage == 0:
            return needs, here + _OWN_I, sink, False
        return needs, here + _OWN_I, here + _GRADIENT, self._remote[stage - 1]

    def time(self, costs: Mapping[tuple[ActionKind, int, int], float], comm_latency: float = 0.0) -> Timing:
        """Time the tables; ``costs`` maps (kind, rank, chunk) to seconds, every key of the tables present."""
        durations = [float(costs[key]) for key in self._cost_keys]
        ready = [0.0] * (self._sink + 1)
        pp = len(self.tables)
        clock, busy = [0.0] * pp, [0.0] * pp
        starts: list[list[float]] = [[] for _ in range(pp)]
        ends: list[list[float]] = [[] for _ in range(pp)]
        for rank, cost, needs, made, message, remote in self._order:
            start = clock[rank]
            for slot in needs:
                if ready[slot] > start:  # noqa: PLR1730 -- max() costs a call per wait, millions per search
                    start = ready[slot]
            duration = durations[cost]
            clock[rank] = ready[made] = end = start + duration
            busy[rank] += duration
            ready[message] = end + comm_latency if remote else end
            starts[rank].append(start)
            ends[rank].append(end)
        return Timing(starts, ends, busy, max(clock))


def _run_order(steps: list[list[tuple]], tables: list[list[Action]], slots: int) -> list[tuple]:
    """Every rank's steps in one sequence that runs each after what it waits for (the simulator's
    rounds over the ranks, without the clock); ``ScheduleDeadlock`` if the tables cannot run."""
    cursor, made, order = [0] * len(steps), bytearray(slots), []
    remaining = sum(len(row) for row in steps)
    while remaining:
        moved = False
        for rank, row in enumerate(steps):
            at = cursor[rank]
            while at < len(row):
                step = row[at]
                if not all(map(made.__getitem__, step[2])):
                    break
                made[step[3]] = made[step[4]] = 1
                order.append(step)
                at += 1
            moved |= at > cursor[rank]
            remaining -= at - cursor[rank]
            cursor[rank] = at
        if not moved:
            waiting = {r: cursor[r] for r, row in enumerate(steps) if cursor[r] < len(row)}
            stuck = {r: str(tables[r][step]) for r, step in waiting.items()}
            raise ScheduleDeadlock(
                f"schedule deadlocks: every rank waits (rank: next action) {stuck}", tables, waiting
            )
    return order

"""Timing a schedule whose ranks share a node's cores (CPU ranks, several per core).

The stage timer gives every action a fixed duration; on a machine with fewer cores than ranks an
action's duration depends on how many other ranks compute at the same moment. Here each action
carries its work (seconds alone) and progresses at ``1 / slowdown(k)`` while ``k`` processes
compute, ``slowdown`` measured on the machine (:mod:`planner.calibrate`); a rank waiting for a
message uses no core (gloo blocks). A pipeline rank stands for its ``processes`` tensor-, context- and
data-parallel ranks, which run the same actions at the same time.

With ideal sharing (``slowdown(k) = max(1, k / cores)``) a schedule's bubble is free wherever the busy
ranks still fill the cores, which is why a shared-core step follows total work, not the bubble.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from core.pipeline_parallel.actions import Action, ActionKind, F, W
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.stage_timer import Timing

__all__ = ["time_shared"]


def _needs(action: Action, stage: int, last: int) -> list[tuple[str, int, int]]:
    """What an action waits for: (what, microbatch, stage) of its producers (the executor's data flow)."""
    mb = action.microbatch
    if action.kind == F:
        return [("F", mb, stage - 1)] if stage > 0 else []
    if action.kind == W:
        return [("I", mb, stage)]
    return [("F", mb, stage)] + ([("I", mb, stage + 1)] if stage < last else [])


def _made(action: Action) -> str:
    return "F" if action.kind == F else "I"


class _Rank:
    """One pipeline rank's progress through its table."""

    __slots__ = ("at", "remaining", "started")

    def __init__(self) -> None:
        self.at, self.remaining, self.started = 0, 0.0, -1.0


def time_shared(
    tables: list[list[Action]],
    placement: Placement,
    work: Mapping[tuple[ActionKind, int, int], float],
    *,
    latency: float,
    processes: int,
    slowdown: Callable[[int], float],
) -> Timing:
    """Time ``tables`` with ``work[kind, rank, chunk]`` seconds alone per action (module docstring)."""
    last = placement.num_stages - 1
    done: dict[tuple[str, int, int], float] = {}
    ranks = [_Rank() for _ in tables]
    starts: list[list[float]] = [[] for _ in tables]
    ends: list[list[float]] = [[] for _ in tables]
    busy = [0.0] * len(tables)
    now, left = 0.0, sum(len(t) for t in tables)
    while left:
        wake = _start_ready(tables, placement, work, ranks, done, now, latency, last)
        running = [r for r, state in enumerate(ranks) if state.started >= 0]
        if not running and wake == float("inf"):
            raise RuntimeError("shared-core timing stalled: the tables cannot run")
        rate = 1.0 / slowdown(processes * len(running)) if running else 0.0
        finish = min((ranks[r].remaining / rate for r in running), default=float("inf"))
        step = min(finish, wake - now)
        now += step
        for r in running:
            state = ranks[r]
            state.remaining -= step * rate
            if state.remaining <= 1e-12 * max(1.0, now):
                action = tables[r][state.at]
                stage = placement.stage(r, action.chunk)
                done[_made(action), action.microbatch, stage] = now
                starts[r].append(state.started)
                ends[r].append(now)
                busy[r] += now - state.started
                state.at, state.started, left = state.at + 1, -1.0, left - 1
    return Timing(starts, ends, busy, now)


def _start_ready(tables, placement, work, ranks, done, now: float, latency: float, last: int) -> float:
    """Start every idle rank's next action whose inputs have arrived; the next arrival time, if any."""
    wake = float("inf")
    for r, state in enumerate(ranks):
        if state.started >= 0 or state.at >= len(tables[r]):
            continue
        action = tables[r][state.at]
        stage = placement.stage(r, action.chunk)
        ready = 0.0
        for key in _needs(action, stage, last):
            if key not in done:
                ready = float("inf")
                break
            remote = placement.rank(key[2]) != r
            ready = max(ready, done[key] + (latency if remote else 0.0))
        if ready <= now + 1e-15:
            state.started, state.remaining = now, max(work[action.kind, r, action.chunk], 1e-12)
        else:
            wake = min(wake, ready)
    return wake

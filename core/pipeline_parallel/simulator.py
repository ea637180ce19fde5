"""Time schedule tables without processes: makespan, bubble, peak in-flight activations, deadlocks.

Each rank runs its table in order; an action starts when its rank is free and its inputs exist:
``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs ``B(mb, s+1)`` (the last stage needs its own
forward). Sends are asynchronous, as in the executor, so a rank never waits for a receiver. If no
rank can start its next action, the tables deadlock. :func:`check_rendezvous` checks a recorded
run's actual posting order against NCCL's stricter rules.
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


def check_rendezvous(comm_logs: list[list[tuple]]) -> None:
    """Would these posting orders finish under NCCL's rules? Raises ``ScheduleDeadlock`` if not.

    ``comm_logs[r]`` is rank r's ``ScheduleRecord.comm_log``: ``("post", stream, ops)`` for one
    ``batch_isend_irecv`` (``ops`` are ``(is_send, peer, message key)``) and ``("wait", key)`` where the
    rank blocks until the batch receiving ``key`` is done. The rules are the strictest a backend
    may apply: batches with the same ``stream`` run one after another; a batch starts only after the
    rank's earlier waits are satisfied (the data it sends is computed after them); and a batch is
    done only when every one of its operations has its counterpart in a started batch of the peer
    (a send completes only against a posted receive, as large NCCL messages do).
    """
    where: dict[tuple[int, bool, tuple], int] = {}  # (rank, is_send, key) -> index of its post
    for rank, log in enumerate(comm_logs):
        for index, entry in enumerate(log):
            if entry[0] == "post":
                for is_send, _peer, key in entry[2]:
                    where[(rank, is_send, key)] = index
    for rank, log in enumerate(comm_logs):
        for entry in log:
            for is_send, peer, key in entry[2] if entry[0] == "post" else ():
                if (peer, not is_send, key) not in where:
                    raise ScheduleDeadlock(f"rank {rank} posts {key} but rank {peer} never posts its half")
    started: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, log in enumerate(comm_logs):
            waiting, previous = False, {}
            for index, entry in enumerate(log):
                if entry[0] == "wait":
                    waiting = waiting or (rank, where[(rank, False, entry[1])]) not in done
                    continue
                stream, ops = entry[1], entry[2]
                before = previous.get(stream)
                if (
                    (rank, index) not in started
                    and not waiting
                    and (before is None or (rank, before) in done)
                ):
                    started.add((rank, index))
                    progressed = True
                matched = all(
                    (peer, where[(peer, not is_send, key)]) in started for is_send, peer, key in ops
                )
                if (rank, index) in started and (rank, index) not in done and matched:
                    done.add((rank, index))
                    progressed = True
                previous[stream] = index
    stuck = {}
    for rank, log in enumerate(comm_logs):
        for index, entry in enumerate(log):
            if entry[0] == "post" and (rank, index) not in done:
                stuck[rank] = entry[2]
                break
    if stuck:
        raise ScheduleDeadlock(f"posted operations wait on each other (rank: first unfinished batch) {stuck}")

"""Time complete schedule tables without processes: makespan, bubble, peak in-flight, deadlocks.

Each rank runs its complete table in order (see :mod:`~core.pipeline_parallel.lowering`). A send
costs nothing and never waits; its message arrives ``comm_latency`` later. A receive is only
posted, except that with variable shapes it waits for the shape. A compute action starts when its
rank is free and its inputs are there: ``F`` needs its stage's input, ``B``/``I`` the output
gradient and its own forward, ``W`` its own ``I``. If no rank can take its next action, the tables
deadlock. :func:`check_rendezvous` checks the same tables' posting order against NCCL's stricter
rules, and :func:`comm_logs` says what that order is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.pipeline_parallel.lowering import (
    ACTIVATION,
    input_message,
    is_remote,
    link_of,
    lower,
    message_of,
    output_message,
)
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.schedule_tables import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    W,
)

Cost = float | Callable[[Action, int], float]


class ScheduleDeadlock(RuntimeError):
    """The tables wait on each other in a cycle."""


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
            stuck = {r: str(t[run.cursor[r]]) for r, t in enumerate(tables) if run.cursor[r] < len(t)}
            raise ScheduleDeadlock(f"schedule deadlocks: every rank waits (rank: next action) {stuck}")
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
    if kind in (SEND_F, SEND_B):
        return (), (), message_of(action, rank, place), 0.0, 0
    if kind in (RECV_F, RECV_B):  # only a variable-length activation waits (for its shape)
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


def ideal_bubble_fraction(schedule: str, pp_size: int, num_microbatches: int, vpp_size: int = 1) -> float:
    """The textbook bubble with equal forward and backward costs: (p-1)/(v m + p-1)."""
    v = vpp_size if schedule == "interleaved" else 1
    return (pp_size - 1) / (v * num_microbatches + pp_size - 1)


def comm_logs(
    tables: list[list[Action]], placement: Placement, *, variable_shapes: bool = False
) -> list[list[tuple]]:
    """What each rank posts and waits for when it runs these complete tables, in
    :func:`check_rendezvous`'s format; the executor records exactly this (``ScheduleRecord.comm_log``).

    Keys are ``(message, part)``; a variable-length activation sends its ``"shape"`` before its
    ``"data"``, and its receive waits for the shape before posting the data receive.
    """
    logs = []
    for rank, table in enumerate(tables):
        log: list[tuple] = []
        for action in table:
            if action.kind in COMPUTE:
                message = input_message(action, rank, placement) if action.kind != W else None
                if is_remote(message, placement):
                    log.append(("wait", (message, "data")))
                continue
            message = message_of(action, rank, placement)
            link = link_of(message, placement)
            is_send = action.kind in (SEND_F, SEND_B)
            peer = link[1] if is_send else link[0]
            if variable_shapes and message.kind == ACTIVATION:
                log.append(("post", link, [(is_send, peer, (message, "shape"))]))
                if not is_send:
                    log.append(("wait", (message, "shape")))
            log.append(("post", link, [(is_send, peer, (message, "data"))]))
        logs.append(log)
    return logs


def warm_up_comm_logs(
    pipelines: list[list[int]], world_size: int, order: list[tuple[int, int, int, int]] | None = None
) -> list[list[tuple]]:
    """What every global rank posts and waits for when it warms its pipeline links up
    (``parallel_state.warm_up_pipeline_links``), in :func:`check_rendezvous`'s format.

    Each link is one batch on each end, a send and a receive (so it completes only when both ends
    have posted, as NCCL's communicator setup does), followed by a wait. ``order`` defaults to
    ``parallel_state.link_warm_up_order(pipelines)``; tests pass others to show what deadlocks.
    """
    from core.parallel_state import link_warm_up_order

    logs: list[list[tuple]] = [[] for _ in range(world_size)]
    for src, dst, _, _ in order if order is not None else link_warm_up_order(pipelines):
        if src == dst:
            continue
        link = (src, dst)  # the stream: the link's group, as the schedule's posts name it
        there, back = ("warm-up", src, dst, "there"), ("warm-up", src, dst, "back")
        logs[src] += [("post", link, [(True, dst, there), (False, dst, back)]), ("wait", back)]
        logs[dst] += [("post", link, [(False, src, there), (True, src, back)]), ("wait", there)]
    return logs


def check_rendezvous(comm_logs: list[list[tuple]]) -> None:
    """Would these posting orders finish under NCCL's rules? Raises ``ScheduleDeadlock`` if not.

    ``comm_logs[r]`` is rank r's posting order (:func:`comm_logs` of complete tables, or a run's
    ``ScheduleRecord.comm_log``): ``("post", stream, ops)`` for one posted batch (``ops``
    are ``(is_send, peer, message key)``) and ``("wait", key)`` where the rank blocks until the
    batch receiving ``key`` is done. The rules are the strictest a backend may apply: batches with
    the same ``stream`` run one after another; a batch starts only after the rank's earlier waits
    are satisfied (the data it sends is computed after them); and a batch is done only when every
    one of its operations has its counterpart in a started batch of the peer (a send completes only
    against a posted receive, as large NCCL messages do).
    """
    check = _Rendezvous(comm_logs)
    for rank in range(len(comm_logs)):
        check.tasks.append(("advance", rank))
    check.run()
    stuck = {}
    for rank, log in enumerate(comm_logs):
        first = next((i for i, e in enumerate(log) if e[0] == "post" and (rank, i) not in check.done), None)
        if first is not None:
            stuck[rank] = log[first][2]
    if stuck:
        raise ScheduleDeadlock(f"posted operations wait on each other (rank: first unfinished batch) {stuck}")


class _Rendezvous:
    """Event-driven replay for :func:`check_rendezvous`: each post is started and finished once."""

    def __init__(self, logs: list[list[tuple]]):
        self.logs = logs
        self.where: dict[tuple[int, bool, object], tuple[int, int]] = {}  # (rank, is_send, key) -> post
        self.next_on_stream: dict[tuple[int, int], tuple[int, int]] = {}
        self.previous: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, log in enumerate(logs):
            last: dict[object, tuple[int, int]] = {}
            for index, entry in enumerate(log):
                if entry[0] != "post":
                    continue
                post = (rank, index)
                if entry[1] in last:
                    self.previous[post] = last[entry[1]]
                    self.next_on_stream[last[entry[1]]] = post
                last[entry[1]] = post
                for is_send, _peer, key in entry[2]:
                    self.where[(rank, is_send, key)] = post
        for rank, log in enumerate(logs):
            for entry in log:
                for is_send, peer, key in entry[2] if entry[0] == "post" else ():
                    if (peer, not is_send, key) not in self.where:
                        raise ScheduleDeadlock(
                            f"rank {rank} posts {key} but rank {peer} never posts its half"
                        )
        self.cursor = [0] * len(logs)
        self.issued: set[tuple[int, int]] = set()
        self.started: set[tuple[int, int]] = set()
        self.done: set[tuple[int, int]] = set()
        self.tasks: list[tuple[str, object]] = []

        self.peers = {
            (rank, i): [self.where[(peer, not s, key)] for s, peer, key in entry[2]]
            for rank, log in enumerate(logs)
            for i, entry in enumerate(log)
            if entry[0] == "post"
        }

    def run(self) -> None:
        steps = {"advance": self.advance, "start": self.start, "finish": self.finish}
        while self.tasks:
            what, item = self.tasks.pop()
            steps[what](item)

    def advance(self, rank: int) -> None:
        """Walk the rank's log: issue posts, stop at a wait whose batch is not done."""
        log = self.logs[rank]
        while self.cursor[rank] < len(log):
            entry = log[self.cursor[rank]]
            if entry[0] == "wait":
                if self.where[(rank, False, entry[1])] not in self.done:
                    return
            else:
                self.issued.add((rank, self.cursor[rank]))
                self.tasks.append(("start", (rank, self.cursor[rank])))
            self.cursor[rank] += 1

    def start(self, post: tuple[int, int]) -> None:
        before = self.previous.get(post)
        if (
            post in self.started
            or post not in self.issued
            or (before is not None and before not in self.done)
        ):
            return
        self.started.add(post)
        self.tasks += [("finish", p) for p in [post, *self.peers[post]]]

    def finish(self, post: tuple[int, int]) -> None:
        if post in self.done or post not in self.started:
            return
        if not all(p in self.started for p in self.peers[post]):
            return
        self.done.add(post)
        if post in self.next_on_stream:
            self.tasks.append(("start", self.next_on_stream[post]))
        self.tasks.append(("advance", post[0]))

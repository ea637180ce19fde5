"""Would these posts finish under NCCL's rules? The rendezvous check, without processes.

NCCL runs a group's operations in order and a send completes only when its receive is posted, so
a posting order that the simulator's ideal machine finishes can still hang on NCCL.
:func:`comm_logs` says what each rank posts and waits for when it runs complete tables (the
executor records the same, ``ScheduleRecord.comm_log``), :func:`warm_up_comm_logs` the same for
the startup warm-up of the pipeline links, and :func:`check_rendezvous` replays either under
NCCL's rules.
"""

from __future__ import annotations

from core.parallel_state import link_warm_up_order
from core.pipeline_parallel.actions import COMPUTE, SENDS, Action, ScheduleDeadlock, W
from core.pipeline_parallel.messages import ACTIVATION, input_message, is_remote, link_of, message_of
from core.pipeline_parallel.placement import Placement


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
            is_send = action.kind in SENDS
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

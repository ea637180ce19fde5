"""Where a rank is in its schedule, for post-mortems: its table, the action it runs, the message it waits for.

The executor keeps one :class:`SchedulePosition` (``ScheduleHooks.position``) up to date at the cost
of one attribute store per action (``index``); everything else is derived when asked, on another
thread: the watchdog's heartbeat, which names the action and the message a rank waits in, and the
dump a rank writes when a job hangs (:meth:`SchedulePosition.as_dict`).

The message waited for is the one whose receive the mailbox waits on (``Mailbox.waiting``, two
attribute stores per wait; it stays set when the wait fails). Once its input is in, an action
computes and waits for nobody: so a rank stuck in its own forward (a hang inside the model) waits
for no message, and the ranks behind it wait for its output: the chains of waits end at the rank
that holds everyone up (:func:`core.watchdog.summarize_waits`). After its last action a rank waits
for its sends to complete (``Mailbox.sending``): a send completes once the peer has posted its
receive, so a rank whose peer is stuck earlier in its table waits for that peer too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from core.pipeline_parallel.actions import Action, ActionKind
from core.pipeline_parallel.mailbox import Mailbox
from core.pipeline_parallel.messages import ACTIVATION
from core.watchdog import SEND

__all__ = ["ACTION_NAMES", "SchedulePosition", "Wait"]

ACTION_NAMES = {
    ActionKind.F: "forward",
    ActionKind.B: "backward",
    ActionKind.I: "input-gradient backward",
    ActionKind.W: "weight-gradient backward",
    ActionKind.SEND_F: "activation send",
    ActionKind.RECV_F: "activation receive",
    ActionKind.SEND_B: "gradient send",
    ActionKind.RECV_B: "gradient receive",
}


def describe(action: Action) -> str:
    """``backward of microbatch 0, chunk 1``."""
    return f"{ACTION_NAMES[action.kind]} of microbatch {action.microbatch}, chunk {action.chunk}"


class Wait(NamedTuple):
    """A pipeline message a rank waits for: from global rank ``peer``, an activation coming forward or
    a gradient coming back, for this rank's chunk ``chunk``; the peer makes it in its chunk ``peer_chunk``.
    With ``sending``, the other way: this rank's chunk ``chunk`` sent it to the peer's ``peer_chunk``,
    and the rank waits for the peer to receive it."""

    peer: int
    kind: str
    microbatch: int
    chunk: int
    peer_chunk: int
    sending: bool = False

    @property
    def direction(self) -> str:
        return "forward" if self.kind == ACTIVATION else "backward"

    def awaited_action(self) -> str:
        """The peer's action that makes the message, e.g. ``forward of microbatch 3, chunk 1``; for a
        send, the message the peer is to receive, e.g. ``gradient of microbatch 1, chunk 0``."""
        if self.sending:
            return f"{self.kind} of microbatch {self.microbatch}, chunk {self.chunk}"
        return f"{self.direction} of microbatch {self.microbatch}, chunk {self.peer_chunk}"

    def as_dict(self) -> dict[str, Any]:
        awaited = f"rank {self.peer}'s {self.awaited_action()}"
        if self.sending:
            awaited = f"rank {self.peer} to receive this rank's {self.awaited_action()}"
        return {
            "peer_rank": self.peer,
            "direction": self.direction,
            "message": self.kind,
            "microbatch": self.microbatch,
            "chunk": self.chunk,
            "peer_chunk": self.peer_chunk,
            "sending": self.sending,
            "awaited": awaited,
        }


class SchedulePosition:
    """This rank's table and the index of the action it runs (``len(table)``: the table is done).

    The executor calls :meth:`begin` once per table, then stores ``index`` before each action;
    ``on_begin(position)`` runs at each :meth:`begin` (the training loop hands the position to its
    watchdog there). ``iteration`` is the training iteration the caller says the table runs for.
    Readers on other threads take ``index`` after the table: :meth:`begin` resets the index first,
    so a reader never pairs a new table with the old table's index.
    """

    def __init__(self, on_begin: Any = None) -> None:
        self.index = -1
        self.iteration: int | None = None
        self.on_begin = on_begin
        self._run: tuple[list[Action], Mailbox] | None = None
        self._runs = 0

    def begin(self, table: list[Action], mailbox: Mailbox) -> None:
        """A table starts to run (``index`` -1: nothing started yet)."""
        self.index = -1
        self._run, self._runs = (table, mailbox), self._runs + 1
        if self.on_begin is not None:
            self.on_begin(self)

    def progress(self) -> tuple[int, int]:
        """Changes whenever the schedule moves on: (tables begun, index)."""
        return self._runs, self.index

    def _state(self) -> tuple[list[Action], Mailbox, int] | None:
        run = self._run
        if run is None:
            return None
        return run[0], run[1], min(self.index, len(run[0]))

    def waits_for(self) -> Wait | None:
        """The message from another rank that this rank's schedule waits for now, if it waits for one."""
        state = self._state()
        if state is None:
            return None
        mailbox = state[1]
        placement, received, sent = mailbox.placement, mailbox.waiting, mailbox.sending
        if mailbox.links is None or (received is None and sent is None):
            return None
        message = received or sent
        ours, theirs = (
            (message.dst_stage, message.src_stage) if received else (message.src_stage, message.dst_stage)
        )
        peer, peer_chunk = placement.rank_and_chunk(theirs)
        chunk = placement.rank_and_chunk(ours)[1]
        global_peer = mailbox.links.global_ranks[peer]
        return Wait(
            global_peer, message.kind, message.microbatch, chunk, peer_chunk, sending=received is None
        )

    def waiting_on(self) -> tuple[int, str] | tuple[int, str, str] | None:
        """(the global rank this rank waits for, its awaited action), for the watchdog's heartbeat; for a
        send waiting to be received, (the peer, the message, ``"send"``)."""
        wait = self.waits_for()
        if wait is None:
            return None
        return (
            (wait.peer, wait.awaited_action(), SEND) if wait.sending else (wait.peer, wait.awaited_action())
        )

    def __str__(self) -> str:
        state = self._state()
        if state is None:
            return "no schedule run yet"
        table, _, index = state
        if index < 0:
            return f"schedule starting ({len(table)} actions)"
        if index == len(table):
            return f"schedule done ({len(table)} actions): sends completing, gradient reductions"
        action = table[index]
        return f"schedule action {index + 1} of {len(table)}: {action} ({describe(action)})"

    def as_dict(self) -> dict[str, Any] | None:
        """The post-mortem: the whole table (as the executor runs it), the running and the last
        finished action (indices into the table), and the message waited for; None before any table."""
        state = self._state()
        if state is None:
            return None
        table, _, index = state
        wait = self.waits_for()
        running = None if not 0 <= index < len(table) else table[index]
        finished = index - 1 if index >= 0 else -1
        return {
            "iteration": self.iteration,
            "table": [str(action) for action in table],
            "running": None
            if running is None
            else {"index": index, "action": str(running), "what": describe(running)},
            "last_finished": None if finished < 0 else {"index": finished, "action": str(table[finished])},
            "waits_for": None if wait is None else wait.as_dict(),
            "where": str(self),
        }

"""Heartbeats in the rendezvous store, so that a rank that stops answering is named, not waited for.

A backend timeout says only that *this* rank waited too long. Which rank went silent, and what the
others were doing, is known to nobody. So every rank runs a :class:`Watchdog`: a daemon thread that
every ``interval`` seconds writes a heartbeat (a counter, the phase the main thread is in, the
iteration, the wall time) under ``trident/heartbeat/<rank>`` in the store every rank already shares
(torchrun's, or the file store of a single-node run). The training loop names its phases with
:meth:`Watchdog.enter`, and where it is inside one (the schedule's action) with :meth:`Watchdog.at`;
both are also the watchdog's measure of progress.

When the main thread has spent ``timeout - interval`` seconds in one phase, it is waiting for
someone. The thread has by then watched every rank's counter for at least ``stale_after`` seconds;
a rank whose counter did not move is silent (stopped, frozen in a call that holds the GIL, or on a
dead host). The thread calls ``on_silent(message)`` with a message such as::

    rank 2 stopped answering: no heartbeat for 597 s (the last one said: forward-backward at
    iteration 5); ranks 0,1,3 waited 594 s for it in forward-backward at iteration 5
    (--distributed-timeout-minutes 10)

This acts an ``interval`` before the backend's own timeout would (the phase started no later than
the collective that hangs), so it works the same under gloo and NCCL. If no rank is silent, the
ranks are alive but wait on each other (mismatched collectives, one rank much slower): the watchdog
does nothing and the backend's timeout ends the run; :meth:`Watchdog.explain_timeout` then says
what every rank was doing. Silence is judged by counters seen to change on this rank's clock, never
by comparing clocks of different hosts. A rank that finished writes a last ``done`` heartbeat and
is never called silent.

Inside the pipeline schedule a heartbeat also says which rank this one waits for a message from, and
that rank's action which makes it. :meth:`Watchdog.summary` follows these waits from rank to rank to
the one that holds the others up, in one line::

    hang summary: ranks 0,1,3 wait on rank 2's forward of microbatch 3, chunk 1 at iteration 5
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HEARTBEAT_KEY",
    "REPORT_KEY",
    "SEND",
    "Watchdog",
    "claim_report",
    "is_communication_failure",
    "summarize_waits",
]

HEARTBEAT_KEY = "trident/heartbeat/{rank}"
REPORT_KEY = "trident/error"
"""Holds the rank that reports the job's error: the first to claim it; the others keep quiet."""
DONE = "done"
SEND = "send"
"""A heartbeat's wait with this third field waits for its own send to be received, not for a message."""

_COMMUNICATION_FAILURES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl error",
    "nccl communicator was aborted",
)


def is_communication_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective or point-to-point operation failing (a peer gone or too slow)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(marker in text for marker in _COMMUNICATION_FAILURES)


def claim_report(store: Any, rank: int) -> bool:
    """True on the first rank to claim the job's one error report, False on every later one."""
    winner = store.compare_set(REPORT_KEY, "", str(rank))
    return winner.decode() == str(rank)


def error_reported(store: Any) -> bool:
    """Whether some rank has already claimed (and printed) the job's error."""
    return store.check([REPORT_KEY])


@dataclass(frozen=True)
class Heartbeat:
    """One rank's last heartbeat, as stored. ``waiting_on``: the rank it waits for a message from and
    that rank's action which makes the message (``(2, "forward of microbatch 3, chunk 1")``), if any;
    or the rank it waits for to receive its own message, that message and :data:`SEND`
    (``(0, "gradient of microbatch 1, chunk 0", "send")``)."""

    count: int
    phase: str
    iteration: int | None
    wall_time: float
    waiting_on: tuple[int, str] | tuple[int, str, str] | None = None

    def encode(self) -> str:
        return json.dumps([self.count, self.phase, self.iteration, self.wall_time, self.waiting_on])

    @classmethod
    def decode(cls, raw: bytes) -> Heartbeat:
        count, phase, iteration, wall_time, *rest = json.loads(raw)
        waiting_on = tuple(rest[0]) if rest and rest[0] is not None else None
        return cls(count, phase, iteration, wall_time, waiting_on)

    def doing(self) -> str:
        return self.phase + ("" if self.iteration is None else f" at iteration {self.iteration}")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _call(detail: object, method: str) -> Any:
    """``detail.method()`` where ``detail`` has it, else None (a plain string says where only)."""
    found = getattr(detail, method, None)
    return found() if found is not None else None


def _end_of_chain(rank: int, edges: dict[int, tuple[int, str]]) -> tuple[int, ...]:
    """Where ``rank``'s chain of waits ends: (the rank that waits for nobody,) or the cycle it runs into."""
    chain = [rank]
    while (nxt := edges[chain[-1]][0]) in edges and nxt not in chain:
        chain.append(nxt)
    if nxt not in edges:
        return (nxt,)
    return tuple(sorted(chain[chain.index(nxt) :]))


def _sends(beat: Heartbeat) -> bool:
    return len(beat.waiting_on) > 2 and beat.waiting_on[2] == SEND


def _at(pairs: dict[tuple[str, int | None], None]) -> str:
    """Each distinct thing awaited once, then the iteration (after each one when they differ)."""
    iterations = {iteration for _, iteration in pairs}
    if len(iterations) > 1:
        return " and ".join(f"{what} at iteration {iteration}" for what, iteration in pairs)
    (iteration,) = iterations
    return " and ".join(what for what, _ in pairs) + (
        "" if iteration is None else f" at iteration {iteration}"
    )


def _awaited(waiters: list[int], target: int, beats: dict[int, Heartbeat], *, sends: bool = False) -> str:
    """What those of ``waiters`` that wait directly on ``target`` (for its messages, or with ``sends`` for
    it to receive theirs) wait for: each distinct action or message once, then the iteration."""
    return _at(
        {
            (beats[r].waiting_on[1], beats[r].iteration): None
            for r in waiters
            if beats[r].waiting_on[0] == target and _sends(beats[r]) == sends
        }
    )


def _held_up_by(end: int, waiters: list[int], beats: dict[int, Heartbeat]) -> str:
    """The part of the summary for the ranks whose waits end at rank ``end``: those waiting for its
    messages (or for a rank that does) ``wait on rank E's <actions>``; those waiting for it to receive
    their sends ``wait for their sends to rank E to be received (<messages>)``."""
    senders = [r for r in waiters if beats[r].waiting_on[0] == end and _sends(beats[r])]
    others = [r for r in waiters if r not in senders]
    parts = []
    if others:
        receivers = [r for r in others if beats[r].waiting_on[0] == end]
        what = f"'s {_awaited(receivers, end, beats)}" if receivers else ""
        parts.append(f"{_ranks(others)} {'waits' if len(others) == 1 else 'wait'} on rank {end}{what}")
    if senders:
        one = len(senders) == 1
        parts.append(
            f"{_ranks(senders)} {'waits for its' if one else 'wait for their'} sends to rank {end} to be "
            f"received ({_awaited(senders, end, beats, sends=True)})"
        )
    return "; ".join(parts)


def summarize_waits(beats: dict[int, Heartbeat], silent: list[int] | tuple[int, ...] = ()) -> str:
    """One line naming the rank and action every waiting rank waits on, from each rank's heartbeat.

    A rank that waits for a pipeline message waits for the rank that sends it; a rank that waits for
    its own send to be received, for the rank that receives it. Following these waits from rank to
    rank ends at a rank that waits for nobody (or is ``silent``): the one holding the others up, and
    the action its direct waiters wait for is the one everybody waits on. For example ``ranks 0,1,3
    wait on rank 2's forward of microbatch 3, chunk 1 at iteration 5``, or ``rank 2 waits for its sends
    to rank 0 to be received (gradient of microbatch 1, chunk 0 at iteration 6)``. Waits that run in a
    circle are named as such; ranks that wait for no pipeline message are named at the end.
    """
    edges = {r: b.waiting_on for r, b in beats.items() if b.waiting_on is not None and r not in silent}
    ends: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(edges):
        ends.setdefault(_end_of_chain(rank, edges), []).append(rank)
    parts = []
    for end, waiters in sorted(ends.items()):
        if len(end) == 1:
            parts.append(_held_up_by(end[0], waiters, beats))
        else:
            each = ", ".join(
                f"rank {r} on rank {edges[r][0]}'s {_awaited([r], edges[r][0], beats, sends=_sends(beats[r]))}"
                for r in end
            )
            parts.append(f"{_ranks(waiters)} wait on each other in a circle ({each})")
    if not parts:
        return "no rank waits for a pipeline message (each rank's flight recorder lists its collectives)"
    idle = sorted(set(beats) - set(edges) - {end[0] for end in ends if len(end) == 1} - set(silent))
    if idle:
        parts[-1] += f" ({_ranks(idle)} {'waits' if len(idle) == 1 else 'wait'} for no pipeline message)"
    return "; ".join(parts)


class Watchdog:
    """This rank's heartbeat thread and the judge of silent peers (see the module docstring).

    ``store`` is the job's shared store (``torch.distributed``'s default store), ``timeout`` the
    process-group timeout in seconds. ``on_silent(message)`` runs on the watchdog thread; the
    training entry point prints the message once for the job and ends the process.
    ``on_reported_elsewhere()`` runs when this rank has waited ``stale_after`` seconds and another
    rank has claimed the job's error report (:func:`claim_report`): under NCCL a peer that exited
    is not noticed until the timeout, so the entry point ends this rank quietly instead.
    ``timeout_setting`` says where the timeout came from, for messages.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        on_silent: Callable[[str], None],
        on_reported_elsewhere: Callable[[], None] | None = None,
        interval: float | None = None,
        timeout_setting: str | None = None,
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, float(timeout)
        self.interval = interval if interval is not None else min(max(self.timeout / 10, 0.5), 10.0)
        self.stale_after = 3 * self.interval
        self.on_silent = on_silent
        self.on_reported_elsewhere = on_reported_elsewhere
        self.timeout_setting = timeout_setting or f"--distributed-timeout-minutes {self.timeout / 60:g}"
        self._lock = threading.Lock()
        self._phase, self._iteration, self._since = "startup", None, time.monotonic()
        self._detail: object = None  # where in the phase (str() of it is taken only when it is written)
        self._progress: object = None  # the detail's progress() when last looked at
        self._last_tick = time.monotonic()
        self._count = 0
        self._seen: dict[int, tuple[Heartbeat | None, float]] = {}  # rank -> (last beat, when it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trident-watchdog", daemon=True)

    # -- the main thread's side ---------------------------------------------------------------------
    def enter(self, phase: str, iteration: int | None = None) -> None:
        """The main thread starts ``phase`` (of ``iteration``): progress, as far as the watchdog sees."""
        with self._lock:
            self._phase, self._iteration, self._since = phase, iteration, time.monotonic()
            self._detail = None

    def at(self, detail: object) -> None:
        """The main thread moves on inside its phase (progress too): ``str(detail)`` says where, e.g. the
        schedule's action, so that a hang names the action each rank waits in.

        ``detail`` may also have ``progress()``, whose value changes as the main thread moves on (the
        watchdog's thread compares it at each tick: the main thread does nothing per step of the
        detail), and ``waiting_on()``, the rank the main thread waits for a message from and that
        rank's action which makes it (or None), written in each heartbeat (see :func:`summarize_waits`).
        """
        with self._lock:
            self._detail, self._since = detail, time.monotonic()
            self._progress = _call(detail, "progress")

    @property
    def iteration(self) -> int | None:
        """The iteration of the main thread's phase."""
        return self._iteration

    def doing(self) -> str:
        """What the main thread is doing, e.g. ``forward-backward at iteration 5``."""
        return self._own_beat().doing()

    def heartbeat(self) -> Heartbeat:
        """This rank's heartbeat as it would be written now."""
        return self._own_beat()

    def start(self) -> Watchdog:
        self._beat()  # synchronously, so every rank's key exists once all have started
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and leave a ``done`` heartbeat: a finished rank is not a silent one."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval)  # a store that hangs must not hold up the exit
        self.enter(DONE)
        with contextlib.suppress(Exception):  # the store may already be gone at the end of a failed run
            self._beat()

    # -- the thread ---------------------------------------------------------------------------------
    def _beat(self) -> None:
        with self._lock:
            self._count += 1
        beat = self._own_beat()
        self.store.set(HEARTBEAT_KEY.format(rank=self.rank), beat.encode())

    def _note_progress(self) -> None:
        """The detail moved on since the last tick: progress, at the earliest since that tick."""
        now = time.monotonic()
        with self._lock:
            progress = _call(self._detail, "progress")
            if progress != self._progress:
                self._progress, self._since = progress, max(self._since, self._last_tick)
            self._last_tick = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a store hiccup must not end the watchdog: next tick
                self._tick()

    def _tick(self) -> None:
        self._note_progress()
        self._beat()
        waited = self.waited()
        if (
            self.on_reported_elsewhere is not None
            and waited >= self.stale_after
            and error_reported(self.store)
        ):
            self.on_reported_elsewhere()
            return
        deadline = self.timeout - self.interval
        if waited < deadline - self.stale_after - self.interval:
            self._seen.clear()  # progress since the last suspicion: start afresh next time
            return
        self.observe()
        silent = self.silent_ranks()
        if waited >= deadline and silent:
            self.on_silent(self.describe_silence(silent, waited))
            self._stop.set()

    def waited(self) -> float:
        """Seconds the main thread has been in its current phase."""
        with self._lock:
            return time.monotonic() - self._since

    def observe(self) -> None:
        """Read every other rank's heartbeat and note, on this rank's clock, whose counter moved."""
        now = time.monotonic()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            beat = self._read(rank)
            previous = self._seen.get(rank)
            if previous is None or previous[0] != beat:
                self._seen[rank] = (beat, now)

    def _read(self, rank: int) -> Heartbeat | None:
        key = HEARTBEAT_KEY.format(rank=rank)
        if not self.store.check([key]):
            return None
        return Heartbeat.decode(self.store.get(key))

    def silent_ranks(self) -> list[int]:
        """Ranks whose heartbeat has not moved for ``stale_after`` seconds of observation (not done)."""
        now = time.monotonic()
        return sorted(
            rank
            for rank, (beat, changed) in self._seen.items()
            if now - changed >= self.stale_after and not (beat is not None and beat.phase == DONE)
        )

    # -- messages -----------------------------------------------------------------------------------
    def _own_beat(self) -> Heartbeat:
        with self._lock:
            phase, iteration, detail, count = self._phase_text(), self._iteration, self._detail, self._count
        return Heartbeat(count, phase, iteration, time.time(), _call(detail, "waiting_on"))

    def _phase_text(self) -> str:
        return self._phase if self._detail is None else f"{self._phase}, {self._detail}"

    def _others(self, exclude: list[int]) -> dict[int, Heartbeat]:
        """The latest heartbeat of every rank not in ``exclude`` (this rank's own state included)."""
        beats = {self.rank: self._own_beat()}
        for rank in range(self.world_size):
            if rank != self.rank and rank not in exclude:
                beat = self._read(rank)
                if beat is not None and beat.phase != DONE:
                    beats[rank] = beat
        return beats

    def _by_activity(self, beats: dict[int, Heartbeat]) -> str:
        groups: dict[str, list[int]] = {}
        for rank in sorted(beats):
            groups.setdefault(beats[rank].doing(), []).append(rank)
        return "; ".join(f"{_ranks(ranks)} in {doing}" for doing, ranks in groups.items())

    def describe_silence(self, silent: list[int], waited: float) -> str:
        """The message naming the silent ranks and what the others were waiting in."""
        now, wall = time.monotonic(), time.time()
        parts = []
        for rank in silent:
            beat, changed = self._seen[rank]
            name = f"rank {rank} " if len(silent) > 1 else ""
            if beat is None:
                parts.append(f"{name}never sent a heartbeat")
            else:
                age = max(now - changed, wall - beat.wall_time)
                parts.append(f"{name}no heartbeat for {age:.0f} s (the last one said: {beat.doing()})")
        waiting = self._others(exclude=silent)
        doings = {beat.doing() for beat in waiting.values()}
        them = "it" if len(silent) == 1 else "them"
        where = (
            f"waited {waited:.0f} s for {them} in {doings.pop()}"
            if len(doings) == 1
            else f"waited up to {waited:.0f} s for {them} ({self._by_activity(waiting)})"
        )
        return (
            f"{_ranks(silent)} stopped answering: {'; '.join(parts)}; {_ranks(sorted(waiting))} {where} "
            f"({self.timeout_setting})"
        )

    def summary(self, silent: list[int], final: dict[int, Heartbeat] | None = None) -> str:
        """The hang's summary line (:func:`summarize_waits`) from every rank's latest heartbeat, or its
        ``final`` one where given: the state a rank failed in, which its ``done`` beat no longer says."""
        beats = self._others(exclude=[]) | (final or {})
        return f"hang summary: {summarize_waits(beats, silent)}"

    def explain_timeout(self) -> str:
        """What every rank was doing when this rank's backend timed out (main thread, after the error)."""
        self.observe()
        silent = self.silent_ranks()
        if silent:
            return self.describe_silence(silent, self.waited())
        return (
            f"timed out after {self.timeout:.0f} s ({self.timeout_setting}) while every "
            f"rank still answered: {self._by_activity(self._others(exclude=[]))}. The ranks wait on each "
            "other: a collective that not every rank runs, or one rank far slower than the others"
        )

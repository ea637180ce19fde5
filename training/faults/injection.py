"""Faults on purpose, for tests and drills: ``TRIDENT_FAULT=<kind>@<point>:<iteration>[:rank=R][:attempt=A]``.

``kind``: ``exception`` (a RuntimeError), ``kill`` (SIGKILL, as a lost host), ``term`` (SIGTERM, as a
scheduler's preemption notice), ``hang`` (the rank stops answering). ``point``: where in an
iteration it fires: ``forward`` (the step's start, before the schedule), ``optimizer`` (before the
update) or ``save`` (before a checkpoint is written). ``rank`` (default 0) is the global rank that
fires; ``attempt`` (default 0) the torchrun launch it fires in, so that a restarted run, which runs
the same command line, does not meet the same fault again.

An environment variable rather than a flag: the drill runs the production command line unchanged,
and each torchrun attempt sees the same variable (the ``attempt`` field says which one fires).
Several faults are separated by ``,``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from training.faults.restart import restart_attempt

__all__ = ["FAULT_ENV", "Fault", "inject", "parse_faults"]

FAULT_ENV = "TRIDENT_FAULT"
KINDS = ("exception", "kill", "term", "hang")
POINTS = ("forward", "optimizer", "save")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    point: str
    iteration: int
    rank: int = 0
    attempt: int = 0


def parse_faults(text: str) -> list[Fault]:
    """The faults ``text`` (``TRIDENT_FAULT``'s value) asks for; one ValueError naming a bad one."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(","))):
        try:
            head, *options = spec.split(":")
            kind, point = head.split("@")
            fields = dict(option.split("=", 1) for option in options[1:])
            fault = Fault(
                kind=kind,
                point=point,
                iteration=int(options[0]),
                rank=int(fields.pop("rank", 0)),
                attempt=int(fields.pop("attempt", 0)),
            )
        except (ValueError, IndexError):
            raise ValueError(_usage(spec)) from None
        if fault.kind not in KINDS or fault.point not in POINTS or fields:
            raise ValueError(_usage(spec))
        faults.append(fault)
    return faults


def _usage(spec: str) -> str:
    return (
        f"{FAULT_ENV}: cannot read {spec!r}; expected <kind>@<point>:<iteration>[:rank=R][:attempt=A] "
        f"with kind in {', '.join(KINDS)} and point in {', '.join(POINTS)}"
    )


_PLANNED: list[Fault] | None = None


def inject(point: str, iteration: int | None) -> None:
    """Fire the faults planned for ``point`` of ``iteration`` on this rank and launch attempt."""
    global _PLANNED
    if _PLANNED is None:
        _PLANNED = parse_faults(os.environ.get(FAULT_ENV, ""))
    if not _PLANNED or iteration is None:
        return
    rank, attempt = int(os.environ.get("RANK", "0")), restart_attempt()
    for fault in _PLANNED:
        if (fault.point, fault.iteration, fault.rank, fault.attempt) == (point, iteration, rank, attempt):
            _fire(fault)


def _fire(fault: Fault) -> None:
    where = f"{fault.kind} at {fault.point} of iteration {fault.iteration} on rank {fault.rank}"
    if fault.kind == "exception":
        raise RuntimeError(f"injected fault ({FAULT_ENV}): {where}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    # SIGTERM with --exit-signal-handler is a request (the loop saves and stops); without it, the end
    os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)

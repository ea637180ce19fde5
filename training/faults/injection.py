"""Faults on purpose, for tests and drills: ``TRIDENT_FAULT=<kind>@<point>:<iteration>[:rank=R][:attempt=A]``.

``kind``: ``exception`` (a RuntimeError), ``kill`` (SIGKILL, as a lost host), ``term`` (SIGTERM, as a
scheduler's preemption notice), ``hang`` (the rank stops answering), ``slow`` (a straggler: from that
iteration on, each of the rank's forward computations takes ``factor`` times as long, ``:factor=F``,
default 1.5), ``nan`` (in that iteration the rank's forward outputs are NaN: the loss and every
gradient behind them, as a bad value or a flipped bit would make them). ``slow`` and ``nan`` fire at
``forward`` only. ``point``: where in an
iteration it fires: ``forward`` (the step's start, before the schedule), ``optimizer`` (before the
update) or ``save`` (before a checkpoint is written). ``rank`` (default 0) is the global rank that
fires; ``attempt`` (default 0) the torchrun launch it fires in, so that a restarted run, which runs
the same command line, does not meet the same fault again.

An environment variable rather than a flag: the drill runs the production command line unchanged,
and each torchrun attempt sees the same variable (the ``attempt`` field says which one fires).
Several faults are separated by ``,``. Each fires once per process: the rerun of an iteration that
result validation makes (:mod:`training.faults.validation`) meets none, as after a transient fault.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from training.faults.restart import restart_attempt

__all__ = ["FAULT_ENV", "Fault", "faulty_forward", "inject", "parse_faults"]

FAULT_ENV = "TRIDENT_FAULT"
KINDS = ("exception", "kill", "term", "hang", "slow", "nan")
FORWARD_ONLY = ("slow", "nan")  # kinds that act through the forward step
POINTS = ("forward", "optimizer", "save")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    point: str
    iteration: int
    rank: int = 0
    attempt: int = 0
    factor: float = 1.5
    """``slow``: how many times as long the rank's forward computations take."""


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
                factor=float(fields.pop("factor", 1.5)),
            )
        except (ValueError, IndexError):
            raise ValueError(_usage(spec)) from None
        misplaced = fault.kind in FORWARD_ONLY and fault.point != "forward"
        if fault.kind not in KINDS or fault.point not in POINTS or fields or misplaced or fault.factor < 1:
            raise ValueError(_usage(spec))
        faults.append(fault)
    return faults


def _usage(spec: str) -> str:
    return (
        f"{FAULT_ENV}: cannot read {spec!r}; expected <kind>@<point>:<iteration>[:rank=R][:attempt=A] "
        f"with kind in {', '.join(KINDS)} and point in {', '.join(POINTS)} (slow and nan: at forward; "
        f"slow takes [:factor=F], F >= 1)"
    )


_PLANNED: list[Fault] | None = None


def inject(point: str, iteration: int | None) -> None:
    """Fire the faults planned for ``point`` of ``iteration`` on this rank and launch attempt."""
    global _PLANNED
    if _PLANNED is None:
        _PLANNED = parse_faults(os.environ.get(FAULT_ENV, ""))
    if not _PLANNED or iteration is None:
        return
    global _POISONED
    if point == "forward":
        _POISONED = False  # a nan fault poisons one iteration
    rank, attempt = int(os.environ.get("RANK", "0")), restart_attempt()
    for fault in _PLANNED:
        here = (fault.point, fault.iteration, fault.rank, fault.attempt) == (point, iteration, rank, attempt)
        if here and fault not in _FIRED:  # once: a rerun of the iteration (result validation) meets none
            _FIRED.add(fault)
            _fire(fault)


_FIRED: set[Fault] = set()
_SLOWDOWN = 1.0  # this rank's forward computations take this many times as long (a ``slow`` fault)
_POISONED = False  # this iteration's forward outputs are NaN (a ``nan`` fault)


def faulty_forward(forward_step_func: Callable) -> Callable:
    """``forward_step_func`` as the ``slow`` and ``nan`` faults fired on this rank make it (the same
    function when neither is planned: nothing is added to a normal run)."""
    if not any(fault.kind in FORWARD_ONLY for fault in parse_faults(os.environ.get(FAULT_ENV, ""))):
        return forward_step_func

    @functools.wraps(forward_step_func)
    def forward_step(*args, **kwargs):
        start = time.perf_counter()
        output, loss_func = forward_step_func(*args, **kwargs)
        if _SLOWDOWN > 1.0:
            time.sleep((_SLOWDOWN - 1.0) * (time.perf_counter() - start))
        if _POISONED:
            output = output * float("nan")
        return output, loss_func

    return forward_step


def _fire(fault: Fault) -> None:
    global _SLOWDOWN, _POISONED
    where = f"{fault.kind} at {fault.point} of iteration {fault.iteration} on rank {fault.rank}"
    if fault.kind == "slow":
        _SLOWDOWN = fault.factor
        return
    if fault.kind == "nan":
        _POISONED = True
        return
    if fault.kind == "exception":
        raise RuntimeError(f"injected fault ({FAULT_ENV}): {where}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    # SIGTERM with --exit-signal-handler is a request (the loop saves and stops); without it, the end
    os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)

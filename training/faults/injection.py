"""Faults on purpose, for tests and drills: ``TRIDENT_FAULT=<kind>@<point>:<iteration>[:rank=R][:attempt=A]``.

``kind``: ``exception`` (a RuntimeError), ``kill`` (SIGKILL, as a lost host), ``term`` (SIGTERM, as a
scheduler's preemption notice), ``hang`` (the rank stops answering), ``slow`` (a straggler: from that
iteration on, each of the rank's forward computations takes ``factor`` times as long, ``:factor=F``,
default 1.5), ``nan`` (in that iteration the rank's forward outputs are NaN, so the loss and every
gradient behind them, as a bad value or a flipped bit would make them; at ``backward``, the gradient
reaching the rank's first forward output is NaN and the loss stays finite), ``write`` (the
checkpoint's write fails on the rank after its first file, as a full disk would).

``point``: where in an iteration it fires: ``forward`` (the step's start, before the schedule),
``data`` (when the rank's forward step is first called, before it reads its first microbatch),
``backward`` (when the rank's first backward of the iteration reaches its forward step's output,
inside autograd), ``optimizer`` (before the update) or ``save`` (before a checkpoint is written).
``slow`` fires at ``forward`` only, ``nan`` at ``forward`` or ``backward``, ``write`` at ``save``.
``rank`` (default 0) is the global rank that fires; ``attempt`` (default 0) the torchrun launch it
fires in, so that a restarted run, which runs the same command line, does not meet the same fault
again.

An environment variable rather than a flag: the drill runs the production command line unchanged,
and each torchrun attempt sees the same variable (the ``attempt`` field says which one fires).
Several faults are separated by ``,``. Each fires once per process: the rerun of an iteration that
result validation makes (:mod:`training.faults.validation`) meets none, as after a transient fault.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from training.faults.restart import restart_attempt

__all__ = ["FAULT_ENV", "Fault", "after_checkpoint_file", "faulty_forward", "inject", "parse_faults"]

FAULT_ENV = "TRIDENT_FAULT"
KINDS = ("exception", "kill", "term", "hang", "slow", "nan", "write")
POINTS = ("forward", "data", "backward", "optimizer", "save")
ONLY_AT = {"slow": ("forward",), "nan": ("forward", "backward"), "write": ("save",)}
"""Kinds that fire at some points only; the others fire at every point."""
IN_STEP = ("data", "backward")
"""Points inside the schedule, reached through the forward step (:func:`faulty_forward`)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault of ``TRIDENT_FAULT`` (module docstring)."""

    kind: str
    """What happens: one of :data:`KINDS`."""
    point: str
    """Where in the iteration: one of :data:`POINTS`."""
    iteration: int
    rank: int = 0
    """The global rank that fires."""
    attempt: int = 0
    """The torchrun launch it fires in (``TORCHELASTIC_RESTART_COUNT``)."""
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
        misplaced = fault.point not in ONLY_AT.get(fault.kind, POINTS)
        if fault.kind not in KINDS or fault.point not in POINTS or fields or misplaced or fault.factor < 1:
            raise ValueError(_usage(spec))
        faults.append(fault)
    return faults


def _usage(spec: str) -> str:
    return (
        f"{FAULT_ENV}: cannot read {spec!r}; expected <kind>@<point>:<iteration>[:rank=R][:attempt=A] "
        f"with kind in {', '.join(KINDS)} and point in {', '.join(POINTS)} (slow: at forward; nan: at "
        f"forward or backward; write: at save; slow takes [:factor=F], F >= 1)"
    )


_PLANNED: list[Fault] | None = None


def inject(point: str, iteration: int | None) -> None:
    """Fire the faults planned for ``point`` of ``iteration`` on this rank and launch attempt."""
    global _PLANNED, _POISONED, _GRADIENT_POISONED, _ITERATION
    if _PLANNED is None:
        _PLANNED = parse_faults(os.environ.get(FAULT_ENV, ""))
    if not _PLANNED or iteration is None:
        return
    if point == "forward":  # a step starts: a nan fault poisons one iteration, in-step points come
        _POISONED = _GRADIENT_POISONED = False
        _ITERATION = iteration
        _PENDING.update(IN_STEP)
    rank, attempt = int(os.environ.get("RANK", "0")), restart_attempt()
    for fault in _PLANNED:
        here = (fault.point, fault.iteration, fault.rank, fault.attempt) == (point, iteration, rank, attempt)
        if here and fault not in _FIRED:  # once: a rerun of the iteration (result validation) meets none
            _FIRED.add(fault)
            _fire(fault)


_FIRED: set[Fault] = set()
_SLOWDOWN = 1.0  # this rank's forward computations take this many times as long (a ``slow`` fault)
_POISONED = False  # this iteration's forward outputs are NaN (``nan@forward``)
_GRADIENT_POISONED = False  # the gradient reaching this iteration's first forward output is NaN
_FAILING_WRITE: str | None = None  # the write fault fired for the save being written
_ITERATION: int | None = None  # the iteration whose step runs (set at its forward point)
_PENDING: set[str] = set()  # the in-step points this iteration has not reached yet


def faulty_forward(forward_step_func: Callable) -> Callable:
    """``forward_step_func`` as the faults planned for this run make it: the ``data`` and
    ``backward`` points, a ``slow`` rank, NaN outputs or gradients (the same function when none of
    these is planned: nothing is added to a normal run)."""
    planned = parse_faults(os.environ.get(FAULT_ENV, ""))
    if not any(fault.kind in ("slow", "nan") or fault.point in IN_STEP for fault in planned):
        return forward_step_func

    @functools.wraps(forward_step_func)
    def forward_step(*args, **kwargs):
        if "data" in _PENDING:
            _PENDING.discard("data")
            inject("data", _ITERATION)
        start = time.perf_counter()
        output, loss_func = forward_step_func(*args, **kwargs)
        if _SLOWDOWN > 1.0:
            time.sleep((_SLOWDOWN - 1.0) * (time.perf_counter() - start))
        if _POISONED:
            output = output * float("nan")
        if "backward" in _PENDING and output.requires_grad:
            _PENDING.discard("backward")
            output.register_hook(_at_backward)
        return output, loss_func

    return forward_step


def _at_backward(grad):
    inject("backward", _ITERATION)
    return grad * float("nan") if _GRADIENT_POISONED else grad


def after_checkpoint_file(name: str) -> None:
    """Called after each file of a checkpoint is in place: a ``write`` fault fired for this save makes
    the write fail here, after its first file (a partial directory that must not count as a checkpoint)."""
    global _FAILING_WRITE
    if _FAILING_WRITE is not None:
        where, _FAILING_WRITE = _FAILING_WRITE, None
        raise OSError(errno.ENOSPC, f"injected fault ({FAULT_ENV}): {where}, after writing {name}")


def _fire(fault: Fault) -> None:
    global _SLOWDOWN, _POISONED, _GRADIENT_POISONED, _FAILING_WRITE
    where = f"{fault.kind} at {fault.point} of iteration {fault.iteration} on rank {fault.rank}"
    if fault.kind == "slow":
        _SLOWDOWN = fault.factor
        return
    if fault.kind == "nan" and fault.point == "backward":
        _GRADIENT_POISONED = True
        return
    if fault.kind == "nan":
        _POISONED = True
        return
    if fault.kind == "write":
        _FAILING_WRITE = where
        return
    if fault.kind == "exception":
        raise RuntimeError(f"injected fault ({FAULT_ENV}): {where}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    # SIGTERM with --exit-signal-handler is a request (the loop saves and stops); without it, the end
    os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)

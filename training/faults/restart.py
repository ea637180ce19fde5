"""A run restarted by torchrun (``--max-restarts``): which attempt this is, and where it resumes from.

torchrun relaunches every worker with the same command line after any of them fails. Each attempt
meets under its own store prefix (``core.parallel_state``), derives data parallelism again from the
world it finds (the global batch stays, the microbatch count follows), and loads the latest complete
checkpoint, resharding it to the new split.
"""

from __future__ import annotations

import argparse
import os
import time


def restart_attempt() -> int:
    """Which launch of the workers this is under ``torchrun --max-restarts``: 0 for the first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_from_save_on_restart(args: argparse.Namespace) -> argparse.Namespace:
    """``args``, with ``--load`` set to ``--save`` when torchrun restarted the workers of a run that
    saves but gave no ``--load`` (a copy; ``args`` is not changed): a restarted worker runs the same
    command line as the first, and must go on from the last complete checkpoint, not from scratch."""
    if restart_attempt() == 0 or not getattr(args, "save", None) or getattr(args, "load", None):
        return args
    return argparse.Namespace(**{**vars(args), "load": args.save})


MARKS: dict[str, float] = {}
"""Wall times this process reached each stage of a resume (the first time only)."""


def mark(stage: str) -> None:
    """This process reached ``stage``: ``rendezvous`` (the process group), ``loaded`` (model, optimizer
    and checkpoint), ``first step`` (the first iteration done)."""
    MARKS.setdefault(stage, time.time())


def process_start_time() -> float | None:
    """When this process started (Linux: ``/proc``), else None."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def time_to_resume(previous_beats: list[float]) -> str | None:
    """The resume's timing, from the fault to the first step, or None on a first attempt.

    The fault is dated by the previous attempt's heartbeats: the first rank to stop beating stopped
    at the fault or up to one watchdog interval after its last beat (``--distributed-timeout-minutes``
    / 10, at most 10 s), so the total can overstate by that much; the last rank's last beat is about
    when torchrun tore the attempt down. Detect and tear-down run to that moment, start to this
    process's start, then the rendezvous, the load (model, optimizer, data, checkpoint) and the
    first step."""
    if restart_attempt() == 0 or not previous_beats or "first step" not in MARKS:
        return None
    fault, down = min(previous_beats), max(previous_beats)
    started = process_start_time() or MARKS.get("rendezvous", down)
    stages = [
        ("detect and tear-down", down - fault),
        ("start", started - down),
        ("rendezvous", MARKS.get("rendezvous", started) - started),
        ("load", MARKS.get("loaded", started) - MARKS.get("rendezvous", started)),
        ("first step", MARKS["first step"] - MARKS.get("loaded", started)),
    ]
    parts = ", ".join(f"{name} {max(seconds, 0.0):.1f} s" for name, seconds in stages)
    return (
        f"time to resume (torchrun restart {restart_attempt()}): {MARKS['first step'] - fault:.1f} s from "
        f"the last heartbeat before the fault (attempt {restart_attempt() - 1}) to the first step: {parts}"
    )

"""A run restarted by torchrun (``--max-restarts``): which attempt this is, and where it resumes from.

torchrun relaunches every worker with the same command line after any of them fails. Each attempt
meets under its own store prefix (``core.parallel_state``), derives data parallelism again from the
world it finds (the global batch stays, the microbatch count follows), and loads the latest complete
checkpoint, resharding it to the new split.
"""

from __future__ import annotations

import argparse
import os


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

"""``--record-memory-history``: the CUDA caching allocator's history, for pytorch.org/memory_viz.

As in Megatron: recording starts before the model is built, on the ranks of ``--profile-ranks`` only
(they alone pay its overhead), and every log step dumps the history so far to ``--memory-snapshot-path``
with the rank before the extension (``snapshot_0.pickle``). Off CUDA there is no caching allocator to
record: the run says so once and goes on.
"""

from __future__ import annotations

import os

import torch

from training.arguments.config import TrainingArgs
from training.reporting.logging_utils import print_rank_0

MAX_ENTRIES = 100_000
"""Allocation and free events kept (Megatron's figure): the newest, once a long run has made more."""


def records(flags: TrainingArgs, rank: int, device: torch.device) -> bool:
    """Whether this rank records."""
    return flags.record_memory_history and device.type == "cuda" and rank in flags.profile_ranks


def snapshot_path(flags: TrainingArgs, rank: int) -> str:
    """``--memory-snapshot-path`` with ``_<rank>`` before its extension."""
    base, ext = os.path.splitext(flags.memory_snapshot_path)
    return f"{base}_{rank}{ext}"


def start_recording(flags: TrainingArgs, rank: int, device: torch.device) -> None:
    """Start recording where :func:`records` says so; off CUDA, rank 0 says once that nothing is."""
    if flags.record_memory_history and device.type != "cuda":
        print_rank_0(
            f"--record-memory-history: the allocator history needs CUDA; this run computes on the "
            f"{device.type.upper()} and goes on without it"
        )
    if records(flags, rank, device):
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def dump(path: str) -> None:
    """Write the history recorded so far to ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)

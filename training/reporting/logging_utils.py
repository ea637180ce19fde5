"""Rank-aware printing: rank 0 says what is happening, the loss stage's first rank reports losses.

Every line goes out through :func:`print_line`: one ``write`` of the text and its newline, then a
flush. torchrun starts its workers with ``python -u``, where ``print`` writes the text and the
newline separately, unbuffered; two ranks sharing the launcher's output then end up on one line
(``...(iteration 100)saved checkpoint ...``). One write per line keeps lines whole: a pipe or
terminal write of up to ``PIPE_BUF`` (4 KiB) bytes is never split by another process's.

This module imports torch only when a rank is asked for, so tools without torch can print with it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from core.parallel_state import ParallelGroups
    from core.pipeline_parallel.layout import PipelineLayout


def print_line(message: str, *, file: TextIO | None = None) -> None:
    """``message`` and a newline in one write, flushed (``file``: stdout by default)."""
    out = sys.stdout if file is None else file
    out.write(f"{message}\n")
    out.flush()


def is_logging_rank(layout: PipelineLayout, groups: ParallelGroups | None) -> bool:
    """First TP and DP x CP rank of the pipeline rank that has the loss: the last, or the first under ZBV.

    ``groups`` None: one process, which logs."""
    if groups is None:
        return True
    return (
        holds_loss(layout, groups.rank_in("pp"))
        and groups.rank_in("tp") == 0
        and groups.rank_in("dp_cp") == 0
    )


def holds_loss(layout: PipelineLayout, pp_rank: int) -> bool:
    """Whether one of ``pp_rank``'s stages computes the loss."""
    return any(layout.has_loss(pp_rank, v if layout.vpp_size > 1 else None) for v in range(layout.vpp_size))


def print_rank_0(message: str) -> None:
    """Print from global rank 0 (every process when torch.distributed is not running)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print_line(message)


def set_logging_level(level: int | None) -> None:
    """``--logging-level`` (else ``MEGATRON_LOGGING_LEVEL``), as Megatron: the level of Python's root
    logger, which the libraries log through (Trident's own lines are printed)."""
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)

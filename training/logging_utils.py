"""Rank-aware printing: rank 0 says what is happening, the loss stage's first rank reports losses.

Every line goes out through :func:`print_line`: one ``write`` of the text and its newline, then a
flush. torchrun starts its workers with ``python -u``, where ``print`` writes the text and the
newline separately, unbuffered; two ranks sharing the launcher's output then end up on one line
(``...(iteration 100)saved checkpoint ...``). One write per line keeps lines whole: a pipe or
terminal write of up to ``PIPE_BUF`` (4 KiB) bytes is never split by another process's.

This module imports torch only when a rank is asked for, so tools without torch can print with it.
"""

from __future__ import annotations

import sys
from typing import TextIO


def print_line(message: str, *, file: TextIO | None = None) -> None:
    """``message`` and a newline in one write, flushed (``file``: stdout by default)."""
    out = sys.stdout if file is None else file
    out.write(f"{message}\n")
    out.flush()


def is_logging_rank() -> bool:
    """First TP and DP rank of the pipeline rank that has the loss: the last, or the first under ZBV."""
    from core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    return holds_loss() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def holds_loss() -> bool:
    """Whether one of this pipeline rank's stages computes the loss (as the run's layout places them)."""
    from core import parallel_state as ps
    from models.gpt.gpt_model import pipeline_layout
    from training.global_vars import get_args

    layout = pipeline_layout(get_args())
    rank = ps.get_pipeline_model_parallel_rank()
    return any(layout.has_loss(rank, v if layout.vpp_size > 1 else None) for v in range(layout.vpp_size))


def print_rank_0(message: str) -> None:
    """Print from global rank 0 (every process when torch.distributed is not running)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print_line(message)


def print_rank_last(message: str) -> None:
    """Print from the rank that computes the loss, so no rank shows a meaningless one."""
    if is_logging_rank():
        print_line(message)

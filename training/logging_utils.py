"""Rank-aware printing: rank 0 says what is happening, the loss stage's first rank reports losses."""

from __future__ import annotations

import torch.distributed as dist

from core import parallel_state as ps


def is_logging_rank() -> bool:
    """First TP and DP rank of the pipeline rank that has the loss: the last, or the first under ZBV."""
    if not ps.model_parallel_is_initialized():
        return True
    return holds_loss() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def holds_loss() -> bool:
    """Whether one of this pipeline rank's stages computes the loss (as the run's layout places them)."""
    from models.gpt.gpt_model import pipeline_layout
    from training.global_vars import get_args

    layout = pipeline_layout(get_args())
    rank = ps.get_pipeline_model_parallel_rank()
    return any(layout.has_loss(rank, v if layout.vpp_size > 1 else None) for v in range(layout.vpp_size))


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    """Print from the rank that computes the loss, so no rank shows a meaningless one."""
    if is_logging_rank():
        print(message, flush=True)

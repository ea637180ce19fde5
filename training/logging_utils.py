"""Rank-aware printing: rank 0 says what is happening, the last stage's first rank reports losses."""

from __future__ import annotations

import torch.distributed as dist

from core import parallel_state as ps


def is_logging_rank() -> bool:
    """First TP and DP rank of the last pipeline stage: the rank that has the loss."""
    if not ps.model_parallel_is_initialized():
        return True
    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    """Print from the rank that computes the loss, so no rank shows a meaningless one."""
    if is_logging_rank():
        print(message, flush=True)

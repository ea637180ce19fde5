"""Rank-aware printing: rank 0 says what is happening, the loss stage's first rank reports losses."""

from __future__ import annotations

import torch.distributed as dist

from core import parallel_state as ps
from core.pipeline_parallel.layout import PipelineLayout


def is_logging_rank(layout: PipelineLayout) -> bool:
    """First TP and DP rank of the pipeline rank that has the loss: the last, or the first under ZBV."""
    if not ps.model_parallel_is_initialized():
        return True
    return (
        holds_loss(layout, ps.get_pipeline_model_parallel_rank())
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


def holds_loss(layout: PipelineLayout, pp_rank: int) -> bool:
    """Whether one of ``pp_rank``'s stages computes the loss."""
    return any(layout.has_loss(pp_rank, v if layout.vpp_size > 1 else None) for v in range(layout.vpp_size))


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)

"""What the data-parallel tests share (one process in tests/unit, real ranks in tests/dist): the toy
stage they wrap (embedding, two decoder layers, loss) and the relative error."""

from __future__ import annotations

import torch

from core.model_parallel_config import ModelParallelConfig
from tests.support.pipeline_toy import ToyStage

SYMBOLS, DECODER_IDS = ["E", "t", "t", "L"], [0, 1]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return ((a - b).norm() / b.norm()).item()


def toy(per_token: bool = False) -> ToyStage:
    """The toy stage at hidden size 8 (``per_token``: losses reduced per token)."""
    return ToyStage(
        ModelParallelConfig(hidden_size=8, calculate_per_token_loss=per_token), SYMBOLS, DECODER_IDS
    )

"""A GPT built and split as training builds it, stepping with plain SGD on Megatron's distributed optimizer.

The multi-rank parity tests (context parallelism, expert parallelism) take one optimizer step and compare
the parameters with a single-device reference: SGD without weight decay keeps that comparison exact
(the change is ``lr`` times the reduced gradient, plus ``sgd_momentum`` times the last change).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from core.distributed import DistributedDataParallelConfig
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.pipeline_parallel.hooks import ScheduleHooks
from core.transformer import TransformerConfig
from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout


@dataclass(kw_only=True)
class SgdModel:
    """This rank's chunks, their optimizer and the hooks to hand the schedule at its call."""

    chunks: list[nn.Module]
    optimizer: Any
    hooks: ScheduleHooks


def parallelize_with_sgd(
    config: TransformerConfig,
    vocab_size: int,
    seq_length: int,
    *,
    lr: float,
    ddp_config: DistributedDataParallelConfig | None,
    sgd_momentum: float = 0.0,
    clip_grad: float = 0.0,
) -> SgdModel:
    """This rank's chunks of the model (``pipeline_layout(config)``), their SGD optimizer (None without
    ``ddp_config``) and hooks."""
    optimizer_config = OptimizerConfig(
        optimizer="sgd",
        lr=lr,
        sgd_momentum=sgd_momentum,
        weight_decay=0.0,
        clip_grad=clip_grad,
        use_distributed_optimizer=True,
    )
    model = parallelize_gpt(
        gpt_provider(config, vocab_size, seq_length), layout=pipeline_layout(config), ddp_config=ddp_config
    )
    # the distributed optimizer needs DDP-wrapped chunks: without them, gradients only (no optimizer)
    optimizer = get_megatron_optimizer(optimizer_config, model.chunks) if ddp_config is not None else None
    return SgdModel(chunks=model.chunks, optimizer=optimizer, hooks=model.schedule_hooks(optimizer))

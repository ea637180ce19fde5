"""A GPT built and split as training builds it, stepping with plain SGD on Megatron's distributed optimizer.

The multi-rank parity tests (context parallelism, expert parallelism) take one optimizer step and compare
the parameters with a single-device reference: SGD without weight decay keeps that comparison exact
(the change is ``lr`` times the reduced gradient, plus ``sgd_momentum`` times the last change).
"""

from __future__ import annotations

from core.distributed import DistributedDataParallelConfig
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.transformer import TransformerConfig
from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
from models.gpt.parallelize import ParallelGPT


def parallelize_with_sgd(
    config: TransformerConfig,
    vocab_size: int,
    seq_length: int,
    *,
    lr: float,
    ddp_config: DistributedDataParallelConfig | None,
    sgd_momentum: float = 0.0,
    clip_grad: float = 0.0,
) -> ParallelGPT:
    """This rank's chunks of the model (``pipeline_layout(config)``) and their SGD optimizer."""
    optimizer_config = OptimizerConfig(
        optimizer="sgd",
        lr=lr,
        sgd_momentum=sgd_momentum,
        weight_decay=0.0,
        clip_grad=clip_grad,
        use_distributed_optimizer=True,
    )
    return parallelize_gpt(
        gpt_provider(config, vocab_size, seq_length),
        layout=pipeline_layout(config),
        ddp_config=ddp_config,
        make_optimizer=lambda chunks: get_megatron_optimizer(optimizer_config, chunks),
    )

"""Data parallelism: gradient buffers and buckets (DistributedDataParallel) and the end-of-step reductions."""

from core.distributed.distributed_data_parallel import DistributedDataParallel, multi_no_sync
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.finalize_model_grads import finalize_model_grads, scale_by_num_tokens

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "finalize_model_grads",
    "multi_no_sync",
    "scale_by_num_tokens",
]

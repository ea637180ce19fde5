"""Tensor parallelism (Megatron's ``megatron.core.tensor_parallel``): layers, mappings, loss and RNG.

Every function and layer takes an optional ``tp_group``; without one it uses
``parallel_state.get_tensor_model_parallel_group()``, and in a process without torch.distributed
it behaves as a tensor-parallel world of one.
"""

from core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from core.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from core.tensor_parallel.random import (
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_rng_tracker_name,
    model_parallel_seed,
)
from core.tensor_parallel.utils import (
    copy_tensor_model_parallel_attributes,
    divide,
    gather_full,
    param_is_not_tensor_parallel_duplicate,
    param_is_tensor_parallel,
    resolve_tp_group,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_of,
    split_tensor_along_last_dim,
    tp_rank,
    tp_world_size,
    vocab_range,
)

__all__ = [
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "fused_vocab_parallel_cross_entropy",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_full",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_rng_tracker_name",
    "model_parallel_seed",
    "param_is_not_tensor_parallel_duplicate",
    "param_is_tensor_parallel",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "resolve_tp_group",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_of",
    "split_tensor_along_last_dim",
    "tp_rank",
    "tp_world_size",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]

"""Tensor-parallel helpers in one process: Megatron's shard striding, the RNG tracker's checks, and the
layers without torch.distributed (unsharded). Two real ranks: tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.model_parallel_config import ModelParallelConfig
from core.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
    shard_of,
    vocab_parallel_cross_entropy,
)
from tests.support.tensor_parallel import close


def test_shard_of_follows_megatron_striding():
    param = nn.Parameter(torch.empty(4))
    set_tensor_model_parallel_attributes(param, True, 0, 2)
    full = torch.arange(8.0)
    assert shard_of(full, param, 0, 2).tolist() == [0, 1, 4, 5]
    assert shard_of(full, param, 1, 2).tolist() == [2, 3, 6, 7]


def test_rng_tracker_rejects_reused_names_and_seeds():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_seed"), tracker.fork("missing"):
        pass


def test_single_process_without_distributed_runs_unsharded():
    """No torch.distributed at all: a TP world of one, same layers, no communication."""
    if dist.is_initialized():
        pytest.skip("torch.distributed was initialised in this process by another test")
    torch.manual_seed(5)
    config = ModelParallelConfig()
    x = torch.randn(3, 2, 4)
    fc1 = ColumnParallelLinear(4, 8, config=config, init_method=nn.init.normal_)
    fc2 = RowParallelLinear(8, 4, config=config, init_method=nn.init.normal_, input_is_parallel=True)
    y, _ = fc2(F.gelu(fc1(x)[0]))
    ref = F.linear(F.gelu(F.linear(x, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)
    close(y, ref, "MLP output")
    logits, target = torch.randn(5, 8), torch.randint(0, 8, (5,))
    close(
        vocab_parallel_cross_entropy(logits, target),
        F.cross_entropy(logits, target, reduction="none"),
        "loss",
    )


def test_with_one_rank_the_mappings_add_no_autograd_node():
    """At TP=1 every mapping is the identity both ways, so the entry points hand the input back as it is:
    no node whose Python backward would run for every layer of every microbatch."""
    from core.tensor_parallel import mappings

    if dist.is_initialized():
        pytest.skip("torch.distributed was initialised in this process by another test")
    x = torch.randn(4, 2, 6, requires_grad=True)
    y = x * 2
    for name in (
        "copy_to_tensor_model_parallel_region",
        "reduce_from_tensor_model_parallel_region",
        "scatter_to_tensor_model_parallel_region",
        "gather_from_tensor_model_parallel_region",
        "scatter_to_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    ):
        assert getattr(mappings, name)(y) is y, name

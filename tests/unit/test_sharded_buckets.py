"""ZeRO-2/3 buckets in one process (no process group): what they hold when, and that a dropped model is freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from core.distributed.sharding_units import layer_units
from models.gpt import GPTModel
from tests.support.configs import tiny_config

VOCAB, SEQ, MBS = 64, 8, 2


def _wrapped(strategy: str):
    config = tiny_config("llama", gradient_accumulation_fusion=False)
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True, data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True
    )
    return DistributedDataParallel(config, ddp, GPTModel(config, VOCAB, SEQ))


def _loss(model) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(0))
    return model(tokens, labels=tokens.roll(1, 1)).sum()


def test_zero3_holds_a_layer_only_while_it_runs_and_no_full_gradient_between_microbatches():
    model = _wrapped("optim_grads_params")
    layers = layer_units(model.module)
    assert len(layers) == model.config.num_layers and len(model.buckets) > len(layers)
    seen = []
    for layer in layers:
        layer.register_forward_hook(  # after the wrapper's own hook freed it
            lambda module, args, out: seen.append(sum(b.params_live for b in model.buckets))
        )
    loss = _loss(model)
    assert not any(b.params_live for b in model.buckets)  # forward done: every unit freed
    own = len(model.buckets) - len(layers)  # a bucket per layer; the chunk's own weights fill the others
    assert seen == [own] * len(layers)  # after a layer ran, only the chunk's own unit stays gathered
    loss.backward()
    assert not any(b.params_live or b.grad_data.untyped_storage().nbytes() for b in model.buckets)
    model.finish_grad_sync()
    assert all(b.grad_shard.abs().sum() > 0 for b in model.buckets)


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_a_dropped_sharded_wrapper_frees_its_model_and_buffers(strategy):
    model = _wrapped(strategy)
    _loss(model).backward()
    alive = [weakref.ref(x) for x in (model, model.module, model.buckets[0], next(model.parameters()))]
    del model
    gc.collect()
    assert [ref() is None for ref in alive] == [True] * 4

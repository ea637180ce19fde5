"""Optimizer on real ranks: global-norm clipping over TP x PP with a tied embedding, and a NaN on one
rank skipping the step everywhere. The optimizer in one process: tests/unit/test_optimizer.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core.optimizer import OptimizerConfig, get_grad_norm_fp32, get_megatron_optimizer
from core.tensor_parallel.utils import set_tensor_model_parallel_attributes, shard_of
from tests.support.optimizer import adam_state_sum

# --------------------------------------------------------------------------------------------------
# Global norm and clipping on real ranks: TP=2 x PP=2, tied embedding
# --------------------------------------------------------------------------------------------------

# name: (full shape, stage, tensor-parallel partition dim or None for replicated)
_WEIGHTS = {
    "embedding": ((8, 4), 0, 0),
    "fc1.weight": ((6, 4), 0, 0),
    "fc1.bias": ((6,), 0, 0),
    "norm0": ((4,), 0, None),
    "fc2.weight": ((4, 6), 1, 1),
    "fc2.bias": ((4,), 1, None),
    "norm1": ((4,), 1, None),
}


def _full_grads() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    grads = {name: torch.randn(shape, generator=gen) for name, (shape, _, _) in _WEIGHTS.items()}
    grads["embedding"][0] = 0.0  # a few exact zeros to count
    return grads


class _HandStage(nn.Module):
    """This rank's shards of the single-device weights; the last stage holds the tied output copy."""

    def __init__(self, pp_rank: int, tp_rank: int, grads: dict[str, torch.Tensor]):
        super().__init__()
        self.params = nn.ParameterDict()
        placed = {n: spec for n, spec in _WEIGHTS.items() if spec[1] == pp_rank}
        if pp_rank == 1:
            placed["output"] = _WEIGHTS["embedding"][:1] + (1, 0)
        for name, (shape, _, dim) in placed.items():
            full_grad = grads["embedding" if name == "output" else name]
            param = nn.Parameter(torch.ones(shape))
            set_tensor_model_parallel_attributes(param, dim is not None, -1 if dim is None else dim)
            param.data = shard_of(param.data, param, tp_rank, 2)
            param.grad = shard_of(full_grad, param, tp_rank, 2).clone()
            if name in ("embedding", "output"):
                param.shared_embedding = True  # after finalize both copies hold the summed gradient
            self.params[name.replace(".", "_")] = param


def _clip_case(rank, world_size, nan_rank):
    from core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    grads = _full_grads()
    stage = _HandStage(ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), grads)
    if rank == nan_rank:
        next(iter(stage.parameters())).grad.view(-1)[1] = float("nan")
    expected = math.sqrt(sum(g.double().square().sum().item() for g in grads.values()))
    clip = expected / 4
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=0.1, weight_decay=0.0, clip_grad=clip, log_num_zeros_in_grad=True), [stage]
    )
    before = [p.detach().clone() for p in stage.parameters()]
    unclipped = [p.grad.clone() for p in stage.parameters()]
    ok, grad_norm, zeros = optimizer.step()
    local_max = max(g.abs().max().item() for g in unclipped)
    inf_norm = get_grad_norm_fp32(unclipped, math.inf, ps.get_model_parallel_group())
    unchanged = all(torch.equal(a, p) for a, p in zip(before, stage.parameters()))
    clipped_right = all(
        torch.allclose(p.grad, g * clip / (expected + 1e-6), rtol=1e-6, atol=0)
        for p, g in zip(stage.parameters(), unclipped)
    )
    return (
        ok,
        grad_norm,
        expected,
        zeros,
        unchanged,
        clipped_right,
        inf_norm,
        local_max,
        max(g.abs().max().item() for g in grads.values()),
        adam_state_sum(optimizer),
    )


def test_global_norm_over_tp_and_pp_counts_each_weight_once_and_clips(ranks):
    results = ranks(4).run(_clip_case, -1, timeout=60)
    for ok, grad_norm, expected, zeros, unchanged, clipped_right, inf_norm, _, full_max, _ in results:
        assert ok and not unchanged
        assert grad_norm == pytest.approx(expected, rel=1e-6)
        assert zeros == 4  # the embedding's zeroed row, counted once although held twice
        assert clipped_right
        assert inf_norm == pytest.approx(full_max, rel=1e-7)


def test_nan_on_one_rank_skips_the_step_everywhere(ranks):
    results = ranks(4).run(_clip_case, 3, timeout=60)
    for ok, grad_norm, _, zeros, unchanged, _, _, _, _, state_sum in results:
        assert not ok and math.isnan(grad_norm) and zeros is None
        assert unchanged and state_sum == 0  # parameters and optimizer state untouched

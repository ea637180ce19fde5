"""The zero-bubble backward split for any nn.Module: I then W give a fused backward's gradients, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from tests.support.configs import full_recompute, tiny_config

H = 8


class SharedWeight(nn.Module):
    """One Linear applied twice, plus a scale used before the input path and an offset after it."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(H, H), nn.LayerNorm(H)
        self.scale, self.offset = nn.Parameter(torch.rand(H) + 0.5), nn.Parameter(torch.randn(H))

    def forward(self, x):
        y = torch.tanh(self.linear(x * self.scale))
        return self.norm(self.linear(y) + x) + self.offset


class IgnoresInput(nn.Module):
    """Its output does not depend on its input at all (the input gradient is zero)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))

    def forward(self, x):
        return self.weight.expand_as(x) * 2


class Empty(nn.Module):
    """A stage with no layers: returns its input."""

    def forward(self, x):
        return x


def _modules():
    torch.manual_seed(0)
    return {
        "mlp": nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)),
        "shared weight": SharedWeight(),
        "transformer layer": nn.TransformerEncoderLayer(H, 2, 4 * H, dropout=0.0),
        "conv": nn.Sequential(nn.Conv1d(3, 3, 3, padding=1), nn.BatchNorm1d(3), nn.ReLU()),
        "ignores input": IgnoresInput(),
        "empty": Empty(),
    }


def _input(name: str) -> torch.Tensor:
    shape = (4, 3, 5) if name == "conv" else (5, 3, H)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(_modules()))
@pytest.mark.parametrize("last_stage", [False, True])
def test_input_then_weight_gradients_equal_the_fused_backward(name, last_stage):
    fused_module = _modules()[name]
    split_module = copy.deepcopy(fused_module)
    grad_out = torch.randn(_input(name).shape, generator=torch.Generator().manual_seed(2))

    def run(module):
        x = _input(name).requires_grad_(True)
        out = module(x)
        if last_stage:  # the loss stage: backward starts from a scalar
            return x, (out * grad_out).sum(), None
        return x, out, grad_out

    x, out, grad = run(fused_module)
    fused_backward(out, grad)
    expected_input = x.grad if x.grad is not None else torch.zeros_like(x)

    accumulated = []
    for n, p in split_module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: accumulated.append(n))
    x, out, grad = run(split_module)
    input_grad, weights = backward_input(out, grad, x)
    assert accumulated == [] and all(p.grad is None for p in split_module.parameters())  # I: no weight
    assert torch.equal(input_grad, expected_input)
    backward_weight(weights)
    names = [n for n, _ in split_module.named_parameters()]
    assert sorted(accumulated) == sorted(names)  # W: every weight once, through autograd's hooks
    for (n, p), q in zip(split_module.named_parameters(), fused_module.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_first_stage_runs_its_whole_backward_in_w():
    """Nothing upstream waits for a first stage's input gradient: I has nothing to do."""
    module = _modules()["mlp"]
    x = _input("mlp")  # token embeddings need no gradient here
    out = module(x)
    input_grad, weights = backward_input(out, torch.ones_like(out), x)
    assert input_grad is None and all(p.grad is None for p in module.parameters())
    backward_weight(weights)
    assert all(p.grad is not None for p in module.parameters())


def test_weight_gradients_accumulate_over_microbatches():
    """Two microbatches' I's first, then their W's: the sums a fused backward per microbatch gives."""
    fused, split = _modules()["shared weight"], None
    split = copy.deepcopy(fused)
    inputs = [torch.randn(5, 3, H, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    for x in inputs:
        out = fused(x.clone().requires_grad_(True))
        fused_backward(out, torch.ones_like(out))
    pending = []
    for x in inputs:
        x = x.clone().requires_grad_(True)
        out = split(x)
        pending.append(backward_input(out, torch.ones_like(out), x)[1])
    for weights in pending:
        backward_weight(weights)
    for p, q in zip(split.parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    "recompute",
    [
        {},
        full_recompute("uniform", 1),
        {"recompute_granularity": "selective"},
    ],
    ids=["no recompute", "full recompute", "selective recompute"],
)
def test_gpt_layers_split_bit_for_bit_with_recompute(recompute):
    """Two real GPT decoder layers (attention, MLP, LayerNorms, residuals) as a middle stage.

    With recomputation W runs the checkpointed forward again (a second backward over the graph
    recomputes, as torch's non-reentrant checkpoint does for every backward pass).
    """
    from core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    config = tiny_config("gpt", hidden_size=16, num_attention_heads=2, **recompute)  # weights drawn below
    fused = TransformerBlock(config, [0, 1], post_process=False)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    split = copy.deepcopy(fused)
    x, grad = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    fused_input = x.clone().requires_grad_(True)
    fused_backward(fused(fused_input), grad)
    split_input = x.clone().requires_grad_(True)
    input_grad, weights = backward_input(split(split_input), grad, split_input)
    backward_weight(weights)
    assert torch.equal(input_grad, fused_input.grad)
    for (n, p), q in zip(split.named_parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad), n

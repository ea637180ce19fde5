"""Weights held in FP8 (``--fp8-param-gather``, issue 28), in one process on the CPU.

* Holding a layer's weight casts it with the whole weight's scale: its values and products are the
  ones the layer computes when it casts the same weight in its forward, and the weight gradient goes
  into ``main_grad`` (there is no gradient of an FP8 tensor).
* The optimizer's cast of an fp32 shard keeps the quantise round trip's 25 dB.
* ``pretrain()`` at DP1: in fp32 with the tensorwise recipe the losses equal the casting run's bit for
  bit; in bf16 with the delayed recipe they stay within 0.01 of them.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from core.tensor_parallel import ColumnParallelLinear
from core.tensor_parallel.fp8 import E4M3, Fp8Recipe
from core.tensor_parallel.fp8_params import (
    Fp8Weight,
    cast_held_weights,
    dequantized,
    held_fp8_weights,
    hold_weights_in_fp8,
)
from core.transformer.transformer_config import TransformerConfig
from tests.support.fp8_run import TINY
from tests.support.pretrain_run import pretrain_gpt_in_process
from tests.unit.test_fp8 import sqnr

INIT = functools.partial(nn.init.normal_, std=0.02)


def _layer(dtype: torch.dtype) -> ColumnParallelLinear:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        bf16=dtype == torch.bfloat16,
        perform_initialization=True,
    )
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 128, config=config, init_method=INIT, bias=False)
    assert layer.enable_fp8(Fp8Recipe(scaling="tensorwise")) is None
    return layer


def _backward(layer: ColumnParallelLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.float().square().sum().backward()
    return out.detach(), x.grad


def test_a_held_weight_multiplies_as_the_cast_weight_and_its_gradient_goes_into_main_grad():
    cast, held = _layer(torch.float32), _layer(torch.float32)
    assert hold_weights_in_fp8([held]) == ["weight"]
    assert held.weight.dtype == E4M3 and held.weight.fp8_weight.dtype == torch.float32
    assert held_fp8_weights([held]) == [("weight", held.weight)]
    held.weight.main_grad = torch.zeros(held.weight.shape)
    calls = []
    held.weight.grad_accumulated = calls.append
    x = torch.randn(16, 2, 64)
    out, grad_input = _backward(cast, x)
    held_out, held_grad_input = _backward(held, x)
    assert torch.equal(held_out, out) and torch.equal(held_grad_input, grad_input)
    assert held.weight.grad is None and calls == [held.weight]
    assert torch.equal(held.weight.main_grad, cast.weight.grad)
    assert sqnr(held.weight.fp8_weight.high_precision, dequantized(held.weight)) >= 25.0


def test_the_optimizers_cast_of_a_shard_keeps_25_db_with_the_whole_weights_scale():
    torch.manual_seed(0)
    main = torch.randn(64, 32) * 3
    param = nn.Parameter(torch.zeros(64, 32, dtype=E4M3), requires_grad=False)
    param.fp8_weight = Fp8Weight(torch.ones(()), torch.bfloat16, None)
    half = main.numel() // 2
    # this rank owns the first half: the scale is still the whole weight's (one rank, so its own half's)
    cast_held_weights([(param, main.reshape(-1)[:half], param.view(-1)[:half])])
    assert param.fp8_weight.casts == 1
    amax = main.reshape(-1)[:half].abs().max()
    assert torch.equal(param.fp8_weight.scale_inv, (torch.finfo(E4M3).max / amax).reciprocal())
    back = dequantized(param).float().reshape(-1)[:half]
    assert sqnr(main.reshape(-1)[:half], back) >= 25.0


def _losses(flags: str) -> list[float]:
    return [float(s["lm loss"]) for s in pretrain_gpt_in_process(argv=flags.split()).losses]


@pytest.mark.parametrize("precision", ["fp32-tensorwise", "bf16-delayed"])
def test_held_weights_train_as_the_cast_weights_at_dp1(precision):
    flags = f"{TINY} --train-iters 4 --use-distributed-optimizer"
    if precision == "fp32-tensorwise":
        flags = flags.replace("--bf16 ", "") + " --fp8-recipe tensorwise"
    cast, held = _losses(flags), _losses(flags + " --fp8-param-gather")
    if precision == "fp32-tensorwise":
        assert held == cast
    else:  # a cast of the fp32 master against one of its bf16 copy
        assert held[0] == cast[0] and max(abs(a - b) for a, b in zip(held, cast)) < 0.01

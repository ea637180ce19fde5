"""Weights held in FP8 (``--fp8-param-gather``, issue 28), in one process on the CPU.

* Holding a layer's weight casts it with the whole weight's scale: its values and products are the
  ones the layer computes when it casts the same weight in its forward, and the weight gradient goes
  into ``main_grad`` (there is no gradient of an FP8 tensor).
* The optimizer's cast of an fp32 shard keeps the quantise round trip's 25 dB.
* ``pretrain()`` at DP1: in fp32 with the tensorwise recipe the losses equal the casting run's bit for
  bit; in bf16 with the delayed recipe they stay within 0.01 of them.
* The planner's dry run counts a held weight at one byte, not two.
* Under full recompute held weights, experts' too, train as the cast ones.
* Routed experts' stacks are held with one scale per expert: each expert multiplies as the layer that
  casts its slice does, its weight gradient goes into its slice of the stack's ``main_grad`` (an expert
  no row reaches gets zeros, not last step's values), and the stack reports its gradient once; the
  optimizer's cast of a range spanning two experts scales each with its own part's amax.
* Under the blockwise recipe weights are held in 128 x 128 tiles, one scale each: a layer multiplies them
  as the casting layer does; the optimizer's cast of a range that starts and ends inside a tile is the
  tiles' cast of that range; an outlier tile coarsens only itself; ``pretrain()`` at DP1 in fp32, dense
  and with routed experts, gives the casting run's losses bit for bit; the dry run adds a float32 per
  tile. ``cuda``: the range's cast on a GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pretrain_gpt
from core.tensor_parallel import ColumnParallelLinear
from core.tensor_parallel.fp8 import E4M3, Fp8Recipe
from core.tensor_parallel.fp8_blockwise import quantize_tiles
from core.tensor_parallel.fp8_params import (
    Fp8Weight,
    cast_held_weights,
    dequantized,
    held_fp8_weights,
    hold_weights_in_fp8,
)
from core.transformer.moe.experts import ExpertLinear
from core.transformer.transformer_config import TransformerConfig
from planner.dry_run import dry_run
from tests.support.fp8_run import IN_BLOCKS, TINY
from tests.support.pretrain_run import pretrain_gpt_in_process, pretrain_keeping_models
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
    cast_held_weights([(param, 0, main.reshape(-1)[:half], param.view(-1)[:half])])
    assert param.fp8_weight.casts == 1
    amax = main.reshape(-1)[:half].abs().max()
    assert torch.equal(param.fp8_weight.scale_inv, (torch.finfo(E4M3).max / amax).reciprocal())
    back = dequantized(param).float().reshape(-1)[:half]
    assert sqnr(main.reshape(-1)[:half], back) >= 25.0


def _losses(flags: str) -> list[float]:
    return [float(s["lm loss"]) for s in pretrain_gpt_in_process(argv=flags.split()).losses]


@pytest.mark.parametrize("precision", ["fp32-tensorwise", "fp32-blockwise", "bf16-delayed"])
def test_held_weights_train_as_the_cast_weights_at_dp1(precision):
    flags = f"{TINY} --train-iters 4 --use-distributed-optimizer"
    if precision == "fp32-tensorwise":
        flags = flags.replace("--bf16 ", "") + " --fp8-recipe tensorwise"
    if precision == "fp32-blockwise":  # every weight in whole tiles
        flags = flags.replace("--bf16 ", "") + f" {IN_BLOCKS}"
    cast, held = _losses(flags), _losses(flags + " --fp8-param-gather")
    if precision.startswith("fp32"):
        assert held == cast
    else:  # a cast of the fp32 master against one of its bf16 copy
        assert held[0] == cast[0] and max(abs(a - b) for a, b in zip(held, cast)) < 0.01


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_the_dry_run_counts_each_held_weight_at_one_byte_instead_of_two(recipe):
    """TP2 rank of 4 layers x 256 (FFN 1024, SwiGLU): 2,097,152 FP8 weight elements per rank (blockwise:
    every weight in whole tiles)."""
    flags = [
        "--num-layers",
        "4",
        "--hidden-size",
        "256",
        "--ffn-hidden-size",
        "1024",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "128",
        "--max-position-embeddings",
        "128",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--bf16",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "4096",
        "--train-iters",
        "10",
        "--lr",
        "1e-3",
        "--mock-data",
        "--fp8-format",
        "e4m3",
        "--fp8-recipe",
        recipe,
        "--use-distributed-optimizer",
        "--tensor-model-parallel-size",
        "2",
    ]
    _assert_held_saves_a_byte_each(flags, 8, 4 * (256 * 768 + 256 * 256 + 256 * 2048 + 1024 * 256) // 2)


def _assert_held_saves_a_byte_each(flags: list[str], world_size: int, held_elements: int) -> None:
    """The dry run with ``--fp8-param-gather`` holds ``held_elements`` fewer parameter bytes than without
    (one byte saved per element, less the held weights' scales, one float32 per 128 x 128 tile under the
    blockwise recipe, and their buffer's padding), and the same gradient bytes."""
    tile_scales = 4 * held_elements // (128 * 128) if "blockwise" in flags else 0
    cast, held = (
        dry_run(
            flags + extra,
            world_size=world_size,
            pp_rank=0,
            vocab_size=4096,
            forward_step_func=pretrain_gpt.forward_step,
        )
        for extra in ([], ["--fp8-param-gather"])
    )
    assert held_elements - tile_scales - 256 <= cast.params - held.params <= held_elements - tile_scales
    assert cast.grads == held.grads


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_the_dry_run_counts_each_held_expert_weight_at_one_byte_instead_of_two(recipe):
    """EP2 rank of 2 layers x 256 (4 experts of FFN 512, SwiGLU; two on the rank): 2 x (256 x 768 +
    256 x 256 attention + 2 x (256 x 1024 + 512 x 256) experts) = 2,097,152 FP8 weight elements."""
    flags = str.split(
        "--num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 16 --bf16 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --tokenizer-type "
        "NullTokenizer --vocab-size 4096 --train-iters 10 --lr 1e-3 --mock-data --fp8-format e4m3 "
        f"--fp8-recipe {recipe} --use-distributed-optimizer --num-experts 4 --moe-router-topk 2 "
        "--expert-model-parallel-size 2"
    )
    _assert_held_saves_a_byte_each(flags, 4, 2 * (256 * 768 + 256 * 256 + 2 * (256 * 1024 + 512 * 256)))


def _experts(dtype: torch.dtype) -> ExpertLinear:
    """Experts 4..6 of a layer (three, stacked [3, 32, 64]), FP8 tensorwise."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        bf16=dtype == torch.bfloat16,
        add_bias_linear=False,
    )
    layer = ExpertLinear(3, 64, 32, config, "normal", first=4)
    torch.manual_seed(0)
    with torch.no_grad():  # experts of different magnitudes: one scale each
        layer.weight.copy_(torch.randn(3, 32, 64) * torch.tensor([0.02, 0.5, 3.0]).view(3, 1, 1))
    assert layer.enable_fp8(Fp8Recipe(scaling="tensorwise")) is None
    return layer


def test_a_held_expert_stack_multiplies_each_expert_with_its_own_scale_as_the_cast_slices_do():
    """Rows 16, 0 and 5 for experts 4, 5 and 6: outputs, input gradients and weight gradients equal the
    casting layer's; expert 5's slice of ``main_grad`` (stale values before) becomes zeros."""
    cast, held = _experts(torch.float32), _experts(torch.float32)
    assert hold_weights_in_fp8([held]) == ["weight"]
    scales = held.weight.fp8_weight.scale_inv
    assert held.weight.dtype == E4M3 and scales.shape == (3,)
    amaxes = cast.weight.detach().abs().amax(dim=(1, 2))
    assert torch.equal(scales, (torch.finfo(E4M3).max / amaxes).reciprocal())
    claims, calls = [], []
    held.weight.main_grad = torch.full(held.weight.shape, 7.0)  # last step's gradient
    held.weight.claim_main_grad = lambda p: not claims.append(p) and len(claims) == 1
    held.weight.grad_accumulated = calls.append
    torch.manual_seed(1)
    pieces = [torch.randn(n, 64) for n in (16, 0, 5)]
    outs = []
    for layer in (cast, held):
        inputs = [p.clone().requires_grad_() for p in pieces]
        out = layer(inputs)
        sum(o.square().sum() for o in out).backward()
        outs.append((out, [i.grad for i in inputs]))
    (cast_out, cast_grads), (held_out, held_grads) = outs
    assert all(torch.equal(a, b) for a, b in zip(cast_out, held_out))
    assert all(torch.equal(a, b) for a, b in zip(cast_grads, held_grads))
    assert held.weight.grad is None and calls == [held.weight] and len(claims) == 2
    assert torch.equal(held.weight.main_grad, cast.weight.grad)
    assert not held.weight.main_grad[1].any()
    for j in range(3):  # each expert's own scale keeps the round trip's 25 dB
        assert sqnr(cast.weight[j], dequantized(held.weight)[j]) >= 25.0


def test_the_optimizers_cast_of_a_range_over_two_experts_scales_each_with_its_own_parts_amax():
    torch.manual_seed(0)
    main = torch.randn(3, 8, 16) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1)
    param = nn.Parameter(torch.zeros(3, 8, 16, dtype=E4M3), requires_grad=False)
    param.fp8_weight = Fp8Weight(torch.ones(3), torch.bfloat16, None)
    start, end = 100, 200  # the end of expert 0 (elements 100..127) and the start of expert 1 (128..199)
    flat = main.reshape(-1)
    cast_held_weights([(param, start, flat[start:end], param.view(-1)[start:end])])
    amaxes = torch.stack([flat[100:128].abs().max(), flat[128:200].abs().max(), torch.tensor(0.0)])
    expected = torch.where(amaxes > 0, torch.finfo(E4M3).max / amaxes, torch.ones(3)).reciprocal()
    assert torch.equal(param.fp8_weight.scale_inv, expected) and param.fp8_weight.casts == 1
    back = dequantized(param).float().reshape(-1)
    assert sqnr(flat[100:128], back[100:128]) >= 25.0 and sqnr(flat[128:200], back[128:200]) >= 25.0
    assert not param.view(-1)[:100].float().any() and not param.view(-1)[200:].float().any()


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_routed_expert_stacks_are_held_with_their_own_scales_and_train_as_the_cast_experts(recipe):
    """DP1, fp32: bitwise the casting run's losses; the start report counts the stacks. Tensorwise: one
    scale per expert; blockwise: each expert's own grid of 128 x 128 tiles (fc1 ``[4, 256, 128]``)."""
    flags = f"{TINY} --train-iters 2 --use-distributed-optimizer --num-experts 4 --moe-router-topk 2"
    flags = flags.replace("--bf16 ", "") + (
        f" {IN_BLOCKS}" if recipe == "blockwise" else " --fp8-recipe tensorwise"
    )
    cast = _losses(flags)
    state, built, out = pretrain_keeping_models(f"{flags} --fp8-param-gather".split())
    assert [float(s["lm loss"]) for s in state.losses] == cast
    params = {n: p for m in built for n, p in m.named_parameters() if n.endswith("weight")}
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].dtype == E4M3
    stack = params["decoder.layers.0.mlp.experts.linear_fc1.weight"]
    assert stack.dtype == E4M3 and stack.fp8_weight.scale_inv.shape == (
        (4, 2, 1) if recipe == "blockwise" else (4,)
    )
    tiles, each = (
        (", one scale per 128x128 tile", "one grid of tiles") if recipe == "blockwise" else ("", "one scale")
    )
    assert (
        f"FP8 on pipeline stage 0: 8 weights held in FP8 (--fp8-param-gather){tiles}; 4 of them "
        f"routed-expert stacks, {each} per expert\n"
    ) in out


def test_held_weights_and_expert_stacks_train_as_the_cast_ones_under_full_recompute():
    """Full recompute saves no weight: the layer keeps the held weight itself for its backward (a
    recomputed, detached alias would have lost its scale and main_grad). DP1, fp32, tensorwise."""
    flags = f"{TINY} --train-iters 2 --use-distributed-optimizer --num-experts 4 --moe-router-topk 2"
    flags = flags.replace("--bf16 ", "") + " --fp8-recipe tensorwise --recompute-granularity full"
    flags += " --recompute-method uniform --recompute-num-layers 1"
    assert _losses(flags + " --fp8-param-gather") == _losses(flags)


# The blockwise recipe: weights held in 128 x 128 tiles, one scale per tile.


def _per_tile(low: float, high: float) -> torch.Tensor:
    """``[384, 256]`` factors, one per 128 x 128 tile, from ``10**low`` to ``10**high``."""
    return torch.logspace(low, high, 6).view(3, 2).repeat_interleave(128, 0).repeat_interleave(128, 1)


def _tiled_layer() -> ColumnParallelLinear:
    config = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=4, perform_initialization=True
    )
    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 384, config=config, init_method=INIT, bias=False)
    with torch.no_grad():  # tiles of different magnitudes: one scale each
        layer.weight.mul_(_per_tile(-2, 2))
    assert layer.enable_fp8(Fp8Recipe(format="e4m3", scaling="blockwise")) is None
    return layer


def test_a_weight_held_in_tiles_multiplies_as_the_cast_tiles_and_keeps_one_scale_per_tile():
    cast, held = _tiled_layer(), _tiled_layer()
    assert hold_weights_in_fp8([held]) == ["weight"]
    meta = held.weight.fp8_weight
    expected = quantize_tiles(cast.weight, E4M3)
    assert meta.tiled and meta.scale_inv.shape == (3, 2)
    assert torch.equal(meta.scale_inv, expected.inverse_scales) and torch.equal(held.weight, expected.values)
    held.weight.main_grad = torch.zeros(held.weight.shape)
    held.weight.grad_accumulated = lambda p: None
    x = torch.randn(16, 2, 256)
    out, grad_input = _backward(cast, x)
    held_out, held_grad_input = _backward(held, x)
    assert torch.equal(held_out, out) and torch.equal(held_grad_input, grad_input)
    assert torch.equal(held.weight.main_grad, cast.weight.grad)
    assert sqnr(meta.high_precision, dequantized(held.weight)) >= 25.0


@pytest.mark.parametrize(
    ("start", "end"), [(0, 384 * 256), (200, 130 * 256 + 77), (129 * 256 + 5, 300 * 256)]
)
def test_the_optimizers_cast_of_a_range_in_tiles_is_the_tiles_cast_of_the_range(start, end):
    """A range that starts and ends inside a row (and inside a tile) casts as the whole weight's tiles
    would if the weight held only the range: each tile's scale from the range's part of it (the other
    ranks' parts meet in the all-reduce), a tile the range misses scaled by 1."""
    torch.manual_seed(0)
    main = torch.randn(384, 256) * _per_tile(-3, 3)
    param = nn.Parameter(torch.zeros(384, 256, dtype=E4M3), requires_grad=False)
    param.fp8_weight = Fp8Weight(torch.ones(3, 2), torch.bfloat16, None, tiled=True)
    flat = main.reshape(-1)
    cast_held_weights([(param, start, flat[start:end], param.view(-1)[start:end])])
    only_range = torch.zeros_like(flat)
    only_range[start:end] = flat[start:end]
    expected = quantize_tiles(only_range.view(384, 256), E4M3)
    assert torch.equal(param.fp8_weight.scale_inv, expected.inverse_scales) and param.fp8_weight.casts == 1
    assert torch.equal(param.view(-1)[start:end].float(), expected.values.view(-1)[start:end].float())
    assert not param.view(-1)[:start].float().any() and not param.view(-1)[end:].float().any()


def test_an_outlier_tile_coarsens_only_itself_in_a_weight_held_in_tiles():
    """One 128 x 128 tile 1e5 times the rest: held in tiles, the other tiles keep the round trip's 25 dB;
    held with one scale they fall under 10 dB (most of their values flush to E4M3's subnormals or zero)."""
    torch.manual_seed(0)
    main = torch.randn(384, 256) * 0.02
    main[:128, :128] *= 1e5
    others = torch.ones_like(main, dtype=torch.bool)
    others[:128, :128] = False
    for tiled, low, high in ((True, 25.0, float("inf")), (False, 0.0, 10.0)):
        param = nn.Parameter(torch.zeros(384, 256, dtype=E4M3), requires_grad=False)
        param.fp8_weight = Fp8Weight(torch.ones((3, 2) if tiled else ()), torch.float32, None, tiled=tiled)
        cast_held_weights([(param, 0, main.reshape(-1), param.view(-1))])
        assert low <= sqnr(main[others], dequantized(param)[others]) < high, tiled


@pytest.mark.cuda
def test_the_optimizers_cast_of_a_range_in_tiles_on_a_gpu_is_the_tiles_cast_of_the_range():
    """The CPU test above on the GPU (the tile rows' gather and scatter run as device kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.manual_seed(0)
    main = (torch.randn(384, 256) * _per_tile(-3, 3)).cuda()
    param = nn.Parameter(torch.zeros(384, 256, dtype=E4M3, device="cuda"), requires_grad=False)
    param.fp8_weight = Fp8Weight(torch.ones(3, 2, device="cuda"), torch.bfloat16, None, tiled=True)
    start, end, flat = 200, 130 * 256 + 77, main.reshape(-1)
    cast_held_weights([(param, start, flat[start:end], param.view(-1)[start:end])])
    only_range = torch.zeros_like(flat)
    only_range[start:end] = flat[start:end]
    expected = quantize_tiles(only_range.view(384, 256), E4M3)
    assert torch.equal(param.fp8_weight.scale_inv, expected.inverse_scales)
    assert torch.equal(param.view(-1)[start:end].float(), expected.values.view(-1)[start:end].float())

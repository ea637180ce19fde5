"""The blockwise FP8 recipe (``--fp8-recipe blockwise``, DeepSeek-V3's scales), in one process on the CPU.

* Each block scales from its own maximum: an outlier coarsens its own block of 128, not the tensor.
* A weight's 128 x 128 tiles transposed are the transpose's tiles, bit for bit (the input gradient's
  operand needs no second cast).
* Partial blocks (a token count that is not a multiple of 128) round-trip like whole ones, and a
  product is the float32 product of the dequantised operands.
* Outlier tokens leave the other tokens' output and input gradient as precise as without them
  (tensorwise scaling loses them).
* Layers whose features per rank are not multiples of 128 stay out of FP8 with the reason.
* In a training run: recomputation changes nothing, and every linear layer of a model of multiples of
  128 runs blockwise.
* ``cuda``: torch's blockwise FP8 kernel gives the dequantised product (not yet the product path).
The SQNR thresholds, the zero-bubble split, routed experts and the GPU's products are
``tests/unit/test_fp8.py``'s, with the blockwise recipes among its recipes; TP2 x SP against TP1 is
``tests/dist/test_tensor_parallel.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from core.tensor_parallel import ColumnParallelLinear
from core.tensor_parallel.fp8 import E4M3, E5M2, Fp8Recipe, amax_of, dequantize, fp8_states, quantize
from core.tensor_parallel.fp8_blockwise import (
    BlockCast,
    block_product,
    dequantize_blocks,
    quantize_rows,
    quantize_tiles,
)
from tests.support.fp8_run import IN_BLOCKS, fp8_run
from tests.unit.test_fp8 import INIT, config, run, sqnr, twin_layers

BLOCKWISE = Fp8Recipe(format="e4m3", scaling="blockwise")


def test_an_outlier_coarsens_only_its_own_block():
    torch.manual_seed(0)
    x = torch.randn(64, 512)
    x[3, 200] = 1e6  # in row 3's second block (columns 128-255)
    blocks = dequantize_blocks(quantize_rows(x, E4M3))
    scale = torch.finfo(E4M3).max / amax_of(x)
    whole = dequantize(quantize(x, scale, E4M3), scale.reciprocal(), torch.float32)
    others = torch.ones_like(x, dtype=torch.bool)
    others[3, 128:256] = False
    assert sqnr(x[others], blocks[others]) >= 25.0
    assert sqnr(x[others], whole[others]) < 10.0  # one scale for the tensor: the rest underflows


def test_a_weight_tiles_transposed_are_the_transposes_tiles():
    torch.manual_seed(1)
    weight = torch.randn(384, 256, dtype=torch.bfloat16) * torch.logspace(-3, 1, 256, dtype=torch.bfloat16)
    tiles = quantize_tiles(weight, E4M3)
    assert tiles.tiled and tiles.inverse_scales.shape == (3, 2)
    flipped, direct = tiles.transposed(), quantize_tiles(weight.t(), E4M3)
    assert torch.equal(flipped.values.view(torch.uint8), direct.values.view(torch.uint8))
    assert torch.equal(flipped.inverse_scales, direct.inverse_scales)
    assert sqnr(weight, dequantize_blocks(tiles)) >= 25.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_partial_blocks_round_trip_and_a_product_is_the_fp32_product_of_the_dequantised_operands(dtype):
    torch.manual_seed(2)
    a, b = torch.randn(40, 200) * 3, torch.randn(24, 200)  # K = 200: one block and a partial one
    rows, tiles = quantize_rows(a, dtype), quantize_tiles(b, E4M3)
    assert rows.inverse_scales.shape == (40, 2) and tiles.inverse_scales.shape == (1, 2)
    assert sqnr(a, dequantize_blocks(rows)) >= (25.0 if dtype is E4M3 else 20.0)
    expected = dequantize_blocks(rows) @ dequantize_blocks(tiles).t()
    assert torch.equal(block_product(rows, tiles, torch.float32), expected)
    assert block_product(rows, tiles, torch.bfloat16).dtype == torch.bfloat16
    zeros = quantize_rows(torch.zeros(3, 130), dtype)  # an all-zero block scales by 1, not by inf
    assert torch.equal(zeros.inverse_scales, torch.ones(3, 2)) and not zeros.values.float().any()


def test_outlier_tokens_leave_the_other_tokens_products_as_precise_as_without_them():
    """A few tokens 1e5 times the rest (massive activations): one scale for the tensor pushes the other
    tokens' values below E4M3's smallest subnormal; their own 1 x 128 blocks keep them."""
    reference, blockwise = twin_layers(ColumnParallelLinear, BLOCKWISE)
    _, tensorwise = twin_layers(ColumnParallelLinear, Fp8Recipe(format="e4m3", scaling="tensorwise"))
    torch.manual_seed(3)
    x = torch.randn(32, 4, 256, dtype=torch.bfloat16)
    grad = torch.randn(32, 4, 512, dtype=torch.bfloat16) * 1e-3
    x[0] *= 1e5  # the first token of each sequence
    grad[5] *= 1e5
    out, dx, _ = run(reference, x, grad)
    for layer, floor, ceiling in ((blockwise, 25.0, None), (tensorwise, None, 10.0)):
        got, got_dx, _ = run(layer, x, grad)
        for figure in (sqnr(out[1:], got[1:]), sqnr(dx[6:], got_dx[6:])):  # the ordinary tokens
            assert (floor is None or figure >= floor) and (ceiling is None or figure < ceiling), figure


def test_layers_whose_features_per_rank_are_not_multiples_of_128_stay_out_with_the_reason():
    layer = ColumnParallelLinear(128, 192, config=config(), init_method=INIT)
    assert layer.enable_fp8(BLOCKWISE) == "its features per rank (128 in, 192 out) are not multiples of 128"
    assert layer.fp8_state is None
    assert ColumnParallelLinear(128, 256, config=config(), init_method=INIT).enable_fp8(BLOCKWISE) is None


def test_a_blockwise_run_records_no_state_and_recomputation_changes_nothing():
    flags = f"--train-iters 3 {IN_BLOCKS}"
    plain, state = fp8_run(flags)
    assert state == {}  # nothing to checkpoint: every block scales from itself
    for extra in (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--recompute-granularity selective",
    ):
        assert fp8_run(f"{flags} {extra}")[0] == plain, extra
    tensorwise, _ = fp8_run(f"{flags} --fp8-recipe tensorwise")  # (the later flag wins)
    assert tensorwise != plain and max(abs(a - b) for a, b in zip(tensorwise, plain)) < 0.05


def test_every_linear_layer_of_a_model_in_multiples_of_128_runs_blockwise():
    from core.transformer.transformer_layer import TransformerLayer

    layer = TransformerLayer(
        config(hidden_size=128, ffn_hidden_size=256, fp8="e4m3", fp8_recipe="blockwise"), 0
    )
    assert layer.fp8_kept_out == {}
    states = dict(fp8_states([layer]))
    assert len(states) == 4 and all(s.recipe.blockwise for s in states.values())
    assert (
        "blockwise (1x128 inputs and gradients, 128x128 weights)"
        in states["mlp.linear_fc1.fp8_state"].extra_repr()
    )


def _torchs_blockwise_product(a: BlockCast, b: BlockCast) -> torch.Tensor:
    """``a @ b^T`` by torch's blockwise FP8 kernel (Hopper, cuBLAS 12.9), with its scale layouts: 1 x 128
    scales stored outer-dimension-major, 128 x 128 ones with their K blocks padded to a multiple of 4."""
    scaling = torch.nn.functional.ScalingType
    scale_a = a.inverse_scales.t().contiguous().t()
    if b.tiled:
        k_blocks = b.inverse_scales.shape[1]
        padded = torch.nn.functional.pad(b.inverse_scales, (0, -k_blocks % 4))
        scale_b, recipe_b = padded.contiguous().t(), scaling.BlockWise128x128
    else:
        scale_b, recipe_b = b.inverse_scales.t().contiguous().t(), scaling.BlockWise1x128
    return torch.nn.functional.scaled_mm(
        a.values,
        b.values.t(),
        scale_a,
        scaling.BlockWise1x128,
        scale_b,
        recipe_b,
        output_dtype=torch.bfloat16,
    )


@pytest.mark.cuda
@pytest.mark.parametrize("tiled", [True, False], ids=["weight-tiles", "row-blocks"])
def test_torchs_blockwise_kernel_gives_the_dequantised_product(tiled):
    """Not yet the product path (``block_product`` dequantises on every device): this checks, on a GPU,
    the kernel that would replace it, with the layouts above, before it is wired in."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch's blockwise FP8 kernel runs on Hopper (sm90)")
    torch.manual_seed(4)
    a = quantize_rows(torch.randn(256, 512, device="cuda"), E4M3)
    b_values = torch.randn(384, 512, device="cuda")
    b = quantize_tiles(b_values, E4M3) if tiled else quantize_rows(b_values, E4M3)
    expected = block_product(a, b, torch.float32)
    got = _torchs_blockwise_product(a, b)
    assert sqnr(expected, got) >= 40.0  # the same FP8 operands; bf16 output and accumulation order differ
    print(
        f"torch's blockwise kernel ({'128x128' if tiled else '1x128'} B): SQNR {sqnr(expected, got):.1f} dB"
    )

"""FP8 products in the tensor-parallel linear layers (issue 28), in one process on the CPU.

* SQNR against the bf16 product with torchao's thresholds: >= 25 dB for a quantise round trip,
  >= 18 dB for a layer's output, >= 17 dB for its weight gradient (both formats, both recipes).
* The zero-bubble split (I, then W) gives the fused backward's gradients exactly, with the output
  gradient cast once; gradient-accumulation fusion puts the same numbers into ``main_grad``.
* The delayed recipe: histories roll once per step (``max`` and ``most_recent``, with the margin),
  a recomputed forward records nothing new, evaluation records nothing; the first step scales from
  the tensors themselves.
* Shapes a CUDA FP8 product cannot take stay in high precision, with the reason; the weight
  gradient of a microbatch whose tokens are not a multiple of 16 runs in the model's dtype.
* Exact resume with the delayed recipe: same losses and the same amax histories as a straight run;
  at another history length, the most recent entries that fit, said in one line.
* The configuration's refusals, word for word.
* ``cuda``: the same layer on the GPU equals the CPU's FP8 product (skipped without a GPU).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

from core.device import building_on
from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from core.tensor_parallel.fp8 import (
    E4M3,
    E5M2,
    EAGER_CASTS,
    Fp8Recipe,
    amax_of,
    compile_fp8_casts,
    compiled_casts,
    dequantize,
    fp8_state_dict,
    fp8_states,
    load_fp8_state_dict,
    quantize,
    scaled_mm,
    update_fp8_scales,
)
from core.transformer.transformer_config import TransformerConfig
from tests.support.fp8_run import TINY, fp8_run
from tests.support.pretrain_run import pretrain_keeping_models

RECIPES = [
    Fp8Recipe(format=fmt, scaling=scaling)
    for scaling in ("tensorwise", "delayed", "blockwise")
    for fmt in ("e4m3", "hybrid")
]
INIT = functools.partial(nn.init.normal_, std=0.02)


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    reference, value = reference.detach().double(), value.detach().double()
    return float(20 * torch.log10(reference.norm() / (reference - value).norm()))


def config(**overrides) -> TransformerConfig:
    return TransformerConfig(
        **{
            "num_layers": 1,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "bf16": True,
            "perform_initialization": True,
            **overrides,
        }
    )


def twin_layers(cls, recipe: Fp8Recipe, in_features=256, out_features=512, **config_overrides):
    """A bf16 layer and the same layer (same weights) with FP8 products."""
    kwargs = {"config": config(**config_overrides), "init_method": INIT, "bias": True}
    if cls is RowParallelLinear:
        kwargs["input_is_parallel"] = True
    torch.manual_seed(0)
    reference = cls(in_features, out_features, **kwargs)
    fp8 = cls(in_features, out_features, **kwargs)
    fp8.load_state_dict(reference.state_dict())
    assert fp8.enable_fp8(recipe) is None
    return reference, fp8


def run(layer, x, grad):
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    return out, x.grad, layer.weight.grad


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_quantise_round_trip_keeps_25_db(dtype):
    torch.manual_seed(0)
    x = torch.randn(4096, dtype=torch.bfloat16) * 3
    scale = torch.finfo(dtype).max / amax_of(x)
    back = dequantize(quantize(x, scale, dtype), scale.reciprocal(), torch.bfloat16)
    assert sqnr(x, back) >= 25.0 if dtype is E4M3 else sqnr(x, back) >= 20.0  # E5M2: two mantissa bits


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear], ids=["column", "row"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.scaling}-{r.format}")
def test_layer_output_and_gradients_keep_torchaos_sqnr(cls, recipe):
    reference, fp8 = twin_layers(cls, recipe)
    torch.manual_seed(1)
    for step in range(3):  # the delayed recipe's first step scales from the tensors, later ones from history
        x = torch.randn(32, 4, 256, dtype=torch.bfloat16)
        grad = torch.randn(32, 4, 512, dtype=torch.bfloat16) * 1e-3
        for layer in (reference, fp8):
            layer.weight.grad = None
        out, dx, dw = run(reference, x, grad)
        out8, dx8, dw8 = run(fp8, x, grad)
        assert out8.dtype == torch.bfloat16 and dw8.dtype == torch.bfloat16
        assert sqnr(out, out8) >= 18.0, step
        assert sqnr(dw, dw8) >= 17.0, step
        assert sqnr(dx, dx8) >= 17.0, step
        update_fp8_scales([fp8], None)


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_compiled_casts_belong_to_the_layers_compiled_and_cast_as_the_eager_ones(scaling):
    """``--compile`` gives its model's FP8 layers compiled casts; a layer built beside it keeps the eager
    ones (nothing process-wide changes), and both cast the same bits (dynamo's eager backend)."""
    recipe = Fp8Recipe(format="hybrid", scaling=scaling)
    _, compiled = twin_layers(ColumnParallelLinear, recipe)
    _, eager = twin_layers(ColumnParallelLinear, recipe)
    compile_fp8_casts([compiled], "eager")
    assert compiled.fp8_state.kernels is compiled_casts("eager") and eager.fp8_state.kernels is EAGER_CASTS
    x, grad = torch.randn(8, 2, 256, dtype=torch.bfloat16), torch.randn(8, 2, 512, dtype=torch.bfloat16)
    for got, expected in zip(run(compiled, x, grad), run(eager, x, grad)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_no_fp8_wgrad_keeps_the_weight_gradient_in_bf16_from_the_saved_input(scaling):
    reference, fp8 = twin_layers(ColumnParallelLinear, Fp8Recipe(scaling=scaling, wgrad=False))
    x = torch.randn(16, 2, 256, dtype=torch.bfloat16)
    grad = torch.randn(16, 2, 512, dtype=torch.bfloat16)
    _, _, dw = run(reference, x, grad)
    _, _, dw8 = run(fp8, x, grad)
    torch.testing.assert_close(dw8, dw, rtol=0, atol=0)  # the same bf16 product of the same operands


class _TwoLayers(nn.Module):
    """Column -> Row, as an MLP: the I/W split reaches both weights through one path."""

    def __init__(self, recipe: Fp8Recipe | None, **config_overrides) -> None:
        super().__init__()
        cfg = config(**config_overrides)
        torch.manual_seed(0)
        self.column = ColumnParallelLinear(128, 256, config=cfg, init_method=INIT, bias=True)
        self.row = RowParallelLinear(
            256, 128, config=cfg, init_method=INIT, bias=True, input_is_parallel=True
        )
        if recipe is not None:
            assert self.column.enable_fp8(recipe) is None and self.row.enable_fp8(recipe) is None

    def forward(self, x):
        return self.row(torch.relu(self.column(x)[0]))[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.scaling}-{r.format}")
def test_the_zero_bubble_split_gives_the_fused_backwards_gradients_exactly(recipe):
    fused, split = _TwoLayers(recipe), _TwoLayers(recipe)
    x = torch.randn(16, 2, 128, dtype=torch.bfloat16)
    grad = torch.randn(16, 2, 128, dtype=torch.bfloat16)
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused_backward(fused(xf), grad)
    input_grad, weights = backward_input(split(xs), grad, xs)
    assert all(p.grad is None for p in split.parameters())  # I computed no weight gradient
    backward_weight(weights)
    torch.testing.assert_close(input_grad, xf.grad, rtol=0, atol=0)
    for (name, a), b in zip(fused.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_gradient_accumulation_fusion_puts_the_same_weight_gradient_into_main_grad():
    recipe = Fp8Recipe(scaling="tensorwise")
    plain = _TwoLayers(recipe)
    fused = _TwoLayers(recipe, gradient_accumulation_fusion=True)
    for p in fused.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_accumulated = lambda param: None
    x = torch.randn(16, 2, 128, dtype=torch.bfloat16)
    for model in (plain, fused):
        for _ in range(2):  # two microbatches accumulate
            model(x).float().square().sum().backward()
    for name in ("column", "row"):
        expected = getattr(plain, name).weight.grad.float()
        got = getattr(fused, name).weight.main_grad
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)  # fp32 sum of bf16 products


def test_delayed_histories_roll_once_per_step_with_the_margin():
    recipe = Fp8Recipe(
        format="hybrid", scaling="delayed", amax_history_len=3, amax_compute_algo="max", margin=1
    )
    _, layer = twin_layers(ColumnParallelLinear, recipe, in_features=64, out_features=64)
    state = layer.fp8_state
    amaxes = []
    for step, magnitude in enumerate((1.0, 4.0, 2.0, 0.5)):
        x = torch.full((16, 64), magnitude, dtype=torch.bfloat16)
        for _ in range(2):  # two microbatches: one history entry
            layer(x)[0].sum().backward()
        amaxes.append(magnitude)
        update_fp8_scales([layer], None)
        assert state.updates == step + 1
        assert state.amax_history[0].tolist() == (amaxes[::-1] + [0.0] * 3)[:3]
        expected = torch.finfo(E4M3).max / max(amaxes[-3:]) / 2
        assert state.scale[0].item() == pytest.approx(expected)
        assert state.step_amax.tolist() == [0.0, 0.0, 0.0]


def test_most_recent_uses_the_last_step_and_a_recomputed_forward_or_an_evaluation_records_nothing():
    recipe = Fp8Recipe(format="e4m3", scaling="delayed", amax_history_len=4)
    _, layer = twin_layers(ColumnParallelLinear, recipe, in_features=64, out_features=64)
    state = layer.fp8_state
    for magnitude in (8.0, 2.0):
        layer(torch.full((16, 64), magnitude, dtype=torch.bfloat16))[0].sum().backward()
        update_fp8_scales([layer], None)
    assert state.scale[0].item() == pytest.approx(448.0 / 2.0)
    x = torch.full((16, 64), 3.0, dtype=torch.bfloat16)
    layer(x)
    recorded = state.step_amax.clone()
    layer(x)  # the same forward again (full or selective recompute): the maximum is unchanged
    assert torch.equal(state.step_amax, recorded) and recorded[0].item() == 3.0
    with torch.no_grad():
        layer(torch.full((16, 64), 100.0, dtype=torch.bfloat16))  # evaluation
    assert torch.equal(state.step_amax, recorded)
    assert state.updates == 2


def test_shapes_a_cuda_fp8_product_cannot_take_stay_in_bf16_with_the_reason():
    layer = ColumnParallelLinear(64, 40, config=config(), init_method=INIT)
    assert layer.enable_fp8(Fp8Recipe()) == "its features per rank (64 in, 40 out) are not multiples of 16"
    assert layer.fp8_state is None


def test_a_microbatch_of_tokens_not_a_multiple_of_16_takes_the_weight_gradient_in_bf16():
    recipe = Fp8Recipe(scaling="tensorwise")
    reference, fp8 = twin_layers(ColumnParallelLinear, recipe, in_features=64, out_features=64)
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16)  # 15 tokens
    grad = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    _, _, dw = run(reference, x, grad)
    _, _, dw8 = run(fp8, x, grad)
    assert sqnr(dw, dw8) >= 17.0  # the product of the dequantised saved input, in bf16


def test_a_decoder_layer_reports_which_linear_layers_stay_out_of_fp8():
    from core.transformer.transformer_layer import TransformerLayer

    cfg = config(fp8="hybrid", fp8_recipe="tensorwise", ffn_hidden_size=72)
    layer = TransformerLayer(cfg, 0)
    assert layer.fp8_kept_out == {
        "mlp.linear_fc1": "its features per rank (64 in, 72 out) are not multiples of 16",
        "mlp.linear_fc2": "its features per rank (72 in, 64 out) are not multiples of 16",
    }
    assert [name for name, _ in fp8_states([layer])] == [
        "self_attention.linear_qkv.fp8_state",
        "self_attention.linear_proj.fp8_state",
    ]


@pytest.mark.parametrize(
    ("precision", "warned"), [({}, True), ({"bf16": True}, False), ({"params_dtype": torch.float16}, False)]
)
def test_fp8_without_a_16_bit_dtype_warns_once_that_the_rest_runs_in_fp32(precision, warned):
    from training.reporting.fp8_report import fp8_report

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, fp8="hybrid", **precision)
    lines = fp8_report(cfg, [], 0, 16)
    warning = (
        "FP8 without --bf16: the parts that are not FP8 products (embedding, norms, attention, output layer) "
        "run in fp32, which is slow (Megatron-LM#883); add --bf16"
    )
    assert lines.count(warning) == int(warned), lines


def test_the_blockwise_recipe_says_at_the_start_that_its_products_are_dequantised():
    from training.reporting.fp8_report import fp8_report

    cfg = TransformerConfig(
        num_layers=1, hidden_size=128, num_attention_heads=4, fp8="e4m3", fp8_recipe="blockwise", bf16=True
    )
    assert fp8_report(cfg, [], 0, 16)[:2] == [
        "FP8: blockwise (1x128 inputs and gradients, 128x128 weights), e4m3 (E4M3 forward, E4M3 gradients)",
        (
            "FP8 blockwise: each product is dequantised and multiplied in float32, the recipe's numerics but "
            "not FP8 speed (torch's blockwise kernel is not wired in yet; on an H100 float32 runs at a "
            "fifteenth of the bf16 peak)"
        ),
    ]


def test_first_and_last_layers_stay_in_bf16_on_request():
    cfg = TransformerConfig(
        num_layers=6, hidden_size=64, num_attention_heads=4, fp8="e4m3", first_last_layers_bf16=True,
        num_layers_at_end_in_bf16=2,
    )  # fmt: skip
    assert [cfg.layer_in_fp8(i) for i in range(6)] == [False, True, True, True, False, False]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fp8": "e5m2"}, "--fp8-format 'e5m2' is not supported: use e4m3 or hybrid"),
        (
            {"fp8": "hybrid", "fp8_recipe": "mxfp8"},
            (
                "the 'mxfp8' recipe needs Blackwell GPUs (sm100) and is not built in Trident; use --fp8-recipe "
                "tensorwise, delayed or blockwise"
            ),
        ),
        (
            {"fp8_recipe": "tensorwise", "fp8_margin": 1},
            "--fp8-recipe, --fp8-margin need --fp8-format (e4m3 or hybrid)",
        ),
        (
            {"fp8_wgrad": False},
            "--no-fp8-wgrad or --disable-fp8-wgrad needs --fp8-format (e4m3 or hybrid)",
        ),
        ({"fp8": "hybrid", "fp8_amax_history_len": 0}, "--fp8-amax-history-len must be >= 1, got 0"),
        (
            {"fp8": "hybrid", "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 2},
            (
                "--num-layers-at-start-in-bf16 must be in [0, 1], the layers per pipeline stage (--num-layers 1 "
                "// --pipeline-model-parallel-size 1), got 2"
            ),
        ),
    ],
)
def test_the_configs_fp8_refusals(overrides, message):
    with pytest.raises(ValueError) as err:
        config(**overrides)
    assert str(err.value) == f"invalid TransformerConfig: {message}"


def test_resume_with_delayed_scaling_is_exact_losses_and_amax_histories(tmp_path):
    ckpt = os.path.join(tmp_path, "ckpt")
    straight, straight_histories = fp8_run(f"--train-iters 6 --save {ckpt} --save-interval 3")
    resumed, resumed_histories = fp8_run(f"--train-iters 6 --load {ckpt} --ckpt-step 3")
    assert len(straight) == 6 and resumed == straight[3:]
    assert straight_histories.keys() == resumed_histories.keys() and straight_histories
    for name, value in straight_histories.items():
        assert torch.equal(resumed_histories[name], value), name


def _delayed_layer(history_len: int, magnitudes: tuple[float, ...]):
    """A delayed-recipe layer (``max``, margin 1) after one step per magnitude."""
    recipe = Fp8Recipe(
        format="hybrid", scaling="delayed", amax_history_len=history_len, amax_compute_algo="max", margin=1
    )
    _, layer = twin_layers(ColumnParallelLinear, recipe, in_features=64, out_features=64)
    for magnitude in magnitudes:
        layer(torch.full((16, 64), magnitude, dtype=torch.bfloat16))[0].sum().backward()
        update_fp8_scales([layer], None)
    return layer


@pytest.mark.parametrize("length", [2, 3, 5])
def test_a_history_loaded_at_another_length_keeps_its_most_recent_entries(length):
    """Saved with 3 entries after the steps 1, 4, 2, 0.5: loaded at 3 it is exact; at 2 it is what a
    2-entry run of the same steps holds (the 4 dropped, the scales from 2); at 5 the 3 entries, zeros after."""
    steps = (1.0, 4.0, 2.0, 0.5)
    saved = fp8_state_dict([_delayed_layer(3, steps)])
    loaded = _delayed_layer(length, ())
    assert load_fp8_state_dict([loaded], saved) == {(3, length): 1}
    state, history = loaded.fp8_state, saved["fp8_state.amax_history"]
    expected = _delayed_layer(length, steps).fp8_state if length <= 3 else None
    if expected is not None:
        assert torch.equal(state.amax_history, expected.amax_history)
        assert torch.equal(state.scale, expected.scale)
    else:
        assert torch.equal(state.amax_history, torch.cat([history, torch.zeros(3, 2)], dim=1))
        assert torch.equal(state.scale, saved["fp8_state.scale"])
    assert state.updates == 4 and torch.equal(state.seen, saved["fp8_state.seen"])
    assert state.amax_history[0, :2].tolist() == [0.5, 2.0]


def test_resume_at_a_shorter_history_says_what_it_kept(tmp_path):
    ckpt = os.path.join(tmp_path, "ckpt")
    _, saved = fp8_run(f"--train-iters 3 --save {ckpt} --save-interval 3")
    _, built, printed = pretrain_keeping_models(
        f"{TINY} --train-iters 3 --load {ckpt} --fp8-amax-history-len 2".split()
    )
    assert (
        "FP8: the checkpoint's amax histories hold 4 steps and --fp8-amax-history-len is 2: the 2 most "
        "recent kept; the scales are computed from them"
    ) in printed.splitlines()
    loaded = fp8_state_dict(built)
    histories = [name for name in saved if name.endswith(".amax_history")]
    assert histories and loaded.keys() == saved.keys()
    for name in histories:
        assert torch.equal(loaded[name], saved[name][:, :2]), name


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.scaling}-{r.format}")
def test_the_gpus_fp8_products_equal_the_cpus(recipe):
    with building_on("cpu"):
        _, cpu = twin_layers(ColumnParallelLinear, recipe, in_features=256, out_features=512)
    with building_on("cuda"):
        _, gpu = twin_layers(ColumnParallelLinear, recipe, in_features=256, out_features=512)
    torch.manual_seed(3)
    x = torch.randn(64, 2, 256, dtype=torch.bfloat16)
    grad = torch.randn(64, 2, 512, dtype=torch.bfloat16)
    out, dx, dw = run(cpu, x, grad)
    out_g, dx_g, dw_g = run(gpu, x.cuda(), grad.cuda())
    for a, b in ((out, out_g), (dx, dx_g), (dw, dw_g)):
        assert sqnr(a, b.cpu()) >= 40.0  # the same FP8 operands; the products differ in accumulation order
    print(f"{recipe.scaling} {recipe.format}: GPU vs CPU SQNR out {sqnr(out, out_g.cpu()):.1f} dB")


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_full_and_selective_recompute_change_nothing(recipe):
    """A recomputed forward casts what the first forward cast and records no new amax."""
    flags = f"--train-iters 3 --fp8-recipe {recipe}"
    plain, plain_state = fp8_run(flags)
    for extra in (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--recompute-granularity selective",
    ):
        losses, state = fp8_run(f"{flags} {extra}")
        assert losses == plain, extra
        assert all(torch.equal(state[k], v) for k, v in plain_state.items()), extra


@pytest.mark.parametrize(("recipe", "width"), [("tensorwise", 64), ("blockwise", 128)])
def test_routed_experts_run_in_fp8_on_the_loop_and_stay_out_under_grouped_gemm(recipe, width):
    """Each expert's weight gradient sums over the tokens routed to it: any count, in the blockwise
    recipe's partial last block of 128 too."""
    from core.transformer.transformer_layer import TransformerLayer

    moe = {"num_moe_experts": 4, "moe_router_topk": 2, "hidden_dropout": 0.0}
    moe.update(hidden_size=width, ffn_hidden_size=width)
    from core.transformer.initialization import initialize_by_name

    plain = TransformerLayer(config(attention_dropout=0.0, **moe), 0)
    initialize_by_name(plain, plain.config)
    fp8 = TransformerLayer(config(attention_dropout=0.0, fp8="hybrid", fp8_recipe=recipe, **moe), 0)
    fp8.load_state_dict(plain.state_dict())
    assert fp8.fp8_kept_out == {} and len(list(fp8_states([fp8.mlp.experts]))) == 8
    torch.manual_seed(5)
    x = torch.randn(32, 2, width, dtype=torch.bfloat16)
    grad = torch.randn(32, 2, width, dtype=torch.bfloat16)
    outs = []
    for layer in (plain, fp8):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(grad)
        outs.append((out, xi.grad, layer.mlp.experts.linear_fc1.weight.grad[0]))
    for (a, b), what in zip(zip(*outs), ("output", "input grad", "expert 0 fc1 weight grad")):
        assert sqnr(a, b) >= 17.0, what
    grouped = TransformerLayer(config(fp8="hybrid", moe_grouped_gemm=True, **moe), 0)
    why = "--moe-grouped-gemm runs the experts as one grouped product, which has no FP8 form here"
    assert grouped.fp8_kept_out == {"mlp.experts.linear_fc1": why, "mlp.experts.linear_fc2": why}


def test_an_expert_no_token_has_reached_scales_from_itself_and_copies_go_at_the_step_end():
    from core.transformer.moe.experts import ExpertLinear

    cfg = config(num_moe_experts=2, ffn_hidden_size=64)
    expert = ExpertLinear(1, 64, 64, cfg, "normal", first=3)  # one expert, the layer's fourth
    torch.nn.init.normal_(expert.weight, std=0.02)
    torch.nn.init.zeros_(expert.bias)  # built uninitialised: the model initialises by name
    assert expert.enable_fp8(Fp8Recipe(format="hybrid", scaling="delayed")) is None
    state = expert.fp8_state["3"]  # by global index
    update_fp8_scales([expert])  # a step that routed it no token: a history of zeros
    assert state.updates == 1 and not state.seen.any()
    x = torch.randn(16, 64, dtype=torch.bfloat16) * 1e-4  # scale 1 would flush these to zero in E4M3
    (out,) = expert([x])
    assert sqnr(torch.nn.functional.linear(x, expert.weight[0]), out) >= 18.0
    cached = state._weight
    (again,) = expert([x])  # a new view of the stacked weight: the FP8 copy is reused
    assert state._weight is cached and torch.equal(again, out)
    out.sum().backward()
    assert state._weight is not None
    update_fp8_scales([expert])
    assert state._weight is None and state.seen.all()


def test_padding_for_quantization_gives_an_expert_the_fp8_weight_gradient_of_its_rows_padded_by_hand():
    """--moe-router-padding-for-quantization: 10 and 22 tokens are padded to 16 and 32 with zero rows,
    so both experts' weight gradients run in FP8 (without it, in bf16): the same numbers as running the
    rows padded by hand, with the padding's outputs dropped."""
    from core.transformer.moe.experts import ExpertLinear

    def experts(pad: bool) -> ExpertLinear:
        layer = ExpertLinear(
            2, 64, 32, config(num_moe_experts=2, moe_router_padding_for_quantization=pad), "normal", first=0
        )
        torch.manual_seed(0)
        torch.nn.init.normal_(layer.weight, std=0.02)
        torch.nn.init.zeros_(layer.bias)
        assert layer.enable_fp8(Fp8Recipe(format="hybrid", scaling="tensorwise")) is None
        return layer

    torch.manual_seed(1)
    pieces = [torch.randn(n, 64, dtype=torch.bfloat16) for n in (10, 22)]
    grads = [torch.randn(n, 32, dtype=torch.bfloat16) for n in (10, 22)]
    padded, by_hand, unpadded = experts(True), experts(False), experts(False)
    outs = padded([p.clone() for p in pieces])
    sum(o.float().mul(g).sum() for o, g in zip(outs, grads)).backward()
    wide = [torch.nn.functional.pad(p, (0, 0, 0, -len(p) % 16)) for p in pieces]
    hand = [o[: len(p)] for o, p in zip(by_hand(wide), pieces)]
    sum(o.float().mul(g).sum() for o, g in zip(hand, grads)).backward()
    assert all(torch.equal(a, b) for a, b in zip(outs, hand))
    assert torch.equal(padded.weight.grad, by_hand.weight.grad)
    plain = unpadded([p.clone() for p in pieces])  # the weight gradient in bf16 from the saved input
    sum(o.float().mul(g).sum() for o, g in zip(plain, grads)).backward()
    assert not torch.equal(padded.weight.grad, unpadded.weight.grad)
    reference = torch.stack([g.float().t() @ p.float() for g, p in zip(grads, pieces)])
    assert sqnr(reference, padded.weight.grad) >= 17.0


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3 x e4m3", "e5m2 x e4m3"])
def test_a_cpu_product_is_the_fp32_product_and_leaves_onednn_as_it_was(dtypes):
    """``scaled_mm`` on a CPU: the fp32 product of the dequantised operands, whichever FP8 types meet,
    with oneDNN switched back on afterwards, also after a product that fails."""
    torch.manual_seed(2)
    a, b = torch.randn(32, 64).to(dtypes[0]), torch.randn(48, 64).to(dtypes[1]).t()
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    assert torch.backends.mkldnn.enabled
    out = scaled_mm(a, b, scale_a, scale_b, torch.float32)
    assert torch.backends.mkldnn.enabled
    reference = (a.float() @ b.float()) * (scale_a * scale_b)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    with pytest.raises(RuntimeError):
        scaled_mm(a, b.t(), scale_a, scale_b, torch.float32)  # shapes that do not multiply
    assert torch.backends.mkldnn.enabled


def test_a_cpu_product_never_reaches_onednn(capfd):
    """oneDNN's verbose log (written to the process's stdout) shows torch's raw E4M3 x E4M3 product in
    oneDNN's matmul (its reference loop on a CPU without FP8 kernels), and ``scaled_mm``'s nowhere."""
    a, b = torch.randn(32, 64).to(E4M3), torch.randn(48, 64).to(E4M3).t()
    one = torch.tensor(1.0)
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        scaled_mm(a, b, one, one, torch.float32)
        ours = capfd.readouterr().out
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        raw = capfd.readouterr().out
    assert ",matmul," not in ours, ours
    if ",matmul," not in raw:
        pytest.skip("this CPU does not hand FP8 products to oneDNN: nothing to keep them from")

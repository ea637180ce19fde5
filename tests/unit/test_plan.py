"""The planner's pure logic: sizes, FLOPs, the memory walk, layouts, step time, search, CLI, rebalancing.

No process group and no model: the dry run is checked in ``tests/unit/test_plan_dry_run.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import replace
from functools import partial
from itertools import pairwise

import pytest

from core.pipeline_parallel.actions import Action, B, F, I, ScheduleDeadlock, W
from core.pipeline_parallel.layout import even_layout, parse_layout
from core.pipeline_parallel.lowering import lower
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.schedule_rules import placement_for
from core.pipeline_parallel.schedule_tables import build_tables
from core.pipeline_parallel.simulator import simulate
from core.pipeline_parallel.stage_timer import StageTimer
from planner.activations import Shape, stage_activations
from planner.calibrate import group_sizes, monotone
from planner.candidate import DP_SHARDING, Candidate
from planner.cli import _collectives_text
from planner.costs import LayerProfile, StageCostModel
from planner.hardware import BEHIND_KIND, GPUS, Cluster, Gpu, HostCosts
from planner.inputs import read_input
from planner.layouts import balanced_layout, stage_layer_counts, uneven_layer_counts
from planner.megatron_formula import megatron_memory
from planner.memory import candidate_memory, rank_memory, rank_static
from planner.model_spec import ModelSpec, describe
from planner.search import DOES_NOT_DIVIDE, FEW_MICROBATCHES, OUT_OF_MEMORY, search
from planner.shared_cores import time_shared
from planner.step_time import estimate_step

_SMALL_FLAGS = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
    "--seq-length 256 --max-position-embeddings 256 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --vocab-size 4095 --global-batch-size 16"
)
SMALL = _SMALL_FLAGS.split()


@pytest.fixture(scope="module")
def small():
    return read_input(SMALL)


def _candidate(spec, **fields) -> Candidate:
    cand = Candidate(**fields)
    placement = cand.rule.placement
    return replace(cand, layout=even_layout(spec.num_layers, cand.pp, cand.vpp, placement).to_string())


# --------------------------------------------------------------------------------------------------
# Sizes and FLOPs
# --------------------------------------------------------------------------------------------------


def test_presets_have_the_published_parameter_counts():
    counts = {name: read_input([], preset=name).spec for name in ("llama3-8b", "llama3-70b", "mixtral-8x7b")}
    assert counts["llama3-8b"].total_params() == 8_030_261_248  # Hugging Face's Meta-Llama-3-8B
    assert counts["llama3-70b"].total_params() == 70_553_706_496
    mixtral = counts["mixtral-8x7b"]
    assert (mixtral.total_params(), mixtral.active_params()) == (46_702_792_704, 12_879_925_248)
    assert mixtral.moe.num_experts == 8 and mixtral.moe.router_topk == 2


def test_flops_are_megatrons_count(small):
    from training.reporting.throughput import num_floating_point_operations

    spec = small.spec
    args = argparse.Namespace(
        seq_length=spec.seq_length, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
        group_query_attention=True, num_query_groups=spec.num_query_groups,
        num_attention_heads=spec.num_attention_heads, kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size, swiglu=True,
    )  # fmt: skip
    expected = num_floating_point_operations(args, 16, spec.padded_vocab(1))
    assert spec.training_flops(16 * spec.seq_length) == pytest.approx(expected, rel=1e-12)


def test_hf_config_gives_the_same_model_as_its_flags(tmp_path, small):
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 256,
        "intermediate_size": 704, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    read = read_input(["--global-batch-size", "16"], hf_config=str(path))
    spec = read.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_query_groups, spec.ffn_hidden_size) == (
        8,
        256,
        4,
        704,
    )
    assert (spec.vocab_size, spec.precision, spec.gated, spec.untie_embeddings) == (4096, "bf16", True, True)
    assert read.base_flags[read.base_flags.index("--vocab-size") + 1] == "4095"  # before NullTokenizer's EOD


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "vpp", "expected"),
    [
        ("1f1b", 1, [4, 3, 2, 1]),
        ("gpipe", 1, [8, 8, 8, 8]),
        ("1f1b", 2, [11, 9, 7, 5]),
        ("zb-h1", 1, [4, 4, 4, 4]),
    ],
)
def test_in_flight_microbatches_come_from_the_schedule_table(small, schedule, vpp, expected):
    cand = _candidate(small.spec, tp=1, pp=4, dp=1, vpp=vpp, schedule=schedule, num_microbatches=8)
    assert [rank_memory(small.spec, cand, r).peak_in_flight for r in range(4)] == expected


def test_distributed_optimizer_shards_the_state_over_data_parallel(small):
    plain = _candidate(small.spec, tp=2, pp=2, dp=4, num_microbatches=4)
    sharded = replace(plain, dp_sharding="optim")
    _, grads, state, _ = rank_static(small.spec, plain, 0)
    _, sharded_grads, sharded_state, _ = rank_static(small.spec, sharded, 0)
    assert state / sharded_state == pytest.approx(4.0)
    assert grads <= sharded_grads < grads * 1.01  # buckets padded to lcm(dp, 128)


def test_fp8_saves_one_byte_inputs_and_holds_fp8_weight_copies(small):
    """FP8 linear layers (issue 28) keep their inputs in FP8 and an FP8 weight and its transpose for the
    step; the planner's figures (within 0.9% of the dry run for LLaMA-3 8B's first stage at TP2 x PP4,
    ``tools/plan_check_memory.py model --config llama3-8b-fp8``) follow those two terms."""
    from planner.activations import Shape, layer_terms

    spec = small.spec
    fp8 = spec.with_(fp8=True)
    shape = Shape(seq=256, batch=1, tp=2, sequence_parallel=True)
    plain_terms, fp8_terms = layer_terms(spec, shape), layer_terms(fp8, shape)
    for name in ("qkv input", "fc1 input", "fc2 input"):
        assert fp8_terms[name] * 2 == plain_terms[name], name
    assert layer_terms(fp8.with_(fp8_wgrad=False), shape)["qkv input"] == plain_terms["qkv input"]
    blockwise = layer_terms(fp8.with_(fp8_blockwise=True), shape)  # plus a float32 scale per 128 values
    assert blockwise["qkv input"] == pytest.approx(fp8_terms["qkv input"] * (1 + 4 / 128), rel=1e-12)
    cand = _candidate(spec, tp=2, pp=2, dp=1, num_microbatches=4)
    params, *_ = rank_static(spec, cand, 0)
    fp8_params, *_ = rank_static(fp8, cand, 0)
    h, f = spec.hidden_size, spec.ffn_hidden_size
    weights = (spec.query_size + 2 * spec.kv_size) * h + spec.query_size * h + 3 * f * h
    assert fp8_params - params == 2 * weights // 2 * 4  # two bytes an element, TP 2, 4 layers on rank 0
    assert rank_memory(fp8, cand, 0).activations < rank_memory(spec, cand, 0).activations


def _fp8_spec(**changes) -> ModelSpec:
    """Hidden 64, 4 heads of 16, FFN 256, 32 tokens, bf16, no biases: a layer's four products hold
    64 x 192 + 64 x 64 + 64 x 256 + 256 x 64 = 49,152 weights, 2 x 32 x 49,152 = 3,145,728 FLOPs."""
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16,
                     ffn_hidden_size=256, vocab_size=1000, seq_length=32, max_position_embeddings=32,
                     add_bias_linear=False, normalization="RMSNorm", precision="bf16", fp8=True)  # fmt: skip
    return spec.with_(**changes)


_FP8_GPU = Gpu("test", 100.0, 80, 1.0, 100.0, 100.0, 1.0, 10.0, 10.0, fp8_peak_tflops=200.0)


def test_fp8_products_run_at_the_fp8_peak_and_their_casts_cost_memory_time():
    """Issue 28 in the time model: a layer's linear products at the FP8 peak (here 200 against 100
    TFLOP/s), the weight gradient too unless --no-fp8-wgrad or a microbatch of tokens that are not a
    multiple of 16; a product whose features are not multiples of 16 stays at the 16-bit peak. Each
    cast reads its 16-bit operand twice and writes one byte, plus one for the transposed copy."""
    cluster = Cluster(1, 1, _FP8_GPU)
    cand = Candidate(tp=1, pp=1, dp=1, num_microbatches=4, layout="E,t*2,L")
    fp8 = StageCostModel(_fp8_spec(), cand, cluster)
    assert fp8.linear_seconds() == pytest.approx((3_145_728 / 2e14, 3_145_728 / 2e14), rel=1e-12)
    assert fp8.rates.label() == "fp8 200" and fp8.rates.other == "bf16"
    # inputs 32 x (64 + 64 + 64 + 256) and weights 49,152 / 4 microbatches forward, output gradients
    # 32 x (192 + 64 + 256 + 64) backward; 2 x 2 bytes read, 1 written and 1 transposed (weights: 2)
    assert fp8.fp8_cast_seconds() == pytest.approx(
        ((32 * 448 * 6 + 49_152 * 6 / 4) / 1e12, 32 * 576 * 6 / 1e12), rel=1e-12
    )
    no_wgrad = StageCostModel(_fp8_spec(fp8_wgrad=False), cand, cluster)
    assert no_wgrad.linear_seconds() == pytest.approx((3_145_728 / 2e14, 3_145_728 / 1e14), rel=1e-12)
    assert no_wgrad.rates.label() == "fp8 200, W bf16 100"
    assert no_wgrad.fp8_cast_seconds()[1] == pytest.approx(32 * 576 * 5 / 1e12, rel=1e-12)  # no transposes
    odd_tokens = StageCostModel(_fp8_spec(seq_length=24, max_position_embeddings=24), cand, cluster)
    assert odd_tokens.linear_seconds()[1] == pytest.approx(2 * 24 * 49_152 / 1e14, rel=1e-12)
    # FFN 200: FC1 and FC2 (64 x 200 each) are not multiples of 16 and stay at 100 TFLOP/s
    narrow = StageCostModel(_fp8_spec(ffn_hidden_size=200), cand, cluster)
    assert narrow.linear_seconds()[0] == pytest.approx(
        2 * 32 * 16_384 / 2e14 + 2 * 32 * 25_600 / 1e14, rel=1e-12
    )
    assert narrow.rates.label() == "fp8 200 (2/4 products)"
    plain = StageCostModel(_fp8_spec(fp8=False), cand, cluster)
    assert plain.linear_seconds() == pytest.approx((3_145_728 / 1e14,) * 2, rel=1e-12)
    assert plain.fp8_cast_seconds() == (0.0, 0.0) and plain.rates.label() == "bf16 100"
    without_fp8_cores = StageCostModel(
        _fp8_spec(), cand, Cluster(1, 1, replace(_FP8_GPU, fp8_peak_tflops=None))
    )
    assert without_fp8_cores.linear_seconds()[0] == pytest.approx(3_145_728 / 1e14, rel=1e-12)


def test_blockwise_fp8_products_run_at_the_fp32_peak_on_features_in_multiples_of_128():
    """The blockwise recipe's products are dequantised and multiplied in float32
    (``core.tensor_parallel.fp8_blockwise``): the planner costs them at the GPU's FP32 peak (here 10
    TFLOP/s, a twentieth of the FP8 one; unknown, the 16-bit one), and only products whose features are
    multiples of 128 run in FP8 (here hidden 128, FFN 256: all four; FFN 320: FC1 and FC2 stay out, as
    the layers decide)."""
    cluster = Cluster(1, 1, replace(_FP8_GPU, fp32_peak_tflops=10.0))
    cand = Candidate(tp=1, pp=1, dp=1, num_microbatches=4, layout="E,t*2,L")
    wide = _fp8_spec(hidden_size=128, kv_channels=32, fp8_blockwise=True)
    blockwise, tensorwise = (
        StageCostModel(wide, cand, cluster),
        StageCostModel(wide.with_(fp8_blockwise=False), cand, cluster),
    )
    assert len(wide.fp8_products(1)) == 4 and blockwise.rates.label() == "fp8 10"
    assert blockwise.linear_seconds() == pytest.approx(
        tuple(20 * t for t in tensorwise.linear_seconds()), rel=1e-12
    )
    unknown = StageCostModel(wide, cand, Cluster(1, 1, _FP8_GPU))
    assert unknown.rates.label() == "fp8 100"
    assert unknown.linear_seconds() == pytest.approx(
        tuple(2 * t for t in tensorwise.linear_seconds()), rel=1e-12
    )
    narrow = wide.with_(ffn_hidden_size=320)
    assert [p.name for p in narrow.fp8_products(1)] == [p.name for p in wide.fp8_products(1)][:2]
    assert len(narrow.with_(fp8_blockwise=False).fp8_products(1)) == 4  # multiples of 16


def test_first_last_layers_bf16_costs_those_layers_at_the_16_bit_peak_without_casts():
    """--first-last-layers-bf16 with one layer at each end of 4, PP2 (layers 0-1 | 2-3): each stage holds
    one 16-bit layer and one FP8 layer. Against the all-FP8 plan, its 16-bit layer's products run at
    100 TFLOP/s instead of 200 (3,145,728 FLOPs forward, the same again for W), pays no casts (inputs
    32 x 448 x 6 bytes and weights 49,152 x 6 / 4 microbatches forward, output gradients 32 x 576 x 6
    backward), and saves its linear layers' inputs in two bytes instead of one: qkv, fc1 (32 x 64) and
    fc2 (32 x 256) one byte more each, with no FP8 copy of the projection's input (32 x 64), 10,240
    bytes more, read and written once more by the element-wise work (2 x 10,240 bytes at 1 TB/s)."""
    cluster = Cluster(2, 2, _FP8_GPU)
    cand = Candidate(tp=1, pp=2, dp=1, num_microbatches=4, layout="E,t*2|t*2,L")
    spec = _fp8_spec(num_layers=4, bf16_layers_at_start=1, bf16_layers_at_end=1)
    assert [spec.layer_in_fp8(n) for n in range(4)] == [False, True, True, False]
    mixed, fp8 = StageCostModel(spec, cand, cluster), StageCostModel(_fp8_spec(num_layers=4), cand, cluster)
    products = 3_145_728 / 2e14
    casts = ((32 * 448 * 6 + 49_152 * 6 / 4) / 1e12, 32 * 576 * 6 / 1e12)
    elementwise = 2 * 10_240 / 1e12
    for stage, symbols in enumerate(cand.stages.stages):
        got, all_fp8 = mixed.stage(symbols, stage), fp8.stage(symbols, stage)
        assert got.forward - all_fp8.forward == pytest.approx(products - casts[0] + elementwise, rel=1e-9)
        assert got.backward_input - all_fp8.backward_input == pytest.approx(
            products - casts[1] + elementwise, rel=1e-9
        )
        assert got.backward_weight - all_fp8.backward_weight == pytest.approx(products, rel=1e-9)
    assert mixed.stage(("t",)) == fp8.stage(("t",))  # a layer as most run: in FP8
    assert mixed.rates.label() == "fp8 200 (2/4 layers)" and fp8.rates.label() == "fp8 200"
    every = StageCostModel(spec.with_(bf16_layers_at_end=3), cand, cluster)
    plain = StageCostModel(_fp8_spec(num_layers=4, fp8=False), cand, cluster)
    assert every.rates.label() == "bf16 100"
    assert every.stage(cand.stages.stages[1], 1) == plain.stage(cand.stages.stages[1], 1)


def test_balanced_layouts_price_first_last_bf16_layers_at_16_bits():
    """Issue 28: the balanced layout prices each decoder layer at its own cost. Two 16-bit layers of 3
    and six FP8 layers of 1 over 2 stages: 12 in all, 6 a stage, so the 16-bit pair is a stage of its
    own (priced as one typical layer each, the split would be 4 | 4: 3 + 3 + 1 + 1 = 8 against 4).
    The search passes ``StageCostModel.decoder_layers``: the first and last layer of 4 at the 16-bit
    layer's cost (the stage test above), the middle two at the FP8 one."""
    costs = [3.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert uneven_layer_counts(costs, 2) == [2, 6]
    assert stage_layer_counts(8, 2, 1.0) == [4, 4]
    assert balanced_layout(8, 2, layer=1.0, costs=costs).to_string() == "E,t*2|t*6,L"
    assert balanced_layout(8, 2, layer=1.0, costs=[1.0] * 8).to_string() == "E,t*4|t*4,L"  # all alike
    # the loss's 2 on the last stage: 3 + 3 + 1 = 7 | 5 x 1 + 2 = 7
    assert uneven_layer_counts(costs, 2, loss=2.0) == [3, 5]
    cluster = Cluster(2, 2, _FP8_GPU)
    cand = Candidate(tp=1, pp=2, dp=1, num_microbatches=4, layout="E,t*2|t*2,L")
    spec = _fp8_spec(num_layers=4, bf16_layers_at_start=1, bf16_layers_at_end=1)
    model = StageCostModel(spec, cand, cluster)
    fp8, plain = model.stage(("t",)), StageCostModel(spec.without_fp8(), cand, cluster).stage(("t",))
    assert model.decoder_layers() == [plain, fp8, fp8, plain] and plain != fp8


def test_first_last_layers_bf16_layers_hold_16_bit_weights_and_save_16_bit_inputs():
    """2 layers, the first kept out of FP8, one rank (E, 2 layers, L; DP 2, distributed optimizer):
    166,272 padded elements of which one layer's 49,152 are FP8 weights. Casting: an FP8 copy and its
    transpose of those only (2 bytes an element); --fp8-param-gather: those held in one byte plus the
    transpose, the all-gather moving 166,272 x 2 - 49,152 bytes. The 16-bit layer saves 10,240 bytes a
    microbatch more than the FP8 one (see above)."""
    from planner.memory import gathered_param_bytes

    cand = Candidate(tp=1, pp=1, dp=2, num_microbatches=4, layout="E,t*2,L", dp_sharding="optim")
    fp8, gather = _fp8_spec(bf16_layers_at_start=1), _fp8_spec(bf16_layers_at_start=1, fp8_param_gather=True)
    assert rank_static(fp8, cand, 0)[0] == 166_272 * 2 + 2 * 49_152
    assert rank_static(gather, cand, 0)[0] == 166_272 * 2 - 49_152 + 49_152
    assert gathered_param_bytes(gather, cand, 0) == 166_272 * 2 - 49_152
    shape = Shape(seq=32, batch=1, tp=1, sequence_parallel=False, recompute="none", device="cuda", cp=1)
    saved = [stage_activations(fp8, shape, ("t", "t"), first=False, fp8_layers=n).saved for n in (0, 1, 2)]
    assert saved[0] - saved[1] == saved[1] - saved[2] == 10_240
    assert saved[2] == stage_activations(_fp8_spec(), shape, ("t", "t"), first=False).saved
    assert rank_memory(fp8, cand, 0).activations > rank_memory(_fp8_spec(), cand, 0).activations


def test_routed_experts_fp8_weights_are_counted_cast_or_held():
    """4 experts of FFN 128 at EP 2 (two on the rank), 2 layers: a layer's FP8 weights are attention's
    64 x 192 + 64 x 64 = 16,384 and its two experts' 2 x (64 x 128 + 128 x 64) = 32,768, 98,304 in all.
    Casting keeps an FP8 copy and its transpose of each (2 bytes); --fp8-param-gather holds them in one
    byte (and the transpose), so the all-gather moves 98,304 bytes fewer; under --moe-grouped-gemm the
    experts are not FP8 (attention's 32,768 only)."""
    from planner.memory import gathered_param_bytes
    from planner.model_spec import MoeSpec

    cand = Candidate(tp=1, pp=1, dp=2, ep=2, num_microbatches=4, layout="E,t*2,L", dp_sharding="optim")
    moe = _fp8_spec(fp8=False, moe=MoeSpec(4, 2, 128))
    plain_params, plain_gathered = rank_static(moe, cand, 0)[0], gathered_param_bytes(moe, cand, 0)
    assert moe.with_(fp8=True).fp8_weight_elements(1, 2) == 49_152
    assert rank_static(moe.with_(fp8=True), cand, 0)[0] == plain_params + 2 * 98_304
    held = moe.with_(fp8=True, fp8_param_gather=True)
    assert rank_static(held, cand, 0)[0] == plain_params - 98_304 + 98_304
    assert gathered_param_bytes(held, cand, 0) == plain_params - 98_304 == plain_gathered - 98_304
    grouped = moe.with_(fp8=True, moe=MoeSpec(4, 2, 128, grouped_gemm=True))
    assert rank_static(grouped, cand, 0)[0] == plain_params + 2 * 32_768


def test_the_planner_reads_first_last_layers_bf16_with_megatrons_defaults(small):
    """--first-last-layers-bf16 alone keeps 1 layer at each end (Megatron's defaults); the counts are
    read from their flags; without --fp8-format nothing is kept out."""
    base = [*SMALL, "--fp8-format", "e4m3", "--first-last-layers-bf16"]
    spec = read_input(base).spec
    assert (spec.bf16_layers_at_start, spec.bf16_layers_at_end) == (1, 1)
    spec = read_input([*base, "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0"]).spec
    assert (spec.bf16_layers_at_start, spec.bf16_layers_at_end) == (2, 0)
    assert [spec.layer_in_fp8(n) for n in range(spec.num_layers)] == [False] * 2 + [True] * (
        spec.num_layers - 2
    )
    assert "first 2 and last 0 layers not in FP8" in describe(spec)
    assert (small.spec.bf16_layers_at_start, small.spec.bf16_layers_at_end) == (0, 0)


def test_fp8_param_gather_holds_fp8_weights_and_gathers_one_byte():
    """--fp8-param-gather (issue 28, ``core/tensor_parallel/fp8_params.py``): the FP8 layers' weights are
    held in one byte, with no 16-bit copy and no cast per step, the layer keeping only the transposed
    copy (one byte); the distributed optimizer's parameter all-gather moves one byte for them. DP 2,
    one rank holding E, 2 layers, L: 65,536 + 2,048 embedding, 2 x (2 x 64 + 49,152) layers and a 64
    final norm = 166,208 elements, padded to 166,272 (a multiple of lcm(2, 128)); 98,304 FP8 weights."""
    from planner.memory import gathered_param_bytes

    cand = Candidate(tp=1, pp=1, dp=2, num_microbatches=4, layout="E,t*2,L", dp_sharding="optim")
    plain, fp8, gather = _fp8_spec(fp8=False), _fp8_spec(), _fp8_spec(fp8_param_gather=True)
    assert rank_static(plain, cand, 0)[:3] == (166_272 * 2, 166_272 * 4, 12 * 166_208 / 2 + 4 * 15 / 2)
    assert rank_static(fp8, cand, 0)[0] == 166_272 * 2 + 2 * 98_304  # an FP8 weight and its transpose
    assert rank_static(gather, cand, 0)[0] == 166_272 * 2 - 98_304 + 98_304  # held in one byte + transpose
    assert (
        rank_static(_fp8_spec(fp8_param_gather=True, precision="fp32"), cand, 0)[0]
        == 166_272 * 4 - 2 * 98_304
    )
    assert rank_static(gather, cand, 0)[1:3] == rank_static(plain, cand, 0)[1:3]
    assert [gathered_param_bytes(s, cand, 0) for s in (plain, fp8, gather)] == [332_544, 332_544, 234_240]
    cluster = Cluster(2, 2, _FP8_GPU)  # 100 GB/s, 10 µs a ring step; a ring all-gather of 2: one step
    assert StageCostModel(gather, cand, cluster).param_gather_seconds(234_240) == pytest.approx(
        1e-5 + 234_240 / 2 / 1e11, rel=1e-12
    )
    # no weight cast per step, only its transposed copy (a byte read, a byte written)
    assert StageCostModel(gather, cand, cluster).fp8_cast_seconds()[0] == pytest.approx(
        (32 * 448 * 6 + 49_152 * 2 / 4) / 1e12, rel=1e-12
    )


def test_fp8_param_gather_plans_runnable_candidates_with_the_distributed_optimizer(small):
    """--fp8-param-gather needs the distributed optimizer: every candidate gets it, DP 1 too, and its
    flags pass Trident's checks (the planner's own check of the base flags keeps the optimizer flag)."""
    from planner.report import candidate_args
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    plan_input = read_input(
        [*SMALL, "--fp8-format", "e4m3", "--fp8-param-gather", "--use-distributed-optimizer"]
    )
    assert plan_input.spec.fp8 and plan_input.spec.fp8_param_gather and not small.spec.fp8_param_gather
    result = search(plan_input.spec, Cluster(4, 4, GPUS["h100"]), global_batch_size=16, top=3,
                    allow_distributed_optimizer=True, fixed={"pp": 4})  # fmt: skip
    assert len(result.candidates) == 3
    for planned in result.candidates:
        assert planned.cand.dp == 1 and planned.cand.distributed_optimizer
        args = validate_args(parse_args(candidate_args(plan_input.base_flags, planned.cand)), 4)
        assert args.fp8_param_gather and args.use_distributed_optimizer


def test_the_table_and_json_say_which_rate_each_candidate_used(capsys):
    from planner.cli import main

    flags = [*SMALL, "--fp8-format", "e4m3", "--num-gpus", "8", "--tensor-model-parallel-size", "2",
             "--top", "2"]  # fmt: skip
    assert main([*flags, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "FP8 products at 1979 TFLOP/s peak" in out[1]
    header = next(line for line in out if line.startswith("#"))
    assert header.endswith("products TFLOP/s")
    rates = json.loads(out[-1])["candidates"][0]["matmul_rates"]
    assert rates == {"linear": "fp8", "linear_tflops": 1979.0, "weight_gradient": "fp8",
                     "weight_gradient_tflops": 1979.0, "other": "bf16", "other_tflops": 989.0,
                     "fp8_products": 4, "products": 4, "measured": False, "fp8_layers": 8,
                     "layers": 8}  # fmt: skip
    rows = [line for line in out if line.split()[0] in ("1", "2")]
    assert len(rows) == 2 and all(row.endswith("fp8 1979") for row in rows)


def test_fp8_pays_on_a_large_layer_and_not_on_a_tiny_one(small):
    """LLaMA-3 8B's layers gain from the FP8 peak; hidden 256's casts (memory-bound) cost more than the
    FLOPs they save, as torchao finds for small shapes."""
    cluster = Cluster(8, 8, GPUS["h100"])
    llama = read_input([], preset="llama3-8b").spec
    for spec, faster in ((llama, True), (small.spec, False)):
        cand = _candidate(spec, tp=2, pp=2, dp=2, num_microbatches=4)
        bf16 = estimate_step(spec.with_(fp8=False), cand, cluster)
        fp8 = estimate_step(spec.with_(fp8=True), cand, cluster)
        assert (fp8.parts.compute < bf16.parts.compute) == faster
        assert (bf16.rates.label(), fp8.rates.label()) == ("bf16 989", "fp8 1979")


def test_recomputation_and_sequence_parallel_shrink_activations(small):
    spec = small.spec
    peaks = {}
    for recompute in ("none", "selective", "full"):
        cand = _candidate(spec, tp=2, pp=2, dp=1, num_microbatches=4, recompute=recompute)
        peaks[recompute] = rank_memory(spec, cand, 0).activations
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0


def test_megatron_formula_weights_term(small):
    spec = small.spec
    cand = _candidate(spec, tp=2, pp=4, dp=2, num_microbatches=4)
    h, layer = spec.hidden_size, spec.layer_params(1)
    first_stage = (spec.num_layers * layer + h) / 4 + h * spec.padded_vocab(2)
    assert megatron_memory(spec, cand)["weights_and_optimizer"] == pytest.approx(first_stage / 2 * 18)


# --------------------------------------------------------------------------------------------------
# Layouts and step time
# --------------------------------------------------------------------------------------------------


def test_balanced_layout_moves_layers_off_an_expensive_loss_stage():
    assert stage_layer_counts(32, 4, 1.0) == [8, 8, 8, 8]
    counts = stage_layer_counts(32, 4, 1.0, embedding=0.1, loss=2.4)
    costs = [n + (0.1 if s == 0 else 0) + (2.4 if s == 3 else 0) for s, n in enumerate(counts)]
    assert sum(counts) == 32 and counts[3] < 8 and max(costs) <= 9.0
    layout = balanced_layout(32, 4, 2, layer=1.0, loss=6.0)
    assert parse_layout(layout.to_string(), 4, 2, num_layers=32).stages[-1] == ("L",)  # a stage of its own


def test_simulated_step_is_the_pipelines_ideal_with_free_communication(small):
    spec = small.spec
    free = Cluster(4, 4, Gpu("ideal", 1.0, 80, 1e12, 1e12, 1e12, intra_node_latency_us=0.0))
    profile = LayerProfile(layer=(0.5, 0.5, 0.5))
    cand = _candidate(spec, tp=1, pp=4, dp=1, num_microbatches=8)  # 2 layers a stage: F = 1, B = 2
    step = estimate_step(spec, cand, free, profile)
    assert step.pipeline_seconds == pytest.approx((8 + 4 - 1) * 3.0)
    assert step.bubble == pytest.approx(3 / 11)


@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "m"),
    [("gpipe", 4, 1, 6), ("1f1b", 4, 1, 9), ("interleaved", 4, 3, 8), ("zb-h1", 4, 2, 12), ("zbv", 4, 2, 8),
     ("zb-h1", 1, 2, 4)],
)  # fmt: skip
def test_stage_timer_gives_the_simulators_floats(schedule, pp, vpp, m):
    """The planner's compiled timing against the simulator on the lowered tables: the same starts and
    ends of every compute action, busy time and makespan, to the last bit, with uneven costs per
    (kind, rank, chunk) and a message latency (the ZBV turn and PP=1's chunks hand over locally)."""
    rng = random.Random(f"{schedule}{pp}{vpp}{m}")
    costs = {(k, r, c): rng.uniform(0.5, 2.0) for r in range(pp) for c in range(vpp) for k in (F, B, I, W)}
    tables, place = build_tables(schedule, pp, vpp, m), placement_for(schedule, pp, vpp)
    timing = StageTimer(tables, place).time(costs, 0.03)

    def cost(kind):
        return lambda action, rank: costs[kind, rank, action.chunk]

    lowered = lower(tables, place) if pp > 1 else tables
    ref = simulate(lowered, place, cost(F), cost(B), 0.03, input_cost=cost(I), weight_cost=cost(W))
    for rank, table in enumerate(lowered):
        compute = [i for i, a in enumerate(table) if a.kind in (F, B, I, W)]
        assert [ref.start_times[rank][i] for i in compute] == timing.start_times[rank]
        assert [ref.end_times[rank][i] for i in compute] == timing.end_times[rank]
    assert (timing.busy, timing.makespan, timing.bubble_fraction) == (
        ref.busy,
        ref.makespan,
        ref.bubble_fraction,
    )
    with pytest.raises(ScheduleDeadlock, match=r"every rank waits \(rank: next action\) \{0: '0B0'\}"):
        StageTimer([[Action(B, 0)]], Placement(1)).time({(B, 0, 0): 1.0})


def _cpu_cluster(**host) -> Cluster:
    """Four CPU ranks on two cores, with the given measured host costs."""
    gpu = Gpu("cpu", 0.07, 6, 0.01, 0.5, 0.5, 1.0, 300.0, 300.0)
    return Cluster(4, 4, gpu, cores=2, host=HostCosts(**host))


_TIED = [("zb-h1", 1), ("zb-h1", 2), ("zb-h1", 3), ("zbv", 2), ("1f1b", 3)]


@pytest.mark.parametrize("host", [{}, {"action_seconds": 0.004, "slowdown": (1.0, 1.3, 1.9, 2.5)}])
def test_the_step_parts_sum_to_the_step(small, host):
    profile = LayerProfile(layer=(0.02, 0.02, 0.02), embedding=(0.001, 0.0, 0.002), loss=(0.01, 0.01, 0.005))
    for cluster in (_cpu_cluster(**host), replace(_cpu_cluster(**host), cores=None)):
        for schedule, vpp in _TIED:
            cand = _candidate(small.spec, tp=2, pp=2, dp=1, vpp=vpp, schedule=schedule, micro_batch_size=8,
                              num_microbatches=2)  # fmt: skip
            step = estimate_step(small.spec, cand, cluster, profile)
            assert step.parts.total() == pytest.approx(step.step_seconds, rel=1e-9)
            assert min(vars(step.parts).values()) >= -1e-12
            assert step.parts.actions == vpp * 2 * (3 if schedule in ("zb-h1", "zbv") else 2)


def test_shared_cores_tie_on_total_work_and_the_report_says_why(small):
    """Ideal core sharing makes a schedule's bubble free (issue 33's tie: the same step for 2 to 8
    chunks); the breakdown shows the bubble traded for shared-core time. A measured per-action cost
    makes the schedules with more chunks cost what they cost."""
    from planner.report import explain_steps
    from planner.search import Planned

    profile = LayerProfile(layer=(0.02, 0.02, 0.02), loss=(0.01, 0.01, 0.005))
    cands = [_candidate(small.spec, tp=2, pp=2, dp=1, vpp=v, schedule=s, micro_batch_size=8, num_microbatches=2)
             for s, v in _TIED]  # fmt: skip
    ideal = [estimate_step(small.spec, c, _cpu_cluster(), profile) for c in cands]
    assert max(e.step_seconds for e in ideal) == pytest.approx(min(e.step_seconds for e in ideal), rel=0.01)
    assert max(e.parts.bubble for e in ideal) > 1.5 * min(e.parts.bubble for e in ideal)
    lines = explain_steps([Planned(c, [], step=e) for c, e in zip(cands, ideal)])
    assert sum("ties #" in line for line in lines) == len(cands) - 1
    assert "shared cores" in lines[2] and "bubble" in lines[2]
    fixed = _cpu_cluster(action_seconds=0.01)
    steps = {(c.schedule, c.vpp): estimate_step(small.spec, c, fixed, profile).step_seconds for c in cands}
    assert steps["zb-h1", 1] < steps["zb-h1", 2] < steps["zb-h1", 3]


@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "m"), [("1f1b", 4, 1, 9), ("zb-h1", 4, 2, 8), ("zbv", 2, 2, 4)]
)
def test_shared_core_timing_without_sharing_is_the_stage_timers(schedule, pp, vpp, m):
    rng = random.Random(f"{schedule}{pp}{vpp}{m}")
    costs = {(k, r, c): rng.uniform(0.5, 2.0) for r in range(pp) for c in range(vpp) for k in (F, B, I, W)}
    tables, place = build_tables(schedule, pp, vpp, m), placement_for(schedule, pp, vpp)
    timing = StageTimer(tables, place).time(costs, 0.03)
    shared = time_shared(tables, place, costs, latency=0.03, processes=1, slowdown=lambda busy: 1.0)
    assert shared.makespan == pytest.approx(timing.makespan, rel=1e-9)
    for rank in range(pp):
        assert shared.end_times[rank] == pytest.approx(timing.end_times[rank], rel=1e-9)
    halved = time_shared(tables, place, costs, latency=0.0, processes=1, slowdown=lambda busy: 2.0)
    assert halved.makespan == pytest.approx(2 * StageTimer(tables, place).time(costs).makespan, rel=1e-9)


def test_the_engines_costs_per_action_and_per_step_are_recovered_from_empty_steps():
    """``--profile-local`` fits the engine's fixed costs per action and per step so that the shared-core
    timing of the tables it ran, plus the per-step cost, gives the steps it measured; here the
    'measured' steps are timings with 1.5 ms an action plus 4 ms a step."""
    from planner.calibrate import engine_runs, fit_engine_costs

    slowdown = partial(HostCosts(slowdown=(1.0, 1.2, 1.7, 2.3)).slowdown_at, cores=2)
    steps = {}
    for schedule, vpp, m in engine_runs(4):
        tables, place = build_tables(schedule, 4, vpp, m), placement_for(schedule, 4, vpp)
        work = {(a.kind, r, a.chunk): 0.0015 for r, t in enumerate(tables) for a in t}
        steps[schedule, vpp, m] = 0.004 + time_shared(tables, place, work, latency=3e-4, processes=1,
                                                      slowdown=slowdown).makespan  # fmt: skip
    assert len(steps) == 3
    action, step = fit_engine_costs(steps, 4, 3e-4, slowdown)
    assert (action, step) == (pytest.approx(0.0015, rel=1e-6), pytest.approx(0.004, rel=1e-5))


def test_the_optimizer_step_is_costed_per_tensor_and_per_element_where_measured(small):
    """Two timings (256 tensors of 1,024 elements; 2 of 2^22) give back 20 µs a tensor and 1 ns an
    element; a candidate's optimizer part is then its rank's tensors and elements at those costs."""
    from planner.calibrate import OPTIMIZER_CASES, fit_optimizer_costs

    timings = tuple(n * 20e-6 + n * e * 1e-9 for n, e in OPTIMIZER_CASES)
    assert fit_optimizer_costs(timings) == (pytest.approx(20e-6, rel=1e-9), pytest.approx(1e-9, rel=1e-9))
    cand = Candidate(tp=1, pp=1, dp=2, num_microbatches=4, layout="E,t*2,L", dp_sharding="optim")
    host = HostCosts(optimizer_element_seconds=1e-9, optimizer_tensor_seconds=20e-6, step_seconds=0.003)
    cluster = Cluster(2, 2, _FP8_GPU, host=host)
    step = estimate_step(_fp8_spec(fp8=False), cand, cluster)
    # 166,208 elements over 2 shards (plus Adam's 15 step counts, 4 bytes each, over 12 bytes an
    # element) and 15 tensors over 2 shards, rounded up
    elements = (12 * 166_208 / 2 + 4 * 15 / 2) / 12
    assert step.parts.optimizer == pytest.approx(elements * 1e-9 + 8 * 20e-6, rel=1e-12)
    assert step.parts.per_step == 0.003 and step.parts.total() == pytest.approx(step.step_seconds, rel=1e-12)
    from planner.cli import describe_cluster

    lines = describe_cluster(replace(cluster, host=replace(host, action_seconds=3e-4)), _fp8_spec())
    measured = (
        "0.3 ms an action and 3 ms a step (the engine), the optimizer 20 µs a tensor and 1 ns an element"
    )
    assert lines[1:] == [f"measured here: {measured}"]
    shared = describe_cluster(
        replace(cluster, host=replace(host, slowdown=(1.0, 1.02, 1.314, 1.95))), _fp8_spec()
    )
    assert shared[1].endswith("; compute slowed 1 / 1.02 / 1.31 / 1.95x with 1 / 2 / 3 / 4 ranks computing")
    a100 = describe_cluster(Cluster(8, 8, GPUS["a100"]), _fp8_spec())
    assert a100[0].endswith("; FP8 products at 312 TFLOP/s peak (no FP8 tensor cores: the 16-bit peak)")
    blockwise = _fp8_spec(fp8_blockwise=True)
    h100 = describe_cluster(Cluster(8, 8, GPUS["h100"]), blockwise)
    assert h100[0].endswith("; blockwise FP8 products dequantised, in float32 at 67 TFLOP/s peak")
    unknown = describe_cluster(Cluster(8, 8, replace(GPUS["h100"], fp32_peak_tflops=None)), blockwise)
    assert unknown[0].endswith(
        "in float32 at 989 TFLOP/s peak (FP32 peak unknown: the 16-bit one; --peak-fp32-tflops)"
    )


def test_measured_collectives_interpolate_and_never_shrink_with_size():
    """``HostCosts.collective_seconds``: linear between measured sizes, the smallest's below them, the
    last two's line beyond them; a size made dearer than a larger one by noise keeps the larger's."""
    points = ((4096, 0.002), (262_144, 0.003), (4_194_304, 0.010))
    host = HostCosts(collectives=((("all_gather", 4), points),), collectives_world=4)
    assert host.collective_seconds("all_gather", 4, 1024) == 0.002
    assert host.collective_seconds("all_gather", 4, (4096 + 262_144) / 2) == pytest.approx(0.0025)
    assert host.collective_seconds("all_gather", 4, 4_194_304 + 3_932_160) == pytest.approx(0.017)
    assert host.collective_seconds("all_gather", 2, 4096) is None
    assert host.collective_seconds("reduce_scatter", 4, 4096) is None
    assert _collectives_text(host) == (
        "; TP, CP and DP collectives with all 4 ranks busy, ms at 4 / 256 / 4096 KiB: 4 ranks all_gather 2 / 3 / 10"
    )
    wider = replace(
        host, collectives=(*host.collectives, (("reduce_scatter", 2), ((4096, 0.001), (16 << 20, 0.03))))
    )
    assert _collectives_text(wider) == (
        "; TP, CP and DP collectives with all 4 ranks busy, ms at 4 / 256 / 4096 KiB: 4 ranks all_gather 2 / 3 / "
        "10, 2 ranks reduce_scatter 1 / 30"
    )
    assert monotone((1, 2, 3), [5.0, 1.0, 2.0]) == ((1, 1.0), (2, 1.0), (3, 2.0))
    assert group_sizes(4) == (2, 4) and group_sizes(6) == (2, 3, 6)


def test_measured_tp_collectives_replace_the_ring_formula(small):
    """A TP layer's traffic each way is two all-gathers and two reduce-scatters of its activations
    (sequence parallel) at the measured seconds, which were wall seconds with all 4 ranks busy:
    divided by that slowdown (2.0), which the shared-core timing puts back; the loss gathers once and
    reduces three per-token values; unmeasured, the ring formula."""
    spec = small.spec
    cand = _candidate(spec, tp=4, pp=1, dp=1, micro_batch_size=2, num_microbatches=4)
    activation = spec.bytes_per_value * 2 * spec.seq_length * spec.hidden_size
    tiny = 4 * 2 * spec.seq_length  # the cross-entropy's per-token values
    measured = {"all_gather": 0.004, "reduce_scatter": 0.006, "all_reduce": 0.009}
    collectives = tuple(
        ((kind, 4), ((tiny, 0.001), (activation, seconds), (2 * activation, 2 * seconds)))
        for kind, seconds in measured.items()
    )
    cluster = _cpu_cluster(slowdown=(1.0, 1.2, 1.6, 2.0), collectives=collectives, collectives_world=4)
    layer, embedding, loss = StageCostModel(spec, cand, cluster).collective_costs()
    each_way = 2 * (0.004 + 0.006) / 2.0
    assert (layer.forward, layer.backward_input, layer.backward_weight) == pytest.approx(
        (each_way, each_way, 0)
    )
    assert (embedding.forward, embedding.backward_weight) == pytest.approx((0.003, 0.003))  # reduce-scatter
    assert (loss.forward, loss.backward_input) == pytest.approx(((0.004 + 3 * 0.001) / 2.0, 0.004 / 2.0))
    unmeasured = StageCostModel(spec, cand, _cpu_cluster(slowdown=(1.0, 1.2, 1.6, 2.0)))
    ring = 3 * (300e-6 + activation / 4 / 0.5e9)  # the ring formula: 3 steps of latency + a quarter
    assert unmeasured.group_seconds("all_gather", 4, activation) == pytest.approx(ring)


def test_ring_attention_costs_its_measured_messages_each_way(small):
    """CP2 at micro-batch 2: each rank holds 256 of the 512 tokens, its key/value block 2 x 256 x
    kv_size values. Forward: one block message; backward: the block and its fp32 gradient, then the
    gradient's last hop: at the host's measured 1 ms and 1 GB/s, with attention too fast to hide any."""
    spec = small.spec
    cand = _candidate(spec, tp=1, cp=2, pp=1, dp=2, micro_batch_size=2, num_microbatches=4)
    host = HostCosts(message_latency=1e-3, message_bandwidth=1e9)
    fast = Cluster(4, 4, Gpu("fast", 1e9, 80, 1e6, 1.0, 1.0, 1.0, 300.0, 300.0), host=host)
    layer = StageCostModel(spec, cand, fast).collective_costs()[0]
    values = 2 * spec.seq_length // 2 * spec.kv_size
    block, grads = 1e-3 + 2 * spec.bytes_per_value * values / 1e9, 1e-3 + 8 * values / 1e9
    assert (layer.forward, layer.backward_input) == pytest.approx((block, block + 2 * grads), rel=1e-6)


def test_measured_ring_exchange_replaces_the_message_formula(small):
    """CP2 at micro-batch 2, as above, with ring attention's exchange measured in groups of 2 among
    every rank's compute (``ring_exchange``): 2 ms for the key/value block, 5 ms for the block and its
    fp32 gradient together, so 3.5 ms for the gradient alone (linear between). Forward: one step, the
    block; backward: one step with both, then the gradient's last hop; wall seconds with all 4 ranks
    busy, divided by that slowdown (2.0). Groups of 4 unmeasured: CP4 keeps the message formula."""
    spec = small.spec
    values = 2 * spec.seq_length // 2 * spec.kv_size
    kv_bytes, grad_bytes = 2 * spec.bytes_per_value * values, 8 * values
    points = ((kv_bytes, 0.002), (kv_bytes + grad_bytes, 0.005))
    grad_alone = 0.002 + 0.003 * (grad_bytes - kv_bytes) / grad_bytes
    assert grad_alone == pytest.approx(0.0035)  # bf16 values: the gradient is twice the block
    cluster = _cpu_cluster(
        slowdown=(1.0, 1.2, 1.6, 2.0), collectives=((("ring_exchange", 2), points),), collectives_world=4
    )
    cand = _candidate(spec, tp=1, cp=2, pp=1, dp=2, micro_batch_size=2, num_microbatches=4)
    layer = StageCostModel(spec, cand, cluster).collective_costs()[0]
    assert (layer.forward, layer.backward_input) == pytest.approx((0.001, (0.005 + 0.0035) / 2.0), rel=1e-9)
    cp4 = _candidate(spec, tp=1, cp=4, pp=1, dp=1, micro_batch_size=2, num_microbatches=4)
    unmeasured = StageCostModel(spec, cp4, cluster)
    assert unmeasured._measured_exchange(kv_bytes) is None
    assert StageCostModel(spec, cp4, _cpu_cluster()).collective_costs()[0] == unmeasured.collective_costs()[0]


def test_under_pipelining_ring_attention_costs_its_exchange_timed_behind_other_ranks(small):
    """CP2 as above, now also with PP2: the exchange timed in one group while the other ranks compute
    out of step (``ring_exchange_behind``: 4 ms the block, 10 ms block and gradient, so 7 ms the
    gradient alone) replaces the lockstep timing (2 ms, 5 ms) under pipelining; wall seconds with all 4
    ranks busy, divided by that slowdown (2.0). Without pipeline stages the lockstep timing stays."""
    spec = small.spec
    values = 2 * spec.seq_length // 2 * spec.kv_size
    kv_bytes, grad_bytes = 2 * spec.bytes_per_value * values, 8 * values
    lockstep = ((kv_bytes, 0.002), (kv_bytes + grad_bytes, 0.005))
    behind = ((kv_bytes, 0.004), (kv_bytes + grad_bytes, 0.010))
    cluster = _cpu_cluster(slowdown=(1.0, 1.2, 1.6, 2.0), collectives_world=4,
                           collectives=((("ring_exchange", 2), lockstep), ((BEHIND_KIND, 2), behind)))  # fmt: skip
    piped = _candidate(spec, tp=1, cp=2, pp=2, dp=1, micro_batch_size=2, num_microbatches=4)
    layer = StageCostModel(spec, piped, cluster).collective_costs()[0]
    assert (layer.forward, layer.backward_input) == pytest.approx((0.002, (0.010 + 0.007) / 2.0), rel=1e-9)
    flat = _candidate(spec, tp=1, cp=2, pp=1, dp=2, micro_batch_size=2, num_microbatches=4)
    layer = StageCostModel(spec, flat, cluster).collective_costs()[0]
    assert (layer.forward, layer.backward_input) == pytest.approx((0.001, (0.005 + 0.0035) / 2.0), rel=1e-9)


def test_the_exchange_behind_other_ranks_is_a_key_of_the_hardware_profile():
    """The calibration writes the key the cost model reads: both take it from the hardware profile
    (``planner.calibrate`` re-exports it), and a profile's measured points answer under it only."""
    from planner import calibrate, costs

    assert calibrate.BEHIND_KIND is costs.BEHIND_KIND is BEHIND_KIND == "ring_exchange_behind"
    host = HostCosts(collectives=(((BEHIND_KIND, 2), ((1024, 0.004), (2048, 0.010))),))
    assert host.collective_seconds(BEHIND_KIND, 2, 1536) == pytest.approx(0.007, rel=1e-12)
    assert host.collective_seconds("ring_exchange", 2, 1536) is None


def test_measured_dp_collectives_cost_each_bucket_and_add_to_the_step_on_shared_cores():
    """DP 2 on two CPU ranks sharing two cores (slowdown 1 at two busy), the model of
    ``test_zero_traffic_per_bucket_and_step_at_each_scope`` (264,832 elements, 6 buckets; 1 s per layer
    and action: compute 24 s at M = 2), with every DP collective measured at one size above any bucket
    (so each costs that, wall seconds): a reduce-scatter 2 ms, an all-gather 3 ms, an all-reduce 4 ms.
    On shared cores nothing hides behind the compute: no_shard adds its all-reduce, ZeRO-1 one
    reduce-scatter and one gather; ZeRO-2/3 at step scope the same per bucket (6 x (2 + 3) ms); at
    microbatch scope ZeRO-2 adds M x 6 reduce-scatters and 6 gathers (24 + 18 ms), ZeRO-3 M x 6
    reduce-scatters and M x (6 + 3) gathers (24 + 54 ms: each backward gathers again all but the chunk's
    own two buckets and the last layer's, kept from its forward without a pipeline). On devices of their own the same measured seconds
    run beside the compute: ZeRO-1's gather hides behind the next forward, its reduce-scatter does
    not (it starts at the last backward's end)."""
    spec = _fp8_spec(fp8=False, num_layers=4)
    big = 1 << 22
    measured = {"reduce_scatter": 0.002, "all_gather": 0.003, "all_reduce": 0.004}
    host = HostCosts(collectives=tuple(((kind, 2), ((big, t),)) for kind, t in measured.items()),
                     collectives_world=2)  # fmt: skip
    shared = Cluster(2, 2, _FP8_GPU, cores=2, host=host)
    base = Candidate(tp=1, pp=1, dp=2, num_microbatches=2, layout="E,t*4,L")
    profile = LayerProfile(layer=(1.0, 1.0, 1.0))
    expected = {
        ("no_shard", "auto"): 0.004,
        ("optim", "auto"): 0.002 + 0.003,
        ("optim_grads", "step"): 6 * (0.002 + 0.003),
        ("optim_grads_params", "step"): 6 * (0.002 + 0.003),
        ("optim_grads", "microbatch"): 2 * 6 * 0.002 + 6 * 0.003,
        ("optim_grads_params", "microbatch"): 2 * 6 * 0.002 + 2 * (6 + 3) * 0.003,
    }
    for (strategy, scope), exposed in expected.items():
        cand = replace(base, dp_sharding=strategy, dp_sharding_scope=scope)
        step = estimate_step(spec, cand, shared, profile)
        assert step.parts.compute == pytest.approx(24.0, rel=1e-12)
        assert step.parts.exposed_comm == pytest.approx(exposed, rel=1e-9), (strategy, scope)
    own = replace(shared, cores=None)
    step = estimate_step(spec, replace(base, dp_sharding="optim"), own, profile)
    assert step.parts.exposed_comm == pytest.approx(0.002, rel=1e-9)


def test_a_measured_slowdown_curve_extends_with_the_ranks():
    host = HostCosts(slowdown=(1.0, 1.3, 1.9, 2.5))
    assert [host.slowdown_at(k, 2) for k in (0, 1, 3, 4, 8)] == [1.0, 1.0, 1.9, 2.5, 5.0]
    assert [HostCosts().slowdown_at(k, 2) for k in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]


# --------------------------------------------------------------------------------------------------
# Search and command line
# --------------------------------------------------------------------------------------------------


def test_search_ranks_what_fits_and_groups_the_rest(small):
    from planner.report import candidate_args
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    cluster = Cluster(8, 8, replace(GPUS["h100"], memory_gb=0.12))
    result = search(small.spec, cluster, global_batch_size=16, top=5)
    assert {DOES_NOT_DIVIDE, FEW_MICROBATCHES, OUT_OF_MEMORY} <= set(result.rejected)
    steps = [p.step.step_seconds for p in result.candidates]
    assert len(steps) == 5 and steps == sorted(steps)
    for planned in result.candidates:
        assert planned.peak.peak <= cluster.usable_bytes
        args = validate_args(parse_args(candidate_args(small.base_flags, planned.cand)), 8)  # Trident runs it
        assert args.num_microbatches == planned.cand.num_microbatches


def test_cli_prints_a_table_and_a_json_line(capsys):
    from planner.cli import main

    assert main([*SMALL, "--num-gpus", "8", "--tensor-model-parallel-size", "2", "--top", "3", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    payload = json.loads(out[-1])
    assert set(payload) == {"candidates", "rejected"} and len(payload["candidates"]) == 3
    first = payload["candidates"][0]
    for key in ("tp", "pp", "vpp", "cp", "ep", "dp", "schedule", "micro_batch_size", "recompute", "layout",
                "peak_memory_bytes", "step_seconds", "tokens_per_second_per_gpu", "mfu", "args", "step_parts"):  # fmt: skip
        assert key in first
    assert all(c["tp"] == 2 for c in payload["candidates"])  # a flag given fixes its dimension
    assert "--tensor-model-parallel-size" in first["args"]


def test_a_schedule_given_fixes_it_even_when_it_is_megatrons_default(small):
    """``--pipeline-schedule 1f1b`` pins 1F1B (interleaved with virtual stages) as any other schedule
    given does; without the flag the search also tries the zero-bubble schedules."""
    pinned = read_input([*SMALL, "--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "4"])
    assert pinned.fixed == {"schedule": "1f1b", "pp": 4}
    cluster = Cluster(4, 4, GPUS["h100"])
    free = search(small.spec, cluster, global_batch_size=16, top=100, fixed={"pp": 4})
    assert {"1f1b", "zb-h1", "zbv"} <= {p.cand.schedule for p in free.candidates}
    result = search(pinned.spec, cluster, global_batch_size=16, top=100, fixed=pinned.fixed)
    assert {p.cand.schedule for p in result.candidates} == {"1f1b"}
    assert {p.cand.vpp for p in result.candidates} == {p.cand.vpp for p in free.candidates}


def test_a_multi_node_plan_prints_a_command_that_runs_on_every_node(capsys):
    """The printed line goes through torchrun's own parser (README's c10d rendezvous, one line for every
    node) and its flags through ``pretrain_gpt.py``'s, for the planned world size."""
    import shlex

    from torch.distributed.run import get_args_parser

    from planner.cli import main
    from training.arguments.parser import parse_args
    from training.run import build_run

    flags = ["--num-gpus", "16", "--gpus-per-node", "4", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--top", "1"]  # fmt: skip
    assert main([*SMALL, *flags]) == 0
    out = capsys.readouterr().out
    assert "on each of the 4 nodes, with MASTER_ADDR set to one node's address:" in out
    line = next(line for line in out.splitlines() if line.startswith("#1: torchrun "))
    tokens = shlex.split(line.removeprefix("#1: torchrun ").replace("$MASTER_ADDR", "node0"))
    launch = get_args_parser().parse_args(tokens)
    assert (launch.nnodes, launch.nproc_per_node) == ("4", "4")
    assert (launch.rdzv_backend, launch.rdzv_endpoint, launch.training_script) == (
        "c10d", "node0:29500", "pretrain_gpt.py")  # fmt: skip
    run = build_run(parse_args(launch.training_script_args), world_size=16)
    assert (run.parallel.world_size, run.parallel.tp, run.parallel.pp) == (16, 2, 2)
    with pytest.raises(SystemExit, match="--num-gpus 12 is not a whole number of nodes of --gpus-per-node 8"):
        main([*SMALL, "--num-gpus", "12"])


# --------------------------------------------------------------------------------------------------
# Rebalancing from a timeline
# --------------------------------------------------------------------------------------------------


def _timeline(path, cand: Candidate, costs: dict[str, tuple[float, float]]) -> None:
    """A timeline.json of the candidate's 1F1B run where every stage costs what its symbols cost."""
    from core.pipeline_parallel.schedule_rules import placement_for
    from core.pipeline_parallel.schedule_tables import build_tables
    from core.pipeline_parallel.simulator import simulate
    from training.reporting.timeline import IterationTimeline, RankEvents, TimelineData, chrome_trace

    def cost(kind):
        def of(action, rank):
            symbols = cand.stages.stages[cand.stages.stage_index(rank)]
            return sum(costs[s][0 if kind == "F" else 1] for s in symbols)

        return of

    tables = build_tables("1f1b", cand.pp, 1, cand.num_microbatches)
    result = simulate(tables, placement_for("1f1b", cand.pp), cost("F"), cost("B"))
    ranks = []
    for rank, table in enumerate(result.tables):
        events = [
            (a.kind.value, a.microbatch, a.chunk, 1e3 * s, 1e3 * e)
            for a, s, e in zip(table, result.start_times[rank], result.end_times[rank])
            if a.kind.value in "FB"
        ]
        ranks.append(RankEvents(rank, rank, True, events))
    data = TimelineData("1f1b", cand.pp, 1, cand.num_microbatches, [IterationTimeline(5, 0.0, ranks)])
    path.mkdir()
    (path / "timeline.json").write_text(json.dumps(chrome_trace(data)))


def test_rebalancing_recovers_the_costs_and_relieves_the_loss_stage(tmp_path, small):
    from planner.rebalance import rebalance

    flags = [*SMALL, "--pipeline-model-parallel-size", "4"]
    plan_input = read_input(flags)
    cand = _candidate(plan_input.spec, tp=1, pp=4, dp=1, num_microbatches=8)
    costs = {"t": (0.010, 0.020), "E": (0.001, 0.002), "L": (0.040, 0.050)}
    _timeline(tmp_path / "run", cand, costs)
    cluster = Cluster(4, 4, GPUS["h100"])
    r = rebalance(plan_input, cluster, str(tmp_path / "run"))
    assert r["layer_seconds"][0] == pytest.approx(0.010, rel=1e-3)
    assert sum(r["loss_seconds"][1:]) == pytest.approx(0.050, rel=1e-3)
    proposed = parse_layout(r["proposed_layout"], 4, num_layers=8)
    assert proposed.stages[-1].count("t") < 2 and r["predicted_gain"] > 1.2
    # the loop closed: the refitted costs give back the run's own pipeline (its timeline was simulated)
    assert r["refit_pipeline_seconds"] == pytest.approx(r["measured_pipeline_seconds"], rel=1e-3)
    assert r["planned_pipeline_seconds"] > 0


def test_the_refitted_costs_rerank_every_candidate(tmp_path, capsys, small):
    """Issue 33's loop closed: ``--from-timeline`` refits the costs and ranks the candidates again. At
    the run's shape the refitted costs are the run's own; at another the FLOP model's there, times the
    run's measured over the FLOP model's at the run's shape (per part and per action)."""
    from planner.cli import main
    from planner.rebalance import _flop_prior, rebalance

    flags = [*SMALL, "--pipeline-model-parallel-size", "4"]
    plan_input = read_input(flags)
    cand = _candidate(plan_input.spec, tp=1, pp=4, dp=1, num_microbatches=8)
    _timeline(tmp_path / "run", cand, {"t": (0.010, 0.020), "E": (0.001, 0.002), "L": (0.040, 0.050)})
    cluster = Cluster(4, 4, GPUS["h100"])
    refit = rebalance(plan_input, cluster, str(tmp_path / "run"))["refit_profile"]
    layer = refit.for_shape(1, 1, "none")[0]
    assert layer[0] == pytest.approx(0.010, rel=1e-3) and sum(layer[1:]) == pytest.approx(0.020, rel=1e-3)
    prior = _flop_prior(plan_input.spec, cluster)
    scale = [p2 / p1 for p1, p2 in zip(prior(1, 1, "none")[0], prior(2, 4, "full")[0])]
    assert list(refit.for_shape(2, 4, "full")[0]) == pytest.approx(
        [t * r for t, r in zip(layer, scale)], rel=1e-12
    )
    assert main([*flags, "--num-gpus", "8", "--gpus-per-node", "8", "--top", "3", "--from-timeline",
                 str(tmp_path / "run")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = out.split("re-ranked with the refitted costs", 1)[1]
    assert "proposed layout:" in out and "step #3:" in table and "step #4:" not in table
    assert re.search(
        r"the run's layout (ranks #\d: \d\.\d\dx the top pick's step|\(.*\) is not among the top 3)", table
    )


def test_a_timeline_is_brought_to_own_core_seconds_with_the_measured_slowdown():
    """``--from-timeline`` on shared cores divides each stretch of an action by the slowdown measured for
    the ranks busy then (the curve the step's timing applies again), not by ideal sharing."""
    from planner.rebalance import _own_core_seconds

    busy = [(0.0, 10.0), (4.0, 6.0), (5.0, 6.0)]  # three ranks: 0-4 one busy, 4-5 two, 5-6 three, 6-10 one
    events = [("F", 0, 0, 0.0, 10.0)]
    curve = HostCosts(slowdown=(1.0, 1.6, 2.5))
    own = _own_core_seconds(events, busy, partial(curve.slowdown_at, cores=2))
    assert own[0][4] == pytest.approx(4.0 + 1.0 / 1.6 + 1.0 / 2.5 + 4.0, rel=1e-12)
    ideal = _own_core_seconds(events, busy, partial(HostCosts().slowdown_at, cores=2))
    assert ideal[0][4] == pytest.approx(4.0 + 1.0 + 1.0 / 1.5 + 4.0, rel=1e-12)
    assert _own_core_seconds(events, busy, None) == events


def test_the_memory_model_knows_the_sharding_scope():
    """ZeRO-2/3 (``rank_memory(..., sharding=(strategy, scope))``), DP 2, one rank holding E, 4 layers, L of
    the FP8 test's model in bf16: buckets follow the units, each padded to a multiple of lcm(2, 128) = 128:
    the embedding 65,536 + 2,048 = 67,584 (528 x 128), the final norm 64 -> 128, each layer 49,280 (385 x
    128): 264,832 elements. Between steps ZeRO-3 holds half of the parameters (2 bytes) and ZeRO-2/3 half of
    the gradients (4 bytes), the optimizer state as ZeRO-1. During the schedule, at step scope the whole
    buckets on top (ZeRO-3's parameters still there at the optimizer step); at microbatch scope only the
    units in flight: the chunk's own 67,712 elements and 2 layers' parameters, 3 layers' gradients."""
    spec = _fp8_spec(fp8=False, num_layers=4)
    cand = Candidate(tp=1, pp=1, dp=2, num_microbatches=4, layout="E,t*4,L", dp_sharding="optim")
    zero1 = rank_memory(spec, cand, 0)
    full, own, layer = 264_832, 67_712, 49_280
    expected = {  # (params, grads, gathered in the schedule, gathered at the optimizer step)
        ("optim_grads", "step"): (full * 2, full * 4 / 2, full * 4, 0),
        ("optim_grads", "microbatch"): (full * 2, full * 4 / 2, (own + 3 * layer) * 4, 0),
        ("optim_grads_params", "step"): (full * 2 / 2, full * 4 / 2, full * (2 + 4), full * 2),
        ("optim_grads_params", "microbatch"): (
            full * 2 / 2,
            full * 4 / 2,
            (own + 2 * layer) * 2 + (own + 3 * layer) * 4,
            0,
        ),
    }
    for sharding, figures in expected.items():
        zero = rank_memory(spec, cand, 0, sharding=sharding)
        assert (zero.params, zero.grads, zero.gathered, zero.gathered_at_step) == figures, sharding
        assert (zero.optimizer, zero.activations, zero.transient) == (
            zero1.optimizer,
            zero1.activations,
            zero1.transient,
        )
        assert zero.schedule_peak - zero1.schedule_peak == sum(figures[:3]) - zero1.params - zero1.grads
    step = rank_memory(spec, cand, 0, sharding=("optim_grads_params", "step"))
    microbatch = rank_memory(spec, cand, 0, sharding=("optim_grads_params", "microbatch"))
    assert step.schedule_peak - microbatch.schedule_peak == 2 * layer * 2 + layer * 4 == 394_240
    assert (zero1.params, zero1.grads, zero1.gathered, zero1.gathered_at_step) == (full * 2, full * 4, 0, 0)
    with pytest.raises(ValueError, match="builds on the distributed optimizer"):
        rank_memory(spec, Candidate(tp=1, pp=1, dp=2, layout="E,t*4,L"), 0, sharding=("optim_grads", "step"))


# --------------------------------------------------------------------------------------------------
# Data-parallel sharding: ZeRO-1/2/3 as candidates
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "scope", "flags", "resolved"),
    [
        ("no_shard", "auto", [], ("no_shard", "microbatch")),
        ("optim", "auto", ["--use-distributed-optimizer"], ("optim", "microbatch")),
        ("optim_grads", "auto", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
         ("optim_grads", "microbatch")),
        ("optim_grads_params", "step", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
         "optim_grads_params", "--data-parallel-sharding-scope", "step"], ("optim_grads_params", "step")),
    ],
)  # fmt: skip
def test_a_candidates_sharding_strategy_is_its_flags(small, strategy, scope, flags, resolved):
    """The strategy maps onto ``pretrain_gpt.py``'s flags (Megatron-FSDP's for ZeRO-2/3, scope ``auto``
    unless fixed), which Trident's own checks read back as that strategy and scope."""
    from planner.report import candidate_args
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    cand = _candidate(small.spec, tp=1, pp=1, dp=2, num_microbatches=8, dp_sharding=strategy,
                      dp_sharding_scope=scope)  # fmt: skip
    tail = cand.flags()[cand.flags().index("--overlap-grad-reduce") + 1 :]
    assert tail == flags + (["--overlap-param-gather"] if strategy != "no_shard" else [])
    args = validate_args(parse_args(candidate_args(small.base_flags, cand)), 2)
    assert args.data_parallel_sharding_strategy == strategy
    assert args.use_distributed_optimizer == cand.distributed_optimizer == (strategy != "no_shard")
    if cand.zero:
        assert (
            (args.data_parallel_sharding_strategy, args.data_parallel_sharding_scope) == cand.zero == resolved
        )
    shown = cand.as_dict()
    assert (shown["dp_sharding"], shown["distributed_optimizer"]) == (strategy, strategy != "no_shard")
    assert shown["dp_sharding_scope"] == (resolved[1] if cand.zero else None)
    assert replace(cand, pp=2).zero == ((strategy, "step") if cand.zero else None)  # auto: step under PP


def test_zero_traffic_per_bucket_and_step_at_each_scope():
    """DP 2 on one 100 GB/s link, 10 µs a ring step; one rank holding E, 4 layers, L (bf16, fp32
    gradients): 264,832 elements in 6 buckets (the FP8 test's model). A layer's forward takes 1 s and
    each backward half 1 s, so at 2 microbatches F0 [0, 4], B0 [4, 12], F1 [12, 16], B1 [16, 24].

    ZeRO-1 reduce-scatters its buffer after the last backward (S, exposed) and all-gathers the
    parameters behind the next forward (hidden). At step scope ZeRO-2/3 move the same, one ring step's
    latency more for each of 5 more buckets. At microbatch scope each backward's reduce-scatter runs
    beside it and ends a bucket's share after it (R / 6 exposed after B1), ZeRO-2 gathers once behind
    the next forward, and ZeRO-3 gathers before each of the 2M forwards and backwards, waiting for the
    first bucket of each: a forward's 6 buckets, a backward's 3 (the 147,840 elements of 3 layers; the
    chunk's own 67,712 in 2 buckets and the last layer stay gathered from the forward, without a pipeline)."""
    spec = _fp8_spec(fp8=False, num_layers=4)
    cluster = Cluster(2, 2, _FP8_GPU)
    profile = LayerProfile(layer=(1.0, 1.0, 1.0))
    base = Candidate(tp=1, pp=1, dp=2, num_microbatches=2, layout="E,t*4,L")
    elements, buckets, latency = 264_832, 6, 1e-5
    S = latency + elements * 4 / 2 / 1e11  # a ring reduce-scatter of 2: one step
    R = S + (buckets - 1) * latency
    gather = latency + elements * 2 / 2 / 1e11 + (buckets - 1) * latency
    regather = latency + 147_840 * 2 / 2 / 1e11 + 2 * latency
    expected = {
        ("optim", "auto"): S,
        ("optim_grads", "step"): R,
        ("optim_grads_params", "step"): R,
        ("optim_grads", "microbatch"): R / buckets,
        ("optim_grads_params", "microbatch"): R / buckets + 2 * gather / buckets + 2 * regather / 3,
    }
    for (strategy, scope), exposed in expected.items():
        cand = replace(base, dp_sharding=strategy, dp_sharding_scope=scope)
        step = estimate_step(spec, cand, cluster, profile)
        assert step.parts.compute == pytest.approx(24.0, rel=1e-12)
        assert step.parts.exposed_comm == pytest.approx(exposed, rel=1e-9), (strategy, scope)
    model = StageCostModel(spec, replace(base, dp_sharding="optim_grads"), cluster, profile)
    assert model.dp_collective_seconds(elements * 4, buckets) == pytest.approx(R, rel=1e-12)


def test_zero3_traffic_beyond_the_compute_is_exposed():
    """When the link cannot keep up, the per-microbatch traffic is what the step waits for: ZeRO-3 at
    microbatch scope on a link 10^5 times slower moves M gathers of the whole buckets (G), M of what
    each backward gathers again (G', 3 of the 6 buckets) and M reduce-scatters one after another,
    2 x (G + G' + R) in all, and the step ends when the last one does."""
    spec = _fp8_spec(fp8=False, num_layers=4)
    slow = replace(_FP8_GPU, intra_node_gb_s=1e-3)
    cluster = Cluster(2, 2, slow)
    cand = Candidate(tp=1, pp=1, dp=2, num_microbatches=2, layout="E,t*4,L", dp_sharding="optim_grads_params")
    step = estimate_step(spec, cand, cluster, LayerProfile(layer=(1e-3, 1e-3, 1e-3)))
    elements, buckets, latency = 264_832, 6, 1e-5
    R = latency + elements * 4 / 2 / 1e6 + (buckets - 1) * latency
    G = latency + elements * 2 / 2 / 1e6 + (buckets - 1) * latency
    G_again = latency + 147_840 * 2 / 2 / 1e6 + 2 * latency
    # the channel starts with F0's gather at 0 and never idles: the traffic ends at 2 x (G + G' + R)
    waits = 2 * G / buckets + 2 * G_again / 3
    assert step.parts.exposed_comm == pytest.approx(2 * (G + G_again + R) + waits - 0.024, rel=1e-9)


def test_the_planner_takes_megatron_fsdps_flags(small):
    """``--use-megatron-fsdp`` (Megatron's default strategy, optim_grads_params), a strategy and a scope
    fix the plan's strategy instead of being refused; the printed flags carry them back."""
    from planner.report import candidate_args
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    assert read_input([*SMALL, "--use-megatron-fsdp"]).fixed == {"dp_sharding": "optim_grads_params"}
    flags = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
             "--data-parallel-sharding-scope", "step"]  # fmt: skip
    plan_input = read_input([*SMALL, *flags])
    assert plan_input.fixed == {"dp_sharding": "optim_grads", "dp_sharding_scope": "step"}
    assert not set(flags) & set(plan_input.base_flags)
    result = search(plan_input.spec, Cluster(4, 4, GPUS["h100"]), global_batch_size=16, top=3,
                    fixed=plan_input.fixed)  # fmt: skip
    assert len(result.candidates) == 3
    for planned in result.candidates:
        assert planned.cand.zero == ("optim_grads", "step")
        args = validate_args(parse_args(candidate_args(plan_input.base_flags, planned.cand)), 4)
        assert (args.data_parallel_sharding_strategy, args.data_parallel_sharding_scope) == (
            "optim_grads",
            "step",
        )


def test_a_stronger_strategy_is_proposed_only_where_it_fits_with_less_recomputation(small):
    """Unpinned, the search climbs no_shard, optim, optim_grads, optim_grads_params per layout and keeps
    a strategy only where it fits with less recomputation than every one below it: with memory for
    everything every candidate is no_shard; with less, sharded ones appear, each recomputing less than
    the same layout's less sharded ones."""
    roomy = search(small.spec, Cluster(8, 8, GPUS["h100"]), global_batch_size=16, top=50)
    assert {p.cand.dp_sharding for p in roomy.candidates} == {"no_shard"}
    tight = search(small.spec, Cluster(8, 8, replace(GPUS["h100"], memory_gb=0.12)), global_batch_size=16,
                   top=200)  # fmt: skip
    order = ("none", "selective", "full")
    by_layout: dict = {}
    for planned in tight.candidates:
        c = planned.cand
        key = replace(c, dp_sharding="no_shard", dp_sharding_scope="auto", recompute="none")
        by_layout.setdefault(key, {}).setdefault(c.dp_sharding, []).append(order.index(c.recompute))
    assert {s for strategies in by_layout.values() for s in strategies} > {"no_shard"}
    for strategies in by_layout.values():  # a strategy's scopes (under pipelining) recompute less than below
        levels = [strategies[s] for s in DP_SHARDING if s in strategies]
        assert all(max(above) < min(below) for below, above in pairwise(levels)), strategies


def test_the_search_tries_both_scopes_under_pipelining():
    """16 layers of the FP8 test's model in bf16 at DP 2, 4 microbatches, CPU kernels. The largest rank's
    peaks in bytes (``candidate_memory``), at recomputation none / selective / full:

    =================================  =============================  ================================
    strategy/scope                     PP 2 (E,t*8 | t*8,L)           PP 1 (E,t*16,L)
    =================================  =============================  ================================
    optim                              8,167,588 7,245,988 6,377,860  13,256,198 12,273,158 11,935,564
    optim_grads/step                   9,091,236 8,169,636 6,892,932
    optim_grads/microbatch             8,105,636 7,184,036 5,907,332  12,406,022 11,422,982 10,223,180
    optim_grads_params/microbatch      7,976,100 7,054,500 5,775,876
    =================================  =============================  ================================

    At step scope ZeRO-2 holds the whole gradients through the step on top of its shards: never less than
    ZeRO-1 here. In 8.15 MB at PP 2 ZeRO-1 fits with selective recomputation, ZeRO-2's step scope not
    without, its microbatch scope without: that one is kept, printing ``--data-parallel-sharding-scope
    microbatch``, and nothing further up is tried. In 7.1 MB ZeRO-1 needs full recomputation, ZeRO-2 fits
    at neither scope with less, ZeRO-3 at microbatch scope with selective (its step scope is never tried:
    ZeRO-2's holds less and moves the same). With ZeRO-2 pinned (``--use-megatron-fsdp
    --data-parallel-sharding-strategy optim_grads``) in 9.2 MB both scopes fit without recomputation and
    both are simulated: the step scope's single reduction is faster on this tiny model, whose
    microbatch-scope step takes no less than its traffic (the search's bound). Without a pipeline only
    ``auto``'s microbatch scope exists, printed without a flag."""
    spec = _fp8_spec(fp8=False, num_layers=16)
    peaks = {}
    for pp, strategy, scope in [(2, "optim", "auto"), (2, "optim_grads", "step"), (2, "optim_grads", "microbatch"),
                                (2, "optim_grads_params", "microbatch"), (1, "optim", "auto"),
                                (1, "optim_grads", "microbatch")]:  # fmt: skip
        cand = _candidate(spec, tp=1, pp=pp, dp=2, num_microbatches=4, dp_sharding=strategy,
                          dp_sharding_scope=scope)  # fmt: skip
        peaks[pp, strategy, scope] = [
            max(m.peak for m in candidate_memory(spec, replace(cand, recompute=r), device="cpu"))
            for r in ("none", "selective", "full")
        ]
    assert peaks == {
        (2, "optim", "auto"): [8_167_588, 7_245_988, 6_377_860],
        (2, "optim_grads", "step"): [9_091_236, 8_169_636, 6_892_932],
        (2, "optim_grads", "microbatch"): [8_105_636, 7_184_036, 5_907_332],
        (2, "optim_grads_params", "microbatch"): [7_976_100, 7_054_500, 5_775_876],
        (1, "optim", "auto"): [13_256_198, 12_273_158, 11_935_564],
        (1, "optim_grads", "microbatch"): [12_406_022, 11_422_982, 10_223_180],
    }

    def plan(pp: int, memory: float, **pinned) -> dict:
        fixed = {"tp": 1, "pp": pp, "cp": 1, "vpp": 1, "micro_batch_size": 1, **pinned}
        if pp > 1:
            fixed["layout"] = "E,t*8|t*8,L"
        cluster = Cluster(2 * pp, 4, replace(_FP8_GPU, memory_gb=memory / 1e9), memory_headroom=1.0)
        result = search(spec, cluster, global_batch_size=8, fixed=fixed, top=50, device="cpu",
                        allow_distributed_optimizer=True)  # fmt: skip
        found = {}
        for planned in (p for p in result.candidates if p.cand.schedule == "1f1b"):  # zb-h1's peaks differ
            c, flags = planned.cand, planned.cand.flags()
            given = "--data-parallel-sharding-scope" in flags
            scope = flags[flags.index("--data-parallel-sharding-scope") + 1] if given else ""
            assert scope == ("" if c.dp_sharding_scope == "auto" else c.dp_sharding_scope)
            assert planned.bound <= planned.step.step_seconds
            found[c.sharding_label()] = (c.recompute, scope, planned.step.step_seconds)
        return found

    def chosen(found: dict) -> dict:
        return {label: figures[:2] for label, figures in found.items()}

    assert chosen(plan(2, 8.15e6)) == {
        "optim": ("selective", ""),
        "optim_grads/microbatch": ("none", "microbatch"),
    }
    assert chosen(plan(2, 7.1e6)) == {
        "optim": ("full", ""),
        "optim_grads_params/microbatch": ("selective", "microbatch"),
    }
    pinned = plan(2, 9.2e6, dp_sharding="optim_grads")
    assert chosen(pinned) == {
        "optim_grads/step": ("none", ""),
        "optim_grads/microbatch": ("none", "microbatch"),
    }
    assert pinned["optim_grads/step"][2] < pinned["optim_grads/microbatch"][2]
    assert chosen(plan(1, 12.5e6)) == {"optim": ("selective", ""), "optim_grads/microbatch": ("none", "")}


@pytest.mark.parametrize(
    ("dtypes", "state", "grads", "sent"),
    [
        (["--megatron-fsdp-main-params-dtype", "auto"], 1 / 3, 1, 1),  # bf16 moments, no main copy
        (["--megatron-fsdp-main-grads-dtype", "bf16"], 1, 1 / 2, 1 / 2),  # as --grad-reduce-in-bf16
        (["--megatron-fsdp-grad-comm-dtype", "bf16"], 1, 1, 1 / 2),  # fp32 gradients sent as bf16 copies
    ],
    ids=["main-params-auto", "main-grads-bf16", "grad-comm-bf16"],
)
def test_the_planner_plans_megatron_fsdps_dtypes(small, dtypes, state, grads, sent):
    """Megatron-FSDP's main-weight, main-gradient and gradient-communication dtypes on a bf16 model: every
    candidate carries the flag (with ``--use-megatron-fsdp`` and its strategy, which the flag needs), and
    the model counts the optimizer state (Adam's bf16 moments and no main copy: a third), gradients (bf16: a
    half) and bytes reduced (bf16 on the wire: a half) the run holds and sends, against the same candidate
    with the defaults; only the gradient-communication dtype makes cast copies."""
    from planner.memory import reduced_grad_bytes
    from planner.report import candidate_args
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    flags = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"]
    defaults = read_input([*SMALL, *flags])
    plan_input = read_input([*SMALL, *flags, *dtypes])
    assert plan_input.fixed == {"dp_sharding": "optim", "megatron_fsdp_dtypes": tuple(dtypes)}
    result = search(plan_input.spec, Cluster(4, 4, GPUS["h100"]), global_batch_size=16, top=3,
                    fixed=plan_input.fixed)  # fmt: skip
    assert len(result.candidates) == 3
    for planned in result.candidates:
        cand = planned.cand
        args = validate_args(parse_args(candidate_args(plan_input.base_flags, cand)), 4)
        assert (args.use_megatron_fsdp, args.data_parallel_sharding_strategy) == (True, "optim")
        assert getattr(args, dtypes[0][2:].replace("-", "_")) == dtypes[1]
        ours, theirs = (rank_static(i.spec, cand, 0) for i in (plan_input, defaults))
        assert ours[1] / theirs[1] == grads
        assert ours[2] / theirs[2] == pytest.approx(state, rel=1e-3)  # but Adam's fp32 step counts
        assert (
            reduced_grad_bytes(plan_input.spec, cand, 0) / reduced_grad_bytes(defaults.spec, cand, 0) == sent
        )
        copies = rank_memory(plan_input.spec, cand, 0).reduction_copies
        assert copies == (ours[1] / 2 if "--megatron-fsdp-grad-comm-dtype" in dtypes else 0)


def test_the_planner_refuses_main_weights_the_training_flags_refuse(capsys):
    from planner.cli import main

    refused = [*SMALL, "--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "fp16", "--num-gpus", "2"]
    assert main(refused) == 2
    assert capsys.readouterr().err == (
        "tools/plan.py: error: --megatron-fsdp-main-params-dtype fp16 must be fp32, auto or the model's dtype "
        "(bf16): the optimizer steps fp32 main copies or the bf16 weights themselves\n"
    )


def test_llama3_70b_fits_only_sharded_over_data_parallel():
    """Issue 29's example, as the planner finds it. On 8 x 80 GB nothing fits under any strategy: Adam
    needs 16 bytes a parameter (1.13 TB for 70.6B) and the GPUs hold 640 GB; the plan says so, at DP8
    with optim_grads_params 158.7 GB per rank before activations. On 32 of them at TP1 x PP1 (FSDP's
    way: no tensor or pipeline parallelism) only optim_grads_params fits; optim and optim_grads fit nowhere
    there, each pinned in turn."""
    from planner.report import format_table

    plan_input = read_input(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"],
                            preset="llama3-70b")  # fmt: skip
    spec, fixed = plan_input.spec, plan_input.fixed
    eight = Cluster(8, 8, GPUS["h100"])
    result = search(spec, eight, global_batch_size=512, fixed=fixed, top=3)
    assert (result.candidates, result.fitting) == ([], 0)
    assert format_table(result, eight, []).splitlines()[-4:-2] == [
        "nothing fits, for example:",
        (
            "  DP8 1f1b mbs 1 m 64 optim_grads_params/microbatch: parameters, gradients and optimizer state "
            "alone 158.7 GB > 72.0 GB"
        ),
    ]
    cluster = Cluster(32, 8, GPUS["h100"])
    best = search(spec, cluster, global_batch_size=512, fixed=fixed, top=3).candidates[0]
    assert (best.cand.split(), best.cand.sharding_label(), best.cand.recompute) == (
        "CP4xDP8", "optim_grads_params/microbatch", "full")  # fmt: skip
    assert round(best.peak.peak / 1e9, 1) == 71.4
    for strategy in ("optim", "optim_grads"):
        pinned = search(spec, cluster, global_batch_size=512, fixed={**fixed, "dp_sharding": strategy}, top=3)
        assert pinned.fitting == 0, strategy


# --------------------------------------------------------------------------------------------------
# HSDP: distributed-optimizer instances
# --------------------------------------------------------------------------------------------------


def test_the_memory_model_knows_hsdp():
    """``--num-distributed-optimizer-instances 2`` at DP 4, the sharding test's model and rank (E, 4 layers, L;
    buckets padded to lcm(2, 128) = lcm(4, 128) = 128: 264,832 elements, 264,768 of them parameters in 27
    tensors). An instance's 2 ranks shard the buckets, so a rank holds what it holds at DP 2: ZeRO-3's
    parameters 2 bytes / 2, the gradients 4 bytes / 2, and the optimizer state 12 bytes / 2 an element plus
    a 4-byte step count per tensor / 2; the outer ``optim`` splits that state over the 2 instances too (as at
    DP 4). The whole buckets in use are the units in flight, as at any DP: the chunk's own 67,712 elements and
    2 layers' parameters (49,280 each), 3 layers' gradients."""
    spec = _fp8_spec(fp8=False, num_layers=4)
    base = Candidate(tp=1, pp=1, dp=4, num_microbatches=4, layout="E,t*4,L", instances=2)
    full, params, own, layer = 264_832, 264_768, 67_712, 49_280
    in_flight = (own + 2 * layer) * 2 + (own + 3 * layer) * 4
    expected = {  # (params, grads, optimizer state, gathered in the schedule)
        ("optim", "no_shard"): (full * 2, full * 4, (12 * params + 4 * 27) / 2, 0),
        ("optim_grads_params", "no_shard"): (
            full * 2 / 2,
            full * 4 / 2,
            (12 * params + 4 * 27) / 2,
            in_flight,
        ),
        ("optim_grads_params", "optim"): (full * 2 / 2, full * 4 / 2, (12 * params + 4 * 27) / 4, in_flight),
    }
    for (strategy, outer), figures in expected.items():
        memory = rank_memory(spec, replace(base, dp_sharding=strategy, outer_dp_sharding=outer), 0)
        assert (memory.params, memory.grads, memory.optimizer, memory.gathered) == figures, (strategy, outer)
    assert figures[2] == 794_331
    flat = rank_memory(spec, replace(base, instances=1, dp_sharding="optim_grads_params"), 0)
    assert (flat.params, flat.grads, flat.optimizer) == (full * 2 / 4, full * 4 / 4, 794_331)


def test_hsdp_traffic_shards_inside_a_node_and_reduces_the_shards_across_nodes():
    """DP 16 on 2 nodes of 8, N = 2: each instance's reduce-scatters and all-gathers run over its 8 ranks on
    the node's links (7 ring steps of 1/8 of the bytes); once a step each rank's 1/8 shard is all-reduced
    with its replica on the other node (2 x 1 steps of half the shard), or with the outer ``optim``
    reduce-scattered and the updated parameter shard all-gathered back (1 step each)."""
    gpu = GPUS["h100"]
    cluster = Cluster(16, 8, gpu)
    intra, inter = (gpu.intra_node_gb_s * 1e9, gpu.intra_node_latency_us * 1e-6), (
        gpu.inter_node_gb_s * 1e9, gpu.inter_node_latency_us * 1e-6)  # fmt: skip
    spec = _fp8_spec(fp8=False, num_layers=4)
    cand = Candidate(tp=1, pp=1, dp=16, layout="E,t*4,L", dp_sharding="optim_grads_params", instances=2)
    model = StageCostModel(spec, cand, cluster)
    G, P = 8e6, 4e6
    assert model.dp_collective_seconds(G) == pytest.approx(7 * (intra[1] + G / 8 / intra[0]), rel=1e-12)
    assert model.instance_seconds(G, P) == pytest.approx(
        (2 * (inter[1] + G / 8 / 2 / inter[0]), 0.0), rel=1e-12
    )
    outer = StageCostModel(spec, replace(cand, outer_dp_sharding="optim"), cluster)
    assert outer.instance_seconds(G, P) == pytest.approx(
        (inter[1] + G / 8 / 2 / inter[0], inter[1] + P / 8 / 2 / inter[0]), rel=1e-12
    )
    flat = StageCostModel(spec, replace(cand, instances=1), cluster)
    assert flat.dp_collective_seconds(G) == pytest.approx(15 * (inter[1] + G / 16 / inter[0]), rel=1e-12)
    assert flat.instance_seconds(G, P) == (0.0, 0.0)


def test_the_reduction_over_the_instances_hides_behind_the_last_backward_on_gpus():
    """Under ``--overlap-grad-reduce`` each bucket's all-reduce over the instances is launched while the
    last backward still fills buckets (``InstanceChain``): LLaMA-3 8B, ZeRO-3 at DP16 in two instances of
    one node each, 8 microbatches, 34 buckets. Over fast links between the nodes what the step exposes
    beyond its compute is well under that all-reduce's time (the last bucket's share follows the
    reductions inside the node); over slow ones the step exposes all of it but what one microbatch's
    backward hides. CPU ranks sharing cores run it after everything else, in full."""
    from planner.costs import StageCostModel
    from planner.memory import gathered_param_bytes, reduced_grad_bytes, sharded_buckets

    spec = read_input([], preset="llama3-8b").spec
    cand = Candidate(tp=1, pp=1, dp=16, layout="E,t*32,L", dp_sharding="optim_grads_params", instances=2,
                     num_microbatches=8)  # fmt: skip
    for inter_node_gb_s in (25.0, 1.0):
        cluster = Cluster(16, 8, replace(GPUS["h100"], inter_node_gb_s=inter_node_gb_s))
        buckets = sum(n for _, n in sharded_buckets(spec, cand, 0))
        reduce, gather = StageCostModel(spec, cand, cluster).instance_seconds(
            reduced_grad_bytes(spec, cand, 0), gathered_param_bytes(spec, cand, 0), buckets
        )
        estimate = estimate_step(spec, cand, cluster)
        one_microbatch = estimate.parts.compute / cand.num_microbatches
        print(
            f"{inter_node_gb_s} GB/s: all-reduce {reduce:.3f} s, exposed {estimate.exposed_comm_seconds:.3f} s"
        )
        assert (buckets, gather) == (34, 0.0)
        if inter_node_gb_s > 1.0:
            assert estimate.exposed_comm_seconds < reduce / 4
        else:
            assert 0.0 < reduce - estimate.exposed_comm_seconds <= one_microbatch
        shared = estimate_step(spec, cand, replace(cluster, cores=64))
        assert shared.exposed_comm_seconds > reduce


def test_the_memory_model_holds_what_the_suggested_communication_unit_size_keeps_in_flight():
    """ZeRO-3 at microbatch scope: beside its chunk's own weights a rank holds two layers' parameters (the
    running one, the next prefetched) and three layers' gradients (the one in backward, two reductions
    under way); with ``--suggested-communication-unit-size`` U, 1 + U/2 // layer and 1 + max(1, U // layer)
    (``core.distributed``: gathers prefetched within half of U, reductions within U). The printed command
    carries the flag, and without prefetch every layer's gather is exposed."""
    from planner.memory import _sharded_units, units_in_flight

    spec = _fp8_spec(fp8=False, num_layers=8)
    base = Candidate(tp=1, pp=1, dp=2, layout="E,t*8,L", dp_sharding="optim_grads_params", num_microbatches=2)
    _, layer, layers = _sharded_units(spec, base, base.symbols(0, 0), True)
    values, grads = spec.bytes_per_value, 4
    assert layers == 8
    assert units_in_flight(layer, None) == (2, 3)
    assert units_in_flight(layer, 1) == (1, 2)
    assert units_in_flight(layer, 6 * layer) == (4, 7)
    default = candidate_memory(spec, base)[0].gathered
    for size, (gathers, reductions) in ((1, (1, 2)), (6 * layer, (4, 7))):
        cand = replace(base, communication_unit_size=size)
        extra = layer * ((gathers - 2) * values + (reductions - 3) * grads)
        assert candidate_memory(spec, cand)[0].gathered == pytest.approx(default + extra, rel=1e-12), size
        assert cand.flags()[-3:-1] == ["--suggested-communication-unit-size", str(size)]
    cluster = Cluster(2, 8, GPUS["h100"])
    exposed = {size: estimate_step(spec, replace(base, communication_unit_size=size), cluster).exposed_comm_seconds
               for size in (None, 1, 6 * layer)}  # fmt: skip
    assert exposed[1] > exposed[None] == exposed[6 * layer]


def test_an_hsdp_candidates_flags_run_and_the_table_shows_it(small):
    """The printed flags carry the instances and the outer strategy, and the training flags accept them."""
    from planner.report import candidate_args
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    cand = _candidate(small.spec, tp=1, pp=1, dp=16, num_microbatches=1, dp_sharding="optim_grads_params",
                      instances=2, outer_dp_sharding="optim")  # fmt: skip
    flags = cand.flags()
    assert flags[flags.index("--num-distributed-optimizer-instances") + 1] == "2"
    assert flags[flags.index("--outer-dp-sharding-strategy") + 1] == "optim"
    assert cand.sharding_label() == "optim_grads_params/microbatch HSDP2 outer optim"
    args = validate_args(parse_args(candidate_args(small.base_flags, cand)), 16)
    assert (args.num_distributed_optimizer_instances, args.outer_dp_sharding_strategy) == (2, "optim")
    zero1 = replace(cand, dp_sharding="optim", outer_dp_sharding="no_shard")
    assert "--outer-dp-sharding-strategy" not in zero1.flags()
    assert zero1.sharding_label() == "optim HSDP2"
    assert "--num-distributed-optimizer-instances" not in replace(cand, instances=1).flags()


def test_the_planner_counts_gradients_in_the_dtype_the_run_keeps_them(small):
    """``--grad-reduce-in-bf16``: a bf16 model's gradients are kept and reduced in bf16, so the plan's
    gradient bytes halve (ZeRO-1 at DP2: its whole buffers) and the reduction moves half the bytes; an fp16
    model's are fp16 unless ``--accumulate-allreduce-grads-in-fp32``."""
    from planner.memory import reduced_grad_bytes

    in_bf16 = read_input([*SMALL, "--grad-reduce-in-bf16"]).spec
    assert (small.spec.grad_bytes_per_value, in_bf16.grad_bytes_per_value) == (4, 2)
    as_fp16 = ["--fp16" if flag == "--bf16" else flag for flag in SMALL]
    fp16 = read_input(as_fp16).spec
    fp16_in_fp32 = read_input([*as_fp16, "--accumulate-allreduce-grads-in-fp32"]).spec
    assert (fp16.grad_bytes_per_value, fp16_in_fp32.grad_bytes_per_value) == (2, 4)
    cand = _candidate(small.spec, tp=1, pp=1, dp=2, dp_sharding="optim")
    fp32, bf16 = (rank_memory(spec, cand, 0) for spec in (small.spec, in_bf16))
    assert bf16.grads * 2 == fp32.grads > 0
    assert reduced_grad_bytes(in_bf16, cand, 0) * 2 == reduced_grad_bytes(small.spec, cand, 0)


def test_the_planner_refuses_hsdp_as_the_training_flags_do(capsys):
    """The outer ``optim`` without ZeRO-3, or without instances, and instances that divide no split's
    DP x CP: one line each, the training flags' own."""
    from planner.cli import main
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    fixed = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    runnable = ["--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4"]
    cases = [
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
         "--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"],
        ["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"],
        ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"],
    ]  # fmt: skip
    for flags in cases:
        with pytest.raises(ValueError) as trained:
            validate_args(parse_args([*SMALL, *fixed, *flags, *runnable]), 8)
        assert main([*SMALL, *fixed, *flags, "--num-gpus", "8"]) == 2
        assert capsys.readouterr().err == f"tools/plan.py: error: {trained.value}\n"
    assert str(trained.value) == (
        "--num-distributed-optimizer-instances 3 must divide the data-parallel size x context-parallel size "
        "(8 x 1 = 8)"
    )


def test_a_two_node_plan_shards_inside_each_node_where_that_is_faster(small, capsys):
    """ZeRO-3 at DP 16 on 2 nodes of 8: unasked, the search also tries one instance per node (N = 2, the
    outer ``optim``) and ranks it first (its gathers and reductions on the node's links), beside the same
    candidate sharded over all 16 ranks; the JSON line and the printed command carry N."""
    from planner.cli import main

    fixed = {"tp": 1, "pp": 1, "cp": 1, "dp_sharding": "optim_grads_params"}
    result = search(small.spec, Cluster(16, 8, GPUS["h100"]), global_batch_size=16, fixed=fixed, top=10)
    best = result.candidates[0]
    assert (best.cand.instances, best.cand.outer_dp_sharding) == (2, "optim")
    flat = next(
        p
        for p in result.candidates
        if p.cand == replace(best.cand, instances=1, outer_dp_sharding="no_shard")
    )
    assert flat.step.step_seconds > best.step.step_seconds
    assert {p.cand.instances for p in search(small.spec, Cluster(8, 8, GPUS["h100"]), global_batch_size=16,
                                             fixed=fixed, top=10).candidates} == {1}  # fmt: skip
    flags = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--context-parallel-size",
             "1", "--use-megatron-fsdp", "--num-gpus", "16", "--top", "1", "--json"]  # fmt: skip
    assert main([*SMALL, *flags]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out.splitlines()[-1])["candidates"][0]
    assert (shown["instances"], shown["outer_dp_sharding"]) == (2, "optim")
    assert "HSDP2 outer optim" in out
    assert "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim" in out

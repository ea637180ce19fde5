"""``--fp8-param-gather``: weights held in FP8, cast by the distributed optimizer and all-gathered as bytes.

* In fp32 with the tensorwise recipe, holding the weights in FP8 is the same computation as casting
  them in each forward: both multiply the E4M3 cast of the same fp32 values with the whole weight's
  scale. So the losses are equal, bit for bit, at TP2 x DP2 with sequence parallelism and at PP2 x DP2
  under the zero-bubble schedule.
* The held weights sit in a one-byte buffer of their own: the all-gather moves FP8 bytes. Under ZeRO-3
  (``optim_grads_params``) each layer gathers those bytes before it runs, with the same losses.
* A checkpoint stores the master values in the model's dtype: a resume is exact, and a run without the
  flag, at another split, loads them as they are.

* Routed experts' stacks are held too, one scale per expert, reduced over the expert's replicas: at
  EP2 x TP2 with sequence parallelism (DP 2, expert DP 2, alltoall) the losses equal the casting run's
  bit for bit, under ZeRO-1 and ZeRO-2/3; checkpoints store each expert's master values under its own name, so a casting run and a
  held one resume from each other's checkpoints (EP2 x DP4) with the straight run's next loss, and a
  bf16 delayed resume is exact.

* The blockwise recipe holds weights in 128 x 128 tiles: at hidden 256 the same equalities hold at TP2 x
  DP2 with sequence parallelism (ZeRO-1 and ZeRO-3), at TP2 x CP2, for experts at EP2 x TP2, and a bf16
  resume is exact.

One pool of 4 gloo ranks serves the module. ZeRO-3, PP2 x DP2, TP2 x CP2, ZeRO-3's resume, the blockwise
experts and resume, and the experts' ZeRO-2/3, checkpoint and resume cases are slow:
``python -m pytest -q -m slow tests/dist/test_fp8_param_gather.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.pretrain_run import pretrain_keeping_models
from training.checkpoint import open_checkpoint
from training.checkpoint.format import optimizer_tensor_name

FP8_FP32 = str.split(
    "--num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 127 --seed 7 --hidden-dropout 0 --attention-dropout 0 "
    "--num-workers 0 --eval-iters 0 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --fp8-format hybrid --fp8-recipe tensorwise --use-distributed-optimizer "
    "--train-iters 4"
)
HELD = ["--fp8-param-gather"]


def _pretrain(rank, world_size, flags):
    """One pretrain() on this rank: (its losses, (how many storages its FP8 weights use, their bytes, their
    elements), the dtypes of its fc1 weights, what it printed)."""
    state, built, out = pretrain_keeping_models(flags)
    held = [p for m in built for n, p in m.named_parameters() if p.dtype == torch.float8_e4m3fn]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in held}
    weights = {n: str(p.dtype) for m in built for n, p in m.named_parameters() if n.endswith("fc1.weight")}
    storage = (len(storages), sum(storages.values()), sum(p.numel() for p in held))
    return [s["lm loss"] for s in state.losses], storage, weights, out


def _losses(pool, flags) -> tuple[list[float], list]:
    results = pool.run(_pretrain, flags, timeout=240)
    curves = [losses for losses, *_ in results if losses]
    assert curves and all(c == curves[0] for c in curves)
    return curves[0], results


BLOCKWISE = str.split("--hidden-size 256 --ffn-hidden-size 256 --fp8-format e4m3 --fp8-recipe blockwise")
"""The blockwise recipe, on :data:`FP8_FP32` widened so that at TP2 every linear layer's features per rank
are multiples of 128 (the experts' too: they are never tensor-parallel)."""
TILES = ", one scale per 128x128 tile"
"""What the start report adds for weights held in tiles."""


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [
        ("tensorwise", "optim"),
        ("blockwise", "optim"),
        pytest.param("tensorwise", "optim_grads_params", marks=pytest.mark.slow),
        pytest.param("blockwise", "optim_grads_params", marks=pytest.mark.slow),
    ],
)
def test_held_weights_give_the_cast_weights_losses_at_tp2_dp2_with_sequence_parallelism(
    ranks, recipe, strategy
):
    """The distributed optimizer (ZeRO-1) and ZeRO-3, whose layers gather their FP8 bytes before use.
    Blockwise: each tile's scale is reduced over the two DP ranks (whose shards of it meet there), not
    over TP (each TP rank holds other tiles)."""
    split = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    split += BLOCKWISE if recipe == "blockwise" else []
    if strategy != "optim":
        split += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    cast, _ = _losses(ranks(4), FP8_FP32 + split)
    held, results = _losses(ranks(4), FP8_FP32 + split + HELD)
    assert held == cast
    _, (storages, nbytes, numel), weights, out = results[0]
    assert set(weights.values()) == {"torch.float8_e4m3fn"} and len(weights) == 4
    if strategy == "optim":  # one buffer of one byte an element (padded to whole shards): what is gathered
        assert storages == 1 and numel <= nbytes < numel + 2 * 128
    else:  # one bucket per decoder layer, each gathered before its layer runs
        assert storages == 4
    tiles = TILES if recipe == "blockwise" else ""
    assert f"FP8 on pipeline stage 0: 16 weights held in FP8 (--fp8-param-gather){tiles}\n" in out


@pytest.mark.slow
def test_weights_held_in_tiles_give_the_cast_tiles_losses_at_tp2_cp2(ranks):
    """Blockwise at TP2 x CP2 (DP 1): the optimizer shards over DP x CP, so each tile's amax is reduced
    over the two context-parallel ranks. (At DP x CP = 4 a gradient's sum over four ranks rounds by the
    buffers' layout, which holding changes: the losses would differ in the last bits, and FP8 roundings
    would then spread them.)"""
    split = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]
    cast, _ = _losses(ranks(4), FP8_FP32 + split + BLOCKWISE)
    held, _ = _losses(ranks(4), FP8_FP32 + split + BLOCKWISE + HELD)
    assert held == cast


@pytest.mark.slow
def test_held_weights_give_the_cast_weights_losses_at_pp2_dp2_zero_bubble(ranks):
    split = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
    cast, _ = _losses(ranks(4), FP8_FP32 + split)
    held, _ = _losses(ranks(4), FP8_FP32 + split + HELD)
    assert held == cast


BF16_DELAYED = [
    *FP8_FP32,
    *"--bf16 --fp8-recipe delayed --fp8-amax-history-len 4 --lr-decay-iters 6".split(),
    *"--pipeline-model-parallel-size 2 --fp8-param-gather".split(),
]


def _weights(rank, world_size, flags):
    """One pretrain() in this process: the decoder's fc1 weights at its end, by name (host copies)."""
    built = pretrain_keeping_models(flags)[1]
    return {n: p.detach().cpu().clone() for m in built for n, p in m.named_parameters() if "fc1" in n}


def _resumes_exactly(pool, flags: list[str], tmp_path) -> str:
    """6 straight iterations saving at iteration 3; a run loading that checkpoint gives their last 3
    losses; the checkpoint's directory."""
    ckpt = str(tmp_path / "ckpt")
    straight, _ = _losses(pool, flags + ["--train-iters", "6", "--save", ckpt, "--save-interval", "3"])
    resumed, _ = _losses(pool, flags + ["--train-iters", "6", "--load", ckpt, "--ckpt-step", "3"])
    assert len(straight) == 6 and resumed == straight[3:]
    return ckpt


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [
        ("delayed", "optim"),
        pytest.param("delayed", "optim_grads_params", marks=pytest.mark.slow),
        pytest.param("blockwise", "optim", marks=pytest.mark.slow),
    ],
)
def test_held_weights_resume_exactly_and_load_as_master_values_without_the_flag(
    ranks, tmp_path, recipe, strategy
):
    """PP2 x DP2, bf16, delayed recipe (or blockwise): a run loading iteration 3's checkpoint gives the 6
    straight iterations' last 3 losses; the checkpoint's weights are the optimizer's fp32 masters in bf16,
    and a run at PP1 x DP1 without the flag (nor the distributed optimizer) loads exactly those."""
    flags = BF16_DELAYED + (BLOCKWISE if recipe == "blockwise" else [])
    if strategy != "optim":
        flags = flags + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    ckpt = _resumes_exactly(ranks(4), flags, tmp_path)
    saved = open_checkpoint(str(tmp_path / "ckpt" / "iter_0000003"))
    plain = [f for f in FP8_FP32 if f != "--use-distributed-optimizer"]
    plain += BLOCKWISE if recipe == "blockwise" else []
    loaded = _weights(
        0, 1, plain + "--bf16 --lr-decay-iters 6 --train-iters 3 --ckpt-step 3 --load".split() + [ckpt]
    )
    assert len(loaded) == 4
    for name, weight in loaded.items():
        master = saved.read_shard(optimizer_tensor_name("main_param", name))
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, master.to(torch.bfloat16)), name
        assert torch.equal(saved.read_shard(name), weight), name


EP2 = str.split(
    "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
    "--tensor-model-parallel-size 2 --sequence-parallel"
)
"""EP2 x TP2 on 4 ranks: DP 2 for the dense layers, expert DP 2. (At DP 4 a gradient's sum over four ranks
rounds by the order the ring adds them in, which follows its place in the buffers, and holding weights
in FP8 gives them a buffer of their own: the losses then differ in the last bits.)"""


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [
        ("tensorwise", "optim"),
        pytest.param("tensorwise", "optim_grads", marks=pytest.mark.slow),
        pytest.param("tensorwise", "optim_grads_params", marks=pytest.mark.slow),
        pytest.param("blockwise", "optim", marks=pytest.mark.slow),
        pytest.param("blockwise", "optim_grads_params", marks=pytest.mark.slow),
    ],
)
def test_held_expert_stacks_give_the_cast_experts_losses_at_ep2_tp2(ranks, recipe, strategy):
    """Each expert's scale (blockwise: each of its tiles') is reduced over its two replicas (expert DP),
    which hold it whole after the gather, so it is the scale of the slice the casting layer casts."""
    split = EP2 + ["--train-iters", "3"] + (BLOCKWISE if recipe == "blockwise" else [])
    if strategy != "optim":
        split += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    cast, _ = _losses(ranks(4), FP8_FP32 + split)
    held, results = _losses(ranks(4), FP8_FP32 + split + HELD)
    assert held == cast
    _, _, weights, out = results[0]
    assert set(weights.values()) == {"torch.float8_e4m3fn"} and len(weights) == 4  # the experts' fc1 stacks
    tiles, each = (TILES, "one grid of tiles") if recipe == "blockwise" else ("", "one scale")
    assert (
        f"FP8 on pipeline stage 0: 16 weights held in FP8 (--fp8-param-gather){tiles}; 8 of them "
        f"routed-expert stacks, {each} per expert\n"
    ) in out


EP2_DP4 = EP2[:8]
"""EP2 without TP (DP 4, expert DP 2), for the checkpoints (held expert stacks at EP2 x TP2 resume in
tests/dist/test_moe_checkpoint.py)."""


@pytest.mark.slow
def test_held_and_cast_expert_checkpoints_load_into_each_other(ranks, tmp_path):
    """fp32 tensorwise at EP2 x DP4: 6 iterations cast, saving at iteration 3, whose checkpoint a held
    run loads (and the other way round): the first loss after the load is the saving kind's, bit for
    bit (the same master weights, so the same FP8 weights and scales); later ones drift apart by
    rounding, as the two kinds' runs do (DP 4's gradient sums round by the buffers' layout, which
    holding changes), within 1e-3."""
    flags = FP8_FP32 + EP2_DP4 + ["--lr-decay-iters", "6"]
    for first_flags, then_flags, name in ((flags, flags + HELD, "cast"), (flags + HELD, flags, "held")):
        ckpt = str(tmp_path / name)
        straight, _ = _losses(
            ranks(4), first_flags + ["--train-iters", "6", "--save", ckpt, "--save-interval", "3"]
        )
        then, _ = _losses(ranks(4), then_flags + ["--train-iters", "6", "--load", ckpt, "--ckpt-step", "3"])
        assert len(straight) == 6 and then[:1] == straight[3:4], name
        assert max(abs(a - b) for a, b in zip(then, straight[3:])) < 1e-3, name


@pytest.mark.slow
def test_held_expert_stacks_resume_exactly_and_store_each_experts_master_values(ranks, tmp_path):
    """bf16, delayed recipe, EP2 x DP4: 3 + 3 iterations give the 6 straight ones' losses; each expert's
    weights are stored under its own name as the optimizer's fp32 master in bf16, and a run at EP1 on
    one rank without the flag loads exactly those."""
    flags = (
        FP8_FP32 + EP2_DP4 + "--bf16 --fp8-recipe delayed --fp8-amax-history-len 4 --lr-decay-iters 6".split()
    )
    flags += HELD
    ckpt = _resumes_exactly(ranks(4), flags, tmp_path)
    saved = open_checkpoint(str(tmp_path / "ckpt" / "iter_0000003"))
    plain = [f for f in FP8_FP32 if f != "--use-distributed-optimizer"] + EP2[:4]  # one rank: EP 1
    loaded = _weights(
        0, 1, plain + "--bf16 --lr-decay-iters 6 --train-iters 3 --ckpt-step 3 --load".split() + [ckpt]
    )
    stacks = {n: w for n, w in loaded.items() if ".experts." in n}
    assert len(stacks) == 4
    for name, stack in stacks.items():
        for expert in range(4):
            logical = name.replace("experts.linear_fc1", f"experts.local_experts.{expert}.linear_fc1")
            master = saved.read_shard(optimizer_tensor_name("main_param", logical))
            assert stack.dtype == torch.bfloat16 and torch.equal(stack[expert], master.to(torch.bfloat16))
            assert torch.equal(saved.read_shard(logical), stack[expert]), logical

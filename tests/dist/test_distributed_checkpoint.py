"""Checkpoints of the distributed optimizer (ZeRO-1) and of the fp16 loss scaler, through pretrain().

With ``--use-distributed-optimizer`` each data-parallel rank writes only its flat ranges of the
optimizer state. A PP2 x DP2 run saved that way resumes bit for bit (fp16, loss scale included),
loads at DP=1 with and without the distributed optimizer, holds 1/DP of the state in each rank's
file, and converts to another TP/PP exactly as the equivalent plain checkpoint does; what the
converter writes loads with the distributed optimizer again. One pool of 4 gloo ranks (and one of
2 for DP=1) serves the module, on the synthetic corpus of ``test_distributed_optimizer``.
Resuming after 10 iterations against 20 straight (fp32 and bf16) is slow:
``python -m pytest -q -m slow tests/dist/test_distributed_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import shutil

import pytest
import safetensors.torch
import torch

from core.distributed.grad_buffer import SHARD_ALIGNMENT
from tests.dist.test_distributed_optimizer import DISTRIBUTED, small_gpt, synthetic_corpus
from tests.dist.test_moe_checkpoint import _manifest, _resumes_at_ep2_tp2
from tests.e2e.test_checkpointing import data  # noqa: F401 (a fixture)
from training.checkpoint import convert_checkpoint, open_checkpoint, target_split
from training.checkpoint.files import read_header

PP2 = ["--pipeline-model-parallel-size", "2"]
PLAIN = ["--overlap-grad-reduce"]


def _pretrain(rank, world_size, flags):
    """One pretrain() on this rank: (losses on the loss stage, the loss scales its log lines show)."""
    from tests.support.pretrain_run import pretrain_gpt_in_process

    with contextlib.redirect_stdout(io.StringIO()) as out:
        state = pretrain_gpt_in_process(argv=flags)
    scales = [float(s) for s in re.findall(r"\| loss scale: ([0-9.]+) \|", out.getvalue())]
    return [losses["lm loss"] for losses in state.losses], scales


def _run(pool, flags) -> tuple[list[float], list[float]]:
    """The loss stage's losses (its ranks agree) and the loss scales the logging rank printed."""
    results = pool.run(_pretrain, flags, timeout=240)
    curves = [losses for losses, _ in results if losses]
    assert curves and all(c == curves[0] for c in curves)
    return curves[0], next((scales for _, scales in results if scales), [])


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _weights_and_optimizer(path: str) -> dict:
    """The manifest records (sizes, per-piece checksums) of every model and optimizer file."""
    files = open_checkpoint(path).manifest["files"]
    return {name: record for name, record in files.items() if name.startswith(("model", "optim"))}


def _state_bytes(path: str) -> int:
    """Bytes of per-element optimizer state (scalars left out) in one safetensors file."""
    header = read_header(path)
    return sum(
        info["data_offsets"][1] - info["data_offsets"][0]
        for key, info in header.items()
        if key != "__metadata__" and info["shape"]
    )


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    return synthetic_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def sharded(ranks, data_prefix, tmp_path_factory):
    """An fp32 PP2 x DP2 run of 6 iterations with the distributed optimizer, saved at 3 and 6."""
    root = str(tmp_path_factory.mktemp("sharded"))
    flags = small_gpt(data_prefix, 6, *PP2, *DISTRIBUTED, "--save", root, "--save-interval", "3")
    losses, _ = _run(ranks(4), flags)
    return root, losses


@pytest.fixture(scope="module")
def at_dp1(ranks, data_prefix, sharded, tmp_path_factory):
    """Iterations 4-6 at PP2 x DP1 from the DP2 checkpoint of iteration 3, plain and with the
    distributed optimizer, each saved at 6."""
    root, _ = sharded
    saved = {name: str(tmp_path_factory.mktemp(f"dp1-{name}")) for name in ("plain", "distributed")}
    load = ["--load", root, "--ckpt-step", "3"]
    losses = {
        name: _run(ranks(2), small_gpt(data_prefix, 6, *PP2, *flags, *load, "--save", saved[name]))[0]
        for name, flags in (("plain", PLAIN), ("distributed", DISTRIBUTED))
    }
    return saved, losses


def test_the_files_hold_each_ranks_flat_ranges_which_tile_every_tensor(sharded):
    root, _ = sharded
    ckpt = open_checkpoint(root)
    pieces = {}  # (tensor, tp rank) -> [(start, end)]
    for name, record in ckpt.manifest["files"].items():
        for key, piece in record["pieces"].items():
            if name.startswith("optim") and "flat" in piece:
                pieces.setdefault((key, piece["tp_rank"]), []).append(tuple(piece["flat"]))
    assert sorted(f for f in os.listdir(ckpt.path) if f.startswith("optim")) == [
        f"optim_tp0_pp{p}_dp{d}.safetensors" for p in (0, 1) for d in (0, 1)
    ]
    per_element = [n for n, spec in ckpt.specs.items() if n.startswith("optimizer.") and spec.shape]
    assert sorted(key for key, _ in pieces) == sorted(per_element)
    for (key, _), spans in pieces.items():
        spans.sort()
        numel = torch.Size(ckpt.spec(key).shard_shape(1)).numel()
        assert spans[0][0] == 0 and spans[-1][1] == numel, key
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), key  # no gap, no overlap


def test_resume_from_a_distributed_optimizer_checkpoint_is_exact_in_fp16(ranks, data_prefix, tmp_path):
    """6 straight fp16 iterations against 3 + 3 resumed: the same losses, loss scales, weights and
    optimizer state, bit for bit. The scale grows every 2 quiet steps, so a resume that lost the
    scaler's growth tracker (or its scale) would log other scales."""
    fp16 = ["--fp16", "--initial-loss-scale", "256", "--loss-scale-window", "2", "--log-interval", "1"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    flags = small_gpt(data_prefix, 6, *PP2, *DISTRIBUTED, *fp16)
    losses, scales = _run(ranks(4), flags + ["--save", straight, "--save-interval", "3"])
    again, again_scales = _run(ranks(4), flags + ["--load", straight, "--ckpt-step", "3", "--save", resumed])
    print(f"loss scales {scales}; resumed {again_scales}")
    assert len(set(scales)) > 2  # the scale changed during the run
    assert (again, again_scales) == (losses[3:], scales[3:])
    assert _weights_and_optimizer(resumed) == _weights_and_optimizer(straight)
    saved = [open_checkpoint(r).manifest["optimizer"]["grad_scaler"] for r in (straight, resumed)]
    assert saved[0] == saved[1] and saved[0]["scale"] == scales[-1]


def test_a_dp2_checkpoint_loads_at_dp1_with_and_without_the_distributed_optimizer(sharded, at_dp1):
    """The same next losses as the DP2 run within 1e-6 (fp32). At DP=1 the distributed optimizer owns
    whole parameters and saves as the plain one does: the two runs' checkpoints are the same bytes."""
    _, straight = sharded
    saved, losses = at_dp1
    print({name: f"{_rel(curve, straight[3:]):.2e}" for name, curve in losses.items()})
    for curve in losses.values():
        assert _rel(curve, straight[3:]) <= 1e-6
    records = {name: _weights_and_optimizer(path) for name, path in saved.items()}
    assert records["plain"] == records["distributed"]
    assert not any("flat" in p for r in records["distributed"].values() for p in r["pieces"].values())


def test_each_ranks_optimizer_file_holds_one_dp_th_of_the_state(sharded, at_dp1):
    """DP=2 sharded files against the DP=1 plain run's files of the same iteration (fp32 Adam: 8 bytes
    per element). Each stage has two buckets (the tied embedding has its own), each padded to a
    multiple of 128 elements, so a rank's share may miss 1/DP by at most that padding."""
    (root, _), (saved, _) = sharded, at_dp1
    plain = saved["plain"]
    for stage in (0, 1):
        full = _state_bytes(os.path.join(plain, "iter_0000006", f"optim_tp0_pp{stage}_dp0.safetensors"))
        shards = [
            _state_bytes(os.path.join(root, "iter_0000006", f"optim_tp0_pp{stage}_dp{d}.safetensors"))
            for d in (0, 1)
        ]
        print(f"stage {stage}: optimizer-state bytes unsharded {full}, per DP rank {shards}")
        assert sum(shards) == full
        assert all(abs(s - full / 2) <= 8 * SHARD_ALIGNMENT * 2 for s in shards)


def test_converting_a_sharded_checkpoint_equals_converting_the_plain_one(
    ranks, data_prefix, sharded, tmp_path
):
    """The sharded iteration-3 checkpoint and a plain copy of it (loaded into the plain optimizer at the
    same split and saved again) convert to TP2 x PP1 byte for byte. The result trains on with the
    distributed optimizer at TP2 x DP2 within 1e-5 of the sharded run, and exactly as loading the
    sharded checkpoint at TP2 x DP2 directly does."""
    root, straight = sharded
    plain = str(tmp_path / "plain")
    flags = small_gpt(data_prefix, 3, *PP2, *PLAIN, "--load", root, "--ckpt-step", "3", "--save", plain)
    flags.append("--override-opt_param-scheduler")  # 3 iterations, none left to train
    assert all(losses == [] for losses, _ in ranks(4).run(_pretrain, flags, timeout=240))  # it only saves
    assert not any("flat" in p for r in _weights_and_optimizer(plain).values() for p in r["pieces"].values())
    converted = {}
    for name, source in (("sharded", root), ("plain", plain)):
        ckpt = open_checkpoint(source, 3)
        target, config = target_split(ckpt, tensor_parallel=2, pipeline_parallel=1)
        convert_checkpoint(ckpt, str(tmp_path / f"{name}-tp2"), target, config)
        converted[name] = str(tmp_path / f"{name}-tp2")
    records = {name: _weights_and_optimizer(path) for name, path in converted.items()}
    assert records["sharded"] == records["plain"]
    for file in records["plain"]:
        a, b = (
            safetensors.torch.load_file(os.path.join(p, "iter_0000003", file)) for p in converted.values()
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    tp2 = small_gpt(data_prefix, 6, *DISTRIBUTED, "--tensor-model-parallel-size", "2")
    losses, _ = _run(ranks(4), tp2 + ["--load", converted["sharded"]])
    direct, _ = _run(ranks(4), tp2 + ["--load", root, "--ckpt-step", "3"])  # resharded while loading
    print(f"TP2 x DP2 from the converted checkpoint: {_rel(losses, straight[3:]):.2e}")
    assert _rel(losses, straight[3:]) <= 1e-5 and direct == losses


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_resume_after_10_iterations_equals_20_straight(ranks, data_prefix, tmp_path, dtype):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    flags = small_gpt(data_prefix, 20, *PP2, *DISTRIBUTED, *dtype, "--ddp-bucket-size", "3000")
    losses, _ = _run(ranks(4), flags + ["--save", straight, "--save-interval", "10"])
    again, _ = _run(ranks(4), flags + ["--load", straight, "--ckpt-step", "10", "--save", resumed])
    assert again == losses[10:]
    assert _weights_and_optimizer(resumed) == _weights_and_optimizer(straight)


FP8_FLAGS = str.split(
    "--num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 127 --seed 7 --hidden-dropout 0 --attention-dropout 0 "
    "--num-workers 0 --eval-iters 0 --bf16 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 --train-iters 3"
)


def _fp8_pretrain(rank, world_size, flags):
    """One pretrain() on this rank: the FP8 states of its layers at the end, by name."""
    from core.tensor_parallel.fp8 import fp8_state_dict
    from tests.support.pretrain_run import pretrain_keeping_models

    return fp8_state_dict(pretrain_keeping_models(flags)[1])


def test_fp8_amax_histories_saved_at_pp2_load_by_name_at_pp1(ranks, tmp_path):
    """The delayed recipe's histories are found by module name whatever the split (issue 28)."""
    ckpt = str(tmp_path / "ckpt")
    saved = {}
    for states in ranks(2).run(_fp8_pretrain, FP8_FLAGS + PP2 + ["--save", ckpt], timeout=240):
        saved.update(states)
    assert len([k for k in saved if k.endswith(".amax_history")]) == 16  # 4 layers x 4 linear layers
    assert all(int(saved[k]) == 3 for k in saved if k.endswith(".updates"))
    loaded = _fp8_pretrain(0, 1, FP8_FLAGS + ["--load", ckpt])  # at iteration 3 already: nothing trains
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def _fp8_printed(rank, world_size, flags):
    """One pretrain() on this rank: what it printed."""
    from tests.support.pretrain_run import pretrain_keeping_models

    return pretrain_keeping_models(flags)[2]


def test_a_history_length_change_is_said_when_the_first_stage_holds_no_fp8_layer(ranks, tmp_path):
    """PP2, the first stage's two layers in bf16 (``--first-last-layers-bf16``): rank 0 holds no FP8 layer,
    yet it prints the line for the histories the last stage cut from 4 to 2 (once)."""
    ckpt = str(tmp_path / "ckpt")
    ranks(2).run(_fp8_printed, FP8_FLAGS + PP2 + ["--save", ckpt], timeout=240)
    bf16_first = "--first-last-layers-bf16 --num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 0"
    flags = FP8_FLAGS + PP2 + bf16_first.split() + ["--fp8-amax-history-len", "2", "--load", ckpt]
    printed = ranks(2).run(_fp8_printed, flags, timeout=240)  # at iteration 3 already: nothing trains
    line = (
        "FP8: the checkpoint's amax histories hold 4 steps and --fp8-amax-history-len is 2: the 2 most "
        "recent kept; the scales are computed from them"
    )
    assert printed[0].splitlines().count(line) == 1 and line not in printed[1]


def test_fp8_experts_reduce_their_amaxes_over_expert_data_parallel_replicas(ranks, tmp_path):
    """EP 2 on 4 ranks (expert DP 2), delayed recipe: the dense layers' histories agree on all four
    ranks (TP x DP x CP), each expert's on its two replicas, which saw other tokens (issue 28); and a
    load at EP 1 on one rank finds every expert's history."""
    moe = "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
    flags = FP8_FLAGS + moe.split() + ["--global-batch-size", "8"]
    ckpt = str(tmp_path / "ckpt")
    results = ranks(4).run(_fp8_pretrain, flags + ["--save", ckpt], timeout=240)
    experts = [name for name in results[0] if ".experts.linear_fc" in name]
    assert experts and all(int(results[0][n]) == 3 for n in experts if n.endswith(".updates"))
    for name in results[0]:
        holders = [r[name] for r in results if name in r]
        assert len(holders) == (2 if ".experts.linear_fc" in name else 4), name
        assert all(torch.equal(h, holders[0]) for h in holders), name
    held = {n: r[n] for r in results for n in r if ".experts.linear_fc" in n}
    assert held.keys() > set(experts)  # the other EP rank's experts
    first, third = (
        f"decoder.layers.0.mlp.experts.linear_fc1.fp8_state.{e}.amax_history" for e in (0, 2)
    )
    assert not torch.equal(held[first], held[third])  # not reduced with another rank's experts
    one = FP8_FLAGS + moe.replace("--expert-model-parallel-size 2", "").split()
    one += ["--global-batch-size", "8", "--load", ckpt]
    loaded = _fp8_pretrain(0, 1, one)  # at iteration 3 already: nothing trains
    for name, value in {**results[0], **held}.items():
        assert torch.equal(loaded[name], value), name


def test_a_checkpoint_saved_at_ep2_tp2_with_sequence_parallelism_resumes_bit_for_bit(ranks, data, tmp_path):  # noqa: F811
    """Distributed optimizer at EP2 x TP2 + SP: the experts' optimizer state that TP rank 1 writes is found
    on load (it was tagged with TP rank 1, and an unsplit tensor is looked up as TP shard 0)."""
    ckpt = _resumes_at_ep2_tp2(ranks(4), data, tmp_path, "zero1")
    pieces = _manifest(ckpt, 2)["files"]["optim_tp1_pp0_dp0.safetensors"]["pieces"]
    experts = {key: piece["tp_rank"] for key, piece in pieces.items() if ".local_experts." in key}
    assert experts and set(experts.values()) == {0}  # not split over TP: TP shard 0, like the expert files
    state = {key: open_checkpoint(ckpt, 2).full_tensor(key) for key in experts}
    old = str(tmp_path / "tagged-tp1")  # as saved before the fix: every piece tagged with the writer's TP rank
    shutil.copytree(os.path.join(ckpt, "iter_0000002"), old)
    manifest = _manifest(ckpt, 2)
    for piece in manifest["files"]["optim_tp1_pp0_dp0.safetensors"]["pieces"].values():
        piece["tp_rank"] = 1
    with open(os.path.join(old, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    assert all(torch.equal(open_checkpoint(old).full_tensor(key), value) for key, value in state.items())

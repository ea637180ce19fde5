"""MoE checkpoints reshard expert parallelism: a run saved at EP2 x PP2 resumes at EP1 x PP1 and at EP4
with the same next losses, directly (``--load``) and through the converter; ``--async-save`` writes
the same bytes.

Experts are stored whole under their global names (``...local_experts.{e}...``); a rank reads the
experts it holds from whichever file has them, and the converter moves them between expert files.
At EP2 x TP2 with sequence parallelism (expert TP 1: TP rank 1 holds other experts and writes their
optimizer state) a resume repeats the uninterrupted run bit for bit without the distributed optimizer,
under ZeRO-2/3 and with ``--fp8-param-gather`` (with the distributed optimizer: in the README's suite,
``test_distributed_checkpoint``, whose rank pool is started anyway); loaded at EP2 x DP2 and EP1 x DP4
the checkpoint gives the same optimizer state. The runs are real ``pretrain()`` calls on 4 gloo ranks:
slow (``pytest -m slow tests/dist/test_moe_checkpoint.py``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.e2e.test_checkpointing import RUN, _losses, _pretrain, _rel, data  # noqa: F401 (data is a fixture)
from training.checkpoint import open_checkpoint

MOE_MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
    "--moe-layer-freq", "([1]*3+[0])", "--use-distributed-optimizer",
]  # fmt: skip
EP2PP2 = ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
EP4 = ["--expert-model-parallel-size", "4"]


def _manifest(root: str, iteration: int) -> dict:
    with open(os.path.join(root, f"iter_{iteration:07d}", "manifest.json")) as fh:
        return json.load(fh)


@pytest.mark.slow
def test_a_checkpoint_saved_at_ep2_pp2_resumes_at_ep1_pp1_and_ep4(ranks, data, tmp_path):  # noqa: F811
    from tools import convert_checkpoint

    pool, ckpt = ranks(4), str(tmp_path / "ep2pp2")
    common = [*MOE_MODEL, *RUN, "--data-path", data]
    straight, _ = _losses(pool, *common, *EP2PP2, "--save", ckpt, "--save-interval", "2")
    background = str(tmp_path / "async")
    again, _ = _losses(pool, *common, *EP2PP2, "--save", background, "--save-interval", "2", "--async-save")
    assert again == straight
    for iteration in (2, 4, 5):  # written in the background: the same bytes, expert files included
        files = [_manifest(root, iteration)["files"] for root in (ckpt, background)]
        assert files[0] == files[1], iteration
    resumed, _ = _losses(pool, *common, *EP2PP2, "--load", ckpt, "--ckpt-step", "2")
    assert resumed == straight[2:]  # the same split repeats the uninterrupted run bit for bit
    expert_files = sorted(f for f in _manifest(ckpt, 2)["files"] if f.startswith("model_experts_"))
    assert expert_files == [f"model_experts_pp{p}_ep{e}.safetensors" for p in (0, 1) for e in (0, 1)]
    ep1, _ = _losses(pool, *common, "--load", ckpt, "--ckpt-step", "2")
    ep4, out = _losses(pool, *common, *EP4, "--load", ckpt, "--ckpt-step", "2")
    converted = str(tmp_path / "ep4")
    flags = ["--iteration", "2", "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"]
    flags += ["--target-expert-model-parallel-size", "4"]
    assert convert_checkpoint.main(["--load", ckpt, "--save", converted, "--quiet", *flags]) == 0
    after_convert, _ = _losses(pool, *common, *EP4, "--load", converted)
    print(
        f"relative differences of the next 3 losses to EP2xPP2's: EP1xPP1 {_rel(ep1, resumed):.2e}, "
        f"EP4 {_rel(ep4, resumed):.2e}, EP4 converted {_rel(after_convert, resumed):.2e}"
    )
    for losses in (ep1, ep4, after_convert):
        assert _rel(losses, resumed) <= 1e-5, (resumed, losses)
    assert f"resharded checkpoint {ckpt}/iter_0000002 from TP=1 PP=2 VPP=1 DP=2 EP=2" in out


EP2TP2SP = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
"""Expert TP is 1: each TP rank holds other experts (expert DP 2), so TP rank 1 writes optimizer state too."""
VARIANTS = {
    "zero1": [],
    "plain": [],  # without --use-distributed-optimizer
    "zero2": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
    "zero3": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
    "fp8_param_gather": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"],
}


def _ep2_tp2_run(corpus: str, variant: str) -> list[str]:
    flags = [*MOE_MODEL, *RUN, "--data-path", corpus, "--train-iters", "3", *EP2TP2SP, *VARIANTS[variant]]
    if variant == "plain":
        flags.remove("--use-distributed-optimizer")
    return flags


def _resumes_at_ep2_tp2(pool, corpus: str, root, variant: str) -> str:
    """Save at iteration 2 of 3, resume there (saving at 3 elsewhere): the same last loss and the same
    bytes at iteration 3, optimizer state included. Returns the first run's checkpoint directory."""
    flags, ckpt, again = _ep2_tp2_run(corpus, variant), str(root / variant), str(root / f"{variant}-again")
    straight, out = _losses(pool, *flags, "--save", ckpt, "--save-interval", "2")
    resumed, _ = _losses(pool, *flags, "--load", ckpt, "--ckpt-step", "2", "--save", again)
    assert resumed == straight[2:]
    assert ("routed-expert stacks, one scale per expert" in out) == (variant == "fp8_param_gather")
    assert _manifest(again, 3)["files"] == _manifest(ckpt, 3)["files"]
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "zero2", "zero3", "fp8_param_gather"])
def test_ep2_tp2_checkpoints_resume_bit_for_bit_with_every_optimizer(ranks, data, tmp_path, variant):  # noqa: F811
    """Without the distributed optimizer, under ZeRO-2/3 (Megatron FSDP) and with expert stacks held in
    FP8 (``--fp8-param-gather``) the same: TP rank 1's experts' state is written and found."""
    _resumes_at_ep2_tp2(ranks(4), data, tmp_path, variant)


@pytest.mark.slow
def test_an_ep2_tp2_checkpoint_gives_the_same_optimizer_state_at_other_splits(ranks, data, tmp_path):  # noqa: F811
    """Loaded at EP2 x DP2 (TP 1) and at EP1 x DP4, then saved at once: every optimizer tensor, the
    experts' that TP rank 1 wrote included, has the bytes the EP2 x TP2 run saved."""
    pool = ranks(4)
    ckpt = _resumes_at_ep2_tp2(pool, data, tmp_path, "zero1")
    saved = open_checkpoint(ckpt, 2)
    names = saved.tensor_names("optimizer")
    assert any(".local_experts." in name for name in names)
    base = [*MOE_MODEL, *RUN, "--data-path", data, "--train-iters", "2", "--lr-decay-iters", "3"]
    base += ["--load", ckpt, "--ckpt-step", "2"]
    for split, name in ((["--expert-model-parallel-size", "2"], "ep2dp2"), ([], "ep1dp4")):
        again = str(tmp_path / name)
        pool.run(_pretrain, [*base, *split, "--save", again], timeout=180)  # no step: the loaded state saved
        loaded = open_checkpoint(again, 2)
        assert sorted(loaded.tensor_names("optimizer")) == sorted(names)
        for key in names:
            assert torch.equal(loaded.full_tensor(key), saved.full_tensor(key)), (name, key)

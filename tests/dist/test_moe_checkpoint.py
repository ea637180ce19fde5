"""MoE checkpoints reshard expert parallelism: a run saved at EP2 x PP2 resumes at EP1 x PP1 and at EP4
with the same next losses, directly (``--load``) and through the converter; ``--async-save`` writes
the same bytes.

Experts are stored whole under their global names (``...local_experts.{e}...``); a rank reads the
experts it holds from whichever file has them, and the converter moves them between expert files.
The runs are real ``pretrain()`` calls on 4 gloo ranks: slow (``pytest -m slow tests/dist/test_moe_checkpoint.py``).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.test_checkpointing import RUN, _losses, _rel, data  # noqa: F401 (data is a fixture)

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

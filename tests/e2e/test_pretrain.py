"""pretrain_gpt.py end to end, through the real torchrun entry point, with W&B offline runs read back."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.support.torchrun_jobs import Job, broken_lines, run_captured, torchrun_command
from training.reporting.wandb_logging import read_offline_history

ROOT = Path(__file__).resolve().parents[2]
# A small GPT that trains in well under a second per iteration on two cores.
SMALL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "0",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One default corpus and tokenizer for the module, built by the first run."""
    return str(tmp_path_factory.mktemp("trident-cache"))


def _env(cache: str) -> dict[str, str]:
    return {
        **os.environ,
        "TRIDENT_CACHE": cache,
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }


def torchrun(nproc: int, args: list[str], cache: str, timeout: float = 270, check: bool = True):
    env = _env(cache)
    cmd = torchrun_command(nproc, args)
    done = run_captured(cmd, env=env, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return done


def wandb_losses(save_dir: Path) -> dict[int, float]:
    """Iteration -> loss from every offline W&B run under ``save_dir``."""
    losses = {}
    for run_dir in sorted(glob.glob(str(save_dir / "wandb" / "offline-run-*"))):
        for row in read_offline_history(run_dir)["history"]:
            if "lm loss" in row:
                losses[row["_step"]] = row["lm loss"]
    return losses


def wandb_batch_sizes(save_dir: Path) -> list[int]:
    """W&B's ``batch-size`` of every iteration, in order, over the runs under ``save_dir``."""
    rows = {}
    for run_dir in sorted(glob.glob(str(save_dir / "wandb" / "offline-run-*"))):
        history = read_offline_history(run_dir)["history"]
        rows |= {row["_step"]: row["batch-size"] for row in history if "batch-size" in row}
    return [rows[step] for step in sorted(rows)]


def run_ids(save_dir: Path) -> list[str]:
    return [
        read_offline_history(d)["id"] for d in sorted(glob.glob(str(save_dir / "wandb" / "offline-run-*")))
    ]


SPLITS = {
    "TP1PP1DP1": (1, []),
    "PP4": (4, ["--pipeline-model-parallel-size", "4"]),
    "TP2PP2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "PP2DP2": (4, ["--pipeline-model-parallel-size", "2"]),
    "PP2VPP2": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]),
}


def test_splits_train_the_same_loss_curve(cache, tmp_path):
    """Same seed and global batch, fp32, dropout off: TP2 x PP2 and PP2 x VPP2 give TP1's losses."""
    _check_splits(cache, tmp_path, ["TP2PP2", "PP2VPP2"])


@pytest.mark.slow
def test_more_splits_train_the_same_loss_curve(cache, tmp_path):
    """The rest of the sweep, 4 ranks each: PP4, and PP2 x DP2."""
    _check_splits(cache, tmp_path, ["PP4", "PP2DP2"])


def _check_splits(cache, tmp_path, names: list[str]) -> None:
    """Same seed and global batch, fp32, dropout off: the same losses whatever the TP x PP x DP split."""
    curves = {}
    for name in ["TP1PP1DP1", *names]:
        nproc, flags = SPLITS[name]
        out = tmp_path / name
        torchrun(
            nproc,
            SMALL
            + flags
            + [
                "--train-iters",
                "10",
                "--hidden-dropout",
                "0",
                "--attention-dropout",
                "0",
                "--wandb-project",
                "split",
                "--wandb-save-dir",
                str(out),
            ],
            cache,
        )
        curves[name] = wandb_losses(out)
    reference = curves.pop("TP1PP1DP1")
    assert sorted(reference) == list(range(1, 11))
    assert reference[10] < reference[1]  # it learns
    for name, curve in curves.items():
        assert sorted(curve) == sorted(reference), name
        first = abs(curve[1] - reference[1]) / abs(reference[1])
        worst = max(abs(curve[i] - reference[i]) / abs(reference[i]) for i in reference)
        print(
            f"{name}: first-iteration relative difference {first:.2e}, worst over 10 iterations {worst:.2e}"
        )
        assert first <= 1e-6, f"{name}: first-iteration loss differs by {first:.2e}"
        assert worst <= 1e-4, f"{name}: losses differ by up to {worst:.2e}"


def _curve(cache, out: Path, nproc: int, flags: list[str]) -> dict[int, float]:
    off = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    torchrun(
        nproc,
        SMALL + flags + off + ["--wandb-project", "zb", "--wandb-save-dir", str(out)],
        cache,
        timeout=900,
    )
    return wandb_losses(out)


@pytest.mark.slow
def test_zero_bubble_h1_trains_the_same_loss_curve_as_1f1b_on_tp2_pp2_dp2(cache, tmp_path):
    """8 ranks, TP2 x PP2 x DP2, overlapped gradient reduction: ZB-H1's losses equal 1F1B's."""
    split = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--overlap-grad-reduce",
    ]
    split += ["--train-iters", "10", "--ddp-bucket-size", "20000"]
    one_f_one_b = _curve(cache, tmp_path / "1f1b", 8, split)
    zero_bubble = _curve(cache, tmp_path / "zb", 8, split + ["--pipeline-schedule", "zb-h1"])
    assert sorted(one_f_one_b) == list(range(1, 11))
    worst = max(abs(zero_bubble[i] - one_f_one_b[i]) / one_f_one_b[i] for i in one_f_one_b)
    print(f"zb-h1 vs 1f1b on TP2xPP2xDP2: worst relative loss difference over 10 iterations {worst:.2e}")
    assert zero_bubble == one_f_one_b  # the same gradients, bit for bit: the same losses


@pytest.mark.slow
def test_zbv_trains_the_same_loss_curve_as_interleaved_1f1b(cache, tmp_path):
    """PP2 x DP2, two chunks per rank: ZBV (the V, the tied embedding one Parameter on rank 0, which
    logs) against interleaved 1F1B (the loop, two copies of the embedding kept in sync)."""
    split = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    split += ["--train-iters", "10"]
    interleaved = _curve(cache, tmp_path / "interleaved", 4, split)
    zbv = _curve(cache, tmp_path / "zbv", 4, split + ["--pipeline-schedule", "zbv"])
    assert sorted(zbv) == list(range(1, 11))
    worst = max(abs(zbv[i] - interleaved[i]) / interleaved[i] for i in interleaved)
    print(
        f"zbv vs interleaved 1f1b on PP2xDP2: worst relative loss difference over 10 iterations {worst:.2e}"
    )
    assert zbv[1] == interleaved[1] and worst <= 1e-6  # tied halves summed in another order later on


@pytest.mark.timeout(800)  # three 4-rank runs, each bounded by its own 240 s that shows its output
def test_resume_is_exact_and_keeps_the_wandb_run(cache, tmp_path):
    """PP=2 x DP=2, dropout on: 20 iterations straight == 10, then resume, then 10 more (bit for bit).

    The global batch ramps up (Megatron's --rampup-batch-size 2 2 48: 1, 2, 3, then 4 microbatches
    of 1 per DP rank), and the run stops in the middle of the ramp. The interrupted and resumed runs
    save with --async-save (iterations 4 and 8 written while training goes on, 10 at the exit, 12 to
    20 after the resume): their checkpoints hold the same bytes as the straight run's synchronous
    ones. The resume is the command the interrupted run printed, run as printed (torchrun included),
    and no line of the three runs' output holds pieces of two ranks' lines."""
    flags = [*SMALL[: SMALL.index("--micro-batch-size")], *SMALL[SMALL.index("--global-batch-size") :]]
    flags += ["--micro-batch-size", "1", "--rampup-batch-size", "2", "2", "48"]
    flags += ["--pipeline-model-parallel-size", "2", "--train-iters", "20", "--wandb-project", "resume"]
    flags += ["--save-interval", "4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight_run = torchrun(
        4, flags + ["--save", str(straight / "ckpt"), "--wandb-save-dir", str(straight)], cache, timeout=240
    )
    first = torchrun(
        4,
        flags
        + ["--save", str(split / "ckpt"), "--exit-interval", "10", "--wandb-save-dir", str(split)]
        + ["--async-save"],
        cache,
        timeout=240,
    )
    assert (split / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert f"writing checkpoint {split}/ckpt/iter_0000008 in the background" in first.stdout, first.stdout
    resume = re.findall(r"^  resume: (.*)$", first.stdout, re.MULTILINE)
    assert len(resume) == 1 and "torch.distributed.run --standalone --nproc-per-node 4 " in resume[0], resume
    second = run_captured(resume[0], env=_env(cache), timeout=240, shell=True)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"loaded checkpoint {split / 'ckpt'} at iteration 10" in second.stdout, second.stdout[-2000:]
    assert re.search(r"^ \[.*\] iteration +11/ +20 \|", second.stdout, re.MULTILINE), second.stdout[-2000:]
    for done in (straight_run, first, second):
        assert broken_lines(done.stdout) == broken_lines(done.stderr) == [], (done.stdout, done.stderr)
    expected, resumed = wandb_losses(straight), wandb_losses(split)
    assert sorted(expected) == list(range(1, 21))
    assert resumed == expected  # exact float equality, iteration by iteration
    batches = [2] * 8 + [4] * 4 + [6] * 3 + [8] * 5  # the ramp: from 16, 32 and 50 consumed samples on
    logged = re.findall(
        r"\] iteration +\d+/ +20 \|.*\| global batch size: +(\d+) \|", first.stdout + second.stdout
    )
    assert [int(b) for b in logged] == batches and wandb_batch_sizes(split) == batches, logged
    for iteration in (4, 8, 20):  # written in the background == written while training waited
        files = [
            json.loads((run / "ckpt" / f"iter_{iteration:07d}" / "manifest.json").read_text())["files"]
            for run in (straight, split)
        ]
        assert files[0] == files[1], iteration
    ids = run_ids(split)
    assert len(ids) == 2 and ids[0] == ids[1], ids  # the resumed run logs under the same W&B id
    manifest = json.loads((split / "ckpt" / "iter_0000020" / "manifest.json").read_text())
    assert manifest["consumed_samples"] == sum(batches) == 90
    assert first.returncode == 0


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(cache, tmp_path):
    env = {**os.environ, "TRIDENT_CACHE": cache, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    flags = [
        *SMALL,
        "--pipeline-model-parallel-size",
        "2",
        "--train-iters",
        "100000",
        "--exit-signal-handler",
    ]
    job = Job(2, [*flags, "--save", str(tmp_path / "ckpt"), "--save-interval", "100000"], env=env)
    try:
        job.wait_for(" iteration        3/", timeout=240)  # training runs
        for pid in job.workers().values():  # as a scheduler preempting the job does to every training process
            os.kill(pid, signal.SIGTERM)
        output = job.finish(timeout=120)
    finally:
        job.kill()
    assert job.proc.returncode == 0, output[-3000:]
    assert "SIGTERM received: saving a checkpoint" in output, output[-3000:]
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 3
    assert (tmp_path / "ckpt" / f"iter_{saved:07d}" / "manifest.json").is_file()
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_bf16_tracks_fp32(cache, tmp_path):
    """bf16 with fp32 main parameters stays within a few percent of fp32 over 50 iterations."""
    curves = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        out = tmp_path / name
        torchrun(
            2,
            SMALL
            + [
                "--pipeline-model-parallel-size",
                "2",
                "--train-iters",
                "50",
                "--wandb-project",
                "bf16",
                "--wandb-save-dir",
                str(out),
                *extra,
            ],
            cache,
            timeout=900,
        )
        curves[name] = wandb_losses(out)
    for i in (10, 25, 50):
        print(f"iteration {i}: fp32 {curves['fp32'][i]:.4f} bf16 {curves['bf16'][i]:.4f}")
        assert abs(curves["bf16"][i] - curves["fp32"][i]) / curves["fp32"][i] < 0.03, (i, curves)
    assert curves["bf16"][50] < curves["bf16"][1]


def _blow_up(cache, flags: tuple[str, ...] = ()) -> str:
    """Train with an absurd learning rate (the weights blow up after one step) until 3 consecutive
    skipped steps stop the run; its output."""
    done = torchrun(
        1,
        SMALL
        + list(flags)
        + [
            "--train-iters",
            "30",
            "--lr",
            "1e30",
            "--lr-warmup-iters",
            "0",
            "--max-consecutive-skipped-iterations",
            "3",
        ],
        cache,
        check=False,
    )
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_nan_steps_are_counted_skipped_and_stop_the_run(cache, tmp_path):
    """An absurd learning rate blows the weights up after one step: later steps are NaN, skipped, then fatal."""
    out = _blow_up(cache)
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in out, out[-3000:]
    assert "number of skipped iterations:   2 | number of nan iterations:   2 |" in out
    assert (
        "RuntimeError: 3 consecutive iterations had a NaN/inf loss or gradient and were skipped (iteration 4); "
        "stopping. Lower --lr or check the data; --max-consecutive-skipped-iterations sets the limit"
    ) in out
    assert " iteration        4/" not in out  # no step after the third skip is logged


def test_an_fp16_nan_loss_backs_the_loss_scale_off(cache, tmp_path):
    """fp16: a NaN loss still reaches the optimizer step, whose overflow check backs the scale off
    (Megatron's behaviour); the iteration is a NaN iteration and counts towards the limit."""
    out = _blow_up(cache, ("--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1"))
    lines = [line for line in out.splitlines() if " iteration " in line and "loss scale:" in line]
    scales = [float(line.split("loss scale:")[1].split("|")[0]) for line in lines]
    assert scales == [4096.0, 2048.0, 1024.0], out[-3000:]
    assert "number of skipped iterations:   2 | number of nan iterations:   2 |" in out
    assert "RuntimeError: 3 consecutive iterations had a NaN/inf loss or gradient" in out


# pretrain() in-process: it tears down the groups it set up (gloo aborts a process whose groups outlive
# the interpreter: "terminate called without an active exception"), and keeps a world the caller started.
IN_PROCESS = """
import sys
import torch.distributed as dist
import pretrain_gpt
from core import parallel_state as ps
from training.faults import end_process
from training.training import pretrain

flags = sys.argv[1:]
providers = (pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
pretrain(*providers, argv=flags, tokenizer_provider=pretrain_gpt.tokenizer_provider)
print("after own world:", dist.is_initialized(), ps.model_parallel_is_initialized())
ps.initialize_distributed()
pretrain(*providers, argv=flags, tokenizer_provider=pretrain_gpt.tokenizer_provider)
print("after caller's world:", dist.is_initialized(), ps.model_parallel_is_initialized())
ps.destroy_distributed()
end_process(0)  # as pretrain_gpt.py ends: without finalization, where gloo's threads can abort
"""


def test_pretrain_ends_the_process_groups_it_started(cache, tmp_path):
    env = {**os.environ, "TRIDENT_CACHE": cache, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    done = run_captured(
        [sys.executable, "-c", IN_PROCESS, *SMALL, "--train-iters", "3"], env=env, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after own world: False False" in done.stdout
    assert "after caller's world: True False" in done.stdout

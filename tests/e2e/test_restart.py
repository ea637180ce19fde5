"""A run that comes back by itself: torchrun --max-restarts after a killed worker, and a smaller second start.

Faults come from ``TRIDENT_FAULT`` (``training.faults.injection``): the worker kills itself at a
chosen point, so the test does not race the training loop.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.e2e.test_pretrain import SMALL
from tests.support.torchrun_jobs import run_captured, torchrun_command

ROOT = Path(__file__).resolve().parents[2]
PP2 = [*SMALL, "--pipeline-model-parallel-size", "2", "--train-iters", "12", "--save-interval", "4"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trident-cache"))


def _run(cache: str, nproc: int, flags: list[str], *, launcher=None, fault: str = "", timeout: float = 240):
    env = {**os.environ, "TRIDENT_CACHE": cache, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["TRIDENT_FAULT"] = fault
    done = run_captured(torchrun_command(nproc, flags, launcher=launcher), env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _losses(output: str) -> dict[int, float]:
    """Iteration -> the logged lm loss (the last time it was logged: a restart repeats some)."""
    found = re.findall(r"\] iteration +(\d+)/ +\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", output)
    return {int(i): float(loss) for i, loss in found}


def _files(ckpt: Path, iteration: int) -> dict:
    return json.loads((ckpt / f"iter_{iteration:07d}" / "manifest.json").read_text())["files"]


@pytest.mark.timeout(600)
def test_a_killed_worker_comes_back_by_itself_and_ends_as_the_uninterrupted_run(cache, tmp_path):
    """PP2 x DP2, dropout on: rank 3 is SIGKILLed at iteration 7; torchrun --max-restarts 1 starts a
    second attempt with the same command line (no --load): it resumes from --save's iteration 4 and
    the checkpoint at iteration 12 holds the same bytes as an uninterrupted run's."""
    straight = _run(cache, 4, [*PP2, "--save", str(tmp_path / "straight")])
    restarted = _run(
        cache,
        4,
        [*PP2, "--save", str(tmp_path / "ckpt")],
        launcher=["--standalone", "--max-restarts", "1"],
        fault="kill@forward:7:rank=3",
    )
    output = restarted.stdout
    assert "torchrun restart 1: resuming from the latest checkpoint in" in output, output[-3000:]
    assert f"loaded checkpoint {tmp_path / 'ckpt'} at iteration 4" in output, output[-3000:]
    timing = re.search(
        r"^time to resume \(torchrun restart 1\): ([0-9.]+) s from the last heartbeat before the fault .*$",
        output,
        re.MULTILINE,
    )
    assert timing and 0 < float(timing.group(1)) < 240, output[-3000:]
    print(timing.group(0))
    assert _losses(output) == _losses(straight.stdout)
    assert _files(tmp_path / "ckpt", 12) == _files(tmp_path / "straight", 12)  # weights, optimizer, RNG


@pytest.mark.slow  # three 4- and 2-rank runs, about 80 s: the CI suite keeps the killed-worker test
@pytest.mark.timeout(600)
def test_a_smaller_second_start_goes_on_at_the_data_parallel_size_it_finds(cache, tmp_path):
    """Four ranks (PP2 x DP2) stop at iteration 6; two ranks (PP2 x DP1) go on from the checkpoint:
    the global batch stays 8 samples (two microbatches become four), no sample is skipped or
    repeated, and the losses are the uninterrupted four-rank run's (to fp32 summation order)."""
    flags = [*PP2, *NO_DROPOUT]
    straight = _losses(_run(cache, 4, flags).stdout)
    _run(cache, 4, [*flags, "--save", str(tmp_path / "ckpt"), "--exit-interval", "6"])
    second = _run(cache, 2, [*flags, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")])
    assert "TP=1 PP=2 VPP=1 CP=1 DP=1, 4 microbatches of 2 x 32 tokens" in second.stdout, second.stdout
    resumed = _losses(second.stdout)
    assert sorted(resumed) == list(range(7, 13))
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5), iteration
    manifest = json.loads((tmp_path / "ckpt" / "iter_0000012" / "manifest.json").read_text())
    assert manifest["consumed_samples"] == 12 * 8


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_quick_fault_matrix_passes_every_cell():
    """tools/fault_matrix.py --quick: each fault kind at the forward point of rank 3, with and
    without torchrun --max-restarts (8 cells), and the slow and NaN ones the run goes on through (2)."""
    from tools.fault_matrix import main

    summary = main(["--quick"])
    assert summary["passed"] == summary["cells"] == 10, summary

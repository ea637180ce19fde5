"""A run that comes back by itself: torchrun --max-restarts after a killed worker, a smaller second start,
a SIGTERM to ``trident-run`` that loses nothing, and an elastic restart on the node that is left.

Faults come from ``TRIDENT_FAULT`` (``training.faults.injection``): the worker kills itself (or hangs) at
a chosen point, so the test does not race the training loop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_pretrain import SMALL
from tests.support.torchrun_jobs import TRIDENT_RUN, Job, free_port, run_captured, torchrun_command
from training.errors import EXIT_SIGNALLED

ROOT = Path(__file__).resolve().parents[2]
PP2 = [*SMALL, "--pipeline-model-parallel-size", "2", "--train-iters", "12", "--save-interval", "4"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trident-cache"))


def _env(cache: str, fault: str = "") -> dict[str, str]:
    env = {**os.environ, "TRIDENT_CACHE": cache, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return {**env, "TRIDENT_FAULT": fault}


def _run(cache: str, nproc: int, flags: list[str], *, launcher=None, fault: str = "", timeout: float = 240):
    command = torchrun_command(nproc, flags, launcher=launcher)
    done = run_captured(command, env=_env(cache, fault), timeout=timeout)
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


def _tracker(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


@pytest.mark.slow  # three 2-rank runs, one stopped by SIGTERM: about 60 s alone
@pytest.mark.timeout(900)
def test_sigterm_to_trident_run_saves_every_rank_at_one_iteration_and_loses_nothing(cache, tmp_path):
    """PP2, dropout on, --exit-signal-handler: SIGTERM to the launcher alone (as a scheduler signals the
    job step) after iteration 3. torch's agent forwards it to each worker's process group; every rank
    saves at the same iteration and exits 0, and the launcher exits 143 (128 + SIGTERM). Resumed with
    --load, the run ends with the uninterrupted run's losses and checkpoint bytes: no iteration lost."""
    straight = _run(cache, 2, [*PP2, "--save", str(tmp_path / "straight")])
    ckpt = tmp_path / "ckpt"
    flags = [*PP2, "--save", str(ckpt), "--exit-signal-handler"]
    job = Job(2, flags, env=_env(cache), launcher=["--standalone"], module=TRIDENT_RUN)
    try:
        job.wait_for(" iteration        3/", timeout=300)
        os.kill(job.proc.pid, signal.SIGTERM)
        output = job.finish(timeout=240)
    finally:
        job.kill()
    assert job.proc.returncode == EXIT_SIGNALLED + signal.SIGTERM == 143, output[-3000:]
    assert _processes_saving_to(ckpt) == [], output[-3000:]  # workers and their data workers are gone
    saved = _tracker(ckpt)
    assert 3 <= saved < 12, output[-3000:]  # the signal came mid-run
    assert output.count("SIGTERM received: saving a checkpoint") == 1, output[-3000:]
    assert f"SIGTERM received: saving a checkpoint at iteration {saved} and exiting" in output
    said = [line for line in output.splitlines() if line.startswith("trident-run: ")]
    stopped_line = (
        "trident-run: SIGTERM: every worker stopped cleanly (exit 0; with --exit-signal-handler after "
        "saving); exit 143"
    )
    assert said == [stopped_line], output[-3000:]
    assert sorted(_files(ckpt, saved)) == sorted(_files(tmp_path / "straight", 12))  # every rank's files
    stopped = _losses(output)
    assert sorted(stopped) == list(range(1, saved + 1))
    resumed = _run(cache, 2, [*flags, "--load", str(ckpt)])
    assert f"loaded checkpoint {ckpt} at iteration {saved}" in resumed.stdout, resumed.stdout[-3000:]
    assert {**stopped, **_losses(resumed.stdout)} == _losses(straight.stdout)  # bit for bit
    assert _files(ckpt, 12) == _files(tmp_path / "straight", 12)  # weights, optimizer, RNG


@pytest.mark.slow  # one 2-rank run, a restart's rendezvous stopped by SIGTERM: about 40 s alone
@pytest.mark.timeout(600)
def test_sigterm_to_trident_run_between_attempts_exits_143_with_nothing_running(cache, tmp_path):
    """An elastic trident-run (--nnodes 1:2: a rendezvous waits 10 s for a second node): rank 1 raises at
    iteration 6 of the first attempt, after iteration 4's checkpoint. The launcher stops the workers and
    waits in the restart's rendezvous; a SIGTERM there finds no worker running, so the launcher says so
    and exits 143, as after a clean stop: the signal lost nothing, and no second attempt starts."""
    ckpt = tmp_path / "ckpt"
    launcher = [
        "--nnodes", "1:2",
        "--max-restarts", "1",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-conf", "last_call_timeout=10",
    ]  # fmt: skip
    env = _env(cache, fault="exception@forward:6:rank=1:attempt=0")
    job = Job(2, [*PP2, "--save", str(ckpt)], env=env, launcher=launcher, module=TRIDENT_RUN)
    try:
        job.wait_for("failed (exitcode: 1) local_rank", timeout=300)  # the agent saw the failure
        time.sleep(3)  # stopping workers that already ended takes well under this: now in the rendezvous
        os.kill(job.proc.pid, signal.SIGTERM)
        output = job.finish(timeout=120)
    finally:
        job.kill()
    assert job.proc.returncode == EXIT_SIGNALLED + signal.SIGTERM == 143, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("trident-run: ")]
    stopped_line = (
        "trident-run: SIGTERM: no workers were running (in a rendezvous, before a start or a restart); "
        "exit 143"
    )
    assert said == [stopped_line], output[-3000:]
    assert len(re.findall(r"^training \d+ iterations from iteration 0: ", output, re.MULTILINE)) == 1
    assert "from iteration 4" not in output, output[-3000:]  # the second attempt never started
    assert _processes_saving_to(ckpt) == [] and _tracker(ckpt) == 4, output[-3000:]


def _processes_saving_to(ckpt: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"--save {ckpt}"], capture_output=True, text=True, check=False)
    return found.stdout.split()


def _elastic_node(host: bool, port: int) -> list[str]:
    """trident-run's flags for one of up to two nodes on loopback (--nnodes 1:2, c10d rendezvous); a
    rendezvous waits 20 s for more nodes once one has joined (torch's default: 30)."""
    return [
        "--nnodes", "1:2",
        "--max-restarts", "1",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "trident-elastic-test",
        "--rdzv-conf", f"is_host={int(host)},last_call_timeout=20",
    ]  # fmt: skip


@pytest.mark.slow  # two reference runs and two launchers' elastic run: several minutes on two cores
@pytest.mark.timeout(1500)
def test_a_lost_node_leaves_an_elastic_run_at_the_smaller_size_that_changed_dp_at_the_checkpoint(
    cache, tmp_path
):
    """Two trident-run launchers (2 workers each, PP2 x DP2) meet at one c10d rendezvous. From iteration
    5 rank 0 computes 500 times slower (every rank waits for it: seconds an iteration), so the run is
    between iteration 4's checkpoint and iteration 8's when the second launcher's process group is
    SIGKILLed, as a node is lost (its workers get the parent-death SIGTERM; the others lose them). The first launcher restarts its workers at world size 2: PP2 x DP1, four
    microbatches of the same global batch, from iteration 4's checkpoint, to iteration 12. Its losses
    after the resume are a reference's that ran PP2 x DP2 to iteration 4 and PP2 x DP1 from there."""
    flags = [*PP2, *NO_DROPOUT]
    reference = tmp_path / "reference"
    _run(cache, 4, [*flags, "--save", str(reference), "--exit-interval", "4"])
    second = _run(cache, 2, [*flags, "--save", str(reference), "--load", str(reference)])
    expected = _losses(second.stdout)
    assert sorted(expected) == list(range(5, 13))

    ckpt, port = tmp_path / "ckpt", free_port()
    env = _env(cache, fault="slow@forward:5:rank=0:factor=500")  # in the first attempt only
    nodes = [
        Job(2, [*flags, "--save", str(ckpt)], env=env, launcher=_elastic_node(host, port), module=TRIDENT_RUN)
        for host in (True, False)
    ]
    try:
        nodes[0].wait_for_workers(timeout=300)
        nodes[1].wait_for_workers(timeout=300)
        _wait_for_checkpoint(ckpt, 4, nodes, timeout=300)
        os.killpg(nodes[1].proc.pid, signal.SIGKILL)
        output = nodes[0].finish(timeout=900)
    finally:
        for node in nodes:
            node.kill()
    assert nodes[0].proc.returncode == 0, output[-5000:]
    assert "TP=1 PP=2 VPP=1 CP=1 DP=1, 4 microbatches of 2 x 32 tokens" in output, output[-5000:]
    assert f"loaded checkpoint {ckpt} at iteration 4" in output, output[-5000:]
    timing = re.search(r"^time to resume \(torchrun restart 1\): .*$", output, re.MULTILINE)
    assert timing, output[-5000:]
    print(timing.group(0))
    assert {i: loss for i, loss in _losses(output).items() if i > 4} == expected  # bit for bit
    assert _tracker(ckpt) == 12
    manifest = json.loads((ckpt / "iter_0000012" / "manifest.json").read_text())
    assert manifest["consumed_samples"] == 12 * 8
    assert _files(ckpt, 4) == _files(reference, 4)  # the two nodes saved what one node of 4 ranks did


def _wait_for_checkpoint(ckpt: Path, iteration: int, nodes: list[Job], timeout: float) -> None:
    """Until ``ckpt``'s tracker names ``iteration``."""
    deadline = time.monotonic() + timeout
    while not ((ckpt / "latest_checkpointed_iteration.txt").is_file() and _tracker(ckpt) == iteration):
        alive = all(node.proc.poll() is None for node in nodes)
        assert alive and time.monotonic() < deadline, [node.output[-3000:] for node in nodes]
        time.sleep(0.2)

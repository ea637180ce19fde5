"""Trident's launcher (``python -m training.launch``, ``trident-run``; ``training/launch.py``) on real
two-rank jobs with ``--max-restarts 2``: torchrun's behaviour, except for the codes it hands on.

Result validation's verdicts under it (exit 17 after one attempt for a transient fault, 16 and then,
resumed, 17 for a persistent one) are in ``tests/e2e/test_result_validation.py``, which runs its jobs
under this launcher. Here: a clean run exits 0; an ordinary crash is restarted as torchrun does and
ends with 1; a command line the workers cannot read ends with 2 after one attempt, and a world the
parallel sizes do not divide with 3 after one attempt. A SIGTERM to the launcher (143 once every worker
saved) and an elastic restart at a smaller size are in ``tests/e2e/test_restart.py``.
"""

from __future__ import annotations

import re

import pytest

from tests.support.torchrun_jobs import TINY, TRIDENT_RUN, job_env, run, write_tiny_dataset
from training.errors import EXIT_CONFIG

RESTARTS = ["--standalone", "--max-restarts", "2"]


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> list[str]:
    data = write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny")
    return [*TINY, "--data-path", str(data), "--train-iters", "4", "--log-interval", "2"]


def _launched(flags: list[str], **env: str) -> tuple[int, str]:
    return run(2, flags, env=job_env(**env), launcher=RESTARTS, module=TRIDENT_RUN, timeout=240)


def _attempts(output: str) -> int:
    """How many times the workers were started: each start prints its plan once."""
    return len(re.findall(r"^training \d+ iterations from iteration \d+: ", output, re.MULTILINE))


def _said(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("trident-run: ")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_clean_run_under_the_launcher_exits_0(flags):
    code, output = _launched(flags)
    assert code == 0, output[-3000:]
    assert _attempts(output) == 1 and " iteration        4/       4 |" in output, output[-3000:]
    assert _said(output) == [] and "FAILED" not in output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_ordinary_crash_is_restarted_as_torchrun_does_then_exits_1(flags):
    """An exception at iteration 2 in every attempt: two restarts, three attempts, then exit 1."""
    crash = ",".join(f"exception@forward:2:rank=1:attempt={attempt}" for attempt in range(3))
    code, output = _launched(flags, TRIDENT_FAULT=crash)
    assert code == 1, output[-3000:]
    assert _attempts(output) == 3, output[-3000:]
    raised = "RuntimeError: injected fault (TRIDENT_FAULT): exception at forward of iteration 2 on rank 1"
    assert [line for line in output.splitlines() if line.startswith("RuntimeError: ")] == [raised] * 3
    assert _said(output) == [] and re.search(r"exitcode\s*: 1 ", output), output[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_command_line_the_workers_cannot_read_ends_with_2_after_one_attempt(flags):
    code, output = _launched([*flags, "--no-such-flag"])
    assert code == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert errors == ["pretrain_gpt.py: error: unrecognized arguments: --no-such-flag (see --help)"], output[
        -3000:
    ]
    said = _said(output)
    rank = re.fullmatch(r"trident-run: rank (\d) exited with 2: not restarting the workers (.*)", said[0])
    assert rank and rank.group(2) == (
        "(2 of --max-restarts 2 left): the command line cannot be read; the same command fails the same way"
    ), said
    assert said[1:] == [f"trident-run: exit 2: rank {rank.group(1)}'s exit code"], said


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_world_the_parallel_sizes_do_not_divide_ends_with_3_after_one_attempt(flags, tmp_path):
    """A run saved at PP2 x DP2 on four workers, started again on three with --max-restarts 2: one line
    naming the sizes, exit 3, and no restart (the same world and command line would fail the same way)."""
    ckpt = str(tmp_path / "ckpt")
    pp2 = [*flags, "--pipeline-model-parallel-size", "2", "--save", ckpt]
    code, output = run(4, pp2, env=job_env(), launcher=RESTARTS, module=TRIDENT_RUN, timeout=240)
    assert code == 0 and "saved checkpoint " in output, output[-3000:]
    code, output = run(3, [*pp2, "--load", ckpt], env=job_env(), launcher=RESTARTS, module=TRIDENT_RUN)
    assert code == EXIT_CONFIG == 3, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    line = (
        "pretrain_gpt.py: error: world size (3) must be divisible by --tensor-model-parallel-size (1) x "
        "--pipeline-model-parallel-size (2) = 2"
    )
    assert errors == [line], output[-3000:]
    said = _said(output)
    rank = re.fullmatch(r"trident-run: rank (\d) exited with 3: not restarting the workers (.*)", said[0])
    assert rank and rank.group(2) == (
        "(2 of --max-restarts 2 left): the flags do not fit together, the world size or the checkpoint; a "
        "restart keeps all three"
    ), said
    assert said[1:] == [f"trident-run: exit 3: rank {rank.group(1)}'s exit code"], said

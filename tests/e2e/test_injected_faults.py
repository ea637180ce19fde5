"""Faults injected into real jobs (TRIDENT_FAULT, training/faults/injection.py): a slow rank is named
by --log-straggler in the first report (and a switch port that is taken is one line before any step);
a NaN in one iteration's forward or in a gradient is a skipped step, or with
--check-for-nan-in-loss-and-grad a transient fault (result validation's rerun) or, without validation,
one line naming the iteration; an exception inside the schedule (at the data or backward point) names
itself; a checkpoint write that fails keeps the previous checkpoint.

``TRIDENT_FAULT=slow@forward:1:rank=1:factor=4`` makes rank 1's forward computations four times as
long from the first iteration on (training/faults/injection.py): a straggler on a CPU. Two ranks, one
per core of a CI machine: more ranks than cores would make every rank a straggler now and then.
"""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from tests.support.torchrun_jobs import TINY, Job, free_port, job_env, run, write_tiny_dataset


def _flags(tmp_path, port: int) -> list[str]:
    data = write_tiny_dataset(tmp_path / "tiny")
    return [*TINY, "--data-path", str(data), "--train-iters", "8", "--log-interval", "4", "--log-straggler",
            "--straggler-ctrlr-port", str(port)]  # fmt: skip


def test_a_slowed_rank_is_named_slowest_within_one_log_interval(tmp_path):
    port = free_port()
    code, output = run(2, _flags(tmp_path, port), env=job_env(TRIDENT_FAULT="slow@forward:1:rank=1:factor=4"))
    assert code == 0, "\n".join(line for line in output.splitlines() if "rror" in line)[-4000:]
    assert f"straggler detection on; switch: http://127.0.0.1:{port}/" in output
    reports = [line for line in output.splitlines() if line.startswith("stragglers, ")]
    print("\n".join(reports))
    assert [re.search(r"iterations (\d+-\d+)", line).group(1) for line in reports] == ["1-4", "5-8"]
    named = re.search(r"slowest rank (\d) ([\d.]+) s \([\d.]+x\) \| fastest rank (\d) ([\d.]+) s", reports[0])
    assert named is not None, reports[0]
    assert (named.group(1), named.group(3)) == ("1", "0"), reports[0]
    assert float(named.group(2)) >= 1.2 * float(named.group(4)), reports[0]  # over 20% slower


def test_the_switch_turns_reports_on_in_a_running_job(tmp_path):
    """Started off (--disable-straggler-on-startup): no report until an HTTP GET of /on at rank 0's
    switch; every rank then collects from the next log step on (the reports' windows say which)."""
    port = free_port()
    flags = [*_flags(tmp_path, port), "--disable-straggler-on-startup", "--train-iters", "100000"]
    job = Job(2, flags, env=job_env())
    try:
        job.wait_for(f"straggler detection off; switch: http://127.0.0.1:{port}/", timeout=120)
        job.wait_for(" iteration        8/", timeout=120)
        assert "stragglers, " not in job.output
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/on", timeout=10) as reply:
            assert reply.read() == b"straggler detection on\n"
        job.wait_for("stragglers, iterations ", timeout=120)
    finally:
        job.kill()
    first = re.search(r"stragglers, iterations (\d+)-(\d+) ", job.output)
    assert int(first.group(1)) > 8 and int(first.group(1)) % 4 == 1 and int(first.group(2)) % 4 == 0, first[0]


def test_a_switch_port_that_is_taken_is_one_line_before_any_step(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = run(2, _flags(tmp_path, port), env=job_env())
    assert code == 1, output[-3000:]
    error = (
        f"pretrain_gpt.py: error: --straggler-ctrlr-port {port}: cannot listen on 127.0.0.1:{port} "
        "(Address already in use); give a free port"
    )
    assert output.count(error) == 1, output[-3000:]
    assert "iteration        1/" not in output


def test_an_injected_nan_is_a_skipped_step_or_with_the_check_one_line(tmp_path):
    """Rank 0 holds the first of two stages: its NaN activations make the loss and every gradient NaN.
    With the check, result validation (on by default) reruns iteration 2, which the fault does not
    poison again: a transient fault, exit 17; without validation, the check's own line, exit 1."""
    data = write_tiny_dataset(tmp_path / "tiny")
    flags = [*TINY, "--data-path", str(data), "--train-iters", "3", "--pipeline-model-parallel-size", "2"]
    env = job_env(TRIDENT_FAULT="nan@forward:2:rank=0")
    code, output = run(2, flags, env=env)
    assert code == 0, output[-3000:]
    lines = [line for line in output.splitlines() if "number of nan iterations" in line]
    assert [re.search(r"nan iterations: +(\d+)", line).group(1) for line in lines] == ["0", "1", "1"], lines
    assert "lm loss: nan" in lines[1].lower() or "lm loss: NaN" in lines[1], lines[1]
    code, output = run(2, [*flags, "--check-for-nan-in-loss-and-grad"], env=env)
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert code == 1 and len(errors) == 1 and "exitcode  : 17" in output, output[-3000:]
    assert re.fullmatch(
        r"pretrain_gpt.py: error: result validation: iteration 2: NaN or inf loss \(lm loss nan\); the rerun "
        r"gave lm loss [0-9.]+E\+00: a transient fault \(exit 17\)",
        errors[0],
    ), errors[0]
    code, output = run(2, [*flags, "--check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"], env=env)
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert code == 1 and len(errors) == 1, output[-3000:]
    assert errors[0].endswith("at iteration 2 (--check-for-nan-in-loss-and-grad)"), errors[0]


def _pp2_flags(tmp_path, *extra: str) -> list[str]:
    data = write_tiny_dataset(tmp_path / "tiny")
    return [*TINY, "--data-path", str(data), "--pipeline-model-parallel-size", "2", *extra]


@pytest.mark.slow
def test_a_nan_gradient_is_a_skipped_step_or_with_the_check_one_line(tmp_path):
    """Rank 1 (the last stage) gets a NaN gradient at its first forward output in iteration 2: the
    loss stays finite, the gradient norm is NaN, the step is skipped (or, checked, one line)."""
    flags = _pp2_flags(tmp_path, "--train-iters", "3")
    env = job_env(TRIDENT_FAULT="nan@backward:2:rank=1")
    code, output = run(2, flags, env=env)
    assert code == 0, output[-3000:]
    lines = [line for line in output.splitlines() if "number of skipped iterations" in line]
    norms = [re.search(r"grad norm: (\S+)", line).group(1) for line in lines]
    skipped = [re.search(r"skipped iterations: +(\d+)", line).group(1) for line in lines]
    assert norms[1] == "nan" and "nan" not in norms[0] + norms[2] and skipped == ["0", "1", "1"], lines
    assert "lm loss: nan" not in lines[1].lower(), lines[1]
    code, output = run(2, [*flags, "--check-for-nan-in-loss-and-grad"], env=env)
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert code == 1 and len(errors) == 1 and "exitcode  : 17" in output, output[-3000:]
    print(errors[0])
    code, output = run(2, [*flags, "--check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"], env=env)
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert code == 1 and errors == [
        "pretrain_gpt.py: error: gradient norm is nan at iteration 2 (--check-for-nan-in-loss-and-grad)"
    ], output[-3000:]


@pytest.mark.parametrize("point,rank", [("data", 1), pytest.param("backward", 0, marks=pytest.mark.slow)])
def test_an_exception_inside_the_schedule_names_its_point_rank_and_iteration(tmp_path, point, rank):
    code, output = run(
        2,
        _pp2_flags(tmp_path, "--train-iters", "3"),
        env=job_env(TRIDENT_FAULT=f"exception@{point}:2:rank={rank}"),
    )
    message = (
        f"RuntimeError: injected fault (TRIDENT_FAULT): exception at {point} of iteration 2 on rank {rank}"
    )
    assert code == 1 and output.count(message) == 1, output[-3000:]
    assert " iteration        1/" in output and " iteration        2/" not in output


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """Rank 1's write of iteration 4 fails after its first file: every rank stops with one line, the
    tracker still names iteration 2, the partial directory has no manifest, and a resume starts at 2."""
    save = tmp_path / "ckpt"
    flags = _pp2_flags(tmp_path, "--train-iters", "6", "--save", str(save), "--save-interval", "2")
    flags += ["--async-save"] if mode == "async" else []
    code, output = run(2, flags, env=job_env(TRIDENT_FAULT="write@save:4:rank=1"))
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    expected = (
        f"saving checkpoint {save}/iter_0000004 failed: OSError: [Errno 28] injected fault (TRIDENT_FAULT): "
        "write at save of iteration 4 on rank 1, after writing model_tp0_pp1.safetensors"
    )  # printed by whichever rank reports first: rank 1 itself, or another naming it
    reporters = ("pretrain_gpt.py: error: ", "pretrain_gpt.py: error: rank 1: ")
    assert code == 1 and errors in [[who + expected] for who in reporters], output[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000002" / "manifest.json").is_file()
    assert not (save / "iter_0000004" / "manifest.json").exists()
    code, output = run(2, [*flags, "--load", str(save)], env=job_env())
    assert code == 0 and f"loaded checkpoint {save} at iteration 2" in output, output[-3000:]
    assert " iteration        6/" in output

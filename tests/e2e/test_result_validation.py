"""Result validation on two real ranks (PP=2: the loss lives on rank 1 only), under Trident's launcher
(``python -m training.launch``, ``trident-run``) with ``--max-restarts 2``: it exits with the verdict's
code and restarts after neither (torchrun would restart, then exit 1).

``--error-injection-rate 4`` with ``--check-for-nan-in-loss-and-grad`` rejects iteration 5 (the fourth
validated step: a launch's first step is not validated), found at log step 8; the run goes back to
before it and reruns it. Megatron's verdicts, exit codes and lines:

* ``transient_error``: the rerun differs; the checkpoint of iteration 4 is saved, exit 17;
* ``persistent_error`` and ``correct_result``: the rerun reproduces it; the checkpoint of iteration 4
  is saved with the step's record, exit 16; resumed from it (a second launch, as a scheduler would
  make on other devices), the step is run a third time: a persistent fault of the first devices, or
  a correct result; exit 17.

Every checkpoint a verdict saves holds the bytes of an uninterrupted run's at that iteration (the
update of iteration 5 and of the steps after it was held off on the device). A clean run validated,
or reporting reproducibility, ends with the unvalidated run's checkpoint, bit for bit; so does a run
whose transient fault (a real NaN) torchrun's restart resumes from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.torchrun_jobs import TINY, TRIDENT_RUN, Job, job_env, run, write_tiny_dataset

CHECKS = ["--check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--check-for-large-grads"]
HEAD = "pretrain_gpt.py: error: result validation: iteration 5: NaN or inf loss (lm loss {loss})"
RESTARTS = ["--standalone", "--max-restarts", "2"]
WHY_NOT = {  # the launcher's reason not to restart, by exit code
    16: "result validation reproduced a fatal result on these devices; resume from the checkpoint on other "
    "devices to tell a persistent fault from a correct result, which a restart here cannot",
    17: "a result failed validation; restarting cannot help",
}


def _launched(flags: list[str]) -> tuple[int, str]:
    """A job under Trident's launcher with two restarts to spare: (its exit code, its output)."""
    return run(2, flags, env=job_env(), launcher=RESTARTS, module=TRIDENT_RUN)


def _attempts(output: str) -> int:
    """How many times the workers were started: each start prints its plan once."""
    return len(re.findall(r"^training \d+ iterations from iteration \d+: ", output, re.MULTILINE))


def _not_restarted(output: str, code: int) -> None:
    """One attempt, and the launcher's lines saying why it did not restart and whose code it exits with."""
    assert _attempts(output) == 1, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("trident-run: ")]
    assert len(said) == 2, output[-3000:]
    stop = re.fullmatch(
        rf"trident-run: rank (\d) exited with {code}: not restarting the workers (.*)", said[0]
    )
    assert stop and stop.group(2) == f"(2 of --max-restarts 2 left): {WHY_NOT[code]}", said
    assert said[1] == f"trident-run: exit {code}: rank {stop.group(1)}'s exit code", said


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> list[str]:
    data = write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny")
    return [*TINY, "--data-path", str(data), "--pipeline-model-parallel-size", "2", "--train-iters", "8",
            "--log-interval", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def unvalidated(flags, tmp_path_factory) -> tuple[Path, str]:
    """The run without validation, saving at iterations 4 and 8; its output."""
    ckpt = tmp_path_factory.mktemp("unvalidated")
    code, output = run(2, [*flags, "--rerun-mode", "disabled", "--save", str(ckpt), "--save-interval", "4"],
                       env=job_env())  # fmt: skip
    assert code == 0, output[-3000:]
    return ckpt, output


def _files(ckpt: Path, iteration: int) -> dict:
    """Every file of the checkpoint, with its checksum: weights, optimizer state, RNG states."""
    return json.loads((ckpt / f"iter_{iteration:07d}" / "manifest.json").read_text())["files"]


def _ended(output: str, exit_code: int) -> str:
    """The one error line, after checking that a worker exited with ``exit_code`` and the other with it
    or torchrun's SIGTERM."""
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", output))
    assert str(exit_code) in codes and codes <= {str(exit_code), "-15"}, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def _loss_at(output: str, iteration: int) -> str:
    match = re.search(rf"result validation: iteration {iteration}: \S.*?\(lm loss ([0-9.E+-]+)\)", output)
    assert match, output[-3000:]
    return match.group(1)


def test_an_injected_transient_error_saves_the_iteration_before_and_exits_17(flags, unvalidated, tmp_path):
    ckpt, tracker = tmp_path / "ckpt", tmp_path / "rejected.txt"
    injected = ["--error-injection-rate", "4", "--error-injection-type", "transient_error"]
    code, output = _launched([*flags, *CHECKS, *injected, "--save", str(ckpt),
                              "--result-rejected-tracker-filename", str(tracker)])  # fmt: skip
    assert code == 17, output[-3000:]
    _not_restarted(output, 17)
    loss = _loss_at(output, 5)
    assert (
        f"result validation: iteration 5: NaN or inf loss (lm loss {loss}) (injected: transient_error); "
        "rerunning it on the same inputs and RNG"
    ) in output
    assert _ended(output, 17) == (
        f"{HEAD.format(loss=loss)}; the rerun counts as different (transient_error injected): a transient "
        f"fault; checkpoint of iteration 4 saved in {ckpt} (exit 17)"
    )
    assert _files(ckpt, 4) == _files(unvalidated[0], 4)
    statuses = re.findall(r" iteration=(\d+) status=(\w+) check=(\w+) ", tracker.read_text())
    assert statuses == [("5", "initial_run", "loss"), ("5", "first_rerun_not_reproducible", "loss")]


PERSISTENT = (
    "the rerun counts as different (persistent_error injected) here: a persistent fault of the first run's "
    "devices"
)
CORRECT = (
    "the rerun counts as reproducing it (correct_result injected) here: a correct result, which the model or "
    "the data make"
)


@pytest.mark.parametrize(
    ("kind", "verdict"),
    [
        pytest.param("persistent_error", PERSISTENT, id="persistent"),
        pytest.param("correct_result", CORRECT, id="correct", marks=pytest.mark.slow),
    ],
)
def test_a_reproduced_result_exits_16_and_its_resumed_rerun_tells_a_persistent_fault_from_a_correct_result(
    flags, unvalidated, tmp_path, kind, verdict
):
    ckpt = tmp_path / "ckpt"
    command = [
        *flags,
        *CHECKS,
        "--error-injection-rate",
        "4",
        "--error-injection-type",
        kind,
        "--save",
        str(ckpt),
    ]
    code, output = _launched(command)
    assert code == 16, output[-3000:]
    _not_restarted(output, 16)
    loss = _loss_at(output, 5)
    assert _ended(output, 16) == (
        f"{HEAD.format(loss=loss)}; the rerun counts as reproducing it ({kind} injected) on the same devices; "
        f"checkpoint of iteration 4 saved in {ckpt}: resume from it on other devices to tell a persistent fault "
        "from a correct result (exit 16)"
    )
    assert _files(ckpt, 4) == _files(unvalidated[0], 4)
    code, output = _launched([*command, "--load", str(ckpt)])  # the scheduler's resume, elsewhere
    assert code == 17, output[-3000:]
    _not_restarted(output, 17)
    assert f"loaded checkpoint {ckpt} at iteration 4" in output, output[-3000:]
    assert (
        "result validation: rerunning iteration 5 from the checkpoint, to tell a persistent fault of the "
        "first run's devices from a correct result"
    ) in output
    assert _ended(output, 17) == f"{HEAD.format(loss=loss)} on the first run's devices; {verdict} (exit 17)"


@pytest.mark.slow
def test_a_nan_in_one_forward_under_torchrun_restarts_is_a_transient_fault_and_the_run_trains_on(
    flags, unvalidated, tmp_path
):
    """A real fault: rank 0 (the first stage) computes NaN activations once, in iteration 6. The rerun
    is clean: a transient fault, exit 17 after saving iteration 5; torchrun --max-restarts 1 restarts,
    the run loads iteration 5 and trains on, and ends with the uninterrupted run's checkpoint."""
    ckpt = tmp_path / "ckpt"
    job = Job(2, [*flags, "--check-for-nan-in-loss-and-grad", "--save", str(ckpt)],
              env=job_env(TRIDENT_FAULT="nan@forward:6:rank=0"), launcher=["--standalone", "--max-restarts", "1"])  # fmt: skip
    output = job.finish(240)
    assert job.proc.returncode == 0, output[-3000:]
    assert re.search(
        r"^pretrain_gpt.py: error: result validation: iteration 6: NaN or inf loss \(lm loss nan\); the rerun "
        rf"gave lm loss [0-9.]+E\+00: a transient fault; checkpoint of iteration 5 saved in {ckpt} \(exit 17\)$",
        output,
        re.MULTILINE,
    ), output[-3000:]
    assert f"loaded checkpoint {ckpt} at iteration 5" in output
    assert _files(ckpt, 8) == _files(unvalidated[0], 8)


@pytest.mark.slow
def test_a_clean_run_validated_or_reporting_reproducibility_ends_as_the_unvalidated_run(
    flags, unvalidated, tmp_path
):
    """All three checks on (validate_results), then --rerun-mode report_stats (every step run twice):
    no alarm, and the final checkpoint is the unvalidated run's, bit for bit."""
    for mode in ("validate_results", "report_stats"):
        ckpt = tmp_path / mode
        extra = CHECKS if mode == "validate_results" else []
        code, output = run(2, [*flags, *extra, "--rerun-mode", mode, "--save", str(ckpt)], env=job_env())
        assert code == 0, output[-3000:]
        assert "result validation" not in output
        assert _files(ckpt, 8) == _files(unvalidated[0], 8), mode
    stats = [line for line in output.splitlines() if line.startswith("result reproducibility")]
    identical = "lm loss identical in 4/4, largest relative difference 0.000E+00; grad norm identical in 4/4"
    assert stats == [
        f"result reproducibility (--rerun-mode report_stats), iterations {span}: {identical}, largest "
        "relative difference 0.000E+00"
        for span in ("1-4", "5-8")
    ]


@pytest.mark.slow  # about a minute on two CPU ranks
@pytest.mark.timeout(900)
def test_a_clean_500_iteration_run_raises_no_false_alarm(flags):
    """Every check on over 500 iterations: the spike trackers fill with the first 100 losses and
    gradient norms, then judge 400 more; nothing is rejected."""
    long = [*flags, *CHECKS, "--train-iters", "500", "--log-interval", "100", "--lr-decay-style", "cosine"]
    code, output = run(2, long, env=job_env(), timeout=900)
    assert code == 0, output[-3000:]
    assert " iteration      500/     500 |" in output, output[-3000:]
    assert "result validation" not in output

"""Result validation in process, at world size 1 (training/faults/validation.py).

A validated run makes no host wait between log steps (the checks run on the device, a suspect step's
update is held off there), and its steps, losses and counters are those of a run without validation.
A suspect step that is not fatal is rewound and rerun, and then run once more to stand; what the run
computes is unchanged, bit for bit, whatever the injection said. The multi-rank verdicts and exit
codes are in ``tests/e2e/test_result_validation.py``.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.support.fp8_run import fp8_run
from tests.support.host_waits import HostWaitCounter
from tests.support.pretrain_run import pretrain_gpt_in_process
from training.errors import ConfigError
from training.faults.validation import _check_writable

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --eval-interval 1000 --eval-iters 0 --lr 1e-3 --mock-data --num-workers 0 "
    "--tokenizer-type NullTokenizer --vocab-size 64 --seed 7 --train-iters 9 --log-interval 3"
)
FP16 = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--disable-bias-linear --fp16 --use-distributed-optimizer --overlap-grad-reduce --clip-grad 0.5 "
    "--initial-loss-scale 65536 --hysteresis 1 --loss-scale-window 2"
)
"""fp16 whose loss scale moves every step (overflows back it off, two clean steps grow it): a rerun
must start from the scale its step first had."""
CHECKS = "--check-for-nan-in-loss-and-grad --check-for-spiky-loss --check-for-large-grads"


def _pretrain(flags: str, hook=None):
    return pretrain_gpt_in_process(argv=f"{TINY} {FP16} {flags}".split(), iteration_hook=hook)


def _record(state) -> tuple:
    return (
        state.iteration,
        state.consumed_samples,
        state.skipped_iterations,
        state.nan_iterations,
        state.losses,
    )


@pytest.fixture(scope="module")
def unvalidated():
    return _record(_pretrain("--rerun-mode disabled"))


def test_validation_makes_no_host_wait_between_log_steps_and_changes_nothing(unvalidated):
    with HostWaitCounter() as counter:
        validated = _pretrain(CHECKS, counter.next_iteration)
    waits = {i: counter.count(i) for i in range(2, 10)}
    assert waits == {2: 0, 3: 1, 4: 0, 5: 0, 6: 1, 7: 0, 8: 0, 9: 1}, {i: counter.where(i) for i in waits}
    assert _record(validated) == unvalidated
    assert unvalidated[2] >= 1 and len(unvalidated[4]) == 9  # some steps overflowed and were skipped


@pytest.mark.parametrize("kind", ["transient_error", "persistent_error", "correct_result"])
def test_an_injected_suspect_that_is_not_fatal_is_rerun_and_the_run_goes_on_unchanged(
    kind, unvalidated, capsys
):
    """--check-for-spiky-loss with an injection every 2nd validated step (iterations 3, 5, 7, 9: the
    first step of a launch is not validated, and a rerun step is not counted): each is found at the
    next log step, rerun from its own states, judged, and run again; the losses are the unvalidated
    run's, bit for bit."""
    validated = _pretrain(f"--check-for-spiky-loss --error-injection-rate 2 --error-injection-type {kind}")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("result validation:")]
    assert _record(validated) == unvalidated
    found = [line.split(":")[1].strip() for line in lines]
    assert found == ["iteration 3"] * 2 + ["iteration 5"] * 2 + ["iteration 7"] * 2 + ["iteration 9"] * 2, (
        lines
    )
    loss = f"lm loss {unvalidated[4][2]['lm loss']:.6E}"
    head = f"result validation: iteration 3: spiky loss (>= 10x the largest of the first 100) ({loss})"
    assert lines[0] == f"{head} (injected: {kind}); rerunning it on the same inputs and RNG"
    verdict = (
        "the rerun counts as different (transient_error injected): a transient fault"
        if kind == "transient_error"
        else f"the rerun counts as reproducing it ({kind} injected): a correct result or a persistent fault"
    )
    assert lines[1] == f"{head}; {verdict}; going on (the check is not fatal)"


def test_a_suspect_found_where_the_loop_evaluates_saves_or_stops_is_rerun_first(tmp_path, capsys):
    """Injections at iterations 3, 5, 7 and 9 are found where the loop settles to evaluate (3, 9), to
    save (5) and to stop (--exit-interval 9): each evaluation, checkpoint and the stop happen once, after
    the rerun, and hold what the unvalidated run's do."""
    flags = (
        f"{TINY} --eval-interval 3 --eval-iters 1 --train-iters 10 --log-interval 4 --save-interval 5 "
        "--exit-interval 9"
    )
    plain = pretrain_gpt_in_process(argv=f"{flags} --rerun-mode disabled --save {tmp_path / 'a'}".split())
    evaluations = re.findall(r"validation loss at iteration .*", capsys.readouterr().out)
    injected = "--check-for-spiky-loss --error-injection-rate 2"
    reran = pretrain_gpt_in_process(argv=f"{flags} {injected} --save {tmp_path / 'b'}".split())
    out = capsys.readouterr().out
    assert re.findall(r"result validation: iteration (\d+): .* rerunning it", out) == ["3", "5", "7", "9"]
    assert re.findall(r"validation loss at iteration .*", out) == evaluations and len(evaluations) == 3
    assert _record(reran) == _record(plain) and plain.iteration == 9
    for iteration in (5, 9):
        files = [json.loads((tmp_path / run / f"iter_{iteration:07d}" / "manifest.json").read_text())["files"]
                 for run in "ab"]  # fmt: skip
        assert files[0] == files[1], iteration


def test_an_fp8_step_rerun_starts_from_the_scaling_state_it_first_had():
    """Delayed FP8 scaling pushes each step's amaxes onto the histories: a rerun step restores them (and
    drops the cached weight casts), so the run with its reruns ends with the plain run's losses and
    histories, bit for bit."""
    plain, plain_state = fp8_run("--train-iters 4 --rerun-mode disabled")
    reran, state = fp8_run("--train-iters 4 --log-interval 2 --check-for-spiky-loss --error-injection-rate 2")
    assert reran == plain and plain_state
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())


def test_a_tracker_file_that_cannot_be_written_is_one_line(tmp_path):
    path = tmp_path / "missing" / "rejected.txt"
    with pytest.raises(ConfigError) as err:
        _check_writable(str(path))
    assert str(err.value) == (
        f"--result-rejected-tracker-filename {path}: cannot append to it (No such file or directory)"
    )

"""The ledger only reads; the loop applies (issue 31).

:class:`training.step_ledger.StepLedger` keeps the steps :func:`training.step.train_step` left on the
device and, at a settling point, returns them with host numbers, deciding nothing.
:func:`training.loop.apply_step` then applies each in iteration order: the learning-rate scheduler
advances once per applied step by that step's batch, the skip counters follow, and the errors name
the iteration that raised them after the steps before it were applied. No process group: the
ledger's read is local at world size 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.optimizer.lr_scheduler import OptimizerParamScheduler
from training.loop import apply_step
from training.state import Step, TrainState
from training.step_ledger import StepLedger

MAX_LR, WARMUP = 1.0, 100  # linear warm-up: the learning rate is num_steps / 100


def _session(*, fused: bool = True):
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    scheduler = OptimizerParamScheduler(inner, 0.0, MAX_LR, 0.0, WARMUP, 1000, "linear")
    optimizer = SimpleNamespace(fused=fused, param_groups=inner.param_groups)
    return SimpleNamespace(state=TrainState(), scheduler=scheduler, optimizer=optimizer)


def _run(*, check_nan: bool = False, max_skipped: int = 10):
    training = SimpleNamespace(
        check_for_nan_in_loss_and_grad=check_nan, max_consecutive_skipped_iterations=max_skipped
    )
    return SimpleNamespace(training=training)


def _step(iteration: int, *, applied: bool, overflow: bool = False, bad_loss: bool = False) -> Step:
    loss = float("nan") if bad_loss else 2.0 + iteration
    return Step(
        iteration=iteration,
        global_batch_size=4,
        consumed_samples=4 * iteration,
        losses={"lm loss": torch.tensor(loss)},
        applied=torch.tensor(applied),
        bad_loss=torch.tensor(bad_loss),
        overflow=torch.tensor(overflow),
        grad_norm=torch.tensor(float("inf") if overflow else 0.5),
        peak_memory=torch.tensor(1024.0, dtype=torch.float64),
    )


def _ledger_with(session, steps: list[Step]) -> StepLedger:
    ledger = StepLedger(session.optimizer, session.scheduler, torch.device("cpu"))
    for step in steps:
        ledger.learning_rates(step.global_batch_size)
        ledger.add(step)
    return ledger


@pytest.mark.parametrize("fused", [True, False], ids=["device-lr-table", "settle-every-step"])
def test_the_ledger_reads_and_the_loop_steps_the_scheduler_once_per_applied_step_in_order(fused):
    """Steps 1 and 3 applied, 2 an fp16 overflow: settling returns all three as host numbers with the
    scheduler untouched; applying them advances it by 4 samples after 1 and after 3, never after 2."""
    session, run = _session(fused=fused), _run()
    ledger = _ledger_with(
        session, [_step(1, applied=True), _step(2, applied=False, overflow=True), _step(3, applied=True)]
    )

    settled = ledger.settle()

    assert [s.iteration for s in settled] == [1, 2, 3] and ledger.pending == []
    assert session.scheduler.num_steps == 0  # the ledger decides nothing
    assert session.state.skipped_iterations == 0 and session.state.losses == []
    assert [(s.settled, s.applied, s.overflow, s.grad_norm) for s in settled] == [
        (True, True, False, 0.5),
        (True, False, True, None),
        (True, True, False, 0.5),
    ]
    assert [s.losses for s in settled] == [{"lm loss": 3.0}, {"lm loss": 4.0}, {"lm loss": 5.0}]
    assert all(s.peak_memory == 1024.0 and s.loss_scale == 1.0 for s in settled)

    seen = []
    for step in settled:
        apply_step(run, session, step)
        seen.append(session.scheduler.num_steps)
    assert seen == [4, 4, 8]
    assert [s.learning_rate for s in settled] == pytest.approx([0.04, 0.04, 0.08])
    assert [s.skipped_iterations for s in settled] == [0, 1, 1]
    assert [s.nan_iterations for s in settled] == [0, 0, 0]
    assert session.state.losses == [{"lm loss": 3.0}, {"lm loss": 4.0}, {"lm loss": 5.0}]


def test_a_step_is_applied_only_once_settled():
    session = _session()
    with pytest.raises(RuntimeError, match="iteration 1 is applied before the ledger read it"):
        apply_step(_run(), session, _step(1, applied=True))
    assert session.scheduler.num_steps == 0


def test_a_nan_loss_raises_at_its_iteration_after_the_steps_before_it_are_applied():
    """--check-for-nan-in-loss-and-grad: step 2's NaN loss raises naming iteration 2; step 1 already
    advanced the scheduler and counted its loss, step 3 is never applied."""
    session = _session()
    ledger = _ledger_with(
        session, [_step(1, applied=True), _step(2, applied=False, bad_loss=True), _step(3, applied=True)]
    )
    with pytest.raises(FloatingPointError, match=r"loss is \{'lm loss': nan\} at iteration 2 "):
        for step in ledger.settle():
            apply_step(_run(check_nan=True), session, step)
    assert session.scheduler.num_steps == 4 and session.state.losses == [{"lm loss": 3.0}]


def test_a_step_skipped_without_an_overflow_raises_naming_its_gradient_norm():
    """--check-for-nan-in-loss-and-grad: a step the optimizer skipped on a finite loss and no overflow
    had a NaN/Inf gradient norm; the error names it and the iteration."""
    session = _session()
    step = _step(1, applied=False)
    step.grad_norm = torch.tensor(float("nan"))
    (settled,) = _ledger_with(session, [step]).settle()
    with pytest.raises(FloatingPointError, match=r"^gradient norm is nan at iteration 1 \(--check-for-nan"):
        apply_step(_run(check_nan=True), session, settled)
    assert session.scheduler.num_steps == 0


def test_too_many_consecutive_skips_stop_at_the_step_that_reaches_the_limit():
    """Without the NaN check, NaN steps are skipped and counted; the third in a row ends the run naming
    its iteration, and the counters hold the three."""
    session = _session()
    steps = [_step(1, applied=True), *(_step(i, applied=False, bad_loss=True) for i in (2, 3, 4, 5))]
    ledger = _ledger_with(session, steps)
    with pytest.raises(RuntimeError, match=r"^3 consecutive iterations .* skipped \(iteration 4\); stopping"):
        for step in ledger.settle():
            apply_step(_run(max_skipped=3), session, step)
    state = session.state
    assert (state.skipped_iterations, state.nan_iterations, state.consecutive_skipped) == (3, 3, 3)
    assert session.scheduler.num_steps == 4

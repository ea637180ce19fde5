"""A run along Megatron's batch-size ramp through ``pretrain()`` in this process, its data loader with
worker processes (the calculator's rules without processes: tests/unit/test_num_microbatches_calculator.py)."""

from __future__ import annotations

from tests.support.flags import MODEL


def test_a_run_along_the_ramp_steps_each_batch_and_builds_each_schedule_table_once(monkeypatch, capsys):
    """One rank, sample-based: the batches of Megatron's ramp in order, the learning-rate schedule
    advanced by each, and one schedule table per microbatch count, however many steps use it."""
    import re

    from core.optimizer.lr_scheduler import OptimizerParamScheduler
    from core.pipeline_parallel import schedules
    from tests.support.pretrain_run import pretrain_gpt_in_process
    from training.arguments.parser import parse_args

    monkeypatch.setenv("WANDB_MODE", "disabled")
    built, increments = [], []
    build_tables, step = schedules.build_tables, OptimizerParamScheduler.step
    monkeypatch.setattr(
        schedules, "build_tables", lambda *a, **k: built.append(a[3]) or build_tables(*a, **k)
    )
    monkeypatch.setattr(
        OptimizerParamScheduler,
        "step",
        lambda self, increment: increments.append(increment) or step(self, increment),
    )
    schedules.complete_tables.cache_clear()
    argv = MODEL + "--train-samples 15 --global-batch-size 4 --rampup-batch-size 1 1 3 --log-interval 1"
    state = pretrain_gpt_in_process(args=parse_args(argv.split()))
    out = capsys.readouterr().out
    batches = [1, 2, 4, 4, 4]  # the ramp up to 3 samples, then (15 - 7) // 4 full batches, as Megatron counts
    assert [int(b) for b in re.findall(r"\| global batch size: +(\d+) \|", out)] == batches
    assert increments == [0, *batches]  # 0: the scheduler's own first step, when it is built
    assert state.consumed_samples == sum(batches) == 15 and state.iteration == 5
    assert sorted(built) == [1, 2, 4]  # microbatch counts at micro batch 1, DP 1: each table once
    assert (
        "1 to 4 microbatches of 1 x 16 tokens (global batch 1 growing to 4: --rampup-batch-size 1 1 3)" in out
    )
    assert (
        "ramping up batch size from 2 to 4 (4 microbatches) at iteration 3, after 3 consumed samples" in out
    )

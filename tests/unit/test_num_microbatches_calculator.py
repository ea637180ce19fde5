"""The batch-size ramp: Megatron's calculator rules, checked without processes (one short run along the
ramp: tests/e2e/test_batch_size_ramp.py).

The references below are Megatron's rules written out directly (the ramp's float formula, and
``update_train_iters``'s loops before and after Megatron-LM#4411); the schedule tables must give
the same batch at every consumed-sample count and the same iteration counts.
"""

from __future__ import annotations

import random
import shlex

import pytest

from core.num_microbatches_calculator import BatchSizeSchedule, NumMicroBatchesCalculator, parse_count
from tests.support.flags import MODEL


def _megatron_ramp(start: int, increment: int, samples: int, final: int, consumed: int) -> int:
    """``RampupBatchsizeNumMicroBatchesCalculator.update``: the batch after ``consumed`` samples."""
    if consumed > samples:
        return final
    return start + int(consumed / (samples / ((final - start) // increment))) * increment


def _ramps() -> list[tuple[int, int, int, int]]:
    rng = random.Random(0)
    cases = [(16, 16, 5859375, 1536), (16, 8, 300000, 1024), (4, 4, 64, 8), (2, 2, 6, 8), (1, 1, 3, 100)]
    for _ in range(200):  # per-increment sample counts that are not whole numbers, and below one
        start, increment, steps = rng.randint(1, 20), rng.randint(1, 9), rng.randint(1, 40)
        cases.append((start, increment, rng.randint(1, 500), start + steps * increment))
    return cases


def test_the_ramp_gives_megatrons_batch_at_every_consumed_sample_count():
    rng = random.Random(1)
    for start, increment, samples, final in _ramps():
        schedule = BatchSizeSchedule.rampup(start, increment, samples, final)
        if samples < 10_000:
            counts = range(samples + 50)
        else:  # the GPT-3 ramp: its ends, and a sample of the rest
            counts = [*range(2000), *range(samples - 2000, samples + 50), *rng.sample(range(samples), 20_000)]
        for consumed in counts:
            assert schedule.global_batch_size(consumed) == _megatron_ramp(
                start, increment, samples, final, consumed
            ), (start, increment, samples, final, consumed)
    gpt3 = BatchSizeSchedule.rampup(16, 16, 5859375, 1536)
    assert len(gpt3.thresholds) == 96 and gpt3.thresholds[:3] == (0, 61678, 123356)  # 5859375 / 95 apart
    assert gpt3.final == 1536 and gpt3.batch_sizes[:3] == (16, 32, 48)


def _megatron_train_iters_rampup(schedule: BatchSizeSchedule, samples: int, train_samples: int) -> int:
    """``update_train_iters`` with ``--rampup-batch-size`` (before #4411), step by step."""
    iterations = consumed = 0
    while consumed <= samples and consumed <= train_samples:
        consumed += schedule.global_batch_size(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // schedule.final
    return iterations


def _megatron_train_iters_step(schedule: BatchSizeSchedule, train_samples: int) -> int:
    """``update_train_iters`` with ``--step-batch-size-schedule`` (after #4411), step by step."""
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += schedule.global_batch_size(consumed)
        iterations += 1
    return iterations


def test_train_samples_become_megatrons_iteration_counts():
    ramp = BatchSizeSchedule.rampup(2, 2, 48, 8)
    step = BatchSizeSchedule.parse("0:2 64:4 192:8", 32)
    for train_samples in range(1, 300):
        assert ramp.train_iters(train_samples) == _megatron_train_iters_rampup(ramp, 48, train_samples)
        assert step.train_iters(train_samples) == _megatron_train_iters_step(step, train_samples)
        assert BatchSizeSchedule.constant(8).train_iters(train_samples) == train_samples // 8
    gpt3 = BatchSizeSchedule.rampup(16, 16, 5859375, 1536)
    assert gpt3.train_iters(300_000_000) == _megatron_train_iters_rampup(gpt3, 5859375, 300_000_000)


def test_a_step_schedule_is_read_as_megatron_reads_it():
    gpt3 = BatchSizeSchedule.parse("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert gpt3.thresholds == (0, 1171875, 2343750, 3515625, 4687500, 5859375)  # tokens // 2048
    assert gpt3.batch_sizes == (16, 320, 624, 928, 1232, 1536) and gpt3.kind == "step"
    same = BatchSizeSchedule.parse(" 12b:1536,0:16 ,2.4b:320  4.8B:624 9.6B:1232 7.2B:928", 2048)
    assert same.thresholds == gpt3.thresholds and same.batch_sizes == gpt3.batch_sizes  # sorted, commas
    assert [parse_count(t) for t in ("768", "1.5k", "2M", "250B", "1T", "0.5K")] == [
        768,
        1500,
        2_000_000,
        250_000_000_000,
        10**12,
        500,
    ]
    assert BatchSizeSchedule.parse("20:4 32:8", 32).thresholds == (0, 1)  # 20 tokens are 0 whole samples
    assert [gpt3.global_batch_size(c) for c in (0, 1171874, 1171875, 10**9)] == [16, 16, 320, 1536]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0:16 64", "entry '64' is not THRESHOLD:BATCH_SIZE"),
        ("0:16 1x:32", "'1x' is not a number (a count with an optional K, M, B or T suffix)"),
        ("0:16 nan:32", "'nan' is not a number (a count with an optional K, M, B or T suffix)"),
        ("64:16 128:32", "the first threshold must be 0, got '64:16' (2 samples of 32 tokens)"),
        ("0:16 40:32 50:64", "'40:32' and '50:64' start at the same sample (1, at 32 tokens a sample); "),
        ("0:16 64:8", "the batch size goes down from 16 to 8 at '64:8'; it may only grow"),
        ("0:0", "entry '0:0': the batch size must be > 0"),
        (" , ", "no THRESHOLD:BATCH_SIZE entries"),
    ],
)
def test_a_malformed_step_schedule_says_what_is_wrong(text, message):
    with pytest.raises(ValueError) as err:
        BatchSizeSchedule.parse(text, 32)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("ramp", "final", "message"),
    [
        ((4, 3, 64), 8, "the ramp from 4 to the global batch size 8 is not a whole number of increments: "),
        ((16, 4, 64), 8, "the start batch size (16) is larger than the global batch size"),
        ((0, 4, 64), 8, "the start batch size (0) and the increment (4) must be > 0"),
        ((4, 4, 0), 8, "the ramp-up samples (0) must be > 0"),
    ],
)
def test_a_ramp_that_does_not_add_up_says_why(ramp, final, message):
    with pytest.raises(ValueError) as err:
        BatchSizeSchedule.rampup(*ramp, final)
    assert str(err.value).startswith(message)


def test_the_calculator_gives_microbatches_per_step_and_where_each_batch_begins():
    calc = NumMicroBatchesCalculator(
        BatchSizeSchedule.rampup(2, 2, 48, 8), micro_batch_size=1, data_parallel_size=2
    )
    consumed, counts = 0, []
    for _ in range(20):
        counts.append(calc.num_microbatches(consumed))
        consumed += calc.global_batch_size(consumed)
    assert counts == [1] * 8 + [2] * 4 + [3] * 3 + [4] * 5 and consumed == 90
    assert list(calc.schedule.segments(0, 20)) == [(0, 0, 2), (8, 16, 4), (12, 32, 6), (15, 50, 8)]
    assert list(calc.schedule.segments(24, 4)) == [(0, 24, 4), (2, 32, 6)]  # resumed mid-ramp, 4 to go
    assert [calc.schedule.consumed_after(24, n) for n in (0, 1, 2, 3, 4, 10)] == [24, 28, 32, 38, 44, 90]
    with pytest.raises(
        ValueError, match=r"^the global batch size 6 \(from 32 consumed samples\) is not divisible"
    ):
        NumMicroBatchesCalculator(calc.schedule, micro_batch_size=2, data_parallel_size=2).num_microbatches(
            32
        )


# --------------------------------------------------------------------------------------------------
# The flags, checked before any process group
# --------------------------------------------------------------------------------------------------


def _args(argv: str, world_size: int = 1):
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    return validate_args(parse_args(shlex.split(argv)), world_size)


def test_the_flags_give_the_full_batch_and_megatrons_sample_based_iterations():
    step = _args(MODEL + "--train-iters 5 --step-batch-size-schedule 0:2,32:4,1.6e2:8", 2)
    assert (step.global_batch_size, step.num_microbatches, step.train_iters) == (8, 4, 5)  # the last entry
    same = _args(
        MODEL + "--train-iters 5 --global-batch-size 8 --step-batch-size-schedule '0:2 32:4 160:8'", 2
    )
    assert same.global_batch_size == 8  # as Megatron's GPT-3 script gives them: equal
    ramp = _args(MODEL + "--train-samples 46 --global-batch-size 8 --rampup-batch-size 2 2 12")
    assert ramp.train_iters == 8 and ramp.num_microbatches == 8  # 2+2+4+6 over the ramp, then 4 x 8
    step = _args(MODEL + "--train-samples 50 --step-batch-size-schedule 0:2,64:8")  # 64 tokens: 4 samples
    assert step.train_iters == 8  # 2 x 2, then 6 x 8: the last one passes 50 (52), as Megatron counts


def test_batches_are_checked_from_where_the_checkpoint_resumes(tmp_path):
    """Four ranks where the run started on one: the schedule's first batch (2) does not divide the new
    DP (4), which matters from scratch but not once the checkpoint is past it."""
    import json

    argv = MODEL + f"--train-iters 10 --step-batch-size-schedule 0:2,128:8 --load {tmp_path}"
    with pytest.raises(
        ValueError, match=r"the global batch size 2 of iteration 1 \(from 0 consumed samples on\)"
    ):
        _args(argv, 4)
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    manifest = {"format": "trident-checkpoint-v2", "iteration": 4, "consumed_samples": 8}
    manifest |= {"parallel": {}, "model": {}, "tensors": {}, "files": {}}
    (tmp_path / "iter_0000004" / "manifest.json").write_text(json.dumps(manifest))
    assert _args(argv, 4).num_microbatches == 2
    with pytest.raises(ValueError, match=r"the global batch size 2 of iteration 1 "):
        _args(argv + " --finetune", 4)  # a fine-tuning run starts from 0 samples


# --------------------------------------------------------------------------------------------------
# A run along a ramp
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_each_step_of_a_ramp_reads_the_same_samples_when_resumed_there(dataloader_type):
    """Megatron's samplers under a growing batch: a step is its microbatch count of consecutive
    ``micro batch x DP`` rounds from the consumed count, whether the sampler ran from the start or was
    opened at that step (a resumed run); with ``single`` a step reads exactly the next global batch."""
    import itertools

    from training.data.batches import SAMPLERS

    calc = NumMicroBatchesCalculator(
        BatchSizeSchedule.rampup(2, 2, 48, 8), micro_batch_size=1, data_parallel_size=2
    )
    sampler = SAMPLERS[dataloader_type]
    straight = [iter(sampler(1000, 0, 1, rank, 2)) for rank in range(2)]
    consumed = 0
    for _ in range(20):
        count, size = calc.num_microbatches(consumed), calc.global_batch_size(consumed)
        read = []
        for rank in range(2):
            step = list(itertools.islice(straight[rank], count))
            assert step == list(itertools.islice(iter(sampler(1000, consumed, 1, rank, 2)), count))
            read += itertools.chain(*step)
        if dataloader_type == "single":
            assert sorted(read) == list(range(consumed, consumed + size))
        consumed += size

"""The global batch of every step, from ``--global-batch-size``, ``--rampup-batch-size`` or
``--step-batch-size-schedule``, checked before any process group exists.

The schedule itself is :mod:`core.num_microbatches_calculator` (Megatron's rules); this module reads
it from the flags and checks it against the run. ``--global-batch-size`` is the full batch: the end
of a ramp, or the last entry of a step schedule, which it defaults to there (Megatron refuses the two
flags together, yet its GPT-3 175B script gives both, equal; Trident takes them when they agree).
Every global batch the run will use, from the ``--load`` checkpoint's consumed samples to
``--train-iters``, must be a whole number of micro-batch x data-parallel rounds and, with virtual
pipeline stages, a microbatch count the interleaved schedule can run. Megatron checks each batch
only when training reaches it; here a bad one stops the run before it starts, in one line.
"""

from __future__ import annotations

import argparse

from core.num_microbatches_calculator import BatchSizeSchedule, NumMicroBatchesCalculator
from core.pipeline_parallel.schedule_rules import schedule_rule
from core.pipeline_parallel.schedule_tables import check_interleaving
from training.checkpoint import find_checkpoint
from training.checkpoint.reader import load_manifest

__all__ = [
    "batch_size_schedule",
    "check_run_batches",
    "derive_batch_sizes",
    "microbatch_calculator",
    "ramp_flag",
]

DEMO_MIN_GLOBAL_BATCH = 16
"""The tiny demo's --global-batch-size: the smallest multiple of micro-batch x DP that is >= this."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def ramp_flag(args: argparse.Namespace) -> str:
    """The batch flag as given, for messages: ``--rampup-batch-size 4 4 64`` or the schedule, quoted."""
    if args.rampup_batch_size is not None:
        return "--rampup-batch-size " + " ".join(map(str, args.rampup_batch_size))
    return f"--step-batch-size-schedule '{args.step_batch_size_schedule}'"


def batch_size_schedule(args: argparse.Namespace) -> BatchSizeSchedule:
    """The run's global batch sizes by consumed samples (``args.global_batch_size`` already resolved)."""
    ramp = args.rampup_batch_size
    if ramp is not None:
        _require(
            len(ramp) == 3,
            "--rampup-batch-size takes three values, START INCR SAMPLES (the start batch size, the increment "
            f"and the samples to ramp over, e.g. --rampup-batch-size 16 16 5859375), got {len(ramp)}",
        )
        try:
            return BatchSizeSchedule.rampup(*ramp, args.global_batch_size)
        except ValueError as err:
            raise ValueError(
                f"{ramp_flag(args)} with --global-batch-size {args.global_batch_size}: {err}"
            ) from None
    if args.step_batch_size_schedule is not None:
        try:
            return BatchSizeSchedule.parse(args.step_batch_size_schedule, args.seq_length)
        except ValueError as err:
            raise ValueError(f"{ramp_flag(args)}: {err}") from None
    return BatchSizeSchedule.constant(args.global_batch_size)


def microbatch_calculator(args: argparse.Namespace) -> NumMicroBatchesCalculator:
    """Microbatches per step of a validated run (the ``Run.microbatches`` the loop asks each step)."""
    return NumMicroBatchesCalculator(
        batch_size_schedule(args), args.micro_batch_size, args.data_parallel_size
    )


def derive_batch_sizes(args: argparse.Namespace, pp: int, dp: int) -> None:
    """Resolve ``global_batch_size`` (the full batch) and its ``num_microbatches``, and check them."""
    mbs, per_step = args.micro_batch_size, args.micro_batch_size * dp
    _require(
        args.rampup_batch_size is None or args.step_batch_size_schedule is None,
        "--rampup-batch-size and --step-batch-size-schedule are mutually exclusive: give one",
    )
    if args.step_batch_size_schedule is not None:
        final = batch_size_schedule(args).final
        _require(
            args.global_batch_size in (None, final),
            f"--global-batch-size ({args.global_batch_size}) differs from the last batch size of "
            f"{ramp_flag(args)} ({final}); leave --global-batch-size out, or make them equal",
        )
        args.global_batch_size = final
    elif args.global_batch_size is None and args.using_default_model:
        args.global_batch_size = per_step * max(1, -(-DEMO_MIN_GLOBAL_BATCH // per_step))
        filled = list(args.tiny_demo_filled.items())
        at = next((i + 1 for i, (k, _) in enumerate(filled) if k == "micro_batch_size"), len(filled))
        args.tiny_demo_filled = dict(
            filled[:at] + [("global_batch_size", args.global_batch_size)] + filled[at:]
        )
    elif args.global_batch_size is None:
        args.global_batch_size = per_step  # Megatron's default: one microbatch per data-parallel rank
    gbs = args.global_batch_size
    _require(
        gbs % per_step == 0,
        f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size "
        f"({mbs}) x data-parallel size ({dp}) = {per_step}",
    )
    args.num_microbatches = gbs // per_step
    try:
        _check_schedulable(args, pp, args.num_microbatches)
    except ValueError as err:
        raise ValueError(
            f"{err} (interleaved schedule, {args.virtual_pipeline_model_parallel_size} virtual stages per "
            f"rank; microbatches = --global-batch-size ({gbs}) / (--micro-batch-size ({mbs}) x data-parallel "
            f"size ({dp})) = {args.num_microbatches})"
        ) from None
    if args.rampup_batch_size is not None:
        batch_size_schedule(args)  # the ramp's own rules, now that the global batch is known


def check_run_batches(args: argparse.Namespace, pp: int, dp: int) -> None:
    """Every global batch of a ramp or step schedule that the run reaches, from where ``--load`` resumes
    to ``--train-iters``: divisible by micro batch x DP, and a microbatch count the schedule can run."""
    schedule = batch_size_schedule(args)
    if not schedule.changes:
        return
    mbs, per_step = args.micro_batch_size, args.micro_batch_size * dp
    iteration, consumed = _resume_point(args)
    for offset, at, size in schedule.segments(consumed, max(args.train_iters - iteration, 0)):
        where = f"the global batch size {size} of iteration {iteration + offset + 1} (from {at} consumed samples on)"
        _require(
            size % per_step == 0,
            f"{ramp_flag(args)}: {where} is not divisible by --micro-batch-size ({mbs}) x data-parallel size "
            f"({dp}) = {per_step}",
        )
        try:
            _check_schedulable(args, pp, size // per_step)
        except ValueError as err:
            raise ValueError(
                f"{ramp_flag(args)}: {where} makes {_microbatches(size // per_step)}: {err} (interleaved "
                f"schedule, {args.virtual_pipeline_model_parallel_size} virtual stages per rank)"
            ) from None


def _microbatches(count: int) -> str:
    return f"{count} microbatch" + ("es" if count != 1 else "")


def _check_schedulable(args: argparse.Namespace, pp: int, num_microbatches: int) -> None:
    """The interleaved schedule's rules on a microbatch count (ZBV's V and the others run any count)."""
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp and schedule_rule(args.pipeline_schedule).groups_microbatches(vpp):
        check_interleaving(pp, vpp, num_microbatches, args.microbatch_group_size_per_vp_stage)


def _resume_point(args: argparse.Namespace) -> tuple[int, int]:
    """(iteration, consumed samples) the run starts from: the ``--load`` checkpoint's, else (0, 0)."""
    if not args.load or args.finetune:
        return 0, 0
    path = find_checkpoint(args.load, args.ckpt_step)
    if path is None:
        return 0, 0
    manifest = load_manifest(path)
    return int(manifest.get("iteration", 0)), int(manifest.get("consumed_samples", 0))

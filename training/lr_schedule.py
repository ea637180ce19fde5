"""The learning-rate and weight-decay schedule from the flags, in samples, as Megatron computes it.

Megatron's scheduler counts samples. A run is either iteration-based (``--train-iters``, with
``--lr-decay-iters``, ``--lr-warmup-iters``, ``--lr-wsd-decay-iters``, each multiplied by the global
batch size: the full one, after any batch ramp, as Megatron multiplies) or sample-based (``--train-samples``, with ``--lr-decay-samples``, ``--lr-warmup-samples``,
``--lr-wsd-decay-samples``); the two families do not mix. ``--lr-warmup-fraction`` is a fraction of
the decay samples in either. Weight decay goes from ``--start-weight-decay`` to ``--end-weight-decay``
over the whole run (``--weight-decay-incr-style``), or stays at ``--weight-decay``.

``check_schedule(args)`` runs inside ``derive_args`` (it derives ``train_iters`` for sample-based
runs); ``scheduler_kwargs(args)`` gives the schedule in samples, which the run keeps
(``Run.lr_schedule``), and ``build_scheduler(optimizer, settings)`` makes the ``OptimizerParamScheduler``.
"""

from __future__ import annotations

import argparse
from typing import Any

from core.optimizer.lr_scheduler import OptimizerParamScheduler
from training.data.batch_sizes import batch_size_schedule

__all__ = ["build_scheduler", "check_schedule", "scheduler_kwargs"]

_ITERATION_FLAGS = {"lr_decay_iters": None, "lr_warmup_iters": 0, "lr_wsd_decay_iters": None}
_SAMPLE_FLAGS = {"lr_decay_samples": None, "lr_warmup_samples": 0, "lr_wsd_decay_samples": None}


def _given(args: argparse.Namespace, defaults: dict[str, Any]) -> list[str]:
    return ["--" + k.replace("_", "-") for k, default in defaults.items() if getattr(args, k) != default]


def _check_run_length(args: argparse.Namespace) -> None:
    """Iteration-based or sample-based, not both; a sample-based run gets its iteration count here."""
    if args.train_samples is None:
        wrong = _given(args, _SAMPLE_FLAGS)
        if wrong:
            raise ValueError(
                f"{', '.join(wrong)} {'needs' if len(wrong) == 1 else 'need'} --train-samples (sample-based "
                "training); with --train-iters use --lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters"
            )
        return
    if args.train_iters is not None:
        raise ValueError("--train-iters and --train-samples are mutually exclusive: give one")
    wrong = _given(args, _ITERATION_FLAGS)
    if wrong:
        raise ValueError(
            f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} for iteration-based training; with "
            "--train-samples use --lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples"
        )
    schedule = batch_size_schedule(args)
    if not schedule.changes and args.train_samples < args.global_batch_size:
        raise ValueError(
            f"--train-samples ({args.train_samples}) is less than one global batch (--global-batch-size "
            f"{args.global_batch_size})"
        )
    args.train_iters = schedule.train_iters(args.train_samples)  # Megatron's count, along a ramp too


def scheduler_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``OptimizerParamScheduler`` arguments from validated flags (steps are samples)."""
    gbs, samples = args.global_batch_size, args.train_samples
    if samples is None:
        decay = (args.lr_decay_iters or args.train_iters) * gbs
        total = args.train_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup = args.lr_warmup_iters * gbs
    else:
        decay = args.lr_decay_samples or samples
        total = samples
        wsd = args.lr_wsd_decay_samples
        warmup = args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    start_wd = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end_wd = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return {
        "init_lr": 0.0,
        "max_lr": args.lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": args.lr_decay_style,
        "start_wd": start_wd,
        "end_wd": end_wd,
        "wd_incr_steps": total,
        "wd_incr_style": args.weight_decay_incr_style,
        "wsd_decay_steps": wsd,
        "lr_wsd_decay_style": args.lr_wsd_decay_style if args.lr_decay_style == "WSD" else None,
        "use_checkpoint_opt_param_scheduler": args.use_checkpoint_opt_param_scheduler,
        "override_opt_param_scheduler": args.override_opt_param_scheduler,
    }


def check_schedule(args: argparse.Namespace) -> None:
    """Megatron's rules for the schedule flags; one ``ValueError`` naming the flags and numbers."""
    _check_run_length(args)
    _check_warmup_and_wsd(args)
    _check_weight_decay_and_decoupled_lr(args)
    _check_lengths(args)


def _check_warmup_and_wsd(args: argparse.Namespace) -> None:
    """One way to give the warm-up; the WSD flags only with WSD, and its anneal's length given."""
    warmups = [
        f
        for f, set_ in (
            ("--lr-warmup-iters", args.lr_warmup_iters),
            ("--lr-warmup-samples", args.lr_warmup_samples),
        )
        if set_
    ]
    if args.lr_warmup_fraction is not None and warmups:
        raise ValueError(f"--lr-warmup-fraction and {warmups[0]} are mutually exclusive: give at most one")
    wsd_flags = [
        f"--{k.replace('_', '-')}"
        for k, default in (
            ("lr_wsd_decay_style", "exponential"),
            ("lr_wsd_decay_iters", None),
            ("lr_wsd_decay_samples", None),
        )
        if getattr(args, k) != default
    ]
    if args.lr_decay_style != "WSD" and wsd_flags:
        raise ValueError(
            f"{', '.join(wsd_flags)} {'needs' if len(wsd_flags) == 1 else 'need'} --lr-decay-style WSD"
        )
    if args.lr_decay_style == "WSD":
        unit = "samples" if args.train_samples is not None else "iters"
        if getattr(args, f"lr_wsd_decay_{unit}") is None:
            raise ValueError(
                f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the length of the final anneal)"
            )


def _check_weight_decay_and_decoupled_lr(args: argparse.Namespace) -> None:
    """A weight-decay ramp names both ends (a constant one neither); a decoupled floor needs its peak."""
    if args.weight_decay_incr_style == "constant":
        given = [f for f in ("start_weight_decay", "end_weight_decay") if getattr(args, f) is not None]
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} needs --weight-decay-incr-style linear or cosine (with "
                "constant, the weight decay is --weight-decay)"
            )
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        raise ValueError(
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
            "--end-weight-decay"
        )
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None and args.decoupled_lr < (args.decoupled_min_lr or 0.0):
        raise ValueError(
            f"--decoupled-min-lr ({args.decoupled_min_lr}) must be <= --decoupled-lr ({args.decoupled_lr})"
        )


def _check_lengths(args: argparse.Namespace) -> None:
    """Warm-up shorter than the decay, and a WSD anneal within it, in the run's own unit."""
    kwargs = scheduler_kwargs(args)
    sample_based = args.train_samples is not None
    unit, flag = ("samples", "samples") if sample_based else ("iterations", "iters")
    decay = _count(kwargs["lr_decay_steps"], args)
    if args.lr_warmup_fraction is None and kwargs["lr_warmup_steps"] >= kwargs["lr_decay_steps"]:
        raise ValueError(
            f"--lr-warmup-{flag} ({_count(kwargs['lr_warmup_steps'], args)}) must be < the decay {unit} "
            f"({decay}, from --lr-decay-{flag} or else --train-{flag})"
        )
    wsd = kwargs["wsd_decay_steps"]
    if args.lr_decay_style == "WSD" and not 0 < wsd <= kwargs["lr_decay_steps"]:
        raise ValueError(
            f"--lr-wsd-decay-{flag} ({_count(wsd, args)}) must be > 0 and at most the decay {unit} ({decay})"
        )


def _count(samples: float, args: argparse.Namespace) -> str:
    """A sample count as the user gave it: samples, or iterations for an iteration-based run."""
    value = samples if args.train_samples is not None else samples / args.global_batch_size
    return f"{value:g}"


def build_scheduler(optimizer: Any, settings: dict[str, Any]) -> OptimizerParamScheduler:
    """The run's ``OptimizerParamScheduler`` from :func:`scheduler_kwargs` (``Run.lr_schedule``):
    warm-up, decay and weight-decay ramp, in samples."""
    return OptimizerParamScheduler(optimizer, **settings)

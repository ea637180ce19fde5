"""``pretrain()``: Megatron's training loop over Trident's engine.

    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=None)

Order of business: parse and validate every flag before any process group exists (one error on
every rank); set up TP/PP/DP groups; build tokenizer, data, model chunks (wrapped for data
parallelism), optimizer and LR schedule; resume from ``--load``; then train, evaluate, log and save.

When something goes wrong (``training.faults``): the heartbeat watchdog names a rank that stops
answering, a step that fails on some ranks fails on all (``faults.agree``), and the rank that
reports the error is decided here, while the process groups still exist (``faults.judge``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.device import bind_local_device, current_device, select_backend
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.pipeline_parallel.hooks import ScheduleHooks
from core.pipeline_parallel.losses import reduce_loss_logs
from core.pipeline_parallel.mailbox import PipelineShapeError
from core.pipeline_parallel.schedules import get_forward_backward_func
from core.tensor_parallel import model_parallel_seed
from training import checkpointing, faults
from training.argument_checks import validate_args
from training.arguments import config_from_args, parse_and_validate, startup_report
from training.batches import BatchStream
from training.checkpoint_args import check_checkpoint_args, load_checkpoint_args
from training.errors import ConfigError
from training.global_vars import get_tokenizer, set_global_variables
from training.logging_utils import is_logging_rank, print_rank_0, print_rank_last
from training.lr_schedule import build_scheduler
from training.profiling import StepProfiler
from training.progress import Progress
from training.run_control import ExitTimer, ManualGC
from training.run_logging import RunLoggers
from training.signal_handler import SignalHandler
from training.throughput import memory_stats, num_floating_point_operations, peak_memory_bytes, peak_tflops
from training.timeline import Timeline
from training.wandb_logging import start_run


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_skipped: int = 0
    wandb_run_id: str | None = None
    losses: list[dict[str, float]] = field(default_factory=list)  # per iteration, on the loss stage
    step_seconds: list[float] = field(default_factory=list)  # wall time of each iteration (no eval/save)
    progress: Progress | None = None  # timestamps, ETA and the end-of-run summary


@dataclass
class _Step:
    """What one iteration measured, for the log line and W&B."""

    losses: dict[str, float] | None  # loss_func's reported values, on the loss stage
    grad_norm: float | None
    num_zeros: int | None
    applied: bool
    peak_memory: float  # bytes, the largest of any rank
    params_norm: float | None = None
    seconds: float = 0.0


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    *,
    argv: list[str] | None = None,
    tokenizer_provider: Callable | None = None,
    args: argparse.Namespace | None = None,
    iteration_hook: Callable[[TrainState], None] | None = None,
) -> TrainState:
    """Train as the flags say; returns the final state (losses on the rank that logs them).

    ``args``: an already parsed namespace (``training.arguments.parse_args``) instead of ``argv``.
    Bad flags raise :class:`~training.errors.UsageError` (unparsable or rejected) or
    :class:`~training.errors.ConfigError` on every rank, before any process group exists.
    ``iteration_hook(state)``, if given, runs after every iteration, outside its measured time
    (``tools/bench_overhead.py`` interleaves a plain PyTorch loop with it, step by step).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args is None:
        args = parse_and_validate(argv, world_size)
    else:
        try:
            load_checkpoint_args(args)  # --use-checkpoint-args: model flags from the --load checkpoint
            validate_args(args, world_size)
            check_checkpoint_args(args)  # a model flag contradicting the --load checkpoint: one error, now
        except ValueError as err:
            raise ConfigError(str(err)) from None
    select_backend(args.distributed_backend)
    started = ps.initialize_distributed(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    try:
        faults.begin(args)
        return _setup_and_train(
            args,
            train_valid_test_datasets_provider,
            model_provider,
            forward_step_func,
            tokenizer_provider,
            iteration_hook,
        )
    except BaseException as err:
        faults.judge(err)  # who prints it: decided while the groups (and their store) still exist
        raise
    finally:
        faults.end()
        # The run's model, gradient buffers and their pending communication handles sit in reference
        # cycles. Free them now, while their groups exist: left to a later collection they may be freed
        # in a forked DataLoader worker of the next run in this process, whose copies of the groups'
        # threads do not exist, and crash it.
        gc.collect()
        # Tear down what this call set up: gloo aborts a process whose groups outlive the interpreter.
        if started:
            ps.destroy_distributed()
        else:
            ps.destroy_model_parallel()


def _setup_and_train(
    args,
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    tokenizer_provider: Callable | None,
    iteration_hook: Callable[[TrainState], None] | None = None,
) -> TrainState:
    bind_local_device()
    ps.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    _seed_everything(args.seed)
    faults.phase("building the tokenizer")
    tokenizer = _rank0_first(lambda: tokenizer_provider(args)) if tokenizer_provider else None
    set_global_variables(args, tokenizer)
    for line in startup_report(args):
        print_rank_0(line)

    if args.save:  # a bad --save fails now, not after the first save_interval of training
        removed = checkpointing.prepare_save_dir(args.save)
        if removed:
            print_rank_0(f"removed {len(removed)} temporary file(s) of interrupted saves from {args.save}")
    faults.phase("building the model and optimizer")
    chunks = _build_chunks(model_provider, args)
    optimizer = get_megatron_optimizer(
        config_from_args(OptimizerConfig, args),
        chunks,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )
    if optimizer.grad_scaler is not None:  # the schedule scales the last stage's loss before backward
        chunks[0].config.schedule_hooks.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(optimizer, args)
    state = TrainState()
    if args.load:
        faults.phase("loading the checkpoint")
        _load(args, chunks, optimizer, scheduler, state)
    faults.phase("building the datasets")
    train_ds, valid_ds, _ = _rank0_first(lambda: train_valid_test_datasets_provider(args))
    train_ds, valid_ds = (_batch_stream(ds, args) for ds in (train_ds, valid_ds))
    faults.phase("starting the W&B run")
    run = start_run(
        project=args.wandb_project,
        name=args.wandb_exp_name or None,
        save_dir=args.wandb_save_dir,
        config=vars(args),
        run_id=state.wandb_run_id,
        is_logging_rank=is_logging_rank(),
    )
    run = RunLoggers(run, tensorboard_dir=args.tensorboard_dir if is_logging_rank() else None)
    state.wandb_run_id = _shared_run_id(getattr(run, "id", None) or state.wandb_run_id)
    print_rank_0(
        f"training {args.train_iters} iterations from iteration {state.iteration}: "
        f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
        f"VPP={args.virtual_pipeline_model_parallel_size or 1} DP={args.data_parallel_size}, "
        f"{args.num_microbatches} microbatches of {args.micro_batch_size} x {args.seq_length} tokens"
    )
    # Only with --exit-signal-handler is SIGTERM caught (to save first); otherwise it ends the run as usual.
    handler = SignalHandler() if args.exit_signal_handler else contextlib.nullcontext()
    collector = ManualGC(
        enabled=args.manual_gc, interval=args.manual_gc_interval, around_eval=args.manual_gc_eval
    )
    with handler as signals, collector:
        _train(
            args,
            chunks,
            optimizer,
            scheduler,
            forward_step_func,
            train_ds,
            valid_ds,
            state,
            run,
            signals,
            collector,
            iteration_hook,
        )
    for line in state.progress.summary(
        args, iteration=state.iteration, consumed_samples=state.consumed_samples, last=run.last, run=run
    ):
        print_rank_last(line)
    run.finish()
    return state


def _train(
    args,
    chunks,
    optimizer,
    scheduler,
    forward_step_func,
    train_ds,
    valid_ds,
    state,
    run,
    signals,
    collector,
    hook,
) -> None:
    forward_backward = get_forward_backward_func()
    device = current_device()
    flops = num_floating_point_operations(args, args.global_batch_size, _padded_vocab_size(chunks, args))
    peak = peak_tflops(device, args.peak_tflops)
    window: dict[str, Any] = {"time": time.perf_counter(), "paused": 0.0, "iters": 0}
    window.update(loss=[], skipped_loss=[])  # losses of the iterations that stepped, and of the others
    timer = ExitTimer(args.exit_duration_in_mins, _any_rank)
    timeline = Timeline.from_args(args)
    state.progress = Progress(state, args.train_iters)
    profiler = StepProfiler(
        enabled=args.profile,
        start=args.profile_step_start,
        end=args.profile_step_end,
        rank=dist.get_rank(),
        ranks=args.profile_ranks,
        out_dir=args.tensorboard_dir or "profile",
    )
    saved_at = None
    while state.iteration < args.train_iters:
        record = timeline.start() if timeline and timeline.wants(state.iteration + 1) else None
        start = time.perf_counter()
        profiler.before_step(state.iteration)
        step = _train_step(
            args, chunks, optimizer, forward_backward, forward_step_func, train_ds, state, record
        )
        if record is not None:
            timeline.finish(state.iteration + 1, record)
        state.iteration += 1
        profiler.after_step(state.iteration)
        state.consumed_samples += args.global_batch_size
        if step.applied:
            scheduler.step(increment=args.global_batch_size)
        if step.losses is not None:
            state.losses.append(step.losses)
            window["loss" if step.applied else "skipped_loss"].append(step.losses)
        window["iters"] += 1
        if args.log_params_norm:  # a collective: every rank, every iteration (as Megatron)
            step.params_norm = optimizer.get_params_norm()
        step.seconds = time.perf_counter() - start
        run.log(_wandb_row(args, state, optimizer, step, flops, peak, device), step=state.iteration)
        collector.after_step(state.iteration)
        if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
            _log(args, state, optimizer, step, window, flops, peak)
        state.step_seconds.append(time.perf_counter() - start)
        paused = time.perf_counter()
        if (
            valid_ds is not None
            and args.eval_interval
            and state.iteration % args.eval_interval == 0
            and args.eval_iters > 0
        ):
            with collector.evaluation():
                _evaluate(args, chunks, forward_backward, forward_step_func, valid_ds, state, run)
        stop = args.exit_interval and state.iteration % args.exit_interval == 0
        faults.phase("run-control checks (exit timer, SIGTERM)", state.iteration)
        if timer.expired():
            print_rank_0(
                f"--exit-duration-in-mins {args.exit_duration_in_mins} reached: saving a checkpoint at "
                f"iteration {state.iteration} and exiting"
            )
            stop = True
        if args.exit_signal_handler and any(signals.signals_received()):
            print_rank_0(f"SIGTERM received: saving a checkpoint at iteration {state.iteration} and exiting")
            stop = True
        if args.save and (stop or state.iteration % args.save_interval == 0):
            _save(args, chunks, optimizer, scheduler, state)
            saved_at = state.iteration
        if hook is not None:
            hook(state)
        window["paused"] += time.perf_counter() - paused  # evaluation and saving are not step time
        if stop:
            break
    for chunk in chunks:  # the last step's parameter all-gathers (distributed optimizer) land
        chunk.finish_param_sync()
    profiler.stop()
    if args.save and saved_at != state.iteration:
        _save(args, chunks, optimizer, scheduler, state)
    if timeline:
        timeline.write()
    faults.phase("finishing")


def _train_step(
    args, chunks, optimizer, forward_backward, forward_step_func, train_ds, state, record=None
) -> _Step:
    """One global batch: forward/backward over all microbatches, then the optimizer step (or a skip).

    A step is skipped for a NaN/Inf loss or gradient norm (counted as a NaN iteration, and towards
    ``--max-consecutive-skipped-iterations``), or for an fp16 loss-scale overflow (a skipped
    iteration only: the scaler backs off and training goes on, as in Megatron). Under fp16 a NaN/Inf
    loss still goes through the optimizer step, whose overflow check finds the gradients it made
    and backs the scale off, as Megatron's does; the iteration counts as a NaN iteration.
    ``record``: a ``ScheduleRecord`` the schedule fills (the timeline's iterations).
    """
    iteration = state.iteration + 1
    faults.phase("forward-backward (pipeline send/recv, data-parallel gradient all-reduce)", iteration)
    optimizer.zero_grad()  # and the chunks' gradient buffers
    losses = _run_global_batch(
        args, chunks, forward_backward, forward_step_func, train_ds, state.consumed_samples, record=record
    )
    faults.phase("the loss check (all-reduce)", iteration)
    bad_loss, peak_memory = _max_over_ranks(
        [
            1.0 if losses is not None and not all(math.isfinite(v) for v in losses.values()) else 0.0,
            float(peak_memory_bytes(current_device())),
        ]
    )
    if bad_loss and args.check_for_nan_in_loss_and_grad:
        raise FloatingPointError(
            f"loss is {losses} at iteration {state.iteration + 1} (--check-for-nan-in-loss-and-grad)"
        )
    applied, grad_norm, num_zeros, overflow = False, None, None, False
    if not bad_loss or optimizer.grad_scaler is not None:
        faults.phase("the optimizer step (gradient-norm all-reduce)", iteration)
        applied, grad_norm, num_zeros = optimizer.step()
        overflow = not applied and optimizer.last_step_overflowed
        if not applied and not overflow and args.check_for_nan_in_loss_and_grad:
            raise FloatingPointError(
                f"gradient norm is {grad_norm} at iteration {state.iteration + 1} "
                "(--check-for-nan-in-loss-and-grad)"
            )
    if applied:
        state.consecutive_skipped = 0
    elif overflow and not bad_loss:
        state.skipped_iterations += 1
    else:
        state.skipped_iterations += 1
        state.nan_iterations += 1
        state.consecutive_skipped += 1
        if state.consecutive_skipped >= args.max_consecutive_skipped_iterations:
            raise RuntimeError(
                f"{state.consecutive_skipped} consecutive iterations had a NaN/inf loss or gradient "
                f"and were skipped (iteration {state.iteration + 1}); stopping. Lower --lr or "
                "check the data; --max-consecutive-skipped-iterations sets the limit"
            )
    return _Step(losses, grad_norm, num_zeros, applied, peak_memory)


def _run_global_batch(
    args,
    chunks,
    forward_backward,
    forward_step_func,
    dataset,
    consumed_samples: int,
    forward_only: bool = False,
    record=None,
) -> dict[str, float] | None:
    """One global batch through the pipeline schedule; returns the reported losses (``loss_func``'s log
    dict, each key reduced over microbatches and data-parallel ranks) on the loss stage, else None."""
    iterators = _iterators(chunks, dataset, consumed_samples, args)
    try:
        logs = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=_one_or_list(iterators),
            model=_one_or_list(chunks),
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=forward_only,
            record=record,
        )
    except PipelineShapeError as err:  # the model's stages disagree with --seq-length/--micro-batch-size
        raise ConfigError(
            f"{err} (--seq-length {args.seq_length}, --micro-batch-size {args.micro_batch_size})"
        ) from None
    return reduce_loss_logs(logs, ps.get_data_parallel_group()) or None


def _mean_per_key(values: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(v[key] for v in values) / len(values) for key in values[0]} if values else {}


def _shared_run_id(run_id: str | None) -> str | None:
    """The logging rank's W&B run id on every rank (rank 0 writes it into the checkpoint manifest)."""
    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, run_id)
    return next((i for i in ids if i), None)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    return bool(_max_over_ranks([1.0 if flag else 0.0])[0])


def _max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over all ranks, in one collective (none at world size 1)."""
    if dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=current_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _evaluate(args, chunks, forward_backward, forward_step_func, valid_ds, state, run) -> None:
    """Validation loss over ``--eval-iters`` batches, in eval mode (no dropout), as Megatron does."""
    losses = []
    for chunk in chunks:
        chunk.eval()
    faults.phase("evaluation (pipeline send/recv)", state.iteration)
    try:
        for k in range(args.eval_iters):
            with torch.no_grad():
                reported = _run_global_batch(
                    args,
                    chunks,
                    forward_backward,
                    forward_step_func,
                    valid_ds,
                    k * args.global_batch_size,
                    forward_only=True,
                )
            if reported is not None:
                losses.append(reported)
    finally:
        for chunk in chunks:
            chunk.train()
    if losses:
        values = _mean_per_key(losses)
        print_rank_last(
            f" validation loss at iteration {state.iteration} |"
            + "".join(
                f" {k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E} |" for k, v in values.items()
            )
        )
        run.log({f"validation/{k}": v for k, v in values.items()}, step=state.iteration)


def _padded_vocab_size(chunks, args) -> int:
    """The output layer's (padded) vocabulary, for the FLOP count: the model's, else Megatron's rule."""
    for chunk in chunks:
        size = getattr(getattr(chunk, "module", chunk), "padded_vocab_size", None)
        if size is not None:
            return int(size)
    try:
        vocab = get_tokenizer().vocab_size
    except RuntimeError:  # no tokenizer: the FLOP count leaves the output layer out
        return 0
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab // multiple) * multiple


def _loss_scale(optimizer) -> float:
    return 1.0 if optimizer.grad_scaler is None else optimizer.grad_scaler.scale


def _wandb_row(args, state, optimizer, step: _Step, flops: float, peak: float | None, device) -> dict:
    """This iteration's numbers under Megatron's W&B keys (plus a few of Trident's), every iteration."""
    tflops = flops / (step.seconds * 1e12 * args.world_size)
    row = {
        "learning-rate": optimizer.param_groups[0]["lr"],
        "batch-size": args.global_batch_size,
        "samples vs steps": state.consumed_samples,
        "loss-scale": _loss_scale(optimizer),
        "iteration-time": step.seconds,
        "throughput": tflops,
        "tokens-per-second": args.global_batch_size * args.seq_length / step.seconds,
        "skipped-iterations": state.skipped_iterations,
        "nan-iterations": state.nan_iterations,
    }
    row.update(step.losses or {})  # "lm loss" and whatever else loss_func reports
    if step.grad_norm is not None:
        row["grad-norm"] = step.grad_norm
    if step.num_zeros is not None:
        row["num-zeros"] = step.num_zeros
    if step.params_norm is not None:
        row["params-norm"] = step.params_norm
    if peak is not None:
        row["mfu"] = tflops / peak
    if args.log_memory_to_tensorboard:
        row.update(memory_stats(device))
        row["mem-max-allocated-bytes"] = step.peak_memory  # the largest of any rank
    return row


def _log(args, state, optimizer, step: _Step, window, flops: float, peak: float | None) -> None:
    """Megatron's log line, averaged over the iterations since the last one (eval and saving excluded)."""
    now = time.perf_counter()
    seconds = (now - window["time"] - window["paused"]) / max(window["iters"], 1)
    tflops = flops / (seconds * 1e12 * args.world_size)
    lr = optimizer.param_groups[0]["lr"]
    # Megatron averages the iterations that stepped; if every one was skipped, show theirs instead of 0.
    losses = _mean_per_key(window["loss"] or window["skipped_loss"]) or {"lm loss": float("nan")}
    fields = [
        f"iteration {state.iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {state.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {seconds * 1000:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {tflops:.4g}",
    ]
    if peak is not None:
        fields.append(f"MFU: {100 * tflops / peak:.1f}%")
    fields += [
        f"learning rate: {lr:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        *(f"{key}: {value:.6E}" for key, value in losses.items()),
        f"loss scale: {_loss_scale(optimizer):.1f}",
        f"grad norm: {float('nan') if step.grad_norm is None else step.grad_norm:.3f}",
    ]
    if step.num_zeros is not None:
        fields.append(f"num zeros: {step.num_zeros}")
    if step.params_norm is not None:
        fields.append(f"params norm: {step.params_norm:.3f}")
    fields += [
        f"tokens/s: {args.global_batch_size * args.seq_length / seconds:.0f}",
        f"peak memory per rank (MB): {step.peak_memory / 2**20:.0f}",
        f"number of skipped iterations: {state.skipped_iterations:3d}",
        f"number of nan iterations: {state.nan_iterations:3d}",
    ]
    state.progress.print_log_line(" " + " | ".join(fields) + " |")
    window.update(loss=[], time=now, paused=0.0, iters=0, skipped_loss=[])


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    """Megatron's seeding: a different stream per pipeline stage, the TP tracker for dropout in TP regions."""
    import random

    import numpy as np

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    model_parallel_seed(stage_seed)


def _rank0_first(build: Callable):
    """Global rank 0 builds (and caches) first, the others after it; cache files are written atomically.

    A failure on any rank (a data file rank 0 cannot read) fails every rank at once: the rank that
    failed reports it, the others end quietly instead of waiting for it (``faults.agree``).
    """
    first = dist.get_rank() == 0
    result = faults.agree(build if first else None)
    later = faults.agree(None if first else build)
    return result if first else later


def _build_chunks(model_provider: Callable, args) -> list[DistributedDataParallel]:
    from models.gpt.gpt_model import pipeline_layout

    vpp = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
        layout = pipeline_layout(args)  # reads the same four fields a TransformerConfig has
        pp_rank = ps.get_pipeline_model_parallel_rank()
        post_process = layout.has_loss(pp_rank, vp_stage)
        # The loss stage on the rank that also holds the embedding (ZBV's V) borrows its Parameter.
        holder = next((c for c in chunks if c.pre_process), None)
        shared = (
            {"shared_embedding_weight": holder.embedding.word_embeddings.weight}
            if post_process and holder
            else {}
        )
        chunk = model_provider(
            pre_process=layout.has_embedding(pp_rank, vp_stage),
            post_process=post_process,
            vp_stage=vp_stage if vpp > 1 else None,
            **shared,
        )
        chunks.append(chunk)
    ps.set_virtual_pipeline_model_parallel_rank(0 if vpp > 1 else None)
    ddp_config = config_from_args(DistributedDataParallelConfig, args)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    # One hooks object for every chunk. Reduction is suspended per chunk and lifted for each chunk's
    # own last weight-gradient step, so its buckets launch while that backward runs (and a weight
    # shared by two chunks of this rank is counted ready once, by the chunk that registers it).
    hooks = ScheduleHooks(
        no_sync=[c.no_sync for c in wrapped],
        grad_sync=[c.start_grad_sync for c in wrapped] if args.overlap_grad_reduce else None,
        finalize_model_grads=finalize_model_grads,
    )
    for chunk in chunks:
        chunk.config.schedule_hooks = hooks
    return wrapped


# The scheduler settings a checkpoint stores, and the flags that set them (steps count samples).
_SCHEDULER_FLAGS = {
    "max_lr": ("--lr", False),
    "min_lr": ("--min-lr", False),
    "lr_warmup_steps": ("warm-up iterations (--lr-warmup-iters or --lr-warmup-fraction)", True),
    "lr_decay_steps": ("decay iterations (--lr-decay-iters, else --train-iters)", True),
    "lr_decay_style": ("--lr-decay-style", False),
    "start_wd": ("--start-weight-decay (else --weight-decay)", False),
    "end_wd": ("--end-weight-decay (else --weight-decay)", False),
    "wd_incr_steps": ("weight-decay ramp iterations (--train-iters)", True),
    "wd_incr_style": ("--weight-decay-incr-style", False),
}


def _check_scheduler(args, scheduler, saved: dict, saved_args: dict) -> None:
    """Megatron's rule on resume: the flags' schedule must be the checkpoint's, unless told which wins.

    Without it a run resumed with a larger ``--train-iters`` silently keeps the old decay and trains
    at the minimum learning rate.
    """
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    differ = scheduler.mismatches(saved)
    if not differ:
        return
    saved_gbs = saved_args.get("global_batch_size") or args.global_batch_size

    def shown(value, in_iterations: bool, gbs: int):
        if in_iterations and isinstance(value, int) and value % gbs == 0:
            return value // gbs
        return f"{value} samples" if in_iterations else value

    listed = []
    for name, mine, theirs in differ:
        flag, in_iterations = _SCHEDULER_FLAGS.get(name, (name, False))
        ours, old = (
            shown(mine, in_iterations, args.global_batch_size),
            shown(theirs, in_iterations, saved_gbs),
        )
        listed.append(f"{flag} {ours} here, {old} in the checkpoint")
    raise ConfigError(
        f"--load {args.load}: the learning-rate schedule differs from the checkpoint's: "
        + "; ".join(listed)
        + ". Pass --override-opt_param-scheduler to follow the flags, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule"
    )


def _batch_stream(dataset, args) -> BatchStream | None:
    if dataset is None:
        return None
    return BatchStream(
        dataset,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        num_workers=args.num_workers,
        dataloader_type=args.dataloader_type,
    )


def _iterators(chunks, stream: BatchStream, consumed_samples: int, args) -> list:
    """Per chunk, an iterator over this step's microbatches (None for a chunk that reads no data)."""
    reads = [c.pre_process or c.post_process for c in chunks]
    batches = stream.step(consumed_samples, args.num_microbatches) if any(reads) else []
    return [iter(batches) if r else None for r in reads]


def _one_or_list(items: list):
    return items if len(items) > 1 else items[0]


def _tokenizer_record(args) -> dict | None:
    """What the checkpoint copies of the tokenizer: its type, files and (NullTokenizer) vocabulary size."""
    if not getattr(args, "tokenizer_type", None):
        return None
    roles = ("tokenizer_model", "vocab_file", "merge_file")  # GPT2BPETokenizer has the last two
    files = {role: getattr(args, role) for role in roles if getattr(args, role, None)}
    record = {"type": args.tokenizer_type, "files": files}
    if args.tokenizer_type == "NullTokenizer":
        record["vocab_size"] = args.vocab_size
    return record


def _save(args, chunks, optimizer, scheduler, state: TrainState) -> None:
    faults.phase("saving a checkpoint", state.iteration)
    for chunk in chunks:  # the weights must be whole before they are written
        chunk.finish_param_sync()
    path = checkpointing.save_checkpoint(
        args.save,
        state.iteration,
        model_chunks=chunks,
        optimizer=optimizer,
        scheduler_state=scheduler.state_dict(),
        consumed_samples=state.consumed_samples,
        tokenizer=_tokenizer_record(args),
        args=args,
        extra={
            "wandb_run_id": state.wandb_run_id,
            "skipped_iterations": state.skipped_iterations,
            "nan_iterations": state.nan_iterations,
        },
    )
    print_rank_0(f"saved checkpoint {path}")


def _load(args, chunks, optimizer, scheduler, state: TrainState) -> None:
    loaded = checkpointing.load_checkpoint(
        args.load,
        model_chunks=chunks,
        optimizer=optimizer,
        iteration=args.ckpt_step,
        load_optim=not args.no_load_optim and not args.finetune,
        load_rng=not args.no_load_rng and not args.finetune,
        finetune=args.finetune,
        verify=args.verify_checkpoint,
        exit_on_missing=args.exit_on_missing_checkpoint,
    )
    if loaded is None:
        print_rank_0(f"WARNING: no checkpoint in {args.load}: starting from scratch")
        return
    if loaded.scheduler_state is not None:
        _check_scheduler(args, scheduler, loaded.scheduler_state, loaded.manifest.get("args", {}))
        scheduler.load_state_dict(loaded.scheduler_state)
    extra = loaded.manifest.get("extra", {})
    state.iteration, state.consumed_samples = loaded.iteration, loaded.consumed_samples
    if not args.finetune:
        state.wandb_run_id = extra.get("wandb_run_id")
        state.skipped_iterations = extra.get("skipped_iterations", 0)
        state.nan_iterations = extra.get("nan_iterations", 0)
    if loaded.resharded:
        saved = loaded.manifest["parallel"]
        print_rank_0(
            f"resharded checkpoint {loaded.path} from TP={saved['tp']} PP={saved['pp']} VPP={saved['vpp']} "
            f"DP={saved['dp']} (layout '{saved['layout']}') to this run's split"
        )
    world = dist.get_world_size()
    if not args.no_load_rng and not args.finetune and loaded.rng_restored < world:
        print_rank_0(
            f"RNG states restored on {loaded.rng_restored} of {world} ranks; the other ranks did not exist "
            "in the checkpoint's split and keep fresh seeds, as Megatron seeds a new rank"
        )
    print_rank_0(f"loaded checkpoint {args.load} at iteration {state.iteration}")

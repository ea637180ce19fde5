"""``pretrain()``: Megatron's training loop over Trident's engine.

    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=None)

Order of business: parse and validate every flag before any process group exists (one error on
every rank); set up TP/PP/DP groups; build tokenizer, data, model chunks (wrapped for data
parallelism), optimizer and LR schedule; resume from ``--load``; then train, evaluate, log and save.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.device import bind_local_device, current_device, select_backend
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from core.distributed.distributed_data_parallel import multi_no_sync
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.pipeline_parallel.schedules import get_forward_backward_func
from core.tensor_parallel import model_parallel_seed
from training import checkpointing
from training.argument_checks import validate_args
from training.arguments import config_from_args, parse_and_validate, startup_report
from training.batches import BatchStream
from training.global_vars import set_global_variables
from training.logging_utils import is_logging_rank, print_rank_0, print_rank_last
from training.lr_schedule import build_scheduler
from training.profiling import StepProfiler
from training.progress import Progress
from training.run_control import ExitTimer, ManualGC
from training.run_logging import RunLoggers
from training.signal_handler import SignalHandler
from training.wandb_logging import start_run


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_skipped: int = 0
    wandb_run_id: str | None = None
    losses: list[float] = field(default_factory=list)  # per iteration, on the logging rank
    step_seconds: list[float] = field(default_factory=list)  # wall time of each train step
    progress: Progress | None = None  # timestamps, ETA and the end-of-run summary


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    *,
    argv: list[str] | None = None,
    tokenizer_provider: Callable | None = None,
    args: argparse.Namespace | None = None,
) -> TrainState:
    """Train as the flags say; returns the final state (losses on the rank that logs them).

    ``args``: an already parsed namespace (``training.arguments.parse_args``) instead of ``argv``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args is None:
        args = parse_and_validate(argv, world_size)
    else:
        validate_args(args, world_size)
    select_backend(args.distributed_backend)
    started = ps.initialize_distributed()
    try:
        return _setup_and_train(
            args, train_valid_test_datasets_provider, model_provider, forward_step_func, tokenizer_provider
        )
    finally:
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
) -> TrainState:
    bind_local_device()
    ps.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
    )
    _seed_everything(args.seed)
    tokenizer = _rank0_first(lambda: tokenizer_provider(args)) if tokenizer_provider else None
    set_global_variables(args, tokenizer)
    for line in startup_report(args):
        print_rank_0(line)

    chunks = _build_chunks(model_provider, args)
    optimizer = get_megatron_optimizer(
        config_from_args(OptimizerConfig, args),
        chunks,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )
    scheduler = build_scheduler(optimizer, args)
    state = TrainState()
    if args.load:
        _load(args, chunks, optimizer, scheduler, state)
    train_ds, valid_ds, _ = _rank0_first(lambda: train_valid_test_datasets_provider(args))
    train_ds, valid_ds = (_batch_stream(ds, args) for ds in (train_ds, valid_ds))
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
        )
    for line in state.progress.summary(
        args, iteration=state.iteration, consumed_samples=state.consumed_samples, last=run.last, run=run
    ):
        print_rank_last(line)
    run.finish()
    return state


def _train(
    args, chunks, optimizer, scheduler, forward_step_func, train_ds, valid_ds, state, run, signals, collector
) -> None:
    forward_backward = get_forward_backward_func()
    window: dict[str, Any] = {"loss": [], "time": time.perf_counter(), "iters": 0}
    timer = ExitTimer(args.exit_duration_in_mins, _any_rank)
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
        start = time.perf_counter()
        profiler.before_step(state.iteration)
        loss, grad_norm, applied = _train_step(
            args, chunks, optimizer, forward_backward, forward_step_func, train_ds, state
        )
        state.step_seconds.append(time.perf_counter() - start)
        state.iteration += 1
        profiler.after_step(state.iteration)
        state.consumed_samples += args.global_batch_size
        if applied:
            scheduler.step(increment=args.global_batch_size)
        if loss is not None:
            state.losses.append(loss)
            window["loss"].append(loss)
        window["iters"] += 1
        collector.after_step(state.iteration)
        if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
            _log(args, state, optimizer, grad_norm, window, run)
        if (
            valid_ds is not None
            and args.eval_interval
            and state.iteration % args.eval_interval == 0
            and args.eval_iters > 0
        ):
            with collector.evaluation():
                _evaluate(args, chunks, forward_backward, forward_step_func, valid_ds, state, run)
        stop = args.exit_interval and state.iteration % args.exit_interval == 0
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
        if stop:
            break
    profiler.stop()
    if args.save and saved_at != state.iteration:
        _save(args, chunks, optimizer, scheduler, state)


def _train_step(args, chunks, optimizer, forward_backward, forward_step_func, train_ds, state):
    """One global batch: forward/backward over all microbatches, then the optimizer step (or a skip)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _run_global_batch(
        args, chunks, forward_backward, forward_step_func, train_ds, state.consumed_samples
    )
    bad_loss = _any_rank(loss is not None and not math.isfinite(loss))
    if bad_loss and args.check_for_nan_in_loss_and_grad:
        raise FloatingPointError(
            f"loss is {loss} at iteration {state.iteration + 1} (--check-for-nan-in-loss-and-grad)"
        )
    applied, grad_norm = False, None
    if not bad_loss:
        applied, grad_norm, _ = optimizer.step()
        if not applied and args.check_for_nan_in_loss_and_grad:
            raise FloatingPointError(
                f"gradient norm is {grad_norm} at iteration {state.iteration + 1} "
                "(--check-for-nan-in-loss-and-grad)"
            )
    if applied:
        state.consecutive_skipped = 0
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
    return loss, grad_norm, applied


def _run_global_batch(
    args,
    chunks,
    forward_backward,
    forward_step_func,
    dataset,
    consumed_samples: int,
    forward_only: bool = False,
) -> float | None:
    """One global batch through the pipeline schedule; returns its mean loss on the last stage."""
    iterators = _iterators(chunks, dataset, consumed_samples, args)
    logs = forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=_one_or_list(iterators),
        model=_one_or_list(chunks),
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )
    return _reduce_loss(logs)


def _reduce_loss(logs: list[dict]) -> float | None:
    """Mean "lm loss" over this step's microbatches and data-parallel ranks (last stage only)."""
    if not logs:
        return None
    values = []
    for log in logs:
        value = log["lm loss"]
        if value.numel() == 2:  # (loss sum, tokens) from the per-token contract
            values.append(value)
        else:
            values.append(
                torch.stack([value.reshape(()), torch.ones((), dtype=value.dtype, device=value.device)])
            )
    total = torch.stack(values).sum(0).double()  # (sum of losses, count): microbatches or tokens
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return (total[0] / total[1]).item()


def _shared_run_id(run_id: str | None) -> str | None:
    """The logging rank's W&B run id on every rank (rank 0 writes it into the checkpoint manifest)."""
    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, run_id)
    return next((i for i in ids if i), None)


def _any_rank(flag: bool) -> bool:
    tensor = torch.tensor([1.0 if flag else 0.0], device=current_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def _evaluate(args, chunks, forward_backward, forward_step_func, valid_ds, state, run) -> None:
    losses = []
    for k in range(args.eval_iters):
        with torch.no_grad():
            loss = _run_global_batch(
                args,
                chunks,
                forward_backward,
                forward_step_func,
                valid_ds,
                k * args.global_batch_size,
                forward_only=True,
            )
        if loss is not None:
            losses.append(loss)
    if losses:
        value = sum(losses) / len(losses)
        print_rank_last(
            f" validation loss at iteration {state.iteration} | lm loss value: {value:.6E} | "
            f"lm loss PPL: {math.exp(min(value, 20)):.6E} |"
        )
        run.log({"validation/lm loss": value}, step=state.iteration)


def _log(args, state, optimizer, grad_norm, window, run) -> None:
    now = time.perf_counter()
    elapsed_ms = (now - window["time"]) * 1000 / max(window["iters"], 1)
    tokens_per_s = args.global_batch_size * args.seq_length / (elapsed_ms / 1000)
    lr = optimizer.param_groups[0]["lr"]
    loss = sum(window["loss"]) / len(window["loss"]) if window["loss"] else float("nan")
    norm = float("nan") if grad_norm is None else float(grad_norm)
    state.progress.print_log_line(
        f" iteration {state.iteration:8d}/{args.train_iters:8d} | consumed samples: {state.consumed_samples:12d} | "
        f"elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {lr:.6E} | "
        f"global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} | grad norm: {norm:.3f} | "
        f"tokens/s: {tokens_per_s:.0f} | number of skipped iterations: {state.skipped_iterations:3d} | "
        f"number of nan iterations: {state.nan_iterations:3d} |"
    )
    run.log(
        {
            "lm loss": loss,
            "learning rate": lr,
            "grad norm": norm,
            "tokens per second": tokens_per_s,
            "elapsed time per iteration (ms)": elapsed_ms,
            "consumed samples": state.consumed_samples,
            "skipped iterations": state.skipped_iterations,
            "nan iterations": state.nan_iterations,
        },
        step=state.iteration,
    )
    window.update(loss=[], time=now, iters=0)


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
    """Global rank 0 builds (and caches) first, the others after it; cache files are written atomically."""
    if dist.get_rank() == 0:
        result = build()
        dist.barrier()
    else:
        dist.barrier()
        result = build()
    return result


def _build_chunks(model_provider: Callable, args) -> list[DistributedDataParallel]:
    from models.gpt.gpt_model import pipeline_layout

    vpp = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
        layout = pipeline_layout(args)  # reads the same four fields a TransformerConfig has
        pp_rank = ps.get_pipeline_model_parallel_rank()
        chunk = model_provider(
            pre_process=layout.has_embedding(pp_rank, vp_stage),
            post_process=layout.has_loss(pp_rank, vp_stage),
            vp_stage=vp_stage if vpp > 1 else None,
        )
        chunks.append(chunk)
    ps.set_virtual_pipeline_model_parallel_rank(0 if vpp > 1 else None)
    ddp_config = config_from_args(DistributedDataParallelConfig, args)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    config = chunks[0].config
    config.no_sync_func = multi_no_sync(wrapped) if len(wrapped) > 1 else wrapped[0].no_sync
    if args.overlap_grad_reduce:
        config.grad_sync_func = [c.start_grad_sync for c in wrapped]
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


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


def _model_state(chunks) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, tensor in chunk.module.state_dict().items():
            if name in state and state[name].data_ptr() != tensor.data_ptr():
                raise RuntimeError(f"two model chunks on this rank both hold {name!r}")
            state[name] = tensor
    return state


def _save(args, chunks, optimizer, scheduler, state: TrainState) -> None:
    path = checkpointing.save_checkpoint(
        args.save,
        state.iteration,
        model_state=_model_state(chunks),
        optimizer_state=optimizer.state_dict(),
        scheduler_state=scheduler.state_dict(),
        rng_state=checkpointing.get_rng_state(),
        args=args,
        consumed_samples=state.consumed_samples,
        parallel=checkpointing.current_parallel(),
        extra={
            "wandb_run_id": state.wandb_run_id,
            "skipped_iterations": state.skipped_iterations,
            "nan_iterations": state.nan_iterations,
        },
    )
    print_rank_0(f"saved checkpoint {path}")


def _load(args, chunks, optimizer, scheduler, state: TrainState) -> None:
    model_state = _model_state(chunks)
    loaded = checkpointing.load_checkpoint(
        args.load,
        parallel=checkpointing.current_parallel(),
        expected_model_shapes={k: tuple(v.shape) for k, v in model_state.items()},
        load_optim=not args.no_load_optim and not args.finetune,
        load_rng=not args.no_load_rng and not args.finetune,
        finetune=args.finetune,
        missing_ok=args.load == args.save,
    )
    if loaded is None:
        print_rank_0(f"no checkpoint in {args.load} yet: starting from scratch")
        return
    for chunk in chunks:
        own = chunk.module.state_dict()
        chunk.module.load_state_dict({k: loaded.model_state[k] for k in own})
    if loaded.optimizer_state is not None:
        optimizer.load_state_dict(loaded.optimizer_state)
    else:
        optimizer.reload_model_params()
    if loaded.scheduler_state is not None:
        scheduler.load_state_dict(loaded.scheduler_state)
    if loaded.rng_state is not None:
        checkpointing.set_rng_state(loaded.rng_state)
    extra = loaded.manifest.get("extra", {})
    state.iteration, state.consumed_samples = loaded.iteration, loaded.consumed_samples
    if not args.finetune:
        state.wandb_run_id = extra.get("wandb_run_id")
        state.skipped_iterations = extra.get("skipped_iterations", 0)
        state.nan_iterations = extra.get("nan_iterations", 0)
    print_rank_0(f"loaded checkpoint {args.load} at iteration {state.iteration}")

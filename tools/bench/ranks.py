"""Spawned ranks for the multi-rank benchmarks (``bench_dp``, ``bench_moe``, ``bench_context_parallel``).

A benchmark's worker runs on ``world`` spawned processes (gloo on CPU, NCCL on GPUs) that meet
through a rendezvous file; rank 0 hands its result back through a queue. A training step is timed
between a barrier and the device's sync, and the slowest rank's seconds count, so that every rank
reports the same figure.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.device import bind_local_device, current_device, default_backend
from core.pipeline_parallel.schedules import get_forward_backward_func
from core.spawned import first_result

__all__ = [
    "collect",
    "init_rank",
    "mean_output_step",
    "slowest_seconds",
    "spawn",
    "token_batches",
    "train_step",
]


def spawn(worker: Callable, args: Any, world: int = 2, timeout: float = 3600) -> Any:
    """Run ``worker(rank, args, init_file, results)`` on ``world`` spawned ranks; what one rank puts in
    ``results`` (a clear error as soon as a rank dies)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, args, init_file, results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            return collect(results, procs, timeout)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()


def collect(queue, procs: list, timeout: float = 1800) -> Any:
    """The result a rank puts in ``queue``, or a clear error as soon as a rank dies instead of waiting
    out the timeout."""
    return first_result(queue, procs, timeout, "benchmark")


def init_rank(rank: int, world: int, init_file: str, threads: int) -> None:
    """In a spawned rank: ``threads`` CPU threads, this rank's device, the default process group."""
    torch.set_num_threads(threads)
    os.environ["LOCAL_RANK"] = str(rank)
    bind_local_device()
    dist.init_process_group(default_backend(), init_method=f"file://{init_file}", rank=rank, world_size=world)


def slowest_seconds(step: Callable[[], None]) -> float:
    """Seconds ``step`` takes, from a barrier to the device's sync, on the slowest rank (every rank calls)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    if current_device().type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def token_batches(
    vocab: int, micro_batch_size: int, seq: int, microbatches: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (tokens, labels) microbatches on this rank's device; labels are the tokens (cost, not loss)."""
    gen = torch.Generator().manual_seed(seed)
    device = current_device()
    return [
        (torch.randint(0, vocab, (micro_batch_size, seq), generator=gen).to(device),) * 2
        for _ in range(microbatches)
    ]


def train_step(model, optimizer, batches: list, seq_length: int, micro_batch_size: int, hooks=None) -> None:
    """One training step of ``model`` (DDP-wrapped) over ``batches``, one per microbatch: zero_grad,
    the schedule's forward and backward with :func:`mean_output_step` (and ``hooks``, the model's
    ``schedule_hooks``), the optimizer step."""
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=mean_output_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        schedule_hooks=hooks,
    )
    optimizer.step()


def mean_output_step(data_iterator, model):
    """A forward step whose loss is the mean of the model's output: the benchmarks time the step."""
    tokens, labels = next(data_iterator)
    output = model(tokens, labels=labels)
    return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})

"""Trident's pipeline engine against ``torch.distributed.pipelining`` on real GPT stages.

Each rank runs Trident's real training step (``pretrain()``: the DDP wrapper's gradient buffers,
Megatron's SGD optimizer, the schedule's executor and mailbox) and, between its iterations (through
``iteration_hook``), one step of PyTorch's own schedule over the same stages: the same
``GPTModel`` chunks from the same model provider (so the same weights: initialisation depends only on
the seed and each parameter's name), the same samples, SGD with the same settings. The two engines
take turns step by step, so that a noisy stretch of the machine hits both alike.

What each side runs is what its users write:
- Trident: ``pretrain_gpt.forward_step``, whose last stage computes the loss inside the model.
- torch: ``PipelineStage`` over each chunk; the last stage returns logits, and the schedule's
  ``loss_fn`` is the masked token cross-entropy. ``Schedule1F1B`` for 1F1B and
  ``ScheduleInterleaved1F1B`` for interleaved 1F1B, with the loop placement Trident uses.

The model is a plain GPT (learned positions, LayerNorm, GELU), fp32, embeddings untied (torch's
pipelining has no tied weights across stages), no clipping, constant learning rate. Both sides'
losses are printed: they are the same computation, so they agree to float rounding.

A step is timed from the all-reduce that ends the other engine's step to this rank's end, and the
slowest rank counts. ``--profile`` adds where each engine's host time goes on one rank (cProfile over
the timed steps, top functions by own time).

    python tools/bench/pipelining.py                          # PP=2 and PP=4, 1F1B and interleaved
    python tools/bench/pipelining.py --pp 2 --schedules 1f1b --steps 10 --profile

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import pipelining

import pretrain_gpt
from core import parallel_state as ps
from tools.bench.ranks import spawn
from training import get_args
from training.data.batches import BatchStream

MODEL_FLAGS = [
    "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4095",
    "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip
"""The issue's plain GPT: 8 layers x 256, sequence 128, 8 microbatches of one sample, fp32."""

TRAIN_FLAGS = [
    "--optimizer", "sgd", "--lr", "0.01", "--sgd-momentum", "0.9", "--weight-decay", "0",
    "--clip-grad", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
    "--eval-iters", "0", "--log-interval", str(10**6), "--num-workers", "0",
]  # fmt: skip

SCHEDULES = {"1f1b": 1, "interleaved": 2}
"""Schedule (both engines' 1F1B family) -> model chunks per rank."""


class TorchStage(torch.nn.Module):
    """One Trident ``GPTModel`` chunk as ``torch.distributed.pipelining`` calls a stage: one tensor in
    (token ids on the first stage, hidden states after it), one out (logits on the last stage)."""

    def __init__(self, chunk: torch.nn.Module, positions: torch.Tensor) -> None:
        super().__init__()
        self.chunk, self.positions = chunk, positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(x, self.positions.expand_as(x))
        self.chunk.set_input_tensor([x])
        return self.chunk(None, None)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The masked mean token cross-entropy of one microbatch; ``target`` stacks (labels, loss mask)."""
    labels, mask = target[:, 0], target[:, 1].float()
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (per_token * mask.flatten()).sum() / mask.sum()


@dataclass
class TorchPipeline:
    """PyTorch's schedule over this rank's chunks of the model, fed the samples Trident reads."""

    schedule: str
    chunks: int
    step_fn: object = None
    optimizer: torch.optim.Optimizer | None = None
    stream: BatchStream | None = None
    first: bool = False
    last: bool = False
    consumed: int = 0
    losses: list[float] = field(default_factory=list)

    def build(self) -> None:
        args = get_args()
        pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        positions = torch.arange(args.seq_length).unsqueeze(0)
        indices = [rank + c * pp for c in range(self.chunks)]  # the loop placement
        stages, params = [], []
        for c, index in enumerate(indices):
            chunk = pretrain_gpt.model_provider(
                pre_process=index == 0,
                post_process=index == pp * self.chunks - 1,
                vp_stage=c if self.chunks > 1 else None,
            )
            params += list(chunk.parameters())
            stages.append(
                pipelining.PipelineStage(
                    TorchStage(chunk, positions), index, pp * self.chunks, torch.device("cpu")
                )
            )
        m = args.global_batch_size // args.micro_batch_size
        if self.chunks > 1:
            self.step_fn = pipelining.ScheduleInterleaved1F1B(stages, m, loss_fn=token_loss)
        else:
            self.step_fn = pipelining.Schedule1F1B(stages[0], m, loss_fn=token_loss)
        self.optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.sgd_momentum, weight_decay=0.0)
        dataset, _, _ = pretrain_gpt.train_valid_test_datasets_provider(args)
        self.stream = BatchStream(dataset, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length)
        self.first, self.last = 0 in indices, pp * self.chunks - 1 in indices

    def step(self) -> None:
        args = get_args()
        m = args.global_batch_size // args.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        batches = self.stream.step(self.consumed, m)
        tokens = torch.cat([b["tokens"] for b in batches])
        target = torch.stack(
            [torch.cat([b["labels"] for b in batches]), torch.cat([b["loss_mask"] for b in batches]).long()],
            1,
        )
        losses: list[torch.Tensor] = []
        self.step_fn.step(
            *([tokens] if self.first else []), **({"target": target, "losses": losses} if self.last else {})
        )
        self.optimizer.step()
        self.consumed += args.global_batch_size
        if self.last:
            self.losses.append(torch.stack(losses).mean().item())


class Duel:
    """The iteration hook: times Trident's iteration, then runs and times one torch step.

    Each step gives two figures: wall seconds on the slowest rank, and CPU seconds summed over the
    ranks (``time.process_time``, one thread a rank): the work the step cost, waits excluded, which
    other processes on a shared machine disturb far less."""

    def __init__(self, torch_side: TorchPipeline, profile: bool) -> None:
        self.torch_side = torch_side
        self.seconds: dict[str, list[float]] = {"trident": [], "torch": []}
        self.cpu_seconds: dict[str, list[float]] = {"trident": [], "torch": []}
        self.profilers = {"trident": cProfile.Profile(), "torch": cProfile.Profile()} if profile else None
        self.start: tuple[float, float] | None = None

    def _record(self, engine: str, start: tuple[float, float]) -> None:
        """The step since ``start`` on every rank: wall at its slowest, CPU summed (one all-reduce each,
        which is also the start line of what comes next)."""
        wall = torch.tensor([time.perf_counter() - start[0]], dtype=torch.float64)
        cpu = torch.tensor([time.process_time() - start[1]], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        self.seconds[engine].append(wall.item())
        self.cpu_seconds[engine].append(cpu.item())

    def __call__(self, state) -> None:
        if self.profilers:
            self.profilers["trident"].disable()
        if self.start is not None:
            self._record("trident", self.start)
        else:
            self.torch_side.build()
            dist.barrier()
        start = (time.perf_counter(), time.process_time())
        if self.profilers and state.iteration > 1:
            self.profilers["torch"].enable()
        self.torch_side.step()
        if self.profilers:
            self.profilers["torch"].disable()
        self._record("torch", start)
        self.start = (time.perf_counter(), time.process_time())
        if self.profilers and state.iteration < get_args().train_iters:
            self.profilers["trident"].enable()


def _worker(rank: int, job: dict, init_file: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(job["pp"]), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=job["pp"])
    chunks = SCHEDULES[job["schedule"]]
    flags = [*MODEL_FLAGS, *TRAIN_FLAGS, "--pipeline-model-parallel-size", str(job["pp"])]
    flags += ["--train-iters", str(job["steps"] + job["warmup"] + 1), "--seed", "1234"]
    if chunks > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(chunks)]
    duel = Duel(
        TorchPipeline(job["schedule"], chunks), job["profile"] and rank == job["profile_rank"] % job["pp"]
    )
    state = pretrain_gpt.main(argv=flags, iteration_hook=duel)
    profiles = {}
    for engine, profiler in (duel.profilers or {}).items():
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(job["profile_lines"])
        profiles[engine] = out.getvalue()
    gathered = [None] * job["pp"]
    dist.all_gather_object(gathered, profiles)
    profiles = next(p for p in gathered if p) if job["profile"] else {}
    if rank == job["pp"] - 1:  # the loss stage
        results.put(
            {
                "trident_seconds": duel.seconds["trident"][job["warmup"] :],
                "torch_seconds": duel.seconds["torch"][job["warmup"] + 1 :],
                "trident_cpu": duel.cpu_seconds["trident"][job["warmup"] :],
                "torch_cpu": duel.cpu_seconds["torch"][job["warmup"] + 1 :],
                "trident_losses": [entry["lm loss"] for entry in state.losses],
                "torch_losses": duel.torch_side.losses,
                "profiles": profiles,
            }
        )


def _case(pp: int, schedule: str, args) -> dict:
    job = {
        "pp": pp,
        "schedule": schedule,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile": args.profile,
        "profile_lines": args.profile_lines,
        "profile_rank": args.profile_rank,
    }
    out = spawn(_worker, job, world=pp)
    tokens = 8 * 128
    trident, torch_ = statistics.median(out["trident_seconds"]), statistics.median(out["torch_seconds"])
    gap = max(abs(a - b) for a, b in zip(out["trident_losses"], out["torch_losses"]))
    return {
        "pp": pp,
        "schedule": schedule,
        "trident_ms": round(trident * 1000, 1),
        "torch_ms": round(torch_ * 1000, 1),
        "trident_tokens_per_s": round(tokens / trident, 1),
        "torch_tokens_per_s": round(tokens / torch_, 1),
        "ratio": round(torch_ / trident, 4),
        "trident_cpu_ms": round(statistics.median(out["trident_cpu"]) * 1000, 1),
        "torch_cpu_ms": round(statistics.median(out["torch_cpu"]) * 1000, 1),
        "cpu_ratio": round(statistics.median(out["torch_cpu"]) / statistics.median(out["trident_cpu"]), 4),
        "trident_faster_pairs": sum(t < p for t, p in zip(out["trident_seconds"], out["torch_seconds"])),
        "pairs": min(len(out["trident_seconds"]), len(out["torch_seconds"])),
        "max_loss_gap": gap,
        "steps_compared": min(len(out["trident_losses"]), len(out["torch_losses"])),
        "profiles": out["profiles"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (one rank each)")
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per engine and case")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each case")
    parser.add_argument("--profile", action="store_true", help="cProfile both engines on one rank")
    parser.add_argument("--profile-lines", type=int, default=20)
    parser.add_argument("--profile-rank", type=int, default=-1, help="the rank profiled (-1: the last)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = [_case(pp, schedule, args) for pp in args.pp for schedule in args.schedules]
    load_after = os.getloadavg()
    print(
        f"plain GPT 8 x 256, seq 128, 8 microbatches of 1, fp32, SGD; median of {args.steps} steps a side, "
        "taking turns step by step; ratio = Trident tokens/s over torch.distributed.pipelining's (wall, slowest "
        "rank); CPU = seconds of work summed over the ranks, Trident / torch, and its ratio"
    )
    print(
        f"{'PP':>3} {'schedule':<12}{'trident ms':>11}{'torch ms':>10}{'ratio':>8}"
        f"{'trident faster':>16}{'CPU ms (all ranks)':>20}{'CPU ratio':>10}{'max loss gap':>14}"
    )
    for r in rows:
        print(
            f"{r['pp']:>3} {r['schedule']:<12}{r['trident_ms']:>11.1f}{r['torch_ms']:>10.1f}{r['ratio']:>8.3f}"
            f"{r['trident_faster_pairs']:>10}/{r['pairs']:<5}"
            f"{r['trident_cpu_ms']:>10.0f} /{r['torch_cpu_ms']:>7.0f}{r['cpu_ratio']:>10.3f}{r['max_loss_gap']:>14.2e}"
        )
    for r in rows:
        for engine, text in r.pop("profiles").items():
            print(
                f"--- {engine}, PP={r['pp']} {r['schedule']}, rank {args.profile_rank % r['pp']}, timed steps ---\n{text}"
            )
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    summary = {
        "benchmark": "bench_pipelining",
        "load_average": [round(x, 2) for x in load_after],
        "results": rows,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

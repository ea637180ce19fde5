"""The planner's shared-core timing against the real engine, with no model in between.

    python tools/plan_check_engine.py                 # PP=4 on 4 gloo ranks, 1F1B and interleaved
    python tools/plan_check_engine.py --hidden 256 --seq 256 --steps 8

Every pipeline stage computes a fixed stretch per microbatch: ``units`` products of its ``[seq, 1,
hidden]`` activation with a ``hidden x hidden`` weight, a tanh after each (the weight scaled so that the
values stay normal floats: subnormal ones are many times slower on a CPU), and sends the real fp32
activation on. Nothing else runs: no model, no optimizer.

The host is calibrated as ``--profile-local`` calibrates it (:func:`planner.calibrate.measure_host`: the
shared-core slowdown curve, the message latency, the engine's fixed costs per action and per step from
stages that compute nothing). Each stage's forward and backward are timed alone on one thread. The
planner's shared-core timing (:func:`planner.shared_cores.time_shared`) of the same tables, each action
costing its seconds alone plus the fixed cost per action, predicts the step, which is then run for real
(the slowest rank's median over ``--steps``). Also printed, for all ranks together, a step's CPU
seconds: in all, inside the stages' forwards and backwards (thread CPU), and their compute alone; and the
CPU outside the stages per action (the executor, the messages, the step's own collectives), against the
calibration's fixed cost per action. These are means over every step run, the first one too.

Prints a table, then one JSON line. A benchmark, not a test: the machine's load is printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from core.model_parallel_config import ModelParallelConfig
from core.pipeline_parallel.actions import F
from core.pipeline_parallel.schedule_rules import placement_for
from core.pipeline_parallel.schedule_tables import build_tables
from planner.calibrate import engine_step_seconds, measure_host
from planner.shared_cores import time_shared
from tools.bench.ranks import spawn

WORLD = 4
CASES = ((1, 16, 0), (1, 16, 1), (1, 16, 4), (1, 16, 12), (2, 16, 4))
"""(chunks per rank, microbatches, products per stage and microbatch): 1F1B (one chunk) or interleaved
1F1B (two), from stages that only pass activations on to stages that compute ~10 ms a microbatch."""


class _StageCpu:
    """Thread CPU seconds this rank has spent inside its stages' forwards and backwards."""

    seconds = 0.0


class _BackwardClock(torch.autograd.Function):
    """Identity. Its backward at a stage's output (the stage's first) notes the thread's CPU clock in
    ``mark``; at the stage's input (its last) it adds the CPU since then to ``_StageCpu.seconds``."""

    @staticmethod
    def forward(ctx, x, mark: list[float], at_input: bool):
        ctx.mark, ctx.at_input = mark, at_input
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.at_input:
            _StageCpu.seconds += time.thread_time() - ctx.mark[0]
        else:
            ctx.mark[0] = time.thread_time()
        return grad, None, None


class ComputingStage(torch.nn.Module):
    """A pipeline chunk that computes ``units`` products with tanh, on what it is given (or its start);
    the thread CPU of its forward and backward is added to ``_StageCpu.seconds``."""

    def __init__(self, config, first: bool, last: bool, vp_stage: int, seq: int, hidden: int, units: int):
        super().__init__()
        self.config, self.vp_stage, self.pre_process, self.post_process = config, vp_stage, first, last
        self.start = torch.nn.Parameter(torch.randn(seq, 1, hidden))
        self.weight = torch.nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.units, self.input_tensor = units, None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0]

    def forward(self) -> torch.Tensor:
        start, mark = time.thread_time(), [0.0]
        x = _BackwardClock.apply(self.start if self.pre_process else self.input_tensor, mark, True)
        for _ in range(self.units):
            x = torch.tanh(x @ self.weight)
        x = x if self.units else x * 1.0
        _StageCpu.seconds += time.thread_time() - start
        return _BackwardClock.apply(x, mark, False)


def _worker(rank: int, job: dict, init_file: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        found = {}
        for vpp, m, units in job["cases"]:
            stage = partial(ComputingStage, seq=job["seq"], hidden=job["hidden"], units=units)
            _StageCpu.seconds, cpu = 0.0, time.process_time()
            wall = engine_step_seconds(
                rank, WORLD, "1f1b", vpp, m, job["steps"], stage, hidden=job["hidden"], seq_length=job["seq"]
            )
            # every rank's CPU a step, in and out of its stages (the mean over every step run, the first too)
            cpus = torch.tensor([time.process_time() - cpu, _StageCpu.seconds]) / (job["steps"] + 1)
            dist.all_reduce(cpus)
            found[vpp, m, units] = (wall, *cpus.tolist())
        if rank == 0:
            results.put(found)
    finally:
        dist.destroy_process_group()


def alone_seconds(seq: int, hidden: int, units: int, repeats: int = 20) -> tuple[float, float]:
    """(forward, backward) seconds of one middle stage's microbatch, alone on one thread (medians)."""
    stage = ComputingStage(ModelParallelConfig(hidden_size=hidden), False, False, 0, seq, hidden, units)
    forwards, backwards = [], []
    for _ in range(repeats + 2):
        x = torch.randn(seq, 1, hidden, requires_grad=True)
        stage.set_input_tensor([x])
        start = time.perf_counter()
        out = stage()
        forwards.append(time.perf_counter() - start)
        start = time.perf_counter()
        out.sum().backward()
        backwards.append(time.perf_counter() - start)
    return statistics.median(forwards[2:]), statistics.median(backwards[2:])


def _load() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=128, help="tokens of a microbatch (the activation's rows)")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    load_before = _load()
    measured_host = measure_host(WORLD, cores, dtype=torch.float32)
    host = measured_host.host
    slowdown = partial(host.slowdown_at, cores=cores)
    job = {"seq": args.seq, "hidden": args.hidden, "steps": args.steps, "cases": CASES}
    measured = spawn(_worker, job, world=WORLD)
    print(f"PP={WORLD} on {cores} cores, activations [{args.seq}, 1, {args.hidden}] fp32; host: slowdown "
          f"{[round(s, 2) for s in host.slowdown]}, {1e3 * host.action_seconds:.3f} ms per action, "
          f"{1e3 * host.step_seconds:.2f} ms per step, message latency {1e6 * host.message_latency:.0f} us")  # fmt: skip
    print(f"{'schedule':>11s} {'m':>3s} {'units':>5s} {'F/B alone ms':>13s} {'measured ms':>11s} "
          f"{'predicted ms':>12s} {'error':>6s} {'CPU ms':>7s} {'in stages':>9s} {'alone':>6s} "
          f"{'outside ms/action':>17s}")  # fmt: skip
    rows = []
    for (vpp, m, units), (wall, cpu, in_stages) in measured.items():
        forward, backward = alone_seconds(args.seq, args.hidden, units)
        tables, placement = build_tables("1f1b", WORLD, vpp, m), placement_for("1f1b", WORLD, vpp)
        work = {(a.kind, r, a.chunk): (forward if a.kind == F else backward) + host.action_seconds
                for r, table in enumerate(tables) for a in table}  # fmt: skip
        timed = time_shared(
            tables, placement, work, latency=host.message_latency, processes=1, slowdown=slowdown
        )
        predicted = timed.makespan + host.step_seconds
        compute = WORLD * vpp * m * (forward + backward)
        outside = (cpu - in_stages) / sum(len(table) for table in tables)
        schedule = "interleaved" if vpp > 1 else "1f1b"
        rows.append({"schedule": schedule, "microbatches": m, "units": units, "forward_alone": forward,
                     "backward_alone": backward, "measured": wall, "predicted": predicted, "cpu": cpu,
                     "cpu_in_stages": in_stages, "compute_alone": compute, "cpu_outside_per_action": outside})  # fmt: skip
        print(f"{schedule:>11s} {m:3d} {units:5d} {1e3 * forward:6.2f}/{1e3 * backward:6.2f} {1e3 * wall:11.0f} "
              f"{1e3 * predicted:12.0f} {predicted / wall - 1:+6.0%} {1e3 * cpu:7.0f} {1e3 * in_stages:9.0f} "
              f"{1e3 * compute:6.0f} {1e3 * outside:17.2f}")  # fmt: skip
    result = {"benchmark": "plan_check_engine", "load_before": load_before, "load_after": _load(),
              "slowdown": list(host.slowdown), "action_seconds": host.action_seconds,
              "step_seconds": host.step_seconds, "rows": rows}  # fmt: skip
    print(f"load average before {load_before}, after {result['load_after']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

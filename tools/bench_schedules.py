"""How close does each schedule come to its ideal makespan? Synthetic stages with known costs.

Every rank's forward costs ``--forward-ms`` and its backward ``--backward-ms`` per microbatch,
split evenly over its virtual chunks (sleeps: no compute noise, tiny tensors). The ideal is the
simulator's makespan of the same table with those costs and free communication, so
``measured / ideal`` is the engine's own overhead: communication latency, Python, waiting.

    python tools/bench_schedules.py                      # PP=4, microbatches 8 and 16, all schedules
    python tools/bench_schedules.py --steps 7 --microbatches 8

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.model_parallel_config import ModelParallelConfig
from core.pipeline_parallel.schedule_tables import build_tables
from core.pipeline_parallel.simulator import simulate

SEQ, BATCH, HIDDEN = 16, 1, 16
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)]


PRECISE = True


def busy(seconds: float) -> None:
    """Take ``seconds``: a sleep, finished by a short spin when ``PRECISE``.

    ``time.sleep`` overshoots by about 0.5 ms on these virtual machines, which would be charged to
    the schedule as overhead (5 % of a 10 ms chunk); the spin makes the cost what the ideal assumes.
    """
    if not PRECISE:
        time.sleep(seconds)
        return
    deadline = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.0015)
    while time.perf_counter() < deadline:
        pass


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        busy(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        busy(ctx.backward_s)
        return grad, None, None


class SleepStage(torch.nn.Module):
    def __init__(self, config, forward_s, backward_s, first, last, vp_stage):
        super().__init__()
        self.config, self.vp_stage = config, vp_stage
        self.pre_process, self.post_process = first, last
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self):
        x = self.weight.expand(SEQ, BATCH, HIDDEN) if self.pre_process else self.input_tensor
        return _Sleep.apply(x, self.forward_s, self.backward_s)


class _TorchSleepStage(torch.nn.Module):
    """The same synthetic stage for PyTorch's ``torch.distributed.pipelining`` (the peer)."""

    def __init__(self, forward_s, backward_s):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)


def _torch_schedule(schedule, vpp, m, rank, world, f, b):
    """PyTorch's own schedule over the same stages (stage s on rank s % pp, as in Megatron)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    stages = [
        PipelineStage(_TorchSleepStage(f, b), c * world + rank, world * vpp, torch.device("cpu"))
        for c in range(vpp)
    ]
    loss = lambda out, target: out.float().mean()
    if vpp > 1:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    else:
        sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn=loss)
    batch = torch.zeros(BATCH * m, SEQ, HIDDEN)

    def step():
        if rank == 0:
            sched.step(batch)
        elif rank == world - 1:
            sched.step(target=batch)
        else:
            sched.step()

    return step


def _forward_step(data_iterator, model):
    return model(), lambda out: (out.float().mean(), {})


def _trident_schedule(schedule, vpp, m, rank, world, f, b, record=None):
    from core import parallel_state as ps
    from core.pipeline_parallel.schedules import get_forward_backward_func

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
    )
    config = ModelParallelConfig(
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        hidden_size=HIDDEN,
        pipeline_schedule="gpipe" if schedule == "gpipe" else "1f1b",
    )
    stages = world * vpp
    chunks = [
        SleepStage(config, f, b, c * world + rank == 0, c * world + rank == stages - 1, c) for c in range(vpp)
    ]
    func = get_forward_backward_func()

    def step():
        func(
            forward_step_func=_forward_step,
            data_iterator=[None] * vpp if vpp > 1 else None,
            model=chunks if vpp > 1 else chunks[0],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            record=record,
        )

    return step


def _worker(rank, world, init_file, cases, args, out_queue):
    global PRECISE
    PRECISE = args.sleep == "precise"
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from core import parallel_state as ps

    # The engines take turns step by step on the same case, so a noisy stretch of the machine hits
    # both alike (the comparison is within the run, as the ratios are).
    times: dict[tuple, list[float]] = {case: [] for case in cases}
    for schedule, vpp, m in dict.fromkeys((s, v, m) for _, s, v, m in cases):
        f, b = args.forward_ms / 1000 / vpp, args.backward_ms / 1000 / vpp
        engines = [e for e, s, v, mb in cases if (s, v, mb) == (schedule, vpp, m)]
        steps = {
            e: (_trident_schedule if e == "trident" else _torch_schedule)(schedule, vpp, m, rank, world, f, b)
            for e in engines
        }
        for i in range(args.steps + 1):
            for engine in engines:
                dist.barrier()
                start = time.perf_counter()
                steps[engine]()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i:  # the first step warms up the connections
                    times[(engine, schedule, vpp, m)].append(elapsed.item())
        if "trident" in engines:
            ps.destroy_model_parallel()
    results = [times[case] for case in cases]
    if rank == 0:
        out_queue.put(results)
    dist.destroy_process_group()


def ideal_makespan(schedule: str, pp: int, vpp: int, m: int, forward_ms: float, backward_ms: float) -> float:
    tables = build_tables(schedule, pp, vpp, m)
    return simulate(
        tables, vpp, forward_cost=forward_ms / 1000 / vpp, backward_cost=backward_ms / 1000 / vpp
    ).makespan


def _collect(queue, procs, timeout: float = 1800):
    """Rank 0's results, or a clear error as soon as a rank dies instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty; check the ranks and keep waiting
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a benchmark rank failed (exit codes {dead}); see its traceback above"
                ) from None
    raise TimeoutError(f"benchmark ranks did not finish within {timeout:.0f} s")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per case and engine (after one warm-up step)"
    )
    parser.add_argument(
        "--peer",
        choices=["torch", "none"],
        default="torch",
        help="also run torch.distributed.pipelining's schedules on the same stages, taking turns with Trident step by step",
    )
    parser.add_argument(
        "--sleep",
        choices=["precise", "plain"],
        default="precise",
        help="precise: sleep, then spin to the deadline; plain: time.sleep alone",
    )
    args = parser.parse_args(argv)
    pp = args.pipeline_model_parallel_size
    engines = ["trident"] + (["torch"] if args.peer == "torch" else [])
    cases = [
        (e, s, v, m)
        for m in args.microbatches
        for s, v in SCHEDULES
        for e in engines
        if not (s == "interleaved" and (m % pp or m < pp))
    ]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, pp, os.path.join(tmp, "rdzv"), cases, args, queue))
            for r in range(pp)
        ]
        for p in procs:
            p.start()
        try:
            results = _collect(queue, procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    rows = []
    print(
        f"PP={pp}, forward {args.forward_ms} ms + backward {args.backward_ms} ms per microbatch and rank, "
        f"median of {args.steps} steps, {args.sleep} sleep"
    )
    print(f"{'engine':<9}{'schedule':<17}{'m':>4}{'ideal ms':>10}{'median ms':>11}{'min ms':>9}{'ratio':>8}")
    for (engine, schedule, vpp, m), times in zip(cases, results):
        ideal = ideal_makespan(schedule, pp, vpp, m, args.forward_ms, args.backward_ms)
        median = statistics.median(times)
        name = schedule if vpp == 1 else f"{schedule} v={vpp}"
        rows.append(
            {
                "engine": engine,
                "schedule": name,
                "microbatches": m,
                "ideal_ms": round(ideal * 1000, 2),
                "median_ms": round(median * 1000, 2),
                "min_ms": round(min(times) * 1000, 2),
                "ratio": round(median / ideal, 4),
            }
        )
        print(
            f"{engine:<9}{name:<17}{m:>4}{ideal * 1000:>10.1f}{median * 1000:>11.1f}{min(times) * 1000:>9.1f}"
            f"{median / ideal:>8.3f}"
        )
    summary = {
        "benchmark": "bench_schedules",
        "pp": pp,
        "sleep": args.sleep,
        "forward_ms": args.forward_ms,
        "backward_ms": args.backward_ms,
        "steps": args.steps,
        "results": rows,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

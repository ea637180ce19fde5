"""How close does each schedule come to its ideal makespan? Synthetic stages with known costs.

Every rank's forward costs ``--forward-ms`` per microbatch, the input-gradient half of its backward
``--input-ms`` and the weight-gradient half ``--weight-ms`` (a fused backward costs both), split
evenly over its virtual chunks. The costs are sleeps inside autograd nodes placed as in a real layer
(the input-gradient node on the path from the stage's input, the weight-gradient node on a branch
from a parameter), so the zero-bubble split runs each half where it belongs: no compute noise,
tiny tensors. As in any model, the first stage's input needs no gradient, so its input-gradient
half runs inside its W. A stage's costs count from the moment it starts (``StageClock``), so its
own few operations are inside them. The ideal is the simulator's makespan of the same complete
tables with those costs and free communication, so ``measured / ideal`` is the engine's own
overhead: communication latency, Python, waiting.

PyTorch's ``torch.distributed.pipelining`` runs the same stages with its own schedules (GPipe, 1F1B,
interleaved 1F1B, ``ScheduleInterleavedZeroBubble`` for ZB-H1 and its interleaved form,
``ScheduleZBVZeroBubble``), the two engines taking turns step by step on each case. Its first stage
also starts from an embedding, so both engines run exactly the same backward.

    python tools/bench/schedules.py                      # PP=4, microbatches 8 and 16, all schedules
    python tools/bench/schedules.py --steps 7 --microbatches 8 --peer none

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from core.model_parallel_config import ModelParallelConfig
from core.pipeline_parallel.actions import B, F, I, W
from core.pipeline_parallel.schedule_rules import CLI_SCHEDULES, placement_for, schedule_rule
from core.pipeline_parallel.schedule_tables import build_tables, check_interleaving
from core.pipeline_parallel.simulator import simulate
from tools.bench.ranks import collect

SEQ, BATCH, HIDDEN = 16, 1, 16
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-h1", 2), ("zbv", 2)]

PRECISE = True


class StageClock:
    """Where a synthetic stage's costs count from, so that its own few operations fall inside them.

    After a pause (between pipeline actions, other ranks on the core) even a tiny tensor operation
    costs tens of microseconds on these 2-core machines, and the stage's dozen of them add about
    half a millisecond a chunk: 5 % of a 10 ms chunk that the ideal does not have, charged to the
    engine. So the forward's cost counts from the moment the stage's forward starts, and a
    backward's from the moment autograd reaches the stage's output node; everything the engine does
    outside the stage is still measured. ``mark`` is that moment (None: count from the cost node).
    """

    __slots__ = ("mark",)

    def __init__(self) -> None:
        self.mark: float | None = time.perf_counter()


def spend(clock: StageClock, seconds: float, *, keep_mark: bool = False) -> None:
    """Take ``seconds`` from ``clock.mark`` (a sleep, then a short spin to the deadline).

    ``time.sleep`` alone overshoots by about 0.5 ms on these virtual machines. ``keep_mark`` leaves
    the deadline as the mark, for the cost node that runs next in the same backward. With
    ``PRECISE`` off it is a plain ``time.sleep(seconds)`` from wherever the node starts.
    """
    if not PRECISE:
        time.sleep(seconds)
        return
    start = time.perf_counter() if clock.mark is None else clock.mark
    deadline = start + seconds
    remaining = deadline - time.perf_counter()
    if remaining > 0.002:
        time.sleep(remaining - 0.0015)
    while time.perf_counter() < deadline:
        pass
    clock.mark = deadline if keep_mark else None


class _CostlyIdentity(torch.autograd.Function):
    """Identity whose backward costs ``seconds``: on the input's path the input-gradient half, on a
    parameter's branch the weight-gradient half (``keep_mark``: a fused backward's input half follows)."""

    @staticmethod
    def forward(ctx, x, clock, seconds, keep_mark):
        ctx.clock, ctx.seconds, ctx.keep_mark = clock, seconds, keep_mark
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        spend(ctx.clock, ctx.seconds, keep_mark=ctx.keep_mark)
        return grad, None, None, None


class _Output(torch.autograd.Function):
    """The sum of the two paths; where a backward (or a W replaying the join) starts the clock."""

    @staticmethod
    def forward(ctx, x, weight, clock):
        ctx.clock = clock
        return x + weight

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.mark = time.perf_counter()
        return grad, grad, None


def _stage_output(x, weight, costs, clock: StageClock):
    """The stage's output; its forward costs F in all, counted from ``clock``'s mark."""
    forward_s, input_s, weight_s = costs
    out = _Output.apply(
        _CostlyIdentity.apply(x, clock, input_s, False),
        _CostlyIdentity.apply(weight, clock, weight_s, True),
        clock,
    )
    spend(clock, forward_s)  # last, so that the operations above are inside the forward's cost
    return out


class SleepStage(torch.nn.Module):
    """Trident's synthetic chunk: ``set_input_tensor`` and Megatron's pre/post flags."""

    def __init__(self, config, costs, first, last, vp_stage):
        super().__init__()
        self.config, self.vp_stage, self.costs = config, vp_stage, costs
        self.pre_process, self.post_process = first, last
        self.embedding = torch.nn.Parameter(torch.ones(SEQ, BATCH, HIDDEN))
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self):
        clock = StageClock()
        x = self.embedding if self.pre_process else self.input_tensor
        return _stage_output(x, self.weight, self.costs, clock)


class _TorchSleepStage(torch.nn.Module):
    """The same synthetic stage for PyTorch's ``torch.distributed.pipelining`` (the peer).

    The first stage ignores the batch and starts from its embedding, as Trident's does: the batch
    needs no gradient, so a stage that started from it would skip its input-gradient half (20 ms
    less backward on the first rank than Trident's stage, and than the ideal assumes).
    """

    def __init__(self, costs, first: bool):
        super().__init__()
        self.costs, self.first = costs, first
        self.embedding = torch.nn.Parameter(torch.ones(SEQ, BATCH, HIDDEN))
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        clock = StageClock()
        if self.first:
            x = self.embedding
        return _stage_output(x, self.weight, self.costs, clock)


def _torch_schedule(schedule, vpp, m, rank, world, costs):
    """PyTorch's own schedule over the same stages, on the same placement as Trident's."""
    from torch.distributed import pipelining as pl

    placement = placement_for(schedule, world, vpp)
    indices = [placement.stage(rank, c) for c in range(vpp)]
    stages = [
        pl.PipelineStage(_TorchSleepStage(costs, s == 0), s, world * vpp, torch.device("cpu"))
        for s in indices
    ]
    loss = lambda out, target: out.float().mean()
    if schedule == "zbv":
        sched = pl.ScheduleZBVZeroBubble(stages, m, loss_fn=loss)
    elif schedule == "zb-h1":
        sched = pl.ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss)
    elif vpp > 1:
        sched = pl.ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    else:
        sched = (pl.ScheduleGPipe if schedule == "gpipe" else pl.Schedule1F1B)(stages[0], m, loss_fn=loss)
    batch = torch.zeros(BATCH * m, SEQ, HIDDEN)
    first, last = 0 in indices, world * vpp - 1 in indices

    def step():
        sched.step(*([batch] if first else []), **({"target": batch} if last else {}))

    return step


def _forward_step(data_iterator, model):
    return model(), lambda out: (out.float().mean(), {})


def _trident_schedule(schedule, vpp, m, rank, world, costs, record=None):
    from core import parallel_state as ps
    from core.pipeline_parallel.schedules import get_forward_backward_func

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
    )
    config = ModelParallelConfig(
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        hidden_size=HIDDEN,
        pipeline_schedule=config_schedule(schedule),
    )
    placement = placement_for(schedule, world, vpp)
    stages = [placement.stage(rank, c) for c in range(vpp)]
    chunks = [SleepStage(config, costs, s == 0, s == world * vpp - 1, c) for c, s in enumerate(stages)]
    func = get_forward_backward_func()

    def step(record=record):
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


def _costs(args, vpp: int) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one chunk and microbatch."""
    return tuple(ms / 1000 / vpp for ms in (args.forward_ms, args.input_ms, args.weight_ms))


def _worker(rank, world, init_file, cases, args, out_queue):
    from core.pipeline_parallel.executor import ScheduleRecord

    global PRECISE
    PRECISE = args.sleep == "precise"
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from core import parallel_state as ps

    # The engines take turns step by step on the same case, so a noisy stretch of the machine hits
    # both alike (the comparison is within the run, as the ratios are).
    times: dict[tuple, list[float]] = {case: [] for case in cases}
    peaks: dict[tuple, int] = {}
    for schedule, vpp, m in dict.fromkeys((s, v, m) for _, s, v, m in cases):
        engines = [e for e, s, v, mb in cases if (s, v, mb) == (schedule, vpp, m)]
        record = ScheduleRecord()  # filled by the warm-up step only: timed steps record nothing
        steps = {
            e: _trident_schedule(schedule, vpp, m, rank, world, _costs(args, vpp))
            if e == "trident"
            else _torch_schedule(schedule, vpp, m, rank, world, _costs(args, vpp))
            for e in engines
        }
        for i in range(args.steps + 1):
            for engine in engines:
                dist.barrier()
                start = time.perf_counter()
                if engine == "trident" and i == 0:
                    steps[engine](record)
                else:
                    steps[engine]()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i:  # the first step warms up the connections
                    times[(engine, schedule, vpp, m)].append(elapsed.item())
        if "trident" in engines:
            peak = torch.tensor([record.peak_in_flight])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[(schedule, vpp, m)] = int(peak.item())
            ps.destroy_model_parallel()
    if rank == 0:
        out_queue.put(([times[case] for case in cases], peaks))
    dist.destroy_process_group()


def ideal_makespan(schedule: str, pp: int, vpp: int, m: int, args) -> float:
    """The simulator's makespan with the stages' costs (the first stage's I is empty, its W both halves)."""
    forward_s, input_s, weight_s = _costs(args, vpp)
    placement = placement_for(schedule, pp, vpp)

    def cost(action, rank: int) -> float:
        first = placement.stage(rank, action.chunk) == 0
        return {
            F: forward_s,
            B: input_s + weight_s,
            I: 0.0 if first else input_s,
            W: input_s + weight_s if first else weight_s,
        }[action.kind]

    tables = build_tables(schedule, pp, vpp, m)
    return simulate(tables, placement, cost, cost, input_cost=cost, weight_cost=cost).makespan


def config_schedule(schedule: str) -> str:
    """The ``pipeline_schedule`` that runs table ``schedule`` ("interleaved" is 1F1B with chunks)."""
    return next(
        (name for name in CLI_SCHEDULES if schedule_rule(name).interleaved_form == schedule), schedule
    )


def runs(schedule: str, vpp: int, pp: int, microbatches: int) -> bool:
    """Whether the table runs ``microbatches`` at ``vpp`` chunks per rank (Megatron's interleaving
    rule, at the default group size, where the schedule groups its microbatches)."""
    if not schedule_rule(schedule).groups_microbatches(vpp):
        return True
    try:
        check_interleaving(pp, vpp, microbatches)
    except ValueError:
        return False
    return True


def _name(schedule: str, vpp: int) -> str:
    if schedule == "zb-h1" and vpp > 1:
        return f"interleaved zb v={vpp}"
    return schedule if vpp == 1 or schedule == "zbv" else f"{schedule} v={vpp}"


def _run(args, cases) -> tuple[list, dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    pp = args.pipeline_model_parallel_size
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, pp, os.path.join(tmp, "rdzv"), cases, args, queue))
            for r in range(pp)
        ]
        for p in procs:
            p.start()
        try:
            return collect(queue, procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--input-ms", type=float, default=20.0, help="input-gradient half of the backward")
    parser.add_argument("--weight-ms", type=float, default=20.0, help="weight-gradient half of the backward")
    parser.add_argument(
        "--schedules", nargs="+", default=[_name(s, v) for s, v in SCHEDULES], help="a subset, by table name"
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per case and engine (after one warm-up)"
    )
    parser.add_argument(
        "--peer",
        choices=["torch", "none"],
        default="torch",
        help="also run torch.distributed.pipelining's schedules on the same stages, taking turns step by step",
    )
    parser.add_argument(
        "--sleep",
        choices=["precise", "plain"],
        default="precise",
        help="precise: costs count from the stage's start (StageClock), a sleep then a spin to the "
        "deadline; plain: time.sleep of each cost alone",
    )
    args = parser.parse_args(argv)
    pp = args.pipeline_model_parallel_size
    engines = ["trident"] + (["torch"] if args.peer == "torch" else [])
    chosen = [(s, v) for s, v in SCHEDULES if _name(s, v) in args.schedules]
    cases = [(e, s, v, m) for m in args.microbatches for s, v in chosen for e in engines if runs(s, v, pp, m)]
    results, peaks = _run(args, cases)
    print(
        f"PP={pp}, per microbatch and rank: forward {args.forward_ms} ms, input gradient {args.input_ms} ms, "
        f"weight gradient {args.weight_ms} ms; median of {args.steps} steps, {args.sleep} sleep"
    )
    print(
        f"{'engine':<9}{'schedule':<22}{'m':>4}{'ideal ms':>10}{'median ms':>11}{'min ms':>9}"
        f"{'ratio':>8}{'peak':>6}"
    )
    rows = []
    for (engine, schedule, vpp, m), times in zip(cases, results):
        ideal = ideal_makespan(schedule, pp, vpp, m, args)
        median = statistics.median(times)
        peak = peaks.get((schedule, vpp, m)) if engine == "trident" else None
        rows.append(
            {
                "engine": engine,
                "schedule": _name(schedule, vpp),
                "microbatches": m,
                "ideal_ms": round(ideal * 1000, 2),
                "median_ms": round(median * 1000, 2),
                "min_ms": round(min(times) * 1000, 2),
                "ratio": round(median / ideal, 4) if ideal else None,
                "peak_in_flight": peak,
            }
        )
        print(
            f"{engine:<9}{_name(schedule, vpp):<22}{m:>4}{ideal * 1000:>10.1f}{median * 1000:>11.1f}"
            f"{min(times) * 1000:>9.1f}{median / ideal if ideal else float('nan'):>8.3f}"
            f"{'' if peak is None else peak:>6}"
        )
    comparisons = _comparisons(rows)
    for line in comparisons:
        print(line)
    summary = {
        "benchmark": "bench_schedules",
        "pp": pp,
        "sleep": args.sleep,
        "forward_ms": args.forward_ms,
        "input_ms": args.input_ms,
        "weight_ms": args.weight_ms,
        "steps": args.steps,
        "load": os.getloadavg()[0],
        "results": rows,
    }
    print(json.dumps(summary))
    return summary


def _comparisons(rows: list[dict]) -> list[str]:
    """Trident's zero-bubble schedules against their 1F1B counterparts, in the same run."""
    median = {(r["engine"], r["schedule"], r["microbatches"]): r["median_ms"] for r in rows}
    lines = []
    for m in sorted({r["microbatches"] for r in rows}):
        for fast, slow in (
            ("zb-h1", "1f1b"),
            ("zbv", "interleaved v=2"),
            ("interleaved zb v=2", "interleaved v=2"),
        ):
            if ("trident", fast, m) in median and ("trident", slow, m) in median:
                ratio = median[("trident", fast, m)] / median[("trident", slow, m)]
                lines.append(f"m={m}: trident {fast} / {slow} = {ratio:.3f}")
    return lines


if __name__ == "__main__":
    main()

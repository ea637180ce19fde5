"""Draw a pipeline schedule as a text timeline: one row per rank, one column per time slot.

    python tools/schedule_timeline.py --schedule 1f1b --pp 4 --microbatches 8
    python tools/schedule_timeline.py --schedule interleaved --pp 4 --vpp 2 --microbatches 8 --run

Without ``--run`` the timeline is the simulator's (forward 1 unit, backward 2, per chunk divided by
the virtual size). With ``--run`` the same table is executed on real gloo ranks with synthetic
stages (``tools/bench_schedules.py``'s sleeps) and the measured timeline is drawn under the
simulated one, so idle gaps caused by communication show up next to the ideal.
Cells: ``F3``/``B3`` = forward/backward of microbatch 3 (lower case on virtual chunks > 0),
``.`` = idle.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.pipeline_parallel.schedule_tables import build_tables
from core.pipeline_parallel.simulator import simulate

Events = list[list[tuple[str, float, float]]]  # per rank: (action, start, end)


def render(events: Events, slot: float, width: int = 4) -> str:
    """Each rank's events on a grid of ``slot``-long cells; a cell shows the action running at its middle."""
    end = max(e for rank in events for _, _, e in rank)
    cells = int(end / slot + 0.5)
    lines = []
    for r, rank_events in enumerate(events):
        row = []
        for c in range(cells):
            t = (c + 0.5) * slot
            label = next((_label(a) for a, s, e in rank_events if s <= t < e), ".")
            row.append(label.ljust(width)[:width])
        lines.append(f"rank {r} |" + "".join(row))
    return "\n".join(lines)


def _label(action: str) -> str:
    chunk, rest = action[0], action[1:]  # "1F3" -> chunk 1, "F3"
    return rest if chunk == "0" else rest.lower()


def simulated(schedule: str, pp: int, vpp: int, m: int, forward: float, backward: float) -> Events:
    tables = build_tables(schedule, pp, vpp, m)
    result = simulate(tables, vpp, forward_cost=forward / vpp, backward_cost=backward / vpp)
    events = []
    for r, table in enumerate(tables):
        events.append(
            [
                (str(a), s, s + (forward if a.kind == "F" else backward) / vpp)
                for a, s in zip(table, result.start_times[r])
            ]
        )
    return events


def _measure(rank, world, init_file, schedule, vpp, m, forward_ms, backward_ms, queue):
    import time

    import torch
    import torch.distributed as dist

    from core.pipeline_parallel.executor import ScheduleRecord
    from tools.bench_schedules import _trident_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    record = ScheduleRecord()
    step = _trident_schedule(
        schedule, vpp, m, rank, world, forward_ms / 1000 / vpp, backward_ms / 1000 / vpp, record=record
    )
    step()  # warm-up
    record.events.clear()
    dist.barrier()
    t0 = time.perf_counter()
    step()
    queue.put((rank, [(a, (s - t0) * 1000, (e - t0) * 1000) for a, s, e in record.events]))
    dist.destroy_process_group()


def measured(schedule: str, pp: int, vpp: int, m: int, forward_ms: float, backward_ms: float) -> Events:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_measure,
                args=(r, pp, os.path.join(tmp, "rdzv"), schedule, vpp, m, forward_ms, backward_ms, queue),
            )
            for r in range(pp)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return [results[r] for r in range(pp)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument(
        "--run", action="store_true", help="also run it on real gloo ranks and draw the measurement"
    )
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    args = parser.parse_args(argv)
    vpp = args.vpp if args.schedule == "interleaved" else 1
    slot = args.forward_ms / vpp
    sim = simulated(args.schedule, args.pp, vpp, args.microbatches, args.forward_ms, args.backward_ms)
    makespan = max(e for rank in sim for _, _, e in rank)
    print(
        f"simulated {args.schedule} PP={args.pp} VPP={vpp} m={args.microbatches}: {makespan:.1f} ms, "
        f"one cell = {slot:g} ms"
    )
    print(render(sim, slot))
    if args.run:
        real = measured(args.schedule, args.pp, vpp, args.microbatches, args.forward_ms, args.backward_ms)
        span = max(e for rank in real for _, _, e in rank)
        print(f"\nmeasured on {args.pp} gloo ranks: {span:.1f} ms ({span / makespan:.3f} x the simulation)")
        print(render(real, slot))


if __name__ == "__main__":
    main()

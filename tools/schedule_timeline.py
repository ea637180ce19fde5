"""Draw a pipeline schedule as a text timeline: one row per rank, one column per time slot.

    python tools/schedule_timeline.py --schedule 1f1b --pp 4 --microbatches 8
    python tools/schedule_timeline.py --schedule zb-h1 --pp 4 --microbatches 8 --png zb.png
    python tools/schedule_timeline.py --schedule interleaved --pp 4 --vpp 2 --microbatches 8 --run
    python tools/schedule_timeline.py --trace timeline/timeline.json --png again.png

Without ``--run`` the timeline is the simulator's (forward 1 unit, backward 2 or, split, 1 + 1; per
chunk divided by the virtual size). With ``--run`` the same table is executed on real gloo ranks with
synthetic stages (``tools/bench/schedules.py``'s sleeps) and the measured timeline is drawn under the
simulated one, so idle gaps caused by communication show up next to the ideal. ``--trace`` reads
the records ``pretrain_gpt.py --timeline-dir`` wrote (a real training run) instead.
Cells: ``F3``/``B3``/``I3``/``W3`` = forward/backward/input-gradient/weight-gradient of microbatch 3
(lower case on virtual chunks > 0), ``.`` = idle.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.pipeline_parallel.actions import COMPUTE
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE, SCHEDULES, placement_for, schedule_rule
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
    """The simulator's timeline of the complete tables (a split backward costs half a fused one each)."""
    result = simulate(
        build_tables(schedule, pp, vpp, m),
        placement_for(schedule, pp, vpp),
        forward_cost=forward / vpp,
        backward_cost=backward / vpp,
    )
    return [
        [
            (str(a), s, e)
            for a, s, e in zip(table, result.start_times[r], result.end_times[r])
            if a.kind in COMPUTE
        ]
        for r, table in enumerate(result.tables)
    ]


def from_trace(path: str, iteration: int | None = None) -> tuple[Events, str]:
    """One recorded iteration of a training run's ``timeline.json``: its events and a one-line summary."""
    from training.reporting.timeline import COMPUTE as KINDS
    from training.reporting.timeline import load_trace

    data = load_trace(path)
    step = next((s for s in data.iterations if iteration in (None, s.iteration)), None)
    if step is None:
        raise SystemExit(
            f"{path} has no iteration {iteration}; it has {[s.iteration for s in data.iterations]}"
        )
    events = [[(f"{c}{k}{mb}", s, e) for k, mb, c, s, e in r.events if k in KINDS] for r in step.ranks]
    summary = (
        f"{data.schedule} PP={data.pp_size} VPP={data.vpp_size} m={data.num_microbatches}, iteration "
        f"{step.iteration} of a training run: bubble {step.measured_bubble:.3f} measured, "
        f"{step.simulated_bubble:.3f} simulated"
    )
    return events, summary


def _measure(rank, world, init_file, schedule, vpp, m, forward_ms, backward_ms, queue):

    import torch
    import torch.distributed as dist

    from core.pipeline_parallel.executor import ScheduleRecord
    from tools.bench.schedules import _trident_schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    record = ScheduleRecord()
    half = backward_ms / 2000 / vpp  # a backward's input- and weight-gradient halves
    step = _trident_schedule(
        schedule, vpp, m, rank, world, (forward_ms / 1000 / vpp, half, half), record=record
    )
    step()  # warm-up
    record.events.clear()
    dist.barrier()
    t0 = record.clock.now()
    step()
    timed = record.timed(t0)
    events = [(f"{e.chunk}{e.kind}{e.microbatch}", e.start, e.end) for e in timed if e.kind in "FBIW"]
    queue.put((rank, [(a, s * 1000, e * 1000) for a, s, e in events]))
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


def _draw_simulated(events: Events, args, vpp: int) -> str:
    from training.reporting.timeline import IterationTimeline, RankEvents, TimelineData, draw, measured_bubble

    ranks = [
        RankEvents(
            r,
            r,
            True,
            [(a[1:].rstrip("0123456789"), int(a[1:].lstrip("FBIW")), int(a[0]), s, e) for a, s, e in rank],
        )
        for r, rank in enumerate(events)
    ]
    step = IterationTimeline(0, 0.0, ranks)
    step.measured_bubble = step.simulated_bubble = measured_bubble(ranks)
    data = TimelineData(f"{args.schedule} (simulated)", args.pp, vpp, args.microbatches, [step])
    return draw(data, args.png)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument(
        "--run", action="store_true", help="also run it on real gloo ranks and draw the measurement"
    )
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    parser.add_argument("--trace", help="a timeline.json written by pretrain_gpt.py --timeline-dir")
    parser.add_argument(
        "--iteration", type=int, help="with --trace: which recorded iteration (default: the first)"
    )
    parser.add_argument("--png", help="also draw the timeline into this PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.trace:
        events, summary = from_trace(args.trace, args.iteration)
        print(summary)
        print(render(events, max(e for rank in events for _, _, e in rank) / 100, width=5))
        if args.png:
            from training.reporting.timeline import draw, load_trace

            print(f"wrote {draw(load_trace(args.trace), args.png)}")
        return
    rule = schedule_rule(args.schedule)
    vpp = rule.chunks or (args.vpp if rule.interleaves else 1)
    slot = args.forward_ms / vpp
    sim = simulated(args.schedule, args.pp, vpp, args.microbatches, args.forward_ms, args.backward_ms)
    makespan = max(e for rank in sim for _, _, e in rank)
    print(
        f"simulated {args.schedule} PP={args.pp} VPP={vpp} m={args.microbatches}: {makespan:.1f} ms, "
        f"one cell = {slot:g} ms"
    )
    print(render(sim, slot))
    if args.png:
        print(f"wrote {_draw_simulated(sim, args, vpp)}")
    if args.run:
        real = measured(args.schedule, args.pp, vpp, args.microbatches, args.forward_ms, args.backward_ms)
        span = max(e for rank in real for _, _, e in rank)
        print(f"\nmeasured on {args.pp} gloo ranks: {span:.1f} ms ({span / makespan:.3f} x the simulation)")
        print(render(real, slot))


if __name__ == "__main__":
    main()

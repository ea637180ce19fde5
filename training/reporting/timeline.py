"""A timeline of real training: what every rank did in chosen iterations, as a trace and a picture.

    torchrun --nproc-per-node 4 pretrain_gpt.py --pipeline-model-parallel-size 4 --train-iters 10 \\
        --timeline-dir timeline --timeline-iters 10

For each recorded iteration every rank keeps the executor's events (``ScheduleRecord``): each
forward ``F``, backward ``B`` (or its halves ``I`` and ``W``), each posted send and receive, each wait
for a message, with microbatch and model chunk. On a GPU they are CUDA events, so the times say when
the GPU ran each action (the host only queues it); on a CPU, host times. Rank 0 gathers them and writes

* ``timeline.json``: a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev), one process per
  rank. Its ``trident`` entry holds the run's schedule and the bubble figures; ``load_trace`` reads
  it back (``tools/schedule_timeline.py`` does);
* ``timeline.png`` (needs matplotlib, ``pip install trident[plot]``): one row per rank, boxes
  coloured by microbatch, forward light, backward dark, weight gradients hatched, idle time white.

The log gives the measured bubble (idle share of the pipeline's ranks between the first action and
the last) next to the simulator's for the same complete tables, timed with the measured mean cost
of each action kind on each rank and chunk and free communication: the gap between the two is what
communication and the engine's own overhead cost.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from core import comm_time
from core import parallel_state as ps
from core.device import current_device
from core.pipeline_parallel.actions import ActionKind
from core.pipeline_parallel.executor import ScheduleRecord
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.record import clock_for
from core.pipeline_parallel.schedule_rules import schedule_rule
from core.pipeline_parallel.simulator import simulate
from training.reporting.logging_utils import print_line

if TYPE_CHECKING:
    from training.run import Run

COMPUTE = ("F", "B", "I", "W")
COMMUNICATION = ("DP", *comm_time.KINDS)
"""Per rank and iteration, beside the actions: ``DP`` the span of ``finalize_model_grads`` after the
last action (the data-parallel reduction the step waits for), ``TP`` and ``CP`` (CPU ranks: the host
clock) the seconds spent in tensor-parallel collectives and ring attention's waits, summed over the
iteration's actions and drawn from the schedule's start (``core.comm_time``). Microbatch -1."""


@dataclass
class RankEvents:
    """One rank's events of one iteration, times in ms from the iteration's start."""

    rank: int
    pp_rank: int
    in_first_pipeline: bool  # tensor- and data-parallel rank 0: the pipeline the bubble is measured on
    events: list[tuple[str, int, int, float, float]]  # (kind, microbatch, chunk, start, end)


@dataclass
class IterationTimeline:
    iteration: int
    offset_ms: float  # start, from the first recorded iteration's start
    ranks: list[RankEvents]
    measured_bubble: float = 0.0
    simulated_bubble: float = 0.0


@dataclass
class TimelineData:
    """Everything ``timeline.json`` holds."""

    schedule: str
    pp_size: int
    vpp_size: int
    num_microbatches: int
    iterations: list[IterationTimeline] = field(default_factory=list)
    clock: str = "host"  # "cuda": CUDA events, when the GPU ran each action


def measured_bubble(ranks: list[RankEvents]) -> float:
    """Idle share of the first pipeline's ranks from its first compute action to its last."""
    pipeline = [r for r in ranks if r.in_first_pipeline]
    compute = [[e for e in r.events if e[0] in COMPUTE] for r in pipeline]
    start = min(e[3] for events in compute for e in events)
    end = max(e[4] for events in compute for e in events)
    busy = sum(e[4] - e[3] for events in compute for e in events)
    return 1.0 - busy / (len(pipeline) * (end - start))


def simulated_bubble(tables, placement: Placement, ranks: list[RankEvents]) -> float:
    """The simulator's bubble for the same tables, each action costing its measured mean."""
    durations: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    for r in ranks:
        if r.in_first_pipeline:
            for kind, _, chunk, start, end in r.events:
                if kind in COMPUTE:
                    durations[(r.pp_rank, chunk, kind)].append(end - start)
    mean = {key: sum(v) / len(v) for key, v in durations.items()}

    def cost(action, rank: int) -> float:
        return mean.get((rank, action.chunk, action.kind.value), 0.0)

    result = simulate([list(t) for t in tables], placement, cost, cost, input_cost=cost, weight_cost=cost)
    return result.bubble_fraction


class Timeline:
    """Records the chosen iterations on every rank; rank 0 writes the trace and the picture."""

    def __init__(self, directory: str, iterations: list[int], schedule: str, clock=None):
        self.directory, self.iterations, self.schedule = directory, set(iterations), schedule
        self.clock = clock if clock is not None else clock_for(current_device())
        self.data: TimelineData | None = None
        self._first_start = None  # the clock's stamps
        self._start = None

    @classmethod
    def for_run(cls, run: Run) -> Timeline | None:
        """The timeline ``--timeline-dir`` asks for, or None."""
        iterations = run.logging.timeline_iters  # read either way: it is meaningless without --timeline-dir
        if not run.logging.timeline_dir:
            return None
        schedule = schedule_rule(run.model.pipeline_schedule).label(run.parallel.vpp)
        return cls(run.logging.timeline_dir, iterations or [run.training.train_iters], schedule)

    def wants(self, iteration: int) -> bool:
        return iteration in self.iterations

    def start(self) -> ScheduleRecord:
        """Call on every rank right before the recorded iteration's schedule runs."""
        dist.barrier()  # every rank's clock starts together (to the barrier's skew, well under 1 ms)
        self._start = self.clock.now()
        if self._first_start is None:
            self._first_start = self._start
        if self.clock.name == "host":
            comm_time.begin()
        return ScheduleRecord(clock=self.clock)

    def finish(self, iteration: int, record: ScheduleRecord) -> None:
        """Gather the iteration's events on rank 0 (a collective: every rank calls it)."""
        mine = RankEvents(
            dist.get_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0,
            [(e.kind, e.microbatch, e.chunk, e.start * 1e3, e.end * 1e3) for e in record.timed(self._start)]
            + self._communication(record),
        )
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return
        ranks = sorted(gathered, key=lambda r: r.rank)
        if self.data is None:
            vpp = len({e[2] for r in ranks for e in r.events if e[0] in COMPUTE})
            forwards = {e[1] for r in ranks for e in r.events if e[0] == "F"}
            pp = record.placement.pp_size
            self.data = TimelineData(self.schedule, pp, vpp, len(forwards), clock=self.clock.name)
        step = IterationTimeline(iteration, self.clock.seconds(self._first_start, self._start) * 1e3, ranks)
        step.measured_bubble = measured_bubble(ranks)
        step.simulated_bubble = simulated_bubble(record.tables, record.placement, ranks)
        self.data.iterations.append(step)
        print_line(
            f" timeline of iteration {iteration}: measured bubble {step.measured_bubble:.3f}, "
            f"simulated bubble of the same table {step.simulated_bubble:.3f}"
        )

    def _communication(self, record: ScheduleRecord) -> list[tuple[str, int, int, float, float]]:
        """The iteration's ``DP`` span and ``TP``/``CP`` totals (:data:`COMMUNICATION`), in ms."""
        totals = comm_time.end() if self.clock.name == "host" else {}
        events = []
        if record.finalized is not None:
            end = self.clock.seconds(self._start, record.end) * 1e3
            events.append(("DP", -1, 0, end, self.clock.seconds(self._start, record.finalized) * 1e3))
        begin = self.clock.seconds(self._start, record.start) * 1e3
        events += [(kind, -1, 0, begin, begin + seconds * 1e3) for kind, seconds in totals.items() if seconds]
        return events

    def write(self) -> list[str]:
        """Write timeline.json (and timeline.png with matplotlib) on rank 0; returns the paths."""
        if dist.get_rank() != 0 or self.data is None:
            return []
        os.makedirs(self.directory, exist_ok=True)
        trace = os.path.join(self.directory, "timeline.json")
        with open(trace, "w") as f:
            json.dump(chrome_trace(self.data), f)
        written = [trace]
        try:
            written.append(draw(self.data, os.path.join(self.directory, "timeline.png")))
        except ImportError:
            print_line(" timeline.png needs matplotlib (pip install trident[plot]); wrote the trace only")
        print_line(f" timeline written: {', '.join(written)}")
        return written


# --------------------------------------------------------------------------------------------------
# Chrome trace, written and read back
# --------------------------------------------------------------------------------------------------


def chrome_trace(data: TimelineData) -> dict:
    """Chrome's trace-event format: a complete ("X") event per action, times in microseconds."""
    events = []
    for rank in data.iterations[0].ranks:
        name = f"rank {rank.rank} (pipeline rank {rank.pp_rank})"
        events.append({"ph": "M", "name": "process_name", "pid": rank.rank, "args": {"name": name}})
    for step in data.iterations:
        for rank in step.ranks:
            for kind, mb, chunk, start, end in rank.events:
                events.append(
                    {
                        "name": f"{chunk}{kind}{mb}",
                        "cat": "compute"
                        if kind in COMPUTE
                        else "communication"
                        if kind in COMMUNICATION
                        else "wait"
                        if kind.startswith("WAIT")
                        else "post",
                        "ph": "X",
                        "ts": round((step.offset_ms + start) * 1e3, 3),
                        "dur": round((end - start) * 1e3, 3),
                        "pid": rank.rank,
                        "tid": 0,
                        "args": {"iteration": step.iteration, "kind": kind, "microbatch": mb, "chunk": chunk},
                    }
                )
    summary = {
        "schedule": data.schedule,
        "pp_size": data.pp_size,
        "vpp_size": data.vpp_size,
        "num_microbatches": data.num_microbatches,
        "clock": data.clock,
        "iterations": [
            {
                "iteration": s.iteration,
                "offset_ms": s.offset_ms,
                "measured_bubble": s.measured_bubble,
                "simulated_bubble": s.simulated_bubble,
                "ranks": {str(r.rank): [r.pp_rank, r.in_first_pipeline] for r in s.ranks},
            }
            for s in data.iterations
        ],
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "trident": summary}


def load_trace(path: str) -> TimelineData:
    """The records a ``timeline.json`` holds."""
    with open(path) as f:
        trace = json.load(f)
    meta = trace["trident"]
    data = TimelineData(
        meta["schedule"],
        meta["pp_size"],
        meta["vpp_size"],
        meta["num_microbatches"],
        clock=meta.get("clock", "host"),
    )
    per_step: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    offsets = {s["iteration"]: s["offset_ms"] for s in meta["iterations"]}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            a = e["args"]
            start = e["ts"] / 1e3 - offsets[a["iteration"]]
            per_step[a["iteration"]][e["pid"]].append(
                (a["kind"], a["microbatch"], a["chunk"], start, start + e["dur"] / 1e3)
            )
    for s in meta["iterations"]:
        ranks = [
            RankEvents(int(r), pp, first, per_step[s["iteration"]][int(r)])
            for r, (pp, first) in sorted(s["ranks"].items(), key=lambda kv: int(kv[0]))
        ]
        step = IterationTimeline(s["iteration"], s["offset_ms"], ranks)
        step.measured_bubble, step.simulated_bubble = s["measured_bubble"], s["simulated_bubble"]
        data.iterations.append(step)
    return data


# --------------------------------------------------------------------------------------------------
# The picture
# --------------------------------------------------------------------------------------------------

_SHADE = {"F": 0.45, "B": 1.0, "I": 1.0, "W": 0.75}  # forward light, backward dark


def draw(data: TimelineData, path: str) -> str:
    """One panel per recorded iteration, one row per rank; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = data.iterations
    rows = len(steps[0].ranks)
    fig, axes = plt.subplots(len(steps), 1, figsize=(13, 0.9 + 0.42 * rows * len(steps) + 0.6 * len(steps)))
    axes = list(axes) if len(steps) > 1 else [axes]
    colours = plt.get_cmap("tab10" if data.num_microbatches <= 10 else "tab20")
    for ax, step in zip(axes, steps):
        _panel(ax, step, colours)
        ax.set_title(
            f"{data.schedule}, PP={data.pp_size}"
            + (f" x {data.vpp_size} chunks" if data.vpp_size > 1 else "")
            + f", {data.num_microbatches} microbatches, iteration {step.iteration}: bubble "
            f"{step.measured_bubble:.1%} measured, {step.simulated_bubble:.1%} simulated",
            fontsize=10,
        )
    legend = [
        Patch(facecolor="0.55", alpha=_SHADE["F"], label="F forward"),
        Patch(facecolor="0.55", label="B backward / I input gradient"),
        Patch(facecolor="0.55", alpha=_SHADE["W"], hatch="///", label="W weight gradient"),
        Patch(facecolor="black", label="wait for a message"),
        Patch(facecolor="white", edgecolor="0.7", label="idle"),
    ]
    axes[-1].legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize=8)
    axes[-1].set_xlabel(
        "ms from the start of the iteration (colour: microbatch; F3 = forward of microbatch 3, f3 on chunk 1)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def _panel(ax, step: IterationTimeline, colours) -> None:
    ranks = step.ranks
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for kind, mb, chunk, start, end in rank.events:
            width = end - start
            if kind in COMPUTE:
                ax.broken_barh(
                    [(start, width)],
                    (y + 0.1, 0.8),
                    facecolors=colours(mb % colours.N),
                    alpha=_SHADE[kind],
                    edgecolor="white",
                    linewidth=0.4,
                    hatch="///" if kind == ActionKind.W.value else None,
                )
                if width > 0:
                    ax.text(
                        start + width / 2,
                        y + 0.5,
                        f"{kind}{mb}" if chunk == 0 else f"{kind.lower()}{mb}",  # lower case: chunk 1
                        ha="center",
                        va="center",
                        fontsize=6,
                        clip_on=True,
                    )
            elif kind.startswith("WAIT") and width > 0:
                ax.broken_barh([(start, width)], (y + 0.02, 0.08), facecolors="black")
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r.rank} (pp {r.pp_rank})" for r in ranks], fontsize=8)
    ax.set_ylim(0, len(ranks))
    ax.set_xlim(left=0)
    ax.grid(axis="x", color="0.9", linewidth=0.5)
    ax.set_axisbelow(True)

"""What the planner prints: a ranked table, each candidate's flags, and the JSON line.

The JSON line is ``{"candidates": [...], "rejected": {...}}``: per candidate its sizes, schedule,
micro-batch size, recomputation, layout, ``peak_memory_bytes`` (the largest rank's),
``step_seconds``, ``tokens_per_second_per_gpu``, ``mfu``, the bubble, ``matmul_rates`` (the peak and
precision each kind of matrix product was costed at: FP8 or 16-bit), the per-rank memory breakdown
and ``args``, the exact ``pretrain_gpt.py`` flags that run it; rejected candidates are grouped by
reason with a count and examples.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict

from planner.candidate import Candidate
from planner.hardware import Cluster
from planner.search import OUT_OF_MEMORY, Planned, SearchResult
from planner.step_time import StepParts

__all__ = ["candidate_json", "format_table", "launch_command", "result_json", "run_rank_line"]

GB = 1e9


def candidate_args(base_flags: list[str], cand: Candidate) -> list[str]:
    """The full ``pretrain_gpt.py`` command line of a candidate."""
    return list(base_flags) + cand.flags()


def launch_command(cluster: Cluster, argv: list[str]) -> str:
    """The ``torchrun`` line that runs ``argv``: on one node as is; over several, the same line on every
    node, meeting through torchrun's c10d rendezvous at ``$MASTER_ADDR`` (README's multi-node form)."""
    script = "pretrain_gpt.py " + shlex.join(argv)
    if cluster.num_gpus <= cluster.gpus_per_node:
        return f"torchrun --nproc-per-node {cluster.num_gpus} {script}"
    nodes = cluster.num_gpus // cluster.gpus_per_node
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {cluster.gpus_per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $MASTER_ADDR:29500 {script}"
    )


def candidate_json(planned: Planned, base_flags: list[str]) -> dict:
    c, step, peak = planned.cand, planned.step, planned.peak
    return {
        **c.as_dict(),
        "peak_memory_bytes": int(peak.peak),
        "peak_memory_rank": peak.pp_rank,
        "step_seconds": step.step_seconds,
        "tokens_per_second_per_gpu": step.tokens_per_second_per_gpu,
        "mfu": step.mfu,
        "bubble": step.bubble,
        "exposed_comm_seconds": step.exposed_comm_seconds,
        "step_parts": asdict(step.parts),
        "step_extrapolated": step.extrapolated,
        "matmul_rates": asdict(step.rates) if step.rates else None,
        "memory_per_pp_rank": [
            {
                k: (round(v) if isinstance(v, float) else v)
                for k, v in m.as_dict().items()
                if k != "activation_terms"
            }
            for m in planned.memory
        ],
        "args": candidate_args(base_flags, c),
    }


def result_json(result: SearchResult, base_flags: list[str]) -> str:
    return json.dumps(
        {
            "candidates": [candidate_json(p, base_flags) for p in result.candidates],
            "rejected": result.rejected,
        }
    )


def _row(rank: int, p: Planned) -> list[str]:
    c, s, m = p.cand, p.step, p.peak
    return [
        str(rank),
        c.split(),
        c.schedule_label,
        str(c.micro_batch_size),
        str(c.num_microbatches),
        c.recompute,
        c.sharding_label(),
        f"{m.peak / GB:.1f} (pp{m.pp_rank})",
        f"{s.step_seconds:.3f}",
        f"{s.tokens_per_second_per_gpu:,.0f}",
        f"{s.mfu:.1%}",
        f"{s.bubble:.1%}",
        s.rates.label() if s.rates else "",
    ]


_PARTS = (
    ("compute", "compute"),
    ("shared_cores", "shared cores"),
    ("per_action", "per action"),
    ("messages", "messages"),
    ("bubble", "bubble"),
    ("exposed_comm", "DP comm"),
    ("optimizer", "optimizer"),
    ("per_step", "per step"),
)
TIE = 0.005
"""Steps this close (relative) are called a tie, and the report says how the two differ."""


def step_line(parts: StepParts) -> str:
    """``compute 0.58 + shared cores 0.76 + ... = 1.52 s (12 actions, 6 messages)``: nonzero parts only."""
    shown = [f"{label} {getattr(parts, name):.3f}" for name, label in _PARTS if getattr(parts, name) > 5e-4]
    return (f"{' + '.join(shown) or '0'} = {parts.total():.3f} s ({parts.actions} actions, "
            f"{parts.messages_received} messages in)")  # fmt: skip


def _why_tie(a: StepParts, b: StepParts) -> str:
    """The parts that differ most, each way: how two equal steps spend their time differently."""
    diffs = sorted(((getattr(b, n) - getattr(a, n), label) for n, label in _PARTS), key=lambda d: d[0])
    (less, less_label), (more, more_label) = diffs[0], diffs[-1]
    if abs(less) < 5e-4 and abs(more) < 5e-4:
        return "the same in every part"
    return f"{more_label} +{more:.3f} s, {less_label} {less:.3f} s"


def explain_steps(candidates: list[Planned]) -> list[str]:
    """Each candidate's step broken down (the slowest rank's), and what makes ties tie."""
    lines = []
    for i, p in enumerate(candidates):
        lines.append(f"  step #{i + 1}: {step_line(p.step.parts)}")
        if i and abs(p.step.step_seconds / candidates[i - 1].step.step_seconds - 1) < TIE:
            lines.append(f"    ties #{i}: {_why_tie(candidates[i - 1].step.parts, p.step.parts)}")
    return lines


def format_table(result: SearchResult, cluster: Cluster, base_flags: list[str], *, show_args: int = 1) -> str:
    """The ranked table, the layouts, and the flags of the first ``show_args`` candidates."""
    head = ["#", "split", "schedule", "mbs", "m", "recompute", "DP sharding", "peak GB", "step s", "tok/s/GPU",
            "MFU", "bubble", "products TFLOP/s"]  # fmt: skip
    rows = [head] + [_row(i + 1, p) for i, p in enumerate(result.candidates)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for i, p in enumerate(result.candidates):
        if p.cand.pp > 1:
            lines.append(f"  layout #{i + 1}: {p.cand.layout}")
    lines += explain_steps(result.candidates)
    rejected = "; ".join(f"{reason}: {v['count']}" for reason, v in result.rejected.items())
    lines.append(
        f"{result.fitting} candidates fit in {cluster.usable_bytes / GB:.0f} of {cluster.memory_bytes / GB:.0f} GB "
        f"per GPU, {result.simulated} simulated in {result.seconds:.1f} s ({result.cpu_seconds:.1f} s of CPU); rejected: {rejected or 'none'}"
    )
    if not result.candidates:
        lines += ["nothing fits, for example:"] + [
            f"  {what}" for what in _examples(result, OUT_OF_MEMORY, 3)
        ]
    if cluster.num_gpus > cluster.gpus_per_node and result.candidates[:show_args]:
        lines.append(f"on each of the {cluster.num_gpus // cluster.gpus_per_node} nodes, with MASTER_ADDR set to "
                     "one node's address:")  # fmt: skip
    for i, p in enumerate(result.candidates[:show_args]):
        lines.append(f"#{i + 1}: {launch_command(cluster, candidate_args(base_flags, p.cand))}")
    return "\n".join(lines)


def _examples(result: SearchResult, reason: str, count: int) -> list[str]:
    """The first ``count`` examples rejected for ``reason`` that give their figures (a larger micro-batch
    rejected because a smaller one failed gives none)."""
    examples = result.rejected.get(reason, {}).get("examples", [])
    return [e for e in examples if not e.endswith("does not fit either")][:count]


def run_rank_line(result: SearchResult, run: Candidate) -> str:
    """Where a recorded run's own layout ranks among the re-ranked candidates (``--from-timeline``)."""
    same = ("tp", "pp", "vpp", "cp", "ep", "dp", "schedule", "micro_batch_size", "recompute", "layout")
    for i, p in enumerate(result.candidates):
        if all(getattr(p.cand, name) == getattr(run, name) for name in same):
            best = result.candidates[0].step.step_seconds
            return f"the run's layout ranks #{i + 1}: {p.step.step_seconds / best:.2f}x the top pick's step"
    return (
        f"the run's layout ({run.split()} {run.schedule_label}) is not among the top {len(result.candidates)}"
    )

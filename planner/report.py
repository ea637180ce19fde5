"""What the planner prints: a ranked table, each candidate's flags, and the JSON line.

The JSON line is ``{"candidates": [...], "rejected": {...}}``: per candidate its sizes, schedule,
micro-batch size, recomputation, layout, ``peak_memory_bytes`` (the largest rank's),
``step_seconds``, ``tokens_per_second_per_gpu``, ``mfu``, the bubble, the per-rank memory breakdown
and ``args``, the exact ``pretrain_gpt.py`` flags that run it; rejected candidates are grouped by
reason with a count and examples.
"""

from __future__ import annotations

import json
import shlex

from planner.candidate import Candidate
from planner.hardware import Cluster
from planner.search import Planned, SearchResult

__all__ = ["candidate_json", "format_table", "launch_command", "result_json"]

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
        "step_extrapolated": step.extrapolated,
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
        "yes" if c.distributed_optimizer else "no",
        f"{m.peak / GB:.1f} (pp{m.pp_rank})",
        f"{s.step_seconds:.3f}",
        f"{s.tokens_per_second_per_gpu:,.0f}",
        f"{s.mfu:.1%}",
        f"{s.bubble:.1%}",
    ]


def format_table(result: SearchResult, cluster: Cluster, base_flags: list[str], *, show_args: int = 1) -> str:
    """The ranked table, the layouts, and the flags of the first ``show_args`` candidates."""
    head = ["#", "split", "schedule", "mbs", "m", "recompute", "dist-opt", "peak GB", "step s", "tok/s/GPU",
            "MFU", "bubble"]  # fmt: skip
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
    rejected = "; ".join(f"{reason}: {v['count']}" for reason, v in result.rejected.items())
    lines.append(
        f"{result.fitting} candidates fit in {cluster.usable_bytes / GB:.0f} of {cluster.memory_bytes / GB:.0f} GB "
        f"per GPU, {result.simulated} simulated in {result.seconds:.1f} s ({result.cpu_seconds:.1f} s of CPU); rejected: {rejected or 'none'}"
    )
    if cluster.num_gpus > cluster.gpus_per_node and result.candidates[:show_args]:
        lines.append(f"on each of the {cluster.num_gpus // cluster.gpus_per_node} nodes, with MASTER_ADDR set to "
                     "one node's address:")  # fmt: skip
    for i, p in enumerate(result.candidates[:show_args]):
        lines.append(f"#{i + 1}: {launch_command(cluster, candidate_args(base_flags, p.cand))}")
    return "\n".join(lines)

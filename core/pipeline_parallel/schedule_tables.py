"""Pipeline schedules as data: each rank's ordered list of compute actions.

A table is a pure function of ``(pp_size, vpp_size, num_microbatches, pp_rank)``. Nothing here
talks to another process: the executor runs the tables, the simulator times them and checks them
for deadlocks, and the timeline plot draws them.

Stage numbering follows Megatron's virtual pipeline: stage ``s`` lives on ``pp_rank = s % pp_size``
as model chunk ``s // pp_size``, so activations travel rank 0 -> 1 -> ... -> pp-1 -> 0 (next chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Action:
    """One computation on one rank: forward ("F") or backward ("B") of a microbatch on a chunk."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:  # "1F3": chunk 1, forward, microbatch 3 (PyTorch's notation)
        return f"{self.chunk}{self.kind}{self.microbatch}"


def stage_of(pp_rank: int, chunk: int, pp_size: int) -> int:
    return chunk * pp_size + pp_rank


def rank_and_chunk(stage: int, pp_size: int) -> tuple[int, int]:
    return stage % pp_size, stage // pp_size


def _check_sizes(pp_size: int, vpp_size: int, num_microbatches: int, pp_rank: int) -> None:
    if pp_size < 1 or vpp_size < 1:
        raise ValueError(f"pipeline size ({pp_size}) and virtual pipeline size ({vpp_size}) must be >= 1")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside the pipeline of size {pp_size}")


def gpipe_table(
    pp_size: int, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> list[Action]:
    """All forwards, then all backwards (GPipe): simple, holds every microbatch's activations."""
    _check_sizes(pp_size, 1, num_microbatches, pp_rank)
    forwards = [Action("F", mb) for mb in range(num_microbatches)]
    if forward_only:
        return forwards
    return forwards + [Action("B", mb) for mb in range(num_microbatches)]


def one_f_one_b_table(
    pp_size: int, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> list[Action]:
    """1F1B (PipeDream-Flush), Megatron's non-interleaved schedule.

    Warm-up: rank r runs ``pp - r - 1`` forwards to fill the pipeline. Steady state: one forward,
    one backward. Cool-down: the remaining backwards. Rank r never holds more than ``pp - r``
    microbatches' activations.
    """
    _check_sizes(pp_size, 1, num_microbatches, pp_rank)
    if forward_only:
        return [Action("F", mb) for mb in range(num_microbatches)]
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    table = [Action("F", mb) for mb in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state
        table += [Action("F", warmup + i), Action("B", i)]
    table += [Action("B", mb) for mb in range(m - warmup, m)]  # cool-down
    return table


def check_interleaving(
    pp_size: int, vpp_size: int, num_microbatches: int, microbatch_group_size: int | None = None
) -> int:
    """Megatron's rule for interleaved schedules; returns the microbatch group size N.

    Microbatches run on one chunk in groups of N (default ``pp_size``) before moving to the next
    chunk. A group smaller than ``pp_size`` would make rank 0 need chunk c+1's input before the
    last rank has produced it, so N must lie in [pp, microbatches] and a shorter last group must
    still hold at least pp microbatches.
    """
    n = pp_size if microbatch_group_size is None else microbatch_group_size
    if vpp_size == 1:
        return n
    if num_microbatches < pp_size:
        raise ValueError(
            f"interleaved pipeline schedule needs at least pipeline_model_parallel_size ({pp_size}) "
            f"microbatches, got {num_microbatches}; raise the global batch size or lower "
            "--pipeline-model-parallel-size"
        )
    if not pp_size <= n <= num_microbatches:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage ({n}) must lie between pipeline_model_parallel_size "
            f"({pp_size}) and the number of microbatches ({num_microbatches})"
        )
    tail = num_microbatches % n
    if tail and tail < pp_size:
        raise ValueError(
            f"number of microbatches ({num_microbatches}) leaves a last group of {tail} when grouped by "
            f"microbatch_group_size_per_vp_stage ({n}); with interleaving the remainder must be 0 or at "
            f"least pipeline_model_parallel_size ({pp_size})"
            + (
                " — with the default group size the microbatch count must be a multiple of the pipeline size"
                if microbatch_group_size is None
                else ""
            )
        )
    return n


def interleaved_order(num_microbatches: int, vpp_size: int, group_size: int) -> list[tuple[int, int]]:
    """Forward order of (microbatch, chunk) pairs: N microbatches on chunk 0, the same N on chunk 1, ..."""
    order = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        order += [(mb, chunk) for chunk in range(vpp_size) for mb in group]
    return order


def interleaved_table(
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    pp_rank: int,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
) -> list[Action]:
    """Interleaved 1F1B (Megatron): each rank holds ``vpp_size`` chunks and alternates between them.

    Forwards visit chunks in the group order above; backwards the same order with chunks reversed.
    Warm-up is ``2 (pp - r - 1) + (v - 1) N`` forwards; then one forward, one backward; then the
    remaining backwards. With exactly ``pp`` microbatches Megatron runs all forwards first.
    """
    _check_sizes(pp_size, vpp_size, num_microbatches, pp_rank)
    n = check_interleaving(pp_size, vpp_size, num_microbatches, microbatch_group_size)
    order = interleaved_order(num_microbatches, vpp_size, n)
    forwards = [Action("F", mb, chunk) for mb, chunk in order]
    if forward_only:
        return forwards
    backwards = [Action("B", mb, vpp_size - 1 - chunk) for mb, chunk in order]
    total = len(order)
    if num_microbatches == pp_size:
        warmup = total
    else:
        warmup = min(2 * (pp_size - pp_rank - 1) + (vpp_size - 1) * n, total)
    table = forwards[:warmup]
    for k in range(total - warmup):
        table += [forwards[warmup + k], backwards[k]]
    table += backwards[total - warmup :]
    return table


def build_table(
    schedule: str,
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    pp_rank: int,
    *,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
) -> list[Action]:
    """The table of ``schedule`` ("gpipe", "1f1b" or "interleaved") for one rank."""
    if schedule == "interleaved" or vpp_size > 1:
        if schedule == "gpipe":
            raise ValueError(
                f"the GPipe schedule cannot run virtual stages (vpp_size={vpp_size}); "
                "use pipeline_schedule='1f1b', which interleaves them"
            )
        return interleaved_table(
            pp_size, vpp_size, num_microbatches, pp_rank, microbatch_group_size, forward_only
        )
    if schedule == "gpipe":
        return gpipe_table(pp_size, num_microbatches, pp_rank, forward_only)
    if schedule == "1f1b":
        return one_f_one_b_table(pp_size, num_microbatches, pp_rank, forward_only)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; expected 'gpipe', '1f1b' or 'interleaved'")


def build_tables(
    schedule: str, pp_size: int, vpp_size: int, num_microbatches: int, **kwargs
) -> list[list[Action]]:
    """Every rank's table, index = pp_rank."""
    return [build_table(schedule, pp_size, vpp_size, num_microbatches, r, **kwargs) for r in range(pp_size)]


def format_tables(tables: list[list[Action]]) -> str:
    """A rank x step grid, one row per rank (``0F3`` = chunk 0, forward, microbatch 3)."""
    width = max((len(str(a)) for t in tables for a in t), default=3)
    return "\n".join(f"rank {r}: " + " ".join(str(a).rjust(width) for a in t) for r, t in enumerate(tables))

"""Pipeline schedules as data: each rank's ordered list of compute actions.

A table is a pure function of ``(pp_size, vpp_size, num_microbatches, pp_rank)``. Nothing here
talks to another process: :mod:`~core.pipeline_parallel.lowering` adds the sends and receives,
the executor runs the result, the simulator times it and checks it for deadlocks, and the
timeline draws it. Actions and their text form (``0F3``) are :mod:`~core.pipeline_parallel.actions`'.

Actions name a model chunk of this rank, not a stage; :mod:`~core.pipeline_parallel.placement`
says which stage a chunk is (Megatron's loop for every schedule but ZBV, whose V puts the last
stage next to the first). Which builder makes which schedule's table, and the rules on its chunks,
are the schedule's record (:mod:`~core.pipeline_parallel.schedule_rules`).

Backward comes whole (``B``) or split in two for the zero-bubble schedules (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR 2024): ``I``, the gradient of the stage's input, which the
previous stage is waiting for, and ``W``, the gradient of its weights, which nobody waits for and
so can fill what would otherwise be idle time.
"""

from __future__ import annotations

from collections import Counter

from core.pipeline_parallel.actions import Action, ActionKind, B, F, I, W
from core.pipeline_parallel.schedule_rules import schedule_rule


def _check_sizes(pp_size: int, vpp_size: int, num_microbatches: int, pp_rank: int) -> None:
    if pp_size < 1 or vpp_size < 1:
        raise ValueError(f"pipeline size ({pp_size}) and virtual pipeline size ({vpp_size}) must be >= 1")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside the pipeline of size {pp_size}")


def _forwards_only(table: list[Action]) -> list[Action]:
    """A table's forwards in its order: forwards never wait for a backward, so this cannot deadlock."""
    return [a for a in table if a.kind == F]


def gpipe_table(
    pp_size: int, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> list[Action]:
    """All forwards, then all backwards (GPipe): simple, holds every microbatch's activations."""
    _check_sizes(pp_size, 1, num_microbatches, pp_rank)
    forwards = [Action(F, mb) for mb in range(num_microbatches)]
    if forward_only:
        return forwards
    return forwards + [Action(B, mb) for mb in range(num_microbatches)]


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
        return [Action(F, mb) for mb in range(num_microbatches)]
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    table = [Action(F, mb) for mb in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state
        table += [Action(F, warmup + i), Action(B, i)]
    table += [Action(B, mb) for mb in range(m - warmup, m)]  # cool-down
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


def _interleaved_forwards(
    pp_size: int, vpp_size: int, num_microbatches: int, pp_rank: int, microbatch_group_size: int | None
) -> tuple[int, list[tuple[int, int]], list[Action]]:
    """The group size N, the (microbatch, chunk) order and its forwards, shared by the interleaved tables."""
    _check_sizes(pp_size, vpp_size, num_microbatches, pp_rank)
    n = check_interleaving(pp_size, vpp_size, num_microbatches, microbatch_group_size)
    order = interleaved_order(num_microbatches, vpp_size, n)
    return n, order, [Action(F, mb, chunk) for mb, chunk in order]


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
    n, order, forwards = _interleaved_forwards(
        pp_size, vpp_size, num_microbatches, pp_rank, microbatch_group_size
    )
    if forward_only:
        return forwards
    backwards = [Action(B, mb, vpp_size - 1 - chunk) for mb, chunk in order]
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


def zero_bubble_table(
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    pp_rank: int,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
) -> list[Action]:
    """ZB-H1 (Qi et al. 2024): 1F1B with each backward split into I and W, the W's run late.

    Warm-up: ``pp - r - 1`` forwards, as in 1F1B. Then for every backward step k: a forward (while
    any are left), the input gradient ``I`` of step k, and the weight gradient ``W`` of step
    ``k - r``. Rank r runs each W r steps late; the last r W's fill the cool-down, where 1F1B idles.
    Every rank holds at most ``pp`` microbatches (1F1B's peak, on rank 0), and with equal F, I and
    W costs the bubble shrinks from 1F1B's ``3 (pp - 1)`` units to ``pp - 1``.

    With ``vpp_size > 1`` the same recipe runs on Megatron's interleaved order (an interleaved
    zero-bubble schedule), with warm-up ``pp - r - 1 + (v - 1) N``.
    """
    n, order, forwards = _interleaved_forwards(
        pp_size, vpp_size, num_microbatches, pp_rank, microbatch_group_size
    )
    if forward_only:
        return forwards
    inputs = [Action(I, mb, vpp_size - 1 - chunk) for mb, chunk in order]
    weights = [Action(W, mb, vpp_size - 1 - chunk) for mb, chunk in order]
    total = len(order)
    warmup = min(pp_size - pp_rank - 1 + (vpp_size - 1) * n, total)
    table = forwards[:warmup]  # warm-up
    for k in range(total):  # steady state, then cool-down once the forwards run out
        if warmup + k < total:
            table.append(forwards[warmup + k])
        table.append(inputs[k])
        if k >= pp_rank:
            table.append(weights[k - pp_rank])
    return table + weights[max(total - pp_rank, 0) :]  # the late weight gradients


def zbv_table(pp_size: int, num_microbatches: int, pp_rank: int, forward_only: bool = False) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V, F = I = W fill every slot.

    Rank r holds stage r (chunk 0) and stage ``2 pp - 1 - r`` (chunk 1). The table is planned for a
    full pipeline of ``max(m, 2 pp - 1)`` microbatches, and actions on microbatches that do not
    exist are dropped. Peak: ``2 pp`` chunk activations, 1F1B's ``pp`` microbatches.
    """
    _check_sizes(pp_size, 2, num_microbatches, pp_rank)
    planned = max(num_microbatches, 2 * pp_size - 1)
    done: Counter = Counter()
    table: list[Action] = []

    def run(kind: ActionKind, chunk: int, times: int = 1) -> None:
        for _ in range(times):
            table.append(Action(kind, done[kind, chunk], chunk))
            done[kind, chunk] += 1

    run(F, 0, 2 * (pp_size - pp_rank) - 1)  # down the first leg of the V
    for _ in range(pp_rank):
        run(F, 1)
        run(F, 0)
    for _ in range(pp_size - pp_rank):  # the first backwards reach this rank's second chunk
        run(F, 1)
        run(I, 1)
        run(W, 1)
    while done[F, 1] < done[F, 0] or done[F, 0] < planned:  # steady: F, I, W on each chunk
        if done[F, 0] < planned:
            run(F, 0)
        for kind in (I, W):
            run(kind, 0)
        for kind in (F, I, W):
            run(kind, 1)
    for _ in range(pp_rank):  # cool-down: input gradients first, they free the ranks upstream ...
        run(I, 0)
        run(I, 1)
    for _ in range(pp_size - pp_rank):
        run(I, 0)
        run(W, 0)
    run(W, 1, done[I, 1] - done[W, 1])  # ... the weight gradients fill the rest
    run(W, 0, done[I, 0] - done[W, 0])
    table = [a for a in table if a.microbatch < num_microbatches]
    return _forwards_only(table) if forward_only else table


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
    """The compute table of ``schedule`` for one rank, by the builder its record names.

    ``"1f1b"`` with ``vpp_size > 1`` is interleaved 1F1B (also reachable as ``"interleaved"``),
    ``"zb-h1"`` with ``vpp_size > 1`` the interleaved zero-bubble schedule; ``"zbv"`` needs
    ``vpp_size == 2`` and the V placement.
    """
    rule = schedule_rule(schedule).running(vpp_size)
    builder = globals()[rule.builder]
    if rule.interleaves:
        return builder(pp_size, vpp_size, num_microbatches, pp_rank, microbatch_group_size, forward_only)
    return builder(pp_size, num_microbatches, pp_rank, forward_only)


def build_tables(
    schedule: str, pp_size: int, vpp_size: int, num_microbatches: int, **kwargs
) -> list[list[Action]]:
    """Every rank's table, index = pp_rank."""
    return [build_table(schedule, pp_size, vpp_size, num_microbatches, r, **kwargs) for r in range(pp_size)]

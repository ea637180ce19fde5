"""Step time of a candidate: the schedule simulator over the real complete tables, plus the step's tail.

The pipeline part is the schedule simulator's timing of the tables the executor runs (compute tables
from ``schedule_tables``; sends and receives, which lowering adds, cost no time of their own), every
action costing what :class:`~planner.costs.StageCostModel` says for its stage and every message
the link's transfer time. :class:`~core.pipeline_parallel.stage_timer.StageTimer` compiles each table
shape once and gives the same floats as :func:`~core.pipeline_parallel.simulator.simulate` on the
lowered tables. On the first stage the input-gradient half of a split backward has
nothing to do (its input needs no gradient), so its W carries the whole backward, as in the executor.

Then each rank's data-parallel reduction starts at its chunk's last backward (Trident's
``--overlap-grad-reduce``) and runs while the rank still computes; what is left of it when the rank's
last action ends, the distributed optimizer's parameter all-gather beyond the next forward that hides
it, and the optimizer's own (memory-bound) time make up the rest of the step. Ranks finish together:
the gradient-norm all-reduce waits for the slowest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from core.pipeline_parallel.schedule_rules import placement_for
from core.pipeline_parallel.schedule_tables import B, F, I, W, build_tables
from core.pipeline_parallel.stage_timer import StageTimer
from planner.candidate import Candidate
from planner.costs import ActionCosts, LayerProfile, StageCostModel
from planner.hardware import Cluster
from planner.memory import rank_static
from planner.model_spec import ModelSpec

__all__ = ["StepEstimate", "estimate_step", "lower_bound", "quick_estimate"]


@dataclass
class StepEstimate:
    """Predicted time of one training step and what follows from it."""

    step_seconds: float
    pipeline_seconds: float
    """The simulated schedule (first action to last, slowest rank)."""
    bubble: float
    """Idle share of the pipeline ranks' time in the simulated schedule."""
    exposed_comm_seconds: float
    """Data-parallel reduction and parameter gather not hidden behind compute."""
    optimizer_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    extrapolated: bool = False
    """Simulated at fewer microbatches and extended along the steady state (the search's ranking)."""


@lru_cache(maxsize=64)
def _timer(schedule: str, pp: int, vpp: int, m: int) -> StageTimer:
    """The compiled tables of one shape; a search times each shape for several candidates."""
    return StageTimer(build_tables(schedule, pp, vpp, m), placement_for(schedule, pp, vpp))


def _stage_costs(model: StageCostModel, cand: Candidate) -> dict[tuple[int, int], ActionCosts]:
    """(pp rank, chunk) -> costs; the first stage's input gradient moves into its W."""
    costs = {}
    for rank in range(cand.pp):
        for chunk in range(cand.vpp):
            stage = cand.stage_of(rank, chunk)
            c = model.stage(cand.stages.stages[stage])
            if stage == 0:
                c = ActionCosts(c.forward, 0.0, c.backward)
            costs[rank, chunk] = c
    return costs


def _model_flops_per_step(spec: ModelSpec, cand: Candidate) -> float:
    return spec.training_flops(cand.global_batch_size * spec.seq_length)


def _tail(model: StageCostModel, spec: ModelSpec, cand: Candidate, rank: int) -> tuple[float, float, float]:
    """(grad sync seconds, param gather seconds, optimizer seconds) of a pipeline rank."""
    params, grads, state, _ = rank_static(spec, cand, rank)
    per_element = 12 if spec.precision != "fp32" else 8
    stepped = state / per_element
    return (
        model.grad_sync_seconds(grads, params),
        model.param_gather_seconds(params),
        model.optimizer_seconds(stepped),
    )


_COST_OF = {F: "forward", B: "backward", I: "backward_input", W: "backward_weight"}


def quick_estimate(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None = None
) -> tuple[float, float]:
    """(lower bound, guess) of the step without simulating: the guess adds the schedule's textbook
    bubble, ``pp - 1`` slowest stages' F + B scaled by the schedule's ``bubble_stages`` (a stage is a
    chunk, so interleaving's ``1 / vpp`` is in the stage's size)."""
    bound = lower_bound(spec, cand, cluster, profile)
    if cand.pp == 1:
        return bound, bound
    model = StageCostModel(spec, cand, cluster, profile)
    slowest = max((c := model.stage(symbols)).forward + c.backward for symbols in cand.stages.stages)
    return bound, bound + (cand.pp - 1) * slowest * cand.rule.bubble_stages


def lower_bound(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None = None
) -> float:
    """A step can be no shorter than this: the busiest rank's compute after the forwards reach it."""
    model = StageCostModel(spec, cand, cluster, profile)
    costs = _stage_costs(model, cand)
    m = cand.num_microbatches
    best = total = 0.0
    for rank in range(cand.pp):
        busy = sum(m * (c.forward + c.backward) for (r, _), c in costs.items() if r == rank)
        first_stage = cand.stage_of(rank, 0)
        fill = sum(costs[cand.placement.rank_and_chunk(s)].forward for s in range(first_stage))
        optimizer = _tail(model, spec, cand, rank)[2]
        best = max(best, fill + busy + optimizer)
        total += busy
    if cluster.cores:  # ranks sharing cores: a node's work over its cores
        ranks = min(cand.world_size, cluster.gpus_per_node)
        best = max(best, total * ranks / cand.pp / cluster.cores)
    return best


def estimate_step(
    spec: ModelSpec,
    cand: Candidate,
    cluster: Cluster,
    profile: LayerProfile | None = None,
    *,
    exact: bool = True,
) -> StepEstimate:
    """Simulate the candidate's step (module docstring).

    ``exact=False`` (the search's ranking) simulates a long step at three shorter microbatch counts,
    ``pp`` apart, and, when the step grows by the same time from each to the next (a steady state),
    extends that line to the real count; otherwise, and with ``exact``, the real count is simulated.
    """
    m, pp = cand.num_microbatches, cand.pp
    if exact or pp == 1 or m <= 8 * pp:
        return _stretched(spec, cand, cluster, profile)
    base = 4 * pp + (m - 4 * pp) % pp
    shorter = [
        _stretched(spec, replace(cand, num_microbatches=base + k * pp), cluster, profile) for k in range(3)
    ]
    slope = shorter[2].pipeline_seconds - shorter[1].pipeline_seconds
    if (
        abs(slope - (shorter[1].pipeline_seconds - shorter[0].pipeline_seconds))
        > 1e-9 * shorter[2].step_seconds
    ):
        return _stretched(spec, cand, cluster, profile)
    last, counted = shorter[2], base + 2 * pp
    more = slope * (m - counted) / pp
    pipeline, step = last.pipeline_seconds + more, last.step_seconds + more
    busy = (1.0 - last.bubble) * last.pipeline_seconds * m / counted
    estimate = _estimate_for(spec, cand, cluster, step, pipeline, 1.0 - busy / pipeline, last)
    estimate.extrapolated = True
    return estimate


def _estimate_for(spec, cand, cluster, step, pipeline, bubble, like: StepEstimate) -> StepEstimate:
    tokens = cand.global_batch_size * spec.seq_length
    return StepEstimate(
        step_seconds=step,
        pipeline_seconds=pipeline,
        bubble=bubble,
        exposed_comm_seconds=like.exposed_comm_seconds,
        optimizer_seconds=like.optimizer_seconds,
        tokens_per_second_per_gpu=tokens / step / cand.world_size,
        mfu=_model_flops_per_step(spec, cand) / (step * cand.world_size * cluster.gpu.peak_tflops * 1e12),
    )


def _stretched(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None
) -> StepEstimate:
    """One simulation; CPU ranks sharing fewer cores (``cluster.cores``) compute slower while more of
    them are busy: compute is stretched by the busy ranks per core, which depends on the bubble,
    which depends on the stretch; three rounds settle it."""
    if not cluster.cores:
        return _estimate(spec, cand, cluster, profile, 1.0)
    ranks = min(cand.world_size, cluster.gpus_per_node)
    stretch = max(1.0, ranks / cluster.cores)
    for _ in range(3):
        estimate = _estimate(spec, cand, cluster, profile, stretch)
        stretch = max(1.0, ranks * (1.0 - estimate.bubble) / cluster.cores)
    return estimate


def _estimate(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None, stretch: float
) -> StepEstimate:
    model = StageCostModel(spec, cand, cluster, profile)
    costs = {key: ActionCosts(*(stretch * x for x in (c.forward, c.backward_input, c.backward_weight)))
             for key, c in _stage_costs(model, cand).items()}  # fmt: skip
    timer = _timer(cand.schedule, cand.pp, cand.vpp, cand.num_microbatches)
    seconds = {(kind, *key): getattr(c, name) for key, c in costs.items() for kind, name in _COST_OF.items()}
    result = timer.time(seconds, model.p2p_seconds() if cand.pp > 1 else 0.0)
    start = min((times[0] for times in result.start_times if times), default=0.0)
    finish, exposed, optimizer = 0.0, 0.0, 0.0
    for rank, table in enumerate(timer.tables):
        ends = result.end_times[rank]
        last_backward = {a.chunk: ends[i] for i, a in enumerate(table) if a.kind in (B, W)}
        compute_end = max(ends) if ends else 0.0
        sync, gather, opt = _tail(model, spec, cand, rank)
        per_chunk = sync / max(1, len(last_backward))
        comm_end = 0.0
        for launch in sorted(last_backward.values()):
            comm_end = max(comm_end, launch) + per_chunk
        first_forward = costs[rank, 0].forward
        rank_end = max(compute_end, comm_end) + max(0.0, gather - first_forward)
        if rank_end > finish:
            finish, exposed = rank_end, rank_end - compute_end
        optimizer = max(optimizer, opt)
    pipeline = max(max(e) for e in result.end_times if e) - start
    step = finish - start + optimizer
    tokens = cand.global_batch_size * spec.seq_length
    peak = cluster.gpu.peak_tflops * 1e12
    return StepEstimate(
        step_seconds=step,
        pipeline_seconds=pipeline,
        bubble=result.bubble_fraction,
        exposed_comm_seconds=exposed,
        optimizer_seconds=optimizer,
        tokens_per_second_per_gpu=tokens / step / cand.world_size,
        mfu=_model_flops_per_step(spec, cand) / (step * cand.world_size * peak),
    )

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
it, what is left of HSDP's once-a-step reduction over the distributed-optimizer instances (launched bucket
by bucket behind the rank's reductions), the outer ``optim``'s gather over the instances after the step,
and the optimizer's own (memory-bound) time make up the rest of the step. Ranks finish together:
the gradient-norm all-reduce waits for the slowest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache, partial

from core.pipeline_parallel.schedule_rules import placement_for
from core.pipeline_parallel.schedule_tables import B, F, I, W, build_tables
from core.pipeline_parallel.stage_timer import StageTimer, Timing
from planner.candidate import Candidate
from planner.costs import ActionCosts, LayerProfile, MatmulRates, StageCostModel
from planner.hardware import Cluster
from planner.memory import (
    gathered_param_bytes,
    kept_after_forward,
    optimizer_bytes_per_element,
    rank_static,
    reduced_buckets,
    reduced_grad_bytes,
    sharded_buckets,
    stepped_tensors,
    units_in_flight,
)
from planner.model_spec import ModelSpec
from planner.shared_cores import time_shared

__all__ = ["StepEstimate", "StepParts", "estimate_step", "lower_bound", "quick_estimate"]


@dataclass
class StepParts:
    """Where the slowest rank's step goes (the rank that finishes last); the parts sum to the step.

    Two candidates with the same step differ in how they spend it: these say how."""

    compute: float = 0.0
    """Its actions' seconds on a device of their own: layers, with their TP/CP/EP collectives."""
    shared_cores: float = 0.0
    """What the same actions take longer while other ranks compute on the same cores (CPU ranks)."""
    per_action: float = 0.0
    """The engine's fixed cost per action (``HostCosts.action_seconds``) times its actions."""
    messages: float = 0.0
    """Its waiting for pipeline messages: what the step loses to their latency and transfer."""
    bubble: float = 0.0
    """The rest of its waiting: the schedule's fill, drain and imbalance."""
    exposed_comm: float = 0.0
    """Data-parallel reduction and parameter gather not hidden behind compute."""
    optimizer: float = 0.0
    per_step: float = 0.0
    """Fixed cost per step outside the schedule (``HostCosts.step_seconds``)."""
    actions: int = 0
    """Compute actions the rank runs (per model chunk and microbatch: F and B, or F, I and W)."""
    messages_received: int = 0
    """Pipeline messages it receives from another rank."""

    def total(self) -> float:
        return (self.compute + self.shared_cores + self.per_action + self.messages + self.bubble
                + self.exposed_comm + self.optimizer + self.per_step)  # fmt: skip

    def scaled(self, factor: float, step: float) -> StepParts:
        """The parts of a longer run of the same schedule: per-microbatch parts ``factor`` times more,
        the bubble what is left of ``step``."""
        grown = replace(self, compute=self.compute * factor, shared_cores=self.shared_cores * factor,
                        per_action=self.per_action * factor, messages=self.messages * factor,
                        actions=round(self.actions * factor),
                        messages_received=round(self.messages_received * factor))  # fmt: skip
        return replace(grown, bubble=max(0.0, step - grown.total() + grown.bubble))


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
    parts: StepParts = field(default_factory=StepParts)
    """The step of the slowest rank, broken down."""
    rates: MatmulRates | None = None
    """The peaks its matrix products were costed at (FP8 or 16-bit), or that a profile measured them."""


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
            c = model.stage(cand.stages.stages[stage], stage)
            if stage == 0:
                c = ActionCosts(c.forward, 0.0, c.backward)
            costs[rank, chunk] = c
    return costs


def _model_flops_per_step(spec: ModelSpec, cand: Candidate) -> float:
    return spec.training_flops(cand.global_batch_size * spec.seq_length)


def _tail(model: StageCostModel, spec: ModelSpec, cand: Candidate, rank: int) -> tuple[float, float, float]:
    """(grad sync seconds, param gather seconds, optimizer seconds) of a pipeline rank, each once a step
    (ZeRO-2/3 per bucket; at microbatch scope see :func:`_microbatch_traffic`)."""
    state = rank_static(spec, cand, rank)[2]
    stepped = state / optimizer_bytes_per_element(spec)
    optimizer = model.optimizer_seconds(stepped, stepped_tensors(spec, cand, rank))
    if spec.fp8_param_gather and cand.distributed_optimizer:
        layers = sum(spec.fp8_layers(cand.layers_of(cand.stage_of(rank, v))) for v in range(cand.vpp))
        dense = spec.fp8_weight_elements(cand.tp)
        experts = spec.fp8_weight_elements(cand.tp, cand.ep) - dense  # sharded over expert DP
        shards = cand.state_shards  # DP x CP, or under HSDP what one instance (or its piece) steps
        expert_shards = cand.tp * cand.cp * cand.dp // cand.ep * shards // (cand.dp * cand.cp)
        optimizer += model.fp8_shard_cast_seconds(layers * (dense / shards + experts / expert_shards))
    buckets = reduced_buckets(spec, cand, rank)
    return (
        model.grad_sync_seconds(reduced_grad_bytes(spec, cand, rank), buckets),
        model.param_gather_seconds(gathered_param_bytes(spec, cand, rank), buckets),
        optimizer,
    )


def _instance_traffic(
    model: StageCostModel, spec: ModelSpec, cand: Candidate, rank: int
) -> tuple[float, float, int]:
    """HSDP's once-a-step traffic over the N instances: (the reduction of each shard, the outer ``optim``'s
    gather of the updated shards after the optimizer step, the rank's buckets); zeros without instances."""
    if cand.instances == 1:
        return 0.0, 0.0, 1
    buckets = reduced_buckets(spec, cand, rank)
    reduce, gather = model.instance_seconds(
        reduced_grad_bytes(spec, cand, rank), gathered_param_bytes(spec, cand, rank), buckets
    )
    return reduce, gather, buckets


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
    slowest = max(
        (c := model.stage(symbols, stage)).forward + c.backward
        for stage, symbols in enumerate(cand.stages.stages)
    )
    return bound, bound + (cand.pp - 1) * slowest * cand.rule.bubble_stages


def _throughput(cluster: Cluster) -> float:
    """Rank-seconds of compute a node's shared cores get through per second, at best."""
    ranks = cluster.gpus_per_node
    return max(k / cluster.host.slowdown_at(k, cluster.cores) for k in range(1, ranks + 1))


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
    if cluster.cores:  # ranks sharing cores: a node's work over what its cores get through
        processes = min(cand.world_size, cluster.gpus_per_node) / cand.pp
        best = max(best, total * processes / _throughput(cluster))
    return best


def estimate_step(
    spec: ModelSpec,
    cand: Candidate,
    cluster: Cluster,
    profile: LayerProfile | None = None,
    *,
    exact: bool = True,
    explain: bool = True,
) -> StepEstimate:
    """Simulate the candidate's step (module docstring).

    ``exact=False`` (the search's ranking) simulates a long step at three shorter microbatch counts,
    ``pp`` apart, and, when the step grows by the same time from each to the next (a steady state),
    extends that line to the real count; otherwise, and with ``exact``, the real count is simulated.
    ``explain`` times the schedule a second time without message costs to say what they cost
    (``StepParts.messages``); without it that time is counted in the bubble.
    """
    m, pp = cand.num_microbatches, cand.pp
    if exact or pp == 1 or m <= 8 * pp:
        return _estimate(spec, cand, cluster, profile, explain)
    base = 4 * pp + (m - 4 * pp) % pp
    shorter = [
        _estimate(spec, replace(cand, num_microbatches=base + k * pp), cluster, profile, explain)
        for k in range(3)
    ]
    slope = shorter[2].pipeline_seconds - shorter[1].pipeline_seconds
    if (
        abs(slope - (shorter[1].pipeline_seconds - shorter[0].pipeline_seconds))
        > 1e-9 * shorter[2].step_seconds
    ):
        return _estimate(spec, cand, cluster, profile, explain)
    last, counted = shorter[2], base + 2 * pp
    more = slope * (m - counted) / pp
    pipeline, step = last.pipeline_seconds + more, last.step_seconds + more
    busy = (1.0 - last.bubble) * last.pipeline_seconds * m / counted
    estimate = _estimate_for(spec, cand, cluster, step, pipeline, 1.0 - busy / pipeline, last)
    estimate.parts = last.parts.scaled(m / counted, step)
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
        rates=like.rates,
    )


def _time(cand: Candidate, cluster: Cluster, seconds: dict, latency: float) -> Timing:
    """The schedule's timing: fixed durations, or on shared cores durations that follow the load."""
    if not cluster.cores:
        return _timer(cand.schedule, cand.pp, cand.vpp, cand.num_microbatches).time(seconds, latency)
    processes = min(cand.world_size, cluster.gpus_per_node) // cand.pp
    tables = _timer(cand.schedule, cand.pp, cand.vpp, cand.num_microbatches).tables
    slowdown = partial(cluster.host.slowdown_at, cores=cluster.cores)
    return time_shared(tables, cand.placement, seconds, latency=latency, processes=max(1, processes),
                       slowdown=slowdown)  # fmt: skip


@dataclass
class _RankEnd:
    """When a rank is done: its last action, its data-parallel tail beyond it, and its optimizer."""

    compute_end: float
    end: float
    optimizer: float


def _rank_ends(spec, cand, model, costs, timer_tables, result: Timing) -> list[_RankEnd]:
    """Each rank's reduction starts at its chunk's last backward and runs beside its compute (at
    microbatch scope, ZeRO-2/3's traffic runs beside every action: :func:`_microbatch_traffic`)."""
    out = []
    per_microbatch = cand.zero is not None and cand.zero[1] == "microbatch"
    for rank, table in enumerate(timer_tables):
        ends = result.end_times[rank]
        last_backward = {a.chunk: ends[i] for i, a in enumerate(table) if a.kind in (B, W)}
        compute_end = max(ends) if ends else 0.0
        sync, gather, opt = _tail(model, spec, cand, rank)
        if per_microbatch:
            comm_end, exposed = _microbatch_traffic(spec, cand, model, rank, table, result)
            gather = gather if cand.zero[0] == "optim_grads" else 0.0  # ZeRO-3 gathers before each use
        elif model.dp_overlaps:
            per_chunk = sync / max(1, len(last_backward))
            comm_end, exposed = 0.0, 0.0
            for launch in sorted(last_backward.values()):
                comm_end = max(comm_end, launch) + per_chunk
        else:  # on shared cores the reduction runs after the compute, not beside it
            comm_end, exposed = compute_end + sync, 0.0
        first_forward = costs[rank, 0].forward if model.dp_overlaps else 0.0
        over_instances, gather_over_instances, buckets = _instance_traffic(model, spec, cand, rank)
        if model.dp_overlaps and over_instances:
            # Each bucket's reduction over the instances is launched behind its reduction inside the
            # instance, as the next bucket's is (InstanceChain), on the links between instances, while
            # the chunk's last backward still fills buckets: it all ends no sooner than the last bucket's
            # share after the rank's last reduction, nor than all of it after the first chunk's last
            # backward began.
            starts = result.start_times[rank]
            last_began = {a.chunk: starts[i] for i, a in enumerate(table) if a.kind in (B, W)}
            first_launch = min(last_began.values())
            comm_end = max(comm_end + over_instances / buckets, first_launch + over_instances)
            over_instances = 0.0
        tail = max(compute_end, comm_end) + exposed + over_instances + max(0.0, gather - first_forward)
        tail += gather_over_instances  # blocking, after the optimizer step
        out.append(_RankEnd(compute_end, tail, opt))
    return out


def _microbatch_traffic(spec, cand: Candidate, model: StageCostModel, rank: int, table, result: Timing):
    """ZeRO-2/3 at microbatch scope: ``(end of the rank's data-parallel traffic, seconds it adds to the
    compute)``. One channel per rank carries, in launch order, each backward's (B, or W) reduce-scatter
    of its chunk's whole gradient buckets, launched as the action starts and over no sooner than one
    bucket's share after it ends (the last layer's), and under ZeRO-3 each forward's and backward's
    (B, or I) all-gather of its chunk's parameters (a backward's without what stayed gathered since the
    forward: :func:`kept_after_forward`), launched as the action starts (each layer prefetches the next);
    the first bucket of each such gather is waited for before the action can start. Where
    the traffic does not run beside the compute (``StageCostModel.dp_overlaps``: ranks sharing cores)
    every job's seconds are added to the rank's step."""
    grad_bytes = spec.grad_comm_bytes_per_value
    zero3 = cand.zero[0] == "optim_grads_params"
    jobs, exposed = [], 0.0
    buckets, kept = sharded_buckets(spec, cand, rank), kept_after_forward(spec, cand, rank)
    starts, ends = result.start_times[rank], result.end_times[rank]
    for i, action in enumerate(table):
        elements, n = buckets[action.chunk]
        if not n:  # a chunk without parameters (an empty stage) moves nothing
            continue
        gathered, m = (
            (elements, n)
            if action.kind == F
            else (elements - kept[action.chunk][0], n - kept[action.chunk][1])
        )
        if zero3 and action.kind in (F, B, I) and m:
            gather = model.dp_collective_seconds(gathered * spec.bytes_per_value, m, "all_gather")
            jobs.append((starts[i], gather, 0.0))
            prefetched = units_in_flight(elements // n, cand.communication_unit_size)[0] > 1
            exposed += gather / m if prefetched else gather  # no prefetch: every layer waits for its own
        if action.kind in (B, W):
            reduce = model.dp_collective_seconds(elements * grad_bytes, n)
            jobs.append((starts[i], reduce, ends[i] + reduce / n))
    if not model.dp_overlaps:
        return 0.0, sum(seconds for _, seconds, _ in jobs)
    comm_end = 0.0
    for launch, seconds, not_before in sorted(jobs):
        comm_end = max(comm_end, launch, not_before - seconds) + seconds
    return comm_end, exposed


def _parts(
    cand: Candidate,
    cluster: Cluster,
    seconds: dict,
    result: Timing,
    no_messages: Timing | None,
    rank: int,
    ends: list[_RankEnd],
) -> StepParts:
    """The breakdown of ``rank``'s step (:class:`StepParts`)."""
    table = _timer(cand.schedule, cand.pp, cand.vpp, cand.num_microbatches).tables[rank]
    fixed = cluster.host.action_seconds
    alone = sum(seconds[a.kind, rank, a.chunk] for a in table)
    start = min((times[0] for times in result.start_times if times), default=0.0)
    waiting = ends[rank].compute_end - start - result.busy[rank]
    messages = 0.0
    if no_messages is not None:
        quiet = max(no_messages.end_times[rank], default=0.0) - start
        messages = min(waiting, max(0.0, ends[rank].compute_end - start - quiet))
    received = sum(1 for a in table if _receives(cand, rank, a))
    return StepParts(
        compute=alone - fixed * len(table),
        shared_cores=result.busy[rank] - alone,
        per_action=fixed * len(table),
        messages=messages,
        bubble=waiting - messages,
        exposed_comm=ends[rank].end - ends[rank].compute_end,
        optimizer=max(e.optimizer for e in ends),
        per_step=cluster.host.step_seconds,
        actions=len(table),
        messages_received=received,
    )


def _receives(cand: Candidate, rank: int, action) -> bool:
    """Whether an action waits for a message from another rank (a forward's input, a backward's gradient)."""
    stage = cand.stage_of(rank, action.chunk)
    if action.kind == F:
        return stage > 0 and cand.placement.rank(stage - 1) != rank
    if action.kind in (B, I):
        last = cand.pp * cand.vpp - 1
        return stage < last and cand.placement.rank(stage + 1) != rank
    return False


def _estimate(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None, explain: bool
) -> StepEstimate:
    model = StageCostModel(spec, cand, cluster, profile)
    costs = _stage_costs(model, cand)
    fixed = cluster.host.action_seconds
    seconds = {
        (kind, *key): getattr(c, name) + fixed for key, c in costs.items() for kind, name in _COST_OF.items()
    }
    latency = model.p2p_seconds() if cand.pp > 1 else 0.0
    result = _time(cand, cluster, seconds, latency)
    quiet = _time(cand, cluster, seconds, 0.0) if explain and latency > 0 else None
    tables = _timer(cand.schedule, cand.pp, cand.vpp, cand.num_microbatches).tables
    ends = _rank_ends(spec, cand, model, costs, tables, result)
    start = min((times[0] for times in result.start_times if times), default=0.0)
    slowest = max(range(cand.pp), key=lambda r: ends[r].end)
    optimizer = max(e.optimizer for e in ends)
    step = ends[slowest].end - start + optimizer + cluster.host.step_seconds
    tokens = cand.global_batch_size * spec.seq_length
    peak = cluster.gpu.peak_tflops * 1e12
    return StepEstimate(
        step_seconds=step,
        pipeline_seconds=max(max(e) for e in result.end_times if e) - start,
        bubble=result.bubble_fraction,
        exposed_comm_seconds=ends[slowest].end - ends[slowest].compute_end,
        optimizer_seconds=optimizer,
        tokens_per_second_per_gpu=tokens / step / cand.world_size,
        mfu=_model_flops_per_step(spec, cand) / (step * cand.world_size * peak),
        parts=_parts(cand, cluster, seconds, result, quiet, slowest, ends),
        rates=model.rates,
    )

"""``--from-timeline DIR``: a real run's measured stage costs in, a rebalanced layout for its split out.

A run with ``--timeline-dir`` records every forward, backward (or I and W) of every stage. From the
first pipeline's events the mean cost of each action on each stage is taken; each stage is a known
mix of decoder layers, embedding and loss (the run's layout), so the cost of one layer, of the
embedding and of the loss follow by least squares (the planner's FLOP model fills in what the layout
cannot tell apart, e.g. the embedding when every stage holds layers). The balanced layout for those
costs is proposed, and both layouts are simulated on the run's own tables with the measured costs:
the ratio is the predicted gain.

The refitted costs then re-rank every candidate the plan tries (``tools/plan.py --from-timeline``
prints the table again): :class:`RefitProfile` carries the run's level to the other shapes.

CPU ranks sharing cores (this machine) measure each action stretched by the ranks busy beside it;
each event is first brought back to the time it would take on a core of its own: each stretch of it
divided by the cluster's slowdown for the ranks busy then (``HostCosts.slowdown``, measured by
``--profile-local``; unmeasured, ``busy ranks / cores`` wherever more ranks computed than there are
cores), the curve the step's timing applies again.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import astuple, replace
from functools import partial

import numpy as np

from core.pipeline_parallel.layout import even_layout, parse_layout
from core.pipeline_parallel.schedule_rules import rule_for_label, schedule_rule
from planner.candidate import Candidate
from planner.costs import LayerProfile, StageCostModel
from planner.hardware import Cluster
from planner.layouts import balanced_layout
from planner.refit_collectives import collective_scales
from planner.step_time import estimate_step
from training.reporting.timeline import load_trace

__all__ = [
    "RefitProfile",
    "fit_costs",
    "measured_pipeline_seconds",
    "rebalance",
    "rebalance_report",
    "refit_profile",
    "stage_means",
]

_KINDS = ("F", "B", "I", "W")


def _own_core_seconds(events: list[tuple], busy: list[tuple[float, float]], slowdown) -> list[tuple]:
    """Events with each duration replaced by the time it would take on a core of its own: each stretch
    progresses at ``1 / slowdown(k)`` while ``k`` ranks compute (``slowdown`` None: no sharing)."""
    if slowdown is None:
        return events
    edges = sorted({t for s, e in busy for t in (s, e)})
    out = []
    for kind, mb, chunk, start, end in events:
        own = 0.0
        for a, b in itertools.pairwise(edges):
            lo, hi = max(a, start), min(b, end)
            if hi <= lo:
                continue
            running = sum(1 for s, e in busy if s <= lo and e >= hi)
            own += (hi - lo) / slowdown(max(running, 1))
        out.append((kind, mb, chunk, start, start + own))
    return out


def _pipelines(step) -> list[list]:
    """An iteration's ranks by pipeline: the k-th rank (by number) of every stage is pipeline k's, as
    in Megatron's order, where the stage is outermost; a tensor- or context-parallel rank counts as a
    pipeline of its own."""
    stages: dict[int, list] = defaultdict(list)
    for rank in sorted(step.ranks, key=lambda r: r.rank):
        stages[rank.pp_rank].append(rank)
    return [list(ranks) for ranks in zip(*stages.values())]  # a stage short of ranks ends the list


def stage_means(path: str, slowdown=None) -> tuple[dict[tuple[int, int, str], float], object]:
    """Mean seconds per (pp rank, chunk, action kind) over every rank's recorded iterations, on a core
    of their own where ``slowdown(k)`` says how much longer an action takes while ``k`` ranks share
    the cores (the same curve the step's timing then applies: a refit gives back the run). Every
    pipeline counts, not only the first: on shared cores data-parallel replicas run out of step, and
    one replica's iteration is a noisy sample of the run."""

    data = load_trace(os.path.join(path, "timeline.json") if os.path.isdir(path) else path)
    durations: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    for step in data.iterations:
        busy = [(e[3], e[4]) for r in step.ranks for e in r.events if e[0] in _KINDS]
        for rank in step.ranks:
            compute = [e for e in rank.events if e[0] in _KINDS]
            for kind, _, chunk, start, end in _own_core_seconds(compute, busy, slowdown):
                durations[rank.pp_rank, chunk, kind].append((end - start) / 1e3)
    return {key: float(np.mean(v)) for key, v in durations.items()}, data


def _solve(rows: np.ndarray, targets: list[float], anchor: np.ndarray) -> np.ndarray:
    """Non-negative per-element costs explaining ``targets``; ``anchor`` fills what they cannot, at the
    level that best explains them (one stage: the targets shared out in the anchor's proportions)."""
    b = np.array(targets, dtype=float)
    weight = 1e-3
    predicted = rows @ anchor
    scaled = anchor * (float(predicted @ b) / max(float(predicted @ predicted), 1e-24))
    lhs = np.vstack([rows, weight * np.eye(3)])
    solution, *_ = np.linalg.lstsq(lhs, np.concatenate([b, weight * scaled]), rcond=None)
    return np.clip(solution, 0.0, None)


def fit_costs(
    means: dict, cand: Candidate, prior: LayerProfile, collectives: tuple | None = None
) -> LayerProfile:
    """Seconds of one decoder layer, the embedding and the loss (F, I, W) that explain the stage means.

    ``collectives`` (the layer's, embedding's and loss's ``ActionCosts`` at the refitted factors) are
    taken off each stage's measured forward and backward first, so the costs fitted are compute alone
    (None: nothing taken off). Forward and whole backward (B, or I + W) are fitted per stage mix; the
    backward is then split as the run split it (the mean I share of the stages that have one), or as
    ``prior`` splits it. ``prior`` (the model's compute costs) also anchors, with a small weight, what
    the layout cannot separate.
    """
    rows, forward, backward, input_shares = [], [], [], []
    for stage, symbols in enumerate(cand.stages.stages):
        rank, chunk = cand.placement.rank_and_chunk(stage)
        got = {k: means.get((rank, chunk, k)) for k in _KINDS}
        if got["F"] is None:
            continue
        whole = got["B"] if got["B"] is not None else (got["I"] or 0.0) + (got["W"] or 0.0)
        if got["I"] and stage > 0 and whole:  # the first stage's I has no input gradient to compute
            input_shares.append(got["I"] / whole)
        counts = [symbols.count("t"), int("E" in symbols), int("L" in symbols)]
        comm = [
            sum(n * getattr(c, k) for n, c in zip(counts, collectives or ())) for k in ("forward", "backward")
        ]
        rows.append(counts)
        forward.append(got["F"] - comm[0])
        backward.append(whole - comm[1])
    a = np.array(rows, dtype=float)
    parts = (prior.layer, prior.embedding, prior.loss)
    f = _solve(a, forward, np.array([p[0] for p in parts]))
    b = _solve(a, backward, np.array([p[1] + p[2] for p in parts]))
    prior_share = prior.layer[1] / max(prior.layer[1] + prior.layer[2], 1e-12)
    share = float(np.mean(input_shares)) if input_shares else prior_share
    costs = [(f[i], b[i] * share, b[i] * (1 - share)) for i in range(3)]
    return LayerProfile(costs[0], costs[1], costs[2], source="timeline")


class RefitProfile(LayerProfile):
    """Costs refitted from a run's timeline, for every shape the search asks about.

    Fitted from the run:

    * compute of one decoder layer, the embedding and the loss, per action (F, I, W), on one rank: the
      stage means less their collectives at the refitted factors. At the run's shape they are the
      fitted costs; at another (TP, micro-batch size, recomputation, CP) the prior's costs there
      (``--profile-local``'s, else the FLOP model's) times what the run measured over what the prior
      predicted for the run's shape, per part and per action: the run corrects the prior's level, the
      prior says how a shape scales;
    * a factor per collective kind the run's layout exercised (``collective_scales``, from its
      timeline's ``TP``, ``CP`` and ``DP`` events: :mod:`planner.refit_collectives`): TP collectives
      (mappings, embedding, cross-entropy), ring attention's exposed exchange, the data-parallel
      reduction and gather. Every candidate's collectives of that kind, at any group size and message
      size, are the calibration's times that factor.

    Carried from the calibration unchanged: how a collective's time grows with its group and message
    size (the measured curves, or the ring formulas), every kind the run did not exercise (factor 1),
    pipeline messages (latency, bandwidth), the engine's fixed costs per action and per step, the
    optimizer's seconds per element and tensor, and the shared-core slowdown curve.
    """

    def __init__(self, ratios: tuple, absolute: tuple, prior: Callable[[int, int, str, int], tuple],
                 scales: dict | None = None):  # fmt: skip
        super().__init__(layer=absolute[0], embedding=absolute[1], loss=absolute[2], source="timeline",
                         collective_scales=dict(scales or {}))  # fmt: skip
        self.ratios, self.absolute, self.prior = ratios, absolute, prior

    def for_shape(self, tp: int, micro_batch_size: int, recompute: str, cp: int = 1) -> tuple:
        key = (tp, micro_batch_size, recompute, cp)
        if key not in self.by_shape:
            prior = self.prior(*key)
            self.by_shape[key] = tuple(
                tuple(p * r if r is not None else a for p, r, a in zip(*parts))
                for parts in zip(prior, self.ratios, self.absolute)
            )
        return self.by_shape[key]


def _flop_prior(spec, cluster: Cluster) -> Callable[[int, int, str, int], tuple]:
    """The FLOP model's compute seconds (no collectives) of a shape, on one context-parallel rank."""

    def prior(tp: int, micro_batch_size: int, recompute: str, cp: int = 1) -> tuple:
        shape = Candidate(tp=tp, pp=1, dp=1, cp=cp, micro_batch_size=micro_batch_size, recompute=recompute)
        costs = StageCostModel(spec, shape, cluster).compute_costs()
        return tuple((c.forward, c.backward_input, c.backward_weight) for c in costs)

    return prior


def refit_profile(
    spec, cluster: Cluster, cand: Candidate, fitted: LayerProfile, profile=None, scales: dict | None = None
) -> RefitProfile:
    """:class:`RefitProfile` from ``fitted`` (the run's compute: :func:`fit_costs` with the collectives
    taken off), the collective factors the run measured (``scales``:
    :func:`planner.refit_collectives.collective_scales`) and the prior: ``profile``
    (``--profile-local``) or the FLOP model."""
    prior = profile.for_shape if profile is not None else _flop_prior(spec, cluster)
    measured = (fitted.layer, fitted.embedding, fitted.loss)
    at_run = prior(cand.tp, cand.micro_batch_size, cand.recompute, cand.cp)
    ratios = tuple(
        tuple(m / p if p > 0 else None for m, p in zip(mine, theirs))
        for mine, theirs in zip(measured, at_run)
    )
    return RefitProfile(ratios, measured, prior, scales)


def _flop_compute(spec, cand: Candidate, cluster: Cluster) -> LayerProfile:
    """The FLOP model's compute (no collectives) of a layer, the embedding and the loss at ``cand``."""
    return LayerProfile(*(astuple(c) for c in StageCostModel(spec, cand, cluster).compute_costs()))


def _run_candidate(plan_input, data) -> Candidate:
    """The recorded run's candidate: its split, schedule, microbatches and layout, from its flags."""
    fixed = plan_input.fixed
    pp, vpp = data.pp_size, data.vpp_size
    schedule = fixed.get("schedule") or rule_for_label(data.schedule).name
    placement = schedule_rule(schedule).placement
    layout = fixed.get("layout") or even_layout(plan_input.spec.num_layers, pp, vpp, placement).to_string()
    parse_layout(layout, pp, vpp, num_layers=plan_input.spec.num_layers, placement=placement)
    tp, cp, mbs = fixed.get("tp") or 1, fixed.get("cp") or 1, fixed.get("micro_batch_size") or 1
    m = data.num_microbatches
    dp = plan_input.global_batch_size // (mbs * m)
    return Candidate(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, schedule=schedule, micro_batch_size=mbs,
                     num_microbatches=m, recompute=fixed.get("recompute") or "none", layout=layout,
                     dp_sharding=fixed.get("dp_sharding", "no_shard"),
                     dp_sharding_scope=fixed.get("dp_sharding_scope", "auto"))  # fmt: skip


def measured_pipeline_seconds(data) -> float:
    """The run's pipeline span (first action to last over one pipeline's ranks), median over the
    recorded iterations and the pipelines: what the planner's ``pipeline_seconds`` predicts."""
    spans = []
    for step in data.iterations:
        for ranks in _pipelines(step):
            events = [e for r in ranks for e in r.events if e[0] in _KINDS]
            if events:
                spans.append((max(e[4] for e in events) - min(e[3] for e in events)) / 1e3)
    return float(np.median(spans)) if spans else 0.0


def rebalance(plan_input, cluster: Cluster, path: str, profile: LayerProfile | None = None) -> dict:
    """The run's layout, the proposed one, and both simulated with the measured costs; the run's
    measured pipeline against the plan's prediction for its layout (``profile``'s costs, or FLOPs)."""
    slowdown = partial(cluster.host.slowdown_at, cores=cluster.cores) if cluster.cores else None
    means, data = stage_means(path, slowdown)
    cand = _run_candidate(plan_input, data)
    spec = plan_input.spec
    scales = collective_scales(spec, cand, cluster, data)
    model = StageCostModel(
        spec, cand, cluster, LayerProfile((0.0,) * 3, source="none", collective_scales=scales)
    )
    collectives = model.collective_costs()
    fitted = fit_costs(means, cand, _flop_compute(spec, cand, cluster), collectives)
    fitted.collective_scales = scales
    layer, embedding, loss = (sum(f) + c.backward + c.forward
                              for f, c in zip((fitted.layer, fitted.embedding, fitted.loss), collectives))  # fmt: skip
    placement = cand.rule.placement
    flops = StageCostModel(spec, cand, cluster)  # layers kept out of FP8: the fitted layer times the ratio
    typical = sum(astuple(flops.stage(("t",))))
    costs = [layer * (c.forward + c.backward) / typical if typical else layer for c in flops.decoder_layers()]
    proposed = balanced_layout(spec.num_layers, cand.pp, cand.vpp, layer=layer, embedding=embedding,
                               loss=loss, placement=placement, costs=costs).to_string()  # fmt: skip
    before = estimate_step(spec, cand, cluster, fitted)
    after = estimate_step(spec, replace(cand, layout=proposed), cluster, fitted)
    measured = [s for s in data.iterations]
    planned = estimate_step(spec, cand, cluster, profile)
    return {
        "measured_pipeline_seconds": measured_pipeline_seconds(data),
        "planned_pipeline_seconds": planned.pipeline_seconds,
        "refit_pipeline_seconds": before.pipeline_seconds,
        "layout": cand.layout,
        "proposed_layout": proposed,
        "layer_seconds": fitted.layer,
        "embedding_seconds": fitted.embedding,
        "loss_seconds": fitted.loss,
        "predicted_step_seconds": before.step_seconds,
        "proposed_step_seconds": after.step_seconds,
        "predicted_gain": before.step_seconds / after.step_seconds,
        "measured_bubble": float(np.mean([s.measured_bubble for s in measured])),
        "candidate": cand,
        "collective_scales": scales,
        "refit_profile": refit_profile(spec, cluster, cand, fitted, profile, scales),
    }


def _against(predicted: float, measured: float) -> str:
    return (
        f"{predicted * 1e3:.1f} ms ({predicted / measured - 1:+.1%})"
        if measured
        else f"{predicted * 1e3:.1f} ms"
    )


def rebalance_report(
    plan_input, cluster: Cluster, path: str, profile: LayerProfile | None = None
) -> tuple[str, RefitProfile, Candidate]:
    """The report's lines, the refitted costs (for re-ranking every candidate) and the run's candidate."""
    r = rebalance(plan_input, cluster, path, profile)
    measured = r["measured_pipeline_seconds"]
    ms = lambda costs: f"{1e3 * costs[0]:.2f}/{1e3 * (costs[1] + costs[2]):.2f}"
    cand = r["candidate"]
    lines = [
        (
            f"timeline {path}: {cand.split()} {cand.schedule_label}, {cand.num_microbatches} microbatches, "
            f"measured bubble {r['measured_bubble']:.1%}"
        ),
        (
            f"measured compute, collectives taken off (forward/backward ms): decoder layer {ms(r['layer_seconds'])}, embedding "
            f"{ms(r['embedding_seconds'])}, loss {ms(r['loss_seconds'])}"
        ),
        (
            f"pipeline (first action to last): measured {measured * 1e3:.1f} ms; predicted for this layout "
            f"{_against(r['planned_pipeline_seconds'], measured)}, refitted from the timeline "
            f"{_against(r['refit_pipeline_seconds'], measured)}"
        ),
        f"current layout:  {r['layout']}  (simulated step {r['predicted_step_seconds'] * 1e3:.1f} ms)",
        f"proposed layout: {r['proposed_layout']}  (simulated step {r['proposed_step_seconds'] * 1e3:.1f} ms)",
        f"predicted gain: {r['predicted_gain']:.3f}x"
        + ("" if r["proposed_layout"] != r["layout"] else " (the run is already balanced)"),
        f"--pipeline-model-parallel-layout '{r['proposed_layout']}'",
        "collectives refitted (measured over calibrated, 1: not exercised, carried): "
        + ", ".join(f"{kind} {factor:.2f}x" for kind, factor in r["collective_scales"].items()),
    ]
    return "\n".join(lines), r["refit_profile"], cand

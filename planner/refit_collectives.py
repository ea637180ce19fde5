"""The collective terms a run's timeline refits: how much longer (or shorter) its TP, CP and DP
communication took than the calibration said, as one factor per kind.

The timeline records per rank and iteration (``training.reporting.timeline.COMMUNICATION``): ``TP``,
the seconds inside tensor-parallel collectives (mappings and the vocabulary-parallel cross-entropy);
``CP``, the seconds ring attention waited for a block; ``DP``, the span of ``finalize_model_grads``
after the last action (the data-parallel reduction the step waits for). Each factor is what the first
pipeline's ranks measured over what the planner predicts for the run's own layout (the collectives'
seconds of work, brought back to wall seconds with the load they were calibrated under, as
``StageCostModel.group_seconds`` divides it out). A kind the run did not exercise (TP1, CP1, DP1, or
no ``TP``/``CP`` events: a GPU's clock) keeps the factor 1: the calibration's costs, unchanged.

The factors then scale that kind's costs for every candidate (``LayerProfile.collective_scales``): a
candidate with another TP, CP or DP size moves with what the run measured at its own.
"""

from __future__ import annotations

import numpy as np

from planner.candidate import Candidate
from planner.costs import LayerProfile, StageCostModel
from planner.hardware import Cluster
from planner.memory import reduced_buckets, reduced_grad_bytes

__all__ = ["collective_scales", "measured_communication", "predicted_communication"]

KINDS = ("TP", "CP", "DP")


def measured_communication(data) -> dict[str, float]:
    """Seconds of each kind per iteration, summed over pipeline ranks (mean over the recorded
    iterations); a kind with no event is absent. Of the ranks at one pipeline rank the least is taken:
    the others' also holds their wait for the last rank of their group to arrive (skew, not transfer)."""
    totals: dict[str, list[float]] = {}
    for step in data.iterations:
        least: dict[tuple[str, int], float] = {}
        for rank in step.ranks:
            spent: dict[str, float] = {}
            for kind, _, _, start, end in rank.events:
                if kind in KINDS:
                    spent[kind] = spent.get(kind, 0.0) + (end - start) / 1e3
            for kind, seconds in spent.items():
                key = (kind, rank.pp_rank)
                least[key] = min(least.get(key, seconds), seconds)
        for kind in {k for k, _ in least}:
            totals.setdefault(kind, []).append(sum(v for (k, _), v in least.items() if k == kind))
    return {kind: float(np.mean(v)) for kind, v in totals.items()}


def _only(kind: str) -> LayerProfile:
    """A profile whose collectives of every kind but ``kind`` cost nothing (its compute, zero, is not read
    here: a collective's seconds do not depend on it)."""
    return LayerProfile(
        (0.0, 0.0, 0.0), source="none", collective_scales={k: float(k == kind) for k in KINDS}
    )


def predicted_communication(spec, cand: Candidate, cluster: Cluster) -> dict[str, float]:
    """The planner's wall seconds of each kind in one iteration, summed over the first pipeline's ranks:
    TP and CP inside the actions (at the calibration's load), DP the gradient reduction after them."""
    busy = cluster.host.slowdown_at(cluster.host.collectives_world, cluster.cores) if cluster.cores else 1.0
    out = {}
    for kind in ("TP", "CP"):
        model = StageCostModel(spec, cand, cluster, _only(kind))
        parts = model.collective_costs()
        per_microbatch = 0.0
        for symbols in cand.stages.stages:
            counts = (symbols.count("t"), int("E" in symbols), int("L" in symbols))
            per_microbatch += sum(n * (p.forward + p.backward) for n, p in zip(counts, parts))
        out[kind] = per_microbatch * cand.num_microbatches * busy
    model = StageCostModel(spec, cand, cluster, _only("DP"))
    out["DP"] = 0.0
    for rank in range(cand.pp):
        buckets = reduced_buckets(spec, cand, rank)
        out["DP"] += model.grad_sync_seconds(reduced_grad_bytes(spec, cand, rank), buckets)
    return out


def collective_scales(spec, cand: Candidate, cluster: Cluster, data) -> dict[str, float]:
    """Measured over predicted, per kind the run exercised (module docstring); 1 for the others."""
    measured = measured_communication(data)
    predicted = predicted_communication(spec, cand, cluster)
    exercised = {"TP": cand.tp > 1, "CP": cand.cp > 1, "DP": cand.dp * cand.cp > 1}
    return {
        kind: measured[kind] / predicted[kind]
        if exercised[kind] and measured.get(kind) and predicted[kind] > 0
        else 1.0
        for kind in KINDS
    }

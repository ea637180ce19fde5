"""Issue 33's loop closed on the collectives: the timeline's communication events, and the factors
``--from-timeline`` refits from them (synthetic timelines with known costs: the terms come back)."""

from __future__ import annotations

import json

import pytest

from core import comm_time
from core.pipeline_parallel.record import HostClock, ScheduleRecord
from core.pipeline_parallel.schedule_rules import placement_for
from core.pipeline_parallel.schedule_tables import build_tables
from core.pipeline_parallel.simulator import simulate
from planner.candidate import Candidate
from planner.costs import LayerProfile, StageCostModel
from planner.hardware import GPUS, Cluster
from planner.inputs import read_input
from planner.memory import reduced_grad_bytes
from planner.rebalance import _run_candidate, fit_costs, rebalance
from planner.refit_collectives import collective_scales, measured_communication, predicted_communication
from training.reporting.timeline import IterationTimeline, RankEvents, Timeline, TimelineData, chrome_trace

_FLAGS = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --vocab-size 4095 --global-batch-size 16 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4"
)
FLAGS = _FLAGS.split()
COMPUTE = {"t": (0.010, 0.020), "E": (0.001, 0.002), "L": (0.040, 0.050)}
TP_FACTOR, DP_FACTOR = 1.7, 2.3
CLUSTER = Cluster(16, 8, GPUS["h100"])


def _run(path, plan_input) -> tuple[Candidate, TimelineData]:
    """A TP2 x PP4 x DP2 1F1B run's timeline.json: every action costs its stage's compute (``COMPUTE``)
    plus its TP collectives at ``TP_FACTOR`` times the planner's; each first-pipeline rank records that
    TP total and a DP span ``DP_FACTOR`` times its predicted reduction; a rank of another pipeline at
    the same stage records more of both (it waited for its group)."""
    data = TimelineData("1f1b", 4, 1, 8)
    cand = _run_candidate(plan_input, data)
    spec = plan_input.spec
    parts = dict(zip("tEL", StageCostModel(spec, cand, CLUSTER).collective_costs()))
    stages = cand.stages.stages

    def seconds(stage: int, kind: str) -> float:
        out = 0.0
        for s in stages[stage]:
            comm = parts[s].forward if kind == "F" else parts[s].backward
            out += COMPUTE[s][0 if kind == "F" else 1] + TP_FACTOR * comm
        return out

    tables = build_tables("1f1b", 4, 1, 8)
    result = simulate(
        tables, placement_for("1f1b", 4), lambda a, r: seconds(r, "F"), lambda a, r: seconds(r, "B")
    )
    iteration = IterationTimeline(5, 0.0, [])
    for rank, table in enumerate(result.tables):
        events = [(a.kind.value, a.microbatch, a.chunk, 1e3 * s, 1e3 * e)
                  for a, s, e in zip(table, result.start_times[rank], result.end_times[rank]) if a.kind.value in "FB"]  # fmt: skip
        end = events[-1][4]
        tp = 8 * TP_FACTOR * sum(parts[s].forward + parts[s].backward for s in stages[rank])
        dp = DP_FACTOR * StageCostModel(spec, cand, CLUSTER).grad_sync_seconds(
            reduced_grad_bytes(spec, cand, rank)
        )
        communication = [("TP", -1, 0, 0.0, 1e3 * tp), ("DP", -1, 0, end, end + 1e3 * dp)]
        iteration.ranks.append(RankEvents(rank, rank, True, events + communication))
        waited = [(k, mb, c, s, e + 5.0) for k, mb, c, s, e in communication]
        iteration.ranks.append(RankEvents(rank + 4, rank, False, waited))
    data.iterations.append(iteration)
    path.mkdir()
    (path / "timeline.json").write_text(json.dumps(chrome_trace(data)))
    return cand, data


def test_the_collective_factors_and_the_compute_come_back_from_a_timeline(tmp_path):
    plan_input = read_input(FLAGS)
    cand, data = _run(tmp_path / "run", plan_input)
    assert (cand.tp, cand.pp, cand.dp, cand.num_microbatches) == (2, 4, 2, 8)
    predicted = predicted_communication(plan_input.spec, cand, CLUSTER)
    assert predicted["CP"] == 0.0 and predicted["TP"] > 0 and predicted["DP"] > 0
    measured = measured_communication(data)  # the least at each stage: the other pipeline's waits drop out
    assert measured["TP"] == pytest.approx(TP_FACTOR * predicted["TP"], rel=1e-9)
    assert measured["DP"] == pytest.approx(DP_FACTOR * predicted["DP"], rel=1e-9)
    scales = collective_scales(plan_input.spec, cand, CLUSTER, data)
    assert scales == pytest.approx({"TP": TP_FACTOR, "CP": 1.0, "DP": DP_FACTOR}, rel=1e-9)
    r = rebalance(plan_input, CLUSTER, str(tmp_path / "run"))
    refit = r["refit_profile"]
    assert refit.collective_scales == pytest.approx(scales, rel=1e-5)  # timeline.json: times to the ns
    for part, (forward, backward) in zip(refit.for_shape(2, 1, "none"), COMPUTE.values()):  # t, E, L
        assert part[0] == pytest.approx(forward, rel=1e-3) and sum(part[1:]) == pytest.approx(
            backward, rel=1e-3
        )


def test_the_refitted_factors_move_candidates_of_other_sizes(tmp_path):
    """A TP4 (or DP4) candidate the run never ran costs its own collectives times the run's factor."""
    plan_input = read_input(FLAGS)
    _run(tmp_path / "run", plan_input)
    refit = rebalance(plan_input, CLUSTER, str(tmp_path / "run"))["refit_profile"]
    spec = plan_input.spec
    other = Candidate(tp=4, pp=1, dp=4, num_microbatches=4, layout="E,t*8,L")
    plain = LayerProfile(refit.layer, refit.embedding, refit.loss)
    scaled, unscaled = (
        StageCostModel(spec, other, CLUSTER, refit),
        StageCostModel(spec, other, CLUSTER, plain),
    )
    tp, dp = refit.collective_scales["TP"], refit.collective_scales["DP"]
    assert (tp, dp) == pytest.approx((TP_FACTOR, DP_FACTOR), rel=1e-5)
    for a, b in zip(scaled.collective_costs(), unscaled.collective_costs()):
        assert (a.forward, a.backward) == pytest.approx((tp * b.forward, tp * b.backward), rel=1e-12)
    assert scaled.collective_costs()[0].forward > 0
    assert scaled.grad_sync_seconds(1e8) == pytest.approx(dp * unscaled.grad_sync_seconds(1e8), rel=1e-12)
    assert scaled.p2p_seconds() == unscaled.p2p_seconds()  # pipeline messages: carried, not refitted


def test_a_kind_the_run_did_not_exercise_keeps_the_calibration(tmp_path):
    plan_input = read_input(FLAGS)
    cand, data = _run(tmp_path / "run", plan_input)
    for rank in data.iterations[0].ranks:  # a GPU's timeline: no TP totals (the host only queued them)
        rank.events = [e for e in rank.events if e[0] != "TP"]
    scales = collective_scales(plan_input.spec, cand, CLUSTER, data)
    assert scales == pytest.approx({"TP": 1.0, "CP": 1.0, "DP": DP_FACTOR}, rel=1e-9)


def test_communication_is_counted_only_between_begin_and_end():
    comm_time.stop("TP", comm_time.start())  # not counting: nothing to add to
    assert comm_time.start() is None
    comm_time.begin()
    stamp = comm_time.start()
    comm_time.stop("CP", stamp)
    totals = comm_time.end()
    assert set(totals) == {"TP", "CP"} and totals["TP"] == 0.0 and 0.0 < totals["CP"] < 1.0
    assert comm_time.start() is None and comm_time.end() == {"TP": 0.0, "CP": 0.0}


def test_the_timeline_records_the_reduction_span_and_the_communication_totals(tmp_path):
    clock = HostClock()
    timeline = Timeline(str(tmp_path), [1], "1F1B", clock=clock)
    timeline._start = 100.0
    comm_time.begin()
    comm_time._totals["TP"] = 0.25  # what the collectives added while the iteration ran
    record = ScheduleRecord(clock=clock, start=100.5, end=102.0, finalized=102.75)
    assert timeline._communication(record) == [("DP", -1, 0, 2000.0, 2750.0), ("TP", -1, 0, 500.0, 750.0)]
    assert comm_time.start() is None  # counting ended with the iteration


def test_one_stage_is_shared_out_in_the_priors_proportions():
    """A PP1 run gives one equation per action for three unknowns: the measured stage is shared out as
    the prior shares it (its level corrected), not all heaped on one part."""
    cand = Candidate(tp=1, pp=1, dp=4, num_microbatches=4, layout="E,t*8,L")
    prior = LayerProfile((0.002, 0.003, 0.001), (0.001, 0.0, 0.001), (0.010, 0.008, 0.004))
    means = {(0, 0, "F"): 2 * (8 * 0.002 + 0.001 + 0.010), (0, 0, "B"): 2 * (8 * 0.004 + 0.001 + 0.012)}
    fitted = fit_costs(means, cand, prior)
    for got, want in zip(
        (fitted.layer, fitted.embedding, fitted.loss), (prior.layer, prior.embedding, prior.loss)
    ):
        assert got[0] == pytest.approx(2 * want[0], rel=1e-6, abs=1e-12)
        assert got[1] + got[2] == pytest.approx(2 * (want[1] + want[2]), rel=1e-6, abs=1e-12)


def test_a_context_parallel_runs_candidate_keeps_its_cp_and_refits_at_its_cp():
    """A TP2 x CP2 x PP4 run (16 ranks): its candidate is CP2 with DP1, and the refit's ratios compare
    the run's rank seconds with the prior's at CP2, so the run's own shape gets them back as they are."""
    from planner.rebalance import _flop_prior, refit_profile

    plan_input = read_input([*FLAGS, "--context-parallel-size", "2"])
    cand = _run_candidate(plan_input, TimelineData("1f1b", 4, 1, 16))
    assert (cand.tp, cand.cp, cand.pp, cand.dp, cand.world_size) == (2, 2, 4, 1, 16)
    fitted = LayerProfile((0.3, 0.2, 0.1), (0.01, 0.0, 0.01), (0.5, 0.4, 0.3))
    refit = refit_profile(plan_input.spec, CLUSTER, cand, fitted)
    for got, run in zip(refit.for_shape(2, 1, "none", 2), (fitted.layer, fitted.embedding, fitted.loss)):
        assert list(got) == pytest.approx(list(run), rel=1e-12)
    prior = _flop_prior(plan_input.spec, CLUSTER)
    at_cp1 = refit.for_shape(2, 1, "none", 1)[0]
    expected = [
        f * p1 / p2
        for f, p1, p2 in zip((0.3, 0.2, 0.1), prior(2, 1, "none", 1)[0], prior(2, 1, "none", 2)[0])
    ]
    assert list(at_cp1) == pytest.approx(expected, rel=1e-12)


def test_every_pipeline_of_a_data_parallel_run_is_measured(tmp_path):
    """PP2 x DP2: ranks 0 and 2 are the first pipeline (60 ms first action to last), 1 and 3 the
    second, whose actions take twice as long (120 ms). The stage means are over both replicas, and
    the pipeline span is the median over both pipelines and the iterations."""
    from planner.rebalance import measured_pipeline_seconds, stage_means

    data = TimelineData("1f1b", 2, 1, 1)
    for iteration, offset in ((5, 0.0), (6, 100.0)):
        ranks = []
        for rank in range(4):
            pp_rank, slow = rank // 2, 1 + rank % 2
            forward = (10.0 * slow * pp_rank, 10.0 * slow * (pp_rank + 1))
            backward = (20.0 * slow * (2 - pp_rank), 20.0 * slow * (3 - pp_rank))
            events = [("F", 0, 0, *forward), ("B", 0, 0, *backward)]
            ranks.append(RankEvents(rank, pp_rank, rank % 2 == 0, events))
        data.iterations.append(IterationTimeline(iteration, offset, ranks))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "timeline.json").write_text(json.dumps(chrome_trace(data)))
    means, read = stage_means(str(tmp_path / "run"))
    assert means[0, 0, "F"] == pytest.approx(0.015) and means[1, 0, "B"] == pytest.approx(0.030)
    assert measured_pipeline_seconds(read) == pytest.approx((0.060 + 0.120) / 2)

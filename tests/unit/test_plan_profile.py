"""``--profile-local``'s measurement: real stages on one rank of a fake process group, per shape.

A context-parallel rank is measured at its own share of the sequence, running ring attention, and
the cost model takes that share as it is (not ``1 / cp`` of the whole sequence).
"""

from __future__ import annotations

from dataclasses import replace

from core.pipeline_parallel.layout import even_layout
from core.transformer.context_parallel.ring import ring_timings
from planner.candidate import Candidate
from planner.costs import LayerProfile, StageCostModel
from planner.hardware import GPUS, Cluster
from planner.inputs import read_input
from planner.profile import measure_shape

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--bf16 --vocab-size 255 --global-batch-size 4"
)
"""A 2-layer GPT whose 64 tokens split into 2 chunks per rank at CP2."""


def test_a_context_parallel_rank_is_measured_running_its_ring():
    """At CP2 the measured layer attends through the ring (its block attentions are timed); at CP1 no
    ring runs. Every part of every stage took time."""
    tiny = read_input(TINY.split())
    for cp, rings in ((1, False), (2, True)):
        with ring_timings() as timings:
            measured = measure_shape(tiny.args, tiny.spec, 1, 1, "none", cp=cp, repeats=1)
        assert (timings.attention > 0) is rings
        layer, embedding, loss = measured
        assert min(layer) > 0 and embedding[0] > 0 and loss[0] > 0 and loss[1] > 0


def test_the_cost_model_takes_a_ranks_measured_share_at_its_cp():
    """A profile measured per shape gives a CP2 candidate its CP2 rank's seconds as they are; a profile
    of one shape only (a run's timeline) gives every candidate that run's rank seconds."""
    spec = read_input(TINY.split()).spec
    whole = ((1.0, 2.0, 3.0), (0.1, 0.0, 0.1), (0.5, 0.4, 0.3))
    share = ((0.7, 1.5, 1.8), (0.05, 0.0, 0.05), (0.3, 0.2, 0.2))
    per_shape = LayerProfile(*whole, by_shape={(1, 1, "none", 1): whole, (1, 1, "none", 2): share})
    cluster = Cluster(4, 4, GPUS["h100"])
    cand = Candidate(tp=1, pp=2, dp=1, cp=2, num_microbatches=4, micro_batch_size=1)
    cand = replace(cand, layout=even_layout(spec.num_layers, 2, 1, cand.rule.placement).to_string())
    for profile, expected in ((per_shape, share), (LayerProfile(*whole), whole)):
        costs = StageCostModel(spec, cand, cluster, profile).compute_costs()
        assert [(c.forward, c.backward_input, c.backward_weight) for c in costs] == list(expected)

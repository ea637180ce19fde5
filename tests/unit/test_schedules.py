"""Schedules without processes: the tables, their lowering, the simulator and the rendezvous check, and
the entry points' checks and hooks on one rank (the executor on real ranks: tests/dist/test_schedules.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from core.model_parallel_config import ModelParallelConfig
from core.parallel_state import generate_parallel_groups
from core.pipeline_parallel.actions import (
    COMPUTE,
    Action,
    ActionKind,
    B,
    F,
    TableError,
    format_tables,
    parse_action,
    parse_tables,
)
from core.pipeline_parallel.losses import reduce_loss_logs
from core.pipeline_parallel.lowering import lower, validate
from core.pipeline_parallel.messages import message_of
from core.pipeline_parallel.rendezvous import check_rendezvous, comm_logs, warm_up_comm_logs
from core.pipeline_parallel.schedule_rules import placement_for, schedule_rule
from core.pipeline_parallel.schedule_tables import (
    build_table,
    build_tables,
    check_interleaving,
    interleaved_order,
    one_f_one_b_table,
)
from core.pipeline_parallel.simulator import ScheduleDeadlock, simulate
from tests.support.pipeline_toy import (
    ToyStage,
    make_forward_step,
    make_microbatches,
    reference_loss_and_grads,
    run_schedule,
)


def test_1f1b_table_has_warmup_steady_cooldown():
    assert [one_f_one_b_table(4, 6, rank) for rank in (0, 3)] == parse_tables("""
        0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5
        0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3 0F4 0B4 0F5 0B5
    """)
    assert one_f_one_b_table(4, 2, 1) == parse_tables("0F0 0F1 0B0 0B1")[0]  # fewer microbatches than warm-up


def test_gpipe_table_is_all_forward_then_all_backward():
    assert build_table("gpipe", 2, 1, 3, 1) == parse_tables("0F0 0F1 0F2 0B0 0B1 0B2")[0]


def test_actions_read_and_print_in_pytorchs_text_form():
    tables = lower(build_tables("zbv", 2, 2, 3), placement_for("zbv", 2, 2))  # F I W, sends, receives
    assert parse_tables(format_tables(tables, marks={0: 3})) == tables
    assert parse_action("1SEND_F3") == Action(ActionKind.SEND_F, 3, 1) and str(Action(F, 0, 2)) == "2F0"
    with pytest.raises(ValueError, match="'0X1' is not an action: write chunk, kind, microbatch"):
        parse_action("0X1")


def test_a_table_that_breaks_a_rule_prints_the_grid_with_the_bad_step_marked():
    placement = placement_for("1f1b", 2, 1)
    tables = parse_tables("""
        0F0 0SEND_F0 0RECV_B0 0B0
        0F0 0RECV_F0 0B0 0SEND_B0
    """)
    with pytest.raises(TableError) as err:
        validate(tables, placement)
    assert str(err.value) == (
        "rank 1 step 0: 0F0 runs before its receive of Message(kind='activation', microbatch=0, "
        "src_stage=0, dst_stage=1)\n"
        "step:          0         1         2         3\n"
        "rank 0:      0F0  0SEND_F0  0RECV_B0       0B0\n"
        "rank 1:     [0F0] 0RECV_F0       0B0  0SEND_B0"
    )
    assert err.value.marks == {1: 0}


def test_interleaved_order_matches_megatrons_documented_table():
    # Megatron's get_schedule_table docstring: PP2, N3, M5, VP2.
    order = interleaved_order(5, 2, 3)
    assert [mb for mb, _ in order] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in order] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_table_warmup_counts():
    pp, v, m = 4, 2, 8
    for rank in range(pp):
        table = build_table("1f1b", pp, v, m, rank)
        warmup = next(i for i, a in enumerate(table) if a.kind == "B") - 1
        assert warmup == 2 * (pp - rank - 1) + (v - 1) * pp
        assert sorted(table) == sorted(
            [Action(k, mb, c) for k in (F, B) for mb in range(m) for c in range(v)]
        )


@pytest.mark.parametrize(
    "pp,m,group,message",
    [
        (
            4,
            2,
            None,
            (
                "interleaved pipeline schedule needs at least pipeline_model_parallel_size (4) microbatches, "
                "got 2; raise the global batch size or lower --pipeline-model-parallel-size"
            ),
        ),
        (
            2,
            5,
            None,
            (
                "number of microbatches (5) leaves a last group of 1 when grouped by "
                "microbatch_group_size_per_vp_stage (2); with interleaving the remainder must be 0 or at least "
                "pipeline_model_parallel_size (2) — with the default group size the microbatch count must be a "
                "multiple of the pipeline size"
            ),
        ),
        (
            4,
            8,
            3,
            (
                "microbatch_group_size_per_vp_stage (3) must lie between pipeline_model_parallel_size (4) "
                "and the number of microbatches (8)"
            ),
        ),
        (4, 9, 5, "number of microbatches (9) leaves a last group of 4 when grouped by"),
    ],
)
def test_interleaving_rules_raise_clear_errors(pp, m, group, message):
    if message.endswith("grouped by"):
        assert check_interleaving(pp, 2, m, group) == group  # a tail of 4 >= pp is legal
        return
    with pytest.raises(ValueError) as err:
        check_interleaving(pp, 2, m, group)
    assert str(err.value) == message


def test_gpipe_with_virtual_stages_is_rejected():
    # One rule (the schedule's record), asked by the tables and the config alike.
    with pytest.raises(
        ValueError, match=r"^the gpipe schedule cannot run virtual pipeline stages \(2 per rank\)"
    ):
        build_table("gpipe", 2, 2, 4, 0)
    with pytest.raises(ValueError, match="^pipeline_schedule='gpipe' cannot run virtual pipeline stages"):
        ModelParallelConfig(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="gpipe"
        )


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_simulated_bubble_matches_the_textbook_formula(schedule, v, pp, m):
    tables = build_tables(schedule, pp, v, m)
    unit = 1.0 / v  # a chunk costs its share of the rank's work
    result = simulate(tables, v, forward_cost=unit, backward_cost=unit)
    assert result.bubble_fraction == pytest.approx(
        schedule_rule(schedule).textbook_bubble(pp, v, m), abs=1e-12
    )


def test_simulated_peak_in_flight():
    pp, m = 4, 8
    assert simulate(build_tables("1f1b", pp, 1, m)).peak_in_flight == [4, 3, 2, 1]
    assert simulate(build_tables("gpipe", pp, 1, m)).peak_in_flight == [8, 8, 8, 8]
    assert simulate(build_tables("1f1b", pp, 2, m), 2).peak_in_flight == [
        2 * (pp - r - 1) + pp + 1 for r in range(pp)
    ]


def test_zb_h1_table_runs_each_weight_gradient_rank_steps_late():
    # Rank 0: warm-up as in 1F1B, then F I W; rank 2: the late weight gradients fill the cool-down.
    assert [build_table("zb-h1", 4, 1, 4, rank) for rank in (0, 2)] == parse_tables("""
        0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3
        0F0 0F1 0I0 0F2 0I1 0F3 0I2 0W0 0I3 0W1 0W2 0W3
    """)


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (8, 32)])
def test_zero_bubble_h1_keeps_1f1b_memory_and_cuts_its_bubble_to_a_third(pp, m):
    """F = I = W = 1: 1F1B idles 3 (pp - 1) units per rank, ZB-H1 pp - 1 (Qi et al., table 1)."""
    one_f_one_b = simulate(build_tables("1f1b", pp, 1, m), 1, forward_cost=1.0, backward_cost=2.0)
    zb = simulate(build_tables("zb-h1", pp, 1, m), 1, forward_cost=1.0, backward_cost=2.0)
    assert one_f_one_b.makespan == 3 * m + 3 * (pp - 1)
    assert zb.makespan == 3 * m + (pp - 1)
    # Rank r runs each W r steps late, so it holds pp microbatches: 1F1B's peak (rank 0's) everywhere.
    assert one_f_one_b.peak_in_flight == [pp - r for r in range(pp)]
    assert zb.peak_in_flight == [pp] * pp


def test_zbv_fills_the_bubble_with_two_chunks_per_rank_in_a_v():
    pp, m = 4, 16
    placement = placement_for("zbv", pp, 2)
    assert [placement.rank_and_chunk(s) for s in range(8)] == [
        *[(r, 0) for r in range(4)],
        *[(r, 1) for r in (3, 2, 1, 0)],
    ]
    costs = {"forward_cost": 0.5, "backward_cost": 1.0}  # per chunk: F = I = W = 1/2
    zbv = simulate(build_tables("zbv", pp, 2, m), placement, **costs)
    interleaved = simulate(build_tables("interleaved", pp, 2, m), 2, **costs)
    assert zbv.makespan < interleaved.makespan
    assert zbv.bubble_fraction < 0.05 < interleaved.bubble_fraction
    assert max(zbv.peak_in_flight) == 2 * pp  # chunk activations: 1F1B's pp microbatches, 2 chunks each


def test_lowering_adds_every_message_on_its_link_in_the_senders_order():
    from core.pipeline_parallel.actions import RECV_B, RECV_F, SEND_B, SEND_F
    from core.pipeline_parallel.messages import Message

    placement = placement_for("zbv", 2, 2)
    complete = lower(build_tables("zbv", 2, 2, 3), placement)
    validate(complete, placement)  # each receive before its consumer, link orders equal
    # Rank 1's chunk 0 hands its output to its own chunk 1 (the bottom of the V) without a message.
    assert complete[1][:5] == parse_tables("0RECV_F0 0F0 0RECV_F1 1F0 1SEND_F0")[0]
    kinds = {a.kind for t in complete for a in t}
    assert kinds == {F, ActionKind.I, ActionKind.W, SEND_F, RECV_F, SEND_B, RECV_B}
    assert Message("activation", 0, 1, 2) not in {
        message_of(a, r, placement) for r, t in enumerate(complete) for a in t if a.kind not in COMPUTE
    }
    broken = [list(t) for t in complete]
    broken[1].remove(Action(RECV_F, 1, 0))
    broken[1].insert(0, Action(RECV_F, 1, 0))  # receives in another order than the sends
    with pytest.raises(ValueError, match="link 0 -> 1: receives .* do not match the sends"):
        validate(broken, placement)


def test_lookahead_is_a_lowering_parameter():
    tables = build_tables("1f1b", 2, 1, 3)
    placement = placement_for("1f1b", 2, 1)
    right_before = lower(tables, placement, lookahead=1)[1]
    two_ahead = lower(tables, placement, lookahead=2)[1]
    assert (
        right_before
        == parse_tables("0RECV_F0 0F0 0B0 0SEND_B0 0RECV_F1 0F1 0B1 0SEND_B1 0RECV_F2 0F2 0B2 0SEND_B2")[0]
    )
    assert two_ahead[:5] == parse_tables("0RECV_F0 0F0 0RECV_F1 0B0 0SEND_B0")[0]
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        lower(tables, placement, lookahead=0)


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zbv", 2)] + [
    (s, v) for s in ("interleaved", "zb-h1") for v in (2, 3, 4)
]


def _legal_configs(max_pp=8, microbatches=range(1, 33), schedules=SCHEDULES):
    for pp, m in itertools.product(range(1, max_pp + 1), microbatches):
        for schedule, v in schedules:
            try:
                yield schedule, pp, v, m, build_tables(schedule, pp, v, m)
            except ValueError:
                continue


def _check_tables(schedule, pp, v, m, tables, variable):
    placement = placement_for(schedule, pp, v)
    complete = lower(tables, placement, variable_shapes=variable)
    simulate(complete, placement, variable_shapes=variable)  # raises ScheduleDeadlock
    check_rendezvous(comm_logs(complete, placement, variable_shapes=variable))


# Every schedule and pipeline size up to 8; microbatch counts through every warm-up/cool-down boundary
# of the single-order schedules (below 2 pp <= 16) and of interleaving (multiples of pp: 24 is the
# first with a steady state at pp 8), and the largest. The slow test below sweeps m = 1..32.
CI_MICROBATCHES = [*range(1, 17), 24, 32]


def test_no_legal_table_deadlocks():
    """Complete tables of every schedule (two virtual stages where it has them), PP <= 8: they neither
    deadlock nor break NCCL's rendezvous rules; fixed lengths, variable ones up to PP 4 and m 8, and
    forward-only tables up to PP 4. ``pytest -m slow -k every_legal_table`` runs m = 1..32, 3 and 4 virtual
    stages, and variable lengths everywhere."""
    checked = 0
    two_chunks = [c for c in SCHEDULES if c[1] <= 2]
    forward_orders = [("1f1b", 1), ("interleaved", 2), ("zbv", 2)]  # the distinct forward-only orders
    for schedule, pp, v, m, tables in _legal_configs(microbatches=CI_MICROBATCHES, schedules=two_chunks):
        _check_tables(schedule, pp, v, m, tables, variable=False)
        if pp <= 4 and m <= 8:
            _check_tables(schedule, pp, v, m, tables, variable=True)
        if (schedule, v) in forward_orders and pp <= 4:
            forward = build_tables(schedule, pp, v, m, forward_only=True)
            _check_tables(schedule, pp, v, m, forward, variable=False)
        checked += 1
    # gpipe, 1f1b, zb-h1 and zbv: 8 x 18 each; interleaved 1F1B and zero-bubble: m a multiple of pp
    multiples = sum(1 for pp in range(1, 9) for m in CI_MICROBATCHES if m % pp == 0)
    assert checked == 4 * 8 * 18 + 2 * multiples == 680


@pytest.mark.slow
def test_every_legal_table_with_every_virtual_size_and_length_is_deadlock_free():
    checked = 0
    for schedule, pp, v, m, tables in _legal_configs():
        for variable in (False, True):
            _check_tables(schedule, pp, v, m, tables, variable)
        _check_tables(schedule, pp, v, m, build_tables(schedule, pp, v, m, forward_only=True), False)
        checked += 1
    # 4 single-order schedules x 8 x 32; interleaved 1F1B and zero-bubble with v = 2, 3, 4
    assert checked == 4 * 8 * 32 + 2 * 3 * sum(32 // pp for pp in range(1, 9))


def test_rendezvous_check_follows_nccls_rules():
    """Head-to-head sends complete only if each meets its receive: in one batch, or on separate links."""
    act, grad = ("activation", 0, 1, "data"), ("gradient", 0, 0, "data")
    one_stream_apart = [
        [("post", "pp", [(True, 1, act)]), ("post", "pp", [(False, 1, grad)]), ("wait", grad)],
        [("post", "pp", [(True, 0, grad)]), ("post", "pp", [(False, 0, act)]), ("wait", act)],
    ]
    with pytest.raises(ScheduleDeadlock, match="posted operations wait on each other"):
        check_rendezvous(one_stream_apart)
    one_batch = [
        [("post", "pp", [(True, 1, act), (False, 1, grad)]), ("wait", grad)],
        [("post", "pp", [(True, 0, grad), (False, 0, act)]), ("wait", act)],
    ]
    check_rendezvous(one_batch)
    per_link = [
        [("post", "a01", [(True, 1, act)]), ("post", "g10", [(False, 1, grad)]), ("wait", grad)],
        [("post", "g10", [(True, 0, grad)]), ("post", "a01", [(False, 0, act)]), ("wait", act)],
    ]
    check_rendezvous(per_link)
    # A send that is only posted after waiting for what the peer sends after waiting: a real cycle.
    cyclic = [
        [("post", "g10", [(False, 1, grad)]), ("wait", grad), ("post", "a01", [(True, 1, act)])],
        [("post", "a01", [(False, 0, act)]), ("wait", act), ("post", "g10", [(True, 0, grad)])],
    ]
    with pytest.raises(ScheduleDeadlock):
        check_rendezvous(cyclic)
    with pytest.raises(ScheduleDeadlock, match="rank 0 posts .* but rank 1 never posts its half"):
        check_rendezvous([[("post", "a01", [(True, 1, act)])], []])


def test_link_warm_up_order_cannot_deadlock_under_nccls_rules():
    """The startup exchange on every pipeline link, in its one global order, completes for every PP
    size up to 8 (wrap-around links included) with one and two pipelines, and then the schedules'
    own posts complete after it; each rank taking its own outgoing links first would deadlock."""
    for pp, dp in itertools.product(range(1, 9), (1, 2)):
        pipelines = generate_parallel_groups(pp * dp, pipeline_model_parallel_size=pp)["pp"]
        logs = warm_up_comm_logs(pipelines, pp * dp)
        check_rendezvous(logs)
        links = 2 * pp if pp > 2 else 2 * (pp - 1)  # each way between neighbours, wrap-around included
        assert sum(len(log) for log in logs) == 4 * links * dp  # a post and a wait on both ends
        if pp == 1:
            continue
        mine_first = [_outgoing_first(rank, log) for rank, log in enumerate(logs)]
        with pytest.raises(ScheduleDeadlock, match="posted operations wait on each other"):
            check_rendezvous(mine_first)
        if dp == 1:
            for schedule, v in (("interleaved", 2), ("zbv", 2), ("1f1b", 1)):
                placement = placement_for(schedule, pp, v)
                complete = lower(build_tables(schedule, pp, v, 2 * pp), placement)
                check_rendezvous([w + c for w, c in zip(logs, comm_logs(complete, placement))])


def _outgoing_first(rank: int, log: list[tuple]) -> list[tuple]:
    """A rank's warm-up log with the links it sends on first (a per-rank order, not a global one)."""
    pairs = [log[i : i + 2] for i in range(0, len(log), 2)]
    pairs.sort(key=lambda pair: pair[0][1][0] != rank)  # stream (src, dst): src == rank first
    return [entry for pair in pairs for entry in pair]


def test_simulator_detects_a_deadlock_and_marks_where_each_rank_waits():
    tables = parse_tables("""
        0F0 0B0 0F1 0B1
        0F1 0B1 0F0 0B0
    """)
    with pytest.raises(ScheduleDeadlock) as err:
        simulate(tables)
    assert str(err.value).startswith(
        "schedule deadlocks: every rank waits (rank: next action) {0: '0B0', 1: '0F1'}"
    )
    assert "\nrank 0: " in str(err.value) and "[0B0]" in str(err.value) and "[0F1]" in str(err.value)


def test_world_size_one_runs_without_communication():
    """No process group at all: the same entry point, no communication."""
    from core.pipeline_parallel.schedules import get_forward_backward_func

    assert not dist.is_initialized()
    config = ModelParallelConfig(hidden_size=8)
    model = ToyStage(config, ["E", "t", "t", "L"], [0, 1])
    batches = make_microbatches(3, 2, 6, variable=True)
    logs = run_schedule(get_forward_backward_func(), model, batches, seq_length=6)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss, ref = reference_loss_and_grads(model, batches, per_token=False)
    assert torch.stack([d["lm loss"] for d in logs]).mean().item() == pytest.approx(loss.item(), rel=1e-6)
    for n, g in grads.items():
        assert ((g - ref[n]).norm() / ref[n].norm()).item() < 1e-6, n
    assert not dist.is_initialized()


def test_timeline_draws_the_simulated_schedule():
    from tools.schedule_timeline import render, simulated

    grid = render(simulated("1f1b", 2, 1, 2, forward=1.0, backward=2.0), slot=1.0).splitlines()
    assert [row.rstrip() for row in grid] == [
        "rank 0 |F0  F1  .   .   B0  B0  .   B1  B1",
        "rank 1 |.   F0  B0  B0  F1  B1  B1  .   .",
    ]


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            {"adjust_tensor_shapes_fn": lambda r, s: (r, s)},
            ValueError,
            "adjust_tensor_shapes_fn is not supported by Trident's schedules",
        ),
        (
            {"decoder_seq_length": 3},
            ValueError,
            r"decoder_seq_length \(3\) only applies to encoder-decoder models",
        ),
        ({"bogus": 1}, TypeError, "unexpected keyword argument 'bogus' for a forward-backward function"),
    ],
)
def test_megatron_keywords_are_accepted_or_rejected_clearly(kwargs, error, message):
    from core.pipeline_parallel.schedules import forward_backward_no_pipelining

    model = ToyStage(ModelParallelConfig(hidden_size=8), ["E", "t", "L"], [0])
    batches = make_microbatches(2, 2, 6, variable=False)
    common = {
        "forward_step_func": make_forward_step(False),
        "model": model,
        "num_microbatches": 2,
        "seq_length": 6,
        "micro_batch_size": 2,
    }
    logs = forward_backward_no_pipelining(
        data_iterator=iter(batches),
        decoder_seq_length=6,
        first_val_step=True,
        collect_non_loss_data=False,
        **common,
    )
    assert len(logs) == 2  # Megatron's harmless keywords are accepted
    with pytest.raises(error, match=message):
        forward_backward_no_pipelining(data_iterator=iter(batches), **kwargs, **common)


def _one_rank_step(model, per_token=False, loss_func=None, **kwargs):
    from core.pipeline_parallel.schedules import forward_backward_no_pipelining

    step = make_forward_step(per_token)
    if loss_func is not None:

        def step(data_iterator, chunk):
            tokens, labels, mask = next(data_iterator)
            return chunk(tokens, labels=labels), lambda out: loss_func(mask, out)

    return forward_backward_no_pipelining(
        forward_step_func=step,
        data_iterator=iter(make_microbatches(2, 2, 6, variable=False)),
        model=model,
        num_microbatches=2,
        seq_length=6,
        micro_batch_size=2,
        **kwargs,
    )


def test_hooks_come_typed_or_by_megatrons_names_not_both():
    from core.pipeline_parallel.hooks import ScheduleHooks

    def finalize(chunks, tokens):
        return None

    megatron = ModelParallelConfig(hidden_size=8, finalize_model_grads_func=finalize)
    assert ScheduleHooks.from_config(megatron) == ScheduleHooks(finalize_model_grads=finalize)
    typed = ScheduleHooks(finalize_model_grads=finalize)
    assert ScheduleHooks.from_config(ModelParallelConfig(hidden_size=8, schedule_hooks=typed)) is typed
    both = ModelParallelConfig(hidden_size=8, schedule_hooks=typed, grad_sync_func=print)
    with pytest.raises(ValueError, match="has both schedule_hooks and Megatron's grad_sync_func"):
        ScheduleHooks.from_config(both)


def test_every_chunk_sees_the_same_hooks():
    from core.pipeline_parallel.hooks import ScheduleHooks
    from core.pipeline_parallel.schedules import _hooks_of

    shared = ScheduleHooks(finalize_model_grads=lambda chunks, tokens: None)
    chunks = [
        ToyStage(ModelParallelConfig(hidden_size=8, schedule_hooks=shared), ["t"], [i]) for i in range(2)
    ]
    assert _hooks_of(chunks) is shared
    chunks[1].config.schedule_hooks = ScheduleHooks(finalize_model_grads=lambda chunks, tokens: None)
    with pytest.raises(ValueError, match="model chunks 0 and 1 carry different schedule hooks"):
        _hooks_of(chunks)


def test_grad_scale_func_scales_the_loss_before_backward_and_timers_time_compute():
    from core.pipeline_parallel.hooks import ScheduleHooks

    plain = ToyStage(ModelParallelConfig(hidden_size=8), ["E", "t", "L"], [0])
    _one_rank_step(plain)
    calls = []

    class Timer:
        def __init__(self, name):
            self.name = name

        def start(self):
            calls.append(("start", self.name))

        def stop(self):
            calls.append(("stop", self.name))

    hooks = ScheduleHooks(grad_scale_func=lambda loss: loss * 4.0, timers=lambda name, log_level: Timer(name))
    scaled = ToyStage(ModelParallelConfig(hidden_size=8), ["E", "t", "L"], [0])
    logs = _one_rank_step(scaled, schedule_hooks=hooks)
    for p, q in zip(scaled.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad * 4.0)  # a power of two: exact
    assert len(logs) == 2
    assert calls == [
        (what, name) for name in ("forward-compute", "backward-compute") * 2 for what in ("start", "stop")
    ]


def test_loss_func_forms_are_checked_and_any_keys_are_reported():

    model = ToyStage(ModelParallelConfig(hidden_size=8), ["E", "t", "L"], [0])

    def two(mask, out):
        loss = (out * mask).sum() / mask.sum()
        return loss, {"my loss": loss.detach(), "tokens seen": mask.sum()}

    logs = _one_rank_step(model, loss_func=two)
    reduced = reduce_loss_logs(logs)
    assert set(reduced) == {"my loss", "tokens seen"} and logs.summed is False
    with pytest.raises(TypeError, match="loss_func must return .* got a 4-tuple"):
        _one_rank_step(model, loss_func=lambda mask, out: (out.sum(), 1, 2, {}))
    with pytest.raises(TypeError, match="must be a dict of logged values, got float"):
        _one_rank_step(model, loss_func=lambda mask, out: (out.sum(), 1.0))
    per_token = ToyStage(ModelParallelConfig(hidden_size=8, calculate_per_token_loss=True), ["E", "L"], [])
    with pytest.raises(
        ValueError, match="calculate_per_token_loss needs loss_func to return .* got a 2-tuple"
    ):
        _one_rank_step(per_token, loss_func=two)
    with pytest.raises(
        ValueError, match="logged value 'lm loss' has 1 elements; with the .* form it must be"
    ):
        reduce_loss_logs([{"lm loss": torch.tensor(1.0)}], summed=True)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            "--pipeline-model-parallel-size 2 --pipeline-schedule zbv",
            (
                "--pipeline-schedule zbv runs exactly 2 model chunks per pipeline rank (a V), got 1: give "
                "--num-virtual-stages-per-pipeline-rank 2 (or a --pipeline-model-parallel-layout with 4 stages)"
            ),
        ),
        (
            "--pipeline-model-parallel-size 2 --pipeline-schedule zbv --num-virtual-stages-per-pipeline-rank 4",
            (
                "--pipeline-schedule zbv runs exactly 2 model chunks per pipeline rank (a V), got 4: give "
                "--num-virtual-stages-per-pipeline-rank 2 (or a --pipeline-model-parallel-layout with 4 stages)"
            ),
        ),
        (
            "--pipeline-model-parallel-size 2 --pipeline-schedule gpipe --num-virtual-stages-per-pipeline-rank 2",
            "--pipeline-schedule gpipe cannot run virtual pipeline stages (2 per rank); the 1f1b schedule interleaves them",
        ),
    ],
)
def test_schedule_flags_break_the_rules_with_one_clear_error(flags, message):
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    argv = "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    argv += (
        "--global-batch-size 8 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 100 "
        + flags
    )
    with pytest.raises(ValueError) as err:
        validate_args(parse_args(argv.split()), 2)
    assert str(err.value) == message


def test_zero_bubble_flags_pass_with_their_layouts():
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    argv = "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    argv += "--global-batch-size 6 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 100 "
    argv += "--pipeline-model-parallel-size 2 "
    zbv = validate_args(
        parse_args((argv + "--pipeline-schedule zbv --pipeline-model-parallel-layout Et|tt|ttt|ttL").split()),
        2,
    )
    assert zbv.virtual_pipeline_model_parallel_size == 2 and zbv.num_microbatches == 6  # any count
    assert (
        validate_args(parse_args((argv + "--pipeline-schedule zb-h1").split()), 2).pipeline_schedule
        == "zb-h1"
    )

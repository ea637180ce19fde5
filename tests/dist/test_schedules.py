"""The executor on real ranks: every schedule against single-device references (the tables, lowering and
simulator, without processes, are in tests/unit/test_schedules.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from core.model_parallel_config import ModelParallelConfig
from core.pipeline_parallel.layout import even_layout, parse_layout
from core.pipeline_parallel.losses import reduce_loss_logs
from core.pipeline_parallel.rendezvous import check_rendezvous, comm_logs
from core.pipeline_parallel.schedule_rules import placement_for
from core.pipeline_parallel.schedule_tables import build_tables
from core.pipeline_parallel.simulator import ScheduleDeadlock, simulate
from tests.support.pipeline_toy import (
    ToyStage,
    make_forward_step,
    make_microbatches,
    reference_loss_and_grads,
    run_schedule,
)


class CheckedStage(ToyStage):
    """A toy stage that checks Megatron's calling conventions as the schedule runs it."""

    def set_input_tensor(self, tensors):
        from core import parallel_state as ps

        assert isinstance(tensors, list) and len(tensors) == 1, tensors
        first = (
            ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=self.vp_stage)
            if ps.model_parallel_is_initialized()
            else True
        )
        assert (tensors[0] is None) == first, "set_input_tensor must get [None] exactly on the first stage"
        super().set_input_tensor(tensors)

    def forward(self, tokens=None, labels=None):
        from core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_virtual_pipeline_model_parallel_world_size():
            # vp_stage travels with the chunk (Megatron Core's convention); nothing global is set.
            assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=self.vp_stage) == (
                ps.is_pipeline_first_stage() and self.vp_stage == 0
            )
        return super().forward(tokens, labels)


def _chunks(layout, pp_rank, config, seed=0):
    return [
        CheckedStage(
            config, layout.stage_layers(pp_rank, c), layout.decoder_layers(pp_rank, c), seed, vp_stage=c
        )
        for c in range(layout.vpp_size)
    ]


CONFIG_SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "1f1b", "zb-h1": "zb-h1", "zbv": "zbv"}


def _run_case(
    schedule: str,
    pp: int,
    layout_str: str | None,
    num_layers: int,
    vpp: int,
    m: int,
    variable: bool,
    per_token: bool,
):
    """One configuration on this rank; returns its problems (empty when all is well) and its comm log."""
    from core import parallel_state as ps
    from core.distributed import finalize_model_grads
    from core.pipeline_parallel.executor import ScheduleRecord
    from core.pipeline_parallel.schedules import complete_tables, get_forward_backward_func

    pp_rank = ps.get_pipeline_model_parallel_rank()
    ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    style = "v" if schedule == "zbv" else "loop"
    if layout_str:
        layout = parse_layout(layout_str, pp, vpp, placement=style)
    else:
        layout = even_layout(num_layers, pp, vpp, placement=style)
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        hidden_size=8,
        pipeline_schedule=CONFIG_SCHEDULE[schedule],
        variable_seq_lengths=variable,
        calculate_per_token_loss=per_token,
        finalize_model_grads_func=finalize_model_grads,
    )
    chunks = _chunks(layout, pp_rank, config)
    batches = make_microbatches(m, 2, 6, variable)
    record = ScheduleRecord()
    logs = run_schedule(
        get_forward_backward_func(),
        chunks if vpp > 1 else chunks[0],
        batches,
        seq_length=6,
        per_token=per_token,
        record=record,
    )
    name = f"{schedule} pp={pp} vpp={vpp} m={m} layout={layout_str or 'even'} var={variable} tok={per_token}"
    problems = _compare_with_single_device(name, chunks, layout, batches, logs, per_token, pp_rank, vpp)

    # The run did exactly what its complete table says: the same posts and waits, the same peak.
    ran = schedule if vpp > 1 or pp > 1 else "1f1b"  # PP=1 without virtual stages: no pipelining
    placement = placement_for(ran, pp, vpp)
    tables = complete_tables(ran, pp, vpp, m, variable_shapes=variable)
    if record.comm_log != comm_logs(tables, placement, variable_shapes=variable)[pp_rank]:
        problems.append(f"{name}: the recorded posting order differs from the complete table's")
    expected_peak = simulate(tables, placement).peak_in_flight[pp_rank]
    if record.peak_in_flight != expected_peak:
        problems.append(f"{name}: peak in-flight {record.peak_in_flight}, simulator says {expected_peak}")
    return problems, (name, record.comm_log)


def _compare_with_single_device(name, chunks, layout, batches, logs, per_token, pp_rank, vpp):
    """Gradients torch.equal to no-pipelining and within 1e-5 of the plain model; losses likewise."""
    from core.distributed import finalize_model_grads
    from core.pipeline_parallel.schedules import forward_backward_no_pipelining

    # Single-device references built from the same seed: no-pipelining through the same entry point,
    # and the plain model computing the whole loss in one backward.
    whole = ToyStage(
        ModelParallelConfig(
            hidden_size=8, calculate_per_token_loss=per_token, finalize_model_grads_func=finalize_model_grads
        ),
        ["E"] + ["t"] * layout.num_decoder_layers + ["L"],
        list(range(layout.num_decoder_layers)),
    )
    ref_logs = run_schedule(forward_backward_no_pipelining, whole, batches, seq_length=6, per_token=per_token)
    no_pipe = {n: p.grad.clone() for n, p in whole.named_parameters()}
    plain_loss, plain = reference_loss_and_grads(whole, batches, per_token)
    problems = []
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            if p.grad is None or not p.grad.abs().sum() > 0:
                problems.append(f"{name}: {n} got no gradient")
                continue
            if not torch.equal(p.grad, no_pipe[n]):
                problems.append(
                    f"{name}: {n} differs from no-pipelining by {(p.grad - no_pipe[n]).abs().max():.3e}"
                )
            rel = ((p.grad - plain[n]).norm() / plain[n].norm()).item()
            if rel > 1e-5:
                problems.append(f"{name}: {n} relative difference {rel:.2e} from the plain model")
    if layout.has_loss(pp_rank, vpp - 1 if vpp > 1 else None):
        same = len(logs) == len(ref_logs) and all(
            torch.equal(a["lm loss"], b["lm loss"]) for a, b in zip(logs, ref_logs)
        )
        if not same:
            problems.append(f"{name}: losses differ from no-pipelining")
        loss = reduce_loss_logs(logs)["lm loss"]
        if abs(loss - plain_loss.item()) > 1e-5 * abs(plain_loss.item()):
            problems.append(f"{name}: loss {loss} vs plain {plain_loss.item()}")
    elif logs:
        problems.append(f"{name}: non-last stage returned logs")
    return problems


def _grid(pp: int, microbatches, schedules):
    cases = []
    for schedule, vpp in schedules:
        for m in microbatches:
            try:
                build_tables(schedule, pp, vpp, m)
            except ValueError:
                continue
            for layout_str, num_layers in _layouts(pp, vpp):
                for variable in (False, True):
                    cases.append((schedule, pp, layout_str, num_layers, vpp, m, variable, m % 2 == 0))
    return cases


def _layouts(pp: int, vpp: int):
    """An even split with a remainder, and an uneven one with an empty stage."""
    stages = pp * vpp
    uneven = {1: "Ettt,L", 2: "Et|ttL", 4: "E|tt|t|L", 8: "Et|t|tt||t|t|tt|L"}[stages]
    return [(None, 2 * stages - 1), (uneven, None)]


def _pipeline_grid(rank, world_size, pp, microbatches, schedules):
    from core import parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
    problems, logs = [], []
    for case in _grid(pp, microbatches, schedules):
        case_problems, log = _run_case(*case)
        problems += case_problems
        logs.append(log)
    return problems, logs, ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def _one_stream(log: list[tuple]) -> list[tuple]:
    """The same posts as if every message went on one pipeline group (one stream per rank)."""
    return [("post", "pp", entry[2]) if entry[0] == "post" else entry for entry in log]


def _check_grid(ranks, pp, microbatches, schedules):
    results = ranks(4).run(_pipeline_grid, pp, microbatches, schedules, timeout=300)
    problems = [p for probs, *_ in results for p in probs]
    assert not problems, "\n".join(problems[:20])
    for dp_rank in {r[2] for r in results}:
        pipeline = sorted((r for r in results if r[2] == dp_rank), key=lambda r: r[3])
        one_stream_ok = []
        for case, (name, _) in enumerate(pipeline[0][1]):
            check_rendezvous([r[1][case][1] for r in pipeline])
            try:
                check_rendezvous([_one_stream(r[1][case][1]) for r in pipeline])
                one_stream_ok.append(name)
            except ScheduleDeadlock:
                pass
        # On one stream, receives posted ahead of need block the sends behind them: every fixed-length
        # case deadlocks (variable lengths post each receive right before its consumer).
        assert pp == 1 or all("var=True" in name for name in one_stream_ok), one_stream_ok
    return len(results[0][1])


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_schedule_matches_single_device_training(ranks, pp):
    """PP x VPP x microbatches x fixed/variable lengths x even/uneven/empty stages, 2- and 3-tuple losses.

    Every run's actual posting order equals its complete table's and passes NCCL's rules
    (check_rendezvous); the same messages on one group per rank instead of one per link would
    deadlock there.
    """
    cases = _check_grid(ranks, pp, range(1, 10), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
    assert cases >= 20


ZERO_BUBBLE = [("zb-h1", 1), ("zb-h1", 2), ("zbv", 2)]


@pytest.mark.parametrize("pp", [2, 4])
def test_zero_bubble_schedules_match_single_device_training(ranks, pp):
    """ZB-H1, interleaved zero-bubble and ZBV: gradients torch.equal to no-pipelining.

    CI runs one microbatch, the smallest count interleaving allows (4) and an odd one (5); ``pytest
    -m slow -k zero_bubble_grid`` runs every count from 1 to 9, and PP = 1."""
    cases = _check_grid(ranks, pp, [1, 4, 5], ZERO_BUBBLE)
    assert cases == (3 + 1 + 3) * 4  # zb-h1 and zbv at every count, interleaved zb at 4; 4 variants each


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_zero_bubble_grid_every_microbatch_count(ranks, pp):
    schedules = ZERO_BUBBLE if pp > 1 else ZERO_BUBBLE[1:]  # PP=1 without chunks is no pipelining
    _check_grid(ranks, pp, range(1, 10), schedules)


def _interleaved_pp2_swaps(rank, world_size):
    """PP=2: prev and next are the same rank; activation and gradient must not be confused."""
    from core import parallel_state as ps
    from core.pipeline_parallel.p2p_communication import P2PCommunicator

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, hidden_size=3)
    comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
    act = torch.full((2, 1, 3), 10.0 * rank + 1)
    grad = torch.full((2, 1, 3), 10.0 * rank + 2)
    got_act, got_grad = comm.send_forward_backward_recv_forward_backward(act, grad, True, True, (2, 1, 3))

    # Megatron's batched order posts "send prev, recv prev, send next, recv next" with one tag:
    # between two ranks that are both prev and next, gloo then delivers the gradient as activation.
    peer = ps.get_pipeline_model_parallel_next_rank()
    a_buf, g_buf = torch.empty(2, 1, 3), torch.empty(2, 1, 3)
    ops = [
        dist.P2POp(dist.isend, grad, peer),
        dist.P2POp(dist.irecv, a_buf, peer),
        dist.P2POp(dist.isend, act, peer),
        dist.P2POp(dist.irecv, g_buf, peer),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    naive = a_buf[0, 0, 0].item(), g_buf[0, 0, 0].item()

    # Megatron's paired calls: 1F1B's steady state (stage 0 sends forward, stage 1 backward), then the
    # interleaved ones (both send forward, then both backward, the latter with requests to wait on).
    if rank == 0:
        steady = comm.send_forward_recv_backward(act, (2, 1, 3), is_last_stage=False)
    else:
        steady = comm.send_backward_recv_forward(grad, (2, 1, 3), is_first_stage=False)
    forward = comm.send_forward_recv_forward(act, True, (2, 1, 3))
    backward, reqs = comm.send_backward_recv_backward(grad, True, (2, 1, 3), overlap_p2p_comm=True)
    for req in reqs:
        req.wait()
    edge = comm.send_forward_recv_backward(act, [(2, 1, 3), (2, 1, 3)], is_last_stage=True)
    megatron = tuple(t[0, 0, 0].item() for t in (steady, forward, backward)) + (edge,)
    return (got_act[0, 0, 0].item(), got_grad[0, 0, 0].item(), *naive, *megatron)


def test_pp2_activations_and_gradients_never_swap(ranks):
    results = ranks(2).run(_interleaved_pp2_swaps, timeout=60)
    assert results[0][:2] == (11.0, 12.0)  # rank 0 got rank 1's activation and gradient
    assert results[1][:2] == (1.0, 2.0)
    # The naive order really does swap them on gloo (this is why the canonical order exists).
    assert results[0][2:4] == (12.0, 11.0)
    # Megatron's paired calls: (steady-state reply, forward received, backward received, no neighbour).
    assert results[0][4:] == (12.0, 11.0, 12.0, [None, None])
    assert results[1][4:] == (1.0, 1.0, 2.0, [None, None])


def _variable_shapes(rank, world_size):
    from core import parallel_state as ps
    from core.pipeline_parallel.p2p_communication import P2PCommunicator

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, hidden_size=3, variable_seq_lengths=True)
    comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
    if rank == 0:
        comm.send_forward(torch.arange(15.0).view(5, 1, 3), is_last_stage=False)
        return comm.recv_backward(None, is_last_stage=False).shape
    got = comm.recv_forward(None, is_first_stage=False)
    comm.send_backward(torch.ones(4, 2, 3), is_first_stage=False)
    return got.shape, got.sum().item()


def test_variable_shapes_travel_with_the_message(ranks):
    results = ranks(2).run(_variable_shapes, timeout=60)
    assert results[0] == torch.Size([4, 2, 3])
    assert results[1] == (torch.Size([5, 1, 3]), 105.0)


def _bad_microbatch_count(rank, world_size):
    from core import parallel_state as ps
    from core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, hidden_size=8
    )
    layout = even_layout(4, 2, 2)
    chunks = _chunks(layout, ps.get_pipeline_model_parallel_rank(), config)
    try:
        forward_backward_pipelining_with_interleaving(
            forward_step_func=make_forward_step(False),
            data_iterator=[iter([])] * 2,
            model=chunks,
            num_microbatches=3,
            seq_length=6,
            micro_batch_size=2,
        )
    except ValueError as err:
        return str(err)
    return None


def test_illegal_interleaving_fails_on_every_rank_before_communicating(ranks):
    messages = ranks(2).run(_bad_microbatch_count, timeout=60)
    assert messages[0] is not None and messages == [messages[0]] * 2
    assert messages[0].startswith("number of microbatches (3) leaves a last group of 1")


def _forward_only(rank, world_size):
    """Evaluation: no activations kept, no backward, the same losses as training's forward."""
    from core import parallel_state as ps
    from core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func

    results = []
    for vpp in (1, 2):
        ps.initialize_model_parallel(
            pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
        )
        config = ModelParallelConfig(
            pipeline_model_parallel_size=4,
            hidden_size=8,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        )
        layout = even_layout(8, 4, vpp)
        chunks = _chunks(layout, ps.get_pipeline_model_parallel_rank(), config)
        batches = make_microbatches(8, 2, 6, variable=False)
        with torch.no_grad():
            logs = run_schedule(get_forward_backward_func(), chunks, batches, seq_length=6, forward_only=True)
        whole = ToyStage(ModelParallelConfig(hidden_size=8), ["E"] + ["t"] * 8 + ["L"], list(range(8)))
        ref = run_schedule(forward_backward_no_pipelining, whole, batches, seq_length=6, forward_only=True)
        no_grads = all(p.grad is None for c in chunks for p in c.parameters())
        same = [torch.equal(a["lm loss"], b["lm loss"]) for a, b in zip(logs, ref)]
        results.append((len(logs), all(same), no_grads))
        ps.destroy_model_parallel()
    return results


def test_forward_only_keeps_nothing_and_matches(ranks):
    results = ranks(4).run(_forward_only, timeout=120)
    assert results[3] == [(8, True, True), (8, True, True)]  # last stage: 8 losses equal to no-pipelining
    assert results[0] == [(0, True, True), (0, True, True)]

"""Data parallelism on real ranks: DDP's reductions (averaged gradients, parameters broadcast, overlap
bit-identical to no overlap, buckets launched during the backward) and finalize_model_grads on
``main_grad`` (tied embeddings, sequence-parallel norms). The buffers and buckets in one process:
tests/unit/test_distributed.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
    multi_no_sync,
)
from core.distributed.grad_buffer import DONE, LAUNCHED
from core.model_parallel_config import ModelParallelConfig
from tests.support.data_parallel import relative_error, toy
from tests.support.pipeline_toy import (
    ToyStage,
    make_forward_step,
    make_microbatches,
    reference_loss_and_grads,
)

MICROBATCHES = 4


# --------------------------------------------------------------------------------------------------
# Real ranks: TP=2 x DP=2 on 4 ranks (DP groups [0, 2] and [1, 3])
# --------------------------------------------------------------------------------------------------


def _all_batches():
    """This rank's microbatches and those of its whole DP group (in group order).

    Data differ on every global rank, TP peers included, so that reducing over any group but the
    DP group gives a wrong answer.
    """
    from core import parallel_state as ps

    members = ps.get_parallel_groups().ranks["dp"]
    per_rank = {r: make_microbatches(MICROBATCHES, 2, 6, False, seed=100 + r) for r in members}
    return per_rank[ps.get_parallel_groups().rank], [b for r in members for b in per_rank[r]]


def _record_launches(ddp, model, events):
    """Log each bucket launch, and each time the embedding's gradient (the last of backward) is computed."""
    for bucket in ddp.buckets:
        start = bucket.start_grad_sync

        def recorded(bucket=bucket, start=start):
            if bucket.state not in (LAUNCHED, DONE):
                events.append(f"launch {bucket.index}")
            start()

        bucket.start_grad_sync = recorded
    model.embedding.weight.register_hook(lambda grad: events.append("embedding grad"))


def _ddp_run(overlap: bool, per_token: bool, driver: str, iterations: int = 1):
    """One configuration; returns (problems, flat main grads, events)."""
    from core.pipeline_parallel.executor import ScheduleRecord
    from core.pipeline_parallel.schedules import forward_backward_no_pipelining

    batches, everyone = _all_batches()
    model = toy(per_token)
    config = ModelParallelConfig(hidden_size=8, calculate_per_token_loss=per_token)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=100), model
    )
    config.no_sync_func = ddp.no_sync
    if driver == "schedule+grad_sync_func":
        config.grad_sync_func = ddp.start_grad_sync
    events: list[str] = []
    _record_launches(ddp, model, events)
    _, expected = reference_loss_and_grads(toy(per_token), everyone, per_token)
    name = f"{driver} overlap={overlap} per_token={per_token}"
    problems = []
    for _ in range(iterations):
        ddp.zero_grad_buffer()
        events.clear()
        if driver.startswith("schedule"):
            record = ScheduleRecord()
            forward_backward_no_pipelining(
                forward_step_func=make_forward_step(per_token),
                data_iterator=iter(batches),
                model=ddp,
                num_microbatches=MICROBATCHES,
                seq_length=6,
                micro_batch_size=2,
                record=record,
            )
            num_tokens = record.num_tokens
        else:  # by hand: no_sync for all but the last microbatch
            num_tokens = torch.zeros((), dtype=torch.int64)
            for i, (tokens, labels, mask) in enumerate(batches):
                with ddp.no_sync() if i < MICROBATCHES - 1 else contextlib.nullcontext():
                    loss = (ddp(tokens, labels=labels) * mask).sum()
                    if not per_token:
                        loss = loss / mask.sum() / MICROBATCHES
                    num_tokens += mask.sum().to(torch.int64)
                    loss.backward()
        launched = all(b.state == LAUNCHED for b in ddp.buckets)
        if launched != (overlap or driver == "schedule+grad_sync_func"):
            problems.append(f"{name}: buckets launched before finish_grad_sync: {launched}")
        if per_token:  # reduced but not yet normalised: the sum over replicas, not the average
            ddp.finish_grad_sync()
            all_tokens = sum(mask.sum() for _, _, mask in everyone)
            for n, p in model.named_parameters():
                if relative_error(p.main_grad, expected[n] * all_tokens) > 1e-6:
                    problems.append(f"{name}: {n} is not the sum over data-parallel ranks")
        finalize_model_grads([ddp], num_tokens if per_token else None)
    for n, param in model.named_parameters():
        rel = relative_error(param.main_grad, expected[n])
        if rel > 1e-6:
            problems.append(f"{name}: {n} off by {rel:.2e}")
    flat = torch.cat([p.main_grad.reshape(-1) for p in model.parameters()])
    return problems, flat, list(events)


def _interleaved_run(overlap: bool, grad_sync: bool) -> list[str]:
    """Two virtual chunks on one rank, each wrapped; one no_sync for both, a grad_sync_func per chunk."""
    from core import parallel_state as ps
    from core.pipeline_parallel.layout import even_layout
    from core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    ps.set_virtual_pipeline_model_parallel_world_size(2)
    layout = even_layout(2, 1, 2)
    config = ModelParallelConfig(hidden_size=8, virtual_pipeline_model_parallel_size=2)
    chunks = [
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=50),
            ToyStage(config, layout.stage_layers(0, c), layout.decoder_layers(0, c), vp_stage=c),
        )
        for c in range(2)
    ]
    config.no_sync_func = multi_no_sync(chunks)
    config.grad_sync_func = [c.start_grad_sync for c in chunks] if grad_sync else None
    config.finalize_model_grads_func = finalize_model_grads
    batches, everyone = _all_batches()
    forward_backward_pipelining_with_interleaving(
        forward_step_func=make_forward_step(False),
        data_iterator=[iter(batches), iter(batches)],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=6,
        micro_batch_size=2,
    )
    ps.set_virtual_pipeline_model_parallel_world_size(None)
    _, expected = reference_loss_and_grads(toy(), everyone, False)
    return [
        f"interleaved overlap={overlap} grad_sync={grad_sync}: {n} off by {relative_error(p.main_grad, expected[n]):.2e}"
        for chunk in chunks
        for n, p in chunk.module.named_parameters()
        if relative_error(p.main_grad, expected[n]) > 1e-6
    ]


def _ddp_cases(rank, world_size):
    from core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    results = {}
    for driver in ("manual", "schedule", "schedule+grad_sync_func"):
        for overlap in (False, True):
            for per_token in (False, True):
                results[(driver, overlap, per_token)] = _ddp_run(
                    overlap, per_token, driver, iterations=2 if driver == "manual" else 1
                )
    for overlap in (False, True):
        for grad_sync in (False, True):
            results[("interleaved", overlap, grad_sync)] = (_interleaved_run(overlap, grad_sync), None, None)
    return results


def _broadcast_case(rank, world_size):
    from core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = toy()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    DistributedDataParallel(model.config, DistributedDataParallelConfig(), model).broadcast_params()
    return model.head.bias[0].item() - toy().head.bias[0].item()


def test_broadcast_params_copies_the_first_dp_rank(ranks):
    assert ranks(4).run(_broadcast_case, timeout=60) == pytest.approx([0.0, 1.0, 0.0, 1.0])


@pytest.fixture(scope="module")
def ddp_results(ranks):
    return ranks(4).run(_ddp_cases, timeout=120)


def test_ddp_grads_equal_the_average_over_all_ranks_data(ddp_results):
    problems = [p for per_rank in ddp_results for probs, _, _ in per_rank.values() for p in probs]
    assert not problems, "\n".join(problems[:20])


def test_overlap_is_bit_identical_to_no_overlap(ddp_results):
    for per_rank in ddp_results:
        for (driver, overlap, per_token), (_, flat, _) in per_rank.items():
            if overlap and driver != "interleaved":
                assert torch.equal(flat, per_rank[(driver, False, per_token)][1]), (driver, per_token)


def test_overlapped_buckets_launch_during_backward(ddp_results):
    grad = "embedding grad"
    for per_rank in ddp_results:
        # No launch during the no_sync microbatches; in the last one, buckets launch in reverse layer
        # order as they complete, before the embedding's gradient (the last of backward) is computed.
        for driver in ("manual", "schedule"):
            assert per_rank[(driver, True, False)][2] == [grad] * 3 + [
                "launch 0",
                "launch 1",
                grad,
                "launch 2",
            ]
        # Without overlap: one bucket, reduced in finish_grad_sync.
        assert per_rank[("manual", False, False)][2] == [grad] * 4 + ["launch 0"]
        # With grad_sync_func too (issue 11): the last backward still launches the buckets as they
        # complete; grad_sync_func after it only catches what did not launch.
        assert per_rank[("schedule+grad_sync_func", True, False)][2] == [grad] * 3 + [
            "launch 0",
            "launch 1",
            grad,
            "launch 2",
        ]


# --------------------------------------------------------------------------------------------------
# finalize_model_grads on main_grad: TP=2 x PP=2 on 4 ranks
# --------------------------------------------------------------------------------------------------


class _Stage(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word = nn.Parameter(torch.zeros(3, 2))
        self.word.shared_embedding = True
        self.norm = nn.Parameter(torch.zeros(2))
        self.norm.sequence_parallel = True
        self.plain = nn.Parameter(torch.zeros(2))


def _finalize_on_main_grad(rank, world_size):
    from core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, hidden_size=2)
    stage = _Stage(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), stage)
    for p in stage.parameters():
        p.main_grad.fill_(rank + 1.0)
    finalize_model_grads([ddp])
    return {n: p.main_grad.reshape(-1)[0].item() for n, p in stage.named_parameters()}


def test_finalize_reduces_tied_and_sequence_parallel_main_grads(ranks):
    got = ranks(4).run(_finalize_on_main_grad, timeout=60)
    # Pipelines [0, 2] and [1, 3] (first and last stage: the embedding group); TP groups [0, 1] and [2, 3].
    assert [g["word"] for g in got] == [4.0, 6.0, 4.0, 6.0]
    assert [g["norm"] for g in got] == [3.0, 3.0, 7.0, 7.0]
    assert [g["plain"] for g in got] == [1.0, 2.0, 3.0, 4.0]

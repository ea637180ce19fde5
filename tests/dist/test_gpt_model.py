"""GPTModel under TP / SP / PP / VPP / DP on real gloo ranks, against the single-device model.

Each split runs one training step through ``get_forward_backward_func()`` with
``finalize_model_grads``; ranks gather their TP shards with ``gather_full`` and hand full
parameters and gradients back, and this (non-distributed) process builds the same GPTModel at
TP=PP=1 from the same seed and computes the loss over every data-parallel rank's microbatches.
One name means one weight in every split, so the comparison is per parameter, by name.
"""

from __future__ import annotations

import pytest
import torch

from core.distributed import finalize_model_grads
from models.gpt import GPTModel, gpt_provider, parallelize_gpt, pipeline_layout
from tests.support.configs import full_recompute
from tests.support.gpt_model import (
    MBS,
    MICROBATCHES,
    SEQ,
    VOCAB,
    WORD_EMBEDDINGS,
    make_batches,
    make_config,
    rel,
)
from tests.support.pipeline_toy import reference_loss_and_grads, run_schedule

TOL = 1e-5


# --------------------------------------------------------------------------------------------------
# Rank functions
# --------------------------------------------------------------------------------------------------


def _setup(kind: str, tp: int, pp: int, vpp: int | None, *, ddp: bool = False, **overrides):
    """``ddp``: the chunks wrapped in DistributedDataParallel (``main_grad`` buffers; ``param.grad`` is
    ``main_grad`` in fp32), as training wraps them; else plain modules reduced by finalize_model_grads."""
    from core import parallel_state as ps
    from core.distributed import DistributedDataParallelConfig
    from core.tensor_parallel import model_parallel_seed

    ps.initialize_model_parallel(tp, pp, vpp)
    model_parallel_seed(1234)
    config = make_config(
        kind,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # with DDP the wrapped chunks' hooks (finalize_model_grads among them) go on the config below
        finalize_model_grads_func=None if ddp else finalize_model_grads,
        **overrides,
    )
    ddp_config = DistributedDataParallelConfig() if ddp else None
    model = parallelize_gpt(
        gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config), ddp_config=ddp_config
    )
    if ddp:  # Megatron's way, still accepted: the hooks on the config the schedule reads
        config.schedule_hooks = model.schedule_hooks()
    return ps, config, model.chunks


def _train_step(ps, chunks, batches, seq_length=SEQ, hooks=None):
    """The schedule over ``batches``; ``hooks``: the model's ``schedule_hooks``, handed in at the call
    (None: whatever the chunks' config carries)."""
    from core.pipeline_parallel.schedules import get_forward_backward_func

    return run_schedule(
        get_forward_backward_func(),
        chunks if len(chunks) > 1 else chunks[0],
        batches,
        seq_length=seq_length,
        micro_batch_size=MBS,
        per_token=chunks[0].config.calculate_per_token_loss,
        schedule_hooks=hooks,
    )


def _full(chunks, what: str) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of this rank's chunks, TP shards gathered into full tensors."""
    from core.tensor_parallel import gather_full

    out = {}
    for chunk in chunks:
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            if what == "grad" and p.grad is None:
                out[name] = None
                continue
            out[name] = gather_full(p, tensor=p.grad if what == "grad" else p)
    return out


def _parity_rank(rank, world_size, kind, tp, pp, vpp, sp, per_token, schedule="1f1b", extra=None):
    """LLaMA runs the fast paths against the plain single-device reference: the fused loss and
    gradients accumulated into ``main_grad`` by the linear layers (DDP-wrapped chunks), with the
    output layer inside the loss under ZB-H1 (GPT too, under sequence parallelism); under ZB-H1
    also compiled layers (tests/e2e/test_compile.py), on data-parallel replica 0 only (8 ranks compiling
    on a 2-core CI machine cost 25 s; the other replica runs eagerly, so the averaged gradients and
    the compiled replica's losses must both equal the reference's)."""
    fast = kind == "llama"
    compiled = fast and schedule == "zb-h1" and rank // tp % (8 // (tp * pp)) == 0  # DP rank 0
    # The output layer fused into the loss (--cross-entropy-fusion-impl linear): GPT's tied weight
    # under TP2+SP (and ZBV's one Parameter), LLaMA's own weight into main_grad under ZB-H1's I/W split.
    linear_loss = (kind == "gpt" and sp) or schedule == "zb-h1"
    ps, _, chunks = _setup(
        kind,
        tp,
        pp,
        vpp,
        ddp=fast,
        sequence_parallel=sp,
        calculate_per_token_loss=per_token,
        pipeline_schedule=schedule,
        cross_entropy_loss_fusion=fast or linear_loss,
        cross_entropy_fusion_impl="linear" if linear_loss else "native",
        gradient_accumulation_fusion=fast,
        compile=compiled,
        compile_backend="aot_eager",
        **(extra or {}),
    )
    assert not compiled or ps.get_data_parallel_rank() == 0
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_batches(dp * MICROBATCHES)[dp_rank * MICROBATCHES : (dp_rank + 1) * MICROBATCHES]
    logs = _train_step(ps, chunks, batches)
    grads, params = _full(chunks, "grad"), _full(chunks, "param")
    first = ps.get_tensor_model_parallel_rank() == 0
    return {
        "grads": grads if first and dp_rank == 0 else None,
        "params": params if first and dp_rank == 0 else None,
        "logs": [{k: v.clone() for k, v in d.items()} for d in logs] if first else [],
    }


def _tied_rank(rank, world_size, steps):
    ps, _, chunks = _setup("gpt", 2, 4, None, calculate_per_token_loss=True)
    (model,) = chunks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches(4 * steps, seed=11)
    copies = []
    for step in range(steps):
        optimizer.zero_grad()
        _train_step(ps, chunks, batches[4 * step : 4 * step + 4])
        optimizer.step()
        tied = model.shared_embedding_or_output_weight()
        copies.append(None if tied is None else _full_one(tied))
    first = ps.get_tensor_model_parallel_rank() == 0
    params = _full(chunks, "param")  # a TP collective: every rank gathers
    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "copies": copies if first else None,
        "params": params if first else None,
        "shared": sorted(n for n, p in model.named_parameters() if getattr(p, "shared_embedding", False)),
    }


RECOMPUTE = {
    "none": {},
    "full-uniform": full_recompute("uniform", 2),
    "full-block": full_recompute("block", 1),
    "selective": {"recompute_granularity": "selective"},
    "dropout-off": {"hidden_dropout": 0.0, "attention_dropout": 0.0},
}


def _recompute_rank(rank, world_size, kind):
    """TP=2 (sequence parallel) x PP=2 x DP=2 with dropout: every recompute variant against none."""
    from core.tensor_parallel import model_parallel_seed

    outcome = {}
    for name, variant in RECOMPUTE.items():
        options = {"hidden_dropout": 0.1, "attention_dropout": 0.1, **variant}
        ps, _, chunks = _setup(
            kind, 2, 2, None, sequence_parallel=True, calculate_per_token_loss=True, **options
        )
        model_parallel_seed(4321 + ps.get_data_parallel_rank())  # same streams in every variant
        batches = make_batches(MICROBATCHES * 2)[ps.get_data_parallel_rank() :: 2]
        logs = _train_step(ps, chunks, batches)
        outcome[name] = ([d["lm loss"] for d in logs], {n: p.grad for n, p in chunks[0].named_parameters()})
        ps.destroy_model_parallel()
    base_logs, base_grads = outcome.pop("none")
    off_logs, _ = outcome.pop("dropout-off")
    diffs = {
        name: max(rel(grads[n], g) for n, g in base_grads.items()) for name, (_, grads) in outcome.items()
    }
    same_loss = all(all(torch.equal(a, b) for a, b in zip(logs, base_logs)) for logs, _ in outcome.values())
    dropout_mattered = any(not torch.equal(a, b) for a, b in zip(off_logs, base_logs)) or not base_logs
    return diffs, same_loss, dropout_mattered


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_recompute_replays_dropout_under_tp_and_pp(ranks, kind):
    results = ranks(8).run(_recompute_rank, kind, timeout=120)
    for diffs, same_loss, dropout_mattered in results:
        assert same_loss and dropout_mattered
        assert max(diffs.values()) == 0.0, diffs


def _full_one(param):
    from core.tensor_parallel import gather_full

    return gather_full(param)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------

SPLITS = {  # name: (tp, pp, vpp, sequence_parallel[, schedule]) on 8 ranks; DP takes the rest
    "tp2": (2, 1, None, False),
    "tp2_sp": (2, 1, None, True),
    "pp2_vpp2": (1, 2, 2, False),
    "tp2_pp2_dp2": (2, 2, None, False),
    # Zero bubble: the B/W split through TP/SP layers; ZBV's V puts the tied embedding and output
    # layer on one rank as one Parameter.
    "tp2_sp_pp2_zb-h1": (2, 2, None, True, "zb-h1"),
    "tp2_sp_pp2_zbv": (2, 2, 2, True, "zbv"),
}


# The zero-bubble splits run once per schedule in CI (ZB-H1 on LLaMA, ZBV on GPT); the other pairs are slow.
SLOW = {("gpt", "tp2_sp_pp2_zb-h1"), ("llama", "tp2_sp_pp2_zbv")}


@pytest.mark.parametrize(
    "kind,split",
    [
        pytest.param(kind, split, marks=[pytest.mark.slow] if (kind, split) in SLOW else [])
        for split in SPLITS
        for kind in ("gpt", "llama")
    ],
)
def test_split_matches_single_device_model(ranks, kind, split):
    tp, pp, vpp, sp, *schedule = SPLITS[split]
    per_token = not (kind == "gpt" and split in ("tp2", "pp2_vpp2", "tp2_sp_pp2_zbv"))  # 2-tuple path too
    _check_split(ranks, kind, split, tp, pp, vpp, sp, per_token, schedule[0] if schedule else "1f1b")


# FP8 products (issue 28): tensorwise scaling casts every microbatch with the whole tensor's scale (amaxes
# reduced over TP), so every split casts what one device casts, and the fast paths (main_grad
# accumulation, the I/W split, compiled layers and casts on DP replica 0) change nothing. The FFN is
# widened so that every linear layer's features per TP rank are multiples of 16.
FP8 = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "ffn_hidden_size": 64}


@pytest.mark.parametrize(
    "split", [pytest.param("tp2_sp_pp2_zb-h1"), pytest.param("pp2_vpp2", marks=pytest.mark.slow)]
)
def test_an_fp8_split_matches_the_single_device_fp8_model(ranks, split):
    tp, pp, vpp, sp, *schedule = SPLITS[split]
    _check_split(ranks, "llama", split, tp, pp, vpp, sp, True, schedule[0] if schedule else "1f1b", FP8)


def _check_split(ranks, kind, split, tp, pp, vpp, sp, per_token, schedule, extra=None, tol=TOL):
    results = ranks(8).run(_parity_rank, kind, tp, pp, vpp, sp, per_token, schedule, extra, timeout=120)
    dp = 8 // (tp * pp)

    reference = GPTModel(make_config(kind, **(extra or {})), VOCAB, SEQ)
    if extra:
        for layer in reference.decoder.layers.values():  # a layer left out of FP8 would test nothing
            assert layer.fp8_kept_out == {}
    ref_loss, ref_grads = reference_loss_and_grads(reference, make_batches(dp * MICROBATCHES), per_token)
    ref_params = dict(reference.named_parameters())
    grads = {n: g for r in results if r["grads"] for n, g in r["grads"].items()}
    params = {n: p for r in results if r["params"] for n, p in r["params"].items()}
    assert set(ref_grads) <= set(grads), f"missing parameters: {set(ref_grads) - set(grads)}"
    worst = 0.0
    for name, grad in grads.items():
        twin = WORD_EMBEDDINGS if name == "output_layer.weight" and name not in ref_grads else name
        assert grad is not None and grad.abs().sum() > 0, f"{name} received no gradient"
        assert torch.equal(params[name], ref_params[twin].detach()), f"{name} initialised differently"
        worst = max(worst, rel(grad, ref_grads[twin]))
        assert rel(grad, ref_grads[twin]) <= tol, (
            f"{name}: relative gradient difference {rel(grad, ref_grads[twin])}"
        )

    logs = [d["lm loss"] for r in results for d in r["logs"]]
    assert len(logs) == dp * MICROBATCHES
    loss = torch.stack(logs).sum(0) if per_token else torch.stack(logs).mean()
    loss = loss[0] / loss[1] if per_token else loss
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    print(
        f"{kind} {split}: max relative grad difference {worst:.2e}, loss difference "
        f"{abs(loss - ref_loss).item() / ref_loss.item():.2e}"
    )


def test_tied_embeddings_stay_identical_across_four_stages(ranks):
    steps = 3
    results = ranks(8).run(_tied_rank, steps, timeout=120)
    by_stage = {r["pp_rank"]: r for r in results if r["copies"] is not None}
    first, last = by_stage[0], by_stage[3]
    assert results[0]["shared"] == [WORD_EMBEDDINGS] and by_stage[3]["shared"] == ["output_layer.weight"]
    for step, (a, b) in enumerate(zip(first["copies"], last["copies"])):
        assert torch.equal(a, b), f"tied copies differ after step {step + 1}"

    reference = GPTModel(make_config("gpt", calculate_per_token_loss=True), VOCAB, SEQ)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = make_batches(4 * steps, seed=11)
    for step in range(steps):
        reference_loss_and_grads(reference, batches[4 * step : 4 * step + 4], per_token=True)
        optimizer.step()
    ref = dict(reference.named_parameters())
    assert rel(last["copies"][-1], ref[WORD_EMBEDDINGS].detach()) <= TOL
    assert rel(ref[WORD_EMBEDDINGS].detach(), make_start_embedding()) > 1e-3  # the steps really moved it
    params = {n: p for r in by_stage.values() for n, p in r["params"].items()}
    worst = 0.0
    for name, value in params.items():
        twin = WORD_EMBEDDINGS if name == "output_layer.weight" else name
        worst = max(worst, rel(value, ref[twin].detach()))
        assert rel(value, ref[twin].detach()) <= TOL, name
    print(f"tied pp4 x tp2: max relative weight difference after {steps} SGD steps {worst:.2e}")


def make_start_embedding() -> torch.Tensor:
    return GPTModel(make_config("gpt"), VOCAB, SEQ).embedding.word_embeddings.weight.detach()


def _explicit_groups_rank(rank, world_size, kind):
    """The same TP2+SP model twice: built and run with parallel_state's groups, then with the groups
    handed in as ``pg_collection`` while parallel_state holds none (any layer that still read the
    globals would raise "model parallel groups are not initialized")."""
    from core import parallel_state as ps
    from core.tensor_parallel import model_parallel_seed

    ps.initialize_model_parallel(2, 1)
    model_parallel_seed(1234)
    config = make_config(kind, tensor_model_parallel_size=2, sequence_parallel=True, ffn_hidden_size=64)
    tokens, labels, _ = make_batches(1)[0]

    def loss_and_grads(model):
        loss = model(tokens, labels=labels).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    expected = loss_and_grads(GPTModel(config, VOCAB, SEQ))
    groups, hidden = ps.get_parallel_groups(), ps._GROUPS
    ps._GROUPS = None  # this test's own module state: no process group is touched
    try:
        got = loss_and_grads(GPTModel(config, VOCAB, SEQ, pg_collection=groups))
    finally:
        ps._GROUPS = hidden
    return torch.equal(got[0], expected[0]) and all(torch.equal(got[1][n], g) for n, g in expected[1].items())


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_model_handed_its_groups_reads_no_global_group(ranks, kind):
    assert ranks(8).run(_explicit_groups_rank, kind, timeout=120) == [True] * 8

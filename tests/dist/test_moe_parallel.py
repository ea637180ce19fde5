"""An MoE layer split over expert (and tensor) parallel gloo ranks equals one device computing it.

Each rank routes its own tokens (a sequence shard under sequence parallelism); the reference is an
unsplit layer with the same weights (the same names give the same initialisation) run on each
sequence in one process. Checked per rank: the output of its tokens, the router's gradient (with
the load-balancing and z-losses of its own sequence, summed over tensor parallelism), and each of
its experts' gradient, which gathers the contributions of every token of the expert-parallel group.
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.pipeline_parallel.auxiliary_loss import auxiliary_loss_scale_hook
from core.transformer.initialization import initialize_by_name, unstacked
from core.transformer.moe.groups import MoEGroups
from core.transformer.moe.moe_layer import MoELayer
from tests.support.configs import full_recompute
from tests.support.moe_reference import moe_config
from tests.support.sgd_model import parallelize_with_sgd

WORLD, SEQ, BATCH, HIDDEN = 4, 8, 2, 16
TIMEOUT = 120
COMMON = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 1e-3, "num_moe_experts": 8}

CASES = {
    "ep2-dp2-alltoall-looped": (1, 2, {"moe_token_dispatcher_type": "alltoall"}),
    "ep2-dp2-allgather-grouped": (1, 2, {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": True}),
    "ep4-alltoall-grouped": (1, 4, {"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True}),
    "ep4-allgather-looped": (1, 4, {"moe_token_dispatcher_type": "allgather"}),
    "tp2-sp-ep2-alltoall-shared-gate": (
        2,
        2,
        {
            "moe_token_dispatcher_type": "alltoall",
            "moe_shared_expert_intermediate_size": 8,
            "moe_shared_expert_gate": True,
        },
    ),
    "tp2-sp-ep2-allgather-seq-aux": (
        2,
        2,
        {"moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "seq_aux_loss"},
    ),
    "ep2-alltoall-capacity-padded": (
        1,
        2,
        {
            "moe_token_dispatcher_type": "alltoall",
            "moe_expert_capacity_factor": 1.0,
            "moe_pad_expert_input_to_capacity": True,
        },
    ),
}
SLOW = {
    "ep2-dp2-alltoall-looped",
    "ep2-dp2-allgather-grouped",
    "ep4-allgather-looped",
    "tp2-sp-ep2-allgather-seq-aux",
    "ep2-alltoall-capacity-padded",
}


def _sequence(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and the upstream gradient of the tensor-parallel group ``group``'s sequence."""
    generator = torch.Generator().manual_seed(100 + group)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator), torch.randn(
        SEQ, BATCH, HIDDEN, generator=generator
    )


def _reference(config, groups: int) -> list[dict[str, torch.Tensor]]:
    """Per tensor-parallel group: output, and every parameter's gradient, on one device."""
    layer = MoELayer(config, layer_number=0, groups=MoEGroups())
    initialize_by_name(layer, config)
    results = []
    for group in range(groups):
        layer.zero_grad()
        hidden, upstream = _sequence(group)
        out = layer(hidden)
        out.backward(upstream)
        grads = {n: g.clone() for name, p in layer.named_parameters() for n, g in unstacked(name, p, p.grad)}
        results.append({"out": out.detach()} | grads)
    return results


def _run(rank, world_size, tp, ep, overrides):
    ps.initialize_model_parallel()
    reference = _reference(moe_config(**COMMON, **overrides), world_size // tp)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    config = moe_config(
        **COMMON,
        **overrides,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=ep,
    )
    layer = MoELayer(config, layer_number=0)
    initialize_by_name(layer, config)
    group, tp_rank = rank // tp, rank % tp
    hidden, upstream = (t.chunk(tp)[tp_rank].contiguous() for t in _sequence(group))
    out = layer(hidden)
    out.backward(upstream)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=ps.get_tensor_model_parallel_group())
    ep_groups = {r // tp for r in ps.get_parallel_groups().ranks["ep"]}
    errors = {
        "out": _relative(out, reference[group]["out"].chunk(tp)[tp_rank]),
        "router": 0.0,
        "experts": 0.0,
    }
    errors["router"] = _relative(router_grad, reference[group]["router.weight"])
    for stacked, param in layer.experts.named_parameters(prefix="experts"):
        for name, grad in unstacked(stacked, param, param.grad):  # each expert under its global name
            expected = sum(reference[g][name] for g in ep_groups)
            errors["experts"] = max(errors["experts"], _relative(grad, expected))
    return errors, layer.local_expert_indices


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b).norm() / b.norm())


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_expert_parallel_layer_equals_one_device(ranks, case):
    tp, ep, overrides = CASES[case]
    results = ranks(WORLD).run(_run, tp, ep, overrides, timeout=TIMEOUT)
    for rank, (errors, local) in enumerate(results):
        assert max(errors.values()) <= 1e-5, (rank, errors)
        ep_rank = rank % ep  # megatron-core's expert grid: rank = ep_rank + EP * (edp_rank + EDP * pp_rank)
        assert local == list(range(ep_rank * 8 // ep, (ep_rank + 1) * 8 // ep))


# --------------------------------------------------------------------------------------------------
# The whole model: a training step split over TP / PP / DP / EP against one device
# --------------------------------------------------------------------------------------------------

VOCAB, MICROBATCHES = 60, 2
PATTERN = [1, 1, 0, 1]  # layer 2 is dense: a pipeline stage may hold a dense layer among MoE ones


def model_config(aux: bool, **overrides):
    """A tiny Mixtral: LLaMA with 4 experts of 16 (top-2) on layers 0, 1 and 3; dropout off."""
    from models.gpt import llama_config

    values = {
        "num_layers": 4,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_query_groups": 2,
        "ffn_hidden_size": 24,
        "num_moe_experts": 4,
        "moe_ffn_hidden_size": 16,
        "moe_router_topk": 2,
        "moe_layer_freq": PATTERN,
        "moe_aux_loss_coeff": 0.01 if aux else 0.0,
        "moe_z_loss_coeff": 1e-3 if aux else None,
        "make_vocab_size_divisible_by": 16,
        "init_method_std": 0.1,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "seed": 7,
    }
    return llama_config(**(values | overrides))


def _owned_grads(chunks, what: str = "grad") -> dict[str, torch.Tensor]:
    """This rank's share of the full gradients (or parameters) by name: dense ones from the first
    TP and DP rank, experts from the first of their expert-data-parallel replicas."""
    from core.tensor_parallel import gather_full

    first_dense = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    first_expert = ps.get_expert_data_parallel_rank() == 0
    out = {}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            source = (
                p.main_grad if what == "grad" and hasattr(p, "main_grad") else p.grad if what == "grad" else p
            )
            full = gather_full(p, tensor=source)  # a TP collective for TP-split weights
            for logical, piece in unstacked(name, p, full):  # an expert's under its global name
                if first_expert if ".local_experts." in logical else first_dense:
                    out[logical] = piece
    return out


def _split_step(tp, pp, ep, aux, schedule, overrides):
    from core.distributed import finalize_model_grads
    from core.tensor_parallel import model_parallel_seed
    from core.transformer.context_parallel import get_batch_on_this_cp_rank
    from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
    from tests.dist.test_context_parallel import _forward_step
    from tests.support.gpt_model import make_batches
    from tests.support.pipeline_toy import make_forward_step

    vpp = overrides.get("virtual_pipeline_model_parallel_size")
    cp = overrides.get("context_parallel_size", 1)
    ps.initialize_model_parallel(tp, pp, vpp, cp, expert_model_parallel_size=ep)
    model_parallel_seed(1234)
    config = model_config(
        aux,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
        pipeline_schedule=schedule,
        finalize_model_grads_func=finalize_model_grads,
        **overrides,
    )
    chunks = parallelize_gpt(gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config)).modules
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_batches(dp * MICROBATCHES)[dp_rank * MICROBATCHES : (dp_rank + 1) * MICROBATCHES]
    if cp > 1:  # this rank's two sequence chunks; the loss is each sequence's mean over all CP ranks
        cut = [
            get_batch_on_this_cp_rank({"tokens": t, "labels": lab, "loss_mask": m}) for t, lab, m in batches
        ]
        batches = [(c["tokens"], c["labels"], c["loss_mask"]) for c in cut]
    logs = _schedule(chunks, batches, _forward_step("mean") if cp > 1 else make_forward_step(False))
    first_logger = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    losses = [float(d["lm loss"]) for d in logs] if first_logger else []
    grads, params = _owned_grads(chunks), _owned_grads(chunks, "param")
    ps.destroy_model_parallel()
    return {"grads": grads, "params": params, "losses": losses}


def _schedule(chunks, batches, forward_step):
    """One forward/backward over ``batches`` with the configured schedule."""
    from core.pipeline_parallel.schedules import get_forward_backward_func

    iterators = [iter(batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=batches[0][0].shape[0],
    )


def _model_rank(rank, world_size, tp, pp, ep, schedule, overrides, with_ep1):
    """The split with the auxiliary losses off, and with them on at EP = ep (and at EP = 1)."""
    out = {
        "off": _split_step(tp, pp, ep, False, schedule, overrides),
        "on": _split_step(tp, pp, ep, True, schedule, overrides),
    }
    if with_ep1:
        out["on_ep1"] = _split_step(tp, pp, 1, True, schedule, overrides)
    return out


def reference_step(config, batches) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One device: every microbatch on its own (a router balances each microbatch's tokens), the mean
    of their mean token losses, the auxiliary losses weighted 1 / microbatches."""
    from models.gpt import GPTModel

    model = GPTModel(config, VOCAB, SEQ)
    auxiliary_loss_scale_hook([model])(1.0 / len(batches))
    losses = [(model(t, labels=lab) * m).sum() / m.sum() for t, lab, m in batches]
    torch.stack(losses).mean().backward()
    named = list(model.named_parameters())  # experts under their global names, as _owned_grads gives them
    grads = {n: g.clone() for name, p in named for n, g in unstacked(name, p, p.grad)}
    params = {n: t.detach() for name, p in named for n, t in unstacked(name, p)}
    return [float(x.detach()) for x in losses], grads, params


def _union(results, run: str, key: str | None) -> dict[str, torch.Tensor]:
    """Every rank's share of one result, by parameter name."""
    return {n: g for r in results for n, g in (r[run] if key is None else r[run][key]).items()}


def _split(schedule: str = "1f1b", *, tp: int = 1, pp: int = 1, ep: int = 2, **overrides) -> tuple:
    """One case of MODEL_SPLITS: EP 2 under 1F1B unless it says otherwise; ``overrides`` go to the config."""
    return tp, pp, ep, schedule, overrides


MODEL_SPLITS = {  # name: (tp, pp, ep, schedule, overrides) on 4 ranks; DP takes the rest
    "ep2-dp4-alltoall-looped": _split(moe_token_dispatcher_type="alltoall"),
    "ep4-allgather-grouped": _split(ep=4, moe_token_dispatcher_type="allgather", moe_grouped_gemm=True),
    "tp2-sp-ep2-alltoall-grouped": _split(tp=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True),
    "tp2-sp-ep2-allgather-looped": _split(tp=2, moe_token_dispatcher_type="allgather"),
    "pp2-ep2-1f1b-alltoall": _split(pp=2, moe_token_dispatcher_type="alltoall"),
    "pp2-ep2-zb-h1-alltoall-grouped": _split(
        "zb-h1", pp=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True
    ),
    "pp2-ep2-zb-h1-allgather-recompute": _split(
        "zb-h1", pp=2, moe_token_dispatcher_type="allgather", **full_recompute("uniform", 1)
    ),
    "pp2-vpp2-layout-ep2-interleaved": _split(
        pp=2, virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|t|tL"
    ),
    "pp2-ep2-zbv-allgather": _split(
        "zbv", pp=2, virtual_pipeline_model_parallel_size=2, moe_token_dispatcher_type="allgather"
    ),
    "pp2-ep2-gpipe-allgather-grouped": _split(
        "gpipe", pp=2, moe_token_dispatcher_type="allgather", moe_grouped_gemm=True
    ),
    "pp2-vpp2-ep2-zb-h1-interleaved": _split(
        "zb-h1", pp=2, virtual_pipeline_model_parallel_size=2, moe_token_dispatcher_type="alltoall"
    ),
    "cp2-ep2-alltoall": _split(context_parallel_size=2, moe_token_dispatcher_type="alltoall"),
    "cp2-ep2-allgather-a2a": _split(
        context_parallel_size=2, cp_comm_type="a2a", moe_token_dispatcher_type="allgather"
    ),
}
MODEL_SLOW = {  # CI keeps PP2 x EP2 under zb-h1 (TP x SP and the router's TP x CP group: the layer cases)
    "tp2-sp-ep2-alltoall-grouped",
    "cp2-ep2-alltoall",
    "ep2-dp4-alltoall-looped",
    "pp2-vpp2-layout-ep2-interleaved",
    "pp2-ep2-zbv-allgather",
    "ep4-allgather-grouped",
    "tp2-sp-ep2-allgather-looped",
    "pp2-ep2-1f1b-alltoall",
    "pp2-ep2-zb-h1-allgather-recompute",
    "pp2-ep2-gpipe-allgather-grouped",
    "pp2-vpp2-ep2-zb-h1-interleaved",
    "cp2-ep2-allgather-a2a",
}


@pytest.mark.parametrize(
    "split", [pytest.param(s, marks=pytest.mark.slow) if s in MODEL_SLOW else s for s in MODEL_SPLITS]
)
def test_expert_parallel_model_step_equals_one_device_and_ep1(ranks, split):
    from tests.support.gpt_model import make_batches

    tp, pp, ep, schedule, overrides = MODEL_SPLITS[split]
    with_ep1 = split in MODEL_SLOW  # CI: the one-device reference of "EP = 1 at the same DP" only
    results = ranks(WORLD).run(_model_rank, tp, pp, ep, schedule, overrides, with_ep1, timeout=TIMEOUT)
    batches = make_batches(WORLD // (tp * pp * overrides.get("context_parallel_size", 1)) * MICROBATCHES)
    pipeline = (
        "virtual_pipeline_model_parallel_size",
        "pipeline_model_parallel_layout",
        "context_parallel_size",
        "cp_comm_type",
    )
    overrides = {k: v for k, v in overrides.items() if k not in pipeline}  # one device: one stage
    ref_losses, ref_grads, ref_params = reference_step(model_config(False, **overrides), batches)
    grads, params = _union(results, "off", "grads"), _union(results, "off", "params")
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():  # aux losses off: the split is one device on the same batch
        assert torch.equal(params[name], ref_params[name]), f"{name} initialised differently"
        assert grad.abs().sum() > 0 and _relative(grad, ref_grads[name]) <= 1e-5, name
    logged = sorted(x for r in results for x in r["off"]["losses"])
    assert (
        len(logged) == len(ref_losses) and max(abs(a - b) for a, b in zip(logged, sorted(ref_losses))) <= 1e-5
    )
    on = _union(results, "on", "grads")
    on_ep1 = _union(results, "on_ep1", "grads") if with_ep1 else on
    _, aux_grads, _ = reference_step(model_config(True, **overrides), batches)
    for name, grad in on.items():  # aux losses on: each rank balances its own tokens, as at EP = 1
        assert _relative(grad, on_ep1[name]) <= 1e-5 and _relative(grad, aux_grads[name]) <= 1e-5, name
    router = "decoder.layers.0.mlp.router.weight"
    assert _relative(aux_grads[router], ref_grads[router]) > 1e-3  # the losses did reach the router


# --------------------------------------------------------------------------------------------------
# Data-parallel buckets, the distributed optimizer and clipping with experts
# --------------------------------------------------------------------------------------------------

CLIP, LR = 0.01, 1e4  # the step is clipped; a large rate keeps the update far above fp32's rounding


def _optimizer_rank(rank, world_size, dispatcher):
    """EP 2 x expert-DP 2 (dense DP 4): bucketed, overlapped reduction, distributed optimizer, one
    clipped SGD step; returns the grad norm and each owned parameter's update."""
    from core.distributed import DistributedDataParallelConfig
    from core.tensor_parallel import model_parallel_seed
    from tests.dist.test_gpt_model import _train_step
    from tests.support.gpt_model import make_batches

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_seed(1234)
    config = model_config(True, expert_model_parallel_size=2, moe_token_dispatcher_type=dispatcher)
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000
    )
    model = parallelize_with_sgd(config, VOCAB, SEQ, lr=LR, ddp_config=ddp, clip_grad=CLIP)
    before = _owned_grads(model.chunks, "param")
    batches = make_batches(world_size * MICROBATCHES)[rank * MICROBATCHES : (rank + 1) * MICROBATCHES]
    _train_step(ps, model.chunks, batches, hooks=model.hooks)
    applied, grad_norm, _ = model.optimizer.step()
    after = _owned_grads(model.chunks, "param")
    expert_buckets = [
        b for c in model.chunks for b in c.buckets if getattr(b.params[0], "allreduce", True) is False
    ]
    return {
        "applied": applied,
        "norm": grad_norm,
        "updates": {n: after[n] - before[n] for n in after},
        "expert_bucket_group": sorted(dist.get_process_group_ranks(expert_buckets[0].group)),
    }


@pytest.mark.parametrize("dispatcher", ["alltoall", pytest.param("allgather", marks=pytest.mark.slow)])
def test_distributed_optimizer_shards_experts_over_expert_data_parallel_and_clips_each_once(
    ranks, dispatcher
):
    from tests.support.gpt_model import make_batches

    results = ranks(WORLD).run(_optimizer_rank, dispatcher, timeout=TIMEOUT)
    _, grads, _ = reference_step(model_config(True), make_batches(WORLD * MICROBATCHES))
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    for rank, result in enumerate(results):
        assert result["applied"] and abs(result["norm"] - norm) <= 1e-5 * norm, (result["norm"], norm)
        assert result["expert_bucket_group"] == [rank % 2, rank % 2 + 2]  # expert-DP: [0, 2] and [1, 3]
    updates = {n: u for r in results for n, u in r["updates"].items()}
    assert set(updates) == set(grads)
    for name, update in updates.items():  # plain SGD: the update is the clipped gradient times the rate
        assert _relative(-update, grads[name] * LR * CLIP / (norm + 1e-6)) <= 1e-5, name


# --------------------------------------------------------------------------------------------------
# Checkpoints: experts by global index, loaded at another expert-parallel size
# --------------------------------------------------------------------------------------------------


def _step_and_snapshot(ep: int, batches, load: str | None = None, save: str | None = None):
    """Build the tiny Mixtral at EP ``ep`` (dense DP 4) with SGD + momentum; optionally load ``load``;
    take one step on ``batches``; optionally save; return the owned parameters before and after."""
    from core.distributed import DistributedDataParallelConfig
    from core.tensor_parallel import model_parallel_seed
    from tests.dist.test_gpt_model import _train_step
    from training.checkpoint.load import load_checkpoint, save_checkpoint

    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_seed(1234)
    config = model_config(True, expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall")
    model = parallelize_with_sgd(
        config,
        VOCAB,
        SEQ,
        lr=1.0,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        sgd_momentum=0.9,
    )
    if load is not None:
        load_checkpoint(load, model_chunks=model.chunks, optimizer=model.optimizer, load_rng=False)
    before = _owned_grads(model.chunks, "param")
    model.optimizer.zero_grad()
    _train_step(ps, model.chunks, batches, hooks=model.hooks)
    model.optimizer.step()
    if save is not None:
        save_checkpoint(save, 1, model_chunks=model.chunks, optimizer=model.optimizer)
    after = _owned_grads(model.chunks, "param")
    ps.destroy_model_parallel()
    return before, after


def _checkpoint_rank(rank, world_size, path):
    from tests.support.gpt_model import make_batches

    batches = make_batches(2 * world_size * MICROBATCHES, seed=5)
    first, second = (
        batches[i * world_size * MICROBATCHES :][rank * MICROBATCHES :][:MICROBATCHES] for i in (0, 1)
    )
    _, saved = _step_and_snapshot(2, first, save=path)  # EP 2: step 1, saved with its momentum
    _, straight = _step_and_snapshot(2, second, load=path)  # EP 2 again: step 2
    out = {"saved": saved, "straight": straight}
    for ep in (1, 4):  # step 2 at other expert-parallel sizes, from the same checkpoint
        out[f"loaded_ep{ep}"], out[f"ep{ep}"] = _step_and_snapshot(ep, second, load=path)
    return out


def test_experts_saved_at_ep2_load_at_ep1_and_ep4_and_take_the_same_next_step(ranks, tmp_path):
    results = ranks(WORLD).run(_checkpoint_rank, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    saved, straight = _union(results, "saved", None), _union(results, "straight", None)
    for ep in (1, 4):
        loaded, stepped = _union(results, f"loaded_ep{ep}", None), _union(results, f"ep{ep}", None)
        assert set(loaded) == set(saved) and all(torch.equal(loaded[n], saved[n]) for n in saved), ep
        for name, value in stepped.items():  # the momentum came back too: the same second update
            assert _relative(value - saved[name], straight[name] - saved[name]) <= 1e-5, (ep, name)


# --------------------------------------------------------------------------------------------------
# The auxiliary losses in the log line, W&B and TensorBoard
# --------------------------------------------------------------------------------------------------


def _logging_rank(rank, world_size, argv):
    os.environ["WANDB_MODE"] = "offline"
    from tests.e2e.test_checkpointing import _pretrain

    return _pretrain(rank, world_size, argv)


@pytest.mark.slow
def test_auxiliary_losses_are_logged_per_layer_and_as_megatrons_mean(ranks, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.reporting.wandb_logging import read_offline_history

    argv = [
        *("--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"),
        *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3"),
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--log-interval", "1"),
        *(
            "--eval-iters",
            "0",
            "--num-experts",
            "4",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--moe-z-loss-coeff",
            "1e-3",
        ),
        *("--moe-layer-freq", "([1]*3+[0])", "--expert-model-parallel-size", "2", "--moe-per-layer-logging"),
        *("--pipeline-model-parallel-size", "2", "--tensorboard-dir", str(tmp_path / "tb")),
        *("--wandb-project", "moe", "--wandb-save-dir", str(tmp_path)),
    ]
    results = ranks(WORLD).run(_logging_rank, argv, timeout=TIMEOUT)
    losses = next(state for state, _ in results if state)
    out = "".join(text for _, text in results)
    assert re.search(r"\| lm loss: \S+ \| load_balancing_loss: \S+ \| z_loss: \S+ \|", out), out[-2000:]
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    rows = [row for row in read_offline_history(run_dir)["history"] if "load_balancing_loss" in row]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert len(rows) == len(losses) == 2
    for row, logged in zip(rows, losses):
        for name in ("load_balancing_loss", "z_loss"):
            per_layer = [row[f"moe/{name}_layer_{i}"] for i in (0, 1, 2)]  # layer 3 is dense: not logged
            assert f"moe/{name}_layer_3" not in row and all(v > 0 for v in per_layer)
            assert row[name] == pytest.approx(sum(per_layer) / 3, rel=1e-6) == logged[name]
            assert [e.value for e in events.Scalars(name)][rows.index(row)] == pytest.approx(
                row[name], rel=1e-6
            )

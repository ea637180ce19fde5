"""MoE without processes: router and losses against a direct reference, experts looped and grouped,
the layer against Hugging Face's Mixtral-style loop, token dropping, config validation.

The multi-rank checks (expert parallelism, both dispatchers) are in test_moe_parallel.py. Slow here:
the --compile check (``python -m pytest -q -m slow tests/unit/test_moe.py``).
"""

from __future__ import annotations

import pytest
import torch

from core.pipeline_parallel.auxiliary_loss import auxiliary_loss_scale_hook
from core.transformer.initialization import initialize_by_name, logical_tensors, name_generator
from core.transformer.moe.experts import Experts
from core.transformer.moe.moe_layer import MoELayer
from core.transformer.moe.moe_utils import drop_tokens_over_capacity, get_capacity, topk_routing
from core.transformer.moe.router import TopKRouter
from tests.support.compiled import assert_compiled_matches_eager, relative_error
from tests.support.configs import full_recompute
from tests.support.moe_reference import (
    expert_weights,
    moe_config,
    reference_aux_loss,
    reference_moe,
    reference_router,
    reference_z_loss,
)

SEQ, BATCH = 6, 3


def _router(**overrides) -> TopKRouter:
    config = moe_config(**overrides)
    router = TopKRouter(config, layer_number=0)
    initialize_by_name(router, config)
    return router


# --------------------------------------------------------------------------------------------------
# Router and losses
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_router_choices_and_weights_match_a_token_by_token_reference(pre_softmax):
    router = _router(moe_router_pre_softmax=pre_softmax, moe_router_load_balancing_type="none")
    hidden = torch.randn(SEQ, BATCH, 16, generator=torch.Generator().manual_seed(0))
    probs, routing_map = router(hidden)
    indices, weights = reference_router(
        hidden.reshape(-1, 16) @ router.weight.t(), 2, pre_softmax=pre_softmax
    )
    expected = torch.zeros_like(probs).scatter(1, indices, weights)
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    if not pre_softmax:
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(SEQ * BATCH))


def test_top_k_ties_are_broken_as_torch_topk_breaks_them():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    for pre_softmax in (False, True):
        _, routing_map = topk_routing(logits, 2, pre_softmax=pre_softmax)
        source = torch.softmax(logits, dim=-1) if pre_softmax else logits
        expected = torch.zeros_like(routing_map).scatter(1, torch.topk(source, 2, dim=1).indices, True)
        assert torch.equal(routing_map, expected)
        assert routing_map.sum(dim=1).tolist() == [2, 2, 2]


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_balancing_and_z_losses_and_their_gradients_match_the_reference(kind):
    coeff, z_coeff = 0.01, 0.001
    router = _router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff)
    hidden = torch.randn(SEQ, BATCH, 16, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(SEQ * BATCH, 4, generator=torch.Generator().manual_seed(2))
    probs, _ = router(hidden)  # no schedule has set its scale: the losses' backward starts from 1
    (probs * upstream).sum().backward()  # the main loss; the attached losses join its backward

    weight = router.weight.detach().clone().requires_grad_(True)
    logits = hidden.reshape(-1, 16) @ weight.t()
    indices, weights = reference_router(logits, 2)
    main = (torch.zeros_like(logits).scatter(1, indices, weights) * upstream).sum()
    if kind == "aux_loss":
        aux = reference_aux_loss(logits, 2, coeff)
    else:  # one loss per sequence (column b of [s, b]), averaged
        per_token = logits.reshape(SEQ, BATCH, 4)
        aux = torch.stack([reference_aux_loss(per_token[:, b], 2, coeff) for b in range(BATCH)]).mean()
    z = reference_z_loss(logits, z_coeff)
    (main + aux + z).backward()
    name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    torch.testing.assert_close(router.metrics[name], (aux / coeff).detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(router.metrics["z_loss"], (z / z_coeff).detach(), rtol=1e-6, atol=0)
    assert relative_error(router.weight.grad, weight.grad) < 1e-6
    assert relative_error(router.weight.grad, weight.grad.clone().zero_() + 1) > 0.5  # the losses moved it


def test_auxiliary_loss_gradient_takes_the_schedule_scale_and_nothing_in_evaluation():
    router = _router(moe_aux_loss_coeff=0.5)
    hidden = torch.randn(SEQ, BATCH, 16, generator=torch.Generator().manual_seed(3))
    set_scale = auxiliary_loss_scale_hook([router])
    grads = []
    for scale in (1.0, 0.25):
        router.weight.grad = None
        set_scale(scale)
        probs, _ = router(hidden)
        (probs * 0).sum().backward()  # only the balancing loss reaches the weight
        grads.append(router.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * 0.25)
    router.eval()
    router.metrics.clear()
    router(hidden)
    assert router.metrics == {}


def test_two_models_in_one_process_keep_their_own_auxiliary_loss_scales():
    """Each model's schedule hooks set only its own routers' scale: a step of one model (its scale set,
    its forward and backward run) between the other's forward and backward changes nothing there."""
    from core.pipeline_parallel.hooks import ScheduleHooks
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from models.gpt import GPTModel
    from tests.support.pipeline_toy import run_schedule

    config = moe_config(num_layers=1, moe_aux_loss_coeff=1.0, init_method_std=0.5)
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(8))
    batches = [(tokens, tokens.roll(1, 1), torch.ones(2, SEQ))] * 2
    first, second = GPTModel(config, 64, SEQ), GPTModel(config, 64, SEQ)  # the same weights (by name)
    routers = [model.decoder.layers["0"].mlp.router for model in (first, second)]
    hooks = [auxiliary_loss_scale_hook([model]) for model in (first, second)]
    hidden = torch.randn(SEQ, 2, 16, generator=torch.Generator().manual_seed(3))
    hooks[0](0.25)
    probs, _ = routers[0](hidden)  # the first model's step is under way ...
    scaled = ScheduleHooks(auxiliary_loss_scale=hooks[1])  # ... when the second runs a whole step
    run_schedule(get_forward_backward_func(), second, batches, seq_length=SEQ, schedule_hooks=scaled)
    assert routers[1].auxiliary_loss_scale.value == 0.5  # two microbatches: the scale the schedule computes
    (probs * 0).sum().backward()  # only the balancing loss reaches the weight
    alone = _router(moe_aux_loss_coeff=1.0, init_method_std=0.5)
    alone.weight.data.copy_(routers[0].weight)
    auxiliary_loss_scale_hook([alone])(0.25)
    (alone(hidden)[0] * 0).sum().backward()
    assert torch.equal(routers[0].weight.grad, alone.weight.grad)
    assert routers[0].auxiliary_loss_scale.value == 0.25


def test_capacity_keeps_each_experts_most_probable_tokens_or_pads_to_capacity():
    assert get_capacity(num_tokens=18 * 2, num_experts=4, capacity_factor=1.0) == 9
    logits = torch.randn(18, 4, generator=torch.Generator().manual_seed(4))
    probs, routing_map = topk_routing(logits, 2)
    kept_probs, kept = drop_tokens_over_capacity(probs, routing_map, 2, 0.5)  # capacity 5
    for e in range(4):
        routed = routing_map[:, e].nonzero().flatten()
        best = routed[torch.argsort(probs[routed, e], descending=True)][:5]
        assert set(kept[:, e].nonzero().flatten().tolist()) == set(best.tolist())
    assert torch.equal(kept_probs, probs * kept)
    padded_probs, padded = drop_tokens_over_capacity(probs, routing_map, 2, 0.5, pad_to_capacity=True)
    assert padded.sum(dim=0).tolist() == [5, 5, 5, 5]
    assert torch.equal(padded_probs, probs * padded)


# --------------------------------------------------------------------------------------------------
# Experts and the layer
# --------------------------------------------------------------------------------------------------


def _experts_output(grouped: bool, dtype: torch.dtype):
    config = moe_config(moe_grouped_gemm=grouped, params_dtype=dtype)
    experts = Experts(config, first=0, count=4)
    initialize_by_name(experts, config)
    tokens = torch.randn(13, 16, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_(True)
    counts = [4, 0, 6, 3]  # an expert without tokens too
    out = experts(tokens, counts)
    out.backward(torch.ones_like(out))
    grads = [p.grad for p in experts.parameters()]
    return out, tokens.grad, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_and_looped_experts_give_the_same_numbers(dtype):
    looped, grouped = _experts_output(False, dtype), _experts_output(True, dtype)
    assert torch.equal(looped[0], grouped[0]) and torch.equal(looped[1], grouped[1])  # bit-identical on CPU
    assert all(torch.equal(a, b) for a, b in zip(looped[2], grouped[2]))
    fc1 = looped[2][0]  # [4 experts, out, in]: one stacked gradient
    assert fc1[1].abs().sum() == 0 and fc1[0].abs().sum() > 0  # expert 1 got no token


@pytest.mark.parametrize("grouped", [False, True])
def test_the_stacked_projections_run_as_modules_so_their_forward_pre_hooks_fire(grouped):
    """The overlapped parameter all-gather (--overlap-param-gather) waits in a forward pre-hook of the
    module that owns the parameters: the experts must call their projections, not read their weights."""
    config = moe_config(moe_grouped_gemm=grouped)
    experts = Experts(config, first=0, count=4)
    initialize_by_name(experts, config)
    called = []
    for name in ("linear_fc1", "linear_fc2"):
        getattr(experts, name).register_forward_pre_hook(lambda module, args, name=name: called.append(name))
    experts(torch.randn(13, 16), [4, 0, 6, 3])
    assert called == ["linear_fc1", "linear_fc2"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_layer_matches_a_mixtral_style_loop(dispatcher, pre_softmax):
    config = moe_config(moe_token_dispatcher_type=dispatcher, moe_router_pre_softmax=pre_softmax)
    layer = MoELayer(config, layer_number=0)
    initialize_by_name(layer, config)
    hidden = torch.randn(SEQ, BATCH, 16, generator=torch.Generator().manual_seed(6))
    out = layer(hidden)
    expected = reference_moe(
        hidden.reshape(-1, 16), layer.router.weight, expert_weights(layer, 4), 2, pre_softmax=pre_softmax
    )
    assert relative_error(out.reshape(-1, 16), expected) < 1e-6


def test_shared_expert_gate_scales_a_dense_mlp_by_a_sigmoid():
    config = moe_config(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    layer = MoELayer(config, layer_number=0)
    initialize_by_name(layer, config)
    hidden = torch.randn(SEQ, BATCH, 16, generator=torch.Generator().manual_seed(7))
    tokens = hidden.reshape(-1, 16)
    shared = layer.shared_experts
    gate, up = (tokens @ shared.linear_fc1.weight.t()).chunk(2, dim=-1)
    dense = (torch.nn.functional.silu(gate) * up) @ shared.linear_fc2.weight.t()
    expected = reference_moe(tokens, layer.router.weight, expert_weights(layer, 4), 2)
    expected = expected + torch.sigmoid(tokens @ shared.gate_weight.t()) * dense
    assert relative_error(layer(hidden).reshape(-1, 16), expected) < 1e-6
    names = {n for n, _ in layer.named_parameters()}
    assert {"shared_experts.gate_weight", "experts.linear_fc2.weight", "router.weight"} <= names
    assert all(getattr(p, "allreduce", True) is False for n, p in layer.experts.named_parameters())


def test_experts_are_stacked_and_each_slice_keeps_its_per_expert_name_and_initialisation():
    """One 3-D parameter per projection; slice ``i`` of the rank holding experts 2 and 3 (EP 2) is
    named, and starts, exactly as expert ``2 + i`` of the rank holding all four (EP 1)."""
    config = moe_config(add_bias_linear=True)
    whole, half = Experts(config, first=0, count=4), Experts(config, first=2, count=2)
    for experts in (whole, half):
        initialize_by_name(experts, config)
    shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    assert shapes == {
        "linear_fc1.weight": (4, 32, 16),  # [W_gate; W_up] of 16 each, hidden 16
        "linear_fc1.bias": (4, 32),
        "linear_fc2.weight": (4, 16, 16),
        "linear_fc2.bias": (4, 16),
    }
    logical = dict(logical_tensors(whole.named_parameters()))
    assert list(logical)[:3] == [f"local_experts.{e}.linear_fc1.weight" for e in range(3)]
    for name, piece in logical_tensors(half.named_parameters()):
        assert torch.equal(piece, logical[name]), name
    fc1 = whole.linear_fc1.weight
    assert not torch.equal(fc1[0], fc1[1])  # each from its own name's generator
    first = torch.empty(32, 16)
    generator = name_generator(config.seed, "local_experts.0.linear_fc1.weight")
    first.normal_(0.0, config.init_method_std, generator=generator)
    assert torch.equal(fc1[0], first)


# --------------------------------------------------------------------------------------------------
# Config validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"moe_router_topk": 5}, "moe_router_topk (5) must be between 1 and num_moe_experts (4)"),
        (
            {"moe_router_topk": 1},
            (
                "moe_router_topk 1 needs moe_router_pre_softmax: a softmax over one logit is 1 and gives "
                "the router no gradient"
            ),
        ),
        ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq [1, 0, 1] must list 0 or 1 for each of the 2 layers"),
        (
            {"moe_pad_expert_input_to_capacity": True},
            "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor",
        ),
        (
            {"moe_token_dispatcher_type": "flex"},
            "moe_token_dispatcher_type must be one of ('alltoall', 'allgather'), got 'flex'",
        ),
    ],
)
def test_bad_moe_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ValueError) as err:
        moe_config(**overrides)
    assert str(err.value) == "invalid TransformerConfig: " + message


# --------------------------------------------------------------------------------------------------
# The losses for the log: per layer, mean over microbatches, mean over MoE layers; recomputation
# does not count twice
# --------------------------------------------------------------------------------------------------


def _logged_losses(**recompute):
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from core.transformer.moe.moe_logging import reduce_moe_metrics
    from models.gpt import GPTModel
    from tests.support.pipeline_toy import run_schedule

    config = moe_config(
        num_layers=3, moe_layer_freq=[1, 0, 1], moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3, **recompute
    )
    model = GPTModel(config, 64, SEQ)
    gen = torch.Generator().manual_seed(8)
    batches = [
        (t, t, torch.ones(2, SEQ)) for t in (torch.randint(0, 64, (2, SEQ), generator=gen) for _ in range(2))
    ]
    recorded = []
    run_schedule(get_forward_backward_func(), model, batches, seq_length=SEQ)
    for layer in (0, 2):
        recorded.append(
            {k: v.clone() for k, v in model.decoder.layers[str(layer)].mlp.router.metrics.items()}
        )
    summary, per_layer = reduce_moe_metrics([model], config, num_microbatches=2)
    assert all(not model.decoder.layers[str(i)].mlp.router.metrics for i in (0, 2))  # reset for the next step
    return summary, per_layer, recorded


def test_logged_losses_are_per_layer_means_over_microbatches_and_their_mean_over_moe_layers():
    summary, per_layer, recorded = _logged_losses()
    for name in ("load_balancing_loss", "z_loss"):
        assert per_layer[name][1] == 0.0  # the dense layer
        for value, router in zip((per_layer[name][0], per_layer[name][2]), recorded):
            assert value == pytest.approx(float(router[name]) / 2, rel=1e-6)
        assert summary[name] == pytest.approx((per_layer[name][0] + per_layer[name][2]) / 2, rel=1e-6)
    recomputed, _, _ = _logged_losses(**full_recompute("uniform", 1))
    assert recomputed == pytest.approx(
        summary, rel=1e-6
    )  # the forward replayed in backward is not logged again


# --------------------------------------------------------------------------------------------------
# --compile: the layer compiled, routing and dispatch eager
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~10 s of Dynamo tracing; tests/e2e/test_compile.py keeps --compile itself in CI
def test_compiled_moe_layer_computes_the_eager_numbers_and_new_routings_compile_nothing():
    from core.transformer.compile import compile_stats
    from models.gpt import GPTModel

    models = {}
    for compiled in (False, True):
        config = moe_config(
            num_layers=1,
            moe_aux_loss_coeff=0.01,
            moe_z_loss_coeff=1e-3,
            init_method_std=0.2,
            compile=compiled,
            compile_backend="aot_eager",
        )
        models[compiled] = GPTModel(config, 64, 16)
    models[True].load_state_dict(models[False].state_dict())
    counts, graphs = [], []
    models[False].decoder.layers["0"].mlp.router.register_forward_hook(
        lambda module, args, out: counts.append(out[1].sum(dim=0).tolist())
    )
    for step in range(2):  # two batches: other token counts per expert, so other dispatch shapes
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        assert_compiled_matches_eager(models, tokens, step)
        graphs.append(compile_stats()["graphs"])
    assert counts[0] != counts[1]
    assert graphs[1] == graphs[0]  # the new routing compiled nothing: router, dispatch and experts eager


# --------------------------------------------------------------------------------------------------
# bf16 and fp16: the router in fp32, the balancing loss scaled with fp16's loss scale
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models_route_in_fp32_and_scale_the_balancing_loss_with_the_loss_scale(dtype):
    from core.pipeline_parallel.hooks import ScheduleHooks
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from models.gpt import GPTModel
    from tests.support.pipeline_toy import run_schedule

    gen = torch.Generator().manual_seed(9)
    batches = [(t, t.roll(1, 1), torch.ones(2, SEQ)) for t in [torch.randint(0, 64, (2, SEQ), generator=gen)]]
    scale = 1024.0 if dtype == torch.float16 else 1.0
    grads, probs = {}, {}
    for low in (False, True):  # the balancing loss weighs as much as the main loss on the router
        config = moe_config(num_layers=1, moe_aux_loss_coeff=1.0, init_method_std=0.5)
        model = GPTModel(config, 64, SEQ).to(dtype if low else torch.float32)
        config.schedule_hooks = ScheduleHooks(grad_scale_func=(lambda x: x * scale) if low else None)
        router = model.decoder.layers["0"].mlp.router
        router.register_forward_hook(lambda module, args, out, low=low: probs.__setitem__(low, out[0]))
        run_schedule(get_forward_backward_func(), model, batches, seq_length=SEQ)
        grads[low] = router.weight.grad.float() / (scale if low else 1.0)
    assert probs[True].dtype == torch.float32  # the gate and its softmax in fp32 whatever the model's dtype
    assert relative_error(grads[True], grads[False]) < 3e-2, relative_error(grads[True], grads[False])

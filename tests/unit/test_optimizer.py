"""Optimizer in one process: AdamW parity, bf16 with fp32 main params, weight-decay groups, LR schedule,
state round trip (also per parameter name), fused against foreach, fp16 loss scaling (overflow skips,
back-off, unscaled steps). Clipping and NaN skips over real ranks: tests/dist/test_optimizer.py."""

from __future__ import annotations

import copy
import itertools
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from core.optimizer import (
    DynamicGradScaler,
    OptimizerConfig,
    OptimizerParamScheduler,
    get_grad_norm_fp32,
    get_megatron_optimizer,
    get_param_groups,
    has_fused_kernel,
)
from tests.support.optimizer import adam_state_sum


class _Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(7, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, tokens):
        return self.out(self.norm(torch.tanh(self.fc(self.embedding(tokens))))).square().mean()


# The kernel get_megatron_optimizer picks on this machine (fused where torch has it, else foreach):
# the bit-identity tests compare against torch's AdamW running that same kernel.
KERNEL = {"fused": True} if has_fused_kernel(torch.optim.AdamW, torch.device("cpu")) else {"foreach": True}


def _reference_adamw(model, lr=1e-2, weight_decay=0.1, **kw):
    decay = [model.embedding.weight, model.fc.weight, model.out.weight]
    no_decay = [model.fc.bias, model.norm.weight, model.norm.bias, model.out.bias]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        **(KERNEL | kw),
    )


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 7, (5,), generator=torch.Generator().manual_seed(step))


def test_weight_decay_groups_exclude_biases_and_norms():
    model = _Net()
    groups = get_param_groups(
        [model], 0.1, scale_lr_cond=lambda name, p: name.startswith("out."), lr_mult=2.0
    )
    summary = [
        (
            {n for n, p in model.named_parameters() if any(p is q for q in g["params"])},
            g["weight_decay"],
            g["wd_mult"],
            g["lr_mult"],
        )
        for g in groups
    ]
    assert summary == [
        ({"embedding.weight", "fc.weight"}, 0.1, 1.0, 1.0),
        ({"out.weight"}, 0.1, 1.0, 2.0),
        ({"fc.bias", "norm.weight", "norm.bias"}, 0.0, 0.0, 1.0),
        ({"out.bias"}, 0.0, 0.0, 2.0),
    ]


def test_fp32_step_from_ddp_buffers_is_bit_identical_to_torch_adamw():
    model, ref = _Net(), _Net()
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0), [ddp])
    reference = _reference_adamw(ref)
    for step in range(4):
        optimizer.zero_grad()
        ddp(_tokens(step)).backward()
        ddp.finish_grad_sync()
        assert all(p.grad.data_ptr() == p.main_grad.data_ptr() for p in model.parameters())  # the buffer
        ok, grad_norm, zeros = optimizer.step()
        reference.zero_grad()
        ref(_tokens(step)).backward()
        reference.step()
        assert ok and zeros is None
        assert grad_norm == pytest.approx(
            math.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters())), rel=1e-6
        )
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, name)


def _bf16_pair():
    model = _Net().to(torch.bfloat16)
    ref = _Net()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model, ref


@pytest.mark.parametrize("grad_source", ["main_grad", "grad"])
def test_bf16_model_steps_fp32_main_params_like_an_fp32_adamw(grad_source):
    model, ref = _bf16_pair()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.0, bf16=True), [model]
    )
    reference = _reference_adamw(ref, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(model.parameters(), ref.parameters()):
            g = torch.randn(p.shape, generator=gen)
            if grad_source == "main_grad":  # what DDP leaves: an fp32 buffer view
                p.main_grad = g
                q.grad = g.clone()
            else:  # a bf16 gradient, upcast by the optimizer
                p.grad = g.bfloat16()
                q.grad = g.bfloat16().float()
        assert optimizer.step()[0]
        reference.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            main = optimizer.get_main_param(p)
            assert main.dtype == torch.float32 and torch.equal(main, q), name
            assert torch.equal(p, main.bfloat16()), name
    # The point of main params: updates below bf16's resolution accumulate instead of vanishing.
    assert any(not torch.equal(main.bfloat16().float(), main) for main in optimizer.get_parameters())


@pytest.mark.parametrize("distributed", [False, True], ids=["whole", "distributed optimizer"])
def test_bf16_main_weights_step_the_bf16_weights_as_torch_adamw_does(distributed):
    """``main_params_dtype=bfloat16`` (``--megatron-fsdp-main-params-dtype auto``): no main copy; the
    fp32-accumulated gradient is cast to bf16 and torch's AdamW steps the bf16 weights, moments in bf16."""
    model, _ = _bf16_pair()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(
        None, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model
    )
    config = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.0,
        bf16=True,
        main_params_dtype=torch.bfloat16,
        use_distributed_optimizer=distributed,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    reference = _reference_adamw(ref)
    for step in range(4):
        optimizer.zero_grad()
        for micro in range(2):  # two microbatches: the gradient accumulates in fp32, then is cast once
            ddp(_tokens(10 * step + micro)).backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]
        reference.zero_grad()
        fp32_sum = {}
        for micro in range(2):
            ref(_tokens(10 * step + micro)).backward()
            for q in ref.parameters():
                fp32_sum[q] = fp32_sum.get(q, 0) + q.grad.float()
                q.grad = None
        for q in ref.parameters():
            q.grad = fp32_sum[q].bfloat16()
        reference.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, name)
    assert all(main.dtype == torch.bfloat16 for main in optimizer.get_parameters())
    assert {v.dtype for state in optimizer.state.values() for v in state.values() if v.dim() > 0} == {
        torch.bfloat16
    }
    # The state loads into fp32 main weights (the moments upcast, the main copies from the weights)...
    fp32_main = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=distributed), [ddp]
    )
    fp32_main.load_state_dict(optimizer.state_dict())
    saved = optimizer.state_dict()["params"]
    for shard in fp32_main.shards:
        assert torch.equal(shard.main_param, shard.model_param.float().view_as(shard.main_param))
        assert fp32_main.state[shard.main_param]["exp_avg"].dtype == torch.float32
        assert torch.equal(
            fp32_main.state[shard.main_param]["exp_avg"].reshape(-1), saved[shard.name]["exp_avg"].float()
        )
    # ... and back: bf16 moments, the fp32 main copy rounded into the weights.
    optimizer.load_state_dict(fp32_main.state_dict())
    assert {v.dtype for state in optimizer.state.values() for v in state.values() if v.dim() > 0} == {
        torch.bfloat16
    }


@pytest.mark.parametrize(
    ("precision", "dtype", "why"),
    [
        ("bf16", torch.float16, "main_params_dtype fp16 must be fp32 or the model's dtype (bf16)"),
        ("fp16", torch.float16, "main_params_dtype fp16 (fp16 main weights) is not built: Adam's moments"),
        ("fp32", torch.bfloat16, "main_params_dtype bf16 must be fp32 or the model's dtype (fp32)"),
    ],
)
def test_the_config_refuses_the_main_weights_the_flags_refuse(precision, dtype, why):
    """One rule (``main_params_problems``) for ``OptimizerConfig`` and ``--megatron-fsdp-main-params-dtype``
    (tests/unit/test_sharding_flags.py words the same cases with the flag)."""
    with pytest.raises(ValueError, match=re.escape(f"invalid OptimizerConfig: {why}")):
        OptimizerConfig(
            lr=1e-3, main_params_dtype=dtype, **({precision: True} if precision != "fp32" else {})
        )


def _roundtrip(optimizer, model, tmp_path, tag):
    """The optimizer's state through files: its tensors to safetensors (``name/key``), the rest to JSON."""
    state = optimizer.state_dict()
    tensors = {
        f"{name}/{key}": value.contiguous()
        for name, entry in state["params"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    ranges = {
        name: {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
        for name, entry in state["params"].items()
    }
    save_file(tensors, str(tmp_path / f"{tag}.safetensors"))
    (tmp_path / f"{tag}.json").write_text(
        json.dumps({"param_groups": state["param_groups"], "ranges": ranges})
    )
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / f"{tag}-model.safetensors")
    )
    return (
        load_file(str(tmp_path / f"{tag}.safetensors")),
        json.loads((tmp_path / f"{tag}.json").read_text()),
        load_file(str(tmp_path / f"{tag}-model.safetensors")),
    )


def _from_files(tensors: dict, meta: dict) -> dict:
    params = {name: dict(entry) for name, entry in meta["ranges"].items()}
    for key, value in tensors.items():
        name, field = key.rsplit("/", 1)
        params[name][field] = value
    return {"param_groups": meta["param_groups"], "params": params}


@pytest.mark.parametrize("bf16", [False, True])
def test_state_dict_round_trip_through_safetensors_and_json_continues_bit_identically(bf16, tmp_path):
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, bf16=bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _Net().to(dtype)
    optimizer = get_megatron_optimizer(config, [model])
    scheduler = OptimizerParamScheduler(optimizer, 0.0, 1e-2, 1e-3, 2, 10, "cosine")

    def train(model, optimizer, scheduler, steps):
        for step in steps:
            optimizer.zero_grad()
            model(_tokens(step)).float().backward()
            assert optimizer.step()[0]
            scheduler.step(1)

    train(model, optimizer, scheduler, range(3))
    tensors, meta, weights = _roundtrip(optimizer, model, tmp_path, "ckpt")
    sched_state = json.loads(json.dumps(scheduler.state_dict()))
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    assert any(key.endswith("/exp_avg") for key in tensors)
    assert any(key.endswith("/main_param") for key in tensors) == bf16

    resumed = _Net(seed=1).to(dtype)
    resumed.load_state_dict(weights)
    resumed_opt = get_megatron_optimizer(config, [resumed])
    resumed_opt.load_state_dict(_from_files(tensors, meta))
    resumed_sched = OptimizerParamScheduler(resumed_opt, 0.0, 1e-2, 1e-3, 2, 10, "cosine")
    resumed_sched.load_state_dict(sched_state)

    train(model, optimizer, scheduler, range(3, 6))
    train(resumed, resumed_opt, resumed_sched, range(3, 6))
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(optimizer.get_main_param(p), resumed_opt.get_main_param(q))


def test_a_gradient_after_its_bucket_was_launched_is_refused_naming_both_causes():
    """With ``overlap_grad_reduce`` a backward outside ``no_sync()`` is a step's last: its bucket launches
    its reduction, and a further backward before ``zero_grad_buffer()`` would add into a buffer being
    reduced. It is refused in one line naming the parameter and both fixes (where ``.grad`` is ``main_grad``
    itself, as for these fp32 parameters, autograd has added into the buffer before the hook runs)."""
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(overlap_grad_reduce=True), _Net())
    ddp(_tokens(0)).backward()
    with pytest.raises(RuntimeError) as refused:
        ddp(_tokens(1)).backward()
    assert str(refused.value) == (
        "gradient for out.bias arrived after its bucket was launched; call zero_grad_buffer() (or "
        "optimizer.zero_grad()) before the next step, and with overlap_grad_reduce run every microbatch "
        "but a step's last inside no_sync()"
    )
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        ddp(_tokens(0)).backward()
    ddp(_tokens(1)).backward()  # accumulated, then the step's last
    ddp.finish_grad_sync()


def test_zero_grad_starts_a_step_whose_first_gradients_overwrite_the_last_steps():
    """No pass zeroes the buffers between steps: ``.grad`` is None until a parameter's first gradient
    of the step, which overwrites the stale ``main_grad``; the result is this step's gradients alone."""
    model = _Net()
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [ddp])
    ddp(_tokens(0)).backward()
    ddp.finish_grad_sync()
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # autograd cannot add into the stale buffer
    ddp.buffers[0].grad_data.fill_(float("nan"))  # whatever the last step left
    params = list(model.parameters())
    expected = torch.autograd.grad(ddp(_tokens(1)), params)  # no accumulation, no hooks
    ddp(_tokens(1)).backward()  # buckets were re-armed: no "arrived after reduction" error
    ddp.finish_grad_sync()
    assert all(p.grad.data_ptr() == p.main_grad.data_ptr() for p in params)  # the buffer again
    assert all(torch.equal(p.main_grad, g) for p, g in zip(params, expected))


class _NetWithExperts(_Net):
    """``_Net`` with two "experts" of which a step's tokens reach one (``expert``): the other gets no
    gradient that step, as an MoE expert no token was routed to."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.expert = 0
        self.to(dtype)

    def forward(self, tokens):
        hidden = torch.tanh(self.fc(self.embedding(tokens)))
        hidden = hidden + self.experts[self.expert](hidden)
        return self.out(self.norm(hidden)).square().mean()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_parameter_without_gradient_in_a_step_steps_on_zero_as_before(overlap):
    """An expert no token reached keeps no stale gradient: its ``main_grad`` is zero when its bucket is
    reduced and Adam steps it on zero (moments decaying, weight decay), bit-identical to torch's AdamW
    given zero gradients, which is what zeroing the whole buffer every step gave."""
    model, ref = _NetWithExperts(), _NetWithExperts()
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(overlap_grad_reduce=overlap), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0), [ddp])
    decay = [p for n, p in ref.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for p in ref.parameters() if all(p is not q for q in decay)]
    reference = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, **KERNEL
    )
    for step in range(4):
        model.expert = ref.expert = step % 2
        optimizer.zero_grad()
        ddp(_tokens(step)).backward()
        ddp.finish_grad_sync()
        unused = model.experts[1 - step % 2]
        assert all(p.main_grad.abs().sum() == 0 for p in unused.parameters()), step
        assert optimizer.step()[0]
        reference.zero_grad()
        ref(_tokens(step)).backward()
        for q in ref.parameters():
            q.grad = torch.zeros_like(q) if q.grad is None else q.grad
        reference.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, name)


def test_an_fp16_overflow_skips_and_its_stale_gradients_never_reach_the_next_step():
    """A skipped fp16 step leaves an Inf in the buffer; the next step's parameter without a gradient
    reads zero, not that Inf, so the next step is taken."""
    model = _NetWithExperts(torch.float16)
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(), model)
    config = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=1024.0, min_loss_scale=1.0, hysteresis=1)
    optimizer = get_megatron_optimizer(config, [ddp])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    optimizer.scale_loss(ddp(_tokens(0)).float()).backward()
    model.experts[0].weight.main_grad.view(-1)[0] = float("inf")  # what an overflowing backward leaves
    ddp.finish_grad_sync()
    assert optimizer.step() == (False, None, None) and optimizer.last_step_overflowed
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model.expert = 1
    optimizer.zero_grad()
    optimizer.scale_loss(ddp(_tokens(1)).float()).backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    assert ok and math.isfinite(grad_norm) and not optimizer.last_step_overflowed
    assert torch.equal(model.experts[0].weight.main_grad, torch.zeros_like(model.experts[0].weight))


def _lrs(style, steps, **kw):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 10, 110, style, **kw)
    values, done = [], 0
    for step in steps:
        scheduler.step(step - done)
        done = step
        values.append(opt.param_groups[0]["lr"])
    return values


def test_lr_warmup_then_decay_matches_megatron_formulas():
    steps = [0, 5, 10, 35, 60, 110, 111, 500]
    approx = lambda xs: pytest.approx(xs, rel=1e-12, abs=1e-15)
    assert _lrs("cosine", steps) == approx([0.0, 0.5, 1.0, 0.8681980515339464, 0.55, 0.1, 0.1, 0.1])
    assert _lrs("linear", steps) == approx([0.0, 0.5, 1.0, 0.775, 0.55, 0.1, 0.1, 0.1])
    assert _lrs("constant", steps) == approx([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert _lrs("inverse-square-root", [40, 1000]) == approx([0.5, 0.1])
    assert _lrs("WSD", [80, 90, 100, 110], wsd_decay_steps=20, lr_wsd_decay_style="linear") == approx(
        [1.0, 1.0, 0.55, 0.1]
    )


def test_weight_decay_ramp_and_group_multipliers():
    groups = [
        {"params": [nn.Parameter(torch.zeros(1))], "wd_mult": 1.0, "lr_mult": 2.0},
        {"params": [nn.Parameter(torch.zeros(1))], "wd_mult": 0.0, "lr_mult": 1.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.0)
    scheduler = OptimizerParamScheduler(
        opt,
        0.0,
        1.0,
        0.1,
        10,
        110,
        "linear",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="linear",
    )
    scheduler.step(50)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2 * 0.64, 0.64])  # ratio .4: .1 + .9 * .6
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.05, 0.0])


def test_scheduler_rejects_bad_settings_with_the_knob_named():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
    with pytest.raises(ValueError, match="lr_warmup_steps < lr_decay_steps"):
        OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 10, 10, "cosine")
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 1, 10, "cosin")


def test_plain_process_norm_needs_no_groups():
    grads = [torch.tensor([3.0]), torch.tensor([4.0])]
    assert get_grad_norm_fp32(grads) == 5.0
    model = copy.deepcopy(_Net())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1e-3), [model])
    model(_tokens(0)).backward()
    ok, norm, _ = optimizer.step()
    assert ok and norm > 1e-3
    assert optimizer.get_grad_norm() == pytest.approx(1e-3, rel=1e-3)  # clipped to the limit


def test_dynamic_scaler_backs_off_after_hysteresis_and_grows_after_a_quiet_window():
    scaler = DynamicGradScaler(1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    scales = []
    for found_inf in (True, True, True, False, False, False, True, True, True, True):
        scaler.update(found_inf)
        scales.append(scaler.scale)
    # 1st overflow uses up hysteresis; then every one halves until the window of 3 quiet steps
    # doubles it and restores the hysteresis; the floor is min_scale.
    assert scales == [1024, 512, 256, 256, 256, 512, 512, 256, 256, 256]
    state = scaler.state_dict()
    again = DynamicGradScaler(1.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    again.load_state_dict(state)
    assert again.state_dict() == state


def _fp16_net_and_optimizer(hysteresis: int, scale: float = 2.0**20):
    model = _Net().to(torch.float16)
    config = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        fp16=True,
        initial_loss_scale=scale,
        min_loss_scale=1.0,
        hysteresis=hysteresis,
    )
    return model, get_megatron_optimizer(config, [model])


def test_fp16_overflow_skips_the_step_halves_the_scale_and_leaves_parameters_untouched():
    model, optimizer = _fp16_net_and_optimizer(hysteresis=1)
    before = [p.detach().clone() for p in model.parameters()]
    mains = [m.detach().clone() for m in optimizer.get_parameters()]
    optimizer.zero_grad()
    optimizer.scale_loss(model(_tokens(0)).float()).backward()
    next(model.parameters()).grad.view(-1)[0] = float("inf")  # what an overflowing backward leaves
    ok, grad_norm, _ = optimizer.step()
    assert (ok, grad_norm, optimizer.last_step_overflowed) == (False, None, True)
    assert optimizer.grad_scaler.scale == 2.0**19
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(a, m) for a, m in zip(mains, optimizer.get_parameters()))
    assert adam_state_sum(optimizer) == 0  # the skipped step left Adam's moments and step count at zero


def test_fp16_step_unscales_gradients_to_those_of_fp32_main_params():
    model, optimizer = _fp16_net_and_optimizer(hysteresis=2, scale=1024.0)
    reference = _Net()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    reference_opt = _reference_adamw(reference)
    optimizer.zero_grad()
    optimizer.scale_loss(model(_tokens(0)).float()).backward()
    ok, _, _ = optimizer.step()
    reference(_tokens(0)).backward()
    reference_opt.step()
    assert ok and not optimizer.last_step_overflowed and optimizer.grad_scaler.scale == 1024.0
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(
            optimizer.get_main_param(p), q, rtol=0, atol=1e-4
        )  # Adam's first step: lr * sign


@pytest.mark.parametrize("bf16", [False, True])
def test_param_state_by_name_round_trips_and_continues_bit_identically(bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=bf16)
    model = _Net().to(dtype)
    optimizer = get_megatron_optimizer(config, [model])
    for step in range(2):
        optimizer.zero_grad()
        model(_tokens(step)).float().backward()
        optimizer.step()
    state = optimizer.param_state_by_name()
    assert state["params"]["fc.weight"]["start"] == 0 and state["params"]["fc.weight"]["end"] == 24
    assert state["params"]["fc.weight"]["exp_avg"].shape == (24,)
    assert ("main_param" in state["params"]["fc.weight"]) == bf16
    copy = _Net(seed=3).to(dtype)
    copy.load_state_dict(model.state_dict())
    restored = get_megatron_optimizer(config, [copy])
    restored.load_param_state_by_name(state)
    for opt, net in ((optimizer, model), (restored, copy)):
        for step in range(2, 4):
            opt.zero_grad()
            net(_tokens(step)).float().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), copy.parameters()))
    state["params"]["fc.weight"]["start"] = 1
    with pytest.raises(
        ValueError, match=r"'fc.weight' covers \[1, 24\) of 24 elements; this rank needs \[0, 24\)"
    ):
        restored.load_param_state_by_name(state)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.skipif(not KERNEL.get("fused"), reason="this torch has no fused AdamW on the CPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_fused_adamw_steps_like_foreach_within_1e_6(dtype):
    """Six steps, clipping active, one of them with a NaN gradient (skipped on the device by the fused
    kernel, on the host by the foreach path): the same parameters, moments and norms within 1e-6."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    config = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, clip_grad=0.05, bf16=dtype == "bf16", fp16=dtype == "fp16"
    )
    config.initial_loss_scale = 1024.0
    runs = []
    for fused in (True, False):
        model = _Net().to(torch_dtype)
        optimizer = get_megatron_optimizer(config, [model], fused=fused)
        assert optimizer.fused is fused
        norms = []
        for step in range(6):
            optimizer.zero_grad()
            optimizer.scale_loss(model(_tokens(step)).float()).backward()
            if step == 2:
                model.fc.weight.grad.view(-1)[0] = float("nan")
            outcome = optimizer.step_on_device()
            norms.append(float(outcome.grad_norm))
            assert bool(outcome.applied) is (step != 2)
        runs.append((optimizer, model, norms))
    (fused_opt, fused_model, fused_norms), (foreach_opt, foreach_model, foreach_norms) = runs
    assert fused_norms[:2] + fused_norms[3:] == pytest.approx(foreach_norms[:2] + foreach_norms[3:], rel=1e-6)
    assert math.isnan(fused_norms[2]) and math.isnan(foreach_norms[2])
    for p, q in zip(fused_model.parameters(), foreach_model.parameters()):
        main_p, main_q = fused_opt.get_main_param(p), foreach_opt.get_main_param(q)
        assert _relative(main_p, main_q) <= 1e-6
        state_p, state_q = fused_opt.state[main_p], foreach_opt.state[main_q]
        assert float(state_p["step"]) == float(state_q["step"]) == 5  # the skipped step did not count
        for key in ("exp_avg", "exp_avg_sq"):
            assert _relative(state_p[key], state_q[key]) <= 1e-6


def test_a_step_decided_on_the_device_takes_per_group_learning_rate_tensors():
    """``lrs``: the learning rates the training loop picks on the device give the same update as the
    same numbers written into the groups."""
    if not KERNEL.get("fused"):
        pytest.skip("this torch has no fused AdamW on the CPU")
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    rates = [3e-3, 7e-4]
    models = []
    for as_tensors in (True, False):
        model = _Net()
        optimizer = get_megatron_optimizer(config, [model])
        model(_tokens(0)).backward()
        if as_tensors:
            lrs = [torch.tensor(r, dtype=torch.float32) for r in rates]
            optimizer.step_on_device(lrs=lrs)
            assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 1e-2]  # the numbers are kept
        else:
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = float(torch.tensor(rate, dtype=torch.float32))
            optimizer.step_on_device()
        models.append(model)
    assert all(torch.equal(p, q) for p, q in zip(*(m.parameters() for m in models)))
    with pytest.raises(ValueError, match="per-step learning-rate tensors need a fused optimizer"):
        get_megatron_optimizer(config, [_Net()], fused=False).step_on_device(lrs=[torch.tensor(1.0)] * 2)


def test_the_sum_of_squares_is_float64_accurate_by_every_path():
    """A GPU on torch >= 2.4 accumulates each tensor in float64 in one kernel, an older torch converts
    pieces, a CPU sums 128-element blocks in fp32 and the blocks in float64."""
    from core.optimizer import clip_grads

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) * 10.0**k for k, n in enumerate((7, 300, 1, 5500))]
    exact = sum(float(t.double().square().sum()) for t in tensors)
    sums = [clip_grads._sum_of_squares(tensors, [0] * len(tensors), torch.device("cpu"))]
    sums.append(clip_grads._sum_of_squares_in_pieces(tensors, torch.device("cpu"), 16))  # pieces, joined
    if clip_grads._FOREACH_NORM_DTYPE:
        sums.append(torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64)).square().sum())
    assert all(s.dtype == torch.float64 for s in sums)
    assert float(sums[0]) == pytest.approx(exact, rel=1e-7)  # fp32 blocks: ~1e-7 / sqrt(blocks)
    assert all(float(s) == pytest.approx(exact, rel=1e-14) for s in sums[1:])


def test_the_cpu_norm_of_a_parameter_is_the_norm_of_its_shards():
    """The distributed optimizer counts its shards of a parameter, cut anywhere: the sum is the whole
    parameter's but for the blocks a cut splits, far below an fp32 rounding of the total, so the
    clipping factor does not depend on the data-parallel split."""
    from core.optimizer.clip_grads import _sum_of_squares

    cpu = torch.device("cpu")
    whole = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1))
    total = float(_sum_of_squares([whole], [0], cpu))
    for cuts in ([128 * 4000], [333_333, 666_667], [1, 129, 500_000, 999_999]):
        bounds = [0, *cuts, whole.numel()]
        pieces = [whole[a:b] for a, b in itertools.pairwise(bounds)]
        sharded = sum(float(_sum_of_squares([p], [a], cpu)) for p, a in zip(pieces, bounds))
        # a block a cut splits: its fp32 rounding (~1e-7) times its share of the total, 1.3e-4 here
        assert sharded == pytest.approx(total, rel=1e-10), cuts
    assert abs(total - float(whole.double().square().sum())) / total < 1e-8  # fp32 throughout: 2e-5


def test_the_cpu_norm_of_large_gradients_is_accurate_and_nan_or_inf_stays_non_finite():
    from core.optimizer.clip_grads import get_grad_norm_tensor

    big = torch.full((1000,), 1e17)
    assert float(get_grad_norm_tensor([big])) == pytest.approx(float(big[0]) * math.sqrt(1000), rel=1e-6)
    assert math.isnan(float(get_grad_norm_tensor([big, torch.tensor([float("nan")])])))
    assert math.isinf(float(get_grad_norm_tensor([torch.tensor([1.0, float("inf")])])))

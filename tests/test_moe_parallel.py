"""An MoE layer split over expert (and tensor) parallel gloo ranks equals one device computing it.

Each rank routes its own tokens (a sequence shard under sequence parallelism); the reference is an
unsplit layer with the same weights (the same names give the same initialisation) run on each
sequence in one process. Checked per rank: the output of its tokens, the router's gradient (with
the load-balancing and z-losses of its own sequence, summed over tensor parallelism), and each of
its experts' gradient, which gathers the contributions of every token of the expert-parallel group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.pipeline_parallel.auxiliary_loss import set_auxiliary_loss_scale
from core.transformer.initialization import initialize_by_name
from core.transformer.moe import MoEGroups, MoELayer
from tests.moe_reference import moe_config

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
SLOW = {"ep2-dp2-allgather-grouped", "ep4-allgather-looped", "ep2-alltoall-capacity-padded"}


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
        results.append({"out": out.detach()} | {n: p.grad.clone() for n, p in layer.named_parameters()})
    return results


def _run(rank, world_size, tp, ep, overrides):
    set_auxiliary_loss_scale(1.0)
    ps.initialize_model_parallel()
    reference = _reference(moe_config(**COMMON, **overrides), world_size // tp)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    config = moe_config(**COMMON, **overrides, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
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
    for name, param in layer.named_parameters():
        if ".local_experts." in name:
            expected = sum(reference[g][name] for g in ep_groups)
            errors["experts"] = max(errors["experts"], _relative(param.grad, expected))
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

"""The MoE layer that replaces a decoder layer's MLP: route, dispatch, run the experts, combine.

``[s, b, h]`` in and out, sequence-sharded under sequence parallelism like the MLP it replaces.
Every token goes to ``moe_router_topk`` of ``num_moe_experts`` experts; the experts are split over
the expert-parallel group (rank ``r`` holds experts ``r * E/EP .. (r + 1) * E/EP - 1``) and are
never split over tensor parallelism (Megatron's ``--expert-tensor-parallel-size 1``): with tensor
parallelism each rank routes its own sequence shard, which is why training needs sequence
parallelism then (as in Megatron). Shared experts, when configured, are a tensor-parallel MLP every
token goes through, optionally scaled by a learned sigmoid gate (Qwen2-MoE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from core.device import param_device
from core.parallel_state import group_rank, group_size
from core.transformer.initialization import mark_init
from core.transformer.mlp import MLP
from core.transformer.moe.experts import Experts
from core.transformer.moe.groups import MoEGroups
from core.transformer.moe.router import TopKRouter
from core.transformer.moe.rules import moe_training_problems
from core.transformer.moe.token_dispatcher import build_token_dispatcher

if TYPE_CHECKING:
    from core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """The shared experts: a dense (tensor-parallel) MLP; with a gate, ``sigmoid(x . gate_weight) * mlp(x)``."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None = None) -> None:
        super().__init__(config, config.moe_shared_expert_intermediate_size, tp_group)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            shape = (1, config.hidden_size)
            self.gate_weight = nn.Parameter(
                torch.empty(shape, device=param_device(config), dtype=config.params_dtype)
            )
            self.gate_weight.sequence_parallel = config.sequence_parallel
            mark_init(self.gate_weight, "normal")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = super().forward(hidden)
        if self.gate_weight is None:
            return output
        return torch.sigmoid(F.linear(hidden, self.gate_weight)) * output


class MoELayer(nn.Module):
    """Megatron's submodule names: ``router``, ``experts``, ``shared_experts`` (and ``token_dispatcher``).

    ``groups`` defaults to this rank's from ``core.parallel_state`` (none in a plain process).
    Under ``--compile`` the shared experts and the layer's element-wise work are compiled; the
    router (its balancing loss talks over TP x CP, and the loss's gradient scale changes per step)
    and :meth:`routed_experts` (host-side splits, an all-to-all or all-gather, token counts that
    change every step) stay eager, so routing never recompiles a graph.
    """

    eager_methods = ("routed_experts",)
    """Methods ``core.transformer.compile.compile_layer`` keeps out of the compiled regions."""

    def __init__(self, config: TransformerConfig, layer_number: int, groups: MoEGroups | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        if groups is None:
            groups = MoEGroups.from_parallel_state(config.expert_model_parallel_size)
        ep_size, ep_rank = group_size(groups.ep), group_rank(groups.ep)
        if config.num_moe_experts % ep_size:
            raise ValueError(
                f"num_moe_experts ({config.num_moe_experts}) must be divisible by the expert-parallel "
                f"group's size ({ep_size})"
            )
        self.num_local_experts = config.num_moe_experts // ep_size
        self.local_expert_indices = list(
            range(ep_rank * self.num_local_experts, (ep_rank + 1) * self.num_local_experts)
        )
        self.router = TopKRouter(config, layer_number, groups.tp_cp)
        self.experts = Experts(config, self.local_expert_indices[0], self.num_local_experts)
        self.shared_experts = (
            SharedExpertMLP(config, groups.tp)
            if config.moe_shared_expert_intermediate_size is not None
            else None
        )
        self.token_dispatcher = build_token_dispatcher(
            config.moe_token_dispatcher_type, config.num_moe_experts, groups.ep
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]``."""
        problems = moe_training_problems(self.config) if self.training else []
        if problems:
            raise ValueError(str(problems[0]))
        shared = self.shared_experts(hidden) if self.shared_experts is not None else None
        probs, routing_map = self.router(hidden)
        output = self.routed_experts(hidden.reshape(-1, hidden.shape[-1]), probs, routing_map).view_as(hidden)
        return output if shared is None else output + shared

    def routed_experts(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> torch.Tensor:
        """``[t, h]`` tokens to their experts and back, weighted by ``probs``: ``[t, h]``."""
        expert_input, tokens_per_expert, plan = self.token_dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(expert_input, tokens_per_expert)
        return self.token_dispatcher.combine(expert_output, plan)

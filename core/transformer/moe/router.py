"""The top-k router: a linear gate over the hidden state, top-k experts per token, balancing losses.

The gate is computed in fp32 whatever the model's dtype (small differences in the logits change
which experts win). Its losses are Megatron's, over *this rank's* tokens: a microbatch's token
counts per expert are summed over the ranks sharing its sequences (tensor x context parallel), so
every data-parallel (and expert-parallel) rank balances its own tokens, as in Megatron. The losses
join the objective through :func:`~core.pipeline_parallel.auxiliary_loss.attach_auxiliary_loss`
(the load-balancing loss on the probabilities, the z-loss on the logits), and only while training
with autograd on; their backward starts from the router's ``auxiliary_loss_scale``, which the
schedule sets each step through its hooks.

For the log, each loss is also accumulated here, without its coefficient, per step
(``metrics``: name -> sum over the step's microbatches), except during a recomputation in backward;
:mod:`~core.transformer.moe.moe_logging` reduces them over ranks and resets them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from core.device import param_device
from core.parallel_state import group_size
from core.pipeline_parallel.auxiliary_loss import AuxiliaryLossScale, attach_auxiliary_loss
from core.transformer.initialization import mark_init
from core.transformer.moe.moe_utils import (
    drop_tokens_over_capacity,
    routing_scores_for_aux_loss,
    switch_load_balancing_loss,
    topk_routing,
    z_loss,
)
from core.transformer.recompute import is_recomputing

if TYPE_CHECKING:
    from core.transformer.transformer_config import TransformerConfig

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
"""The name each balancing loss is logged under (Megatron's)."""


class TopKRouter(nn.Module):
    """``[s, b, h]`` -> ``(probs, routing_map)``, each ``[s * b, experts]``; ``weight`` is ``[experts, h]``.

    The weight is replicated on every tensor-parallel rank; under sequence parallelism each sees
    its own tokens, so it is marked ``sequence_parallel`` and its gradient summed over TP.
    Stays eager under ``--compile`` (``keep_out_of_compile``): its balancing loss all-reduces over
    TP x CP and takes a gradient scale that the schedule sets each step (``auxiliary_loss_scale``).
    """

    keep_out_of_compile = True

    def __init__(
        self, config: TransformerConfig, layer_number: int, tp_cp_group: ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.tp_cp_group = tp_cp_group
        shape = (self.num_experts, config.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape, device=param_device(config), dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        mark_init(self.weight, "normal")
        self.bias = None
        if config.add_bias_linear:
            self.bias = nn.Parameter(
                torch.zeros(self.num_experts, device=param_device(config), dtype=config.params_dtype)
            )
            self.bias.sequence_parallel = config.sequence_parallel
            mark_init(self.bias, "zeros")
        self.auxiliary_loss_scale = AuxiliaryLossScale()
        """The gradient this router's losses start their backward from: the step's, set by the schedule
        through ``ScheduleHooks.auxiliary_loss_scale``."""
        self.metrics: dict[str, torch.Tensor] = {}
        """Loss name -> its value (without coefficient) summed over this step's microbatches."""

    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """The router's logits ``[s * b, experts]``, in fp32."""
        bias = None if self.bias is None else self.bias.float()
        return F.linear(hidden.float(), self.weight.float(), bias).reshape(-1, self.num_experts)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq_length, batch = hidden.shape[:2]
        logits = self._apply_z_loss(self.gating(hidden))
        config = self.config
        probs, routing_map = topk_routing(
            logits,
            self.topk,
            pre_softmax=config.moe_router_pre_softmax,
            scaling_factor=config.moe_router_topk_scaling_factor,
        )
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens_over_capacity(
                probs,
                routing_map,
                self.topk,
                config.moe_expert_capacity_factor,
                drop_policy=config.moe_token_drop_policy,
                pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            )
        balancing = config.moe_router_load_balancing_type
        if self._losses_on() and balancing != "none" and config.moe_aux_loss_coeff > 0:
            aux_map, scores = routing_scores_for_aux_loss(logits, self.topk)
            if balancing == "seq_aux_loss":  # one row per position, (sequence, expert) columns
                aux_map, scores = aux_map.reshape(seq_length, -1), scores.reshape(seq_length, -1)
            probs = self._apply_balancing_loss(
                probs, scores, aux_map, batch if balancing == "seq_aux_loss" else 1
            )
        return probs, routing_map

    def _losses_on(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _apply_balancing_loss(
        self, probs: torch.Tensor, scores: torch.Tensor, aux_map: torch.Tensor, sequences: int
    ) -> torch.Tensor:
        """Megatron's aux_loss (``sequences`` 1) or seq_aux_loss: each of the microbatch's sequences
        balanced on its own (its experts are columns of their own), the losses averaged."""
        coeff = self.config.moe_aux_loss_coeff
        tokens_per_expert = aux_map.sum(dim=0).float()
        if self.tp_cp_group is not None:
            dist.all_reduce(tokens_per_expert, group=self.tp_cp_group)
        local_tokens = scores.shape[0]
        total_tokens = local_tokens * group_size(self.tp_cp_group)
        loss = (
            switch_load_balancing_loss(
                scores, tokens_per_expert, total_tokens, self.topk, self.num_experts, coeff
            )
            / sequences
        )
        name = AUX_LOSS_NAMES[self.config.moe_router_load_balancing_type]
        self._record(name, loss / coeff)
        scaled = self._per_token_scaled(loss, local_tokens * sequences)
        return attach_auxiliary_loss(probs, scaled, self.auxiliary_loss_scale)

    def _apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self._losses_on():
            return logits
        coeff = coeff / group_size(self.tp_cp_group)  # each rank's share of the mean over the sequence
        loss = z_loss(logits, coeff)
        self._record("z_loss", loss / coeff)
        scaled = self._per_token_scaled(loss, logits.shape[0])
        return attach_auxiliary_loss(logits, scaled, self.auxiliary_loss_scale)

    def _per_token_scaled(self, loss: torch.Tensor, local_tokens: int) -> torch.Tensor:
        """With a per-token main loss every gradient is divided by the step's token count at the end;
        multiplying by this rank's share of it keeps the auxiliary loss's weight (Megatron's rule)."""
        if not self.config.calculate_per_token_loss:
            return loss
        return loss * (local_tokens * group_size(self.tp_cp_group))

    def _record(self, name: str, value: torch.Tensor) -> None:
        if is_recomputing():
            return
        value = value.detach().float()
        self.metrics[name] = self.metrics[name] + value if name in self.metrics else value

"""Routing and load-balancing maths as plain functions of tensors (Megatron's definitions).

Every function here works on one rank's tokens, ``[num_tokens, num_experts]``; what is summed over
ranks (token counts per expert) is passed in already summed. All of it runs in fp32: the router's
logits are fp32 whatever the model's dtype.

* Top-k: ``torch.topk`` picks the experts, so ties go the way ``torch.topk`` breaks them. By
  default the top-k *logits* are picked and softmaxed (probabilities sum to one over the chosen
  experts: Mixtral); ``pre_softmax`` softmaxes over all experts first and keeps the chosen
  probabilities as they are (Qwen2-MoE, DeepSeek).
* Load balancing (Switch Transformer / GShard): with ``f_i`` the fraction of routed slots that
  went to expert ``i`` and ``P_i`` the mean router probability of expert ``i``,
  ``aux = coeff * E * sum_i f_i P_i``. The probabilities are the full softmax and ``f`` counts the
  top-k of that softmax before any token is dropped.
* z-loss (ST-MoE): ``coeff * mean(logsumexp(logits) ** 2)``.
* Capacity: an expert takes at most ``ceil(tokens * topk / experts * factor)`` of the tokens.
"""

from __future__ import annotations

import math

import torch


def topk_routing(
    logits: torch.Tensor, topk: int, *, pre_softmax: bool = False, scaling_factor: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)``, both ``[tokens, experts]``: each token's weight per chosen expert
    (zero elsewhere) and which experts it goes to."""
    if pre_softmax:
        top_probs, top_indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), topk, dim=1)
    else:
        top_logits, top_indices = torch.topk(logits, topk, dim=1)
        top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    if scaling_factor:
        top_probs = top_probs * scaling_factor
    top_probs = top_probs.type_as(logits)
    probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return probs, routing_map


def routing_scores_for_aux_loss(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map, scores)`` the balancing loss is computed from: the top-k of the full softmax
    (before any dropping) and the full softmax itself."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    _, top_indices = torch.topk(scores, topk, dim=1)
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True), scores


def switch_load_balancing_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """``coeff * E * sum_i f_i P_i`` with ``f_i = tokens_per_expert_i / (T * topk)`` and
    ``P_i = sum(probs[:, i]) / T``, ``T = total_num_tokens``.

    ``probs`` may be this rank's share of the tokens and ``tokens_per_expert`` their sum over the
    ranks sharing a sequence: the loss is then this rank's share, and the shares add up to the loss
    over all the tokens.
    """
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * scale


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean(logsumexp(logits) ** 2)``: keeps the router's logits small (ST-MoE)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ``ceil(num_tokens / num_experts * capacity_factor)``."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def drop_tokens_over_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    *,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` with each expert keeping at most its capacity of tokens.

    The kept tokens are those of highest probability (``"probs"``) or the first ones
    (``"position"``). With ``pad_to_capacity`` every expert takes exactly its capacity: the map
    becomes the capacity mask, padding tokens carrying probability zero.
    """
    num_tokens, num_experts = probs.shape
    capacity = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            ranked = probs
        elif drop_policy == "position":
            ranked = routing_map.int()
        else:
            raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
        _, kept = torch.topk(ranked, k=capacity, dim=0, sorted=False)
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map

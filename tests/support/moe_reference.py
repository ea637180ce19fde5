"""Single-device references for the MoE tests, written from the papers' formulas, not from our code.

``reference_router`` computes a router's choices and losses token by token (GShard/Switch
load balancing, ST-MoE z-loss); ``reference_moe`` runs a whole MoE layer as Hugging Face's Mixtral
does (a loop over experts, ``index_add`` of weighted outputs). Both take plain weight tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.transformer import TransformerConfig


def moe_config(**overrides) -> TransformerConfig:
    """A tiny SwiGLU MoE config: 4 experts of 16, top-2, fp32, no dropout."""
    values = {
        "num_layers": 2,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "ffn_hidden_size": 24,
        "num_moe_experts": 4,
        "moe_ffn_hidden_size": 16,
        "moe_router_topk": 2,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    return TransformerConfig(**(values | overrides))


def reference_router(logits: torch.Tensor, topk: int, *, pre_softmax: bool = False):
    """Chosen experts and their weights, token by token: ``(indices [t, k], weights [t, k])``."""
    indices, weights = [], []
    for row in logits:
        chosen = torch.topk(row, topk).indices  # ties as torch.topk breaks them
        if pre_softmax:
            w = torch.exp(row[chosen]) / torch.exp(row).sum()
        else:
            w = torch.exp(row[chosen]) / torch.exp(row[chosen]).sum()
        indices.append(chosen)
        weights.append(w)
    return torch.stack(indices), torch.stack(weights)


def reference_aux_loss(logits: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """Switch/GShard: ``coeff * E * sum_i f_i P_i`` over these tokens."""
    tokens, experts = logits.shape
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.topk(scores, topk, dim=1).indices
    fraction = torch.stack([(chosen == i).any(dim=1).float().sum() for i in range(experts)]) / (tokens * topk)
    mean_prob = scores.mean(dim=0)
    return coeff * experts * (fraction * mean_prob).sum()


def reference_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return coeff * (torch.log(torch.exp(logits).sum(dim=-1)) ** 2).mean()


def reference_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor]],
    topk: int,
    *,
    pre_softmax: bool = False,
) -> torch.Tensor:
    """``[t, h]`` -> ``[t, h]``: each token through its top-k SwiGLU experts ``(W1 = [W_gate; W_up], W2)``."""
    indices, weights = reference_router(x @ router_weight.t(), topk, pre_softmax=pre_softmax)
    out = torch.zeros_like(x)
    for e, (w1, w2) in enumerate(experts):
        token, slot = torch.where(indices == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w1.t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2.t()
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out


def expert_weights(layer, num_experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(fc1, fc2)`` weights of experts ``0..num_experts-1`` of an EP=1 ``MoELayer``."""
    experts = layer.experts
    return [(experts.linear_fc1.weight[e], experts.linear_fc2.weight[e]) for e in range(num_experts)]

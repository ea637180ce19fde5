"""The mixture-of-experts fields of a transformer config (Megatron's ``TransformerConfig`` names).

A model with ``num_moe_experts`` set replaces the MLP of its MoE layers (every layer, or those
``moe_layer_freq`` picks) by a router, a token dispatcher and ``num_moe_experts`` expert MLPs, split
over ``expert_model_parallel_size`` ranks. ``core.transformer.moe.rules`` checks every combination at
construction, before any rank builds a layer or joins a collective.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Literal, get_args

from core.flags import flag

LoadBalancingType = Literal["aux_loss", "seq_aux_loss", "none"]
TokenDispatcherType = Literal["alltoall", "allgather"]
TokenDropPolicy = Literal["probs", "position"]
LOAD_BALANCING_TYPES = get_args(LoadBalancingType)
TOKEN_DISPATCHER_TYPES = get_args(TokenDispatcherType)
TOKEN_DROP_POLICIES = get_args(TokenDropPolicy)
_MOE = "mixture of experts"


@dataclass(kw_only=True)
class MoEConfig:
    """Router, experts, dispatch and load balancing of the MoE layers (all off when no experts)."""

    num_moe_experts: int | None = flag(None, name="--num-experts", group=_MOE)
    """Experts per MoE layer; None means a dense model (no MoE layer)."""

    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE layers: N means every N-th (layers 0, N, 2N, ...), a list of 0/1 per
    layer gives the pattern (Megatron's ``--moe-layer-freq``, e.g. ``([0]+[1]*23)``; that text is
    accepted too and parsed at construction)."""

    moe_ffn_hidden_size: int | None = flag(None, group=_MOE)
    """Inner size of each expert (per branch of a gated unit); None means ffn_hidden_size."""

    moe_router_topk: int = flag(2, group=_MOE)
    """Experts each token is routed to."""

    moe_router_pre_softmax: bool = flag(False, group=_MOE)
    """Softmax over all experts before the top-k (probabilities not renormalised, as Qwen2-MoE and
    DeepSeek); by default the top-k logits are picked first and their softmax taken (Mixtral)."""

    moe_router_topk_scaling_factor: float | None = flag(None, group=_MOE)
    """Multiply the routing probabilities by this (DeepSeek-V2/V3); None leaves them."""

    moe_router_load_balancing_type: LoadBalancingType = flag("aux_loss", group=_MOE)
    """Load balancing: "aux_loss" (GShard/Switch, over each microbatch's tokens), "seq_aux_loss"
    (DeepSeek-V2, per sequence, averaged) or "none"."""

    moe_aux_loss_coeff: float = flag(0.0, group=_MOE)
    """Coefficient of the load-balancing loss (1e-2 is a usual start); 0 turns it off."""

    moe_z_loss_coeff: float | None = flag(None, group=_MOE)
    """Coefficient of the router z-loss (ST-MoE: mean squared log-sum-exp of the logits); None is off."""

    moe_token_dispatcher_type: TokenDispatcherType = flag("allgather", group=_MOE)
    """How tokens reach the experts of other ranks: "alltoall" (each token goes to the ranks of its
    experts) or "allgather" (every rank sees every token of its expert-parallel group)."""

    moe_grouped_gemm: bool = flag(False, group=_MOE)
    """Run a rank's experts as one grouped matrix multiply where torch offers one for the device and
    dtype (torch._grouped_mm), a loop over experts otherwise; the same numbers either way."""

    moe_router_padding_for_quantization: bool = flag(False, group=_MOE)
    """In FP8, each expert's tokens are padded with zero rows to a multiple of 16 before each of its
    products, so that its weight gradient runs in FP8 too (CUDA's FP8 product needs the tokens a
    multiple of 16); the zero rows change no amax and no gradient. Megatron pads the routing map
    instead (extra tokens with probability 0)."""

    moe_expert_capacity_factor: float | None = flag(None, group=_MOE)
    """Each expert takes at most ceil(tokens x topk / experts x factor) of a rank's tokens, the
    rest are dropped; None is dropless."""

    moe_pad_expert_input_to_capacity: bool = flag(False, group=_MOE)
    """With a capacity factor: every expert gets exactly its capacity of tokens (padding tokens
    carry probability 0)."""

    moe_token_drop_policy: TokenDropPolicy = flag("probs", group=_MOE)
    """Which tokens an expert over capacity keeps: the highest "probs", or the first by "position"."""

    moe_shared_expert_intermediate_size: int | None = flag(None, group=_MOE)
    """Inner size of the shared experts every token goes through (Qwen2-MoE, DeepSeek); None: none."""

    moe_shared_expert_gate: bool = flag(False, group=_MOE)
    """Scale the shared experts' output by sigmoid(x . w) with a learned w (Qwen2-MoE)."""

    moe_per_layer_logging: bool = flag(False, group=_MOE)
    """Also log each layer's auxiliary losses (moe/<name>_layer_<i>) to TensorBoard and W&B."""

    def moe_layer_pattern(self, num_layers: int) -> list[bool]:
        """For each of the model's layers, whether it is an MoE layer."""
        if self.num_moe_experts is None:
            return [False] * num_layers
        if isinstance(self.moe_layer_freq, int):
            return [i % self.moe_layer_freq == 0 for i in range(num_layers)]
        return [bool(v) for v in self.moe_layer_freq]

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether decoder layer ``layer_number`` (global, 0-based) has an MoE layer for its MLP."""
        return self.moe_layer_pattern(self.num_layers)[layer_number]

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Inner size of one routed expert."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size


def parse_moe_layer_freq(value: int | str | list[int]) -> int | list[int]:
    """Megatron's ``--moe-layer-freq``: an int N, or a list expression of 0/1 per layer built from list
    literals, ``+`` and ``*`` (``"([0]+[1]*23)"``, ``"([1]*3+[0]*1)*3"``), evaluated without ``eval``."""
    if isinstance(value, (int, list)):
        return value
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        result = _pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise ValueError(
            f"moe_layer_freq {value!r} is neither an integer nor a list expression such as '([0]+[1]*23)'"
            f" ({err})"
        ) from None
    if not isinstance(result, list):
        raise ValueError(f"moe_layer_freq {value!r} must give a list of 0/1 per layer")  # noqa: TRY004
    return result


def _pattern(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        return [_pattern(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        too_long = isinstance(left, list) and isinstance(right, int) and len(left) * right > 1_000_000
        if isinstance(node.op, ast.Mult) and too_long:  # a layer pattern, not a memory bomb
            raise ValueError(f"{ast.unparse(node)!r} is longer than any model")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"only list literals of integers, + and * are allowed, not {ast.unparse(node)!r}")

"""The MoE parts of the Hugging Face mapping: Mixtral and Qwen2-MoE, whose attention is LLaMA's.

Names are the Hub's (what ``save_pretrained`` writes and every ``transformers`` release loads):

* Mixtral: ``block_sparse_moe.gate`` (the router, ``[experts, hidden]``) and per expert ``w1``
  (gate), ``w3`` (up), ``w2`` (down). Its top-k weights are renormalised to sum to one: our default
  (softmax over the top-k logits).
* Qwen2-MoE: ``mlp.gate``, per expert ``gate_proj``/``up_proj``/``down_proj``, the shared expert
  ``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate`` (``[1, hidden]``, our
  ``shared_experts.gate_weight``). ``norm_topk_prob`` False keeps the softmax over all experts
  (``moe_router_pre_softmax``); which layers are sparse comes from ``decoder_sparse_step`` and
  ``mlp_only_layers`` (our ``moe_layer_freq`` as a 0/1 list).

Our expert fc1 is ``[W_gate; W_up]``, as the dense MLP's. Checkpoints written by transformers 5 with
fused experts (``experts.gate_up_proj`` ``[E, 2F, H]``, ``experts.down_proj`` ``[E, H, F]``) are
read too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

from core.transformer.transformer_config import TransformerConfig

StateDict = Mapping[str, torch.Tensor]
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


def has_llama_blocks(config: TransformerConfig) -> bool:
    """RMSNorm, SwiGLU and RoPE over the whole head: the block LLaMA and the MoE families share."""
    return (
        config.normalization == "RMSNorm"
        and config.gated_linear_unit
        and config.activation_func is F.silu
        and config.position_embedding_type == "rope"
        and config.rotary_percent == 1.0
    )


def moe_architecture(config: TransformerConfig) -> str:
    """ "mixtral" or "qwen2_moe": the Hugging Face MoE family exactly equivalent to ``config``."""
    llama_like = (
        has_llama_blocks(config)
        and not config.rope_scaling
        and not config.add_bias_linear
        and config.moe_expert_capacity_factor is None
        and config.moe_router_topk_scaling_factor is None
    )
    pattern = config.moe_layer_pattern(config.num_layers)
    mixtral = (
        llama_like
        and all(pattern)
        and config.moe_shared_expert_intermediate_size is None
        and not config.moe_router_pre_softmax
        and not config.add_qkv_bias
    )
    if mixtral:
        return "mixtral"
    if (
        llama_like
        and config.moe_shared_expert_intermediate_size is not None
        and config.moe_shared_expert_gate
    ):
        return "qwen2_moe"
    raise ValueError(
        "this MoE TransformerConfig matches neither Hugging Face Mixtral (LLaMA with every layer MoE, "
        "top-k renormalised, no shared experts) nor Qwen2-MoE (shared experts with a sigmoid gate); both "
        "need RMSNorm, SwiGLU, full RoPE without scaling, no linear biases and dropless routing"
    )


def moe_hf_config_kwargs(config: TransformerConfig, arch: str) -> dict:
    """The MoE fields of ``MixtralConfig`` / ``Qwen2MoeConfig`` (the LLaMA ones come from the caller)."""
    common = {
        "num_experts_per_tok": config.moe_router_topk,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "output_router_logits": False,
    }
    if arch == "mixtral":
        return common | {
            "num_local_experts": config.num_moe_experts,
            "intermediate_size": config.expert_ffn_hidden_size,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    pattern = config.moe_layer_pattern(config.num_layers)
    return common | {
        "num_experts": config.num_moe_experts,
        "moe_intermediate_size": config.expert_ffn_hidden_size,
        "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "norm_topk_prob": not config.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse],
        "qkv_bias": config.add_qkv_bias,
        "use_sliding_window": False,
    }


def _prefix(arch: str, layer: int) -> str:
    return f"model.layers.{layer}." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")


def moe_layer_to_hf(
    sd: StateDict, config: TransformerConfig, layer: int, arch: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of MoE layer ``layer``'s MLP (router, experts, shared experts)."""
    src, dst = f"decoder.layers.{layer}.mlp.", _prefix(arch, layer)
    gate_name, up_name, down_name = _EXPERT_NAMES[arch]
    yield dst + "gate.weight", sd[src + "router.weight"]
    for e in range(config.num_moe_experts):
        expert = f"{src}experts.local_experts.{e}."
        gate, up = torch.chunk(sd[expert + "linear_fc1.weight"], 2, dim=0)
        yield f"{dst}experts.{e}.{gate_name}.weight", gate
        yield f"{dst}experts.{e}.{up_name}.weight", up
        yield f"{dst}experts.{e}.{down_name}.weight", sd[expert + "linear_fc2.weight"]
    if arch == "qwen2_moe":
        gate, up = torch.chunk(sd[src + "shared_experts.linear_fc1.weight"], 2, dim=0)
        yield dst + "shared_expert.gate_proj.weight", gate
        yield dst + "shared_expert.up_proj.weight", up
        yield dst + "shared_expert.down_proj.weight", sd[src + "shared_experts.linear_fc2.weight"]
        yield dst + "shared_expert_gate.weight", sd[src + "shared_experts.gate_weight"]


def moe_layer_from_hf(
    hf: StateDict, config: TransformerConfig, layer: int, arch: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors of MoE layer ``layer``'s MLP from the Hugging Face ones (Hub or fused experts)."""
    src, dst = _prefix(arch, layer), f"decoder.layers.{layer}.mlp."
    fused = f"model.layers.{layer}.mlp.experts."
    yield (
        dst + "router.weight",
        hf[src + "gate.weight" if src + "gate.weight" in hf else f"model.layers.{layer}.mlp.gate.weight"],
    )
    gate_name, up_name, down_name = _EXPERT_NAMES[arch]
    stacked = fused + "gate_up_proj" in hf
    gate_up = hf[fused + "gate_up_proj"] if stacked else None
    down = hf[fused + "down_proj"] if stacked else None
    for e in range(config.num_moe_experts):
        expert = f"{dst}experts.local_experts.{e}."
        if stacked:
            yield expert + "linear_fc1.weight", gate_up[e]
            yield expert + "linear_fc2.weight", down[e]
            continue
        theirs = f"{src}experts.{e}."
        pair = [hf[theirs + gate_name + ".weight"], hf[theirs + up_name + ".weight"]]
        yield expert + "linear_fc1.weight", torch.cat(pair)
        yield expert + "linear_fc2.weight", hf[theirs + down_name + ".weight"]
    if arch == "qwen2_moe":
        shared = src + "shared_expert."
        pair = [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]]
        yield dst + "shared_experts.linear_fc1.weight", torch.cat(pair)
        yield dst + "shared_experts.linear_fc2.weight", hf[shared + "down_proj.weight"]
        yield dst + "shared_experts.gate_weight", hf[src + "shared_expert_gate.weight"]

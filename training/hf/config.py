"""Hugging Face ``config.json`` and ``TransformerConfig``, both ways, for the LLaMA, GPT-2, Mixtral and
Qwen2-MoE families.

Export writes the classic field names (``rope_theta``, ``rope_scaling``, ``torch_dtype``) that every
``transformers`` release reads. Import reads those and the newer ``rope_parameters`` / ``dtype``,
and refuses, in one error naming the field, anything Trident would compute differently: another
``model_type``, biases on attention but not on the MLP, a RoPE scaling other than Llama-3.1's,
partial rotary embeddings in a LLaMA, an untied GPT-2, ...; never a silent change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from core.transformer.rope import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
)
from core.transformer.transformer_config import TransformerConfig, openai_gelu
from models.gpt.hf_mapping import hf_architecture, hf_config_kwargs
from models.gpt.presets import gpt2_config, llama_config

__all__ = ["HFConfigError", "hf_config_json", "transformer_config_from_hf"]

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
GPT2_ACTIVATIONS = {"gelu_new": openai_gelu, "gelu_pytorch_tanh": openai_gelu, "gelu": F.gelu}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFConfigError(ValueError):
    """A Hugging Face config Trident cannot represent; the message names the file and the field."""


def hf_config_json(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    dtype: torch.dtype,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model that computes what ``config`` computes."""
    arch = hf_architecture(config)
    fields = hf_config_kwargs(config, vocab_size, max_sequence_length)
    names = {v: k for k, v in DTYPES.items()}
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        **fields,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": names.get(dtype, "float32"),
        "use_cache": True,
    }


def _dtype(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``TransformerConfig`` precision fields for the checkpoint's dtype (fp32 when it says none)."""
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if name not in DTYPES:
        raise HFConfigError(f"{where}: torch_dtype {name!r} is not supported: use one of {sorted(DTYPES)}")
    if name == "bfloat16":
        return {"bf16": True}
    if name == "float16":
        return {"params_dtype": torch.float16, "pipeline_dtype": torch.float16}
    return {}


def _refuse(where: str, field: str, value: Any, why: str) -> HFConfigError:
    return HFConfigError(f"{where}: {field} {value!r} is not supported: {why}")


def _rope(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``rotary_base``, ``rope_scaling`` and its factor from ``rope_theta``/``rope_scaling`` or ``rope_parameters``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse(where, "partial_rotary_factor", partial, "Hugging Face LLaMA rotates whole heads")
    if kind == "default":
        return {"rotary_base": float(theta)}
    if kind != "llama3":
        raise _refuse(
            where, f"{source}.rope_type", kind, "Trident has plain RoPE and Llama-3.1's scaling ('llama3')"
        )
    fixed = {
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS,
    }
    for key, value in fixed.items():
        if params.get(key, value) != value:
            raise _refuse(
                where,
                f"{source}.{key}",
                params[key],
                f"Trident's --use-rope-scaling has Llama-3.1's {value} (only the factor may change)",
            )
    return {"rotary_base": float(theta), "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}


def _llama(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", hf["hidden_act"], "LLaMA's gated MLP is SwiGLU ('silu')")
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise _refuse(
            where,
            "attention_bias",
            attention_bias,
            f"Trident has biases on every linear layer or on none, and mlp_bias is {mlp_bias!r}",
        )
    heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "add_bias_linear": bool(attention_bias),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        **_rope(hf, where),
    }


def _moe_common(hf: Mapping[str, Any], where: str, experts: str) -> dict[str, Any]:
    """What Mixtral and Qwen2-MoE share: LLaMA's attention and norms (no linear biases), top-k routing."""
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        raise _refuse(where, "attention_bias", True, f"{hf['model_type']} has no linear biases")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", hf["model_type"] == "mixtral"):
        raise _refuse(where, "sliding_window", hf["sliding_window"], "Trident's attention is fully causal")
    if hf.get("router_jitter_noise", 0.0):
        raise _refuse(
            where, "router_jitter_noise", hf["router_jitter_noise"], "Trident's router multiplies no noise"
        )
    fields = _llama(hf | {"attention_bias": False, "mlp_bias": False}, where)
    return fields | {
        "num_moe_experts": hf[experts],
        "moe_router_topk": hf.get("num_experts_per_tok", 2),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)),
        "moe_router_load_balancing_type": "aux_loss",
    }


def _mixtral(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    fields = _moe_common(hf, where, "num_local_experts")
    return fields | {
        "moe_ffn_hidden_size": hf["intermediate_size"],
        "ffn_hidden_size": hf["intermediate_size"],
    }


def _qwen2_moe(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    fields = _moe_common(hf, where, "num_experts")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    if step < 1:
        raise _refuse(where, "decoder_sparse_step", step, "it must be >= 1")
    shared = hf.get("shared_expert_intermediate_size", 0)
    if not shared:
        raise _refuse(
            where, "shared_expert_intermediate_size", shared, "Qwen2-MoE's shared expert needs a size"
        )
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    return fields | {
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
        "moe_layer_freq": pattern if not all(pattern) else 1,
        "add_qkv_bias": bool(hf.get("qkv_bias", True)),
    }


def _gpt2(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise _refuse(where, "activation_function", activation, f"use one of {sorted(GPT2_ACTIVATIONS)}")
    if not hf.get("tie_word_embeddings", True):
        raise _refuse(
            where, "tie_word_embeddings", False, "Trident's GPT-2 ties the output layer to the word embedding"
        )
    for field, expected in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(field, expected) != expected:
            raise _refuse(where, field, hf[field], f"Trident's attention needs {field}={expected}")
    hidden = hf["n_embd"]
    return {
        "num_layers": hf["n_layer"],
        "hidden_size": hidden,
        "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
        "num_attention_heads": hf["n_head"],
        "layernorm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "activation_func": GPT2_ACTIVATIONS[activation],
        "hidden_dropout": float(hf.get("resid_pdrop", 0.1)),
        "attention_dropout": float(hf.get("attn_pdrop", 0.1)),
    }


def transformer_config_from_hf(
    hf: Mapping[str, Any], *, where: str = "config.json", **parallel: Any
) -> tuple[TransformerConfig, int, int]:
    """``(TransformerConfig, vocab_size, max_sequence_length)`` of a Hugging Face LLaMA or GPT-2 config.

    ``parallel``: the target split's fields (``tensor_model_parallel_size``, ...). Raises
    :class:`HFConfigError` naming ``where`` and the field for anything Trident cannot represent.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _refuse(
            where,
            "model_type",
            model_type,
            "Trident imports 'llama', 'gpt2', 'mixtral' and 'qwen2_moe' models",
        )
    try:
        if model_type in ("llama", "mixtral", "qwen2_moe"):
            fields = {"llama": _llama, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe}[model_type](hf, where)
            max_positions = hf.get("max_position_embeddings", 2048)
            build = llama_config
        else:
            fields = _gpt2(hf, where)
            max_positions = hf.get("n_positions", 1024)
            build = gpt2_config
        vocab_size = hf["vocab_size"]
    except KeyError as err:
        raise HFConfigError(f"{where}: the {model_type} config lacks {err.args[0]!r}") from None
    try:
        config = build(**fields, **_dtype(hf, where), **parallel)
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None
    return config, int(vocab_size), int(max_positions)

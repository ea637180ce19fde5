"""State-dict conversion between a TP=PP=1 GPTModel and Hugging Face LLaMA / GPT-2 checkpoints (and the
MoE families built on LLaMA, Mixtral and Qwen2-MoE, with :mod:`models.gpt.hf_moe_mapping`).

Pure tensor mapping (no ``transformers`` import), shared by the parity tests and the checkpoint
tools. Three layouts differ from Hugging Face's:

* QKV: one fused weight laid out per query group ``[q_0..q_{n-1}, k, v]`` (see
  ``core.transformer.attention``) vs LLaMA's separate ``q_proj``/``k_proj``/``v_proj`` and GPT-2's
  ``c_attn`` columns ``[all q | all k | all v]``;
* the gated MLP's fc1 is ``[gate; up]`` vs LLaMA's ``gate_proj``/``up_proj``;
* GPT-2's ``Conv1D`` stores weights as ``[in, out]``, the transpose of ``nn.Linear``.

The vocabulary is padded here (``config.padded_vocab_size``, zero rows) and unpadded on export.
RoPE needs no permutation: both sides use the rotate-half convention. A zero-centred norm weight
(``--apply-layernorm-1p``) is gamma - 1 here and gamma there. ``iter_to_hf`` and ``iter_from_hf``
convert one layer at a time from a possibly lazy mapping, which is how the checkpoint tools stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import einops
import torch
import torch.nn.functional as F

from core.transformer.rope import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
)
from core.transformer.transformer_config import TransformerConfig, openai_gelu
from models.gpt.hf_moe_mapping import (
    has_llama_blocks,
    moe_architecture,
    moe_hf_config_kwargs,
    moe_layer_from_hf,
    moe_layer_to_hf,
)

StateDict = Mapping[str, torch.Tensor]


LLAMA_LIKE = ("llama", "mixtral", "qwen2_moe")
"""The families whose attention, norms and (dense) MLP are LLaMA's; the MoE ones add
:mod:`models.gpt.hf_moe_mapping`."""


def hf_architecture(config: TransformerConfig) -> str:
    """ "llama", "gpt2", "mixtral" or "qwen2_moe": which Hugging Face model class ``config`` is exactly equivalent to."""
    if config.num_moe_experts is not None:
        return moe_architecture(config)
    if has_llama_blocks(config) and (config.add_bias_linear or not config.add_qkv_bias):
        return "llama"
    gpt2 = (
        config.normalization == "LayerNorm"
        and not config.gated_linear_unit
        and config.activation_func in (openai_gelu, F.gelu)
        and config.position_embedding_type == "learned_absolute"
        and config.add_bias_linear
        and not config.untie_embeddings_and_output_weights
        and config.num_query_groups == config.num_attention_heads
        and config.kv_channels * config.num_attention_heads == config.hidden_size
    )
    if gpt2:
        return "gpt2"
    raise ValueError(
        "this TransformerConfig matches neither Hugging Face LLaMA (RMSNorm, SwiGLU, full RoPE) nor "
        "GPT-2 (LayerNorm, GELU, learned positions, biases, tied embeddings, MHA)"
    )


def hf_config_kwargs(config: TransformerConfig, vocab_size: int, max_sequence_length: int) -> dict:
    """Keyword arguments for ``LlamaConfig`` / ``GPT2Config`` / ``MixtralConfig`` / ``Qwen2MoeConfig``."""
    arch = hf_architecture(config)
    if arch in ("mixtral", "qwen2_moe"):
        llama = _llama_kwargs(config, vocab_size, max_sequence_length)
        for name in ("attention_bias", "mlp_bias", "rope_scaling"):
            del llama[name]
        return llama | moe_hf_config_kwargs(config, arch)
    if arch == "llama":
        return _llama_kwargs(config, vocab_size, max_sequence_length)
    return {
        "vocab_size": vocab_size,
        "n_positions": max_sequence_length,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": None if config.ffn_hidden_size == 4 * config.hidden_size else config.ffn_hidden_size,
        "activation_function": "gelu_new" if config.activation_func is openai_gelu else "gelu",
        "layer_norm_epsilon": config.layernorm_epsilon,
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "tie_word_embeddings": True,
    }


def _llama_kwargs(config: TransformerConfig, vocab_size: int, max_sequence_length: int) -> dict:
    """``LlamaConfig``'s fields (the MoE families share them)."""
    rope_scaling = None
    if config.rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": config.rope_scaling_factor,
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS,
        }
    return {
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "max_position_embeddings": max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": config.rotary_base,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
    }


def _split_qkv(
    fused: torch.Tensor, config: TransformerConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused per-group rows -> q rows ``(heads d)``, k and v rows ``(groups d)`` (weights or biases)."""
    n = config.num_attention_heads // config.num_query_groups
    grouped = einops.rearrange(
        fused, "(g m d) ... -> g m d ...", g=config.num_query_groups, d=config.kv_channels
    )
    q = einops.rearrange(grouped[:, :n], "g n d ... -> (g n d) ...")
    k, v = (einops.rearrange(grouped[:, i], "g d ... -> (g d) ...") for i in (n, n + 1))
    return q, k, v


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Inverse of :func:`_split_qkv`."""
    g, d = config.num_query_groups, config.kv_channels
    q = einops.rearrange(q, "(g n d) ... -> g n d ...", g=g, d=d)
    k, v = (einops.rearrange(t, "(g one d) ... -> g one d ...", g=g, one=1, d=d) for t in (k, v))
    return einops.rearrange(torch.cat([q, k, v], dim=1), "g m d ... -> (g m d) ...")


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def to_hf(state_dict: StateDict, config: TransformerConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """A full (TP=PP=1) GPTModel state dict -> the Hugging Face model's state dict."""
    return dict(iter_to_hf(state_dict, config, vocab_size))


def iter_to_hf(
    source: StateDict, config: TransformerConfig, vocab_size: int, *, tied_head: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` from full GPTModel tensors, one layer at a time.

    ``source`` may be lazy (a checkpoint read on demand): each tensor is looked up when its layer
    is converted, so memory stays near one layer. ``lm_head.weight`` comes last; with tied
    embeddings only if ``tied_head`` (a state dict has it, a saved Hugging Face model does not).
    """
    arch = hf_architecture(config)
    llama = arch in LLAMA_LIKE
    prefix = "model." if llama else "transformer."
    word = "embedding.word_embeddings.weight"
    yield prefix + ("embed_tokens.weight" if llama else "wte.weight"), source[word][:vocab_size].contiguous()
    if not llama:
        yield "transformer.wpe.weight", source["embedding.position_embeddings.weight"].contiguous()
    for i in range(config.num_layers):
        yield from _layer_to_hf(source, config, i, arch)
    final = "decoder.final_layernorm."
    yield prefix + ("norm.weight" if llama else "ln_f.weight"), _gamma_to_hf(source[final + "weight"], config)
    if not llama:
        yield "transformer.ln_f.bias", source[final + "bias"].contiguous()
    if config.untie_embeddings_and_output_weights:
        yield "lm_head.weight", source["output_layer.weight"][:vocab_size].contiguous()
    elif tied_head:
        yield "lm_head.weight", source[word][:vocab_size].contiguous()


def _gamma_to_hf(weight: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """A norm weight as Hugging Face stores it: gamma itself, not gamma - 1 (``--apply-layernorm-1p``)."""
    return (weight + 1 if config.layernorm_zero_centered_gamma else weight).contiguous()


def _gamma_from_hf(weight: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    return (weight - 1 if config.layernorm_zero_centered_gamma else weight).contiguous()


def _layer_to_hf(
    sd: StateDict, config: TransformerConfig, i: int, arch: str
) -> Iterator[tuple[str, torch.Tensor]]:
    llama = arch in LLAMA_LIKE
    src = f"decoder.layers.{i}."
    dst = f"model.layers.{i}." if llama else f"transformer.h.{i}."
    out: dict[str, torch.Tensor] = {}
    if config.num_moe_experts is not None and config.is_moe_layer(i):
        out.update(moe_layer_to_hf(sd, config, i, arch))
    out.update(_one_to_one(sd, config, src, dst, llama, to_hf=True))
    q, k, v = _split_qkv(sd[src + "self_attention.linear_qkv.weight"], config)
    fc1 = sd.get(src + "mlp.linear_fc1.weight")  # None in an MoE layer
    if llama:
        out.update(
            {
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
            }
        )
        if src + "self_attention.linear_qkv.bias" in sd:
            biases = _split_qkv(sd[src + "self_attention.linear_qkv.bias"], config)
            out.update({dst + f"self_attn.{p}_proj.bias": b for p, b in zip("qkv", biases)})
        if fc1 is not None:
            gate, up = torch.chunk(fc1, 2, dim=0)
            out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up})
        if src + "mlp.linear_fc1.bias" in sd:
            gate_b, up_b = torch.chunk(sd[src + "mlp.linear_fc1.bias"], 2)
            out.update({dst + "mlp.gate_proj.bias": gate_b, dst + "mlp.up_proj.bias": up_b})
    else:
        out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
        out[dst + "attn.c_attn.bias"] = torch.cat(
            _split_qkv(sd[src + "self_attention.linear_qkv.bias"], config)
        )
        out[dst + "mlp.c_fc.weight"] = fc1.t()
        out[dst + "mlp.c_fc.bias"] = sd[src + "mlp.linear_fc1.bias"]
    for name, value in out.items():
        yield name, value.contiguous()


def _one_to_one(
    sd: StateDict, config: TransformerConfig, src: str, dst: str, llama: bool, *, to_hf: bool
) -> dict[str, torch.Tensor]:
    """A layer's modules that map one to one, either way: renamed, a norm weight moved between gamma
    and gamma - 1, a GPT-2 ``Conv1D`` weight transposed."""
    out = {}
    for ours, theirs in _per_layer_names(llama):
        read, write = (ours, theirs) if to_hf else (theirs, ours)
        for suffix in ("weight", "bias"):
            if src + read + "." + suffix not in sd:
                continue
            value = sd[src + read + "." + suffix]
            if suffix == "weight" and ours.endswith("layernorm"):
                value = (_gamma_to_hf if to_hf else _gamma_from_hf)(value, config)
            elif suffix == "weight" and not llama and theirs.endswith("c_proj"):
                value = value.t()
            out[dst + write + "." + suffix] = value
    return out


def _per_layer_names(llama: bool) -> list[tuple[str, str]]:
    """``(ours, Hugging Face's)`` names of the modules whose weight and bias map one to one."""
    if llama:
        return [
            ("input_layernorm", "input_layernorm"),
            ("pre_mlp_layernorm", "post_attention_layernorm"),
            ("self_attention.linear_proj", "self_attn.o_proj"),
            ("mlp.linear_fc2", "mlp.down_proj"),
        ]
    return [
        ("input_layernorm", "ln_1"),
        ("pre_mlp_layernorm", "ln_2"),
        ("self_attention.linear_proj", "attn.c_proj"),
        ("mlp.linear_fc2", "mlp.c_proj"),
    ]


def from_hf(hf_state_dict: StateDict, config: TransformerConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """A Hugging Face LLaMA / GPT-2 state dict -> a full (TP=PP=1) GPTModel state dict (vocabulary padded)."""
    padded = config.padded_vocab_size(vocab_size)
    out = dict(iter_from_hf(hf_state_dict, config))
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            out[name] = _pad_rows(out[name], padded)
    return out


def iter_from_hf(source: StateDict, config: TransformerConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(GPTModel name, full tensor)`` from Hugging Face tensors, one layer at a time, vocabulary unpadded.

    ``source`` may be lazy (safetensors files read on demand). A tied model (GPT-2, or LLaMA with
    ``tie_word_embeddings``) needs no ``lm_head.weight``; an untied one takes it, or the embedding
    when the checkpoint leaves it out.
    """
    arch = hf_architecture(config)
    llama = arch in LLAMA_LIKE
    prefix = "model." if llama else "transformer."
    embedding_name = prefix + ("embed_tokens.weight" if llama else "wte.weight")
    yield "embedding.word_embeddings.weight", source[embedding_name].contiguous()
    if not llama:
        yield "embedding.position_embeddings.weight", source["transformer.wpe.weight"].contiguous()
    for i in range(config.num_layers):
        yield from _layer_from_hf(source, config, i, arch)
    norm = source[prefix + ("norm.weight" if llama else "ln_f.weight")]
    yield "decoder.final_layernorm.weight", _gamma_from_hf(norm, config)
    if not llama:
        yield "decoder.final_layernorm.bias", source["transformer.ln_f.bias"].contiguous()
    if config.untie_embeddings_and_output_weights:
        head = source["lm_head.weight"] if "lm_head.weight" in source else source[embedding_name]
        yield "output_layer.weight", head.contiguous()


def _layer_from_hf(
    hf: StateDict, config: TransformerConfig, i: int, arch: str
) -> Iterator[tuple[str, torch.Tensor]]:
    llama = arch in LLAMA_LIKE
    src = f"model.layers.{i}." if llama else f"transformer.h.{i}."
    dst = f"decoder.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    moe = config.num_moe_experts is not None and config.is_moe_layer(i)
    if moe:
        out.update(moe_layer_from_hf(hf, config, i, arch))
    out.update(_one_to_one(hf, config, src, dst, llama, to_hf=False))
    if llama:
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            *(hf[attn + f"{p}_proj.weight"] for p in "qkv"), config
        )
        if attn + "q_proj.bias" in hf:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                *(hf[attn + f"{p}_proj.bias"] for p in "qkv"), config
            )
        if not moe:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
            )
        if src + "mlp.gate_proj.bias" in hf:
            out[dst + "mlp.linear_fc1.bias"] = torch.cat(
                [hf[src + "mlp.gate_proj.bias"], hf[src + "mlp.up_proj.bias"]]
            )
    else:
        q, k, v = torch.chunk(hf[src + "attn.c_attn.weight"].t(), 3, dim=0)
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(q, k, v, config)
        out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
            *torch.chunk(hf[src + "attn.c_attn.bias"], 3), config
        )
        out[dst + "mlp.linear_fc1.weight"] = hf[src + "mlp.c_fc.weight"].t()
        out[dst + "mlp.linear_fc1.bias"] = hf[src + "mlp.c_fc.bias"]
    for name, value in out.items():
        yield name, value.contiguous()

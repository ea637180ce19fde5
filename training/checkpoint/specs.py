"""Tensor specs from a model: what the checkpoint records about every parameter and optimizer state.

A parameter's TP split comes from Megatron's attributes on it (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``); a vocabulary-padded weight is recognised by
``init_valid_rows`` (only the first rows are real, see ``core.transformer.initialization``) and
recorded with its unpadded size and the padding rule; its place in the pipeline comes from its
name (``models.gpt.gpt_model.layout_owner``), and so does an MoE expert's global index
(``expert_of``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from core.device import building_on
from core.tensor_parallel import param_is_tensor_parallel
from core.transformer.initialization import logical_tensors
from models.gpt.gpt_model import OUTPUT_WEIGHT, WORD_EMBEDDINGS, GPTModel, expert_of, layout_owner
from training.checkpoint.format import (
    CheckpointError,
    Partition,
    TensorSpec,
    canonical_order,
)

__all__ = ["gpt_tensor_specs", "param_spec", "tied_tensors"]


def param_spec(name: str, param: torch.Tensor, tp_size: int, pad_multiple: int) -> TensorSpec:
    """The spec of a (possibly TP-sharded) parameter as this rank holds it."""
    shape = list(param.shape)
    partition = None
    if param_is_tensor_parallel(param):
        dim = param.partition_dim % param.dim()
        valid = getattr(param, "init_valid_rows", None)
        if valid is not None and dim == 0:
            partition = Partition(dim, getattr(param, "partition_stride", 1), pad_multiple)
            if partition.padded(valid, tp_size) != shape[0] * tp_size:
                raise CheckpointError(
                    f"parameter '{name}' has {shape[0] * tp_size} rows over {tp_size} TP ranks, but "
                    f"{valid} real rows padded to a multiple of {pad_multiple} x {tp_size} make "
                    f"{partition.padded(valid, tp_size)}"
                )
            shape[0] = valid
        else:
            partition = Partition(dim, getattr(param, "partition_stride", 1))
            shape[dim] *= tp_size
    return TensorSpec(tuple(shape), param.dtype, partition, layout_owner(name), expert_of(name))


def tied_tensors(untie_embeddings_and_output_weights: bool) -> dict[str, dict[str, Any]]:
    """The manifest's ``tied`` map: the output layer repeats the word embedding unless untied."""
    if untie_embeddings_and_output_weights:
        return {}
    return {OUTPUT_WEIGHT: {"source": WORD_EMBEDDINGS, "owner": layout_owner(OUTPUT_WEIGHT)}}


def specs_of_params(
    named_params: Iterable[tuple[str, torch.Tensor]], tp_size: int, pad_multiple: int
) -> dict[str, TensorSpec]:
    return {name: param_spec(name, p, tp_size, pad_multiple) for name, p in named_params}


def gpt_tensor_specs(
    config, vocab_size: int, max_sequence_length: int
) -> tuple[dict[str, TensorSpec], dict[str, dict[str, Any]]]:
    """Specs (in the order files store them, :func:`canonical_order`) and tied map of a GPTModel, without a process group.

    Builds the single-device model on the meta device (shapes and dtypes, no memory: on a GPU host
    an 8B model would otherwise land on ``cuda:0``) and reads its parameters; this is how an importer
    learns every tensor a checkpoint must hold.
    """
    single = dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        pipeline_model_parallel_layout=None,
        perform_initialization=False,
        sequence_parallel=False,
    )
    with building_on("meta"):
        model = GPTModel(single, vocab_size, max_sequence_length)
    specs = specs_of_params(logical_tensors(model.named_parameters()), 1, config.make_vocab_size_divisible_by)
    order = canonical_order(specs, lambda name: specs[name].owner)
    return {name: specs[name] for name in order}, tied_tensors(config.untie_embeddings_and_output_weights)


def check_same_model(saved: Mapping[str, Any], ours: Mapping[str, Any], where: str) -> None:
    """Raise naming every architecture field where two ``TransformerConfig.to_dict()`` differ."""
    fields = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "kv_channels",
        "normalization",
        "layernorm_epsilon",
        "activation_func",
        "gated_linear_unit",
        "add_bias_linear",
        "add_qkv_bias",
        "position_embedding_type",
        "rotary_base",
        "rotary_percent",
        "rope_scaling",
        "rope_scaling_factor",
        "layernorm_zero_centered_gamma",
        "untie_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_layer_freq",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
    )
    diffs = [
        f"{f} is {saved[f]!r} in the checkpoint but {ours[f]!r} here"
        for f in fields
        if f in saved and f in ours and saved[f] != ours[f]
    ]
    if diffs:
        raise CheckpointError(f"checkpoint {where} holds a different model: " + "; ".join(diffs))

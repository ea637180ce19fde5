"""What a mixture of experts refuses, stated once for the config, the command line and the layer.

``TransformerConfig`` reports these problems with its field names, ``training.arguments.checks`` with
Megatron's flags. Two rules need more than the config: the world size (given by the command line;
``core.parallel_state`` checks the groups themselves) and training (the layer checks it as it runs).
"""

from __future__ import annotations

from typing import Any

from core.model_parallel_config import expert_tensor_parallel_problems
from core.problems import Problem, problem
from core.transformer.moe.moe_config import (
    LOAD_BALANCING_TYPES,
    TOKEN_DISPATCHER_TYPES,
    TOKEN_DROP_POLICIES,
    parse_moe_layer_freq,
)

_EP = ("expert_model_parallel_size", "num_moe_experts")


def moe_problems(config: Any, *, world_size: int | None = None, training: bool = False) -> list[Problem]:
    """The invalid MoE settings of ``config`` (a transformer config's fields), first first.

    With ``world_size``, also whether the expert-parallel groups can be formed; with ``training``,
    what training needs besides (:func:`moe_training_problems`).
    """
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    if experts is None:
        if ep == 1:
            return []
        return [
            problem(
                "{expert_model_parallel_size} {ep} needs {num_moe_experts} (a model with experts)",
                *_EP,
                ep=ep,
            )
        ]
    if experts < 1:
        return [problem("{num_moe_experts} must be >= 1, got {experts}", "num_moe_experts", experts=experts)]
    out = _parallel_problems(config, world_size) + _router_problems(config)
    out += moe_training_problems(config) if training else []
    return out + _layer_freq_problems(config) + _size_problems(config) + _choice_problems(config)


def moe_training_problems(config: Any) -> list[Problem]:
    """What training an MoE model needs besides: with TP, each rank routes its own sequence shard."""
    tp = config.tensor_model_parallel_size
    if config.num_moe_experts is None or tp == 1 or config.sequence_parallel:
        return []
    return [
        problem(
            "{num_moe_experts} with {tensor_model_parallel_size} {tp} needs {sequence_parallel}: each "
            "tensor-parallel rank routes its own sequence shard (as in Megatron)",
            "num_moe_experts",
            "tensor_model_parallel_size",
            "sequence_parallel",
            tp=tp,
        )
    ]


def _parallel_problems(config: Any, world_size: int | None) -> list[Problem]:
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    out = expert_tensor_parallel_problems(config)
    if experts % ep:
        out.append(
            problem(
                "{num_moe_experts} ({experts}) must be divisible by {expert_model_parallel_size} ({ep})",
                *_EP,
                experts=experts,
                ep=ep,
            )
        )
    pp = config.pipeline_model_parallel_size
    if world_size is not None and world_size % (ep * pp):
        out.append(
            problem(
                "{expert_model_parallel_size} ({ep}) x {pipeline_model_parallel_size} ({pp}) = {product} "
                "does not divide the world size ({world_size}): the {dispatcher} dispatcher's "
                "expert-parallel groups cannot be formed",
                "expert_model_parallel_size",
                "pipeline_model_parallel_size",
                ep=ep,
                pp=pp,
                product=ep * pp,
                world_size=world_size,
                dispatcher=config.moe_token_dispatcher_type,
            )
        )
    return out


def _router_problems(config: Any) -> list[Problem]:
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if not 1 <= topk <= experts:
        return [
            problem(
                "{moe_router_topk} ({topk}) must be between 1 and {num_moe_experts} ({experts})",
                "moe_router_topk",
                "num_moe_experts",
                topk=topk,
                experts=experts,
            )
        ]
    if topk == 1 and not config.moe_router_pre_softmax:
        return [
            problem(
                "{moe_router_topk} 1 needs {moe_router_pre_softmax}: a softmax over one logit is 1 and gives "
                "the router no gradient",
                "moe_router_topk",
                "moe_router_pre_softmax",
            )
        ]
    return []


def _layer_freq_problems(config: Any) -> list[Problem]:
    """``moe_layer_freq`` as given (Megatron's text, an int or a list) against ``num_layers``."""
    given, layers = config.moe_layer_freq, config.num_layers
    try:
        freq = parse_moe_layer_freq(given)
    except ValueError as err:
        return [problem("{moe_layer_freq}: {err}", "moe_layer_freq", err=err)]
    either = (
        "{moe_layer_freq} {given} must be an integer >= 1 or list 0 or 1 for each of the {layers} layers "
        "({num_layers})"
    )
    fields, values = ("moe_layer_freq", "num_layers"), {"given": given, "layers": layers}
    if isinstance(freq, int):
        return [] if freq >= 1 else [problem(either, *fields, **values)]
    if len(freq) != layers or any(v not in (0, 1) for v in freq):
        listed = "{moe_layer_freq} {given} must list 0 or 1 for each of the {layers} layers"
        return [problem(listed, *fields, command_line=either, **values)]
    return []


def _size_problems(config: Any) -> list[Problem]:
    out = []
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(config, name)
        if value is not None and value < 1:
            out.append(problem(f"{{{name}}} must be >= 1 or None, got {{value}}", name, value=value))
    shared, tp = config.moe_shared_expert_intermediate_size, config.tensor_model_parallel_size
    if shared is not None and shared >= 1 and shared % tp:
        out.append(
            problem(
                "{moe_shared_expert_intermediate_size} ({shared}) must be divisible by "
                "{tensor_model_parallel_size} ({tp})",
                "moe_shared_expert_intermediate_size",
                "tensor_model_parallel_size",
                shared=shared,
                tp=tp,
            )
        )
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        out.append(
            problem(
                "{moe_expert_capacity_factor} must be > 0 or None, got {factor}",
                "moe_expert_capacity_factor",
                factor=factor,
            )
        )
    if config.moe_pad_expert_input_to_capacity and factor is None:
        out.append(
            problem(
                "{moe_pad_expert_input_to_capacity} needs {moe_expert_capacity_factor}",
                "moe_pad_expert_input_to_capacity",
                "moe_expert_capacity_factor",
            )
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(config, name)
        if value is not None and value < 0:
            out.append(problem(f"{{{name}}} must be >= 0, got {{value}}", name, value=value))
    return out


def _choice_problems(config: Any) -> list[Problem]:
    out = []
    for name, choices in (
        ("moe_router_load_balancing_type", LOAD_BALANCING_TYPES),
        ("moe_token_dispatcher_type", TOKEN_DISPATCHER_TYPES),
        ("moe_token_drop_policy", TOKEN_DROP_POLICIES),
    ):
        value = getattr(config, name)
        if value not in choices:
            out.append(
                problem(
                    f"{{{name}}} must be one of {{choices}}, got {{value!r}}",
                    name,
                    choices=choices,
                    value=value,
                )
            )
    return out

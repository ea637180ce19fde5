"""What context parallelism refuses, stated once for the config and the command line.

``TransformerConfig`` reports these problems with its field names, ``training.arguments.checks`` with
Megatron's flags. Rules that need a value outside the config (the sequence length, a ``GPTModel``
argument) are checked where it is given.
"""

from __future__ import annotations

from typing import Any

from core.problems import Problem, problem

CP_COMM_TYPES = ("p2p", "a2a", "allgather")
"""The ``--cp-comm-type`` values Trident implements (Megatron's ``a2a+p2p`` is not one of them)."""


def context_parallel_problems(config: Any, *, seq_length: int | None = None) -> list[Problem]:
    """The invalid context-parallel settings of ``config`` (a transformer config's fields), first first.

    With ``seq_length``, also the sequence cuts context parallelism needs.
    """
    types, cp = config.cp_comm_type, config.context_parallel_size
    if "a2a+p2p" in types:
        return [
            problem(
                "{cp_comm_type} a2a+p2p: Trident does not support hierarchical context parallelism "
                "(all-to-all inside a node, ring across nodes); use p2p, a2a or allgather",
                "cp_comm_type",
            )
        ]
    unknown = [t for t in types if t not in CP_COMM_TYPES]
    if unknown:
        return [
            problem(
                "{cp_comm_type} must be one of {types}, got {value!r}",
                "cp_comm_type",
                command_line="{cp_comm_type} {value}: must be one of {listed}",
                types=CP_COMM_TYPES,
                listed=", ".join(CP_COMM_TYPES),
                value=unknown[0],
            )
        ]
    if len(types) not in (1, config.num_layers):
        return [
            problem(
                "{cp_comm_type} gives {count} types for {layers} layers; give one or one per layer",
                "cp_comm_type",
                count=len(types),
                layers=config.num_layers,
            )
        ]
    if cp == 1:
        return []
    return _sequence_problems(config, seq_length) + _head_problems(config)


def _sequence_problems(config: Any, seq: int | None) -> list[Problem]:
    cp, tp = config.context_parallel_size, config.tensor_model_parallel_size
    if seq is None:
        return []
    if seq % (2 * cp):
        return [
            problem(
                "{seq_length} ({seq}) must be divisible by 2 x {context_parallel_size} ({cp}) = {chunks}: "
                "each sequence is cut into that many equal chunks",
                "seq_length",
                "context_parallel_size",
                seq=seq,
                cp=cp,
                chunks=2 * cp,
            )
        ]
    if config.sequence_parallel and seq % (cp * tp):
        return [
            problem(
                "{seq_length} ({seq}) must be divisible by {context_parallel_size} ({cp}) x "
                "{tensor_model_parallel_size} ({tp}) = {shards} with {sequence_parallel}",
                "seq_length",
                "context_parallel_size",
                "tensor_model_parallel_size",
                "sequence_parallel",
                seq=seq,
                cp=cp,
                tp=tp,
                shards=cp * tp,
            )
        ]
    return []


def _head_problems(config: Any) -> list[Problem]:
    cp, tp = config.context_parallel_size, config.tensor_model_parallel_size
    heads, groups = config.num_attention_heads, config.num_query_groups
    if "a2a" not in config.cp_comm_type or (heads // tp) % cp == 0 and (groups // tp) % cp == 0:
        return []
    return [
        problem(
            "{cp_comm_type} a2a splits heads over the context-parallel ranks: "
            "{num_attention_heads} ({heads}) and the query groups ({groups}) per "
            "{tensor_model_parallel_size} ({tp}) rank must be divisible by {context_parallel_size} ({cp})",
            "cp_comm_type",
            "num_attention_heads",
            "tensor_model_parallel_size",
            "context_parallel_size",
            heads=heads,
            groups=groups,
            tp=tp,
            cp=cp,
        )
    ]

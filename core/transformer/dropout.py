"""Dropout that draws from the right random stream for how the activation is laid out over TP.

A replicated activation (hidden states without sequence parallelism) must get the same mask on
every TP rank, or the replicas drift apart: it uses the default generator, which
``model_parallel_seed`` seeds identically across the TP group. A sharded activation (attention
probabilities split by head, hidden states split by sequence) must get independent masks per
rank: it draws from the tracker's per-rank stream (Megatron's ``get_cuda_rng_tracker().fork()``).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F

from core.tensor_parallel import get_rng_tracker, tp_world_size


def sharded_rng() -> AbstractContextManager:
    """Context in which random ops draw from this TP rank's private stream.

    Without a seeded tracker a single TP rank falls back to the default generator (a plain
    single-process run needs no ``model_parallel_seed``); several TP ranks cannot, since their
    masks would then be correlated.
    """
    tracker = get_rng_tracker()
    if tracker.is_initialized():
        return tracker.fork()
    if tp_world_size() > 1:
        raise RuntimeError(
            "dropout on tensor-parallel activations needs the model-parallel RNG tracker; "
            "call core.tensor_parallel.model_parallel_seed(seed) on every rank first"
        )
    return contextlib.nullcontext()


def dropout(x: torch.Tensor, p: float, training: bool, *, sharded: bool) -> torch.Tensor:
    """``F.dropout`` from the stream that matches the activation's layout (identity when off)."""
    if p == 0.0 or not training:
        return x
    with sharded_rng() if sharded else contextlib.nullcontext():
        return F.dropout(x, p, training=True)

"""RNG states of a run, as a checkpoint stores them: Python, numpy, torch (CPU and CUDA) and the TP tracker.

Restoring them makes the next draws repeat exactly, so a resumed run with dropout on logs the
uninterrupted run's losses.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from core.tensor_parallel import get_rng_tracker

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """Python ``random``, numpy, torch CPU (and CUDA when present) and the tensor-parallel tracker states."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "random": [version, list(keys), gauss],
        "numpy": [name, np_keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch_cpu": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned, so the next draws repeat exactly."""
    version, keys, gauss = state["random"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    get_rng_tracker().set_states(state["tracker"])

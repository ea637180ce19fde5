"""The one place that decides backend and device: NCCL/CUDA when GPUs are present, gloo/CPU otherwise."""

from __future__ import annotations

import os

import torch


def default_backend() -> str:
    """Process-group backend for this hardware (``TRIDENT_BACKEND`` overrides it)."""
    override = os.environ.get("TRIDENT_BACKEND")
    if override:
        return override
    return "nccl" if torch.cuda.is_available() else "gloo"


def current_device() -> torch.device:
    """Device this process computes on: its local GPU under NCCL, the CPU otherwise."""
    if default_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_local_device() -> None:
    """Pin this process to ``LOCAL_RANK``'s GPU when there are GPUs; a no-op on CPU."""
    if default_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

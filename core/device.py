"""The one place that decides backend and device: NCCL/CUDA when GPUs are present, gloo/CPU otherwise.

``--distributed-backend`` (``select_backend``) can ask for one: ``gloo`` computes on the CPU even
where GPUs exist, and ``nccl`` on a machine without CUDA falls back to gloo with one warning, so a
GPU cluster's launch script also runs on a laptop. ``TRIDENT_BACKEND`` overrides both.
"""

from __future__ import annotations

import os
import sys

import torch

_requested: str | None = None


def select_backend(requested: str | None) -> str:
    """Use ``requested`` (``"nccl"``, ``"gloo"`` or None for the hardware's choice) from now on in this
    process; returns the backend that will be used. Call it before creating process groups."""
    global _requested
    _requested = requested
    backend = default_backend()
    if requested == "nccl" and backend != "nccl" and os.environ.get("RANK", "0") == "0":
        print(
            "WARNING: --distributed-backend nccl needs CUDA, which this machine does not have: using gloo",
            file=sys.stderr,
            flush=True,
        )
    return backend


def default_backend() -> str:
    """Process-group backend for this hardware and request (``TRIDENT_BACKEND`` overrides it)."""
    override = os.environ.get("TRIDENT_BACKEND")
    if override:
        return override
    if _requested == "gloo" or not torch.cuda.is_available():
        return "gloo"
    return "nccl"


def current_device() -> torch.device:
    """Device this process computes on: its local GPU under NCCL, the CPU otherwise."""
    if default_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_local_device() -> None:
    """Pin this process to ``LOCAL_RANK``'s GPU when there are GPUs; a no-op on CPU."""
    if default_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

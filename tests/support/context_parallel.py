"""What the context-parallel tests share (one process in tests/unit, real ranks in tests/dist): the
tolerance against full attention and the relative error."""

from __future__ import annotations

import torch

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return ((a - b).norm() / b.norm()).item()

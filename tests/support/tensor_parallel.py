"""What the tensor-parallel tests share (one process in tests/unit, two ranks in tests/dist): the
tolerance and the relative-error check against single-device torch."""

from __future__ import annotations

import torch

TOL = 1e-6


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    """``|actual - expected| / |expected| <= tol`` (Frobenius norms); ``what`` names the tensor in a failure."""
    err = ((actual.detach() - expected.detach()).norm() / expected.detach().norm()).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"

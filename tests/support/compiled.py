"""A model built with ``compile=True`` against its eager twin: the same loss and gradients on one batch."""

from __future__ import annotations

import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return float((a - b).detach().norm() / b.detach().norm())


def assert_compiled_matches_eager(
    models: dict[bool, torch.nn.Module], tokens: torch.Tensor, where: object
) -> None:
    """One forward and backward of ``models[False]`` (eager) and ``models[True]`` (compiled) on ``tokens``
    (labels: the tokens rolled by one); the losses and every gradient agree within 1e-6 relative.
    ``where`` names the batch in a failure."""
    results = {}
    for compiled, model in models.items():
        model.zero_grad(set_to_none=True)
        loss = model(tokens, labels=tokens.roll(1, 1)).mean()
        loss.backward()
        results[compiled] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert relative_error(results[True][0], results[False][0]) <= 1e-6, where
    for name, grad in results[False][1].items():
        assert relative_error(results[True][1][name], grad) <= 1e-6, (where, name)

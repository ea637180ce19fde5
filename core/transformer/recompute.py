"""Activation recomputation that replays dropout exactly, tensor-parallel RNG stream included.

``torch.utils.checkpoint`` (non-reentrant, ``preserve_rng_state=True``) saves the default
generator's state at the forward and restores it for the recomputation, so default-stream dropout
masks repeat. The model-parallel RNG tracker keeps its own named states outside the generator;
they advance during the forward, so a recomputation would otherwise draw fresh attention-dropout
masks and silently compute a different gradient. :func:`checkpoint` snapshots the tracker's
states when the forward runs, swaps the snapshot in for the recomputation and puts the current
states back afterwards, so the recomputation neither diverges nor disturbs later draws.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from core.tensor_parallel import get_rng_tracker


@contextlib.contextmanager
def _remember_tracker(store: dict) -> Iterator[None]:
    store["states"] = get_rng_tracker().get_states()
    yield


_RECOMPUTING = [0]  # recomputations under way (nested checkpoints count each)


def is_recomputing() -> bool:
    """Whether the forward now running is a recomputation inside backward (its side effects, such as
    recording a router's auxiliary losses for the log, already happened in the first forward)."""
    return _RECOMPUTING[0] > 0


class _ReplayTracker:
    """Swaps the forward's tracker states in for a recomputation. Re-enterable: a second backward over
    the same graph (the zero-bubble weight-gradient pass) recomputes again."""

    def __init__(self, store: dict) -> None:
        self.store, self.saved = store, []

    def __enter__(self) -> None:
        tracker = get_rng_tracker()
        self.saved.append(tracker.get_states())
        tracker.set_states(self.store["states"])
        _RECOMPUTING[0] += 1

    def __exit__(self, *exc: object) -> None:
        _RECOMPUTING[0] -= 1
        get_rng_tracker().set_states(self.saved.pop())


def _replay_tracker(store: dict) -> _ReplayTracker:
    return _ReplayTracker(store)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` without keeping its intermediate activations; they are recomputed in backward.

    Outside autograd (``torch.no_grad``, evaluation) it simply calls ``function``.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    store: dict = {}
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (_remember_tracker(store), _replay_tracker(store)),
    )

"""Agreement on a step that may fail on some ranks only: every rank fails if any did."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from core.device import current_device
from training.errors import PeerFailure

T = TypeVar("T")


def agree(step: Callable[[], T] | None) -> T | None:
    """Run ``step`` (None: nothing to run on this rank), then fail every rank if it failed on any.

    The failing rank raises its own error; the others raise :class:`PeerFailure`, which ends them
    quietly. One small all-reduce; call it on every rank.
    """
    result, error = None, None
    if step is not None:
        try:
            result = step()
        except Exception as err:  # noqa: BLE001 -- re-raised below, after every rank knows
            error = err
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        first = torch.tensor([dist.get_rank() if error is not None else world], device=current_device())
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        failed = int(first.item())
        if failed < world and error is None:
            raise PeerFailure(f"rank {failed} failed and reported why")
    if error is not None:
        raise error
    return result

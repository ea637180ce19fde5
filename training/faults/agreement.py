"""What the ranks of a job agree on: a step that fails on some ranks fails on all, before any rank
waits in a collective for one that gave up.

Every helper is one small collective that every rank of ``group`` calls (default: the whole job); in
a world of one each is a plain return. Their tensors live where ``group``'s backend wants them: the
CPU for gloo (an asynchronous save agrees over a gloo group of its own, which never waits for the
GPU), this rank's device otherwise.

* :func:`fail_together` runs a step, then fails every rank if it failed on any: the failing rank
  raises its own error, the others :class:`~training.errors.PeerFailure`, which ends them quietly.
* :func:`raise_first_error` raises the lowest failing rank's message on every rank, as one error type
  (the checkpoint's ``CheckpointError``): every rank then says why.
* :func:`everyone` (all done, any failed), :func:`gather` and :func:`sum_over_ranks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from core.device import current_device
from training.errors import PeerFailure

__all__ = ["distributed", "everyone", "fail_together", "gather", "raise_first_error", "sum_over_ranks"]

T = TypeVar("T")


def distributed() -> bool:
    """Whether a process group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device(group) -> torch.device:
    """Where a collective's tensors live on ``group``: the CPU for gloo, this rank's device otherwise."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else current_device()


def _first_failing(failed: bool, group) -> int:
    """The lowest rank (of the job) that failed, or the world size if none did."""
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if failed else world], device=_device(group))
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    return int(first.item())


def fail_together(step: Callable[[], T] | None, group=None) -> T | None:
    """Run ``step`` (None: nothing to run on this rank), then fail every rank if it failed on any.

    The failing rank raises its own error; the others raise :class:`PeerFailure`.
    """
    result, error = None, None
    if step is not None:
        try:
            result = step()
        except Exception as err:  # noqa: BLE001 -- re-raised below, after every rank knows
            error = err
    if distributed():
        failed = _first_failing(error is not None, group)
        if failed < dist.get_world_size() and error is None:
            raise PeerFailure(f"rank {failed} failed and reported why")
    if error is not None:
        raise error
    return result


def raise_first_error(error: str | None, group=None, *, error_type: type[Exception] = RuntimeError) -> None:
    """Raise ``error_type`` on every rank if any rank failed, with the lowest failing rank's message
    (prefixed ``rank N:`` where this rank did not hit the same problem). ``error``: this rank's
    message, or None. Doubles as a barrier."""
    if not distributed():
        if error:
            raise error_type(error)
        return
    src = _first_failing(bool(error), group)
    if src == dist.get_world_size():
        return
    device = _device(group)
    data = torch.tensor(list((error or "").encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], device=device)
    dist.broadcast(length, src, group=group)
    mine = dist.get_rank() == src
    buf = data if mine else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    message = bytes(buf.cpu().tolist()).decode()
    raise error_type(message if mine or error == message else f"rank {src}: {message}")


def everyone(done: bool, failed: bool, group=None) -> tuple[bool, bool]:
    """(``done`` on every rank, ``failed`` on any rank)."""
    if not distributed():
        return done, failed
    flags = torch.tensor([int(not done), int(failed)], device=_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    not_done, any_failed = flags.tolist()
    return not not_done, bool(any_failed)


def gather(value: Any, group=None) -> list[Any]:
    """``value`` of every rank of ``group``, in rank order (picklable values)."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def sum_over_ranks(value: int, group=None) -> int:
    """``value`` summed over every rank of ``group``."""
    if not distributed():
        return value
    total = torch.tensor([value], device=_device(group))
    dist.all_reduce(total, group=group)
    return int(total.item())

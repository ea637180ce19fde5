"""What the ranks of a job agree on around a checkpoint: who failed, what each wrote, where each sits.

A checkpoint is written by every rank and committed by one, so every step that can fail on some
ranks ends in :func:`agree`: the lowest failing rank's message is raised as a
:class:`CheckpointError` on every rank, before any rank waits in a collective for one that gave up.
Each function takes the process group to agree over (default: the whole world); an asynchronous
save agrees over a gloo group of its own, whose CPU tensors never wait for the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.device import current_device
from training.checkpoint.format import CheckpointError

__all__ = ["agree", "current_parallel", "distributed", "everyone", "gather", "sum_over_ranks"]


def distributed() -> bool:
    """Whether a process group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device(group) -> torch.device:
    """Where a collective's tensors live on ``group``: the CPU for gloo, this rank's device otherwise."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return current_device()


def agree(error: str | None, group=None) -> None:
    """Raise on every rank if any rank failed: the lowest failing rank's message is broadcast to all."""
    if not distributed():
        if error:
            raise CheckpointError(error)
        return
    rank, world, device = dist.get_rank(), dist.get_world_size(), _device(group)
    first = torch.tensor([rank if error else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first.item())
    if src == world:
        return
    data = torch.tensor(list((error or "").encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], device=device)
    dist.broadcast(length, src, group=group)
    buf = data if rank == src else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    message = bytes(buf.cpu().tolist()).decode()
    own = rank == src or error == message  # a rank that hit the same problem needs no "rank N:"
    raise CheckpointError(message if own else f"rank {src}: {message}")


def everyone(done: bool, failed: bool, group=None) -> tuple[bool, bool]:
    """(``done`` on every rank, ``failed`` on any rank): one small all-reduce; call it on every rank."""
    if not distributed():
        return done, failed
    flags = torch.tensor([int(not done), int(failed)], device=_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    not_done, any_failed = flags.tolist()
    return not not_done, bool(any_failed)


def gather(value: Any, group=None) -> list[Any]:
    """``value`` of every rank, in rank order (JSON-like values)."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def sum_over_ranks(value: int) -> int:
    """``value`` summed over every rank of the job."""
    if not distributed():
        return value
    total = torch.tensor([value], device=current_device())
    dist.all_reduce(total)
    return int(total.item())


def current_parallel() -> dict[str, int]:
    """This rank's ``parallel`` dict from ``core.parallel_state`` (a world of one when it is not set up).

    Its data-parallel size and rank count DP x CP: context-parallel ranks hold the same weights, the
    distributed optimizer shards over all of them, and a checkpoint records no CP split.
    """
    if not ps.model_parallel_is_initialized():
        return {
            "tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "vpp": 1,
            "ep": 1, "ep_rank": 0, "edp": 1, "edp_rank": 0,
        }  # fmt: skip
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_world_size(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
    }

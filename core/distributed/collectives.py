"""The two collectives of the distributed optimizer, with the path each backend takes.

``reduce_scatter``: each data-parallel rank needs the sum of one shard of a gradient bucket.

* NCCL (and any backend but gloo): ``reduce_scatter_tensor`` into this rank's shard of the bucket,
  in place. The other shards keep this rank's unreduced gradients, which nothing reads.
* gloo: torch (2.3 to 2.13 at least) has ``reduce_scatter_tensor`` on gloo for every float dtype,
  but implements it as a clone of the input, a full all-reduce and a copy of this rank's chunk
  (pytorch/pytorch#118911). Trident all-reduces the bucket in place instead: the same traffic, one
  copy less, and every shard ends up reduced (this rank reads only its own). Setting
  ``TRIDENT_GLOO_REDUCE_SCATTER=native`` makes gloo call ``reduce_scatter_tensor`` as NCCL does, so
  tests can check that nothing reads another rank's shard.

``all_gather``: every rank sends its updated parameter shard and receives the others'. All
backends call ``all_gather_into_tensor`` (gloo's is a list all-gather underneath), in place: the
input is this rank's shard of the output.

Both take ``async_op`` and return the work handle (None when synchronous).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# torch 2.13 renamed the tensor collectives and deprecated the old names; older torch has only those.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_is_native(group: ProcessGroup) -> bool:
    """Whether ``reduce_scatter`` on this group calls the backend's reduce-scatter (see module doc)."""
    if dist.get_backend(group) != "gloo":
        return True
    return os.environ.get("TRIDENT_GLOO_REDUCE_SCATTER", "") == "native"


def reduce_scatter(
    shard: torch.Tensor, flat: torch.Tensor, group: ProcessGroup, *, native: bool, async_op: bool
) -> dist.Work | None:
    """Sum ``flat`` over ``group`` into ``shard`` (this rank's equal slice of ``flat``, a view of it)."""
    if native:
        return _reduce_scatter_tensor(shard, flat, group=group, async_op=async_op)
    return dist.all_reduce(flat, group=group, async_op=async_op)


def all_gather(
    flat: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, *, async_op: bool
) -> dist.Work | None:
    """Fill ``flat`` with every rank's ``shard`` in rank order (``shard`` is this rank's slice of it).
    One-byte floats (weights held in FP8) move as bytes: gloo has no FP8 type, and nothing is summed."""
    if flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        flat, shard = flat.view(torch.uint8), shard.view(torch.uint8)
    return _all_gather_into_tensor(flat, shard, group=group, async_op=async_op)

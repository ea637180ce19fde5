"""Microbatches for one training step: each data-parallel rank its own samples, TP ranks identical.

Sample order is Megatron's sequential sampler: the step that starts at ``consumed_samples`` takes
the next ``global_batch_size`` samples, microbatch by microbatch, data-parallel rank ``r`` taking
the ``r``-th slice of each. Resuming from a checkpoint's ``consumed_samples`` therefore continues
the exact sequence. As in Megatron, tensor-parallel rank 0 reads and broadcasts to its TP group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.device import current_device
from training.data import dp_microbatch_indices

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def _read(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    samples = [dataset[i % len(dataset)] for i in indices]
    return {f: torch.stack([s[f] for s in samples]) for f in FIELDS}


def _broadcast_in_tp_group(
    batch: dict[str, torch.Tensor] | None, micro_batch_size: int, seq_length: int
) -> dict[str, torch.Tensor]:
    """TP rank 0's batch on every rank of its tensor-parallel group."""
    device = current_device()
    if ps.get_tensor_model_parallel_world_size() == 1:
        return {k: v.to(device) for k, v in batch.items()}
    src, group = ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_group()
    out = {}
    for field in FIELDS:
        dtype = torch.float32 if field == "loss_mask" else torch.int64
        tensor = (
            batch[field].to(device, dtype)
            if batch is not None
            else torch.empty(micro_batch_size, seq_length, dtype=dtype, device=device)
        )
        dist.broadcast(tensor, src=src, group=group)
        out[field] = tensor
    return out


def step_iterator(
    dataset, consumed_samples: int, num_microbatches: int, micro_batch_size: int, seq_length: int
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's microbatches of the step that starts at ``consumed_samples``."""
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    reads = ps.get_tensor_model_parallel_rank() == 0
    for k in range(num_microbatches):
        start = consumed_samples + k * micro_batch_size * dp_size
        batch = (
            _read(dataset, dp_microbatch_indices(start, micro_batch_size, dp_rank, dp_size))
            if reads
            else None
        )
        yield _broadcast_in_tp_group(batch, micro_batch_size, seq_length)

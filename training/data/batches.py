"""Microbatches for each training step, read ahead by a ``torch.utils.data.DataLoader``.

Sample order is Megatron's: with ``--dataloader-type single`` the step that starts at
``consumed_samples`` takes the next ``global_batch_size`` samples, microbatch by microbatch,
data-parallel rank ``r`` taking the ``r``-th slice of each; with ``cyclic``, each rank reads its shard
in a random order per epoch (``training/data/samplers.py``). Either order is a function of
``consumed_samples`` alone, which a checkpoint stores, so a resumed run reads exactly what the
uninterrupted one would have. The datasets draw no random numbers, so neither the worker count nor
the read-ahead changes what is read.

``BatchStream`` keeps one ``DataLoader`` iterator open across steps: ``--num-workers`` processes build
the next microbatches (``prefetch_factor`` each) while the model computes, into pinned memory on a
GPU. Only tensor-parallel rank 0 of a stage that reads data (the first and last pipeline stages)
reads; it broadcasts each microbatch to its tensor-parallel group, as Megatron does. With context
parallelism every CP rank reads the same samples and keeps its two chunks of each sequence
(``get_batch_on_this_cp_rank``, Megatron's function). Asking for a
step at another position (an evaluation, which starts at its first sample) restarts the loader there.
A sample that fails with one of the run's one-line errors (a token id outside the vocabulary) fails
the step with that same error, whether a worker or the training process read it (:class:`_Failed`).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.device import current_device
from core.parallel_state import ParallelGroups
from core.transformer.context_parallel import get_batch_on_this_cp_rank
from training.data.samplers import EndlessSequentialSampler, MegatronPretrainingRandomSampler
from training.faults import one_line_errors

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
SAMPLERS = {"single": EndlessSequentialSampler, "cyclic": MegatronPretrainingRandomSampler}


def _ignore_sigterm(worker_id: int) -> None:
    """A data worker of a training process that saves on SIGTERM (``--exit-signal-handler``) ignores SIGTERM
    and leaves its end to that process (it stops with its parent). torchrun's agent signals each worker's
    whole process group, and a scheduler every process of the job step: a data worker ended under the
    training process fails its next read ("DataLoader worker ... is killed by signal") before the
    checkpoint is saved. Without the flag SIGTERM ends both, as before."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Failed:
    """A sample that raised one of the run's one-line errors, carried to the training process as a value.

    Raised inside a DataLoader worker, such an error would come back re-raised by torch as ``Caught
    DataError in DataLoader worker process 0.`` with the worker's traceback in its message, where the
    same error read in the training process is one line. Carried as a value it is raised again, as it
    was, in the training process, with or without workers.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Guarded(torch.utils.data.Dataset):
    """``dataset`` whose samples that fail with a one-line error become :class:`_Failed` values."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self.errors = one_line_errors()

    def __getitem__(self, index: int):
        try:
            return self.dataset[index]
        except self.errors as err:
            return _Failed(err)

    def __len__(self) -> int:
        return len(self.dataset)


def _collate(samples: list):
    """torch's default collation, or the first :class:`_Failed` sample of the microbatch."""
    failed = next((s for s in samples if isinstance(s, _Failed)), None)
    return failed if failed is not None else torch.utils.data.default_collate(samples)


def _broadcast_in_tp_group(
    batch: dict[str, torch.Tensor] | None, micro_batch_size: int, seq_length: int, groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """TP rank 0's batch on every rank of its tensor-parallel group."""
    device = current_device()
    if groups.size("tp") == 1:
        return {k: batch[k].to(device, non_blocking=True) for k in FIELDS}
    src, group = groups.ranks["tp"][0], groups.tp
    out = {}
    for field in FIELDS:
        dtype = torch.float32 if field == "loss_mask" else torch.int64
        tensor = (
            batch[field].to(device, dtype, non_blocking=True)  # pinned on a GPU: the host does not wait
            if batch is not None
            else torch.empty(micro_batch_size, seq_length, dtype=dtype, device=device)
        )
        dist.broadcast(tensor, src=src, group=group)
        out[field] = tensor
    return out


class BatchStream:
    """One dataset's microbatches for this rank, step after step (see the module docstring).

    ``num_workers=0`` reads in the training process; ``dataloader_type`` is ``single`` or ``cyclic``.
    ``groups``: the process groups to read for (default: ``parallel_state``'s).
    ``workers_ignore_sigterm``: with ``--exit-signal-handler`` (see :func:`_ignore_sigterm`).
    """

    def __init__(
        self,
        dataset,
        *,
        micro_batch_size: int,
        seq_length: int,
        num_workers: int = 0,
        dataloader_type: str = "single",
        groups: ParallelGroups | None = None,
        workers_ignore_sigterm: bool = False,
    ) -> None:
        self.workers_ignore_sigterm = workers_ignore_sigterm
        self.dataset, self.groups = dataset, groups if groups is not None else ps.get_parallel_groups()
        self.micro_batch_size, self.seq_length = micro_batch_size, seq_length
        self.num_workers, self.dataloader_type = num_workers, dataloader_type
        self.position: int | None = None
        self._batches: Iterator | None = None

    def _open(self, consumed_samples: int) -> Iterator:
        sampler = SAMPLERS[self.dataloader_type](
            len(self.dataset),
            consumed_samples,
            self.micro_batch_size,
            self.groups.rank_in("dp"),
            self.groups.size("dp"),
        )
        loader = torch.utils.data.DataLoader(
            _Guarded(self.dataset),
            batch_sampler=sampler,
            collate_fn=_collate,
            num_workers=self.num_workers,
            pin_memory=current_device().type == "cuda",
            persistent_workers=False,
            # Its own generator: otherwise starting the iterator draws a worker seed from torch's global
            # generator, which dropout uses, and a resumed run (which starts it later) would diverge.
            generator=torch.Generator().manual_seed(consumed_samples),
            worker_init_fn=_ignore_sigterm if self.workers_ignore_sigterm else None,
        )
        return iter(loader)

    def step(self, consumed_samples: int, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
        """The ``num_microbatches`` microbatches of the step that starts at ``consumed_samples``."""
        reads = self.groups.rank_in("tp") == 0
        if reads and consumed_samples != self.position:
            self.close()
            self._batches = self._open(consumed_samples)
        batches = [
            get_batch_on_this_cp_rank(
                _broadcast_in_tp_group(
                    self._next_batch() if reads else None, self.micro_batch_size, self.seq_length, self.groups
                ),
                cp_size=self.groups.size("cp"),
                cp_rank=self.groups.rank_in("cp"),
            )
            for _ in range(num_microbatches)
        ]
        self.position = consumed_samples + num_microbatches * self.micro_batch_size * self.groups.size("dp")
        return batches

    def _next_batch(self) -> dict[str, torch.Tensor]:
        batch = next(self._batches)
        if isinstance(batch, _Failed):
            # Stop the workers now: left to the error's traceback, the loader would be collected late,
            # and shutting down from the garbage collector waits out torch's 5 s join timeout.
            self.close()
            raise batch.error
        return batch

    def close(self) -> None:
        """Stop the loader's worker processes."""
        self._batches, self.position = None, None

    def __len__(self) -> int:
        return len(self.dataset)

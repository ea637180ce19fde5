"""Which samples each data-parallel rank reads next: Megatron's sequential pretraining sampler.

Global batches are consecutive runs of sample indices; within each run of
``micro_batch_size * dp_size`` samples, DP rank ``r`` takes the ``r``-th slice of
``micro_batch_size``. Everything follows from ``consumed_samples`` (the number of samples all
ranks together have consumed), which a checkpoint stores, so training resumes exactly.
"""

from __future__ import annotations

from collections.abc import Iterator


def dp_microbatch_indices(
    consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[int]:
    """Sample indices of the next microbatch of ``dp_rank``, ``consumed_samples`` samples into the run."""
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size, got "
            f"micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
        )
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
    start = consumed_samples + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


class MegatronPretrainingSampler:
    """Batch sampler yielding ``dp_microbatch_indices`` lists until ``total_samples`` run out.

    The last incomplete round of microbatches is dropped, as Megatron does by default.
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed_samples={consumed_samples} >= {total_samples}")
        dp_microbatch_indices(consumed_samples, micro_batch_size, dp_rank, dp_size)  # validate
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        for consumed in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield dp_microbatch_indices(consumed, self.micro_batch_size, self.dp_rank, self.dp_size)


class EndlessSequentialSampler:
    """``--dataloader-type single`` for the training loop: ``dp_microbatch_indices`` from
    ``consumed_samples`` on, without end; an index past the dataset wraps around (``i % total``)."""

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        dp_microbatch_indices(consumed_samples, micro_batch_size, dp_rank, dp_size)  # validate
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        while True:
            indices = dp_microbatch_indices(consumed, self.micro_batch_size, self.dp_rank, self.dp_size)
            yield [i % self.total_samples for i in indices]
            consumed += self.micro_batch_size * self.dp_size


class MegatronPretrainingRandomSampler:
    """``--dataloader-type cyclic``: Megatron's random sampler with data sharding, epoch after epoch.

    Each epoch uses the first ``total - total % (mbs x dp)`` samples. Data-parallel rank ``r`` owns the
    contiguous bucket ``[r * B, (r + 1) * B)`` of them (``B = total // (mbs x dp) * mbs``) and reads
    it in the order of ``torch.randperm(B)`` seeded with the epoch number, ``mbs`` at a time. The
    position in that order follows from ``consumed_samples`` alone (every rank has read
    ``consumed_in_epoch / dp`` of its bucket), so a resumed run continues the same sequence.
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        dp_microbatch_indices(consumed_samples, micro_batch_size, dp_rank, dp_size)  # validate
        step = micro_batch_size * dp_size
        if total_samples < step:
            raise ValueError(
                f"--dataloader-type cyclic needs at least micro-batch x data-parallel size ({step}) samples, "
                f"the dataset has {total_samples}"
            )
        if consumed_samples % step:
            raise ValueError(f"consumed_samples ({consumed_samples}) must be a multiple of {step}")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        import torch

        mbs, step = self.micro_batch_size, self.micro_batch_size * self.dp_size
        active = self.total_samples - self.total_samples % step
        bucket = active // self.dp_size
        epoch, in_epoch = divmod(self.consumed_samples, active)
        while True:
            generator = torch.Generator()
            generator.manual_seed(epoch)
            order = torch.randperm(bucket, generator=generator)[in_epoch // self.dp_size :]
            order = (order + self.dp_rank * bucket).tolist()
            for k in range(0, len(order), mbs):
                yield order[k : k + mbs]
            epoch, in_epoch = epoch + 1, 0

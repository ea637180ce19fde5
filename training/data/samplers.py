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

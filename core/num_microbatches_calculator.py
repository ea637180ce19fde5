"""The global batch size and microbatch count of a step, as functions of the samples consumed before it.

Megatron grows the global batch during a run in one of two ways, both expressed here as one
:class:`BatchSizeSchedule` (a step function: from ``thresholds[i]`` consumed samples on, the global
batch is ``batch_sizes[i]``):

- ``--rampup-batch-size START INCR SAMPLES`` (Megatron's ``RampupBatchsizeNumMicroBatchesCalculator``):
  the batch starts at START and grows by INCR, (global - START) / INCR times in all, one increment
  every SAMPLES / increments samples (a float, as Megatron divides). A step that starts at ``c``
  consumed samples uses ``START + int(c / (SAMPLES / increments)) * INCR``, and the full global batch
  once ``c`` exceeds SAMPLES. :meth:`BatchSizeSchedule.rampup` finds the exact sample counts where
  that formula moves, so the table gives Megatron's batch at every ``c``.
- ``--step-batch-size-schedule "0:768 250B:1536 500B:3072"`` (Megatron's
  ``StepBatchsizeNumMicroBatchesCalculator``): THRESHOLD:BATCH pairs, separated by spaces or commas,
  each number with an optional K/M/B/T suffix (1e3 ... 1e12). Thresholds count tokens and become
  samples by integer division by the sequence length; sorted, they must start at 0 and strictly
  increase.

:class:`NumMicroBatchesCalculator` adds the micro-batch and data-parallel sizes: microbatches per
data-parallel rank = global batch / (micro batch x data-parallel size). Everything here is pure: the
training loop asks it per step with the consumed-sample count that checkpoints store, so a resumed
run gets the batch the uninterrupted one had. Errors are ``ValueError`` s saying what is wrong with
the numbers; the caller names the flag.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["BatchSizeSchedule", "NumMicroBatchesCalculator", "parse_count"]

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """A count such as ``250B``, ``2.4B`` or ``768``: Megatron's ``int(float(number) * suffix)``."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if multiplier > 1 else value
    try:
        return int(float(number) * multiplier)
    except (ValueError, OverflowError):
        raise ValueError(f"{text!r} is not a number (a count with an optional K, M, B or T suffix)") from None


@dataclass(frozen=True)
class BatchSizeSchedule:
    """The global batch size as a step function of consumed samples (see the module docstring)."""

    thresholds: tuple[int, ...]
    """Consumed samples from which each batch size applies: 0 first, strictly increasing."""
    batch_sizes: tuple[int, ...]
    """The global batch size from the matching threshold on."""
    kind: Literal["constant", "rampup", "step"] = "constant"
    """Which of Megatron's calculators this is; it decides how ``--train-samples`` becomes iterations."""
    rampup_samples: int = 0
    """With ``rampup``: SAMPLES, after which the batch is the full global batch."""

    def __post_init__(self) -> None:
        if not self.thresholds or self.thresholds[0] != 0 or len(self.thresholds) != len(self.batch_sizes):
            raise ValueError(f"a schedule needs one batch size per threshold, starting at 0: {self}")
        if any(b <= a for a, b in itertools.pairwise(self.thresholds)):
            raise ValueError(f"thresholds must strictly increase: {self.thresholds}")

    @classmethod
    def constant(cls, global_batch_size: int) -> BatchSizeSchedule:
        """One batch size for the whole run (Megatron's ``ConstantNumMicroBatchesCalculator``)."""
        return cls((0,), (global_batch_size,))

    @classmethod
    def rampup(cls, start: int, increment: int, samples: int, global_batch_size: int) -> BatchSizeSchedule:
        """Megatron's linear ramp from ``start`` to ``global_batch_size`` over ``samples`` samples."""
        if start <= 0 or increment <= 0:
            raise ValueError(f"the start batch size ({start}) and the increment ({increment}) must be > 0")
        if samples <= 0:
            raise ValueError(f"the ramp-up samples ({samples}) must be > 0")
        if start > global_batch_size:
            raise ValueError(f"the start batch size ({start}) is larger than the global batch size")
        if (global_batch_size - start) % increment:
            raise ValueError(
                f"the ramp from {start} to the global batch size {global_batch_size} is not a whole number "
                f"of increments: {global_batch_size} - {start} = {global_batch_size - start} is not "
                f"divisible by {increment}"
            )
        increments = (global_batch_size - start) // increment
        if increments == 0:
            return cls((0,), (start,), "rampup", samples)
        per_increment = samples / increments  # Megatron's float: the batch is start + int(c / this) * incr
        table = {0: start}
        for k in range(1, increments + 1):
            first = min(_first_reaching(k, samples, increments, per_increment), samples + 1)
            table[first] = max(table.get(first, 0), start + k * increment)
        table[samples + 1] = global_batch_size  # past the ramp: the full batch, whatever the rounding
        return cls._collapsed(table, "rampup", samples)

    @classmethod
    def parse(cls, text: str, seq_length: int) -> BatchSizeSchedule:
        """Megatron's ``--step-batch-size-schedule``: thresholds in tokens, ``seq_length`` tokens a sample."""
        entries = []
        for entry in text.replace(",", " ").split():
            if ":" not in entry:
                raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
            threshold, batch = (parse_count(part) for part in entry.split(":", 1))
            if batch <= 0:
                raise ValueError(f"entry {entry!r}: the batch size must be > 0")
            entries.append((threshold // seq_length, batch, entry))
        if not entries:
            raise ValueError("no THRESHOLD:BATCH_SIZE entries")
        entries.sort(key=lambda e: e[0])
        if entries[0][0] != 0:
            raise ValueError(
                f"the first threshold must be 0, got {entries[0][2]!r} ({entries[0][0]} samples of "
                f"{seq_length} tokens)"
            )
        for (at, size, entry), (next_at, next_size, next_entry) in itertools.pairwise(entries):
            if next_at == at:
                raise ValueError(
                    f"{entry!r} and {next_entry!r} start at the same sample ({at}, at {seq_length} tokens a "
                    "sample); thresholds must strictly increase"
                )
            if next_size < size:
                raise ValueError(
                    f"the batch size goes down from {size} to {next_size} at {next_entry!r}; it may only grow "
                    "(Megatron's microbatch count never decreases)"
                )
        return cls(tuple(e[0] for e in entries), tuple(e[1] for e in entries), "step")

    @classmethod
    def _collapsed(cls, table: dict[int, int], kind, rampup_samples: int) -> BatchSizeSchedule:
        thresholds, sizes = [], []
        for at in sorted(table):
            if not sizes or table[at] != sizes[-1]:
                thresholds.append(at)
                sizes.append(table[at])
        return cls(tuple(thresholds), tuple(sizes), kind, rampup_samples)

    @property
    def final(self) -> int:
        """The last (largest) global batch size: ``--global-batch-size``."""
        return self.batch_sizes[-1]

    @property
    def changes(self) -> bool:
        return len(self.batch_sizes) > 1

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        return self.batch_sizes[bisect.bisect_right(self.thresholds, consumed_samples) - 1]

    def segments(self, consumed_samples: int, iterations: int) -> Iterator[tuple[int, int, int]]:
        """``(iteration offset, consumed samples, batch size)`` where each batch size of the next
        ``iterations`` steps from ``consumed_samples`` begins (the first one included)."""
        done = 0
        while done < iterations:
            index = bisect.bisect_right(self.thresholds, consumed_samples) - 1
            size = self.batch_sizes[index]
            yield done, consumed_samples, size
            if index + 1 == len(self.thresholds):
                return
            steps = min(-(-(self.thresholds[index + 1] - consumed_samples) // size), iterations - done)
            consumed_samples, done = consumed_samples + steps * size, done + steps

    def consumed_after(self, consumed_samples: int, iterations: int) -> int:
        """The consumed-sample count ``iterations`` steps after ``consumed_samples``."""
        segments = list(self.segments(consumed_samples, iterations))
        for (offset, at, size), end in zip(segments, [s[0] for s in segments[1:]] + [iterations]):
            consumed_samples = at + (end - offset) * size
        return consumed_samples

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run, counted as Megatron's ``update_train_iters`` does."""
        if self.kind == "constant":
            return train_samples // self.final
        if self.kind == "step":  # steps until the samples are reached; the last one may pass them
            return self._steps_below(0, train_samples)[0]
        # The ramp: steps while the consumed count is at most both SAMPLES and train_samples, then
        # whole full batches of what is left (a partial last batch is dropped).
        steps, consumed = self._steps_below(0, min(self.rampup_samples, train_samples) + 1)
        return steps + max(train_samples - consumed, 0) // self.final

    def _steps_below(self, consumed_samples: int, limit: int) -> tuple[int, int]:
        """Steps taken while fewer than ``limit`` samples are consumed, and the count after them."""
        steps = 0
        while consumed_samples < limit:
            index = bisect.bisect_right(self.thresholds, consumed_samples) - 1
            size = self.batch_sizes[index]
            end = min(self.thresholds[index + 1] if index + 1 < len(self.thresholds) else limit, limit)
            taken = -(-(end - consumed_samples) // size)
            consumed_samples, steps = consumed_samples + taken * size, steps + taken
        return steps, consumed_samples


def _first_reaching(k: int, samples: int, increments: int, per_increment: float) -> int:
    """The smallest sample count ``c`` with ``int(c / per_increment) >= k`` (Megatron's float rounding)."""
    c = k * samples // increments  # the exact boundary, give or take the float's rounding
    while c > 0 and int((c - 1) / per_increment) >= k:
        c -= 1
    while int(c / per_increment) < k:
        c += 1
    return c


@dataclass(frozen=True)
class NumMicroBatchesCalculator:
    """Microbatches per data-parallel rank of each step: the schedule's batch / (micro batch x DP)."""

    schedule: BatchSizeSchedule
    micro_batch_size: int
    data_parallel_size: int

    @property
    def micro_batch_times_data_parallel_size(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def global_batch_size(self, consumed_samples: int) -> int:
        """Megatron's ``get_current_global_batch_size()`` after ``update_num_microbatches(consumed_samples)``."""
        return self.schedule.global_batch_size(consumed_samples)

    def num_microbatches(self, consumed_samples: int) -> int:
        """Megatron's ``get_num_microbatches()`` after ``update_num_microbatches(consumed_samples)``."""
        size, per_step = self.global_batch_size(consumed_samples), self.micro_batch_times_data_parallel_size
        if size % per_step:
            raise ValueError(
                f"the global batch size {size} (from {consumed_samples} consumed samples) is not divisible by "
                f"micro batch size ({self.micro_batch_size}) x data-parallel size ({self.data_parallel_size})"
            )
        return size // per_step

"""What a schedule calls besides the model, and what it reads from the model's config: typed, in one place.

``ScheduleHooks`` carries the training loop's hooks (data-parallel gradient sync, the end-of-step
reductions, loss scaling, the weight of the model's own losses, timers). One object is shared by
every model chunk; the entry points
take it as ``schedule_hooks=``, or read it from the first chunk's config: its ``schedule_hooks``
field, or else Megatron's attribute names (``no_sync_func``, ``grad_sync_func``,
``finalize_model_grads_func``, ``grad_scale_func``, ``timers``), which stay accepted.

``ScheduleSettings`` is everything else the engine needs from a config, read once by
:func:`ScheduleSettings.from_config` so that no other code looks attributes up on a config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any

import torch

from core.pipeline_parallel.position import SchedulePosition
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE

NoSync = Callable[[], AbstractContextManager]
GradSync = Callable[[Iterable[torch.nn.Parameter]], None]

_MEGATRON_NAMES = {
    "no_sync": "no_sync_func",
    "grad_sync": "grad_sync_func",
    "finalize_model_grads": "finalize_model_grads_func",
    "grad_scale_func": "grad_scale_func",
    "timers": "timers",
}


@dataclass(kw_only=True)
class ScheduleHooks:
    """The training loop's hooks, shared by every model chunk of a rank."""

    no_sync: NoSync | Sequence[NoSync] | None = None
    """Suspends data-parallel gradient reduction while microbatches accumulate: one context manager
    for all chunks, or one per chunk. The schedule lifts it for the last weight-gradient
    computation of the step (a chunk's own, when there is one per chunk), so buckets launch their
    reductions while that backward still runs."""

    grad_sync: GradSync | Sequence[GradSync] | None = None
    """Called with a chunk's parameters right after its last weight-gradient computation (one for
    all chunks or one per chunk): launches whatever reduction has not started yet."""

    finalize_model_grads: Callable[[list[torch.nn.Module], torch.Tensor | None], None] | None = None
    """``finalize_model_grads(chunks, num_tokens)`` once all backwards are done (DP, TP and tied-weight
    reductions; ``num_tokens`` is the step's token count with a per-token loss, else None)."""

    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Backward starts from ``grad_scale_func(loss)`` on the last stage instead of the loss (fp16 loss
    scaling: Megatron passes ``optimizer.scale_loss``)."""

    auxiliary_loss_scale: Callable[[torch.Tensor], None] | None = None
    """``auxiliary_loss_scale(scale)`` at the start of each training step: the weight in the step's
    objective of the losses the model computes inside (MoE routers' load-balancing and z-losses),
    which their backward starts from (:mod:`core.pipeline_parallel.auxiliary_loss`). None: the entry
    point builds it from the chunks it runs (``auxiliary_loss_scale_hook``)."""

    timers: Callable | None = None
    """Megatron-style timers: ``timers("forward-compute", log_level=2).start()`` / ``.stop()``."""

    position: SchedulePosition | None = None
    """Kept up to date with this rank's table and the index of the action it runs (one attribute store
    per action): the training loop's watchdog reads it, so that a hang names the action and the message
    every rank waits for, and a hung rank's post-mortem holds its whole table."""

    @classmethod
    def from_config(cls, config: Any) -> ScheduleHooks:
        """The hooks a config carries: its ``schedule_hooks``, or Megatron's attribute names."""
        typed = getattr(config, "schedule_hooks", None)
        legacy = {field: getattr(config, name, None) for field, name in _MEGATRON_NAMES.items()}
        if typed is None:
            return cls(**legacy)
        given = [_MEGATRON_NAMES[f] for f, v in legacy.items() if v is not None]
        if given:
            raise ValueError(
                f"the model config has both schedule_hooks and Megatron's {', '.join(given)}; "
                "give the hooks one way"
            )
        return typed

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def for_chunk(self, hook: str, chunk: int) -> Any:
        """A per-chunk hook's entry for ``chunk`` (or the one shared by all chunks)."""
        value = getattr(self, hook)
        return value[chunk] if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class ScheduleSettings:
    """The schedule's knobs, read from a model config (a ``ModelParallelConfig`` or Megatron's)."""

    pipeline_schedule: str = DEFAULT_SCHEDULE
    pipeline_dtype: torch.dtype = torch.float32
    hidden_size: int = 0
    variable_seq_lengths: bool = False
    deallocate_pipeline_outputs: bool = False
    calculate_per_token_loss: bool = False
    microbatch_group_size: int | None = None
    virtual_pipeline_size: int = 1
    sequence_parallel: bool = False
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1

    @classmethod
    def from_config(cls, config: Any) -> ScheduleSettings:
        def get(name: str, default: Any) -> Any:
            value = getattr(config, name, default)
            return default if value is None else value

        return cls(
            pipeline_schedule=get("pipeline_schedule", DEFAULT_SCHEDULE),
            pipeline_dtype=get("pipeline_dtype", torch.float32),
            hidden_size=get("hidden_size", 0),
            variable_seq_lengths=bool(get("variable_seq_lengths", False)),
            deallocate_pipeline_outputs=bool(get("deallocate_pipeline_outputs", False)),
            calculate_per_token_loss=bool(get("calculate_per_token_loss", False)),
            microbatch_group_size=getattr(config, "microbatch_group_size_per_vp_stage", None),
            virtual_pipeline_size=get("virtual_pipeline_model_parallel_size", 1),
            sequence_parallel=bool(get("sequence_parallel", False)),
            tensor_parallel_size=get("tensor_model_parallel_size", 1),
            context_parallel_size=get("context_parallel_size", 1),
        )

    def tensor_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
        """``[seq, batch, hidden]`` between stages; the sequence is split over TP with sequence parallelism."""
        seq = seq_length // self.context_parallel_size
        if self.sequence_parallel:
            seq //= self.tensor_parallel_size
        return seq, micro_batch_size, self.hidden_size

    def describe_tensor_shape(self, seq_length: int, micro_batch_size: int) -> str:
        """Where :meth:`tensor_shape` comes from, for error messages."""
        seq = f"seq_length {seq_length}"
        if self.context_parallel_size > 1:
            seq += f" / context_parallel_size {self.context_parallel_size}"
        if self.sequence_parallel:
            seq += f" / tensor_model_parallel_size {self.tensor_parallel_size} (sequence parallelism)"
        return f"[{seq}, micro_batch_size {micro_batch_size}, hidden_size {self.hidden_size}]"

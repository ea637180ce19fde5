"""What the loop works on: the pieces setup built (``Session``), the counters it carries from step to
step (``TrainState``) and what one step measured (``StepResult``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from training.progress import Progress

if TYPE_CHECKING:
    from core.optimizer.lr_scheduler import OptimizerParamScheduler
    from core.optimizer.optimizer import MegatronOptimizer
    from core.parallel_state import ParallelGroups
    from core.pipeline_parallel.hooks import ScheduleHooks
    from models.gpt.parallelize import ParallelGPT
    from training.batches import BatchStream
    from training.checkpoint.async_save import CheckpointSaver
    from training.run_logging import RunLoggers


@dataclass
class TrainState:
    """The run's counters (checkpointed) and its record so far; ``pretrain()`` returns it."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_skipped: int = 0
    wandb_run_id: str | None = None
    losses: list[dict[str, float]] = field(default_factory=list)  # per iteration, on the loss stage
    step_seconds: list[float] = field(default_factory=list)  # wall time of each iteration (no eval/save)
    progress: Progress | None = None  # timestamps, ETA and the end-of-run summary


@dataclass
class StepResult:
    """What one iteration measured, read from the device (see :mod:`training.step_ledger`), for the log
    line and W&B."""

    losses: dict[str, float] | None  # loss_func's reported values, on the loss stage
    grad_norm: float | None
    num_zeros: int | None
    applied: bool
    peak_memory: float  # bytes, the largest of any rank
    global_batch_size: int  # samples of this step (all data-parallel ranks): it grows along a batch ramp
    params_norm: float | None = None
    seconds: float = 0.0  # the host's time for the step (on a GPU, until it queued the next)
    moe_layers: dict[str, float] = field(default_factory=dict)  # --moe-per-layer-logging, for W&B/TB
    iteration: int = 0
    learning_rate: float = 0.0  # the first group's, after this step (as Megatron logs it)
    loss_scale: float = 1.0  # after this step's update
    consumed_samples: int = 0
    skipped_iterations: int = 0  # the run's counters after this step
    nan_iterations: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # allocator statistics (--log-memory-to-tensorboard)


@dataclass
class Session:
    """What the loop works with: the parallel model and its optimizer, the schedule, data and loggers."""

    groups: ParallelGroups
    """This rank's process groups, handed to whatever communicates (model, data, loss reduction)."""
    model: ParallelGPT
    optimizer: MegatronOptimizer
    hooks: ScheduleHooks
    """What the schedule calls besides the model (gradient sync, finalize, loss scale), built once after
    the optimizer and passed at every call with the groups."""
    scheduler: OptimizerParamScheduler
    forward_step_func: Callable
    forward_backward: Callable
    """The pipeline schedule (``get_forward_backward_func(pp, vpp)``)."""
    state: TrainState
    logs_loss: bool
    """This rank prints the loss and talks to W&B: the first TP and DP rank of the loss stage."""
    tokenizer: Any = None
    train_data: BatchStream | None = None
    valid_data: BatchStream | None = None
    loggers: RunLoggers | None = None
    saver: CheckpointSaver | None = None
    """Writes the ``--save`` checkpoints (in the background with ``--async-save``)."""

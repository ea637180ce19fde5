"""What the loop works on: the pieces setup built (``Session``), the counters it carries from step to
step (``TrainState``) and what one step decided (``Step``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from training.reporting.progress import Progress

if TYPE_CHECKING:
    import torch

    from core.optimizer.lr_scheduler import OptimizerParamScheduler
    from core.optimizer.optimizer import MegatronOptimizer
    from core.parallel_state import ParallelGroups
    from core.pipeline_parallel.hooks import ScheduleHooks
    from models.gpt.parallelize import ParallelGPT
    from training.checkpoint.async_save import CheckpointSaver
    from training.data.batches import BatchStream
    from training.reporting.run_logging import RunLoggers


@dataclass
class TrainState:
    """The run's counters (checkpointed) and its record so far; ``pretrain()`` returns it."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_skipped: int = 0
    wandb_run_id: str | None = None
    rerun: dict | None = None
    """Result validation's record of a step to rerun from this checkpoint on other devices (the exit 16
    checkpoint holds it; :mod:`training.faults.validation`)."""
    losses: list[dict[str, float]] = field(default_factory=list)  # per iteration, on the loss stage
    step_seconds: list[float] = field(default_factory=list)  # wall time of each iteration (no eval/save)
    progress: Progress | None = None  # timestamps, ETA and the end-of-run summary


@dataclass(kw_only=True)
class Step:
    """One iteration, from :func:`training.step.train_step` to the log line and the W&B row.

    The step leaves what it decided on the device: the fields under "decided on the device" are 0-dim
    tensors until the ledger settles the step (:meth:`training.step_ledger.StepLedger.settle`, one read for all the
    steps since the last settling point); from then on they are host numbers. The loop then applies
    the settled step (:func:`training.loop.apply_step`: the NaN checks, the skip counters, the
    learning-rate scheduler) and fills in the learning rate and counters after it.
    """

    iteration: int
    global_batch_size: int = 0
    """Samples of this step (all data-parallel ranks): a batch ramp grows it; the scheduler advances by
    it after an applied step."""
    consumed_samples: int = 0  # after this step (Megatron's count: skipped steps too)
    # Decided on the device (tensors), host numbers once settled.
    losses: dict[str, torch.Tensor] | dict[str, float] | None = None  # loss_func's values, on the loss stage
    applied: torch.Tensor | bool  # the optimizer stepped
    bad_loss: torch.Tensor | bool  # a NaN/Inf loss on some rank
    overflow: torch.Tensor | bool | None = None
    """An fp16 loss-scale overflow (settled: False without loss scaling)."""
    grad_norm: torch.Tensor | float | None  # settled: None after an overflow
    num_zeros: torch.Tensor | int | None = None  # settled: None unless applied
    loss_scale: torch.Tensor | float | None = None  # after this step's update (settled: 1.0 without scaling)
    moe_layers: dict[str, torch.Tensor] | dict[str, float] = field(default_factory=dict)  # per layer, for W&B
    params_norm: torch.Tensor | float | None = None  # --log-params-norm
    validation: dict[str, torch.Tensor] | dict[str, float] = field(default_factory=dict)
    """Result validation's verdicts on this step, by check (1.0: rejected; training/faults/validation.py)."""
    peak_memory: torch.Tensor | float
    """Bytes: this rank's on the device (float64); settled, the largest of any rank."""
    settled: bool = False  # the device fields above hold host numbers
    # The host's own.
    seconds: float = 0.0  # the host's time for the step (on a GPU, until it queued the next)
    memory: dict[str, int] = field(default_factory=dict)  # allocator statistics (--log-memory-to-tensorboard)
    # After the loop applied the step.
    learning_rate: float = 0.0  # the first group's, after this step (as Megatron logs it)
    skipped_iterations: int = 0  # the run's counters after this step
    nan_iterations: int = 0


@dataclass(kw_only=True)
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

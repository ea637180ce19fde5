"""One training step: a global batch through the pipeline schedule, the loss check, the optimizer step.

A step is skipped for a NaN/Inf loss or gradient norm (counted as a NaN iteration, and towards
``--max-consecutive-skipped-iterations``), or for an fp16 loss-scale overflow (a skipped iteration
only: the scaler backs off and training goes on, as in Megatron). Under fp16 a NaN/Inf loss still
goes through the optimizer step, whose overflow check finds the gradients it made and backs the
scale off, as Megatron's does; the iteration counts as a NaN iteration.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from core.device import current_device
from core.pipeline_parallel.losses import reduce_loss_logs
from core.pipeline_parallel.mailbox import PipelineShapeError
from core.transformer.moe.moe_logging import reduce_moe_metrics
from training import faults
from training.batches import BatchStream
from training.errors import ConfigError
from training.state import Session, StepResult, TrainState
from training.throughput import peak_memory_bytes

if TYPE_CHECKING:
    from training.run import Run


def train_step(run: Run, session: Session, record=None) -> StepResult:
    """One global batch: forward/backward over all microbatches, then the optimizer step (or a skip).

    ``record``: a ``ScheduleRecord`` the schedule fills (the timeline's iterations).
    """
    state, optimizer = session.state, session.model.optimizer
    iteration = state.iteration + 1
    faults.phase("forward-backward (pipeline send/recv, data-parallel gradient all-reduce)", iteration)
    optimizer.zero_grad()  # and the chunks' gradient buffers
    num_microbatches = run.microbatches.num_microbatches(state.consumed_samples)  # a ramp grows it
    losses = run_global_batch(
        run, session, session.train_data, state.consumed_samples, num_microbatches, record=record
    )
    moe_losses, moe_layers = moe_metrics(run, session, num_microbatches)
    if losses is not None:
        losses |= moe_losses
    faults.phase("the loss check (all-reduce)", iteration)
    bad_loss, peak_memory = max_over_ranks(
        [
            1.0 if losses is not None and not all(math.isfinite(v) for v in losses.values()) else 0.0,
            float(peak_memory_bytes(current_device())),
        ]
    )
    if bad_loss and run.training.check_for_nan_in_loss_and_grad:
        raise FloatingPointError(
            f"loss is {losses} at iteration {iteration} (--check-for-nan-in-loss-and-grad)"
        )
    applied, grad_norm, num_zeros, overflow = False, None, None, False
    if not bad_loss or optimizer.grad_scaler is not None:
        faults.phase("the optimizer step (gradient-norm all-reduce)", iteration)
        applied, grad_norm, num_zeros = optimizer.step()
        overflow = not applied and optimizer.last_step_overflowed
        if not applied and not overflow and run.training.check_for_nan_in_loss_and_grad:
            raise FloatingPointError(
                f"gradient norm is {grad_norm} at iteration {iteration} (--check-for-nan-in-loss-and-grad)"
            )
    _count_skips(run, state, applied=applied, overflow=overflow, bad_loss=bool(bad_loss))
    global_batch_size = run.microbatches.global_batch_size(state.consumed_samples)
    return StepResult(
        losses, grad_norm, num_zeros, applied, peak_memory, global_batch_size, moe_layers=moe_layers
    )


def moe_metrics(
    run: Run, session: Session, num_microbatches: int
) -> tuple[dict[str, float], dict[str, float]]:
    """The step's MoE auxiliary losses as Megatron logs them (``load_balancing_loss``, ``z_loss``: the
    mean over MoE layers), and with ``--moe-per-layer-logging`` each layer's (``moe/<name>_layer_<i>``,
    for W&B and TensorBoard). A collective on every rank; nothing without experts."""
    if run.model.num_moe_experts is None:
        return {}, {}
    summary, per_layer = reduce_moe_metrics(session.model.modules, run.model, num_microbatches)
    if not run.model.moe_per_layer_logging:
        return summary, {}
    moe_layers = [i for i in range(run.model.num_layers) if run.model.is_moe_layer(i)]
    return summary, {
        f"moe/{name}_layer_{i}": values[i] for name, values in per_layer.items() for i in moe_layers
    }


def _count_skips(run: Run, state: TrainState, *, applied: bool, overflow: bool, bad_loss: bool) -> None:
    """A loss-scale overflow is a skipped iteration; a NaN/Inf one is also a NaN iteration, and too
    many of those in a row end the run."""
    if applied:
        state.consecutive_skipped = 0
    elif overflow and not bad_loss:
        state.skipped_iterations += 1
    else:
        state.skipped_iterations += 1
        state.nan_iterations += 1
        state.consecutive_skipped += 1
        if state.consecutive_skipped >= run.training.max_consecutive_skipped_iterations:
            raise RuntimeError(
                f"{state.consecutive_skipped} consecutive iterations had a NaN/inf loss or gradient "
                f"and were skipped (iteration {state.iteration + 1}); stopping. Lower --lr or "
                "check the data; --max-consecutive-skipped-iterations sets the limit"
            )


def run_global_batch(
    run: Run,
    session: Session,
    data: BatchStream,
    consumed_samples: int,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    record=None,
) -> dict[str, float] | None:
    """One global batch through the pipeline schedule; returns the reported losses (``loss_func``'s log
    dict, each key reduced over microbatches and data-parallel ranks) on the loss stage, else None."""
    chunks = session.model.chunks
    iterators = _iterators(chunks, data, consumed_samples, num_microbatches)
    micro_batch_size, seq_length = run.training.micro_batch_size, run.gpt.seq_length
    try:
        logs = session.forward_backward(
            forward_step_func=session.forward_step_func,
            data_iterator=_one_or_list(iterators),
            model=_one_or_list(chunks),
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            record=record,
        )
    except PipelineShapeError as err:  # the model's stages disagree with --seq-length/--micro-batch-size
        raise ConfigError(
            f"{err} (--seq-length {seq_length}, --micro-batch-size {micro_batch_size})"
        ) from None
    return reduce_loss_logs(logs, session.groups.dp_cp) or None


def _iterators(chunks, stream: BatchStream, consumed_samples: int, num_microbatches: int) -> list:
    """Per chunk, an iterator over this step's microbatches (None for a chunk that reads no data)."""
    reads = [c.pre_process or c.post_process for c in chunks]
    batches = stream.step(consumed_samples, num_microbatches) if any(reads) else []
    return [iter(batches) if r else None for r in reads]


def _one_or_list(items: list):
    return items if len(items) > 1 else items[0]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    return bool(max_over_ranks([1.0 if flag else 0.0])[0])


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over all ranks, in one collective (none at world size 1)."""
    if dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=current_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()

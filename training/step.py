"""One training step: a global batch through the pipeline schedule, the loss check, the optimizer step.

A step is skipped for a NaN/Inf loss or gradient norm (counted as a NaN iteration, and towards
``--max-consecutive-skipped-iterations``), or for an fp16 loss-scale overflow (a skipped iteration
only: the scaler backs off and training goes on, as in Megatron). Under fp16 a NaN/Inf loss still
goes through the optimizer step, whose overflow check finds the gradients it made and backs the
scale off, as Megatron's does; the iteration counts as a NaN iteration.

All of it is decided on the device: the losses stay there, a NaN/Inf loss on any rank is found by
one small all-reduce, and the optimizer skips on the device (``step_on_device``). The host reads
the outcome later, when :mod:`training.step_ledger` settles the steps, and the loop counts and
checks them (:func:`training.loop.apply_step`); on a GPU nothing in a step waits for the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from core.device import current_device
from core.pipeline_parallel.losses import reduce_loss_logs_on_device
from core.pipeline_parallel.mailbox import PipelineShapeError
from core.tensor_parallel.fp8 import update_fp8_scales
from core.transformer.moe.moe_logging import reduce_moe_metrics_on_device
from training import faults
from training.data.batches import BatchStream
from training.errors import ConfigError
from training.reporting.throughput import peak_memory_bytes
from training.state import Session, Step

if TYPE_CHECKING:
    from training.faults.validation import ResultValidator
    from training.run import Run


def train_step(
    run: Run,
    session: Session,
    record=None,
    learning_rates: list[torch.Tensor] | None = None,
    validator: ResultValidator | None = None,
) -> Step:
    """One global batch: forward/backward over all microbatches, then the optimizer step (or a skip).

    ``record``: a ``ScheduleRecord`` the schedule fills (the timeline's iterations).
    ``learning_rates``: per parameter group, this step's learning rate as a device tensor (see
    :mod:`training.step_ledger`), else the groups' own.
    ``validator``: result validation's checks (:mod:`training.faults.validation`), which may hold the
    update off on the device.
    """
    state, optimizer = session.state, session.optimizer
    iteration = state.iteration + 1
    faults.phase(
        "forward-backward (pipeline send/recv, data-parallel gradient all-reduce)", iteration, "forward"
    )
    optimizer.zero_grad()  # and the chunks' gradient buffers
    num_microbatches = run.microbatches.num_microbatches(state.consumed_samples)  # a ramp grows it
    losses = run_global_batch(
        run, session, session.train_data, state.consumed_samples, num_microbatches, record=record
    )
    if run.model.fp8 is not None:  # the step's FP8 casts end: amaxes reduced, histories pushed, copies freed
        update_fp8_scales(session.model.modules)
    moe_losses, moe_layers = moe_metrics(run, session, num_microbatches)
    if losses is not None:
        losses |= moe_losses
    faults.phase("the loss check (all-reduce)", iteration)
    bad_loss, reduced = _bad_loss_on_any_rank(losses, validator and validator.local_flags(losses))
    gate = validator and validator.gate(iteration, bad_loss, reduced)
    faults.phase("the optimizer step (gradient-norm all-reduce)", iteration, "optimizer")
    outcome = optimizer.step_on_device(skip=bad_loss, lrs=learning_rates, gate=gate)
    device = current_device()
    return Step(
        iteration=iteration,
        losses=losses,
        applied=outcome.applied,
        bad_loss=bad_loss,
        grad_norm=outcome.grad_norm,
        overflow=outcome.overflow,
        num_zeros=outcome.num_zeros,
        loss_scale=None if optimizer.grad_scaler is None else optimizer.get_loss_scale().clone(),
        moe_layers=moe_layers,
        validation=validator.step_flags() if validator else {},
        peak_memory=torch.full((), float(peak_memory_bytes(device)), dtype=torch.float64, device=device),
    )


def _bad_loss_on_any_rank(
    losses: dict[str, torch.Tensor] | None, extra: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A bool device tensor: some rank's reported losses hold a NaN or Inf; and ``extra`` (float64
    flags, result validation's) at their maximum over ranks. One MAX all-reduce for both."""
    bad = torch.zeros((), dtype=torch.float64, device=current_device())
    if losses:
        bad = (~torch.isfinite(torch.stack([v.to(torch.float64) for v in losses.values()]))).any().double()
    flags = bad.reshape(1) if extra is None else torch.cat([bad.reshape(1), extra])
    if dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags[0] > 0, (None if extra is None else flags[1:])


def moe_metrics(
    run: Run, session: Session, num_microbatches: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The step's MoE auxiliary losses as Megatron logs them (``load_balancing_loss``, ``z_loss``: the
    mean over MoE layers), and with ``--moe-per-layer-logging`` each layer's (``moe/<name>_layer_<i>``,
    for W&B and TensorBoard), as device tensors. A collective on every rank; nothing without experts."""
    if run.model.num_moe_experts is None:
        return {}, {}
    summary, per_layer = reduce_moe_metrics_on_device(
        session.model.modules, run.model, num_microbatches, session.groups
    )
    if not run.model.moe_per_layer_logging:
        return summary, {}
    moe_layers = [i for i in range(run.model.num_layers) if run.model.is_moe_layer(i)]
    return summary, {
        f"moe/{name}_layer_{i}": values[i] for name, values in per_layer.items() for i in moe_layers
    }


def run_global_batch(
    run: Run,
    session: Session,
    data: BatchStream,
    consumed_samples: int,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    record=None,
) -> dict[str, torch.Tensor] | None:
    """One global batch through the pipeline schedule; returns the reported losses (``loss_func``'s log
    dict, each key reduced over microbatches and data-parallel ranks, as 0-dim device tensors) on the
    loss stage, else None."""
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
            schedule_hooks=session.hooks,
            pg_collection=session.groups,
        )
    except PipelineShapeError as err:  # the model's stages disagree with --seq-length/--micro-batch-size
        raise ConfigError(
            f"{err} (--seq-length {seq_length}, --micro-batch-size {micro_batch_size})"
        ) from None
    return reduce_loss_logs_on_device(logs, session.groups.dp_cp) or None


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

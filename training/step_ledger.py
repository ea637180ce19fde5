"""What the training steps decided on the device, read by the host only where it must look.

A step (:func:`training.step.train_step`) leaves its results on the device: the reported losses,
whether the update was applied, an fp16 overflow, a NaN/Inf loss, the gradient norm, the loss scale.
On a GPU the host then queues the next step at once instead of waiting for this one. The ledger
keeps those steps (:class:`~training.state.Step`) until a *settling point* — a log step, an
evaluation, a save, a stop, the end of training — where one read brings them all to the host
(:meth:`StepLedger.settle`) and returns them, in order, with host numbers in place of the device
values. The ledger decides nothing: the loop (:func:`training.loop.apply_step`) then does, step by
step, what it would have done had it read each step at once — the NaN checks, the skip counters and
their stop, the learning-rate scheduler's advance after each applied step, the losses, the W&B rows.

Learning rates between settling points. Megatron's scheduler advances only after an applied step,
and the host does not know which steps were applied. For the k-th step since the last settling
point, at most k steps before it were applied: the ledger writes the learning rate each parameter
group would have after j of them, for j = k (one new column of a small device table per step,
``torch.fill_`` from the host: no copy), and the step picks column "applied so far" on the device.
The fused optimizer takes the picked value as a tensor. Where that cannot work — no fused optimizer
(torch < 2.4 on a CPU), a weight-decay ramp (the fused kernels take the weight decay as a number) —
the ledger settles after every step: one wait per step, and the groups' numbers are exact. A change
of the batch-size increment settles first (the table assumes one increment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from training.state import Step

if TYPE_CHECKING:
    from core.optimizer.lr_scheduler import OptimizerParamScheduler


class StepLedger:
    """The steps not yet read, the device learning-rate table, and the one read that settles them."""

    def __init__(self, optimizer, scheduler: OptimizerParamScheduler, device: torch.device) -> None:
        self.pending: list[Step] = []
        self.settle_every_step = not optimizer.fused or scheduler.schedules_weight_decay
        self.rates = None if self.settle_every_step else _DeviceLearningRates(scheduler, device)

    def must_settle_before(self, global_batch_size: int) -> bool:
        """Whether the next step needs the host's numbers exact first (another batch-size increment)."""
        return bool(self.pending) and self.pending[-1].global_batch_size != global_batch_size

    def learning_rates(self, global_batch_size: int) -> list[torch.Tensor] | None:
        """The next step's learning rate per parameter group, on the device (None: the groups' own).

        Read from the scheduler as the loop left it: the loop applies every settled step before the
        next step starts."""
        return None if self.rates is None else self.rates.next(global_batch_size)

    def add(self, step: Step) -> None:
        self.pending.append(step)
        if self.rates is not None:
            self.rates.count(step.applied)

    def settle(self) -> list[Step]:
        """Every pending step, in order, with its device values read (one wait): the loop applies them."""
        steps, self.pending = self.pending, []
        if not steps:
            return []
        layouts, tensors = [], []
        for step in steps:
            names, values = _device_values(step)
            layouts.append(names)
            tensors.extend(values)
        peaks = torch.stack([step.peak_memory for step in steps])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        numbers = torch.cat([peaks, *tensors]).tolist()
        if self.rates is not None:
            self.rates.reset()
        position = len(steps)
        for step, names, peak in zip(steps, layouts, numbers):
            _write_host_values(step, dict(zip(names, numbers[position : position + len(names)])), peak)
            position += len(names)
        return steps


def _device_values(step: Step) -> tuple[list[str], list[torch.Tensor]]:
    """The names and flat float64 tensors the settling read brings to the host, in one order."""
    named: dict[str, torch.Tensor | None] = {
        "applied": step.applied,
        "bad_loss": step.bad_loss,
        "overflow": step.overflow,
        "grad_norm": step.grad_norm,
        "num_zeros": step.num_zeros,
        "loss_scale": step.loss_scale,
        "params_norm": step.params_norm,
    }
    named.update({f"loss\0{k}": v for k, v in (step.losses or {}).items()})
    named.update({f"moe\0{k}": v for k, v in step.moe_layers.items()})
    named.update({f"val\0{k}": v for k, v in step.validation.items()})
    names = [k for k, v in named.items() if v is not None]
    return names, [named[k].detach().reshape(1).to(torch.float64) for k in names]


def _write_host_values(step: Step, values: dict[str, float], peak: float) -> None:
    """The step's device fields replaced by the numbers read for them."""
    step.applied, step.bad_loss = bool(values["applied"]), bool(values["bad_loss"])
    step.overflow = bool(values.get("overflow", 0.0))
    if step.losses is not None:
        step.losses = {k.split("\0", 1)[1]: v for k, v in values.items() if k.startswith("loss\0")}
    step.moe_layers = {k.split("\0", 1)[1]: v for k, v in values.items() if k.startswith("moe\0")}
    step.validation = {k.split("\0", 1)[1]: v for k, v in values.items() if k.startswith("val\0")}
    step.grad_norm = None if step.overflow else values["grad_norm"]
    zeros = values.get("num_zeros")
    step.num_zeros = int(zeros) if zeros is not None and step.applied else None
    step.loss_scale = values.get("loss_scale", 1.0)
    step.params_norm = values.get("params_norm")
    step.peak_memory = peak
    step.settled = True


class _DeviceLearningRates:
    """Per parameter group, the learning rate after j applied steps since the last settling point,
    for every j the current step may have seen, as a device table; the step picks its column there.

    CUDA's fused kernels read a float32 learning rate; on a CPU the table is float64 (exact).
    """

    def __init__(self, scheduler: OptimizerParamScheduler, device: torch.device) -> None:
        self.scheduler = scheduler
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        groups = len(scheduler.optimizer.param_groups)
        self.table = torch.zeros((groups, 16), dtype=dtype, device=device)
        self.applied = torch.zeros((), dtype=torch.int64, device=device)  # since the last settling point
        self.columns, self.base = 0, scheduler.num_steps

    def next(self, increment: int) -> list[torch.Tensor]:
        if self.columns == 0:
            self.base = self.scheduler.num_steps
        if self.columns == self.table.shape[1]:
            self.table = torch.cat([self.table, torch.zeros_like(self.table)], dim=1)
        for group, lr in enumerate(self.scheduler.group_lrs_at(self.base + self.columns * increment)):
            self.table[group, self.columns].fill_(lr)
        self.columns += 1
        return list(self.table.index_select(1, self.applied.reshape(1)).reshape(-1).unbind(0))

    def count(self, applied: torch.Tensor) -> None:
        self.applied += applied.to(torch.int64)

    def reset(self) -> None:
        self.applied.zero_()
        self.columns = 0

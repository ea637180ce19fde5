"""What the training steps decided on the device, read by the host only where it must look.

A step (:func:`training.step.train_step`) leaves its results on the device: the reported losses,
whether the update was applied, an fp16 overflow, a NaN/Inf loss, the gradient norm, the loss scale.
On a GPU the host then queues the next step at once instead of waiting for this one. The ledger
keeps those results (:class:`PendingStep`) until a *settling point* — a log step, an evaluation, a
save, a stop, the end of training — where one read brings them all to the host
(:meth:`StepLedger.settle`). The host then replays, step by step and in order, what the loop did
after each step before: the skipped and NaN iteration counters, the stop after
``--max-consecutive-skipped-iterations``, the errors of ``--check-for-nan-in-loss-and-grad`` (named
with the iteration they happened in; the skipped step changed nothing in between), the learning-rate
scheduler's advance after each applied step, the per-iteration losses, and each step's W&B row.

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from training.state import StepResult

if TYPE_CHECKING:
    from core.optimizer.lr_scheduler import OptimizerParamScheduler
    from training.run import Run
    from training.state import TrainState


@dataclass
class PendingStep:
    """One step's results as the device holds them (0-dim tensors unless said), and what the host knew."""

    iteration: int
    losses: dict[str, torch.Tensor] | None  # loss_func's reported values, on the loss stage
    applied: torch.Tensor  # bool
    bad_loss: torch.Tensor  # bool: a NaN/Inf loss on some rank
    grad_norm: torch.Tensor
    overflow: torch.Tensor | None = None  # bool, with loss scaling
    num_zeros: torch.Tensor | None = None
    loss_scale: torch.Tensor | None = None  # after this step's update, with loss scaling
    moe_layers: dict[str, torch.Tensor] = field(default_factory=dict)
    params_norm: torch.Tensor | None = None
    peak_memory: torch.Tensor | None = None  # this rank's, float64
    seconds: float = 0.0
    consumed_samples: int = 0
    increment: int = 0  # samples the scheduler advances by if the step applied
    memory: dict[str, int] = field(default_factory=dict)  # allocator statistics after the step (host)

    def device_values(self) -> tuple[list[str], list[torch.Tensor]]:
        """The names and flat float64 tensors the settling read brings to the host, in one order."""
        named: dict[str, torch.Tensor | None] = {
            "applied": self.applied,
            "bad_loss": self.bad_loss,
            "overflow": self.overflow,
            "grad_norm": self.grad_norm,
            "num_zeros": self.num_zeros,
            "loss_scale": self.loss_scale,
            "params_norm": self.params_norm,
        }
        named.update({f"loss\0{k}": v for k, v in (self.losses or {}).items()})
        named.update({f"moe\0{k}": v for k, v in self.moe_layers.items()})
        names = [k for k, v in named.items() if v is not None]
        return names, [named[k].detach().reshape(1).to(torch.float64) for k in names]


class StepLedger:
    """The steps not yet read, the device learning-rate table, and the one read that settles them."""

    def __init__(self, run: Run, optimizer, scheduler: OptimizerParamScheduler, device: torch.device) -> None:
        self.run, self.optimizer, self.scheduler = run, optimizer, scheduler
        self.pending: list[PendingStep] = []
        self.settle_every_step = not optimizer.fused or scheduler.schedules_weight_decay
        self.rates = None if self.settle_every_step else _DeviceLearningRates(scheduler, device)

    def must_settle_before(self, increment: int) -> bool:
        """Whether the next step needs the host's numbers exact first (another batch-size increment)."""
        return bool(self.pending) and self.pending[-1].increment != increment

    def learning_rates(self, increment: int) -> list[torch.Tensor] | None:
        """The next step's learning rate per parameter group, on the device (None: the groups' own)."""
        return None if self.rates is None else self.rates.next(increment)

    def add(self, step: PendingStep) -> None:
        self.pending.append(step)
        if self.rates is not None:
            self.rates.count(step.applied)

    def settle(self, state: TrainState, report: Callable[[StepResult], None]) -> None:
        """Read every pending step (one wait), replay the loop's bookkeeping and ``report`` each, in order.

        Raises what the loop raised after the failing step (too many consecutive skips,
        ``--check-for-nan-in-loss-and-grad``); the steps before it are reported first.
        """
        steps, self.pending = self.pending, []
        if not steps:
            return
        layouts, tensors = [], []
        for step in steps:
            names, values = step.device_values()
            layouts.append(names)
            tensors.extend(values)
        peaks = torch.stack([step.peak_memory for step in steps])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        numbers = torch.cat([peaks, *tensors]).tolist()
        if self.rates is not None:
            self.rates.reset()
        position = len(steps)
        for i, (step, names) in enumerate(zip(steps, layouts)):
            values = dict(zip(names, numbers[position : position + len(names)]))
            position += len(names)
            report(self._replay(state, step, values, numbers[i]))

    def _replay(
        self, state: TrainState, step: PendingStep, values: dict[str, float], peak: float
    ) -> StepResult:
        """What the loop did after this step when it read the step at once."""
        applied, bad_loss = bool(values["applied"]), bool(values["bad_loss"])
        overflow = bool(values.get("overflow", 0.0))
        losses = {k.split("\0", 1)[1]: v for k, v in values.items() if k.startswith("loss\0")}
        losses = losses if step.losses is not None else None
        grad_norm = None if overflow else values["grad_norm"]
        check = self.run.training.check_for_nan_in_loss_and_grad
        if bad_loss and check:
            raise FloatingPointError(
                f"loss is {losses} at iteration {step.iteration} (--check-for-nan-in-loss-and-grad)"
            )
        if not applied and not overflow and check:
            raise FloatingPointError(
                f"gradient norm is {grad_norm} at iteration {step.iteration} (--check-for-nan-in-loss-and-grad)"
            )
        count_skips(self.run, state, step.iteration, applied=applied, overflow=overflow, bad_loss=bad_loss)
        if applied:
            self.scheduler.step(increment=step.increment)
        if losses is not None:
            state.losses.append(losses)
        zeros = values.get("num_zeros")
        return StepResult(
            losses,
            grad_norm,
            int(zeros) if zeros is not None and applied else None,
            applied,
            peak,
            step.increment,
            params_norm=values.get("params_norm"),
            seconds=step.seconds,
            moe_layers={k.split("\0", 1)[1]: v for k, v in values.items() if k.startswith("moe\0")},
            iteration=step.iteration,
            learning_rate=self.optimizer.param_groups[0]["lr"],
            loss_scale=values.get("loss_scale", 1.0),
            consumed_samples=step.consumed_samples,
            skipped_iterations=state.skipped_iterations,
            nan_iterations=state.nan_iterations,
            memory=step.memory,
        )


def count_skips(
    run: Run, state: TrainState, iteration: int, *, applied: bool, overflow: bool, bad_loss: bool
) -> None:
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
                f"and were skipped (iteration {iteration}); stopping. Lower --lr or "
                "check the data; --max-consecutive-skipped-iterations sets the limit"
            )


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

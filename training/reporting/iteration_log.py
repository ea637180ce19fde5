"""What an iteration reports: a W&B row every iteration, and Megatron's log line every ``--log-interval``.

The log line averages over the iterations since the previous one (its :class:`LogWindow`), with the
time spent evaluating and saving left out; scripts parse its form, ``iteration N/ M | ... | lm loss: X |``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from training.state import Step, TrainState

if TYPE_CHECKING:
    from training.run import Run


def mean_per_key(values: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(v[key] for v in values) / len(values) for key in values[0]} if values else {}


class LogWindow:
    """The iterations since the last log line: their losses and their time, pauses excluded."""

    def __init__(self) -> None:
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        self.start, self.paused, self.iterations, self.samples = now, 0.0, 0, 0
        self.losses: list[dict[str, float]] = []  # of the iterations that stepped
        self.skipped_losses: list[dict[str, float]] = []  # of the others

    def add(self, step: Step) -> None:
        if step.losses is not None:
            (self.losses if step.applied else self.skipped_losses).append(step.losses)
        self.iterations += 1
        self.samples += step.global_batch_size

    def pause(self, seconds: float) -> None:
        """Time that is not step time (evaluation, saving)."""
        self.paused += seconds

    def seconds_per_iteration(self, now: float) -> float:
        return (now - self.start - self.paused) / max(self.iterations, 1)

    def mean_losses(self) -> dict[str, float]:
        """Megatron averages the iterations that stepped; if every one was skipped, theirs instead of 0."""
        return mean_per_key(self.losses or self.skipped_losses) or {"lm loss": float("nan")}


def wandb_row(run: Run, step: Step, flops: float, peak: float | None) -> dict:
    """One iteration's numbers under Megatron's W&B keys (plus a few of Trident's), every iteration.

    ``flops``: model FLOPs per sample; ``batch-size`` is this iteration's global batch (a ramp grows it).
    """
    gbs = step.global_batch_size
    tflops = flops * gbs / (step.seconds * 1e12 * run.parallel.world_size)
    row: dict[str, Any] = {
        "learning-rate": step.learning_rate,
        "batch-size": gbs,
        "samples vs steps": step.consumed_samples,
        "loss-scale": step.loss_scale,
        "iteration-time": step.seconds,
        "throughput": tflops,
        "tokens-per-second": gbs * run.gpt.seq_length / step.seconds,
        "skipped-iterations": step.skipped_iterations,
        "nan-iterations": step.nan_iterations,
    }
    row.update(step.losses or {})  # "lm loss", whatever else loss_func reports, MoE's auxiliary losses
    row.update(step.moe_layers)
    optional = {"grad-norm": step.grad_norm, "num-zeros": step.num_zeros, "params-norm": step.params_norm}
    row.update({key: value for key, value in optional.items() if value is not None})
    if peak is not None:
        row["mfu"] = tflops / peak
    if run.logging.log_memory_to_tensorboard:
        row.update(step.memory)
        row["mem-max-allocated-bytes"] = step.peak_memory  # the largest of any rank
    return row


def log_line(
    run: Run,
    state: TrainState,
    step: Step,
    window: LogWindow,
    flops: float,
    peak: float | None,
) -> str:
    """Megatron's log line, averaged over ``window``; starts the next window.

    ``flops``: model FLOPs per sample. Throughput counts the window's samples (a ramp changes the batch
    within it); "global batch size" is the last iteration's, as Megatron prints it.
    """
    now = time.perf_counter()
    seconds = window.seconds_per_iteration(now)
    samples_per_iteration = window.samples / max(window.iterations, 1)
    tflops = flops * samples_per_iteration / (seconds * 1e12 * run.parallel.world_size)
    fields = [
        f"iteration {state.iteration:8d}/{run.training.train_iters:8d}",
        f"consumed samples: {state.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {seconds * 1000:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {tflops:.4g}",
    ]
    if peak is not None:
        fields.append(f"MFU: {100 * tflops / peak:.1f}%")
    fields += [
        f"learning rate: {step.learning_rate:.6E}",
        f"global batch size: {step.global_batch_size:5d}",
        *(f"{key}: {value:.6E}" for key, value in window.mean_losses().items()),
        f"loss scale: {step.loss_scale:.1f}",
        f"grad norm: {float('nan') if step.grad_norm is None else step.grad_norm:.3f}",
    ]
    if step.num_zeros is not None:
        fields.append(f"num zeros: {step.num_zeros}")
    if step.params_norm is not None:
        fields.append(f"params norm: {step.params_norm:.3f}")
    fields += [
        f"tokens/s: {samples_per_iteration * run.gpt.seq_length / seconds:.0f}",
        f"peak memory per rank (MB): {step.peak_memory / 2**20:.0f}",
        f"number of skipped iterations: {state.skipped_iterations:3d}",
        f"number of nan iterations: {state.nan_iterations:3d}",
    ]
    window.reset(now)
    return " " + " | ".join(fields) + " |"

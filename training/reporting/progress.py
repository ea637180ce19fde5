"""Timestamps and an ETA on the log line, and the summary printed when a run ends.

The loop's log line keeps Megatron's form; ``Progress.line`` puts Megatron's ``[YYYY-MM-DD hh:mm:ss]``
before it and an ``ETA: h:mm:ss |`` field after it, so a parser that reads
``iteration N/ M | ... | lm loss: X |`` reads it unchanged. The ETA is the mean wall time per
iteration since this process started training (evaluations and checkpoints included) times the
iterations left. ``Progress.summary`` says what the run did and what to try next (the command that
resumes the run or trains it longer: ``training.reporting.launch_command``).
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING

from training.reporting.launch_command import next_command
from training.reporting.logging_utils import print_line

if TYPE_CHECKING:
    from training.reporting.run_logging import RunLoggers
    from training.run import Run


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


class Progress:
    """Wall-clock bookkeeping of one ``pretrain`` call from its first training step."""

    def __init__(self, state, train_iters: int, *, prints: bool = True, batches=None) -> None:
        """``batches``: a ``BatchSizeSchedule`` whose batch grows; the ETA then counts samples, not steps."""
        self.state, self.train_iters, self.prints = state, train_iters, prints
        self.start_iteration, self.start_samples = state.iteration, state.consumed_samples
        self.start = time.monotonic()
        self.batches = batches if batches is not None and batches.changes else None

    def eta_seconds(self, iteration: int) -> float | None:
        done = iteration - self.start_iteration
        if done <= 0:
            return None
        elapsed = time.monotonic() - self.start
        if self.batches is None:
            return elapsed / done * (self.train_iters - iteration)
        consumed = self.state.consumed_samples  # along a ramp, later steps take more samples, and time
        left = self.batches.consumed_after(consumed, self.train_iters - iteration) - consumed
        return elapsed / max(consumed - self.start_samples, 1) * left

    def line(self, text: str) -> str:
        """``text`` (a Megatron log line, starting with a space) with the time before it and the ETA after."""
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        eta = self.eta_seconds(self.state.iteration)
        return f" [{now}]{text} ETA: {'?' if eta is None else _clock(eta)} |"

    def print_log_line(self, text: str) -> None:
        """Print ``line(text)`` if this rank prints (the one that has the loss)."""
        if self.prints:
            print_line(self.line(text))

    def summary(self, run: Run, loggers: RunLoggers) -> list[str]:
        """Lines for the end of the run: time, tokens, final losses, where things went, what next."""
        iteration, consumed_samples = self.state.iteration, self.state.consumed_samples
        elapsed = time.monotonic() - self.start
        ran = iteration - self.start_iteration
        seq_length, train_iters, save = run.gpt.seq_length, run.training.train_iters, run.checkpointing.save
        tokens = (consumed_samples - self.start_samples) * seq_length  # a batch ramp changes the batch
        head = (
            f"run summary: {ran} iterations in {_clock(elapsed)} (now at {iteration}/{train_iters}), "
            f"{tokens:,} tokens this run ({consumed_samples * seq_length:,} in all, "
            f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s)"
        )
        lines = [head]
        train, valid = loggers.last.get("lm loss"), loggers.last.get("validation/lm loss")
        lines.append(
            f"  final train lm loss: {'n/a' if train is None else f'{train:.4f}'} | final validation lm loss: "
            f"{'n/a (no evaluation ran)' if valid is None else f'{valid:.4f}'}"
        )
        if save:
            lines.append(f"  checkpoint: {save} (iteration {iteration})")
            after = next_command(run.args, iteration)
            lines.append(f"  {after.label}: {after.command}")
            lines += [f"    ({note})" for note in after.notes]
        else:
            lines.append("  checkpoint: none (give --save DIR to keep the model)")
        if loggers.dir:
            lines.append(f"  W&B run: {loggers.dir}" + ("" if loggers.id is None else f" (id {loggers.id})"))
            lines.append(f"  upload an offline W&B run: wandb sync {loggers.dir.rsplit('/files', 1)[0]}")
        if run.logging.tensorboard_dir:
            lines.append(f"  TensorBoard: tensorboard --logdir {run.logging.tensorboard_dir}")
        return lines

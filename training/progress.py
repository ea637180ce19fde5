"""Timestamps and an ETA on the log line, and the summary printed when a run ends.

The loop's log line keeps Megatron's form; ``Progress.line`` puts Megatron's ``[YYYY-MM-DD hh:mm:ss]``
before it and an ``ETA: h:mm:ss |`` field after it, so a parser that reads
``iteration N/ M | ... | lm loss: X |`` reads it unchanged. The ETA is the mean wall time per
iteration since this process started training (evaluations and checkpoints included) times the
iterations left. ``Progress.summary`` says what the run did and what to try next (the command that
resumes the run or trains it longer: ``training.launch_command``).
"""

from __future__ import annotations

import argparse
import datetime
import time

from training.launch_command import next_command
from training.logging_utils import print_rank_last


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


class Progress:
    """Wall-clock bookkeeping of one ``pretrain`` call from its first training step."""

    def __init__(self, state, train_iters: int) -> None:
        self.state, self.train_iters = state, train_iters
        self.start_iteration = state.iteration
        self.start = time.monotonic()

    def eta_seconds(self, iteration: int) -> float | None:
        done = iteration - self.start_iteration
        if done <= 0:
            return None
        return (time.monotonic() - self.start) / done * (self.train_iters - iteration)

    def line(self, text: str) -> str:
        """``text`` (a Megatron log line, starting with a space) with the time before it and the ETA after."""
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        eta = self.eta_seconds(self.state.iteration)
        return f" [{now}]{text} ETA: {'?' if eta is None else _clock(eta)} |"

    def print_log_line(self, text: str) -> None:
        """Print ``line(text)`` from the rank that has the loss."""
        print_rank_last(self.line(text))

    def summary(
        self, args: argparse.Namespace, *, iteration: int, consumed_samples: int, last: dict, run
    ) -> list[str]:
        """Lines for the end of the run: time, tokens, final losses, where things went, what next."""
        elapsed = time.monotonic() - self.start
        ran = iteration - self.start_iteration
        tokens = ran * args.global_batch_size * args.seq_length
        head = (
            f"run summary: {ran} iterations in {_clock(elapsed)} (now at {iteration}/{args.train_iters}), "
            f"{tokens:,} tokens this run ({consumed_samples * args.seq_length:,} in all, "
            f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s)"
        )
        lines = [head]
        train, valid = last.get("lm loss"), last.get("validation/lm loss")
        lines.append(
            f"  final train lm loss: {'n/a' if train is None else f'{train:.4f}'} | final validation lm loss: "
            f"{'n/a (no evaluation ran)' if valid is None else f'{valid:.4f}'}"
        )
        if args.save:
            lines.append(f"  checkpoint: {args.save} (iteration {iteration})")
            after = next_command(args, iteration)
            lines.append(f"  {after.label}: {after.command}")
            lines += [f"    ({note})" for note in after.notes]
        else:
            lines.append("  checkpoint: none (give --save DIR to keep the model)")
        if run.dir:
            lines.append(f"  W&B run: {run.dir}" + ("" if run.id is None else f" (id {run.id})"))
            lines.append(f"  upload an offline W&B run: wandb sync {run.dir.rsplit('/files', 1)[0]}")
        if args.tensorboard_dir:
            lines.append(f"  TensorBoard: tensorboard --logdir {args.tensorboard_dir}")
        return lines

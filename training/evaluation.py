"""Validation loss over ``--eval-iters`` global batches, in eval mode (no dropout), as Megatron does."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from training import faults
from training.reporting.iteration_log import mean_per_key
from training.reporting.logging_utils import print_line
from training.state import Session
from training.step import run_global_batch

if TYPE_CHECKING:
    from training.run import Run


def evaluate(run: Run, session: Session) -> None:
    """Run the validation batches (each evaluation reads the same ones) and report their mean loss."""
    chunks, state, gbs = session.model.chunks, session.state, run.training.global_batch_size
    losses = []
    for chunk in chunks:
        chunk.eval()
    faults.phase("evaluation (pipeline send/recv)", state.iteration)
    try:
        for k in range(run.validation.eval_iters):
            with torch.no_grad():
                reported = run_global_batch(
                    run, session, session.valid_data, k * gbs, run.num_microbatches, forward_only=True
                )
            if reported is not None:
                losses.append(reported)
    finally:
        for chunk in chunks:
            chunk.train()
    if losses:
        keys = list(losses[0])
        read = torch.stack([torch.stack([reported[k] for k in keys]) for reported in losses]).tolist()
        values = mean_per_key([dict(zip(keys, row)) for row in read])  # one read from the device
        if session.logs_loss:
            print_line(
                f" validation loss at iteration {state.iteration} |"
                + "".join(
                    f" {k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E} |" for k, v in values.items()
                )
            )
        session.loggers.log({f"validation/{k}": v for k, v in values.items()}, step=state.iteration)

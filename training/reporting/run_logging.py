"""Where logged scalars go: W&B and TensorBoard side by side, behind the one ``log`` call the loop makes.

``RunLoggers(run, tensorboard_dir=...)`` has a W&B run's ``log(metrics, step)``, ``finish()`` and
``id``, and writes every scalar also to a ``torch.utils.tensorboard.SummaryWriter`` when
``--tensorboard-dir`` is given, on the same rank that talks to W&B (the one that has the loss; others
pass ``tensorboard_dir=None``). It keeps the last value of each metric for the end-of-run summary.
"""

from __future__ import annotations

import math
from typing import Any


class RunLoggers:
    """A W&B run (or ``NullRun``) plus an optional TensorBoard writer, with the last value of each metric."""

    def __init__(
        self, run: Any, *, tensorboard_dir: str | None = None, config: dict[str, Any] | None = None
    ) -> None:
        self.run = run
        self.tensorboard_dir = tensorboard_dir
        self.last: dict[str, float] = {}
        self._writer = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
            for key, value in sorted((config or {}).items()):  # the run's flags, as Megatron writes them
                self._writer.add_text(key, str(value), global_step=0)

    @property
    def id(self) -> str | None:
        return getattr(self.run, "id", None)

    @property
    def dir(self) -> str | None:
        return getattr(self.run, "dir", None)

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.run.log(metrics, step=step)
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.last[name] = float(value)
                if self._writer is not None and math.isfinite(value):
                    self._writer.add_scalar(name, value, global_step=step)

    def finish(self) -> None:
        self.run.finish()
        if self._writer is not None:
            self._writer.close()

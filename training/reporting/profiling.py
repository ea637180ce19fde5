"""``--profile``: a torch.profiler trace of chosen steps on chosen ranks.

With ``--profile --profile-step-start S --profile-step-end E``, each rank in ``--profile-ranks``
records iterations ``S + 1`` to ``E`` (Megatron's window) with ``torch.profiler`` (CPU, and CUDA
when there is a GPU) and writes one trace, readable by Perfetto, ``chrome://tracing`` and
TensorBoard's profiler plugin, into ``--tensorboard-dir`` (else ``./profile``) as
``rank<R>.pt.trace.json``. Other ranks do nothing.

The profiler stops only once no collective it saw start is still running: on gloo a collective runs on
the process group's own threads, and stopping torch's profiler (Kineto) while one of them still records
crashes the process (SIGSEGV), as ``--overlap-param-gather``'s all-gathers, launched at the end of a step
and waited for in the next forward, would. So the loop hands in ``wait_for_collectives``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from training.reporting.logging_utils import print_line


class StepProfiler:
    """Starts torch.profiler before iteration ``start + 1`` and writes the trace after iteration ``end``."""

    def __init__(
        self,
        *,
        enabled: bool,
        start: int,
        end: int,
        rank: int,
        ranks: list[int],
        out_dir: str,
        wait_for_collectives: Callable[[], None] = lambda: None,
    ) -> None:
        self.enabled = enabled and rank in ranks
        self.wait_for_collectives = wait_for_collectives
        self.start, self.end, self.rank = start, end, rank
        self.path = os.path.join(out_dir, f"rank{rank}.pt.trace.json")
        self._profiler: torch.profiler.profile | None = None

    def before_step(self, iteration: int) -> None:
        """Call with the number of iterations done before the step."""
        if self.enabled and iteration == self.start and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()

    def after_step(self, iteration: int) -> None:
        """Call with the number of iterations done after the step."""
        if self._profiler is not None and iteration >= self.end:
            self.stop()

    def stop(self) -> None:
        """Write the trace (also when the run ends inside the window)."""
        if self._profiler is None:
            return
        self.wait_for_collectives()
        self._profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._profiler.export_chrome_trace(self.path)
        self._profiler = None
        print_line(f"rank {self.rank}: profiled iterations {self.start + 1}-{self.end}: {self.path}")

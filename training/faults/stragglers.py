"""Stragglers named (``--log-straggler``): each rank's compute time per iteration, compared at log steps.

Collectives make every rank's iteration as long as the slowest rank's, so the step time cannot name a
slow rank. Its *compute* can: the schedule records every action of the iteration (the clock of
``core.pipeline_parallel.record``: the host's on a CPU, CUDA events on a GPU, read only at log steps, so
no step waits for the device), and a rank's compute is the time of its forward, backward and
weight-gradient actions, not counting the waits for their inputs. At each log step the ranks gather
their median compute per iteration over the window (one iteration slowed by something else, such as
a warm-up or another process on the host, does not make a straggler), and rank 0 prints the
``--straggler-minmax-count`` slowest and fastest ranks, each with its throughput against the median
rank's::

    stragglers, iterations 11-20 (compute per iteration; throughput against the median, 0.412 s):
    slowest rank 2 0.547 s (0.75x) | fastest rank 0 0.401 s (1.03x)

Rank 0 listens on ``127.0.0.1:--straggler-ctrlr-port`` (loopback only, unlike Megatron, which binds
every interface): an HTTP GET of ``/`` turns detection on or off, ``/on`` and ``/off`` set it (any
other path is a 404 and changes nothing). The
ranks take rank 0's setting at each log step, so every rank collects over the same iterations.
``--disable-straggler-on-startup`` starts it off.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from core.device import current_device
from core.pipeline_parallel.record import ScheduleRecord, clock_for
from training.errors import ConfigError
from training.faults.agreement import distributed, fail_together
from training.reporting.logging_utils import print_line
from training.run import Run

COMPUTE_KINDS = frozenset({"F", "B", "I", "W"})


@dataclass(frozen=True, kw_only=True)
class StragglerSettings:
    """Megatron's four straggler flags."""

    enabled_on_startup: bool
    minmax_count: int
    port: int

    @classmethod
    def of(cls, run: Run) -> StragglerSettings | None:
        """The run's settings (None without ``--log-straggler``); one ConfigError for a bad value."""
        flags = run.logging
        settings = cls(
            enabled_on_startup=not flags.disable_straggler_on_startup,
            minmax_count=flags.straggler_minmax_count,
            port=flags.straggler_ctrlr_port,
        )
        if not flags.log_straggler:
            return None
        if settings.minmax_count < 1:
            raise ConfigError(f"--straggler-minmax-count must be at least 1, got {settings.minmax_count}")
        if not 1 <= settings.port <= 65535:
            raise ConfigError(f"--straggler-ctrlr-port must be a port number (1-65535), got {settings.port}")
        return settings


def compute_seconds(record: ScheduleRecord) -> float:
    """Seconds this rank computed in one recorded iteration: its F, B, I and W actions, waits excluded."""
    return sum(e.end - e.start for e in record.timed(record.start) if e.kind in COMPUTE_KINDS)


class Switch:
    """Detection on or off, turned by HTTP GETs on ``127.0.0.1:port`` (served on a daemon thread)."""

    def __init__(self, on: bool, port: int) -> None:
        self.on = on
        switch = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                turns = {"/": not switch.on, "/on": True, "/off": False}
                if self.path not in turns:
                    self.send_error(404, "straggler switch: GET /, /on or /off")
                    return
                switch.on = turns[self.path]
                body = f"straggler detection {'on' if switch.on else 'off'}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # the switch's state is in the next log line
                pass

        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as err:
            raise ConfigError(
                f"--straggler-ctrlr-port {port}: cannot listen on 127.0.0.1:{port} ({err.strerror}); "
                "give a free port"
            ) from None
        self.port = self.server.server_address[1]
        threading.Thread(
            target=self.server.serve_forever, name="trident-straggler-switch", daemon=True
        ).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StragglerDetector:
    """Per rank: the records of the iterations it collects, and the report at log steps (module doc)."""

    def __init__(self, settings: StragglerSettings) -> None:
        self.settings = settings
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.clock = clock_for(current_device())
        self.collecting = settings.enabled_on_startup
        self.records: list[ScheduleRecord] = []
        self.first: int | None = None  # the first iteration of the window
        # Rank 0 serves the switch; a port that is taken fails every rank, before any step.
        self.switch = fail_together(
            (lambda: Switch(settings.enabled_on_startup, settings.port)) if self.rank == 0 else None
        )
        if self.switch is not None:
            state = "on" if self.collecting else "off"
            print_line(f"straggler detection {state}; switch: http://127.0.0.1:{self.switch.port}/")

    @classmethod
    def for_run(cls, run: Run) -> StragglerDetector | None:
        settings = StragglerSettings.of(run)
        return cls(settings) if settings is not None else None

    def collects(self, iteration: int) -> bool:
        """Whether ``iteration`` is recorded for the report (the window's first one is remembered)."""
        if self.collecting and self.first is None:
            self.first = iteration
        return self.collecting

    def new_record(self) -> ScheduleRecord:
        """A record for the schedule to fill, on the clock of this rank's device."""
        return ScheduleRecord(clock=self.clock)

    def add(self, record: ScheduleRecord | None) -> None:
        if self.collecting and record is not None:
            self.records.append(record)

    def report(self, iteration: int) -> list[str]:
        """At a log step, on every rank (collectives): the lines rank 0 prints (none elsewhere), then
        every rank takes rank 0's switch for the next window."""
        lines = []
        if self.collecting:
            typical = statistics.median(map(compute_seconds, self.records)) if self.records else 0.0
            everyone = self._gather(typical)
            if self.rank == 0:
                lines = describe(everyone, self.first or iteration, iteration, self.settings.minmax_count)
        self.records.clear()
        self.first = None
        self.collecting = self._agree_on_switch()
        return lines

    def _gather(self, value: float) -> list[float]:
        if not distributed():
            return [value]
        mine = torch.tensor([value], dtype=torch.float64, device=_device())
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [float(t.item()) for t in everyone]

    def _agree_on_switch(self) -> bool:
        on = self.switch.on if self.switch is not None else self.collecting
        if not distributed():
            return on
        flag = torch.tensor([1 if on else 0], device=_device())
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def close(self) -> None:
        if self.switch is not None:
            self.switch.close()


def _device() -> torch.device:
    return torch.device("cpu") if dist.get_backend() == "gloo" else current_device()


def describe(seconds: list[float], first: int, last: int, count: int) -> list[str]:
    """The report of per-rank compute ``seconds`` (rank order) over iterations ``first``-``last``."""
    median = statistics.median(seconds)
    if median <= 0.0:
        return []
    order = sorted(range(len(seconds)), key=lambda r: seconds[r])
    count = min(count, len(seconds))

    def ranks(chosen: list[int]) -> str:
        return ", ".join(f"{r} {seconds[r]:.3f} s ({median / max(seconds[r], 1e-12):.2f}x)" for r in chosen)

    plural = "s" if count > 1 else ""
    line = (
        f"stragglers, iterations {first}-{last} (compute per iteration; throughput against the median, "
        f"{median:.3f} s): slowest rank{plural} {ranks(order[::-1][:count])} | "
        f"fastest rank{plural} {ranks(order[:count])}"
    )
    return [line]

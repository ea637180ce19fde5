"""One training step's peak memory, its host share and, on request, its operators, so two steps compare.

``tools/bench/model.py --profile`` uses it to name where Trident's eager layers and the transformers
model differ: each operator (and, on a GPU, each kernel) with its number of calls and its self time
on each side, the largest differences first. On a CPU the peak comes from the profiler's allocation
records, on a GPU from the caching allocator's statistics. The profiler always runs, for the host
share (:func:`host_share`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


class StepProbe:
    """Peak bytes allocated above the start, and with ``ops`` the per-operator table, of whatever runs
    between its creation and ``stop()``."""

    def __init__(self, device: torch.device, ops: bool = False) -> None:
        self.device, self.want_ops = device, ops
        self.ops: dict[str, tuple[int, float]] = {}
        self.peak, self.host_share = 0, None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profile = profile(activities=activities, profile_memory=device.type != "cuda")
        self.profile.__enter__()
        self.started = time.perf_counter()  # event times count from about here

    def stop(self) -> int:
        """The peak in bytes; ``self.host_share`` is set, and ``self.ops`` holds ``{operator: (calls, self
        milliseconds)}`` if asked for."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed_us = (time.perf_counter() - self.started) * 1e6
        self.profile.__exit__(None, None, None)
        self.host_share = host_share(self.profile, self.device, elapsed_us)
        if self.want_ops:
            self.ops = operator_table(self.profile, self.device)
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.before
        return allocation_peak(self.profile)


def measure(step: Callable[[], object], device: torch.device, ops: bool = False) -> StepProbe:
    """Run ``step`` once under a probe; the probe holds ``peak`` and ``ops``."""
    probe = StepProbe(device, ops)
    step()
    probe.peak = probe.stop()
    return probe


def host_share(prof, device: torch.device, span_us: float) -> float | None:
    """The share of the profiled ``span_us`` (from the profiler's start, where its event times count
    from) in which the device did no work of the step's own:

    * on a GPU, the time no kernel or copy ran: the device waiting on the host (at one rank nothing
      else makes it wait; the profiler's own cost counts as host time too);
    * on a CPU, the time outside ATen's operators (the union of their spans: an operator called inside
      another counts once): Python, the autograd engine's bookkeeping, the framework's own code.

    None for an empty span.
    """
    if span_us <= 0:
        return None
    events = prof.events()
    if device.type == "cuda":
        work = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        work = [e for e in events if e.name.startswith("aten::")]
    return 1.0 - _covered(sorted((e.time_range.start, e.time_range.end) for e in work)) / span_us


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of sorted ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def allocation_peak(prof) -> int:
    """The most bytes held at once, from the profiler's allocation and free records in time order."""
    from torch._C._profiler import _EventType

    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(allocations):
        current += size
        peak = max(peak, current)
    return peak


def operator_table(prof, device: torch.device) -> dict[str, tuple[int, float]]:
    """``{name: (calls, self ms)}``: host time on a CPU; on a GPU, device time where an event has it
    (kernels), else host time."""
    table = {}
    for event in prof.key_averages():
        if event.key.startswith("[memory]"):
            continue
        device_us = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))
        us = device_us if device.type == "cuda" and device_us else event.self_cpu_time_total
        table[event.key] = (event.count, us / 1e3)
    return table


def compare(first: dict, second: dict, top: int = 25) -> list[dict]:
    """The operators whose self time differs most between two tables (either side may lack one)."""
    rows = []
    for name in set(first) | set(second):
        calls_a, ms_a = first.get(name, (0, 0.0))
        calls_b, ms_b = second.get(name, (0, 0.0))
        rows.append({"op": name, "calls": [calls_a, calls_b], "ms": [ms_a, ms_b], "diff_ms": ms_a - ms_b})
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return rows[:top]


def print_comparison(title: str, names: tuple[str, str], first: dict, second: dict, top: int = 25) -> None:
    """The ``compare`` table, with each side's total self time."""
    total = [sum(ms for _, ms in table.values()) for table in (first, second)]
    print(
        f"{title}: self time {names[0]} {total[0]:.0f} ms, {names[1]} {total[1]:.0f} ms (one step, profiled)"
    )
    print(f"  {'operator':<52}{'calls':>13}{'self ms':>19}{'diff ms':>10}")
    for r in compare(first, second, top):
        calls = f"{r['calls'][0]}/{r['calls'][1]}"
        ms = f"{r['ms'][0]:.1f}/{r['ms'][1]:.1f}"
        print(f"  {r['op'][:52]:<52}{calls:>13}{ms:>19}{r['diff_ms']:>10.1f}")

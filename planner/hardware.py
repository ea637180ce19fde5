"""The cluster a plan is for: GPU peak, memory and bandwidths, every number overridable.

Peaks are the dense 16-bit tensor-core figures ``training/reporting/throughput.py`` uses for MFU, and
the dense FP8 figures from the same data sheets, which ``--fp8-format``'s products run at (none on a
GPU without FP8 tensor cores: there FP8 products are costed at the 16-bit rate), and the dense FP32 peaks
of their CUDA cores, which the blockwise recipe's dequantised products run at. Bandwidths
are what a collective achieves, not the data sheet's: NCCL's bus bandwidth on NVLink within a node
and per GPU over the network between nodes, each about 80-90% of the link's rate. The compute
efficiency is the fraction of peak a transformer layer's matrix multiplies reach on that GPU once
kernels are launched back to back; measured costs (``--profile-local``) replace it where they exist.
Every message also pays a fixed latency (a ring collective one per step): a few microseconds on
NVLink, more across nodes, milliseconds between CPU processes sharing cores, which is what makes
many small tensor-parallel collectives expensive there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

from training.reporting.throughput import PEAK_TFLOPS

__all__ = ["BEHIND_KIND", "GPUS", "Cluster", "Gpu", "HostCosts", "Interconnect"]

BEHIND_KIND = "ring_exchange_behind"
"""``HostCosts.collectives``' key for ring attention's exchange in the first group while every other rank
computes on without rounds (as the other pipeline stages do under PP): the exchange waits for a partner
that other work keeps off the cores, which the lockstep timing (every group at once) does not see."""


@dataclass(frozen=True)
class Gpu:
    """One accelerator kind."""

    name: str
    peak_tflops: float
    """Dense bf16/fp16 tensor-core peak."""
    memory_gb: float
    """Usable device memory (GiB as the vendor counts it, 1e9 bytes)."""
    hbm_tb_s: float
    """Device memory bandwidth, for the memory-bound parts of a step (optimizer, softmax)."""
    intra_node_gb_s: float
    """Achieved per-GPU collective bandwidth inside a node (NVLink / xGMI)."""
    inter_node_gb_s: float
    """Achieved per-GPU bandwidth between nodes (InfiniBand / RoCE)."""
    compute_efficiency: float = 0.6
    """Fraction of ``peak_tflops`` a layer's matrix multiplies reach (a stated assumption)."""
    intra_node_latency_us: float = 10.0
    """Fixed cost of one message (one ring step) inside a node."""
    inter_node_latency_us: float = 25.0
    """Fixed cost of one message between nodes."""
    fp8_peak_tflops: float | None = None
    """Dense FP8 tensor-core peak; None: no FP8 tensor cores (FP8 products costed at ``peak_tflops``)."""
    fp32_peak_tflops: float | None = None
    """Dense FP32 peak of the CUDA cores: torch's float32 matrix products (TF32 is off by default), which
    the blockwise recipe's dequantised products are; None: unknown (costed at ``peak_tflops``)."""


@dataclass(frozen=True)
class Interconnect:
    """What a group's messages cost: achieved bytes/s per GPU and seconds per message."""

    bandwidth: float
    latency: float

    def ring(self, size: int, nbytes: float, *, all_reduce: bool = False) -> float:
        """Seconds of a ring all-gather / reduce-scatter of ``nbytes`` (all-reduce: both, twice the steps)."""
        if size <= 1:
            return 0.0
        return (2.0 if all_reduce else 1.0) * (size - 1) * (self.latency + nbytes / size / self.bandwidth)

    def message(self, nbytes: float) -> float:
        """Seconds of one point-to-point message."""
        return self.latency + nbytes / self.bandwidth


def _peak(name: str) -> float:
    return dict(PEAK_TFLOPS)[name]


FP8_PEAK_TFLOPS = {"H100": 1979.0, "H200": 1979.0, "B200": 4500.0, "MI300X": 2615.0}
"""Dense (no sparsity) FP8 tensor-core peaks, TFLOP/s, from the vendors' data sheets: twice the 16-bit
peak on each (H100 SXM: 1,979 against 989). The A100 has no FP8 tensor cores."""

FP32_PEAK_TFLOPS = {"H100": 67.0, "H200": 67.0, "A100": 19.5, "B200": 80.0, "MI300X": 163.4}
"""Dense FP32 peaks of the CUDA (or stream) cores, TFLOP/s, from the same data sheets (B200: the HGX
variant at 1,000 W): a fifteenth of the 16-bit tensor-core peak on an H100."""


def _gpu(name: str, kind: str, memory_gb: float, hbm_tb_s: float, intra: float, inter: float) -> Gpu:
    return Gpu(
        name, _peak(kind), memory_gb, hbm_tb_s, intra, inter,
        fp8_peak_tflops=FP8_PEAK_TFLOPS.get(kind), fp32_peak_tflops=FP32_PEAK_TFLOPS.get(kind),
    )  # fmt: skip


GPUS: dict[str, Gpu] = {
    "h100": _gpu("H100 SXM 80GB", "H100", 80, 3.35, 360, 45),
    "h200": _gpu("H200 SXM 141GB", "H200", 141, 4.8, 360, 45),
    "a100": _gpu("A100 SXM 80GB", "A100", 80, 2.0, 230, 22),
    "a100-40gb": _gpu("A100 SXM 40GB", "A100", 40, 1.55, 230, 22),
    "b200": _gpu("B200 180GB", "B200", 180, 8.0, 720, 45),
    "mi300x": _gpu("MI300X 192GB", "MI300X", 192, 5.3, 300, 45),
}
"""Known GPUs (``--gpu``); a name not here needs ``--peak-tflops`` and ``--gpu-memory-gb``."""


@dataclass(frozen=True)
class HostCosts:
    """What a step pays beyond its layers' compute and collectives, measured where it can be
    (``--profile-local``: :mod:`planner.calibrate`); zero on a cluster never measured."""

    action_seconds: float = 0.0
    """The engine's fixed cost per pipeline compute action: the interpreter's dispatch, posting and
    waiting for its messages, the autograd call around the stage."""
    message_latency: float | None = None
    """Seconds per pipeline message (a point-to-point send); None: the link's collective latency."""
    message_bandwidth: float | None = None
    """Bytes/s of a pipeline message; None: the link's."""
    step_seconds: float = 0.0
    """Fixed cost per training step outside the schedule and the optimizer: what the engine's step
    costs beyond its actions (the loop around the schedule, the loss's reduction, its waits)."""
    optimizer_element_seconds: float | None = None
    """Seconds of the optimizer step per parameter element a rank steps (AdamW, the fp32 main copy
    written back to the parameter, the gradient zeroed); None: the memory-bound model."""
    optimizer_tensor_seconds: float = 0.0
    """Seconds of the optimizer step per tensor a rank steps (each tensor's calls)."""
    slowdown: tuple[float, ...] = ()
    """``slowdown[k - 1]``: how much longer an action takes while ``k`` of the node's ranks compute than
    alone (ranks sharing cores); empty: ideal sharing of ``Cluster.cores``."""
    collectives: tuple = ()
    """``((kind, group size), ((bytes, seconds), ...))`` pairs: a layer's or data parallelism's
    collective (``all_gather``, ``reduce_scatter``, ``all_reduce``) of a whole tensor of ``bytes``, or
    ring attention's exchange (``ring_exchange``), in a group of that size, every group of
    ``collectives_world`` ranks at once among their compute (wall seconds while they all compute); and
    ``ring_exchange_behind``, the exchange in one group while the other ranks compute out of step (as
    other pipeline stages do); empty: the ring formulas over the link's latency and bandwidth."""
    collectives_world: int = 0
    """The ranks that measured ``collectives``, all busy."""

    def collective_seconds(self, kind: str, size: int, nbytes: float) -> float | None:
        """Measured seconds of a ``kind`` collective of ``nbytes`` in a group of ``size`` (see
        ``collectives``): linear between the measured sizes, the smallest's below them, the last two's
        line beyond them; None where unmeasured."""
        points = dict(self.collectives).get((kind, size))
        if not points:
            return None
        if nbytes <= points[0][0] or len(points) == 1:
            return points[0][1]
        segments = list(pairwise(points))
        (b0, t0), (b1, t1) = next(((a, b) for a, b in segments if nbytes <= b[0]), segments[-1])
        return max(points[0][1], t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0))

    def slowdown_at(self, busy: int, cores: int) -> float:
        """The slowdown with ``busy`` ranks computing; beyond the measured counts, the last measured one
        shared by proportionally more ranks; unmeasured, the cores' fair share."""
        if busy <= 0:
            return 1.0
        if not self.slowdown:
            return max(1.0, busy / cores)
        if busy <= len(self.slowdown):
            return self.slowdown[busy - 1]
        return self.slowdown[-1] * busy / len(self.slowdown)


@dataclass(frozen=True)
class Cluster:
    """How many GPUs, how they sit in nodes, and what each can do."""

    num_gpus: int
    gpus_per_node: int
    gpu: Gpu
    memory_headroom: float = 0.9
    """Share of device memory a plan may fill: the rest is the allocator's fragmentation, CUDA
    context and NCCL buffers."""
    cores: int | None = None
    """CPU ranks only: the cores a node's ranks share (None: each rank has its own device)."""
    host: HostCosts = HostCosts()
    """Fixed costs and core sharing, where measured."""

    @property
    def memory_bytes(self) -> float:
        return self.gpu.memory_gb * 1e9

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.memory_headroom

    @property
    def achievable_flops(self) -> float:
        return self.gpu.peak_tflops * 1e12 * self.gpu.compute_efficiency

    @property
    def fp8_peak_tflops(self) -> float:
        """The peak FP8 products run at: the FP8 peak, or the 16-bit one on a GPU without FP8."""
        return self.gpu.fp8_peak_tflops or self.gpu.peak_tflops

    @property
    def blockwise_peak_tflops(self) -> float:
        """The peak the blockwise recipe's products run at: dequantised and multiplied in float32 (the
        FP32 peak; unknown: the 16-bit one)."""
        return self.gpu.fp32_peak_tflops or self.gpu.peak_tflops

    def link(self, group_stride: int, group_size: int) -> Interconnect:
        """The link of a group of ``group_size`` ranks ``group_stride`` apart (in a node or across)."""
        g = self.gpu
        if group_stride * (group_size - 1) < self.gpus_per_node:
            return Interconnect(g.intra_node_gb_s * 1e9, g.intra_node_latency_us * 1e-6)
        return Interconnect(g.inter_node_gb_s * 1e9, g.inter_node_latency_us * 1e-6)

    def with_gpu(self, **changes) -> Cluster:
        return replace(self, gpu=replace(self.gpu, **changes))

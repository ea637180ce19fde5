"""What this machine's ranks pay beyond their layers' compute, measured with real ranks on gloo.

``--profile-local`` measures each layer alone, on one thread; a real step also pays what no layer
shows. Here as many real ranks as the plan has (one thread each, as under ``torchrun``) measure:

* **collectives**: tiny and large all-reduces over every rank (latency and bandwidth of a ring step);
* **pipeline messages**: a point-to-point ping-pong between two ranks, tiny and large (latency and
  bandwidth of one ``isend``/``irecv``);
* **latency under load**: a tiny all-reduce and a message between two ranks while the others
  compute, as in a real step, where a collective waits until its partner holds a core: the larger
  latency of the two ways is kept;
* **shared cores**: the same compute on ``k`` ranks at once, ``k = 1 .. ranks``: how much longer
  each takes than alone (``HostCosts.slowdown``);
* **the engine's fixed costs per action and per step**: the real schedule engine
  (``core.pipeline_parallel``) runs 1F1B (at two microbatch counts) and interleaved ZB-H1 over stages
  that compute nothing; the cost per action and the cost per step are the pair with which the
  shared-core timing of the same tables, plus the per-step cost, gives the measured steps best
  (least squares over the three);
* **collectives inside a layer**: every group of ``g`` consecutive ranks (each size ``g >= 2`` that
  divides the world: the tensor- and context-parallel groups), all groups at once as in a real step,
  runs a short stretch of compute and then one all-gather, reduce-scatter or all-reduce, or ring
  attention's exchange (started before the stretch, waited after it, as the ring does), at the
  sizes of :data:`GROUP_BYTES` and in the model's dtype; what a round takes beyond the same stretch
  of compute with every rank busy is the collective's seconds (``HostCosts.collectives``; a larger
  tensor is never cheaper: each size keeps the least of its own and the larger sizes' seconds). On
  ranks sharing cores that is milliseconds: each collective waits until every rank of its group
  holds a core, which a ring formula over one latency does not see. The collectives are also timed at
  a data-parallel bucket's size (:data:`DP_BYTES`), which the gradient reduction and the parameter
  gather then cost; and ring attention's exchange in one group while the other ranks compute out of
  step, as other pipeline stages do (:data:`BEHIND_KIND`);
* **the optimizer step**: every rank at once (as in a step) runs the step's tail on fp32 main
  parameters: the gradient norm, fused (else foreach) AdamW, the main copy written back to the
  16-bit parameters and the gradient buffer zeroed, once over many small tensors and once over a few
  large ones: seconds per tensor and per element (``HostCosts.optimizer_tensor_seconds``,
  ``optimizer_element_seconds``), which a candidate's optimizer step is then costed with.

Nothing is tuned to a model: every figure is a time measured here, and a model's own layers come
from :mod:`planner.profile`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.model_parallel_config import ModelParallelConfig
from core.optimizer import has_fused_kernel
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE, SCHEDULES, placement_for, schedule_rule
from core.pipeline_parallel.schedule_tables import build_tables
from core.pipeline_parallel.schedules import get_forward_backward_func
from core.spawned import first_result
from core.tensor_parallel.utils import all_gather_single, reduce_scatter_single
from core.transformer.context_parallel.ring import RingExchange
from planner.hardware import BEHIND_KIND, HostCosts
from planner.shared_cores import time_shared

__all__ = [
    "BEHIND_KIND",
    "DP_BYTES",
    "GROUP_BYTES",
    "GROUP_KINDS",
    "HostMeasurement",
    "engine_runs",
    "engine_step_seconds",
    "fit_engine_costs",
    "fit_optimizer_costs",
    "group_sizes",
    "measure_host",
    "monotone",
    "time_group_collectives",
]

ENGINE_CASES = (
    (DEFAULT_SCHEDULE, 1),
    (next(n for n in SCHEDULES if schedule_rule(n).split_backward and schedule_rule(n).interleaves), 2),
)
"""Schedules (and chunks per rank) the engine's fixed cost is measured on: plain 1F1B, and ZB-H1
interleaved over two chunks (a split backward: I and W actions too)."""
_SEQ, _HIDDEN = 8, 8
GROUP_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "ring_exchange")
"""The collectives a layer's tensor-parallel group runs, and ring attention's exchange in a
context-parallel group (each rank sends to the next while receiving from the previous, started before
the block's compute and waited after it: ``RingExchange``) (``HostCosts.collectives``)."""
GROUP_BYTES = (4 << 10, 256 << 10, 4 << 20)
"""Bytes of the whole (gathered) tensor the group collectives are timed at: a loss's per-token values,
a layer's activations at a few thousand tokens, and a large microbatch's."""
DP_BYTES = 16 << 20
"""One more size, for the collectives only (not ring attention's exchange), timed with fewer repeats: a
data-parallel gradient bucket's (a few layers' fp32 gradients), where the three smaller sizes' line would
otherwise be stretched tenfold."""
DP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives data parallelism runs (gradient reduction, parameter gather); a layer's TP ones too."""
OPTIMIZER_CASES = ((256, 1024), (2, 1 << 22))
"""(tensors, elements each) the optimizer step is timed on: many small tensors, then a few large ones
(2 x 2^22 elements: 128 MiB of parameters, gradients and moments, beyond the caches, as a real rank's)."""


def engine_runs(world: int) -> list[tuple[str, int, int]]:
    """(schedule, chunks, microbatches) the engine is timed on: each of :data:`ENGINE_CASES` at
    ``2 world`` microbatches, and 1F1B at ``world`` too (a third action count for the per-step fit)."""
    return [(s, v, 2 * world) for s, v in ENGINE_CASES] + [(ENGINE_CASES[0][0], 1, world)]


@dataclass(frozen=True)
class HostMeasurement:
    """What :func:`measure_host` found: the collectives' ring figures and the host's fixed costs."""

    bandwidth: float
    """Bytes/s of a ring step of an all-reduce over every rank."""
    latency: float
    """Seconds of a ring step's fixed cost, while the other ranks compute (as in a step)."""
    host: HostCosts
    engine_steps: dict
    """(schedule, chunks, microbatches) -> measured seconds of the step whose stages compute nothing."""


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collectives(nbytes: int) -> tuple[float, float]:
    """(seconds of a tiny all-reduce, of one of ``nbytes``) over every rank."""
    timings = []
    for numel, repeats in ((1, 30), (nbytes // 4, 4)):
        buffer = torch.ones(numel)
        dist.all_reduce(buffer)
        dist.barrier()
        timings.append(_median_seconds(lambda b=buffer: dist.all_reduce(b), repeats))
    return timings[0], timings[1]


def _ping_pong(rank: int, nbytes: int, repeats: int, *, barrier: bool = True) -> float:
    """One-way seconds of a ``nbytes`` message between ranks 0 and 1 (half a round trip)."""
    buffer = torch.zeros(max(1, nbytes // 4))
    if barrier:
        dist.barrier()

    def round_trip():
        if rank == 0:
            dist.isend(buffer, 1).wait()
            dist.irecv(buffer, 1).wait()
        elif rank == 1:
            dist.irecv(buffer, 0).wait()
            dist.isend(buffer, 0).wait()

    round_trip()
    seconds = _median_seconds(round_trip, repeats) / 2
    if barrier:
        dist.barrier()
    return seconds


def _slowdowns(rank: int, world: int, units: int = 40, repeats: int = 5) -> tuple[float, ...]:
    """Per ``k``: the time of a stretch of compute while ``k`` ranks run it, over alone. A stretch is
    ``units`` matrix multiplies (tens of milliseconds): longer than the scheduler's time slices,
    which a single short unit would slip between."""
    a, b = torch.randn(256, 512), torch.randn(512, 512)

    def stretch() -> None:
        for _ in range(units):
            torch.nn.functional.gelu(a @ b)

    stretch()
    seconds: list[list[float]] = [[] for _ in range(world)]
    for _ in range(repeats):  # the counts in turns, so that load from elsewhere falls on all alike
        for k in range(1, world + 1):
            dist.barrier()
            mine = torch.tensor([_median_seconds(stretch, 1) if rank < k else 0.0])
            dist.all_reduce(mine)
            seconds[k - 1].append(mine.item() / k)
    curve, slowest = [], 1.0
    for times in seconds:  # each round's ratio to its own alone; more ranks never make each faster
        slowest = max(slowest, statistics.median(t / alone for t, alone in zip(times, seconds[0])))
        curve.append(slowest)
    return tuple(curve)


def _contended(rank: int, world: int, busy_seconds: float = 1.5, repeats: int = 20) -> tuple[float, float]:
    """(seconds of a tiny all-reduce between ranks 0 and 1, of a one-way message between them) while
    the other ranks compute: a collective waits until its partner holds a core, as in a real step."""
    pair = dist.new_group([0, 1])
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    buffer = torch.ones(1)
    dist.barrier()
    if rank >= 2:
        deadline = time.perf_counter() + busy_seconds
        while time.perf_counter() < deadline:
            torch.nn.functional.gelu(a @ b)
        dist.barrier()
        return 0.0, 0.0
    collective = _median_seconds(lambda: dist.all_reduce(buffer, group=pair), repeats)
    message = _ping_pong(rank, 4, repeats, barrier=False)
    dist.barrier()
    return collective, message


def group_sizes(world: int) -> tuple[int, ...]:
    """The group sizes :func:`time_group_collectives` times: each ``g >= 2`` that divides ``world``."""
    return tuple(g for g in range(2, world + 1) if world % g == 0)


def _group_round(kind: str, nbytes: int, dtype: torch.dtype, group, size: int, stretch: Callable[[], None]):
    """A round of ``stretch`` and one ``kind`` collective in ``group``, ready to call: the collective
    after the stretch; ring attention's exchange (``nbytes`` sent, as many received) around it."""
    if kind == "ring_exchange":
        ring, element = RingExchange(group), torch.tensor([], dtype=dtype).element_size()
        block = torch.ones(max(1, nbytes // element), dtype=dtype)

        def exchange() -> None:
            pending = ring.start(block, 0)
            stretch()
            pending.wait()

        return exchange
    op = _group_op(kind, nbytes, dtype, group, size)
    return lambda: (stretch(), op())


def _group_op(kind: str, nbytes: int, dtype: torch.dtype, group, size: int, async_op: bool = False):
    """One ``kind`` collective of an ``nbytes`` tensor (whole, gathered) in ``group``, ready to call."""
    element = torch.tensor([], dtype=dtype).element_size()
    whole = torch.ones(max(size, nbytes // element // size * size), dtype=dtype)
    shard = torch.ones(whole.numel() // size, dtype=dtype)
    if kind == "all_gather":
        return lambda: all_gather_single(whole, shard, group=group, async_op=async_op)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_single(shard, whole, group=group, async_op=async_op)
    return lambda: dist.all_reduce(whole, group=group, async_op=async_op)


def _slowest_median(fn, repeats: int) -> float:
    """The slowest rank's median seconds of ``fn``, every rank running it at once."""
    dist.barrier()
    mine = torch.tensor([_median_seconds(fn, repeats)])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def _timed_sizes(
    kind: str, dtype: torch.dtype, group, size: int, stretch, compute: float, repeats: int, dp_bytes: int
):
    """``(bytes, seconds)`` of a ``kind`` round beyond its ``compute``, at each of :data:`GROUP_BYTES` (and
    ``dp_bytes`` for a collective, at half the repeats), every group at once; monotone in size."""
    sizes = GROUP_BYTES + ((dp_bytes,) if kind in DP_KINDS else ())
    seconds = []
    for nbytes in sizes:
        rounds = _group_round(kind, nbytes, dtype, group, size, stretch)
        rounds()
        times = repeats if nbytes in GROUP_BYTES else max(2, repeats // 2)
        seconds.append(max(0.0, _slowest_median(rounds, times) - compute))
    return monotone(sizes, seconds)


def _behind(rank: int, dtype: torch.dtype, group, size: int, stretch, compute: float, repeats: int, lockstep):
    """Ring attention's exchange (``ring_exchange``) in the first group of ``size`` ranks while every other
    rank computes on, out of step, for three times what the lockstep rounds (``lockstep``: their seconds
    beyond the compute) would take: ``(bytes, seconds)`` beyond ``compute`` at each of :data:`GROUP_BYTES`."""
    inside = rank < size
    window = 3 * (repeats + 1) * sum(t + compute for _, t in lockstep)
    dist.barrier()
    seconds = []
    if not inside:
        deadline = time.perf_counter() + window
        while time.perf_counter() < deadline:
            stretch()
    for nbytes in GROUP_BYTES:
        if inside:
            rounds = _group_round("ring_exchange", nbytes, dtype, group, size, stretch)
            rounds()
            seconds.append(_median_seconds(rounds, repeats))
    mine = torch.tensor(seconds if inside else [0.0] * len(GROUP_BYTES))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return monotone(GROUP_BYTES, [max(0.0, t - compute) for t in mine.tolist()])


def time_group_collectives(
    rank: int, world: int, dtype: torch.dtype, units: int = 2, repeats: int = 6, dp_bytes: int = DP_BYTES
) -> dict:
    """{(kind, group size): ((bytes, seconds), ...)}: every group at once, a stretch of ``units``
    matrix multiplies (about a millisecond alone: the compute between a layer's collectives) then one
    collective, less the stretch alone with every rank busy (module docstring); per size below the
    world also :data:`BEHIND_KIND`; the collectives also at ``dp_bytes`` (:data:`DP_BYTES`)."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def stretch() -> None:
        for _ in range(units):
            a @ b

    stretch()
    compute = _slowest_median(stretch, 3 * repeats)
    found = {}
    for size in group_sizes(world):
        blocks = [list(range(start, start + size)) for start in range(0, world, size)]
        groups = [dist.new_group(members) for members in blocks]
        group = groups[rank // size]
        for kind in GROUP_KINDS:
            found[kind, size] = _timed_sizes(kind, dtype, group, size, stretch, compute, repeats, dp_bytes)
        if size < world:
            lockstep = found["ring_exchange", size]
            found[BEHIND_KIND, size] = _behind(
                rank, dtype, groups[0], size, stretch, compute, repeats, lockstep
            )
    return found


def monotone(sizes: tuple[int, ...], seconds: list[float]) -> tuple[tuple[int, float], ...]:
    """``(size, seconds)`` pairs in which a larger size never costs less: each size keeps the least of
    its own seconds and the larger sizes' (noise under load makes a small message look dearer)."""
    kept, least = [], float("inf")
    for size, t in reversed(list(zip(sizes, seconds))):
        least = min(least, t)
        kept.append((size, least))
    return tuple(reversed(kept))


class _EmptyStage(torch.nn.Module):
    """A model chunk that computes (almost) nothing: what is left of a step is the engine's."""

    def __init__(self, config, first: bool, last: bool, vp_stage: int):
        super().__init__()
        self.config, self.vp_stage, self.pre_process, self.post_process = config, vp_stage, first, last
        self.start = torch.nn.Parameter(torch.ones(_SEQ, 1, _HIDDEN))
        self.weight = torch.nn.Parameter(torch.ones(_HIDDEN))
        self.input_tensor = None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0]

    def forward(self):
        return (self.start if self.pre_process else self.input_tensor) * self.weight


def _forward_step(data_iterator, model):
    return model(), lambda out: (out.sum(), {})


def engine_step_seconds(
    rank: int,
    world: int,
    schedule: str,
    vpp: int,
    m: int,
    steps: int,
    stage=_EmptyStage,
    hidden: int = _HIDDEN,
    seq_length: int = _SEQ,
) -> float:
    """The slowest rank's median seconds of a step of the real engine (PP = ``world``) over chunks
    ``stage(config, first, last, vp_stage)``: by default stages that compute nothing, whose step is the
    engine's fixed costs."""
    virtual = vpp if vpp > 1 else None
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=virtual
    )
    try:
        config = ModelParallelConfig(pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=virtual,
                                     hidden_size=hidden, pipeline_schedule=schedule)  # fmt: skip
        placement = placement_for(schedule, world, vpp)
        stages = [placement.stage(rank, c) for c in range(vpp)]
        chunks = [stage(config, s == 0, s == world * vpp - 1, c) for c, s in enumerate(stages)]
        func = get_forward_backward_func()
        run = partial(func, forward_step_func=_forward_step, data_iterator=[None] * vpp if vpp > 1 else None,
                      model=chunks if vpp > 1 else chunks[0], num_microbatches=m, seq_length=seq_length,
                      micro_batch_size=1)  # fmt: skip
        times = []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            run()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:  # the first step opens the links
                times.append(elapsed.item())
        return statistics.median(times)
    finally:
        ps.destroy_model_parallel()


def _optimizer_seconds(tensors: int, elements: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Median seconds of the optimizer's part of a step over ``tensors`` tensors of ``elements``: the
    gradient norm (float64, as ``core.optimizer.clip_grads``), AdamW (fused where this torch has it),
    the fp32 main copy written back to the model's parameters, the flat gradient buffer zeroed."""
    buffer = torch.randn(tensors * elements)
    grads = list(buffer.view(tensors, elements).unbind())
    main = [torch.nn.Parameter(torch.randn(elements)) for _ in range(tensors)]
    for param, grad in zip(main, grads):
        param.grad = grad
    params = [p.detach().to(dtype) for p in main]
    fused = has_fused_kernel(torch.optim.AdamW, torch.device("cpu"))
    adam = torch.optim.AdamW(main, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))

    def step() -> None:
        torch.stack(torch._foreach_norm(grads, 2.0)).double().square().sum()
        adam.step()
        if dtype != torch.float32:  # a 16-bit model: its parameters take the updated main copy
            torch._foreach_copy_(params, main)
        buffer.zero_()

    step()
    return _median_seconds(step, repeats)


def _optimizer_costs(dtype: torch.dtype) -> tuple[float, ...]:
    """Every rank's :func:`_optimizer_seconds` at each of :data:`OPTIMIZER_CASES`, at once, the
    slowest rank's (the ranks of a real step step together)."""
    dist.barrier()
    mine = torch.tensor([_optimizer_seconds(n, size, dtype) for n, size in OPTIMIZER_CASES])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return tuple(mine.tolist())


def fit_optimizer_costs(seconds: tuple[float, ...]) -> tuple[float, float]:
    """(seconds per tensor, seconds per element) that give the two :data:`OPTIMIZER_CASES` timings
    (two equations, two unknowns; neither negative)."""
    (n1, e1), (n2, e2) = OPTIMIZER_CASES
    t1, t2 = seconds
    per_element = max(0.0, (t2 * n1 - t1 * n2) / (n1 * n2 * e2 - n2 * n1 * e1))
    per_tensor = max(0.0, (t1 - per_element * n1 * e1) / n1)
    return per_tensor, per_element


def _worker(rank: int, world: int, init_file: str, nbytes: int, queue, dtype: torch.dtype) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tiny, large = _collectives(nbytes)
        p2p = (_ping_pong(rank, 4, 30), _ping_pong(rank, nbytes, 4))
        slowdown = _slowdowns(rank, world)
        contended = _contended(rank, world)
        engine = {(s, v, m): engine_step_seconds(rank, world, s, v, m, 5) for s, v, m in engine_runs(world)}
        optimizer = _optimizer_costs(dtype)
        grouped = time_group_collectives(rank, world, dtype)
        if rank == 0:
            queue.put({"all_reduce": (tiny, large), "p2p": p2p, "slowdown": slowdown, "engine": engine,
                       "contended": contended, "optimizer": optimizer, "grouped": grouped})  # fmt: skip
    finally:
        dist.destroy_process_group()


def _empty_step(
    schedule: str, world: int, vpp: int, m: int, latency: float, slowdown
) -> Callable[[float], float]:
    """Seconds of the shared-core timing of the schedule when every action costs ``per_action``."""
    tables, placement = build_tables(schedule, world, vpp, m), placement_for(schedule, world, vpp)
    keys = {(a.kind, r, a.chunk) for r, t in enumerate(tables) for a in t}

    def step(per_action: float) -> float:
        work = dict.fromkeys(keys, per_action)
        return time_shared(tables, placement, work, latency=latency, processes=1, slowdown=slowdown).makespan

    return step


def fit_engine_costs(engine_steps: dict, world: int, latency: float, slowdown) -> tuple[float, float]:
    """(seconds per action, seconds per step): the fixed costs with which the shared-core timing of
    each measured schedule, plus the per-step cost, gives its measured step, in the least-squares
    sense (the per-step cost is the mean residual at a given per-action cost, never negative; the
    per-action cost is found by golden-section search, the squared error being convex in it where the
    timing is linear)."""
    steps = [(_empty_step(s, world, v, m, latency, slowdown), measured)
             for (s, v, m), measured in engine_steps.items()]  # fmt: skip

    def per_step(action: float) -> float:
        return max(0.0, statistics.fmean(measured - step(action) for step, measured in steps))

    def error(action: float) -> float:
        fixed = per_step(action)
        return sum((measured - step(action) - fixed) ** 2 for step, measured in steps)

    low, high = 0.0, max(max(measured for _, measured in steps), 1e-6)
    ratio = (5**0.5 - 1) / 2
    for _ in range(60):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        low, high = (low, b) if error(a) <= error(b) else (a, high)
    action = (low + high) / 2
    return action, per_step(action)


def measure_host(
    world: int, cores: int, nbytes: int = 4 << 20, dtype: torch.dtype = torch.bfloat16
) -> HostMeasurement:
    """Spawn ``world`` gloo ranks here and measure (module docstring); ``dtype``: the model's parameters'."""
    import torch.multiprocessing as mp

    world = max(world, 2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(target=_worker, args=(r, world, init, nbytes, queue, dtype)) for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            found = first_result(queue, procs, 600, "calibration")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    steps = 2 * (world - 1)
    tiny, large = found["all_reduce"]
    latency = tiny / steps
    bandwidth = nbytes / world / max(large / steps - latency, 1e-12)
    p2p_tiny, p2p_large = found["p2p"]
    collective, message = found["contended"]
    latency = max(latency, collective / 2)  # a two-rank all-reduce: two ring steps
    host = HostCosts(
        message_latency=max(p2p_tiny, message),
        message_bandwidth=nbytes / max(p2p_large - p2p_tiny, 1e-12),
        slowdown=found["slowdown"],
    )
    slowdown = partial(host.slowdown_at, cores=cores)
    action, step = fit_engine_costs(found["engine"], world, p2p_tiny, slowdown)
    per_tensor, per_element = fit_optimizer_costs(found["optimizer"])
    fitted = {"action_seconds": action, "step_seconds": step, "optimizer_tensor_seconds": per_tensor,
              "optimizer_element_seconds": per_element, "collectives": tuple(sorted(found["grouped"].items())),
              "collectives_world": world}  # fmt: skip
    return HostMeasurement(bandwidth, latency, HostCosts(**{**host.__dict__, **fitted}), found["engine"])

"""Every way Trident can run the model on the cluster, the ones that fit, ranked by simulated step time.

The search walks the splits (TP, CP, EP, PP, DP), then per split the virtual sizes and the schedules
that apply, the micro-batch sizes, two layouts (Megatron's even split and the cost-balanced one of
:mod:`planner.layouts`) and recomputation. What cannot run is rejected with its reason:

* ``does not divide``: heads, query groups, FFN, sequence or global batch by the sizes;
* ``fewer microbatches than stages``: a pipeline would idle most of the step (interleaving needs
  at least ``pp``, and Megatron's group rule);
* ``out of memory``: the largest rank's peak (:mod:`planner.memory`) above the usable memory;
* ``not supported by this Trident``: sizes its flags refuse (context or expert parallelism before
  they exist), read from the flag coverage table, so they open up when the features land.

Dominated choices are not costed: recomputation is tried from none to full and the first that fits
is kept (recomputing more only adds time), and where the distributed optimizer is allowed it is used
(the same traffic as an all-reduce, a fraction of the state), and always with ``--fp8-param-gather``,
which needs it. Data-parallel sharding climbs the same way where DP x CP > 1 and the user fixed no
strategy: from ``no_shard`` (``optim`` with ``--use-distributed-optimizer``) through ``optim`` and
ZeRO-2 (``optim_grads``) to ZeRO-3 (``optim_grads_params``); a strategy further up is kept only where
it fits with less recomputation than every one below it, since it moves more (at microbatch scope) or
holds its buckets whole while in use (at step scope), so it is proposed where it is what fits. Under
pipelining ZeRO-2/3 are tried at both scopes (``--data-parallel-sharding-scope`` fixes one; without a
pipeline ``auto`` is microbatch): each scope that fits with less recomputation than the strategies
below is kept, and where both do the simulated step picks the faster (step scope moves ZeRO-1's
traffic, microbatch scope holds only the units in flight). ZeRO-3's step scope is left out of the
climb: ZeRO-2's moves the same and holds less. ``--use-megatron-fsdp`` (with
``--data-parallel-sharding-strategy``) fixes the strategy. On more than one node every strategy but
``no_shard`` is also tried as HSDP with one distributed-optimizer instance per node
(:func:`_instance_options`), beside the same strategy over all of DP x CP, the simulated step picking;
``--num-distributed-optimizer-instances`` fixes N. The rest is
timed by branch and bound:
candidates in order of a lower bound on their step (the busiest rank's compute), simulated until the
next bound exceeds the ``top``-th best simulated step, so only a few schedules are simulated in full.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from core.pipeline_parallel.layout import even_layout
from core.pipeline_parallel.placement import V
from core.pipeline_parallel.schedule_rules import CLI_SCHEDULES, DEFAULT_SCHEDULE, schedule_rule
from core.pipeline_parallel.schedule_tables import check_interleaving
from planner.candidate import DP_SHARDING, RECOMPUTE, ZERO_SHARDING, Candidate
from planner.costs import LayerProfile, StageCostModel
from planner.hardware import Cluster
from planner.layouts import balanced_layout
from planner.memory import RankMemory, candidate_memory, kept_after_forward, rank_static, sharded_buckets
from planner.model_spec import ModelSpec
from planner.step_time import StepEstimate, estimate_step, quick_estimate
from training.arguments.data_parallel_flags import instances_problem
from training.arguments.schema import BY_OPTION, coverage_of

__all__ = [
    "DOES_NOT_DIVIDE",
    "FEW_MICROBATCHES",
    "OUT_OF_MEMORY",
    "UNSUPPORTED",
    "Planned",
    "SearchResult",
    "search",
]

DOES_NOT_DIVIDE = "does not divide"
FEW_MICROBATCHES = "fewer microbatches than stages"
OUT_OF_MEMORY = "out of memory"
UNSUPPORTED = "not supported by this Trident"
REFUSED = "refused by Trident's flag checks"
GUESS_MARGIN = 0.03
"""Candidates whose guess is this much slower than the ``top``-th simulated step are not simulated."""
EXACT_ACTIONS = 1 << 15
"""The shown candidates are simulated over every microbatch up to this many stage-microbatches; above
it they keep the steady-state extension (``step_extrapolated`` in the JSON). On LLaMA-3 405B's top five
at 1024 GPUs (PP32, 2048 microbatches, where one full simulation takes 20 s) the two agreed within
2e-5 of the step."""
EXAMPLES = 12
"""Rejected candidates listed per reason (all are counted)."""


@dataclass
class Planned:
    """A candidate with its memory per rank and (once simulated) its step."""

    cand: Candidate
    memory: list[RankMemory]
    bound: float = 0.0
    """No step of this candidate can be shorter."""
    guess: float = 0.0
    """The bound plus the schedule's textbook bubble: the order candidates are simulated in."""
    step: StepEstimate | None = None

    @property
    def peak(self) -> RankMemory:
        return max(self.memory, key=lambda m: m.peak)


@dataclass
class SearchResult:
    candidates: list[Planned]
    """Simulated and ranked, fastest first."""
    rejected: dict[str, dict] = field(default_factory=dict)
    """Reason -> {"count": n, "examples": [...]}."""
    fitting: int = 0
    """Candidates that fit in memory (only the best of them are simulated)."""
    simulated: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """This process's CPU time for the search: the wall time's share of it shows how loaded the machine was."""


class _Rejections:
    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, reason: str, what: str, count: int = 1) -> None:
        self.counts[reason] += count
        if len(self.examples[reason]) < EXAMPLES:
            self.examples[reason].append(what)

    def as_dict(self) -> dict[str, dict]:
        return {r: {"count": n, "examples": self.examples[r]} for r, n in sorted(self.counts.items())}


def _supports(option: str, value: int) -> bool:
    """Whether this Trident's flags accept ``option value`` (the coverage table decides)."""
    if value == 1:
        return True
    entry = coverage_of(option)
    if option not in BY_OPTION or entry.rejected:
        return False
    return not entry.only or value in entry.only


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split_problem(spec: ModelSpec, tp: int, cp: int, ep: int) -> str | None:
    """Why TP/CP/EP cannot split this model, or None."""
    if spec.num_attention_heads % tp:
        return f"--num-attention-heads ({spec.num_attention_heads}) by TP {tp}"
    if spec.num_query_groups % tp:
        return f"--num-query-groups ({spec.num_query_groups}) by TP {tp}"
    if spec.ffn_hidden_size % tp:
        return f"--ffn-hidden-size ({spec.ffn_hidden_size}) by TP {tp}"
    if spec.seq_length % (2 * cp if cp > 1 else 1) or (spec.seq_length // cp) % tp:
        return f"--seq-length ({spec.seq_length}) by 2 x CP {cp} x TP {tp}"
    if spec.moe is not None and spec.moe.num_experts % ep:
        return f"--num-experts ({spec.moe.num_experts}) by EP {ep}"
    return None


@dataclass(frozen=True)
class _Space:
    """What the search may choose, after the user's fixed values."""

    tps: tuple[int, ...]
    cps: tuple[int, ...]
    eps: tuple[int, ...]
    vpps: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    recomputes: tuple[str, ...]
    schedules: tuple[str, ...] | None
    pps: tuple[int, ...] | None
    layout: str | None
    dp_sharding: str | None = None
    """The strategy the user fixed (``--use-megatron-fsdp``), else None: the search climbs
    :data:`DP_SHARDING`."""
    dp_sharding_scope: str = "auto"
    instances: int | None = None
    """``--num-distributed-optimizer-instances`` the user fixed, else None: on more than one node the
    search also tries one instance per node (:func:`_instance_options`)."""
    outer_dp_sharding: str | None = None
    communication_unit_size: int | None = None
    """``--suggested-communication-unit-size`` the user fixed (every candidate carries it)."""
    megatron_fsdp_dtypes: tuple[str, ...] = ()
    """Megatron-FSDP's dtype flags the user gave (every candidate carries them)."""


def _space(spec: ModelSpec, cluster: Cluster, fixed: dict) -> _Space:
    def pick(key: str, default: tuple) -> tuple:
        return (fixed[key],) if fixed.get(key) is not None else default

    powers = tuple(2**k for k in range(12))
    tps = tuple(t for t in powers if t <= cluster.gpus_per_node)
    cps = tuple(c for c in powers if c <= 32)
    eps = tuple(_divisors(spec.moe.num_experts)) if spec.moe is not None else (1,)
    recompute = fixed.get("recompute")
    return _Space(
        tps=pick("tp", tps),
        cps=pick("cp", cps),
        eps=pick("ep", eps),
        vpps=pick("vpp", (1, 2, 3, 4, 6, 8)),
        micro_batch_sizes=pick("micro_batch_size", (1, 2, 4, 8)),
        recomputes=(recompute,) if recompute else RECOMPUTE,
        schedules=(fixed["schedule"],) if fixed.get("schedule") is not None else None,
        pps=pick("pp", ()) or None,
        layout=fixed.get("layout"),
        dp_sharding=fixed.get("dp_sharding"),
        dp_sharding_scope=fixed.get("dp_sharding_scope", "auto"),
        instances=fixed.get("instances"),
        outer_dp_sharding=fixed.get("outer_dp_sharding"),
        communication_unit_size=fixed.get("communication_unit_size"),
        megatron_fsdp_dtypes=fixed.get("megatron_fsdp_dtypes", ()),
    )


def _schedules(pp: int, vpp: int, space: _Space) -> list[str]:
    """The schedules that run ``vpp`` chunks per rank: the user's, else all but GPipe (1F1B's bubble
    with every microbatch's activations held, so never the better choice)."""
    if pp == 1:
        return [DEFAULT_SCHEDULE] if vpp == 1 else []
    runnable = [s for s in CLI_SCHEDULES if schedule_rule(s).chunks_problem(vpp) is None]
    if space.schedules is not None:
        return [s for s in space.schedules if s in runnable]
    return [s for s in runnable if not schedule_rule(s).holds_every_microbatch]


def _splits(spec: ModelSpec, cluster: Cluster, space: _Space, rejected: _Rejections) -> Iterator[tuple]:
    """(tp, cp, ep, pp, dp) that divide the model and the cluster and that Trident runs. Where the user's
    ``--num-distributed-optimizer-instances`` divides no split's DP x CP, the training flags' line."""
    n, refused, yielded = cluster.num_gpus, "", False
    for tp in space.tps:
        for cp in space.cps:
            if n % (tp * cp):
                continue
            for ep in space.eps:
                problem = _split_problem(spec, tp, cp, ep)
                if problem is not None:
                    rejected.add(DOES_NOT_DIVIDE, f"TP{tp} CP{cp} EP{ep}: {problem}")
                    continue
                for pp in space.pps or tuple(_divisors(n // (tp * cp))):
                    if pp > spec.num_layers or n % (tp * cp * pp):
                        continue
                    dp = n // (tp * cp * pp)
                    if (tp * cp * dp) % ep:  # experts are grouped over the ranks of one pipeline stage
                        rejected.add(DOES_NOT_DIVIDE, f"TP{tp} CP{cp} PP{pp} DP{dp}: EP {ep} by TP x CP x DP")
                        continue
                    missing = [
                        f"{flag} {size}"
                        for flag, size in (
                            ("--context-parallel-size", cp),
                            ("--expert-model-parallel-size", ep),
                        )
                        if not _supports(flag, size)
                    ]
                    if missing:
                        rejected.add(UNSUPPORTED, f"TP{tp} CP{cp} EP{ep} PP{pp} DP{dp}: {', '.join(missing)}")
                        continue
                    problem = _instances_problem(spec, space, tp, cp, ep, dp)
                    if problem is not None:
                        rejected.add(REFUSED, f"TP{tp} CP{cp} EP{ep} PP{pp} DP{dp}: {problem}")
                        refused = refused or problem
                        continue
                    yielded = True
                    yield tp, cp, ep, pp, dp
    if refused and not yielded:
        raise ValueError(refused)


def _instances_problem(spec: ModelSpec, space: _Space, tp: int, cp: int, ep: int, dp: int) -> str | None:
    """Why the user's ``--num-distributed-optimizer-instances`` cannot split this DP x CP (and, with
    experts, the expert data-parallel size), in the training flags' words; None if it can."""
    if not space.instances or space.instances == 1:
        return None
    edp = tp * cp * dp // ep if spec.moe is not None else None
    return instances_problem(
        space.instances, "no_shard", strategy=None, distributed=True, dp=dp, cp=cp, edp=edp
    )


def _layouts(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None, fixed: str | None
):
    """The layouts to try: the user's, else the even split and the cost-balanced one (if different)."""
    placement = cand.rule.placement
    if fixed is not None:
        return [fixed]
    even = even_layout(spec.num_layers, cand.pp, cand.vpp, placement=placement).to_string()
    model = StageCostModel(spec, replace(cand, layout=even), cluster, profile)
    layer, embedding, loss = (model.stage(s) for s in (("t",), ("E",), ("L",)))
    balanced = balanced_layout(
        spec.num_layers,
        cand.pp,
        cand.vpp,
        layer=layer.forward + layer.backward,
        embedding=embedding.forward + embedding.backward,
        loss=loss.forward + loss.backward,
        placement=placement,
        costs=[c.forward + c.backward for c in model.decoder_layers()],
    ).to_string()
    return [even] if balanced == even else [even, balanced]


def _describe(c: Candidate) -> str:
    return (
        f"{c.split()} {c.schedule_label} mbs {c.micro_batch_size} m {c.num_microbatches} {c.sharding_label()}"
    )


def _microbatches(
    pp: int, vpp: int, schedule: str, mbs: int, dp: int, global_batch: int
) -> tuple[int, str | None]:
    """The microbatch count, or 0 and why the candidate cannot run (reason, description)."""
    if global_batch % (mbs * dp):
        return 0, DOES_NOT_DIVIDE
    m = global_batch // (mbs * dp)
    if pp > 1 and m < pp:
        return 0, FEW_MICROBATCHES
    if schedule_rule(schedule).groups_microbatches(vpp):
        try:
            check_interleaving(pp, vpp, m)
        except ValueError:
            return 0, FEW_MICROBATCHES
    return m, None


def _fitting(
    spec: ModelSpec,
    cluster: Cluster,
    space: _Space,
    global_batch: int,
    allow_distributed_optimizer: bool,
    profile: LayerProfile | None,
    rejected: _Rejections,
    device: str,
) -> Iterator[Planned]:
    """Every candidate that fits in memory, with the least recomputation that makes it fit.

    Micro-batch sizes go up until one does not fit at all: larger ones hold more, so they cannot.
    """
    for tp, cp, ep, pp, dp in _splits(spec, cluster, space, rejected):
        for vpp in space.vpps if pp > 1 else (1,):
            if pp * vpp > spec.num_layers + 2:
                continue
            for schedule in _schedules(pp, vpp, space):
                too_big = False
                for mbs in space.micro_batch_sizes:
                    what = f"TP{tp} CP{cp} EP{ep} PP{pp} VPP{vpp} DP{dp} {schedule} mbs {mbs}"
                    m, problem = _microbatches(pp, vpp, schedule, mbs, dp, global_batch)
                    if problem is not None:
                        rejected.add(
                            problem,
                            f"{what}: --global-batch-size {global_batch}, {global_batch // mbs // dp} microbatches",
                        )
                        continue
                    if too_big:
                        rejected.add(OUT_OF_MEMORY, f"{what}: a smaller micro-batch does not fit either")
                        continue
                    base = Candidate(
                        tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp, ep=ep, schedule=schedule, micro_batch_size=mbs,
                        num_microbatches=m, dp_sharding_scope=space.dp_sharding_scope,
                        communication_unit_size=space.communication_unit_size,
                        megatron_fsdp_dtypes=space.megatron_fsdp_dtypes,
                    )  # fmt: skip
                    strategies = _strategies(spec, space, base, allow_distributed_optimizer, rejected)
                    rungs = [
                        tuple(
                            (strategy, scope, *hsdp)
                            for strategy, scope in _scopes(s, base.pp, space)
                            for hsdp in _instance_options(s, base, cluster, space)
                        )
                        for s in strategies
                    ]
                    found = list(_fit_recompute(spec, cluster, space, base, rungs, profile, rejected, device))
                    too_big = not found
                    yield from found


def _strategies(
    spec: ModelSpec, space: _Space, base: Candidate, allow_distributed_optimizer: bool, rejected: _Rejections
) -> tuple[str, ...]:
    """The data-parallel sharding strategies to try, least sharded first: the user's; else from
    ``optim`` (``--use-distributed-optimizer``) or ``no_shard`` up to ``optim_grads_params`` where DP x CP
    > 1 (from ``optim`` with the user's distributed-optimizer instances; ZeRO-2/3 not where Trident refuses
    them: a tied embedding in both of ZBV's chunks)."""
    refused = base.rule.placement == V and not spec.untie_embeddings
    if space.dp_sharding is not None:
        if refused and space.dp_sharding in ZERO_SHARDING:
            rejected.add(
                REFUSED, f"{_describe(base)}: {space.dp_sharding} with a tied embedding in both chunks"
            )
            return ()
        return (space.dp_sharding,)
    if base.dp * base.cp == 1:
        return ("optim",) if allow_distributed_optimizer and spec.fp8_param_gather else ("no_shard",)
    distributed = allow_distributed_optimizer or (space.instances or 1) > 1  # instances replicate it
    ladder = DP_SHARDING[DP_SHARDING.index("optim" if distributed else "no_shard") :]
    return tuple(s for s in ladder if not (refused and s in ZERO_SHARDING))


def _scopes(strategy: str, pp: int, space: _Space) -> tuple[tuple[str, str], ...]:
    """A strategy's rung of the climb: ``(strategy, scope)`` for each scope to try. The user's scope, or
    ``auto``'s, where there is no choice (no pipeline: microbatch; ZeRO-1 and no_shard have none); under
    pipelining both, ``auto`` (step) first, except ZeRO-3's step scope where the climb chooses the
    strategy: it moves what ZeRO-2's step scope moves and holds the parameter shards on top of the whole
    parameters, so it never fits where ZeRO-2's does not."""
    if strategy not in ZERO_SHARDING or space.dp_sharding_scope != "auto" or pp == 1:
        return ((strategy, space.dp_sharding_scope),)
    if strategy == "optim_grads_params" and space.dp_sharding is None:
        return ((strategy, "microbatch"),)
    return ((strategy, "auto"), (strategy, "microbatch"))


def _instance_options(
    strategy: str, base: Candidate, cluster: Cluster, space: _Space
) -> list[tuple[int, str]]:
    """HSDP's ``(instances, outer strategy)`` to try with a strategy: the user's; else none, and on more
    than one node also one instance per node where the nodes divide DP x CP into groups of two or more
    (each instance's sharding then stays on a node's fast links, only the once-a-step reduction of the
    shards crosses nodes), ZeRO-3's with the outer ``optim`` unless the user gave an outer strategy (its
    optimizer state still split DP x CP ways: the same bytes moved, less held)."""
    if space.instances is not None:
        return [(space.instances, space.outer_dp_sharding or "no_shard")]
    options = [(1, "no_shard")]
    nodes, shards = cluster.num_gpus // cluster.gpus_per_node, base.dp * base.cp
    if strategy != "no_shard" and nodes > 1 and shards % nodes == 0 and shards // nodes >= 2:
        outer = "optim" if strategy == "optim_grads_params" else "no_shard"
        options.append((nodes, space.outer_dp_sharding or outer))
    return options


_LESS_RECOMPUTE = ("none", "selective", "full")
"""Recomputation from the least time to the most (and from the most memory to the least but for
selective, which keeps more than full)."""


def _fit_recompute(spec, cluster, space, base: Candidate, rungs, profile, rejected: _Rejections, device):
    """Per layout, the least recomputation that fits, with the least sharding: a rung further along
    ``rungs`` (more traffic, or gathered buckets in use) only where it fits with less recomputation than
    every rung before it; of a rung's scopes each that does (step scope moves less, microbatch scope holds
    less: where both fit, the simulated step picks the faster)."""
    for layout in _layouts(spec, base, cluster, profile, space.layout if base.pp > 1 else None):
        least, why = len(_LESS_RECOMPUTE), ""
        for rung in rungs:
            reached = least
            for strategy, scope, instances, outer in rung:
                trial = replace(base, layout=layout, dp_sharding=strategy, dp_sharding_scope=scope,
                                instances=instances, outer_dp_sharding=outer)  # fmt: skip
                planned, why = _least_recompute(spec, cluster, space, trial, device, _LESS_RECOMPUTE[:least])
                level = _LESS_RECOMPUTE.index(planned.cand.recompute) if planned else len(_LESS_RECOMPUTE)
                if level < least:
                    reached = min(reached, level)
                    yield planned
            least = reached
            if least == 0:
                break
        if least == len(_LESS_RECOMPUTE) and why:
            rejected.add(OUT_OF_MEMORY, why)


def _least_recompute(
    spec, cluster, space, cand: Candidate, device: str, wanted: tuple[str, ...]
) -> tuple[Planned | None, str]:
    """The least recomputation of ``wanted`` with which ``cand`` fits (none, else full, then selective
    if it fits too), or None and why nothing fits."""
    static = max(sum(rank_static(spec, cand, r, device)[:3]) for r in range(cand.pp))
    if static > cluster.usable_bytes:
        return None, (f"{_describe(cand)}: parameters, gradients and optimizer state alone "
                      f"{static / 1e9:.1f} GB > {cluster.usable_bytes / 1e9:.1f} GB")  # fmt: skip
    order = [r for r in ("none", "full", "selective") if r in space.recomputes and r in wanted]
    fits: dict[str, Planned] = {}
    smallest = None
    for recompute in order:
        if recompute == "selective" and "full" in order and "full" not in fits:
            continue  # full recomputation keeps the least: if it does not fit, selective cannot
        trial = replace(cand, recompute=recompute)
        memory = candidate_memory(spec, trial, device=device)
        peak = max(m.peak for m in memory)
        if peak <= cluster.usable_bytes:
            fits[recompute] = Planned(trial, memory, 0.0)
            if recompute == "none":
                break
        elif smallest is None or peak < smallest[1]:
            smallest = (trial, peak)
    if fits:
        return fits.get("none") or fits.get("selective") or fits["full"], ""
    if smallest is None:  # nothing wanted left to try
        return None, ""
    trial, peak = smallest
    return None, (f"{_describe(trial)}: {peak / 1e9:.1f} GB > {cluster.usable_bytes / 1e9:.1f} GB even with "
                  f"--recompute-granularity {trial.recompute}")  # fmt: skip


def _microbatch_traffic_bound(
    spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None
) -> float:
    """ZeRO-2/3 at microbatch scope: a rank's data-parallel channel carries, one after another, M
    reduce-scatters of each chunk's buckets, and under ZeRO-3 M all-gathers of them in forward and M in
    backward of all but those kept from the forward (the step's simulation, ``step_time``), so no step is
    shorter than the busiest rank's sum of them (0 at any other scope)."""
    if cand.zero is None or cand.zero[1] != "microbatch":
        return 0.0
    model = StageCostModel(spec, cand, cluster, profile)
    grad_bytes, zero3 = spec.grad_comm_bytes_per_value, cand.zero[0] == "optim_grads_params"

    def gather(elements: int, n: int) -> float:
        return (
            model.dp_collective_seconds(elements * spec.bytes_per_value, n, "all_gather")
            if zero3 and n
            else 0.0
        )

    busiest = 0.0
    for rank in range(cand.pp):
        seconds = sum(
            model.dp_collective_seconds(elements * grad_bytes, n)
            + gather(elements, n)
            + gather(elements - kept, n - kept_n)
            for (elements, n), (kept, kept_n) in zip(
                sharded_buckets(spec, cand, rank), kept_after_forward(spec, cand, rank), strict=True
            )
            if n
        )
        busiest = max(busiest, seconds)
    return busiest * cand.num_microbatches


def search(
    spec: ModelSpec,
    cluster: Cluster,
    *,
    global_batch_size: int,
    fixed: dict | None = None,
    allow_distributed_optimizer: bool = False,
    top: int = 10,
    profile: LayerProfile | None = None,
    device: str = "cuda",
) -> SearchResult:
    """Rank the ways to train ``spec`` on ``cluster`` (module docstring)."""
    started, started_cpu = time.perf_counter(), time.process_time()
    rejected = _Rejections()
    space = _space(spec, cluster, fixed or {})
    fitting = list(
        _fitting(
            spec, cluster, space, global_batch_size, allow_distributed_optimizer, profile, rejected, device
        )
    )
    for planned in fitting:
        bound, guess = quick_estimate(spec, planned.cand, cluster, profile)
        traffic = _microbatch_traffic_bound(spec, planned.cand, cluster, profile)
        planned.bound, planned.guess = max(bound, traffic), max(guess, traffic)
    fitting.sort(key=lambda p: p.guess)
    best: list[Planned] = []
    simulated = 0
    for planned in fitting:
        if len(best) >= top:
            kth = best[-1].step.step_seconds
            if planned.bound > kth or planned.guess > kth * (1 + GUESS_MARGIN):
                continue
        planned.step = estimate_step(spec, planned.cand, cluster, profile, exact=False, explain=False)
        simulated += 1
        best = sorted([*best, planned], key=lambda p: (p.step.step_seconds, p.peak.peak))[:top]
    for planned in best:  # the shown figures, explained: every microbatch of the tables, where that is cheap
        c = planned.cand
        exact = not planned.step.extrapolated or c.pp * c.vpp * c.num_microbatches <= EXACT_ACTIONS
        planned.step = estimate_step(spec, c, cluster, profile, exact=exact)
    best.sort(key=lambda p: (p.step.step_seconds, p.peak.peak))
    return SearchResult(
        best,
        rejected.as_dict(),
        len(fitting),
        simulated,
        time.perf_counter() - started,
        time.process_time() - started_cpu,
    )

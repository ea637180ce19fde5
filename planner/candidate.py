"""One way to run a model: the split, the schedule, the microbatch, recomputation and the layout.

A :class:`Candidate` is what the search enumerates, the memory and time models evaluate, and the
report prints; :meth:`Candidate.flags` turns it into the ``pretrain_gpt.py`` flags that run it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property, lru_cache

from core.distributed.distributed_data_parallel_config import (
    SHARDING_STRATEGIES,
    ZERO_STRATEGIES,
    resolve_sharding_scope,
)
from core.pipeline_parallel.layout import PipelineLayout, parse_layout
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE, ScheduleRule, schedule_rule

__all__ = ["DP_SHARDING", "RECOMPUTE", "ZERO_SHARDING", "Candidate"]

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none; the attention core (Megatron's selective); every layer (full,
uniform, one layer per checkpoint)."""
DP_SHARDING = SHARDING_STRATEGIES
"""``--data-parallel-sharding-strategy``, in the order the search tries them: each shards more (nothing;
the optimizer state, ZeRO-1, ``--use-distributed-optimizer``; and the gradients, ZeRO-2; and the
parameters, ZeRO-3) and, where its buckets are whole only in use, moves more."""
ZERO_SHARDING = ZERO_STRATEGIES
"""The strategies whose buckets are whole only while in use (``--data-parallel-sharding-scope``)."""


@dataclass(frozen=True)
class Candidate:
    """A complete choice of how to train; every field maps onto a ``pretrain_gpt.py`` flag."""

    tp: int
    """``--tensor-model-parallel-size``."""
    pp: int
    """``--pipeline-model-parallel-size``."""
    dp: int
    """The data-parallel size: what is left of the cluster after TP x PP x CP (no flag of its own)."""
    vpp: int = 1
    """Model chunks per pipeline rank, which the layout carries (``layout`` below)."""
    cp: int = 1
    """``--context-parallel-size``."""
    ep: int = 1
    """``--expert-model-parallel-size``."""
    schedule: str = DEFAULT_SCHEDULE
    """``--pipeline-schedule``: 1f1b, gpipe, zb-h1 or zbv (1f1b and zb-h1 interleave with vpp > 1)."""
    micro_batch_size: int = 1
    """``--micro-batch-size``."""
    num_microbatches: int = 1
    """Microbatches a step per data-parallel rank: ``--global-batch-size`` over micro batch x DP."""
    recompute: str = "none"
    """``--recompute-granularity``: ``none``, ``selective``, or ``full`` (every layer, one at a time)."""
    layout: str = ""
    """``--pipeline-model-parallel-layout``: which layers each of the pp x vpp stages holds."""
    dp_sharding: str = "no_shard"
    """``--data-parallel-sharding-strategy`` (:data:`DP_SHARDING`); every one but ``no_shard`` is the
    distributed optimizer."""
    dp_sharding_scope: str = "auto"
    """``--data-parallel-sharding-scope`` of ZeRO-2/3: ``auto`` (``step`` with more than one pipeline stage,
    else ``microbatch``), ``step`` or ``microbatch``."""
    instances: int = 1
    """``--num-distributed-optimizer-instances`` (HSDP): the DP x CP ranks split into this many instances of
    consecutive ranks; buckets are sharded inside an instance and each shard is reduced over its
    replicas once a step."""
    outer_dp_sharding: str = "no_shard"
    """``--outer-dp-sharding-strategy``: ``optim`` splits each shard's optimizer state over the instances
    too (ZeRO-3 only), ``no_shard`` keeps a whole optimizer per instance."""
    communication_unit_size: int | None = None
    """``--suggested-communication-unit-size`` the user fixed: the elements ZeRO-2/3's reductions under way
    (and, halved, ZeRO-3's prefetched gathers) may hold at microbatch scope; None, Trident's defaults."""
    megatron_fsdp_dtypes: tuple[str, ...] = ()
    """Megatron-FSDP's dtype flags the user gave, with their values (``--megatron-fsdp-main-params-dtype
    auto``): every candidate passes them on and names its strategy with ``--use-megatron-fsdp``, which
    they need. What they change is the model's numbers (:class:`~planner.model_spec.ModelSpec`)."""

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the optimizer state is sharded over data parallelism (every strategy but ``no_shard``)."""
        return self.dp_sharding != "no_shard"

    @property
    def zero(self) -> tuple[str, str] | None:
        """ZeRO-2/3 as ``(strategy, scope)``, ``auto`` resolved (the memory model's ``sharding``), else None."""
        if self.dp_sharding not in ZERO_SHARDING:
            return None
        return self.dp_sharding, resolve_sharding_scope(self.dp_sharding_scope, self.pp)

    @property
    def shard_ranks(self) -> int:
        """The ranks a bucket is sharded over: DP x CP, or one instance's DP x CP / N under HSDP."""
        return self.dp * self.cp // self.instances

    @property
    def outer_sharded(self) -> bool:
        """HSDP's outer ``optim``: the optimizer state split over the instances as well."""
        return self.instances > 1 and self.outer_dp_sharding == "optim"

    @property
    def state_shards(self) -> int:
        """The ranks the optimizer state is split over: :attr:`shard_ranks`, times N with the outer
        ``optim`` (so DP x CP, as without instances); a bucket pads to a multiple of lcm(this, 128)."""
        return self.shard_ranks * (self.instances if self.outer_sharded else 1)

    def sharding_label(self) -> str:
        """The report's column: ``no_shard``, ``optim``, ``optim_grads_params/microbatch``, and under HSDP
        `` HSDP4`` (N instances) with `` outer optim``."""
        zero = self.zero
        label = "/".join(zero) if zero else self.dp_sharding
        if self.instances > 1:
            label += f" HSDP{self.instances}" + (" outer optim" if self.outer_sharded else "")
        return label

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    @property
    def rule(self) -> ScheduleRule:
        """The schedule's record: placement, chunks, split backward, textbook bubble."""
        return schedule_rule(self.schedule)

    @property
    def schedule_label(self) -> str:
        """The schedule this ``--pipeline-schedule`` value runs at this virtual size, as the report names it."""
        return self.rule.label(self.vpp)

    @cached_property
    def stages(self) -> PipelineLayout:
        """The parsed layout (stage ``s`` on rank ``s % pp``, or in a V under ZBV)."""
        return _parsed(self.layout, self.pp, self.rule.placement)

    @cached_property
    def placement(self):
        """Stage <-> (pp rank, chunk) of the layout (built once: the search asks often)."""
        return self.stages.stage_placement

    def stage_of(self, pp_rank: int, chunk: int) -> int:
        """The stage a rank runs as its chunk ``chunk``."""
        return self.placement.stage(pp_rank, chunk)

    def layers_of(self, stage: int) -> range:
        """The global numbers of the decoder layers stage ``stage`` holds."""
        firsts = _first_layers(self.layout, self.pp, self.rule.placement)
        return range(firsts[stage], firsts[stage + 1])

    def symbols(self, pp_rank: int, chunk: int) -> tuple[str, ...]:
        """The layers (``E``, ``t``, ``L``) of a rank's chunk."""
        return self.stages.stages[self.stage_of(pp_rank, chunk)]

    def split(self) -> str:
        """``TP2 PP4 VPP2 CP1 EP1 DP8`` with the size-1 axes left out."""
        parts = [("TP", self.tp), ("CP", self.cp), ("EP", self.ep), ("PP", self.pp), ("VPP", self.vpp)]
        shown = [f"{name}{size}" for name, size in parts if size > 1]
        return "x".join(shown + [f"DP{self.dp}"])

    def flags(self) -> list[str]:
        """The parallel, batch, schedule, recompute and optimizer flags of ``pretrain_gpt.py``."""
        out = [
            "--tensor-model-parallel-size", str(self.tp),
            "--pipeline-model-parallel-size", str(self.pp),
        ]  # fmt: skip
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.pp > 1:
            out += ["--pipeline-model-parallel-layout", self.layout]
        if self.schedule != DEFAULT_SCHEDULE:
            out += ["--pipeline-schedule", self.schedule]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        out += ["--micro-batch-size", str(self.micro_batch_size)]
        out += ["--global-batch-size", str(self.global_batch_size)]
        if self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            out += ["--recompute-num-layers", "1"]
        out.append("--overlap-grad-reduce")
        if self.megatron_fsdp_dtypes:  # they need --use-megatron-fsdp: every strategy is named with it
            out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", self.dp_sharding]
            out += self.megatron_fsdp_dtypes
        elif self.dp_sharding == "optim":
            out.append("--use-distributed-optimizer")
        elif self.distributed_optimizer:
            out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", self.dp_sharding]
        if self.zero and self.dp_sharding_scope != "auto":
            out += ["--data-parallel-sharding-scope", self.dp_sharding_scope]
        if self.instances > 1:
            out += ["--num-distributed-optimizer-instances", str(self.instances)]
        if self.outer_sharded:
            out += ["--outer-dp-sharding-strategy", "optim"]
        if self.communication_unit_size is not None:
            out += ["--suggested-communication-unit-size", str(self.communication_unit_size)]
        if self.distributed_optimizer:
            out.append("--overlap-param-gather")
        return out

    def as_dict(self) -> dict:
        fields = asdict(self)
        fields["schedule"] = self.schedule_label
        fields["pipeline_schedule"] = self.schedule
        fields["sequence_parallel"] = self.sequence_parallel
        fields["distributed_optimizer"] = self.distributed_optimizer
        fields["dp_sharding_scope"] = self.zero[1] if self.zero else None
        return fields


@lru_cache(maxsize=256)
def _first_layers(layout: str, pp: int, placement: str) -> tuple[int, ...]:
    """The first decoder layer of each stage, and the layer count after the last (the memory model asks
    for every stage of every candidate it weighs)."""
    counts = [symbols.count("t") for symbols in _parsed(layout, pp, placement).stages]
    return tuple(sum(counts[:stage]) for stage in range(len(counts) + 1))


@lru_cache(maxsize=256)
def _parsed(layout: str, pp: int, placement: str) -> PipelineLayout:
    """A layout parsed once (it is frozen): the search's candidates share a few layout strings."""
    return parse_layout(layout, pp, placement=placement)

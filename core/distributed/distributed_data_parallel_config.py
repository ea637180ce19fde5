"""Knobs of the data-parallel wrapper (Megatron's ``DistributedDataParallelConfig`` field names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from core.flags import flag, not_a_flag

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Megatron's dtype names (``--megatron-fsdp-*-dtype``), ``auto`` aside."""

ShardingStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
SHARDING_STRATEGIES: tuple[str, ...] = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's names: nothing sharded (DDP), optimizer state (ZeRO-1), and gradients (ZeRO-2),
and parameters (ZeRO-3)."""
OuterShardingStrategy = Literal["no_shard", "optim"]
ShardingScope = Literal["auto", "step", "microbatch"]
SHARDING_SCOPES: tuple[str, ...] = ("auto", "step", "microbatch")
"""How long ZeRO-2/3's sharded units live whole (see ``data_parallel_sharding_scope``)."""
ZERO_STRATEGIES: tuple[str, ...] = SHARDING_STRATEGIES[2:]
"""The strategies whose buckets are whole only while in use (ZeRO-2 and ZeRO-3): they have a scope."""


def resolve_sharding_scope(scope: str, pipeline_stages: int) -> str:
    """``auto`` is ``step`` under pipelining (the chunk gathered once and reduced once a step) and
    ``microbatch`` without it (Megatron-FSDP's behaviour, the least memory); ``step`` and ``microbatch`` stay."""
    if scope == "auto":
        return "step" if pipeline_stages > 1 else "microbatch"
    return scope


@dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """How gradients are stored and reduced over the data-parallel group.

    Difference from Megatron: ``grad_reduce_in_fp32`` defaults to True (Megatron's training
    script forces it on for bf16 anyway, and a bf16 model is what needs it).
    """

    grad_reduce_in_fp32: bool = flag(
        True,
        name="--grad-reduce-in-bf16",
        group="mixed precision",
        help="With --bf16, accumulate and reduce gradients in bfloat16 instead of fp32.",
    )
    """Accumulate and reduce gradients in fp32 even when parameters are bf16/fp16 (False: in the
    parameters' dtype). The training loop sets it as Megatron does: fp32 for bf16 unless
    ``--grad-reduce-in-bf16``; for fp16 only with ``--accumulate-allreduce-grads-in-fp32``."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction asynchronously as soon as its gradients are final, while
    backward still runs; without it every bucket is reduced, synchronously, in ``finish_grad_sync``."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1): gradients are reduce-scattered,
    parameters live in a flat buffer and are all-gathered after each optimizer step."""

    use_megatron_fsdp: bool = flag(False, group="distributed")
    """Shard over data-parallel ranks under Megatron-FSDP's flags: ``data_parallel_sharding_strategy``
    then defaults to ``optim_grads_params`` (Megatron's default with this flag). Trident builds the
    strategies on its own buckets and distributed optimizer (no separate FSDP wrapper)."""

    data_parallel_sharding_strategy: ShardingStrategy | None = flag(None, group="distributed")
    """What each data-parallel rank keeps only a shard of: ``no_shard`` (plain DDP), ``optim``
    (optimizer state: the distributed optimizer, ZeRO-1), ``optim_grads`` (and the reduced
    gradients, ZeRO-2), ``optim_grads_params`` (and the parameters, gathered per layer when used,
    ZeRO-3). None: ``optim_grads_params`` with ``use_megatron_fsdp``, else ``optim`` with
    ``use_distributed_optimizer``, else ``no_shard``. Every strategy but ``no_shard`` needs
    ``use_distributed_optimizer``."""

    num_distributed_optimizer_instances: int = flag(1, group="distributed")
    """N > 1: the distributed optimizer is replicated N times over data parallelism (megatron-core's
    partial distributed optimizer; HSDP under Megatron-FSDP). The DP x CP ranks split into N
    instances of DPxCP / N consecutive ranks; buckets are sharded, and gradients reduce-scattered,
    inside an instance only, and each reduced shard is then all-reduced over the N ranks holding it
    (``ParallelGroups.intra_dp_cp`` and ``inter_dp_cp``); an MoE expert's over EDP / N of its replicas
    and the same N instances (``intra_expt_dp`` and ``inter_expt_dp``). Needs a strategy other than
    no_shard."""

    outer_dp_sharding_strategy: OuterShardingStrategy = flag("no_shard", group="distributed")
    """Across the N instances: ``no_shard`` (each instance keeps a whole optimizer) or ``optim``
    (Megatron-FSDP's HSDP: the optimizer state of each shard is split once more over the N instances,
    its gradients reduce-scattered and its updated parameters all-gathered across them). ``optim``
    needs ``optim_grads_params`` and N > 1, as in Megatron."""

    data_parallel_sharding_scope: ShardingScope = flag("auto", group="distributed")
    """How long ZeRO-2 (``optim_grads``) and ZeRO-3 (``optim_grads_params``) keep a bucket whole, a Trident
    setting (Megatron has none). ``step``: gradients accumulate in the full bucket over the step's
    microbatches and are reduce-scattered once, after the chunk's last backward (the W pass under
    zero-bubble); under ZeRO-3 each bucket is gathered at its first use in the step and kept until the
    optimizer step: per bucket and step 1 all-gather and 1 reduce-scatter, the whole chunk's parameters and
    gradients held during the step. ``microbatch``: every microbatch is reduce-scattered on its own, and
    ZeRO-3 gathers each layer before its forward and again before its backward (2M all-gathers and M
    reduce-scatters per bucket and step, M microbatches), only the units in flight held. ``auto``: ``step``
    when the pipeline has more than one stage, ``microbatch`` without pipelining (Megatron-FSDP's own
    behaviour, least memory). Between steps a rank holds 1/DP of what the strategy shards either way.
    Irrelevant to ``no_shard`` and ``optim``, which refuse ``step`` and ``microbatch``."""

    suggested_communication_unit_size: int | None = flag(None, group="distributed")
    """Megatron-FSDP's: how many elements ZeRO-2/3 keep in flight. At microbatch scope the reduce-scatters
    under way hold at most this many elements of full gradient buckets (a new one lands the oldest until
    they fit; one may always run), and with ``overlap_param_gather`` ZeRO-3 prefetches the next units'
    all-gathers, in use order, while together they hold at most half of it (none when the next unit alone
    is larger). None: two reductions in flight and the next unit prefetched. No effect on ``no_shard``
    and ``optim``, whose buckets stay whole."""

    overlap_param_gather: bool = flag(False, group="distributed")
    """With the distributed optimizer: launch the parameter all-gathers asynchronously after the
    step and let each module's forward pre-hook wait for its own bucket."""

    megatron_fsdp_grad_comm_dtype: Literal["fp32", "bf16", "fp16", "auto"] = flag(
        "auto", group="mixed precision"
    )
    """The dtype gradients travel in when reduced (Megatron-FSDP's): each bucket is cast to it for its
    reduction (and each shard for the one over the distributed-optimizer instances) and the result cast
    back into the gradient buffer. ``auto``: the gradients' own dtype, no copy."""

    check_for_nan_in_grad: bool = not_a_flag(False)
    """Raise, naming the parameters, if a bucket holds NaN or Inf before it is reduced."""

    bucket_size: int | None = flag(None, name="--ddp-bucket-size")
    """Elements per bucket with ``overlap_grad_reduce``; None means Megatron's default,
    ``max(40_000_000, 1_000_000 * dp_size)``. Ignored without overlap (one bucket per buffer)."""

    average_in_collective: bool = flag(False, name="--ddp-average-in-collective")
    """Average in the collective instead of pre-scaling by 1/dp. Gloo has no AVG reduction, so here
    it means "sum, then divide after the collective"; the result is the same average."""

    def __post_init__(self) -> None:
        self._resolve_sharding_strategy()
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather=True needs use_distributed_optimizer=True (only the distributed "
                "optimizer gathers parameters)"
            )
        self._check_instances()
        self._check_scope()
        if self.megatron_fsdp_grad_comm_dtype not in (*DTYPES, "auto"):
            raise ValueError(
                f"megatron_fsdp_grad_comm_dtype must be one of {', '.join(DTYPES)} or auto; "
                f"got {self.megatron_fsdp_grad_comm_dtype!r}"
            )
        for name in ("bucket_size", "suggested_communication_unit_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of elements or None, got {value!r}")

    def _resolve_sharding_strategy(self) -> None:
        strategy = self.data_parallel_sharding_strategy
        if strategy is None:
            strategy = (
                "optim_grads_params"
                if self.use_megatron_fsdp
                else "optim"
                if self.use_distributed_optimizer
                else "no_shard"
            )
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"data_parallel_sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}; "
                f"got {strategy!r}"
            )
        if (strategy != "no_shard") != self.use_distributed_optimizer:
            raise ValueError(
                f"data_parallel_sharding_strategy={strategy!r} "
                + (
                    "shards the optimizer: it needs use_distributed_optimizer=True"
                    if strategy != "no_shard"
                    else "shards nothing, but use_distributed_optimizer=True shards the optimizer (optim)"
                )
            )
        self.data_parallel_sharding_strategy = strategy

    def _check_scope(self) -> None:
        scope = self.data_parallel_sharding_scope
        if scope not in SHARDING_SCOPES:
            raise ValueError(
                f"data_parallel_sharding_scope must be one of {', '.join(SHARDING_SCOPES)}; got {scope!r}"
            )
        if scope != "auto" and not self.shard_grads:
            raise ValueError(
                f"data_parallel_sharding_scope={scope!r} says how long ZeRO-2/3 keep a bucket whole, but "
                f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r} keeps every bucket "
                "whole: give 'optim_grads' or 'optim_grads_params', or leave the scope 'auto'"
            )

    def sharding_scope(self, pipeline_stages: int) -> str | None:
        """The scope a chunk of a pipeline of ``pipeline_stages`` stages runs at: ``step`` or ``microbatch``
        (``auto`` resolved), None for the strategies that keep every bucket whole."""
        if not self.shard_grads:
            return None
        return resolve_sharding_scope(self.data_parallel_sharding_scope, pipeline_stages)

    def _check_instances(self) -> None:
        instances, outer = self.num_distributed_optimizer_instances, self.outer_dp_sharding_strategy
        if not isinstance(instances, int) or instances < 1:
            raise ValueError(
                f"num_distributed_optimizer_instances must be an integer >= 1, got {instances!r}"
            )
        if instances > 1 and not self.use_distributed_optimizer:
            raise ValueError(
                f"num_distributed_optimizer_instances={instances} replicates the distributed optimizer: "
                "it needs a data_parallel_sharding_strategy other than no_shard"
            )
        if outer not in ("no_shard", "optim"):
            raise ValueError(f"outer_dp_sharding_strategy must be no_shard or optim; got {outer!r}")
        if outer == "optim" and not self.shard_params:
            raise ValueError(
                "outer_dp_sharding_strategy='optim' needs data_parallel_sharding_strategy='optim_grads_params' "
                f"(as in Megatron-FSDP); got {self.data_parallel_sharding_strategy!r}"
            )
        if outer == "optim" and instances == 1:
            raise ValueError(
                "outer_dp_sharding_strategy='optim' shards over the distributed-optimizer instances: it needs "
                "num_distributed_optimizer_instances > 1"
            )

    @property
    def grad_comm_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in, None for their own (``megatron_fsdp_grad_comm_dtype``)."""
        return DTYPES.get(self.megatron_fsdp_grad_comm_dtype)

    @property
    def shard_outer(self) -> bool:
        """The optimizer state is split over the instances too (``outer_dp_sharding_strategy='optim'``)."""
        return self.outer_dp_sharding_strategy == "optim"

    @property
    def shard_grads(self) -> bool:
        """Each rank keeps only its shard of the reduced gradients (optim_grads, optim_grads_params)."""
        return self.data_parallel_sharding_strategy in ZERO_STRATEGIES

    @property
    def shard_params(self) -> bool:
        """Each rank keeps only its shard of the parameters between uses (optim_grads_params)."""
        return self.data_parallel_sharding_strategy == "optim_grads_params"

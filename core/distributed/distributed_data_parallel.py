"""Data-parallel wrapper: gradients in contiguous buckets, reduced over the DP group (Megatron's DDP).

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True), model)
    config.no_sync_func = ddp.no_sync             # the schedule suspends reduction until the last microbatch
    config.grad_sync_func = ddp.start_grad_sync   # optional: launch right after a chunk's last backward
    # several chunks (virtual pipeline): one context for all, one grad_sync_func per chunk
    config.no_sync_func = multi_no_sync(chunks); config.grad_sync_func = [c.start_grad_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads   # waits via ddp.finish_grad_sync()

Unlike ``torch.nn.parallel.DistributedDataParallel`` it has no all-reduce in forward or at
backward's end: the pipeline schedule decides when gradients are final (the last microbatch of a
chunk), and the wrapper exposes exactly the hooks the schedule calls. Gradients end up in
``param.main_grad``, in fp32 for a bf16 model by default, which is what the mixed-precision
optimizer steps from; where the gradient has the parameter's dtype, ``param.grad`` is that same
buffer view.

With ``use_distributed_optimizer`` the buckets are reduce-scattered instead of all-reduced (each
data-parallel rank gets the sum of its shard), the parameters live in a flat buffer of the same
layout, and ``start_param_sync`` all-gathers the shards the optimizer updated (see
:mod:`core.distributed.grad_buffer`).

With ``data_parallel_sharding_strategy`` ``optim_grads`` (ZeRO-2) or ``optim_grads_params`` (ZeRO-3)
the buckets follow the layers and keep only this rank's reduced gradient shard, and under ZeRO-3 only
its parameter shard, between uses. How long a bucket stays whole is ``data_parallel_sharding_scope``
(``sharding_scope`` here, ``auto`` resolved by the pipeline size of ``pg_collection``): at ``step`` scope
gradients accumulate in the full bucket and are reduce-scattered once after the chunk's last backward,
and ZeRO-3 gathers each bucket at its first use and keeps it until the optimizer step; at ``microbatch``
scope every microbatch is reduce-scattered, and ZeRO-3 gathers each layer around its forward and its
backward (without a pipeline, the chunk's own weights and the last layer once, kept from forward into
backward: :mod:`core.distributed.sharded_bucket`, :mod:`core.distributed.sharding_units`). With
``num_distributed_optimizer_instances`` N > 1 (HSDP) the buckets are sharded over this rank's instance
only (``intra_dp_group``, DPxCP / N ranks; an MoE expert's over ``intra_expert_dp_group``, its
instance's EDP / N expert replicas) and each reduced shard is summed over its N replicas
(``inter_dp_group``, the same group for experts), or with ``outer_dp_sharding_strategy='optim'`` split
over them (:mod:`core.distributed.grad_buffer`). Read ZeRO-3 weights after ``finish_param_sync()`` (or through ``state_dict()``, which calls it); write them whole,
then call ``keep_gathered_params()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from core import parallel_state as ps
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.distributed.grad_buffer import IDLE, Bucket, GradBuffer, InstanceChain, ReduceOptions
from core.distributed.sharded_bucket import ShardedBucket, ShardedGradBuffer, storage_bytes
from core.distributed.sharding_units import (
    layer_units,
    register_unit_hooks,
    sharded_grad_accumulated,
    sharded_grad_hook,
    sharded_main_grad_claim,
    unit_of_params,
)
from core.parallel_state import ParallelGroups, group_size
from core.tensor_parallel.fp8_params import held_weight


def _instance_groups(
    ddp_config: DistributedDataParallelConfig,
    groups: ParallelGroups | None,
    dp_group: ProcessGroup | None,
    expert_dp_group: ProcessGroup | None,
) -> tuple[ProcessGroup | None, ProcessGroup | None, ProcessGroup | None, ProcessGroup | None]:
    """(the group dense buckets are sharded over, the group of their replicas, the same two for expert
    buckets): (the data-parallel group, None, the expert data-parallel group, None) with one
    distributed-optimizer instance, else the groups ``initialize_model_parallel`` made for N."""
    instances = ddp_config.num_distributed_optimizer_instances
    if instances == 1:
        return dp_group, None, expert_dp_group, None
    if groups is None or groups.num_distributed_optimizer_instances != instances:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} needs the process groups of "
            f"initialize_model_parallel(num_distributed_optimizer_instances={instances})"
        )
    return groups.intra_dp_cp, groups.inter_dp_cp, groups.intra_expt_dp, groups.inter_expt_dp


def is_expert_param(param: nn.Parameter) -> bool:
    """An MoE expert's parameter (Megatron's ``allreduce = False``): reduced over expert data parallelism."""
    return not getattr(param, "allreduce", True)


def _reduce_options(
    config: Any, ddp_config: DistributedDataParallelConfig, dp_size: int, scope: str | None
) -> ReduceOptions:
    """How buckets reduce: averaging over replicas by 1/dp before the sum, or (average_in_collective)
    after it. A per-token loss is normalised later by the global token count, so the sum is kept."""
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    if per_token and ddp_config.average_in_collective:
        raise ValueError(
            "average_in_collective=True cannot be combined with calculate_per_token_loss: a "
            "per-token loss needs gradients summed over data-parallel ranks, not averaged"
        )
    pre_scale = post_scale = 1.0
    if not per_token:
        if ddp_config.average_in_collective:
            post_scale = 1.0 / dp_size
        else:
            pre_scale = 1.0 / dp_size
    return ReduceOptions(
        pre_scale=pre_scale,
        post_scale=post_scale,
        async_op=ddp_config.overlap_grad_reduce,
        check_for_nan=ddp_config.check_for_nan_in_grad,
        shard=ddp_config.use_distributed_optimizer,
        shard_grads=ddp_config.shard_grads,
        shard_params=ddp_config.shard_params,
        step_scope=scope == "step",
        in_flight_elements=ddp_config.suggested_communication_unit_size,
        comm_dtype=ddp_config.grad_comm_dtype,
        outer_shard=ddp_config.shard_outer,
    )


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; its gradients live in flat buffers and are reduced in buckets.

    Attributes it does not have itself (``set_input_tensor``, ``pre_process``, ``vp_stage``...)
    are looked up on the wrapped ``module``, so schedules and user code treat it as the model.
    ``state_dict`` is the module's, without a ``module.`` prefix, so checkpoints do not depend on
    the wrapper. ``disable_bucketing`` (and, as in Megatron, any pipeline rank but the first, where
    reduction is off the critical path) puts each buffer in a single bucket.

    MoE expert parameters (``allreduce = False``) live in buffers of their own, reduced over
    ``expert_data_parallel_group`` (the replicas of this rank's experts) but scaled by 1/dp like the
    others, as Megatron does: the tokens of every data-parallel rank reached them through the
    expert-parallel dispatcher, so their sum over the expert replicas covers all dp replicas' losses.
    With N distributed-optimizer instances they are sharded over this rank's instance of those replicas
    and summed over the N instances, as the dense buckets are.

    ``pg_collection``: the model's process groups, from which the data-parallel (with context
    parallelism folded in) and expert data-parallel groups and the pipeline rank come; an explicit
    ``data_parallel_group`` or ``expert_data_parallel_group`` takes precedence. Without either,
    ``parallel_state``'s groups (Megatron's default) when they are set up, else one process.
    """

    def __init__(
        self,
        config: Any,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        disable_bucketing: bool = False,
        *,
        pg_collection: ParallelGroups | None = None,
        data_parallel_group: ProcessGroup | None = None,
        expert_data_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        groups = ps.groups_or_default(pg_collection)
        if data_parallel_group is None and groups is not None:
            data_parallel_group = groups.dp_cp
        if expert_data_parallel_group is None and groups is not None:
            expert_data_parallel_group = groups.expt_dp
        self.data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group
        self.intra_dp_group, self.inter_dp_group, self.intra_expert_dp_group, self.inter_expert_dp_group = (
            _instance_groups(ddp_config, groups, data_parallel_group, expert_data_parallel_group)
        )
        pp_rank = groups.rank_in("pp") if groups is not None else 0
        self.pipeline_stages = groups.size("pp") if groups is not None else 1
        self.sharding_scope = ddp_config.sharding_scope(self.pipeline_stages)
        """``step`` or ``microbatch`` under ZeRO-2/3 (``data_parallel_sharding_scope`` resolved), else None."""
        dp_size = group_size(self.data_parallel_group)
        self.bucket_size = ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp_size)
        if not ddp_config.overlap_grad_reduce or disable_bucketing or pp_rank > 0:
            self.bucket_size = None
        if ddp_config.shard_grads:  # buckets follow the layers instead (see core.distributed.sharding_units)
            self.bucket_size = None
        self.buffers: list[GradBuffer] = []
        self._build_buffers(_reduce_options(config, ddp_config, dp_size, self.sharding_scope))
        self.param_to_bucket: dict[nn.Parameter, Bucket] = {
            p: bucket for bucket in self.buckets for p in bucket.params
        }
        chain = InstanceChain()  # HSDP with overlap: one order of the reductions over the instances
        for bucket in self.buckets:
            bucket.instance_chain = chain
        self._register_hooks()

    def _build_buffers(self, options: ReduceOptions) -> None:
        """One gradient buffer per (parameter dtype, gradient dtype, expert or not)."""
        grad_in_fp32 = self.ddp_config.grad_reduce_in_fp32
        by_dtype: dict[tuple[torch.dtype, torch.dtype, bool], list[tuple[nn.Parameter, str]]] = {}
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                held = held_weight(param)  # a weight held in FP8 has gradients in the model's dtype
                grad_dtype = torch.float32 if grad_in_fp32 else param.dtype if held is None else held.dtype
                by_dtype.setdefault((param.dtype, grad_dtype, is_expert_param(param)), []).append(
                    (param, name)
                )
        sharded = self.ddp_config.shard_grads
        units = unit_of_params(self.module) if sharded else None
        for (_, grad_dtype, expert), members in by_dtype.items():
            self.buffers.append(
                (ShardedGradBuffer if sharded else GradBuffer)(
                    [p for p, _ in members],
                    [n for _, n in members],
                    grad_dtype,
                    self.bucket_size,
                    self.intra_expert_dp_group if expert else self.intra_dp_group,
                    first_bucket_index=len(self.buckets),
                    options=options,  # 1/dp for experts too: see the class docstring
                    units=units,
                    inter_group=self.inter_expert_dp_group if expert else self.inter_dp_group,
                )
            )

    def _register_hooks(self) -> None:
        """Gradient hooks on every parameter; forward pre-hooks when parameter gathers overlap."""
        if self.ddp_config.shard_grads:
            self._register_sharded_hooks()
            return
        # Where the gradient has the parameter's dtype, ``param.grad`` is ``main_grad`` itself (as
        # torch DDP's gradient_as_bucket_view) once the step's first gradient is in: autograd
        # accumulates every later microbatch straight into the buffer, and the hook below has
        # nothing to copy. Otherwise the hook adds each microbatch's gradient into the (fp32) buffer
        # and drops it. The step's first gradient of a parameter is copied instead of added: the
        # buffers are not zeroed between steps (see core.distributed.grad_buffer).
        self._grad_is_main_grad = [p for p in self.param_to_bucket if p.main_grad.dtype == p.dtype]
        for param in self._grad_is_main_grad:
            param.grad = param.main_grad
        self._hook_handles = []
        for param, bucket in self.param_to_bucket.items():
            ready = self._make_ready(bucket)
            # For layers that accumulate into main_grad themselves (gradient_accumulation_fusion): they
            # call grad_accumulated and set grad_added_to_main_grad (Megatron's name), so that the
            # hook, which autograd may still run for the parameter, does nothing more.
            param.grad_accumulated = ready
            param.claim_main_grad = self._make_claim(bucket)
            param.grad_added_to_main_grad = False
            hook = self._make_grad_hook(bucket, ready)
            self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))
        if self.ddp_config.overlap_param_gather:
            self._hook_handles += [
                module.register_forward_pre_hook(self._make_forward_pre_hook(buckets))
                for module, buckets in self._buckets_by_module().items()
            ]

    def _register_sharded_hooks(self) -> None:
        """ZeRO-2/3: each microbatch's gradient goes into its bucket's transient full buffer (never into
        ``param.grad`` for good); ZeRO-3 also gathers and frees each unit's parameters around its use."""
        self._grad_is_main_grad = []
        self._hook_handles = []
        for param, bucket in self.param_to_bucket.items():
            param.grad_added_to_main_grad = False
            param.grad_accumulated = sharded_grad_accumulated(bucket)
            param.claim_main_grad = sharded_main_grad_claim(bucket)
            self._hook_handles.append(param.register_post_accumulate_grad_hook(sharded_grad_hook(bucket)))
        if self.ddp_config.overlap_param_gather and not self.ddp_config.shard_params:  # ZeRO-2: as ZeRO-1
            self._hook_handles += [
                module.register_forward_pre_hook(self._make_forward_pre_hook(buckets))
                for module, buckets in self._buckets_by_module().items()
            ]
        if self.ddp_config.shard_params:
            self._register_unit_hooks()

    def _register_unit_hooks(self) -> None:
        """ZeRO-3: each unit (the chunk's own weights, then each layer) gathers around its use; with
        ``overlap_param_gather`` it prefetches its neighbour's (the next in forward, the previous in
        backward), or with ``suggested_communication_unit_size`` the neighbours' that fit (:func:`_prefetched`).
        At microbatch scope without a pipeline the chunk's own unit and the last layer are kept gathered from
        their forward into their backward, which follows at once (:mod:`core.distributed.sharding_units`)."""
        layers = layer_units(self.module)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        units = []
        for unit in [self.module, *layers]:
            own = {id(p) for p in unit.parameters()} - (in_layers if unit is self.module else set())
            buckets = list({id(b): b for p, b in self.param_to_bucket.items() if id(p) in own}.values())
            if buckets:
                units.append((unit, buckets))
        prefetch = self.ddp_config.overlap_param_gather
        budget = self.ddp_config.suggested_communication_unit_size
        kept = set()
        if self.sharding_scope == "microbatch" and self.pipeline_stages == 1:
            kept = {id(units[0][0]), id(units[-1][0])} if units else set()
        for index, (unit, buckets) in enumerate(units):
            after = [group for _, group in units[index + 1 :]]
            before = [group for _, group in reversed(units[1:index])]  # the chunk's own stays gathered
            if unit is self.module:  # its backward starts with the last layer's
                before = [group for _, group in reversed(units[1:])]
            self._hook_handles += register_unit_hooks(
                unit,
                buckets,
                next_in_forward=_prefetched(after, budget) if prefetch else [],
                next_in_backward=_prefetched(before, budget) if prefetch else [],
                keep_after_forward=id(unit) in kept,
            )

    def persistent_bytes(self) -> dict[str, int]:
        """Bytes of parameters and gradients this rank holds now in its buckets, padding included (under
        ZeRO-2/3 the full buckets count only while allocated: between steps, none are)."""
        params = grads = 0
        for bucket in self.buckets:
            if isinstance(bucket, ShardedBucket):
                grads += storage_bytes(bucket.grad_shard) + storage_bytes(bucket.grad_data)
                params += storage_bytes(bucket.param_data)
                params += storage_bytes(bucket.param_shard) if bucket.shards_params else 0
                continue
            grads += bucket.grad_data.numel() * bucket.grad_data.element_size()
            if bucket.param_data is not None:
                params += bucket.param_data.numel() * bucket.param_data.element_size()
            else:
                params += sum(p.numel() * p.element_size() for p in bucket.params)
        return {"params": params, "grads": grads}

    # -- plumbing ---------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not yet assigned: do not recurse
                raise
            return getattr(self.module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """The wrapped module's state dict (no ``module.`` prefix). Under ZeRO-3 the parameters are
        gathered first (they stay gathered until the next step frees them): between uses their
        tensors have no memory, and reading them then is undefined (read them after
        ``finish_param_sync``)."""
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module (keys without a ``module.`` prefix); under ZeRO-3 into the
        gathered parameters, whose shards are then kept."""
        self.finish_param_sync()
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self.keep_gathered_params()
        return result

    def keep_gathered_params(self) -> None:
        """ZeRO-3: after the gathered (whole) parameters were written, keep this rank's shard of them and
        free the rest. A no-op for the other strategies."""
        for bucket in self.buckets:
            if isinstance(bucket, ShardedBucket):
                bucket.keep_gathered_params()

    @property
    def buckets(self) -> list[Bucket]:
        """All buckets, in the order their reductions are launched when backward runs in order."""
        return [bucket for buffer in getattr(self, "buffers", []) for bucket in buffer.buckets]

    def _make_ready(self, bucket: Bucket):
        """``ready(param)``: ``param``'s gradient of this microbatch is in ``main_grad``.

        The hooks and ``param.grad_accumulated`` hold their bucket weakly: autograd keeps a parameter's
        hooks alive from C++, where Python's collector cannot see a cycle back through the bucket, so
        a strong reference would keep every dropped model's buffers alive for the process's life.
        """
        overlap = self.ddp_config.overlap_grad_reduce
        bucket_ref = weakref.ref(bucket)

        def ready(param: nn.Parameter) -> None:
            bucket = bucket_ref()
            if bucket is None:  # the wrapper was dropped
                return
            if bucket.state != IDLE:
                bucket.check_accumulation_allowed(param)  # raises
            if overlap:
                bucket.register_grad_ready(param)

        return ready

    @staticmethod
    def _make_claim(bucket: Bucket):
        """``param.claim_main_grad(param)``: whether a fused layer's write is the step's first, which
        overwrites ``main_grad`` (:meth:`Bucket.claim`). Holds its bucket weakly: see ``_make_ready``."""
        bucket_ref = weakref.ref(bucket)

        def claim_main_grad(param: nn.Parameter) -> bool:
            bucket = bucket_ref()
            return bucket is not None and bucket.claim(param)

        return claim_main_grad

    @staticmethod
    def _make_grad_hook(bucket: Bucket, ready):
        bucket_ref = weakref.ref(bucket)  # weakly: see _make_ready

        def hook(param: nn.Parameter) -> None:
            # Runs right after autograd accumulated into param.grad; it runs for every parameter of
            # every microbatch, so it does no more than this. If param.grad is main_grad, autograd has
            # just accumulated into the buffer in place; otherwise add it there and let it go.
            if param.grad_added_to_main_grad:  # a fused layer accumulated and reported it already
                param.grad_added_to_main_grad = False
                return
            bucket = bucket_ref()
            if bucket is None:
                return
            if bucket.state != IDLE:
                bucket.check_accumulation_allowed(param)  # raises (where grad is main_grad, autograd added)
            # Identity, not data pointers: fake tensors (the planner's dry run) have none.
            grad, main_grad = param.grad, param.main_grad
            if grad is not None and grad is not main_grad:
                # The step's first overwrites last step's values. Asked of the parameter: a parameter
                # two chunks share (a tied embedding under ZBV) has one main_grad, the last wrapper's.
                if param.claim_main_grad(param):
                    main_grad.copy_(grad)
                else:
                    main_grad.add_(grad)
                param.grad = main_grad if main_grad.dtype == param.dtype else None
            ready(param)

        return hook

    def _buckets_by_module(self) -> dict[nn.Module, list[Bucket]]:
        """Each submodule that owns parameters -> the buckets holding them, in forward order."""
        out: dict[nn.Module, list[Bucket]] = {}
        for module in self.module.modules():
            buckets = {
                id(b): b
                for p in module.parameters(recurse=False)
                if (b := self.param_to_bucket.get(p)) is not None
            }
            if buckets:
                out[module] = sorted(buckets.values(), key=lambda b: -b.index)
        return out

    @staticmethod
    def _make_forward_pre_hook(buckets: list[Bucket]):
        def hook(module: nn.Module, args: Any) -> None:
            # The module is about to read its parameters: their all-gather must have landed.
            for bucket in buckets:
                bucket.finish_param_sync()

        return hook

    # -- the schedule's hooks ------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside this context (every microbatch but the last)."""
        for bucket in self.buckets:
            bucket.is_last_microbatch = False
        try:
            yield
        finally:
            for bucket in self.buckets:
                bucket.is_last_microbatch = True

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch every bucket's reduction not launched yet (``config.grad_sync_func``)."""
        for bucket in self.buckets:
            bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction: wait for launched ones, run the others now."""
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply all gradients in the buffers by ``scaling_factor``."""
        for buffer in self.buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Start a step's gradients: re-arm the buckets; call once at the start of every step.

        Nothing is zeroed here: each parameter's first gradient of the step overwrites its
        ``main_grad``, and what gets none is zeroed before its bucket is reduced
        (:mod:`core.distributed.grad_buffer`). ``param.grad`` is None until that first gradient (then
        ``main_grad`` again, where the dtypes agree), so autograd never adds into last step's values.
        """
        for buffer in self.buffers:
            buffer.reset()
        for param in self._grad_is_main_grad:
            param.grad = None

    def zero_unwritten_grads(self) -> None:
        """Zero the ``main_grad`` of every parameter that got no gradient this step (done by each
        bucket's reduction anyway; for readers of the buffers that come without one)."""
        for bucket in self.buckets:
            bucket.zero_unwritten()

    # -- the distributed optimizer's hooks ------------------------------------------------------
    def start_param_sync(self) -> None:
        """All-gather the parameter shards the distributed optimizer just updated.

        With ``overlap_param_gather`` the all-gathers are launched asynchronously, in the order the
        next forward needs them, and each module's forward pre-hook waits for its own buckets; so
        the gathers of later buckets overlap the forward of earlier layers. Without it they
        complete here. A no-op without the distributed optimizer.
        """
        for bucket in reversed(self.buckets):
            bucket.start_param_sync(async_op=self.ddp_config.overlap_param_gather)

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (before reading the weights)."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def wait_for_collectives(self) -> None:
        """Wait for every collective still running that this model's buckets launched, and change
        nothing else: the handles stay, and whoever waits for them later returns at once. (For a
        profiler, which must not stop while a collective it saw start still runs on gloo's threads.)"""
        for bucket in self.buckets:
            for work in bucket.in_flight():
                work.wait()

    def broadcast_params(self) -> None:
        """Copy the first data-parallel rank's parameters to the others (identical replicas); an
        expert's, the first of its expert-data-parallel replicas'."""
        self.finish_param_sync()
        for param in self.module.parameters():
            group = self.expert_data_parallel_group if is_expert_param(param) else self.data_parallel_group
            if group is not None and dist.get_world_size(group) > 1:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
        self.keep_gathered_params()


def _prefetched(units: list[list[ShardedBucket]], budget: int | None) -> list[ShardedBucket]:
    """The buckets ZeRO-3 prefetches of ``units`` (each unit's buckets, in the order they will be used):
    the next unit's, or with ``budget`` (``suggested_communication_unit_size``) the next units' while
    together they hold at most half of it (Megatron-FSDP's all-gather prefetch size), maybe none."""
    if budget is None:
        return list(units[0]) if units else []
    chosen, elements = [], 0
    for buckets in units:
        elements += sum(bucket.param_data.numel() for bucket in buckets)
        if elements > budget // 2:
            break
        chosen += buckets
    return chosen


def multi_no_sync(chunks: list[nn.Module]):
    """One ``no_sync_func`` suspending reduction on every chunk at once (virtual pipelining).

    Megatron's interleaved schedule builds this itself from a list of functions; here it is built
    once, so a schedule only ever calls one context manager.
    """

    @contextmanager
    def no_sync() -> Iterator[None]:
        with ExitStack() as stack:
            for chunk in chunks:
                stack.enter_context(chunk.no_sync())
            yield

    return no_sync

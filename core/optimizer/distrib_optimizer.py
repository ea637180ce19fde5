"""The distributed optimizer (ZeRO-1, Megatron's design): optimizer state sharded over data parallelism.

Without it every data-parallel rank holds fp32 main parameters and both Adam moments for the whole
model: 12 bytes per parameter for a 16-bit model (8 for fp32), on every rank. Here each rank
keeps them for its own shard of the data-parallel buffers only, so the bytes per rank fall to
1/DP, give or take a bucket's padding.

The data-parallel wrapper (``DistributedDataParallel`` with ``use_distributed_optimizer``) cuts
each bucket into DP equal shards and reduce-scatters the gradients, so rank ``r`` holds the
reduced gradient of shard ``r``. A parameter can straddle shards; the part of it in this rank's
shard is a :class:`~core.optimizer.param_state.ParamShard` ``[start, end)``. The step:

1. each shard's main parameter takes its gradient: a view of the gradient buffer (fp32), or an
   fp32 copy of it (16-bit gradients);
2. unscaling (fp16), the global norm, clipping and the NaN skip run over the shards as before; the
   squared sums are added up over every rank (the shards of all DP ranks make up the model);
3. the inner optimizer steps on the shards (Adam moments exist only for them);
4. 16-bit models copy the updated fp32 shards into their parameter buffer (fp32 models stepped
   on views of it), then every chunk all-gathers its parameter buffer
   (``DistributedDataParallel.start_param_sync``): at once, or with ``overlap_param_gather``
   asynchronously, each module's forward pre-hook waiting for its own bucket.

Under ``optim_grads`` and ``optim_grads_params`` (ZeRO-2/3, :mod:`core.distributed.sharded_bucket`)
the same ranges are stepped, but the gradient is read from the bucket's persistent reduced shard
(the full gradient buffer is gone by then) and, under ZeRO-3, the values are read from and written
to the persistent parameter shard; ``start_param_sync`` then frees any gathered copy instead of
gathering (each layer gathers its parameters when it next runs).

With ``--fp8-param-gather`` the weights of the dense FP8 layers, and the FP8 routed experts' stacks, are
held in E4M3 (:mod:`core.tensor_parallel.fp8_params`): step 4 casts their updated fp32 shards with each
weight's scale (each expert's, for a stack) instead of copying them, and the all-gather moves one byte
an element. Their main copies start from the values the weights had before they were cast, and a
checkpoint stores those main values (:meth:`DistributedOptimizer.held_weights_in_model_dtype`; a
stack's under each expert's name).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from core.optimizer.optimizer import _HALF, MegatronOptimizer, OptimizerConfig
from core.optimizer.param_state import ParamShard
from core.parallel_state import ParallelGroups
from core.tensor_parallel.fp8_params import cast_held_weights, dequantized, held_fp8_weights, held_weight


class DistributedOptimizer(MegatronOptimizer):
    """Steps this data-parallel rank's shard of every bucket; the interface of the other optimizers.

    ``optimizer`` is built on the model's parameters (as for the other flavours); each one is
    replaced, in its group, by the main parameter of the part this rank owns, or dropped if it
    owns none.
    """

    shards_data_parallel = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model_chunks: Iterable[nn.Module],
        groups: ParallelGroups | None = None,
    ) -> None:
        model_chunks = list(model_chunks or [])
        self._bucket_of = {}
        for chunk in model_chunks:
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is None or not ddp_config.use_distributed_optimizer:
                raise TypeError(
                    "the distributed optimizer needs every model chunk wrapped in DistributedDataParallel "
                    "with DistributedDataParallelConfig(use_distributed_optimizer=True)"
                )
            self._bucket_of.update(chunk.param_to_bucket)
        self.replicated_over_instances = any(
            c.ddp_config.num_distributed_optimizer_instances > 1 and not c.ddp_config.shard_outer
            for c in model_chunks
        )
        """Each of N > 1 distributed-optimizer instances holds all of the state (outer no_shard)."""
        self.state_is_a_replica = self.replicated_over_instances and any(
            b.instance_rank > 0 for b in self._bucket_of.values()
        )
        """This rank's state is a copy of the first instance's (whose ranks write it to checkpoints)."""
        super().__init__(optimizer, config, model_chunks, groups)
        shard_of = {id(s.model_param): s for s in self._shards}
        self._held = [(p, shard_of.get(id(p))) for _, p in held_fp8_weights(model_chunks)]
        """Every weight of the chunks held in FP8, in module order (the same on every rank of its amax
        group), with this rank's shard of it (None: it owns none)."""
        for param, _ in self._held:
            held_weight(param).high_precision = None  # the main copies have them now

    def _make_shard(self, param: nn.Parameter) -> ParamShard | None:
        name = self._name(param)
        bucket = self._bucket_of.get(param)
        if bucket is None:
            raise ValueError(f"parameter {name} is in no data-parallel buffer of the model chunks")
        owned = bucket.owned_range(param)
        if owned is None:
            return None
        start, end = owned
        if held_weight(param) is not None:
            return self._held_shard(name, param, bucket, start, end)
        views = {}
        if hasattr(bucket, "shard_views"):  # ZeRO-2/3: the bucket's persistent shards
            param_view, grad_view = bucket.shard_views(param)
            views = {"param_view": param_view, "grad_view": grad_view}
            view = param_view
        else:
            view = param.detach().reshape(-1)[start:end]
        if param.dtype in (torch.float32, self.config.main_params_dtype):  # stepped where the model keeps it
            return ParamShard(name, param, view, start, end, copy=False, **views)
        if param.dtype in _HALF:
            return ParamShard(name, param, view.clone().float(), start, end, copy=True, **views)
        raise TypeError(f"cannot optimise {name} of dtype {param.dtype}; expected bf16, fp16 or fp32")

    def _held_shard(self, name: str, param: nn.Parameter, bucket, start: int, end: int) -> ParamShard:
        """A weight held in FP8: its main copy starts from the values it was cast from."""
        meta = held_weight(param)
        source = meta.high_precision if meta.high_precision is not None else dequantized(param)
        main = source.detach().reshape(-1)[start:end].to(self.config.main_params_dtype, copy=True)
        views = {}
        if hasattr(bucket, "shard_views"):  # ZeRO-2/3: the bucket's persistent shards (FP8 values)
            views = dict(zip(("param_view", "grad_view"), bucket.shard_views(param)))
        return ParamShard(name, param, main, start, end, copy=True, held_in_fp8=True, **views)

    def _cast_held(self, gather: bool) -> None:
        """Cast the held weights from the main shards (collective over their amax groups); ``gather``:
        and all-gather them now (after a load; a step's gather is the chunks' usual one)."""
        if not self._held:
            return
        pieces = [
            (p, None, None, None) if s is None else (p, s.start, s.main_param, s.model_view())
            for p, s in self._held
        ]
        cast_held_weights(pieces)
        if gather:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
                chunk.finish_param_sync()

    def held_weights_in_model_dtype(self) -> dict[str, torch.Tensor]:
        """Every weight held in FP8, by name: its main values in the model's dtype, gathered from the
        data-parallel shards (collective over each bucket's group; a checkpoint stores these, so
        resuming, resharding and exporting read the master weights, not the FP8 ones)."""
        out: dict[str, torch.Tensor] = {}
        for param, shard in self._held:
            meta, bucket = held_weight(param), self._bucket_of[param]
            full = torch.zeros(param.numel(), dtype=meta.dtype, device=param.device)
            if shard is not None:
                full[shard.start : shard.end] = shard.main_param.detach().reshape(-1)
            if bucket.dp_size > 1:  # each element is non-zero on one rank only: the sum is exact
                dist.all_reduce(full, group=bucket.group)
            out[self._name(param)] = full.view(param.shape)
        return out

    def _grad_stats_group(self):
        """Every rank: each DP rank counts only its shard, so the sums run over DP as well as TP x PP
        (without the model's groups, over the chunks' one data-parallel group). With N distributed-
        optimizer instances that each hold a whole optimizer, over this rank's instance only: its ranks'
        shards cover every dense parameter once, and every MoE expert once too (an expert's shards lie
        in the instance's own expert replicas, :func:`core.rank_groups.generate_expert_instance_groups`)."""
        if self.groups is not None:
            return self.groups.intra_dist_opt if self.replicated_over_instances else dist.group.WORLD
        which = "intra_dp_group" if self.replicated_over_instances else "data_parallel_group"
        groups = {id(getattr(c, which)): getattr(c, which) for c in self.model_chunks}
        return next(iter(groups.values())) if len(groups) == 1 else None

    def prepare_grads(self) -> None:
        """Each shard's gradient: its range of the (reduce-scattered) gradient buffer, in the main
        weights' dtype (fp32, or the model's own)."""
        self._zero_unwritten_grads()
        for s in self._shards:
            grad = s.model_grad()
            s.main_param.grad = None if grad is None else grad.to(s.main_param.dtype)

    def _copy_main_params_to_model_params(self) -> None:
        super()._copy_main_params_to_model_params()
        self._cast_held(gather=False)
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def reload_model_params(self) -> None:
        """Refresh the main copies from the model after a load; a weight held in FP8 from the values
        the load gave it (``Fp8Weight.high_precision``), then cast and gathered again."""
        super().reload_model_params()
        for param, shard in self._held:
            meta = held_weight(param)
            if shard is not None and meta.high_precision is not None:
                with torch.no_grad():
                    shard.main_param.copy_(meta.high_precision.reshape(-1)[shard.start : shard.end])
            meta.high_precision = None
        self._cast_held(gather=True)

    def load_param_state_by_name(self, state: dict) -> None:
        super().load_param_state_by_name(state)
        self._cast_held(gather=True)  # the main copies changed: so do the FP8 weights

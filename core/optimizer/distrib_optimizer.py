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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from core.optimizer.optimizer import _HALF, MegatronOptimizer, OptimizerConfig
from core.optimizer.param_state import ParamShard
from core.parallel_state import ParallelGroups


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

    def _make_shard(self, param: nn.Parameter) -> ParamShard | None:
        name = self._name(param)
        bucket = self._bucket_of.get(param)
        if bucket is None:
            raise ValueError(f"parameter {name} is in no data-parallel buffer of the model chunks")
        owned = bucket.owned_range(param)
        if owned is None:
            return None
        start, end = owned
        views = {}
        if hasattr(bucket, "shard_views"):  # ZeRO-2/3: the bucket's persistent shards
            param_view, grad_view = bucket.shard_views(param)
            views = {"param_view": param_view, "grad_view": grad_view}
            view = param_view
        else:
            view = param.detach().reshape(-1)[start:end]
        if param.dtype == torch.float32:
            return ParamShard(name, param, view, start, end, copy=False, **views)
        if param.dtype in _HALF:
            return ParamShard(name, param, view.clone().float(), start, end, copy=True, **views)
        raise TypeError(f"cannot optimise {name} of dtype {param.dtype}; expected bf16, fp16 or fp32")

    def _grad_stats_group(self):
        """Every rank: each DP rank counts only its shard, so the sums run over DP as well as TP x PP
        (without the model's groups, over the chunks' one data-parallel group). With N distributed-
        optimizer instances that each hold a whole optimizer, over this rank's instance only."""
        if self.groups is not None:
            return self.groups.intra_dist_opt if self.replicated_over_instances else dist.group.WORLD
        which = "intra_dp_group" if self.replicated_over_instances else "data_parallel_group"
        groups = {id(getattr(c, which)): getattr(c, which) for c in self.model_chunks}
        return next(iter(groups.values())) if len(groups) == 1 else None

    def prepare_grads(self) -> None:
        """Each shard's gradient: its range of the (reduce-scattered) gradient buffer, in fp32."""
        self._zero_unwritten_grads()
        for s in self._shards:
            grad = s.model_grad()
            s.main_param.grad = None if grad is None else grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        super()._copy_main_params_to_model_params()
        for chunk in self.model_chunks:
            chunk.start_param_sync()

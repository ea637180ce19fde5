"""How a GPT becomes parallel, in one place: this rank's chunks, their data-parallel wrappers and hooks.

    model = parallelize_gpt(model_provider, layout=run.layout, groups=groups, ddp_config=run.ddp)
    model.chunks      # what the schedule, the optimizer and checkpoints take (DDP wrappers with ddp_config)
    model.modules     # the GPTModel chunks themselves
    optimizer = get_megatron_optimizer(optimizer_config, model.chunks)
    hooks = model.schedule_hooks(optimizer)     # handed to the schedule at each call: schedule_hooks=hooks

- **Tensor parallelism** lives in the layers (``ColumnParallelLinear``, ``RowParallelLinear``,
  ``VocabParallelEmbedding``): the provider builds them at the sizes its config says.
- **Pipeline parallelism** comes from the layout: this rank builds one chunk per virtual stage it
  runs, and the layout says whether each holds the embedding (``pre_process``) or the loss
  (``post_process``). When one rank holds both ends (ZBV's V), the loss chunk borrows the
  embedding's Parameter, so a tied embedding is one weight.
- **The meta device** (``init_model_with_meta_device``): the chunks are built with shapes only; the
  data-parallel wrappers give each parameter its memory and initial values as they lay their buckets
  out (under ZeRO-3 one bucket at a time, keeping only this rank's shard), and what no wrapper holds
  gets its memory here, in place.
- **Data parallelism** wraps each chunk in ``DistributedDataParallel`` over the data-parallel group
  (with context parallelism folded in), gradients in buckets; MoE experts' over the
  expert-data-parallel group (their replicas).
- **Expert parallelism** lives in the MoE layers: each builds the experts its expert-parallel rank
  holds and sends tokens to the others (``core.transformer.moe``).
- **Hooks** (:meth:`ParallelGPT.schedule_hooks`, built once the optimizer exists and passed at the
  schedule's call; nothing is written onto the configs): reduction is suspended per chunk while
  microbatches accumulate and lifted for each chunk's own last weight-gradient step (so its buckets
  launch while that backward runs); ``finalize_model_grads`` ends the step over the model's groups;
  with loss scaling the last stage's backward starts from the scaled loss.

``model_provider(pre_process, post_process, vp_stage, shared_embedding_weight)`` is Megatron's
contract; :func:`gpt_provider` makes one from a config for tools and tests.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from core import parallel_state as ps
from core.device import current_device, materialize_module
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.auxiliary_loss import auxiliary_loss_scale_hook
from core.pipeline_parallel.hooks import ScheduleHooks
from core.pipeline_parallel.layout import PipelineLayout
from core.tensor_parallel.fp8 import set_amax_group
from core.tensor_parallel.fp8_params import hold_weights_in_fp8
from core.transformer.transformer_config import TransformerConfig
from models.gpt.gpt_model import GPTModel

__all__ = ["ParallelGPT", "gpt_provider", "parallelize_gpt"]

ModelProvider = Callable[..., nn.Module]


@dataclass(kw_only=True)
class ParallelGPT:
    """One rank's share of a parallel GPT (see the module docstring)."""

    modules: list[nn.Module]
    """The model chunks, one per virtual stage this rank runs, in stage order."""
    chunks: list[nn.Module]
    """The chunks the schedule runs: the modules wrapped for data parallelism, or the modules themselves."""
    groups: ParallelGroups | None
    """The process groups the chunks were built for (None: one process)."""

    def schedule_hooks(self, optimizer=None) -> ScheduleHooks:
        """What the schedule calls besides the chunks: gradient sync of data-parallel chunks (per chunk,
        overlapped where their config says), ``finalize_model_grads`` over this model's groups, and
        ``optimizer``'s loss scale (fp16), and the scale of this model's MoE auxiliary losses. Pass it at
        every call (``schedule_hooks=``)."""
        wrapped = [c for c in self.chunks if isinstance(c, DistributedDataParallel)]
        overlap = bool(wrapped) and wrapped[0].ddp_config.overlap_grad_reduce
        scaled = optimizer is not None and optimizer.grad_scaler is not None
        return ScheduleHooks(
            no_sync=[c.no_sync for c in wrapped] if wrapped else None,
            grad_sync=[c.start_grad_sync for c in wrapped] if overlap else None,
            finalize_model_grads=functools.partial(finalize_model_grads, groups=self.groups),
            grad_scale_func=optimizer.scale_loss if scaled else None,
            auxiliary_loss_scale=auxiliary_loss_scale_hook(self.modules),
        )


def gpt_provider(config: TransformerConfig, vocab_size: int, max_sequence_length: int) -> ModelProvider:
    """A Megatron-style model provider building ``GPTModel`` chunks of ``config``: ``GPTModel`` with the
    config and sizes bound, its stage keywords (``pre_process``, ``post_process``, ``vp_stage``,
    ``shared_embedding_weight``, ``pg_collection``) left to each call."""
    return functools.partial(GPTModel, config, vocab_size, max_sequence_length)


def _build_modules(
    model_provider: ModelProvider, layout: PipelineLayout, groups: ParallelGroups | None
) -> list[nn.Module]:
    """One chunk per virtual stage of this rank, with the embedding and loss flags the layout gives.

    Each provider call gets its ``vp_stage`` explicitly (None without virtual stages), as Megatron
    Core passes it; no global virtual-pipeline rank is set. A provider that takes ``pg_collection``
    (Megatron's name) gets the groups too.
    """
    pp_rank = groups.rank_in("pp") if groups is not None else 0
    takes = inspect.signature(model_provider).parameters
    if "pg_collection" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        given = {"pg_collection": groups}
    else:
        given = {}
    vpp = layout.vpp_size
    modules: list[nn.Module] = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        post_process = layout.has_loss(pp_rank, vp_stage)
        holder = next((m for m in modules if m.pre_process), None)  # the embedding, on this rank
        shared = (
            {"shared_embedding_weight": holder.embedding.word_embeddings.weight}
            if post_process and holder
            else {}
        )
        modules.append(
            model_provider(
                pre_process=layout.has_embedding(pp_rank, vp_stage),
                post_process=post_process,
                vp_stage=vp_stage,
                **shared,
                **given,
            )
        )
    return modules


def _check_no_shared_parameter(modules: list[nn.Module], strategy: str) -> None:
    """ZeRO-2/3 reduce (and gather) a parameter through the one chunk whose buckets hold it: refuse one
    held by two chunks (a tied embedding under ZBV's V placement)."""
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) in seen:
                raise ValueError(
                    f"data_parallel_sharding_strategy={strategy!r} cannot shard {name}, which two model chunks "
                    "of this rank share (a tied embedding under the zbv schedule); untie the embedding and "
                    "output weights or use optim"
                )
        seen.update(id(p) for p in module.parameters())


def parallelize_gpt(
    model_provider: ModelProvider,
    *,
    layout: PipelineLayout,
    groups: ParallelGroups | None = None,
    ddp_config: DistributedDataParallelConfig | None = None,
) -> ParallelGPT:
    """This rank's chunks of the model ``layout`` splits, wrapped for data parallelism when ``ddp_config``
    is given. ``groups``: the process groups (default: ``parallel_state``'s, when initialised; else
    one rank)."""
    groups = ps.groups_or_default(groups)
    modules = _build_modules(model_provider, layout, groups)
    if groups is not None:  # where FP8 amaxes are reduced (the delayed recipe; weights held in FP8)
        set_amax_group(modules, groups.tp_dp_cp, groups.expt_dp, tile_group=groups.dp_cp)
    if getattr(modules[0].config, "fp8_param_gather", False):
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            raise ValueError("fp8_param_gather only supported with distributed optimizer")
        hold_weights_in_fp8(modules)  # before the wrapper lays the parameters out: a one-byte buffer
    chunks = modules
    if ddp_config is not None:
        if ddp_config.shard_grads:
            _check_no_shared_parameter(modules, ddp_config.data_parallel_sharding_strategy)
        chunks = [DistributedDataParallel(m.config, ddp_config, m, pg_collection=groups) for m in modules]
    for module in modules:  # built on the meta device: what no wrapper's buffer holds gets memory in place
        materialize_module(module, current_device())
    return ParallelGPT(modules=modules, chunks=chunks, groups=groups)

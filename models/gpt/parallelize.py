"""How a GPT becomes parallel, in one place: this rank's chunks, their data-parallel wrappers and hooks.

    model = parallelize_gpt(model_provider, layout=run.layout, ddp_config=run.ddp,
                            make_optimizer=lambda chunks: get_megatron_optimizer(config, chunks))
    model.chunks      # what the schedule, the optimizer and checkpoints take (DDP wrappers with ddp_config)
    model.modules     # the GPTModel chunks themselves
    model.hooks       # the one ScheduleHooks every chunk's config carries, loss scale included
    model.optimizer   # with make_optimizer

- **Tensor parallelism** lives in the layers (``ColumnParallelLinear``, ``RowParallelLinear``,
  ``VocabParallelEmbedding``): the provider builds them at the sizes its config says.
- **Pipeline parallelism** comes from the layout: this rank builds one chunk per virtual stage it
  runs, and the layout says whether each holds the embedding (``pre_process``) or the loss
  (``post_process``). When one rank holds both ends (ZBV's V), the loss chunk borrows the
  embedding's Parameter, so a tied embedding is one weight.
- **Data parallelism** wraps each chunk in ``DistributedDataParallel`` over the data-parallel group
  (with context parallelism folded in), gradients in buckets; MoE experts' over the
  expert-data-parallel group (their replicas).
- **Expert parallelism** lives in the MoE layers: each builds the experts its expert-parallel rank
  holds and sends tokens to the others (``core.transformer.moe``).
- **Hooks**: reduction is suspended per chunk while microbatches accumulate and lifted for each
  chunk's own last weight-gradient step (so its buckets launch while that backward runs);
  ``finalize_model_grads`` ends the step; with loss scaling the last stage's backward starts from
  the scaled loss.

``model_provider(pre_process, post_process, vp_stage, shared_embedding_weight)`` is Megatron's
contract; :func:`gpt_provider` makes one from a config for tools and tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from core import parallel_state as ps
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.hooks import ScheduleHooks
from core.pipeline_parallel.layout import PipelineLayout
from core.tensor_parallel.fp8 import set_amax_group
from core.transformer.transformer_config import TransformerConfig
from models.gpt.gpt_model import GPTModel

__all__ = ["ParallelGPT", "gpt_provider", "parallelize_gpt"]

ModelProvider = Callable[..., nn.Module]


@dataclass
class ParallelGPT:
    """One rank's share of a parallel GPT (see the module docstring)."""

    modules: list[nn.Module]
    """The model chunks, one per virtual stage this rank runs, in stage order."""
    chunks: list[nn.Module]
    """The chunks the schedule runs: the modules wrapped for data parallelism, or the modules themselves."""
    hooks: ScheduleHooks | None
    """What the schedule calls besides the model; None without data parallelism."""
    optimizer: Any | None = None


def gpt_provider(config: TransformerConfig, vocab_size: int, max_sequence_length: int) -> ModelProvider:
    """A Megatron-style model provider building ``GPTModel`` chunks of ``config``."""

    def provide(
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        shared_embedding_weight: nn.Parameter | None = None,
    ) -> GPTModel:
        return GPTModel(
            config,
            vocab_size,
            max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            shared_embedding_weight=shared_embedding_weight,
        )

    return provide


def _build_modules(model_provider: ModelProvider, layout: PipelineLayout, pp_rank: int) -> list[nn.Module]:
    """One chunk per virtual stage of ``pp_rank``, with the embedding and loss flags the layout gives.

    Each provider call gets its ``vp_stage`` explicitly (None without virtual stages), as Megatron
    Core passes it; no global virtual-pipeline rank is set.
    """
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
    make_optimizer: Callable[[list[nn.Module]], Any] | None = None,
) -> ParallelGPT:
    """This rank's chunks of the model ``layout`` splits, wrapped for data parallelism when ``ddp_config``
    is given, with one complete ``ScheduleHooks`` set on every chunk's config.

    ``groups``: the process groups (default: ``parallel_state``'s, when initialised; else one rank).
    ``make_optimizer(chunks)`` builds the optimizer over the wrapped chunks; its loss scale (fp16)
    goes into the hooks.
    """
    if groups is None and ps.model_parallel_is_initialized():
        groups = ps.get_parallel_groups()
    pp_rank = groups.rank_in("pp") if groups is not None else 0
    modules = _build_modules(model_provider, layout, pp_rank)
    if groups is not None:  # where the delayed FP8 recipe reduces its amaxes
        set_amax_group(modules, groups.tp_dp_cp, groups.expt_dp)
    if ddp_config is None:
        return ParallelGPT(modules, modules, None)
    if ddp_config.shard_grads:
        _check_no_shared_parameter(modules, ddp_config.data_parallel_sharding_strategy)
    dp_group = groups.dp_cp if groups is not None else None
    expert_dp_group = groups.expt_dp if groups is not None else None
    chunks = [
        DistributedDataParallel(
            m.config, ddp_config, m, data_parallel_group=dp_group, expert_data_parallel_group=expert_dp_group
        )
        for m in modules
    ]
    optimizer = make_optimizer(chunks) if make_optimizer is not None else None
    scaled = optimizer is not None and optimizer.grad_scaler is not None
    hooks = ScheduleHooks(
        no_sync=[c.no_sync for c in chunks],
        grad_sync=[c.start_grad_sync for c in chunks] if ddp_config.overlap_grad_reduce else None,
        finalize_model_grads=functools.partial(finalize_model_grads, groups=groups),
        grad_scale_func=optimizer.scale_loss if scaled else None,
    )
    for module in modules:
        module.config.schedule_hooks = hooks
    return ParallelGPT(modules, chunks, hooks, optimizer)

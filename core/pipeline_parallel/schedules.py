"""Megatron's schedule entry points: thin wrappers that pick a table and hand it to the executor.

    forward_backward_func = get_forward_backward_func()
    losses = forward_backward_func(forward_step_func=forward_step, data_iterator=it, model=chunks,
                                   num_microbatches=8, seq_length=512, micro_batch_size=2)

Every check runs before any communication, on every rank, so bad input fails at once with one
message instead of hanging a peer. Each entry builds this rank's complete table (compute tables of
every rank, lowered once and cached) and hands it to the executor. Besides Megatron's keywords the
entries take ``schedule_hooks=`` (a :class:`~core.pipeline_parallel.hooks.ScheduleHooks`; default:
read from the first chunk's config) and ``record=`` (a ``ScheduleRecord`` to fill).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator

import torch

from core import parallel_state as ps
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.actions import Action
from core.pipeline_parallel.auxiliary_loss import auxiliary_loss_scale_hook
from core.pipeline_parallel.executor import ScheduleRecord, StepContext, run_table
from core.pipeline_parallel.hooks import ScheduleHooks, ScheduleSettings
from core.pipeline_parallel.links import PipelineLinks
from core.pipeline_parallel.lowering import lower, validate
from core.pipeline_parallel.p2p_communication import P2PCommunicator
from core.pipeline_parallel.rendezvous import check_rendezvous, comm_logs
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE, placement_for, schedule_rule
from core.pipeline_parallel.schedule_tables import build_tables

Model = torch.nn.Module | list[torch.nn.Module]
DataIterator = Iterator | None | list[Iterator | None]


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None) -> Callable:
    """The schedule entry for ``pp_size`` pipeline ranks of ``vp_size`` chunks each, as Megatron picks it.

    A virtual size > 1: the interleaved entry (also at PP = 1, where the chunks hand over
    locally), which runs interleaved 1F1B, the interleaved zero-bubble schedule or ZBV as the
    model's ``config.pipeline_schedule`` says; otherwise PP = 1: no pipelining; PP > 1: 1F1B, GPipe
    or ZB-H1. Without sizes (Megatron's older call), ``parallel_state``'s.
    """
    if pp_size is None and ps.model_parallel_is_initialized():
        pp_size = ps.get_pipeline_model_parallel_world_size()
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    if vp_size is not None and vp_size > 1:
        return forward_backward_pipelining_with_interleaving
    if pp_size is None or pp_size == 1:
        return forward_backward_no_pipelining
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(*, model: Model, **call) -> list:
    """Forward and backward of each microbatch in turn on one stage; gradients accumulate.

    Takes Megatron's keywords (``forward_step_func``, ``data_iterator``, ``num_microbatches``,
    ``seq_length``, ``micro_batch_size``, ``forward_only``, ...), as all three entries do: ``_prepare``
    states them once."""
    chunks = _single_chunk(model, "forward_backward_no_pipelining")
    # 1F1B on one stage: each microbatch's forward, then its backward
    return run_table(*_prepare(DEFAULT_SCHEDULE, chunks, pipelined=False, **call))


def forward_backward_pipelining_without_interleaving(*, model: Model, **call) -> list:
    """1F1B over the pipeline group; GPipe or ZB-H1 as ``config.pipeline_schedule`` says."""
    chunks = _single_chunk(model, "forward_backward_pipelining_without_interleaving")
    schedule = ScheduleSettings.from_config(chunks[0].config).pipeline_schedule
    return run_table(*_prepare(schedule, chunks, **call))


def forward_backward_pipelining_with_interleaving(*, model: Model, **call) -> list:
    """Virtual stages: ``model`` is this rank's list of chunks, ``data_iterator`` one per chunk.

    Runs interleaved 1F1B, or with ``config.pipeline_schedule`` "zb-h1" the interleaved zero-bubble
    schedule, or with "zbv" ZBV (two chunks per rank in a V).
    """
    chunks = _as_chunks(model)
    schedule = ScheduleSettings.from_config(chunks[0].config).pipeline_schedule
    return run_table(*_prepare(schedule_rule(schedule).interleaved_form or schedule, chunks, **call))


_ACCEPTED_DEFAULTS = {"adjust_tensor_shapes_fn": None}


def _prepare(
    schedule,
    chunks,
    *,
    forward_step_func,
    data_iterator,
    num_microbatches,
    seq_length,
    micro_batch_size,
    forward_only=False,
    pipelined: bool = True,
    decoder_seq_length: int | None = None,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    record: ScheduleRecord | None = None,
    schedule_hooks: ScheduleHooks | None = None,
    pg_collection: ParallelGroups | None = None,
    **unsupported,
) -> tuple[list[Action], StepContext]:
    """This rank's complete table and the executor's context for one call of an entry point: every
    check done, nothing communicated yet. The entries call ``run_table`` themselves (one frame less
    between the training loop and the model)."""
    _check_keywords(unsupported, decoder_seq_length, seq_length)
    del first_val_step  # only meaningful for FP8 weight caching, which Trident does not do
    settings = ScheduleSettings.from_config(chunks[0].config)
    _check_call(settings, num_microbatches, vpp := len(chunks))
    groups = ps.groups_or_default(pg_collection)
    links = _links(p2p_communicator, pipelined, groups)
    pp_rank, pp_size = (links.pp_rank, links.pp_size) if links is not None else (0, 1)
    tables = complete_tables(
        schedule,
        pp_size,
        vpp,
        num_microbatches,
        microbatch_group_size=settings.microbatch_group_size,
        forward_only=forward_only,
        variable_shapes=settings.variable_seq_lengths,
    )
    placement = placement_for(schedule, pp_size, vpp)
    if record is not None:
        record.tables, record.placement = tables, placement
    ctx = StepContext(
        forward_step_func=forward_step_func,
        data_iterators=_as_iterators(data_iterator, vpp),
        chunks=chunks,
        num_microbatches=num_microbatches,
        settings=settings,
        hooks=_step_hooks(schedule_hooks, chunks),
        tensor_shape=settings.tensor_shape(seq_length, micro_batch_size),
        shape_origin=settings.describe_tensor_shape(seq_length, micro_batch_size),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        pp_rank=pp_rank,
        placement=placement,
        links=links,
        groups=groups,
        record=record,
    )
    return list(tables[pp_rank]), ctx


@functools.lru_cache(maxsize=64)
def complete_tables(
    schedule: str,
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    *,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
    variable_shapes: bool = False,
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's complete table, as the entry points run them (built, lowered and checked once, cached)."""
    tables = build_tables(
        schedule,
        pp_size,
        vpp_size,
        num_microbatches,
        microbatch_group_size=microbatch_group_size,
        forward_only=forward_only,
    )
    placement = placement_for(schedule, pp_size, vpp_size)
    complete = lower(tables, placement, variable_shapes=variable_shapes)
    # Checked once per configuration, on every rank, before the first message: every receive ahead
    # of its consumer and in its link's order, and a posting order that finishes under NCCL's rules.
    validate(complete, placement)
    check_rendezvous(comm_logs(complete, placement, variable_shapes=variable_shapes))
    return tuple(tuple(t) for t in complete)


def _check_call(settings: ScheduleSettings, num_microbatches: int, vpp: int) -> None:
    """The call against the model: at least one microbatch, as many chunks as the config says."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if vpp > 1 and settings.virtual_pipeline_size != vpp:
        raise ValueError(
            f"model has {vpp} chunks but config.virtual_pipeline_model_parallel_size is "
            f"{settings.virtual_pipeline_size}"
        )


def _check_keywords(unsupported: dict, decoder_seq_length: int | None, seq_length: int) -> None:
    for name, value in unsupported.items():
        if name not in _ACCEPTED_DEFAULTS:
            raise TypeError(f"unexpected keyword argument {name!r} for a forward-backward function")
        if value is not _ACCEPTED_DEFAULTS[name]:
            raise ValueError(
                f"{name} is not supported by Trident's schedules (got {value!r}); leave it unset"
            )
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise ValueError(
            f"decoder_seq_length ({decoder_seq_length}) only applies to encoder-decoder models, which "
            "Trident does not have; leave it unset"
        )


def _hooks_of(chunks: list[torch.nn.Module]) -> ScheduleHooks:
    """The first chunk's hooks (Megatron reads model[0].config); other chunks must agree or carry none."""
    hooks = ScheduleHooks.from_config(chunks[0].config)
    for index, chunk in enumerate(chunks[1:], start=1):
        other = ScheduleHooks.from_config(chunk.config)
        if not other.is_empty() and other != hooks:
            raise ValueError(
                f"model chunks 0 and {index} carry different schedule hooks; every chunk must see the "
                "same ones (put one ScheduleHooks on every chunk's config.schedule_hooks)"
            )
    return hooks


def _step_hooks(schedule_hooks: ScheduleHooks | None, chunks: list[torch.nn.Module]) -> ScheduleHooks:
    """``schedule_hooks`` (None: the chunks' configs'), setting the scale of ``chunks``' own losses when
    they do not say how (Megatron's hooks, a config's): found in the chunks at each call, so a loop
    passes ``ParallelGPT.schedule_hooks``, which carries it, at every step."""
    hooks = schedule_hooks if schedule_hooks is not None else _hooks_of(chunks)
    if hooks.auxiliary_loss_scale is not None:
        return hooks
    setter = auxiliary_loss_scale_hook(chunks)
    return hooks if setter is None else dataclasses.replace(hooks, auxiliary_loss_scale=setter)


def _as_chunks(model: Model) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model is an empty list of chunks")
    for chunk in chunks:
        if not hasattr(chunk, "config"):
            raise TypeError(f"model chunk {type(chunk).__name__} has no .config (a ModelParallelConfig)")
    return chunks


def _single_chunk(model: Model, entry: str) -> list[torch.nn.Module]:
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"{entry} runs one model chunk per rank, got {len(chunks)}; use "
            "forward_backward_pipelining_with_interleaving for virtual stages"
        )
    return chunks


def _as_iterators(data_iterator: DataIterator, num_chunks: int) -> list:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(
                f"data_iterator is a list of {len(data_iterator)} iterators for {num_chunks} model "
                "chunks; pass one per chunk"
            )
        return list(data_iterator)
    return [data_iterator] * num_chunks


def _links(
    p2p_communicator: P2PCommunicator | None, pipelined: bool, groups: ParallelGroups | None
) -> PipelineLinks | None:
    """This rank's pipeline links: the caller's communicator's, the groups', or None (one rank)."""
    if p2p_communicator is not None:
        return p2p_communicator.links
    if not pipelined or groups is None or groups.size("pp") == 1:
        return None
    return PipelineLinks.from_groups(groups)

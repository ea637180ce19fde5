"""Megatron's schedule entry points: thin wrappers that pick a table and hand it to the executor.

    forward_backward_func = get_forward_backward_func()
    losses = forward_backward_func(forward_step_func=forward_step, data_iterator=it, model=chunks,
                                   num_microbatches=8, seq_length=512, micro_batch_size=2)

Every check runs before any communication, on every rank, so bad input fails at once with one
message instead of hanging a peer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from core.pipeline_parallel.executor import ScheduleRecord, StepContext, run_table
from core.pipeline_parallel.p2p_communication import P2PCommunicator
from core.pipeline_parallel.schedule_tables import build_tables

Model = torch.nn.Module | list[torch.nn.Module]
DataIterator = Iterator | None | list[Iterator | None]


def get_forward_backward_func() -> Callable:
    """The schedule for the current parallel state, as Megatron picks it.

    A virtual size > 1: interleaved 1F1B (also at PP = 1, where the chunks hand over locally);
    otherwise PP = 1: no pipelining; PP > 1: 1F1B, or GPipe when the model's
    ``config.pipeline_schedule`` is "gpipe".
    """
    from core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return forward_backward_no_pipelining
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vpp > 1:
        return forward_backward_pipelining_with_interleaving
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator: DataIterator,
    model: Model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    **kwargs,
) -> list:
    """Forward and backward of each microbatch in turn on one stage; gradients accumulate."""
    chunks = _single_chunk(model, "forward_backward_no_pipelining")
    return _run(
        "1f1b",
        forward_step_func,
        data_iterator,
        chunks,
        num_microbatches,
        seq_length,
        micro_batch_size,
        forward_only,
        pipelined=False,
        **kwargs,
    )


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator: DataIterator,
    model: Model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    **kwargs,
) -> list:
    """1F1B over the pipeline group (GPipe when ``config.pipeline_schedule == "gpipe"``)."""
    chunks = _single_chunk(model, "forward_backward_pipelining_without_interleaving")
    schedule = chunks[0].config.pipeline_schedule
    return _run(
        schedule,
        forward_step_func,
        data_iterator,
        chunks,
        num_microbatches,
        seq_length,
        micro_batch_size,
        forward_only,
        **kwargs,
    )


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func,
    data_iterator: DataIterator,
    model: Model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    **kwargs,
) -> list:
    """Interleaved 1F1B: ``model`` is this rank's list of chunks, ``data_iterator`` one per chunk."""
    chunks = _as_chunks(model)
    if chunks[0].config.pipeline_schedule == "gpipe":
        raise ValueError(
            "pipeline_schedule='gpipe' cannot run virtual stages; use '1f1b', which interleaves them"
        )
    return _run(
        "interleaved",
        forward_step_func,
        data_iterator,
        chunks,
        num_microbatches,
        seq_length,
        micro_batch_size,
        forward_only,
        **kwargs,
    )


_ACCEPTED_DEFAULTS = {"adjust_tensor_shapes_fn": None, "pg_collection": None}


def _run(
    schedule,
    forward_step_func,
    data_iterator,
    chunks,
    num_microbatches,
    seq_length,
    micro_batch_size,
    forward_only,
    *,
    pipelined: bool = True,
    decoder_seq_length: int | None = None,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    record: ScheduleRecord | None = None,
    **unsupported,
) -> list:
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
    del first_val_step  # only meaningful for FP8 weight caching, which Trident does not do
    config = chunks[0].config
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    iterators = _as_iterators(data_iterator, len(chunks))
    vpp = len(chunks)
    configured_vpp = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if vpp > 1 and configured_vpp != vpp:
        raise ValueError(
            f"model has {vpp} chunks but config.virtual_pipeline_model_parallel_size is {configured_vpp}"
        )
    pp_group, pp_rank, pp_size, pp_channels = _pipeline_group(p2p_communicator, pipelined)
    group_size = getattr(config, "microbatch_group_size_per_vp_stage", None)
    tables = build_tables(
        schedule, pp_size, vpp, num_microbatches, microbatch_group_size=group_size, forward_only=forward_only
    )
    ctx = StepContext(
        forward_step_func=forward_step_func,
        data_iterators=iterators,
        chunks=chunks,
        num_microbatches=num_microbatches,
        config=config,
        tensor_shape=_tensor_shape(config, seq_length, micro_batch_size),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        pp_rank=pp_rank,
        pp_size=pp_size,
        pp_group=pp_group,
        pp_channels=pp_channels,
        all_tables=tables,
        record=record,
    )
    return run_table(tables[pp_rank], ctx)


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


def _pipeline_group(p2p_communicator: P2PCommunicator | None, pipelined: bool):
    """(pp group, pp rank, pp size, per-link channel groups or None)."""
    if p2p_communicator is not None:  # the caller's own group: no per-link groups (see executor)
        return p2p_communicator.pp_group, p2p_communicator.pp_rank, p2p_communicator.pp_size, None
    if not pipelined:
        return None, 0, 1, None
    from core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 0, 1, None
    group = parallel_state.get_pipeline_model_parallel_group()
    size = dist.get_world_size(group)
    channels = parallel_state.get_pipeline_model_parallel_channel_groups()
    return group, parallel_state.get_pipeline_model_parallel_rank(), size, channels


def _tensor_shape(config, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
    """[seq, batch, hidden] between stages; the sequence is split over TP with sequence parallelism."""
    seq = seq_length // getattr(config, "context_parallel_size", 1)
    if getattr(config, "sequence_parallel", False):
        seq //= config.tensor_model_parallel_size
    return seq, micro_batch_size, config.hidden_size

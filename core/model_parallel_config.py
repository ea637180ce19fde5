"""What the parallel engine needs to know about a model: sizes, dtypes, schedule and hooks."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from core.flags import flag, not_a_flag
from core.pipeline_parallel.schedule_rules import (
    CLI_SCHEDULES,
    DEFAULT_SCHEDULE,
    PipelineSchedule,
    schedule_rule,
)
from core.problems import Problem, problem

if TYPE_CHECKING:  # the config carries the hooks; it does not need the schedule code to do so
    from core.pipeline_parallel.hooks import ScheduleHooks


@dataclass(kw_only=True)
class ModelParallelConfig:
    """Parallel sizes, pipeline options and the training loop's hooks (Megatron's field names).

    Every model chunk carries one as ``.config``; schedules read what they need from it.
    """

    tensor_model_parallel_size: int = 1
    """Ranks a layer's weights are split over (TP)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages per model replica (PP)."""

    virtual_pipeline_model_parallel_size: int | None = not_a_flag(None)
    """Model chunks per pipeline rank; > 1 selects the interleaved 1F1B schedule."""

    context_parallel_size: int = 1
    """Ranks each sequence is split over (CP): every rank holds ``seq / CP`` tokens, two load-balanced
    chunks, and attention reaches across the ranks (``cp_comm_type``)."""

    expert_model_parallel_size: int = 1
    """Ranks the experts of each MoE layer are split over (EP); carved out of the data-parallel ranks
    as in megatron-core (``core.parallel_state.generate_expert_groups``)."""

    expert_tensor_parallel_size: int | None = flag(
        None, help="Tensor parallelism inside each expert: only 1 (experts are never split here)."
    )
    """Tensor parallelism inside each expert. Trident's experts are never split (Megatron's
    ``--expert-tensor-parallel-size 1``); None means 1 here, where megatron-core defaults to the TP size."""

    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the sequence over the TP group."""

    gradient_accumulation_fusion: bool = flag(
        False,
        name="--gradient-accumulation-fusion",
        negation="--no-gradient-accumulation-fusion",
        group="training",
        help="The tensor-parallel linear layers accumulate their weight gradients straight into the fp32 "
        "main_grad buffers (Megatron's fusion; Megatron's default is on where APEX is installed, "
        "Trident's is off); Trident's word embedding adds its gradient rows there too.",
    )
    """The TP linear layers' backward accumulates weight gradients into ``weight.main_grad`` (made by
    ``DistributedDataParallel``) instead of handing autograd a new gradient for a hook to add; a
    ``GPTModel``'s word embedding adds its gradient rows there too."""

    hidden_size: int = flag(0, group="network size", cli_default=None)
    """Hidden size of the activations passed between stages."""

    params_dtype: torch.dtype = torch.float32
    """Dtype parameters are created in."""

    pipeline_dtype: torch.dtype = torch.float32
    """Dtype of activations and gradients sent between pipeline stages."""

    variable_seq_lengths: bool = not_a_flag(False)
    """Microbatches may differ in shape: each message is preceded by its shape."""

    deallocate_pipeline_outputs: bool = not_a_flag(True)
    """Free an output's storage once it has been sent; backward only needs its graph."""

    pipeline_schedule: PipelineSchedule = DEFAULT_SCHEDULE
    """"1f1b" (default), "gpipe" (all forward, then all backward), "zb-h1" (zero bubble: 1F1B with
    the backward split into input and weight gradients, the weight gradients filling the bubble) or
    "zbv" (zero bubble in a V: needs ``virtual_pipeline_model_parallel_size=2`` and places stage
    ``s >= pp`` on rank ``2 pp - 1 - s``). With ``virtual_pipeline_model_parallel_size > 1``, "1f1b"
    is interleaved 1F1B and "zb-h1" the interleaved zero-bubble schedule."""

    pipeline_model_parallel_layout: str | None = None
    """Megatron layout string, e.g. ``"Et*3|(tt|)*29,m|L"``; None means an even split."""

    microbatch_group_size_per_vp_stage: int | None = flag(
        None, name="--microbatch-group-size-per-virtual-pipeline-stage"
    )
    """Microbatches run on one virtual chunk before moving to the next (None = pipeline size)."""

    calculate_per_token_loss: bool = flag(False, group="training")
    """Normalise the loss by the step's total token count instead of per microbatch."""

    schedule_hooks: ScheduleHooks | None = None
    """The training loop's hooks for the schedule (gradient sync, end-of-step reductions, loss
    scaling, timers), typed; set the same object on every chunk's config. The Megatron-named
    fields below are the older way to give the same hooks, still accepted (not both)."""

    no_sync_func: Callable[[], AbstractContextManager] | list | None = None
    """Megatron's name for ``ScheduleHooks.no_sync``: suspends data-parallel gradient reduction."""

    grad_sync_func: Callable | list | None = None
    """Megatron's name for ``ScheduleHooks.grad_sync``: called with a chunk's parameters after its last backward."""

    finalize_model_grads_func: Callable | None = None
    """Megatron's name for ``ScheduleHooks.finalize_model_grads``: ``f(model_chunks, num_tokens)`` at the
    end of a step (DP and tied-weight reductions; with ``calculate_per_token_loss`` it also scales
    gradients by 1/num_tokens)."""

    grad_scale_func: Callable | None = None
    """Megatron's name for ``ScheduleHooks.grad_scale_func``: backward starts from ``grad_scale_func(loss)``."""

    timers: Callable | None = None
    """Megatron's name for ``ScheduleHooks.timers``: times forward and backward compute."""

    def __post_init__(self) -> None:
        for refused in parallel_size_problems(self) + expert_tensor_parallel_problems(self):
            raise ValueError(str(refused))
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1 or None, got {vpp}")
        if self.pipeline_schedule not in CLI_SCHEDULES:
            raise ValueError(
                f"pipeline_schedule must be one of {CLI_SCHEDULES}, got {self.pipeline_schedule!r}"
            )
        problem = schedule_rule(self.pipeline_schedule).chunks_problem(vpp or 1)
        if problem:
            raise ValueError(
                f"pipeline_schedule={self.pipeline_schedule!r} {problem} "
                f"(virtual_pipeline_model_parallel_size={vpp})"
            )
        if self.variable_seq_lengths and self.context_parallel_size > 1:
            raise ValueError(
                f"variable_seq_lengths is not supported with context_parallel_size "
                f"{self.context_parallel_size}: every sequence is cut into 2 x CP equal chunks"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron silently turns it off; so do we, it is a no-op at TP=1.
            self.sequence_parallel = False


_PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)


def parallel_size_problems(config: Any) -> list[Problem]:
    """The parallel sizes below 1. The config refuses the first at construction, the command line
    with its flag."""
    return [
        problem(f"{{{name}}} must be >= 1, got {{value}}", name, value=value)
        for name in _PARALLEL_SIZES
        if (value := getattr(config, name)) < 1
    ]


def expert_tensor_parallel_problems(config: Any) -> list[Problem]:
    """Experts are never split over tensor parallelism here: only 1 (None, megatron-core's "the TP size",
    means 1 too). The config refuses it at construction, the command line with its flag."""
    etp = config.expert_tensor_parallel_size
    if etp in (None, 1):
        return []
    return [
        problem(
            "{expert_tensor_parallel_size} {etp}: Trident supports only 1 (experts are never split over "
            "tensor parallelism; Megatron's default, the tensor-parallel size, also means 1 here)",
            "expert_tensor_parallel_size",
            etp=etp,
        )
    ]

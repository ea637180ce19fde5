"""A validated run, described by typed objects: what the training loop reads instead of ``args``.

    run = build_run(parse_args(argv), world_size)        # every check, before any process group
    run.parallel.dp, run.num_microbatches, run.layout     # what was derived
    run.microbatches.num_microbatches(consumed_samples)   # a step's count (it follows a batch ramp)
    run.model.num_layers, run.optimizer.lr, run.training.train_iters, run.checkpointing.save

``build_run`` is the one sequence after parsing: ``--use-checkpoint-args`` fills the model flags
from the ``--load`` checkpoint, :func:`~training.arguments.checks.derive_args` checks the flags
together and derives what they imply, a model flag contradicting the checkpoint is refused, and
any of these errors becomes one :class:`~training.errors.ConfigError`. The parsed namespace is
never written to.

The typed objects are the dataclasses that declare the flags (``TransformerConfig``,
``OptimizerConfig``, ``DistributedDataParallelConfig`` and the sections of ``training/arguments/config.py``),
holding the resolved values (``--global-batch-size`` filled in, ``--ffn-hidden-size`` computed,
...), plus what is no flag: the parallel sizes, the microbatch count, the pipeline layout (built
once here) and the learning-rate schedule in samples. A new flag appears in its section by
declaring the field (``training/arguments/schema.py``); a new parallel dimension is a field of
:class:`ParallelSizes`.

``run.args`` is Megatron's view of the same run, the parsed flags plus the derived values on a
copy of the namespace. It exists for code written against Megatron: ``get_args()`` returns it to
model and dataset providers, W&B records it as the run's config and checkpoints store its flags.
Trident's own code reads the typed objects.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from core import parallel_state as ps
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.num_microbatches_calculator import NumMicroBatchesCalculator
from core.optimizer.optimizer_config import OptimizerConfig
from core.pipeline_parallel.layout import PipelineLayout
from core.transformer.transformer_config import TransformerConfig
from models.gpt.gpt_model import pipeline_layout
from training.arguments.checks import derive_args, megatron_namespace
from training.arguments.config import (
    CheckpointingArgs,
    DataArgs,
    DistributedArgs,
    LearningRateArgs,
    LoggingArgs,
    ModelArgs,
    TokenizerArgs,
    TrainingArgs,
    ValidationArgs,
)
from training.arguments.parser import parse_args_or_usage_error, transformer_config_from_args
from training.checkpoint.format import CheckpointError
from training.checkpoint.model_args import check_checkpoint_args, load_checkpoint_args
from training.data.batch_sizes import microbatch_calculator
from training.errors import ConfigError
from training.faults.heartbeat import process_group_timeout_minutes
from training.faults.injection import FAULT_ENV, parse_faults
from training.faults.restart import resume_from_save_on_restart
from training.lr_schedule import scheduler_kwargs

__all__ = ["ParallelSizes", "Run", "build_run", "parse_run"]


@dataclass(frozen=True)
class ParallelSizes:
    """How the world is split: ``world_size = tp * pp * dp`` (times ``cp`` with context parallelism)."""

    world_size: int
    tp: int
    """Tensor-parallel ranks."""
    pp: int
    """Pipeline stages per model replica."""
    vpp: int
    """Model chunks per pipeline rank (1 without virtual pipelining)."""
    dp: int
    """Data-parallel replicas."""
    cp: int = 1
    """Context-parallel ranks (the sequence split for attention)."""
    ep: int = 1
    """Expert-parallel ranks."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """Everything a validated run is: the configs that declare its flags, and what follows from them."""

    parallel: ParallelSizes
    num_microbatches: int
    """Microbatches of the full ``--global-batch-size`` on each data-parallel rank (evaluation's); a
    training step's count comes from ``microbatches``, which follows a batch ramp."""
    microbatches: NumMicroBatchesCalculator
    """The global batch and microbatch count of each training step, by consumed samples (Megatron's
    calculator: constant, ``--rampup-batch-size`` or ``--step-batch-size-schedule``)."""
    layout: PipelineLayout
    """Which stages hold which layers, and which pipeline rank runs each stage."""
    model: TransformerConfig
    """The model and the engine's settings (parallel sizes, schedule, dtypes, recomputation)."""
    gpt: ModelArgs
    """The model flags that are ``GPTModel`` arguments rather than config fields (sequence length...)."""
    optimizer: OptimizerConfig
    ddp: DistributedDataParallelConfig
    training: TrainingArgs
    lr: LearningRateArgs
    lr_schedule: dict[str, Any]
    """``OptimizerParamScheduler``'s settings, in samples (:func:`training.lr_schedule.scheduler_kwargs`)."""
    checkpointing: CheckpointingArgs
    validation: ValidationArgs
    data: DataArgs
    tokenizer: TokenizerArgs
    logging: LoggingArgs
    distributed: DistributedArgs
    args: argparse.Namespace = dataclasses.field(repr=False)
    """Megatron's namespace for code written against Megatron (``get_args()``); see the module docstring."""

    def process_group_timeout_minutes(self) -> float:
        """``--distributed-timeout-minutes``, or a test's ``TRIDENT_TEST_PROCESS_GROUP_TIMEOUT_SECONDS``."""
        return process_group_timeout_minutes(self.distributed.distributed_timeout_minutes)

    def initialize_model_parallel(self, **options: Any) -> None:
        """Build this run's process groups (Megatron's ``initialize_model_parallel``, bounded by the run's
        timeout; ``options`` are its further keywords)."""
        ps.initialize_model_parallel(
            self.parallel.tp,
            self.parallel.pp,
            self.model.virtual_pipeline_model_parallel_size,
            self.parallel.cp,
            expert_model_parallel_size=self.parallel.ep,
            num_distributed_optimizer_instances=self.ddp.num_distributed_optimizer_instances,
            distributed_timeout_minutes=self.process_group_timeout_minutes(),
            **options,
        )


def _section(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` filled from the resolved flag values, by field name (no attribute is read from ``args``)."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values})


def _typed(namespace: argparse.Namespace) -> Run:
    """The typed description of a validated namespace."""
    values = vars(namespace)
    model = TransformerConfig(**transformer_config_from_args(namespace))
    parallel = ParallelSizes(
        world_size=values["world_size"],
        tp=model.tensor_model_parallel_size,
        pp=model.pipeline_model_parallel_size,
        vpp=model.virtual_pipeline_model_parallel_size or 1,
        dp=values["data_parallel_size"],
        cp=model.context_parallel_size,
        ep=values["expert_model_parallel_size"],
    )
    return Run(
        parallel=parallel,
        num_microbatches=values["num_microbatches"],
        microbatches=microbatch_calculator(namespace),
        layout=pipeline_layout(model),
        model=model,
        gpt=_section(ModelArgs, values),
        optimizer=_section(OptimizerConfig, values),
        ddp=_section(DistributedDataParallelConfig, values),
        training=_section(TrainingArgs, values),
        lr=_section(LearningRateArgs, values),
        lr_schedule=scheduler_kwargs(namespace),
        checkpointing=_section(CheckpointingArgs, values),
        validation=_section(ValidationArgs, values),
        data=_section(DataArgs, values),
        tokenizer=_section(TokenizerArgs, values),
        logging=_section(LoggingArgs, values),
        distributed=_section(DistributedArgs, values),
        args=namespace,
    )


def build_run(args: argparse.Namespace, world_size: int | None = None) -> Run:
    """The run a parsed namespace describes, or one :class:`ConfigError` naming the flags to change.

    ``world_size`` defaults to ``$WORLD_SIZE`` (1 without it). With ``--use-checkpoint-args`` the
    model flags not given are first taken from the ``--load`` checkpoint (set on ``args`` as if
    given); nothing else is written to ``args``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    args = resume_from_save_on_restart(args)  # under torchrun --max-restarts, a restart goes on
    try:
        parse_faults(os.environ.get(FAULT_ENV, ""))  # a drill's bad TRIDENT_FAULT stops here
        load_checkpoint_args(args)  # --use-checkpoint-args: model flags from the --load checkpoint
        namespace = check_checkpoint_args(megatron_namespace(args, derive_args(args, world_size)))
        return _typed(namespace)
    except CheckpointError:
        raise  # a checkpoint that cannot be read: its own one line and exit code (1), not a flag to change
    except ValueError as err:
        raise ConfigError(str(err)) from None


def parse_run(argv: list[str] | None = None, world_size: int | None = None) -> Run:
    """:func:`build_run` of a command line; a command line that cannot be parsed is a ``UsageError``."""
    return build_run(parse_args_or_usage_error(argv), world_size)

"""Everything a run builds before its first step, in order: groups, seeds, tokenizer, model and
optimizer, resume, data, loggers. ``setup(run, providers)`` returns them as one :class:`Session`.

Building the tokenizer and the datasets may write caches: global rank 0 builds first, the others
after it (``_rank0_first``), and a failure on any rank fails every rank at once (``faults.fail_together``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from core import parallel_state as ps
from core.device import bind_local_device, current_device
from core.optimizer import get_megatron_optimizer
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.schedules import get_forward_backward_func
from core.tensor_parallel import model_parallel_seed
from models.gpt.parallelize import parallelize_gpt
from training import faults
from training.arguments.parser import startup_report
from training.checkpoint.async_save import CheckpointSaver
from training.checkpoint.load import prepare_save_dir
from training.checkpoint.resume import load
from training.data.batches import BatchStream
from training.faults import restart
from training.global_vars import set_global_variables
from training.lr_schedule import build_scheduler
from training.reporting import memory_history
from training.reporting.fp8_report import fp8_report
from training.reporting.logging_utils import is_logging_rank, print_line, print_rank_0, set_logging_level
from training.reporting.run_logging import RunLoggers
from training.reporting.wandb_logging import start_run
from training.run import Run
from training.state import Session, TrainState


@dataclass
class Providers:
    """The user's functions, Megatron's contract: datasets, model chunks, forward step (and a tokenizer)."""

    datasets: Callable
    model: Callable
    forward_step: Callable
    tokenizer: Callable | None = None


def setup(run: Run, providers: Providers) -> Session:
    """Build the run's pieces (the process groups of ``torch.distributed`` already exist)."""
    bind_local_device()
    set_logging_level(run.logging.logging_level)
    run.initialize_model_parallel()
    _seed_everything(run.model.seed, ps.get_pipeline_model_parallel_rank())
    faults.phase("building the tokenizer")
    tokenizer = _rank0_first(lambda: providers.tokenizer(run.args)) if providers.tokenizer else None
    set_global_variables(run.args, tokenizer)  # Megatron's get_args() / get_tokenizer() for the providers
    _report_start(run)
    faults.phase("building the model and optimizer")
    memory_history.start_recording(run.training, dist.get_rank(), current_device())
    groups = ps.get_parallel_groups()
    model = parallelize_gpt(providers.model, layout=run.layout, groups=groups, ddp_config=run.ddp)
    optimizer = get_megatron_optimizer(
        run.optimizer,
        model.chunks,
        decoupled_lr=run.lr.decoupled_lr,
        decoupled_min_lr=run.lr.decoupled_min_lr,
    )
    logs_loss = is_logging_rank(run.layout, groups)
    if groups.rank_in("tp") == groups.rank_in("dp") == groups.rank_in("cp") == 0:  # one rank a stage
        tokens = run.training.micro_batch_size * run.gpt.seq_length // run.model.context_parallel_size
        for line in fp8_report(run.model, model.modules, groups.rank_in("pp"), tokens):
            print_line(line)
    session = Session(
        groups=groups,
        model=model,
        optimizer=optimizer,
        hooks=faults.watched(model.schedule_hooks(optimizer)),
        scheduler=build_scheduler(optimizer, run.lr_schedule),
        forward_step_func=faults.faulty_forward(providers.forward_step),
        forward_backward=get_forward_backward_func(run.parallel.pp, run.parallel.vpp),
        state=TrainState(),
        logs_loss=logs_loss,
        tokenizer=tokenizer,
        saver=CheckpointSaver(
            groups=groups,
            async_save=run.checkpointing.async_save,
            announce=_announcer(logs_loss),
            after_file=faults.after_checkpoint_file,
        ),
    )
    if run.checkpointing.load:
        faults.phase("loading the checkpoint")
        load(run, session)
    faults.phase("building the datasets")
    train_ds, valid_ds, _ = _rank0_first(lambda: providers.datasets(run.args))
    session.train_data, session.valid_data = (_batch_stream(ds, run, groups) for ds in (train_ds, valid_ds))
    faults.phase("starting the W&B run")
    session.loggers = _start_loggers(run, session)
    restart.mark("loaded")
    return session


def _report_start(run: Run) -> None:
    """The start report (rank 0), the line of CUDA graphs asked for off CUDA, and a bad ``--save``
    found now rather than after the first save interval (its interrupted saves' files removed)."""
    for line in startup_report(run.args):
        print_rank_0(line)
    if run.args.cuda_graphs_note:  # graphs asked for off CUDA (the argument checks decided it)
        print_rank_0(run.args.cuda_graphs_note)
    if run.checkpointing.save:
        removed = prepare_save_dir(run.checkpointing.save)
        if removed:
            print_rank_0(
                f"removed {len(removed)} temporary file(s) of interrupted saves from {run.checkpointing.save}"
            )


def _announcer(logs_loss: bool) -> Callable[[str], None]:
    """What a committed save prints: one whole line, from the rank that prints the log lines."""

    def announce(path: str) -> None:
        if logs_loss:
            print_line(f"saved checkpoint {path}")

    return announce


def _seed_everything(seed: int, pp_rank: int) -> None:
    """Megatron's seeding: a different stream per pipeline stage, the TP tracker for dropout in TP regions."""
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    model_parallel_seed(stage_seed)


def _rank0_first(build: Callable):
    """Global rank 0 builds (and caches) first, the others after it; cache files are written atomically.

    A failure on any rank (a data file rank 0 cannot read) fails every rank at once: the rank that
    failed reports it, the others end quietly instead of waiting for it (``faults.fail_together``).
    """
    first = dist.get_rank() == 0
    result = faults.fail_together(build if first else None)
    later = faults.fail_together(None if first else build)
    return result if first else later


def _batch_stream(dataset, run: Run, groups: ParallelGroups) -> BatchStream | None:
    if dataset is None:
        return None
    return BatchStream(
        dataset,
        micro_batch_size=run.training.micro_batch_size,
        seq_length=run.gpt.seq_length,
        num_workers=run.data.num_workers,
        dataloader_type=run.data.dataloader_type,
        groups=groups,
        workers_ignore_sigterm=run.training.exit_signal_handler,
    )


def _start_loggers(run: Run, session: Session) -> RunLoggers:
    """W&B (and TensorBoard) on the rank that logs the loss; the same W&B run id on every rank."""
    flags, state = run.logging, session.state
    wandb_run = start_run(
        project=flags.wandb_project,
        name=flags.wandb_exp_name or None,
        save_dir=flags.wandb_save_dir,
        config=vars(run.args),
        run_id=state.wandb_run_id,
        is_logging_rank=session.logs_loss,
    )
    loggers = RunLoggers(
        wandb_run, tensorboard_dir=flags.tensorboard_dir if session.logs_loss else None, config=vars(run.args)
    )
    # The logging rank's W&B run id on every rank (rank 0 writes it into the checkpoint manifest).
    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, getattr(loggers, "id", None) or state.wandb_run_id)
    state.wandb_run_id = next((i for i in ids if i), None)
    return loggers

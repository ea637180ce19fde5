"""``pretrain()``: Megatron's training loop over Trident's engine.

    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=None)

Order of business: parse and check every flag before any process group exists, into a typed
:class:`~training.run.Run` (one error on every rank); set up the groups and build tokenizer, model
chunks (wrapped for data parallelism), optimizer, LR schedule, data and loggers, resuming from
``--load`` (:mod:`training.setup`); then train, evaluate, log and save (:mod:`training.loop`).

When something goes wrong (``training.faults``): the heartbeat watchdog names a rank that stops
answering, a step that fails on some ranks fails on all (``faults.fail_together``), and the rank that
reports the error is decided here, while the process groups still exist (``faults.judge``).
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from datetime import timedelta

from core import parallel_state as ps
from core.device import select_backend
from training import faults
from training.faults import restart
from training.loop import train
from training.reporting.logging_utils import print_line
from training.run import build_run, parse_run
from training.setup import Providers, setup
from training.state import TrainState

__all__ = ["TrainState", "pretrain"]


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    *,
    argv: list[str] | None = None,
    tokenizer_provider: Callable | None = None,
    args: argparse.Namespace | None = None,
    iteration_hook: Callable[[TrainState], None] | None = None,
) -> TrainState:
    """Train as the flags say; returns the final state (losses on the rank that logs them).

    ``args``: an already parsed namespace (``training.arguments.parser.parse_args``) instead of ``argv``;
    it is checked as the command line would be, and not written to. The providers receive
    Megatron's namespace (``run.args``, also ``get_args()``). Bad flags raise
    :class:`~training.errors.UsageError` (unparsable or rejected) or
    :class:`~training.errors.ConfigError` on every rank, before any process group exists.
    ``iteration_hook(state)``, if given, runs after every iteration, outside its measured time
    (``tools/bench/overhead.py`` interleaves a plain PyTorch loop with it, step by step). The host
    reads a step's results from the device at the next log step (``training/step_ledger.py``), so
    ``state.losses`` and the skip counters a hook sees cover the iterations up to the last log step.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run = parse_run(argv, world_size) if args is None else build_run(args, world_size)
    providers = Providers(
        datasets=train_valid_test_datasets_provider,
        model=model_provider,
        forward_step=forward_step_func,
        tokenizer=tokenizer_provider,
    )
    select_backend(run.distributed.distributed_backend)
    started = ps.initialize_distributed(timeout=timedelta(minutes=run.process_group_timeout_minutes()))
    restart.mark("rendezvous")
    try:
        faults.begin(run.distributed.distributed_timeout_minutes)
        return _train_session(run, providers, iteration_hook)
    except BaseException as err:
        faults.judge(err)  # who prints it: decided while the groups (and their store) still exist
        raise
    finally:
        faults.end()
        # The run's model, gradient buffers and their pending communication handles sit in reference
        # cycles. Free them now, while their groups exist: left to a later collection they may be freed
        # in a forked DataLoader worker of the next run in this process, where the groups' threads do
        # not exist, and crash it.
        gc.collect()
        # Tear down what this call set up: gloo aborts a process whose groups outlive the interpreter.
        if started:
            ps.destroy_distributed()
        else:
            ps.destroy_model_parallel()


def _train_session(run, providers: Providers, iteration_hook) -> TrainState:
    """Set up, train and summarise; the session (model, optimizer, data) is garbage once this returns."""
    session = setup(run, providers)
    try:
        train(run, session, iteration_hook)
    finally:
        # Stop the data workers now, not when a collection frees their loader: with --exit-signal-handler
        # they ignore SIGTERM, and a loader still alive at the interpreter's exit would be joined forever.
        for stream in (session.train_data, session.valid_data):
            if stream is not None:
                stream.close()
    if session.logs_loss:
        for line in session.state.progress.summary(run, session.loggers):
            print_line(line)
    session.loggers.finish()
    return session.state

"""The training loop: steps until ``--train-iters``, reporting each, evaluating, saving and stopping.

One iteration: the step (:mod:`training.step`), handed to the ledger (:mod:`training.step_ledger`)
and, every ``--log-interval``, the log line (:mod:`training.reporting.iteration_log`); then, outside the
measured time, evaluation, the stop checks (``--exit-interval``, ``--exit-duration-in-mins``, SIGTERM
with ``--exit-signal-handler``), a checkpoint every ``--save-interval`` and the caller's
``iteration_hook``.

The host reads a step's results when the ledger settles (at a log step, before an evaluation or a
save, at the end). The loop then applies each settled step in order (:func:`apply_step`): the errors
of ``--check-for-nan-in-loss-and-grad``, the skipped and NaN iteration counters and the stop after
``--max-consecutive-skipped-iterations``, the learning-rate scheduler's advance after an applied step
and the losses; then the step's W&B row.

With result validation (:mod:`training.faults.validation`) a settled step that failed a check is not
applied, nor any after it: the loop goes back to before it, reruns it, and goes on, or saves and stops
as the verdict says.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

import torch.distributed as dist

from core.device import current_device
from core.transformer.compile import compile_stats
from training import faults
from training.checkpoint.resume import save
from training.data.batch_sizes import ramp_flag
from training.evaluation import evaluate
from training.faults import restart
from training.faults.signal_handler import SignalHandler
from training.faults.stragglers import StragglerDetector
from training.faults.validation import ResultValidator
from training.reporting import memory_history
from training.reporting.iteration_log import LogWindow, log_line, wandb_row
from training.reporting.logging_utils import print_line, print_rank_0
from training.reporting.profiling import StepProfiler
from training.reporting.progress import Progress
from training.reporting.throughput import memory_stats, num_floating_point_operations, peak_tflops
from training.reporting.timeline import Timeline
from training.run import Run
from training.run_control import ExitTimer, ManualGC
from training.state import Session, Step, TrainState
from training.step import any_rank, train_step
from training.step_ledger import StepLedger


def train(run: Run, session: Session, hook: Callable[[TrainState], None] | None = None) -> None:
    """Train from ``session.state`` to ``--train-iters`` (or an earlier stop), saving as the flags say."""
    flags, state, parallel = run.training, session.state, run.parallel
    print_rank_0(
        f"training {flags.train_iters} iterations from iteration {state.iteration}: "
        f"TP={parallel.tp} PP={parallel.pp} VPP={parallel.vpp} CP={parallel.cp} DP={parallel.dp}"
        f"{f' EP={parallel.ep}' if parallel.ep > 1 else ''}, "
        f"{_microbatches(run, state.consumed_samples)}"
    )
    # Only with --exit-signal-handler is SIGTERM caught (to save first); otherwise it ends the run as usual.
    handler = SignalHandler() if flags.exit_signal_handler else contextlib.nullcontext()
    collector = ManualGC(
        enabled=flags.manual_gc, interval=flags.manual_gc_interval, around_eval=flags.manual_gc_eval
    )
    # On an error the write in flight (--async-save) finishes, and nothing more is committed.
    with handler as signals, collector, session.saver, contextlib.ExitStack() as closing:
        loop = _Loop(run, session, signals, collector, hook)
        if loop.stragglers is not None:  # its switch stops listening however the loop ends
            closing.callback(loop.stragglers.close)
        while state.iteration < flags.train_iters:
            increment = run.microbatches.global_batch_size(state.consumed_samples)  # a ramp grows it
            if loop.ledger.must_settle_before(increment):
                loop.settle()
                continue  # the settled steps may rewind the run (result validation)
            record = loop.step_record(state.iteration + 1)
            start = time.perf_counter()
            loop.profiler.before_step(state.iteration)
            step = loop.train_step(record, loop.ledger.learning_rates(increment))
            loop.step_recorded(state.iteration + 1, record)
            state.iteration += 1
            loop.profiler.after_step(state.iteration)
            state.consumed_samples += increment  # Megatron's count: skipped steps too
            step.consumed_samples, step.global_batch_size = state.consumed_samples, increment
            rewound = loop.report(step, start)
            state.step_seconds.append(time.perf_counter() - start)
            if rewound:  # result validation reruns a suspect step: back to before it
                continue
            paused = time.perf_counter()
            stop = loop.between_steps()
            loop.window.pause(time.perf_counter() - paused)  # evaluation and saving are not step time
            if stop:
                break
            _report_ramp(run, state, increment)
        loop.finish()


def _wait_for_collectives(chunks) -> None:
    for chunk in chunks:  # e.g. --overlap-param-gather's all-gathers, launched after the step
        chunk.wait_for_collectives()


def apply_step(run: Run, session: Session, step: Step) -> None:
    """What training does after a settled step, as if it had read the step at once: the NaN errors,
    the skip counters (and the stop after too many), the scheduler's advance after an applied step,
    the losses; the step then carries the learning rate and the counters after it.

    Raises the error the failing step raises, named with its iteration; the caller applies steps in
    iteration order, so the steps before it are applied (and reported) first.
    """
    if not step.settled:
        raise RuntimeError(f"iteration {step.iteration} is applied before the ledger read it")
    state, check = session.state, run.training.check_for_nan_in_loss_and_grad
    if step.bad_loss and check:  # the losses live on the last stage; every rank knows they went bad
        loss = step.losses if step.losses is not None else "NaN or inf on the last pipeline stage"
        raise FloatingPointError(
            f"loss is {loss} at iteration {step.iteration} (--check-for-nan-in-loss-and-grad)"
        )
    if not step.applied and not step.overflow and check:
        raise FloatingPointError(
            f"gradient norm is {step.grad_norm} at iteration {step.iteration} (--check-for-nan-in-loss-and-grad)"
        )
    count_skips(run, state, step)
    if step.applied:
        session.scheduler.step(increment=step.global_batch_size)
    if step.losses is not None:
        state.losses.append(step.losses)
    step.learning_rate = session.optimizer.param_groups[0]["lr"]
    step.skipped_iterations, step.nan_iterations = state.skipped_iterations, state.nan_iterations


def count_skips(run: Run, state: TrainState, step: Step) -> None:
    """A loss-scale overflow is a skipped iteration; a NaN/Inf one is also a NaN iteration, and too
    many of those in a row end the run."""
    if step.applied:
        state.consecutive_skipped = 0
    elif step.overflow and not step.bad_loss:
        state.skipped_iterations += 1
    else:
        state.skipped_iterations += 1
        state.nan_iterations += 1
        state.consecutive_skipped += 1
        if state.consecutive_skipped >= run.training.max_consecutive_skipped_iterations:
            raise RuntimeError(
                f"{state.consecutive_skipped} consecutive iterations had a NaN/inf loss or gradient "
                f"and were skipped (iteration {step.iteration}); stopping. Lower --lr or "
                "check the data; --max-consecutive-skipped-iterations sets the limit"
            )


def _microbatches(run: Run, consumed_samples: int) -> str:
    """The startup line's batch: "8 microbatches of 2 x 128 tokens", and a batch ramp's start and end."""
    calc, flags = run.microbatches, run.training
    shape = f"of {flags.micro_batch_size} x {run.gpt.seq_length} tokens"
    if not calc.schedule.changes:
        return f"{calc.num_microbatches(consumed_samples)} microbatches {shape}"
    return (
        f"{calc.num_microbatches(consumed_samples)} to {run.num_microbatches} microbatches {shape} (global "
        f"batch {calc.global_batch_size(consumed_samples)} growing to {flags.global_batch_size}: "
        f"{ramp_flag(flags)})"
    )


def _report_ramp(run: Run, state: TrainState, last: int) -> None:
    """Megatron's line when the global batch changes for the next iteration."""
    upcoming = run.microbatches.global_batch_size(state.consumed_samples)
    if upcoming != last and state.iteration < run.training.train_iters:
        print_rank_0(
            f"ramping up batch size from {last} to {upcoming} "
            f"({run.microbatches.num_microbatches(state.consumed_samples)} microbatches) at iteration "
            f"{state.iteration + 1}, after {state.consumed_samples} consumed samples"
        )


class _Loop:
    """The loop's own state: timers, the log window, the profiler, the timeline, the last save."""

    def __init__(self, run: Run, session: Session, signals, collector: ManualGC, hook) -> None:
        self.run, self.session, self.hook = run, session, hook
        self.signals, self.collector = signals, collector
        self.device = current_device()
        vocab = _padded_vocab_size(run, session)
        self.flops = num_floating_point_operations(run.args, 1, vocab)  # per sample: the batch may grow
        self.peak = peak_tflops(self.device, run.logging.peak_tflops)
        self.window = LogWindow()
        self.ledger = StepLedger(session.optimizer, session.scheduler, self.device)
        self.last: Step | None = None  # the latest applied step
        self.timer = ExitTimer(run.training.exit_duration_in_mins, any_rank)
        self.timeline = Timeline.for_run(run)
        self.stragglers = StragglerDetector.for_run(run)
        self.validator = ResultValidator.for_run(run, session)
        # train_step(record, learning_rates): the step itself, or through result validation when it is on
        self.train_step = (
            functools.partial(train_step, run, session) if self.validator is None else self._validated_step
        )
        session.state.progress = Progress(
            session.state,
            run.training.train_iters,
            prints=session.logs_loss,
            batches=run.microbatches.schedule,
        )
        self.profiler = StepProfiler(
            enabled=run.training.profile,
            start=run.training.profile_step_start,
            end=run.training.profile_step_end,
            rank=dist.get_rank(),
            ranks=run.training.profile_ranks,
            out_dir=run.logging.tensorboard_dir or "profile",
            wait_for_collectives=functools.partial(_wait_for_collectives, session.model.chunks),
        )
        rank = dist.get_rank()
        records = memory_history.records(run.training, rank, self.device)
        self.memory_snapshot = memory_history.snapshot_path(run.training, rank) if records else None
        self.saved_at: int | None = None
        self.resume_unreported = restart.restart_attempt() > 0  # a restarted run times its first step
        self.compile_start = compile_stats() if run.model.compile else None
        self.compile_warm: dict | None = None

    def step_record(self, iteration: int):
        """The ``ScheduleRecord`` the schedule fills in ``iteration`` (for the timeline or the straggler
        report), else None."""
        collects = self.stragglers is not None and self.stragglers.collects(iteration)
        if self.timeline and self.timeline.wants(iteration):
            return self.timeline.start()
        return self.stragglers.new_record() if collects else None

    def step_recorded(self, iteration: int, record) -> None:
        if record is not None and self.timeline and self.timeline.wants(iteration):
            self.timeline.finish(iteration, record)
        if self.stragglers is not None:
            self.stragglers.add(record)

    def _validated_step(self, record, learning_rates) -> Step:
        """One step, checked by result validation (twice with ``report_stats``)."""
        validator, run, session = self.validator, self.run, self.session
        validator.before_step(session.state.iteration + 1)
        if validator.mode == "report_stats":
            run_once = lambda: train_step(run, session, record, learning_rates, validator)
            return validator.run_twice(run_once, session.state.iteration + 1)
        return train_step(run, session, record, learning_rates, validator)

    def report(self, step: Step, start: float) -> bool:
        """Hand the step to the ledger; at a log step settle it (the W&B rows, then the log line).
        True when settling rewound the run to rerun a step (result validation)."""
        run, state, optimizer = self.run, self.session.state, self.session.optimizer
        if run.logging.log_params_norm:  # a collective: every rank, every iteration (as Megatron)
            step.params_norm = optimizer.get_params_norm_tensor()
        if run.logging.log_memory_to_tensorboard:
            step.memory = memory_stats(self.device)
        step.seconds = time.perf_counter() - start
        self.ledger.add(step)
        if self.resume_unreported:
            self.resume_unreported = False
            self._report_resume()
        if self.compile_start is not None and self.compile_warm is None:
            self.compile_warm = compile_stats()
            line = _compile_line("warm-up (first iteration)", self.compile_start, self.compile_warm)
            print_rank_0(f"{line}; the iteration took {step.seconds:.1f} s")
        self.collector.after_step(state.iteration)
        logs = state.iteration % run.training.log_interval == 0 or state.iteration == run.training.train_iters
        rerun = self.validator is not None and self.validator.must_settle()
        if (logs or self.ledger.settle_every_step or rerun) and self.settle():
            return True
        if logs:
            if self.memory_snapshot:
                memory_history.dump(self.memory_snapshot)
            state.progress.print_log_line(log_line(run, state, self.last, self.window, self.flops, self.peak))
            for line in self.stragglers.report(state.iteration) if self.stragglers else ():
                print_line(line)
            stats = self.validator and self.validator.stats_line(state.iteration)
            if stats and self.session.logs_loss:
                print_line(stats)
        return False

    def _report_resume(self) -> None:
        """A restarted run's first step: how long the resume took, stage by stage (rank 0 says it)."""
        restart.mark("first step")
        if dist.get_rank() == 0:
            line = restart.time_to_resume(faults.last_beats(restart.restart_attempt() - 1))
            if line:
                print_line(line)

    def settle(self) -> bool:
        """Read the pending steps from the device (one wait), then apply each and write its W&B row, in
        order (an error stops at the failing step, after the rows of the steps before it).

        With result validation, only the steps before a suspect one are applied; the run then goes back
        to before it (True), to rerun it, or saves and stops as the verdict says."""
        steps = self.ledger.settle()
        verdict = self.validator.review(steps) if self.validator is not None and steps else None
        for step in steps if verdict is None else verdict.apply:
            apply_step(self.run, self.session, step)
            self.window.add(step)
            self.last = step
            self.session.loggers.log(wandb_row(self.run, step, self.flops, self.peak), step=step.iteration)
        if verdict is None or verdict.rewind is None:
            return False
        self.validator.rewind(verdict.rewind)
        if verdict.save:
            save(self.run, self.session)
            self.session.saver.wait()
        if verdict.stop is not None:
            raise verdict.stop
        return True

    def between_steps(self) -> bool:
        """Evaluate, decide whether to stop, save, call the hook; True to stop."""
        run, session, state = self.run, self.session, self.session.state
        every = run.validation.eval_interval
        if (
            session.valid_data is not None
            and every
            and state.iteration % every == 0
            and run.validation.eval_iters > 0
        ):
            if self.settle():  # its W&B rows go before the validation row
                return False  # rewound: the suspect step runs again first
            with self.collector.evaluation():
                evaluate(run, session)
        stop = self._should_stop()
        if run.checkpointing.save:  # a save in flight commits once every rank wrote it; a failure stops here
            session.saver.poll()
        saves = run.checkpointing.save and (stop or state.iteration % run.checkpointing.save_interval == 0)
        if (saves or stop) and self.settle():  # the counters, the scheduler and the losses to save
            return False  # rewound: a stop is asked again after the rerun
        if saves:
            save(run, session)
            self.saved_at = state.iteration
        if self.hook is not None:
            self.hook(state)
        return stop

    def _should_stop(self) -> bool:
        """``--exit-interval``, ``--exit-duration-in-mins`` (agreed by all ranks) or SIGTERM."""
        flags, iteration = self.run.training, self.session.state.iteration
        stop = bool(flags.exit_interval and iteration % flags.exit_interval == 0)
        faults.phase("run-control checks (exit timer, SIGTERM)", iteration)
        if self.timer.expired():
            print_rank_0(
                f"--exit-duration-in-mins {flags.exit_duration_in_mins} reached: saving a checkpoint at "
                f"iteration {iteration} and exiting"
            )
            stop = True
        if flags.exit_signal_handler and any(self.signals.signals_received()):
            print_rank_0(f"SIGTERM received: saving a checkpoint at iteration {iteration} and exiting")
            stop = True
        return stop

    def finish(self) -> None:
        """The last steps settle, the last parameter gathers land, the profile and timeline are written,
        a final save if due."""
        self.settle()
        for chunk in self.session.model.chunks:  # the last step's all-gathers (distributed optimizer)
            chunk.finish_param_sync()
        self.profiler.stop()
        if self.run.checkpointing.save and self.saved_at != self.session.state.iteration:
            save(self.run, self.session)
        self.session.saver.wait()
        if self.timeline:
            self.timeline.write()
        if self.compile_warm is not None:  # evaluation compiles its own graphs (eval mode, no grad)
            print_rank_0(_compile_line("after the first iteration", self.compile_warm, compile_stats()))
        faults.phase("finishing")


def _compile_line(when: str, before: dict, after: dict) -> str:
    """What Dynamo compiled between two ``compile_stats()`` snapshots, as one log line."""
    return (
        f"--compile {when}: {after['graphs'] - before['graphs']} graphs compiled, "
        f"{after['graph_breaks'] - before['graph_breaks']} graph breaks, "
        f"{after['compile_seconds'] - before['compile_seconds']:.1f} s compiling"
    )


def _padded_vocab_size(run: Run, session: Session) -> int:
    """The output layer's (padded) vocabulary, for the FLOP count: the model's, else Megatron's rule."""
    for module in session.model.modules:
        size = getattr(module, "padded_vocab_size", None)
        if size is not None:
            return int(size)
    if session.tokenizer is None:  # no tokenizer: the FLOP count leaves the output layer out
        return 0
    vocab = session.tokenizer.vocab_size
    multiple = run.model.make_vocab_size_divisible_by * run.parallel.tp
    return -(-vocab // multiple) * multiple

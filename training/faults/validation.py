"""Megatron's result validation (its "rerun state machine"): a step whose results look wrong is run
again on the same inputs and RNG states, to tell a transient fault from a reproducible result.

Flags (Megatron's names): ``--rerun-mode {disabled,validate_results,report_stats}`` (default
``validate_results``), the checks ``--check-for-nan-in-loss-and-grad`` (a NaN/inf loss or gradient
norm; fatal), ``--check-for-spiky-loss`` and ``--check-for-large-grads`` (a value at least 10x the
largest of the first 100 seen; not fatal), ``--error-injection-rate N`` and ``--error-injection-type``
(drills), ``--result-rejected-tracker-filename`` (one line per event).

Megatron's verdicts, which Trident keeps:

* a fatal check rejects a result: the step is rerun in place. A different result is a transient
  fault: save a checkpoint of the iteration before, exit 17. The same result: save it with a record
  of the step and exit 16 ("resume to disambiguate"); resumed from it (elsewhere), the step is run a
  third time and compared with the record: different, a persistent fault of the first devices; the
  same, a correct result (the model or the data make it). Both exit 17.
* under ``trident-run`` (:mod:`training.launch`) the launcher exits with 16 or 17 and does not restart
  after either (torchrun exits 1 and restarts after both);
* a check that is not fatal rejects a result: the step is rerun in place, the verdict is printed,
  and training goes on.
* ``report_stats`` runs every step twice and reports, at each log step, how often the loss and the
  gradient norm came out identical and their largest relative difference; it never stops a run.

How, without a host wait between log steps (:mod:`training.step_ledger`'s rule). Every check runs
on the device (the loss's flags ride the step's existing NaN all-reduce; the gradient norm is the same
on every rank). A rejected result sets a device flag, ``held``, that gates the optimizer update off
(``step_on_device(gate=...)``, as a NaN skip does) for that step and every later one until the host
next reads the steps. So the model and optimizer state stay those of before the suspect step. Before
each step the host keeps what else a step changes: the RNG states (as a checkpoint stores them), and
copies (no read) of the loss scaler's, the spike trackers' and FP8's scaling states. At the next
settling point the loop applies the steps before the suspect one, rewinds the iteration, the consumed
samples (so the sampler gives the same batch) and those states to the suspect step, and runs it
again; that rerun is read at once (a host wait, on this rare path only) and judged.

Where Trident differs from Megatron:

* the checks look at the step's reduced loss (``lm loss``) and its global gradient norm, not at each
  microbatch's local loss or each bucket's local gradient norm, and the losses are compared bitwise
  (Megatron: tolerance 0), the gradient norm within 0.1% (Megatron's tolerance for gradients);
* the injector is deterministic: every N-th validated step, not a draw of 1/N per rank and call;
* the resumed rerun does not check that it runs on other devices (Megatron compares node and GPU):
  the launcher places the resumed job;
* a reproducible fatal result without ``--save`` cannot be resumed elsewhere: it stops with 17;
* the tracker file is written, not read back: Trident has no ``--iterations-to-skip``;
* ``--check-for-spiky-loss`` and ``--check-for-large-grads`` need ``--rerun-mode validate_results``
  (Megatron also logs them when disabled);
* ``--check-for-nan-in-loss-and-grad`` is off by default (Megatron: on): by default nothing is
  validated, and a run pays nothing for it.

As in Megatron, the first step of each launch is not validated (a NaN there meets the old check).
"""

from __future__ import annotations

import datetime
import math
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from core.device import current_device
from core.tensor_parallel.fp8 import fp8_states
from training.checkpoint.rng import get_rng_state, set_rng_state
from training.errors import EXIT_FAILED_VALIDATION, EXIT_RESUME_TO_DISAMBIGUATE, ConfigError, ResultRejected
from training.faults.agreement import everyone
from training.reporting.logging_utils import print_rank_0

if TYPE_CHECKING:
    from training.run import Run
    from training.state import Session, Step

__all__ = ["EXIT_FAILED_VALIDATION", "EXIT_RESUME_TO_DISAMBIGUATE", "ResultValidator"]

SPIKE_FACTOR, SAMPLES = 10.0, 100  # Megatron's: 10x the largest of the first 100 values
GRAD_TOLERANCE = 1e-3  # Megatron's relative tolerance when it compares gradient norms


@dataclass(frozen=True)
class Check:
    name: str
    fatal: bool
    what: str


CHECKS = (  # in Megatron's order (the loss function's checks, then the gradients'): injection hits the first
    Check("loss", True, "NaN or inf loss"),
    Check("spiky", False, "spiky loss (>= 10x the largest of the first 100)"),
    Check("grad", True, "NaN or inf gradient norm"),
    Check("large", False, "large gradient norm (>= 10x the largest of the first 100)"),
)
BY_NAME = {check.name: check for check in CHECKS}


class _Tracker:
    """On the device: the largest of the first ``SAMPLES`` finite values, and whether one is spiky."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.max = torch.zeros((), dtype=torch.float64, device=device)

    def rejects(self, value: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        v = value.detach().reshape(()).to(torch.float64).abs()
        finite, sampled = torch.isfinite(v), self.count >= SAMPLES
        take = ~sampled & finite & ~held
        reject = sampled & finite & (v >= self.max * SPIKE_FACTOR)
        self.max.copy_(torch.where(take, torch.maximum(self.max, v), self.max))
        self.count.add_(take.to(torch.int64))
        return reject


@dataclass
class _Verdict:
    """What the loop does with the settled steps: apply ``apply``; then rewind to ``rewind`` (rerun it);
    or save (``save``) and raise ``stop``."""

    apply: list
    rewind: int | None = None
    save: bool = False
    stop: ResultRejected | None = None


@dataclass
class _Stats:
    """``report_stats``: per value, reruns compared, identical ones, the largest relative difference."""

    runs: int = 0
    first: int = 0
    device: dict[str, torch.Tensor] = field(default_factory=dict)


class ResultValidator:
    """The run's validation: the device checks of each step and the host's verdicts (module doc)."""

    @classmethod
    def for_run(cls, run: Run, session: Session) -> ResultValidator | None:
        """None when nothing is validated (disabled, or validate_results with no check on)."""
        flags = run.training
        checks = _enabled(flags)
        if flags.rerun_mode == "disabled" or (flags.rerun_mode == "validate_results" and not checks):
            return None
        return cls(run, session, checks)

    def __init__(self, run: Run, session: Session, checks: tuple[str, ...]) -> None:
        flags, device = run.training, current_device()
        self.run, self.session, self.checks = run, session, checks
        self.mode, self.rate, self.injection = (
            flags.rerun_mode,
            flags.error_injection_rate,
            flags.error_injection_type,
        )
        self.tracker_file = flags.result_rejected_tracker_filename
        if self.tracker_file is not None:
            _check_writable(self.tracker_file)
        self.held = torch.zeros((), dtype=torch.bool, device=device)
        self.trackers = {"spiky": _Tracker(device), "large": _Tracker(device)}
        self.fp8 = [layer for _, layer in fp8_states(session.model.modules)]  # scales that move every step
        self.closed = False  # the update is gated off whatever the checks say (a rerun)
        self.snapshots: dict[
            int, tuple
        ] = {}  # before each step: RNG, device states, samples, validations, FP8
        self.validated, self.first, self.validating = 0, None, False
        self.injected: dict[int, str] = {}
        self.phase, self.suspect = "normal", None  # phases: normal, rerun, accept, resumed
        self.flags: dict[str, torch.Tensor] = {}
        self.stats = _Stats()
        record = session.state.rerun
        resumes = record is not None and record["iteration"] == session.state.iteration + 1
        if resumes and self.mode == "validate_results":
            self.phase, self.suspect = "resumed", record
            print_rank_0(
                f"result validation: rerunning iteration {record['iteration']} from the checkpoint, to tell a "
                f"persistent fault of the first run's devices from a correct result"
            )
        session.state.rerun = None

    # ---------------------------------------------------------------- each step, on the device
    def before_step(self, iteration: int) -> None:
        """Keep the states a rerun of ``iteration`` starts from; plan this step's injection."""
        first = self.first is None  # a launch's first step is not validated (Megatron's rule)
        if first:
            self.first = iteration
        if iteration not in self.snapshots:  # a rerun starts from the states its step first had
            state = [t.clone() for t in self._device_state()]
            fp8 = [layer.snapshot() for layer in self.fp8]
            self.snapshots[iteration] = (
                get_rng_state(),
                state,
                self.session.state.consumed_samples,
                self.validated,
                fp8,
            )
        self.closed = self.phase in ("rerun", "resumed")
        self.validating = self.phase == "normal" and not first and self.mode == "validate_results"
        if self.phase == "accept":  # the rerun's verdict let the step stand: run it once more, unchecked
            self.phase = "normal"
        if self.validating:
            self.validated += 1
            if self.rate and self.validated % self.rate == 0:
                self.injected[iteration] = self.injection

    def local_flags(self, losses: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """This rank's loss verdicts to all-reduce with the step's NaN flag (the loss lives on the last
        stage): [spiky]."""
        if not self.validating or "spiky" not in self.checks:
            return None
        value = _loss_value(losses)
        if value is None:
            return torch.zeros(1, dtype=torch.float64, device=self.held.device)
        return self.trackers["spiky"].rejects(value, self.held).to(torch.float64).reshape(1)

    def gate(self, iteration: int, bad_loss: torch.Tensor, reduced: torch.Tensor | None):
        """The optimizer's gate for this step: given the gradient norm, the checks' verdicts (kept in
        ``self.flags``) and whether the update is held off."""

        def held(grad_norm: torch.Tensor, overflow: torch.Tensor | None) -> torch.Tensor:
            self.flags = {}
            if self.validating:
                self.flags = self._verdicts(iteration, bad_loss, reduced, grad_norm, overflow)
                for flag in self.flags.values():
                    self.held |= flag
            return self.held | self.closed

        return held

    def _verdicts(self, iteration, bad_loss, reduced, grad_norm, overflow) -> dict[str, torch.Tensor]:
        flags = {}
        if "loss" in self.checks:
            flags["loss"] = bad_loss.reshape(())
        if "spiky" in self.checks:
            flags["spiky"] = reduced[0] > 0
        if "grad" in self.checks:
            clean = (
                torch.ones((), dtype=torch.bool, device=grad_norm.device) if overflow is None else ~overflow
            )
            flags["grad"] = ~torch.isfinite(grad_norm) & clean.reshape(())
        if "large" in self.checks:
            flags["large"] = self.trackers["large"].rejects(grad_norm, self.held)
        if iteration in self.injected:
            first = self.checks[0]
            flags[first] = flags[first] | True
        return flags

    def step_flags(self) -> dict[str, torch.Tensor]:
        return self.flags

    # ---------------------------------------------------------------- at a settling point, on the host
    def must_settle(self) -> bool:
        """The step just run is a rerun: read it at once."""
        return self.closed and self.mode == "validate_results"

    def review(self, steps: list[Step]) -> _Verdict:
        """Judge the settled steps (module doc): which to apply, and whether to rewind or stop."""
        if self.phase == "rerun":
            return self._judge_rerun(steps[0])
        if self.phase == "resumed":
            return self._judge_resumed(steps[0])
        for index, step in enumerate(steps):
            rejected = [name for name in self.checks if step.validation.get(name)]
            if rejected:
                return self._suspect(steps, index, BY_NAME[rejected[0]])
        self.snapshots.clear()
        self.injected.clear()
        return _Verdict(apply=steps)

    def _suspect(self, steps: list[Step], index: int, check: Check) -> _Verdict:
        step = steps[index]
        self.suspect = {
            "iteration": step.iteration,
            "check": check.name,
            "value": _shared_value(step, check).hex(),
            "injected": self.injected.get(step.iteration),
        }
        injected = f" (injected: {self.suspect['injected']})" if self.suspect["injected"] else ""
        print_rank_0(
            f"result validation: iteration {step.iteration}: {check.what} ({_shown(self.suspect, check)})"
            f"{injected}; rerunning it on the same inputs and RNG"
        )
        self._track("initial_run", _shown(self.suspect, check))
        self.phase = "rerun"
        return _Verdict(apply=steps[:index], rewind=step.iteration)

    def _judge_rerun(self, step: Step) -> _Verdict:
        check = BY_NAME[self.suspect["check"]]
        value = _shared_value(step, check)
        same = self._reproduced(check, value, {"transient_error": False})
        status = "first_rerun_reproducible" if same else "first_rerun_not_reproducible"
        self._track(status, _fmt(check, value))
        compared = self._compared(same, check, value)
        if not check.fatal:
            kind = "a correct result or a persistent fault" if same else "a transient fault"
            print_rank_0(f"{self._head(check)}; {compared}: {kind}; going on (the check is not fatal)")
            iteration, self.phase, self.suspect = self.suspect["iteration"], "accept", None
            return _Verdict(apply=[], rewind=iteration)
        return self._stop_after_rerun(same, check, compared)

    def _stop_after_rerun(self, same: bool, check: Check, compared: str) -> _Verdict:
        save, iteration = self.run.checkpointing.save, self.suspect["iteration"]
        where = f"checkpoint of iteration {iteration - 1} saved in {save}"
        head = f"{self._head(check)}; {compared}"
        if not same:
            saved = f"; {where}" if save else ""
            return self._stop(
                f"{head}: a transient fault{saved} (exit 17)", EXIT_FAILED_VALIDATION, save=bool(save)
            )
        if not save:
            message = f"{head} on the same devices; no --save to resume from elsewhere (exit 17)"
            return self._stop(message, EXIT_FAILED_VALIDATION, save=False)
        self.session.state.rerun = self.suspect  # the checkpoint carries it to the resumed run
        message = (
            f"{head} on the same devices; {where}: resume from it on other devices to tell a persistent "
            "fault from a correct result (exit 16)"
        )
        return self._stop(message, EXIT_RESUME_TO_DISAMBIGUATE, save=True)

    def _judge_resumed(self, step: Step) -> _Verdict:
        check = BY_NAME[self.suspect["check"]]
        value = _shared_value(step, check)
        same = self._reproduced(check, value, {"persistent_error": False, "correct_result": True})
        status = "second_rerun_reproducible" if same else "second_rerun_not_reproducible"
        self._track(status, _fmt(check, value))
        kind = (
            "a correct result, which the model or the data make"
            if same
            else "a persistent fault of the first run's devices"
        )
        message = f"{self._head(check)} on the first run's devices; {self._compared(same, check, value)} here: {kind}"
        return self._stop(f"{message} (exit 17)", EXIT_FAILED_VALIDATION, save=False)

    def _head(self, check: Check) -> str:
        return f"result validation: iteration {self.suspect['iteration']}: {check.what} ({_shown(self.suspect, check)})"

    def _compared(self, same: bool, check: Check, value: float) -> str:
        """How the rerun compared: its value, or the injection that decided."""
        kind = self.suspect["injected"]
        if kind is not None:
            return f"the rerun counts as {'reproducing it' if same else 'different'} ({kind} injected)"
        return "a rerun reproduced it" if same else f"the rerun gave {_fmt(check, value)}"

    def _stop(self, message: str, code: int, *, save: bool) -> _Verdict:
        self.phase = "stopped"
        return _Verdict(
            apply=[], rewind=self.suspect["iteration"], save=save, stop=ResultRejected(message, code)
        )

    def _reproduced(self, check: Check, value: float, injected: dict[str, bool]) -> bool:
        """Whether the rerun gave the first run's result (an injection decides as Megatron's does);
        every rank answers the same."""
        kind = self.suspect["injected"]
        if kind is not None:
            return injected.get(kind, True)
        first = float.fromhex(self.suspect["value"])
        tolerance = GRAD_TOLERANCE if check.name in ("grad", "large") else 0.0
        return not everyone(True, _differ(first, value, tolerance))[1]  # any rank saw a difference

    def rewind(self, iteration: int) -> None:
        """Back to the start of ``iteration``: counters, RNG and device states (the model and optimizer
        are there already: the update was held off since)."""
        consumed = self._restore(iteration)
        self.validated = self.snapshots[iteration][3] + 1  # the suspect step counts once (injection's count)
        self.held.zero_()
        state = self.session.state
        state.iteration, state.consumed_samples = iteration - 1, consumed
        self.snapshots = {iteration: self.snapshots[iteration]}

    def _restore(self, iteration: int) -> int:
        """The RNG and device states from before ``iteration``; returns the samples consumed before it."""
        rng, device, consumed, _, fp8 = self.snapshots[iteration]
        set_rng_state(rng)
        for tensor, saved in zip(self._device_state(), device, strict=True):
            tensor.copy_(saved)
        for layer, saved in zip(self.fp8, fp8, strict=True):
            layer.restore(saved)
        return consumed

    def _device_state(self) -> list[torch.Tensor]:
        scaler = self.session.optimizer.grad_scaler
        trackers = [t for tracker in self.trackers.values() for t in (tracker.count, tracker.max)]
        return trackers + ([] if scaler is None else scaler.device_state())

    def _track(self, status: str, result: str) -> None:
        """One line in --result-rejected-tracker-filename (rank 0 writes it)."""
        if self.tracker_file is None or dist.get_rank() != 0:
            return
        record = self.suspect
        with open(self.tracker_file, "a") as out:
            out.write(
                f"ts={datetime.datetime.now().isoformat()} node={os.uname().nodename} "
                f"job={os.environ.get('SLURM_JOB_ID', os.environ.get('TORCHELASTIC_RUN_ID', 'N/A'))} "
                f"iteration={record['iteration']} status={status} check={record['check']} result={result} "
                f"injected={record['injected']}\n"
            )

    # ---------------------------------------------------------------- report_stats
    def run_twice(self, step_fn, iteration: int) -> Step:
        """``report_stats``: the step, held off, then again from the same states; compared on the device."""
        if self.stats.runs == 0:
            self.stats.first = iteration
        self.closed = True
        first = step_fn()
        self._restore(iteration)
        del self.snapshots[iteration]
        self.closed = False
        second = step_fn()
        self.stats.runs += 1
        pairs = {"lm loss": (_loss_value(first.losses), _loss_value(second.losses))}
        pairs["grad norm"] = (first.grad_norm, second.grad_norm)
        for name, (a, b) in pairs.items():
            if a is not None and b is not None:
                _accumulate(self.stats.device, name, a, b)
        return second

    def stats_line(self, iteration: int) -> str | None:
        """The log step's reproducibility line (a host read, at a log step), and a fresh count."""
        if self.mode != "report_stats" or not self.stats.runs:
            return None
        stats, parts = self.stats, []
        for name in ("lm loss", "grad norm"):
            if name in stats.device:
                same, worst = stats.device[name].tolist()
                parts.append(
                    f"{name} identical in {int(same)}/{stats.runs}, largest relative difference {worst:.3E}"
                )
        line = (
            f"result reproducibility (--rerun-mode report_stats), iterations {stats.first}-{iteration}: "
            + ("; ".join(parts) or "nothing compared on this rank")
        )
        self.stats = _Stats()
        return line


def _enabled(flags) -> tuple[str, ...]:
    on = {
        "loss": flags.check_for_nan_in_loss_and_grad,
        "spiky": flags.check_for_spiky_loss,
        "grad": flags.check_for_nan_in_loss_and_grad,
        "large": flags.check_for_large_grads,
    }
    return tuple(check.name for check in CHECKS if on[check.name])


def _check_writable(path: str) -> None:
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        raise ConfigError(
            f"--result-rejected-tracker-filename {path}: cannot append to it ({err.strerror})"
        ) from None


def _loss_value(losses) -> torch.Tensor | None:
    """The validated loss: ``lm loss`` (else the first reported value) on the loss stage; None elsewhere."""
    if not losses:
        return None
    return losses.get("lm loss", next(iter(losses.values())))


def _shared_value(step: Step, check: Check) -> float:
    """The value ``check`` judged, on every rank: the gradient norm is global; the loss lives on the
    last stage and travels bit for bit (one all-reduce, on this rare path only)."""
    if check.name in ("grad", "large"):
        return math.nan if step.grad_norm is None else float(step.grad_norm)
    value = _loss_value(step.losses)
    bits = -(2**63) if value is None else struct.unpack("<q", struct.pack("<d", float(value)))[0]
    if dist.is_initialized() and dist.get_world_size() > 1:
        tensor = torch.tensor([bits], dtype=torch.int64, device=current_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        bits = int(tensor.item())
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _differ(a: float, b: float, tolerance: float) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return False
    if not (math.isfinite(a) and math.isfinite(b)):
        return True
    return abs(a - b) > tolerance * abs(a + b) / 2


def _fmt(check: Check, value: float) -> str:
    name = "grad norm" if check.name in ("grad", "large") else "lm loss"
    return f"{name} {value:.6E}" if math.isfinite(value) else f"{name} {value}"


def _shown(record: dict, check: Check) -> str:
    return _fmt(check, float.fromhex(record["value"]))


def _accumulate(stats: dict[str, torch.Tensor], name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Add one comparison to ``stats[name]`` = [identical count, largest relative difference], on the device."""
    a, b = a.detach().reshape(()).to(torch.float64), b.detach().reshape(()).to(torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    relative = torch.where(same, torch.zeros_like(a), (a - b).abs() / ((a + b).abs() / 2))
    relative = torch.nan_to_num(relative, nan=math.inf)
    if name not in stats:
        stats[name] = torch.zeros(2, dtype=torch.float64, device=a.device)
    stats[name][0] += same.to(torch.float64)
    stats[name][1] = torch.maximum(stats[name][1], relative)

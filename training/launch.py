"""``trident-run`` (or ``python -m training.launch``): torchrun, with Trident's exit codes for its caller.

    trident-run --standalone --nproc-per-node 8 --max-restarts 3 pretrain_gpt.py ... --save ckpt

It takes torchrun's arguments and runs torch's own elastic agent (the same rendezvous, restarts and
worker environment), with three changes, all about the codes it and its workers end with
(``training.errors``):

* the launcher exits with the failed worker's code when it is one Trident documents for a caller to
  act on: 2 (the command line cannot be read), 3 (the flags do not fit together, the world size or the
  checkpoint; a ``ConfigError`` exits 3 only in trident-run's workers, which it marks with
  ``TRIDENT_RUN=1``), 16 (result validation: resume from the checkpoint on other devices) and 17 (result
  validation: the result failed). torchrun exits 1 whatever the code, which then shows only in its
  failure summary. Any other failure exits 1, as under torchrun.
* ``--max-restarts`` does not restart the workers after those codes, since a restart here cannot
  help. After 17 (a transient fault: these devices computed a wrong result once; or a persistent
  fault of the first run's devices) the devices should be looked at before the run goes on. After 16
  the step must run again on *other* devices: torchrun restarts every worker on the same devices
  (``LOCAL_RANK`` picks the same GPU), where a persistent fault would reproduce and pass for a
  correct result (Megatron reruns from the checkpoint again when it lands on the same device). So the
  launcher hands 16 to its caller, whose scheduler resumes the job elsewhere. After 2 the same
  command line fails the same way, and after 3 too: a restart keeps the command line, the world size
  (the nodes that are left) and the checkpoint it resumes from (the latest complete one), which are
  all a configuration error depends on. Every other failure is restarted as torchrun does.
* a launcher ended by a signal (SIGTERM, as a scheduler sends to the job step; SIGINT, SIGHUP,
  SIGQUIT) forwards it to the workers as torchrun does, waits for them (``--shutdown-timeout``, then
  SIGKILL), and exits 128 + the signal's number (143 for SIGTERM) when every worker stopped cleanly:
  with ``--exit-signal-handler`` each has saved a checkpoint at the same iteration, so the same command
  line resumes losing nothing. It does the same when no worker was running (a signal during a
  rendezvous: before the first start, or between attempts after a failure): the signal lost nothing. If a worker did not (no ``--exit-signal-handler``: the signal ended it),
  the launcher prints torchrun's failure summary and exits 1. torchrun prints a traceback there and
  exits 1 either way.

On several nodes each node's agent applies the rule to its own workers; every rank of a Trident job
ends with the same code for these failures (one rank prints, the others exit quietly with its code),
so every node stops, and the rendezvous closes as under torchrun.

torchrun's agent has no hook for a restart rule, so :class:`TridentAgent` subclasses its
``LocalElasticAgent`` and reads and sets one private attribute (the restarts left), and
:func:`launch` builds the agent as ``torch.distributed.launcher.api.launch_agent`` does. Nothing in
torch is patched; the subclass is tested with the torch versions :data:`TESTED_TORCH` names, and the
launcher refuses any other with one line.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from typing import NoReturn

import torch
import torch.distributed.elastic.rendezvous.registry as rdzv_registry
import torch.distributed.run as torch_run
from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port

from training.errors import (
    EXIT_CONFIG,
    EXIT_FAILED_VALIDATION,
    EXIT_FAILURE,
    EXIT_RESUME_TO_DISAMBIGUATE,
    EXIT_SIGNALLED,
    EXIT_USAGE,
    LAUNCHED_BY_TRIDENT_RUN,
)

__all__ = [
    "NO_RESTART",
    "TESTED_TORCH",
    "Signalled",
    "TridentAgent",
    "exit_code",
    "launch",
    "main",
    "signalled_exit_code",
    "torch_problem",
]

PROG = "trident-run"
TESTED_TORCH = ((2, 13), (2, 14))
"""The torch versions the agent's subclass is tested with: at least the first, below the second."""
NO_RESTART = {
    EXIT_USAGE: "the command line cannot be read; the same command fails the same way",
    EXIT_CONFIG: (
        "the flags do not fit together, the world size or the checkpoint; a restart keeps all three"
    ),
    EXIT_RESUME_TO_DISAMBIGUATE: (
        "result validation reproduced a fatal result on these devices; resume from the checkpoint on other "
        "devices to tell a persistent fault from a correct result, which a restart here cannot"
    ),
    EXIT_FAILED_VALIDATION: "a result failed validation; restarting cannot help",
}
"""The worker exit codes the launcher hands to its caller, never restarting after them, and why."""


def torch_problem(version: str) -> str | None:
    """Why this launcher cannot run under torch ``version``, or None when it is a tested one."""
    low, high = TESTED_TORCH
    if low <= tuple(int(part) for part in version.split(".")[:2]) < high:
        return None
    tested = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    return (
        f"torch {version} is installed; {PROG} subclasses torch's elastic agent and is tested with torch "
        f"{tested} only: use torchrun (it restarts after every failure and exits 1), or a torch in that range"
    )


def _say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _first_failure(result: RunResult) -> tuple[int, ProcessFailure] | None:
    """The failure torchrun's summary calls the root cause: the first observed (global rank, failure)."""
    if not result.is_failed() or not result.failures:
        return None
    rank = min(result.failures, key=lambda r: result.failures[r].timestamp)
    return rank, result.failures[rank]


class Signalled(Exception):
    """The launcher was sent ``signum``; ``workers``: how the workers it forwarded it to ended (None
    when none were running)."""

    def __init__(self, signum: int, workers: RunResult | None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.workers = signum, workers


class TridentAgent(LocalElasticAgent):
    """torchrun's agent, which does not restart the workers after a code in :data:`NO_RESTART`, and
    which says how the workers ended when a signal stops it (:class:`Signalled`)."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        first = _first_failure(result)
        if first is not None and first[1].exitcode in NO_RESTART and self._remaining_restarts > 0:
            rank, code = first[0], first[1].exitcode
            left = f"{self._remaining_restarts} of --max-restarts {worker_group.spec.max_restarts} left"
            _say(f"rank {rank} exited with {code}: not restarting the workers ({left}): {NO_RESTART[code]}")
            self._remaining_restarts = 0  # read by the agent's loop right after this call returns
        return result

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super().run(role)
        except SignalException as stop:  # the agent has forwarded the signal and waited for the workers
            raise Signalled(int(stop.sigval), self._ended_workers(role)) from stop

    def _ended_workers(self, role: str) -> RunResult | None:
        """How the workers the signal reached ended; None when none was running: before the first start,
        or between attempts (stopped after a failure, the next ones not yet started by the rendezvous)."""
        group = self.get_worker_group(role)
        if group.state in (WorkerState.INIT, WorkerState.STOPPED):
            return None
        return super()._monitor_workers(group)


def _same_names(source: object, *names: str) -> dict[str, object]:
    """``source``'s attributes ``names``, by name: the ``LaunchConfig`` fields torch passes on as they are."""
    return {name: getattr(source, name) for name in names}


def launch(config: LaunchConfig, entrypoint: str, args: list[str]) -> RunResult | None:
    """Run the workers under :class:`TridentAgent`, as ``launch_agent`` runs torchrun's; the result
    (None when the rendezvous let this node go without running workers)."""
    config.run_id = config.run_id or str(uuid.uuid4().int)
    os.environ[LAUNCHED_BY_TRIDENT_RUN] = "1"  # inherited by the workers: a ConfigError exits 3 there
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        **_same_names(config, "run_id", "min_nodes", "max_nodes", "local_addr"),
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv),
        master_addr=master_addr,
        master_port=master_port,
        **_same_names(
            config,
            "max_restarts",
            "monitor_interval",
            "local_addr",
            "event_log_handler",
            "numa_options",
            "duplicate_stdout_filters",
            "duplicate_stderr_filters",
            "virtual_local_rank",
        ),
    )
    agent = TridentAgent(
        spec=spec,
        **_same_names(config, "logs_specs", "start_method", "log_line_prefix_template", "shutdown_timeout"),
    )
    return _run_agent(agent, spec, config)


def _run_agent(agent: TridentAgent, spec: WorkerSpec, config: LaunchConfig) -> RunResult | None:
    close_rendezvous = True
    metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
    try:
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        return result
    except Signalled:
        # as launch_agent: a launcher ended by a signal leaves the rendezvous open for the other nodes
        close_rendezvous = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()


def exit_code(result: RunResult | None) -> int:
    """The launcher's exit code: 0, the first failed worker's code when :data:`NO_RESTART` has it, else 1."""
    first = _first_failure(result) if result is not None else None
    if first is None:
        return 0 if result is None or not result.is_failed() else EXIT_FAILURE
    return first[1].exitcode if first[1].exitcode in NO_RESTART else EXIT_FAILURE


def signalled_exit_code(stop: Signalled) -> int:
    """128 + the signal's number when no worker was running or every one stopped cleanly, else 1."""
    clean = stop.workers is None or stop.workers.state == WorkerState.SUCCEEDED
    return EXIT_SIGNALLED + stop.signum if clean else EXIT_FAILURE


def _standalone(args) -> None:
    """torchrun's own defaults for a single node (``torch.distributed.run.run``'s first lines)."""
    single = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
    if args.standalone or (single and torch_run.parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _summary(script: str, result: RunResult) -> None:
    print(ChildFailedError(name=script, failures=result.failures).format_msg(), file=sys.stderr)


def _stopped(script: str, stop: Signalled) -> int:
    """Say how the workers ended after the launcher's signal; the launcher's exit code."""
    code, name = signalled_exit_code(stop), signal.Signals(stop.signum).name
    if stop.workers is None:
        _say(f"{name}: no workers were running (in a rendezvous, before a start or a restart); exit {code}")
    elif code != EXIT_FAILURE:
        _say(
            f"{name}: every worker stopped cleanly (exit 0; with --exit-signal-handler after saving); exit {code}"
        )
    elif (first := _first_failure(stop.workers)) is not None:
        _summary(script, stop.workers)
        _say(f"{name}: rank {first[0]} ended with {first[1].exitcode}, not cleanly; exit {code}")
    else:
        _say(f"{name}: the workers did not all stop ({stop.workers.state.name}); exit {code}")
    return code


def main(argv: list[str] | None = None) -> NoReturn:
    """The ``trident-run`` command: torchrun's arguments, Trident's exit codes (module docstring)."""
    problem = torch_problem(torch.__version__)
    if problem is not None:
        _say(f"error: {problem}")
        sys.exit(EXIT_FAILURE)
    parser = torch_run.get_args_parser()
    parser.prog, parser.description = PROG, __doc__.split("\n\n")[0]
    args = parser.parse_args(argv)
    _standalone(args)
    config, entrypoint, entry_args = torch_run.config_from_args(args)
    try:
        result = launch(config, entrypoint, entry_args)
    except Signalled as stop:
        sys.exit(_stopped(args.training_script, stop))
    code = exit_code(result)
    if result is not None and result.is_failed():
        _summary(args.training_script, result)
        if code != EXIT_FAILURE:
            _say(f"exit {code}: rank {_first_failure(result)[0]}'s exit code")
    sys.exit(code)


if __name__ == "__main__":
    main()

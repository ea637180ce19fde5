"""Trident's launcher without processes (``training/launch.py``): the torch versions it runs under, and
the exit code it makes of the workers' failures (its restart rule runs in ``tests/e2e/test_launch.py``)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.api import ProcessFailure

from training.errors import EXIT_CONFIG, EXIT_FAILURE, LAUNCHED_BY_TRIDENT_RUN, ConfigError, UsageError
from training.faults.reporting import exit_code as exit_code_of
from training.launch import Signalled, exit_code, signalled_exit_code, torch_problem


def test_the_launcher_runs_under_the_torch_versions_it_is_tested_with_and_refuses_others():
    assert torch_problem("2.13.0+cpu") is None and torch_problem("2.13.1") is None
    for other in ("2.12.1", "2.14.0", "3.0.0"):
        assert torch_problem(other) == (
            f"torch {other} is installed; trident-run subclasses torch's elastic agent and is tested with torch "
            ">=2.13,<2.14 only: use torchrun (it restarts after every failure and exits 1), or a torch in that range"
        )


def _failed(*codes: int) -> RunResult:
    """Workers 0, 1, ... failed with ``codes``, in that order."""
    failures = {}
    for rank, code in enumerate(codes):
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        failures[rank].timestamp = 1000 + rank
    return RunResult(state=WorkerState.FAILED, failures=failures)


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ((17, -15), 17),
        ((16, 16), 16),
        ((2, 2), 2),
        ((1, -15), 1),
        ((-9, 17), 1),
        ((130,), 1),
        ((3, -15), 3),
        ((4,), 1),
    ],
)
def test_the_first_failed_workers_code_is_the_launchers_when_trident_documents_it(codes, expected):
    """2, 3, 16 and 17 go to the caller; any other failure is 1, as under torchrun. The first failure
    (torchrun's root cause) decides: a worker that was killed first makes the job a plain failure."""
    assert exit_code(_failed(*codes)) == expected


def test_a_run_that_succeeded_or_never_started_workers_exits_0():
    assert exit_code(RunResult(state=WorkerState.SUCCEEDED)) == 0
    assert exit_code(None) == 0


def test_a_launcher_ended_by_a_signal_exits_128_plus_it_when_every_worker_stopped_cleanly():
    """143 for SIGTERM once the workers exited 0 (with --exit-signal-handler: saved), or when none ran;
    1 when the signal ended a worker before it could save."""
    assert signalled_exit_code(Signalled(15, RunResult(state=WorkerState.SUCCEEDED))) == 143
    assert signalled_exit_code(Signalled(15, None)) == 143
    assert signalled_exit_code(Signalled(2, RunResult(state=WorkerState.SUCCEEDED))) == 130
    assert signalled_exit_code(Signalled(15, _failed(-15, 0))) == 1
    assert signalled_exit_code(Signalled(15, RunResult(state=WorkerState.UNKNOWN))) == 1


def test_a_refused_configuration_exits_3_only_in_trident_runs_workers(monkeypatch):
    """1 under python or plain torchrun (as Megatron's refusals), 3 where trident-run marked the worker."""
    monkeypatch.delenv(LAUNCHED_BY_TRIDENT_RUN, raising=False)
    assert exit_code_of(ConfigError("no")) == EXIT_FAILURE == 1
    monkeypatch.setenv(LAUNCHED_BY_TRIDENT_RUN, "1")
    assert exit_code_of(ConfigError("no")) == EXIT_CONFIG == 3
    assert exit_code_of(ValueError("a bug")) == 1 and exit_code_of(UsageError("x")) == 2

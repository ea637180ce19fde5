"""The restart rules and the fault injector's grammar, without processes."""

from __future__ import annotations

import argparse

import pytest

from training.arguments.parser import parse_args
from training.faults.injection import Fault, parse_faults
from training.faults.restart import resume_from_save_on_restart


def test_faults_parse_with_their_defaults_and_options():
    assert parse_faults("kill@forward:7:rank=3, exception@save:4:attempt=1, slow@forward:2:factor=3") == [
        Fault(kind="kill", point="forward", iteration=7, rank=3),
        Fault(kind="exception", point="save", iteration=4, attempt=1),
        Fault(kind="slow", point="forward", iteration=2, factor=3.0),
    ]
    assert parse_faults("") == []
    assert parse_faults("nan@backward:2:rank=1,exception@data:3,write@save:4") == [
        Fault(kind="nan", point="backward", iteration=2, rank=1),
        Fault(kind="exception", point="data", iteration=3),
        Fault(kind="write", point="save", iteration=4),
    ]


@pytest.mark.parametrize(
    "spec",
    [
        "explode@forward:3",
        "kill@backwards:3",
        "kill@forward",
        "kill@forward:3:host=2",
        "slow@optimizer:3",
        "slow@forward:3:factor=0.5",
        "nan@save:3",
        "nan@data:3",
        "slow@backward:3",
        "write@forward:3",
    ],
)
def test_a_fault_that_does_not_exist_is_one_line_naming_the_grammar(spec):
    with pytest.raises(ValueError) as err:
        parse_faults(spec)
    assert str(err.value) == (
        f"TRIDENT_FAULT: cannot read {spec!r}; expected <kind>@<point>:<iteration>[:rank=R][:attempt=A] "
        "with kind in exception, kill, term, hang, slow, nan, write and point in forward, data, backward, "
        "optimizer, save (slow: at forward; nan: at forward or backward; write: at save; slow takes "
        "[:factor=F], F >= 1)"
    )


def test_a_restarted_attempt_without_load_resumes_from_save(monkeypatch):
    args = argparse.Namespace(save="ckpt", load=None)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resume_from_save_on_restart(args).load is None  # the first attempt starts as told
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert resume_from_save_on_restart(args).load == "ckpt"
    assert args.load is None  # a copy: the parsed flags stay as given
    given = argparse.Namespace(save="ckpt", load="other")
    assert resume_from_save_on_restart(given).load == "other"
    assert resume_from_save_on_restart(argparse.Namespace(save=None, load=None)).load is None


_RERUN = (
    "Megatron's result validation (the rerun state machine) is not built; --check-for-nan-in-loss-and-grad "
    "stops at a NaN/inf loss or gradient (without it the step is skipped and counted), and TRIDENT_FAULT "
    "injects faults for drills"
)
_RESILIENCY = (
    "it needs NVIDIA's resiliency package and NCCL; Trident restarts under torchrun --max-restarts, at any "
    "world size, resuming from the latest complete checkpoint"
)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        *(
            (flag, f"Trident does not support {flag.split()[0]} yet: {_RERUN}")
            for flag in (
                "--rerun-mode validate_results",
                "--check-for-spiky-loss",
                "--check-for-large-grads",
                "--error-injection-rate 100",
                "--error-injection-type transient_error",
                "--result-rejected-tracker-filename rejected.txt",
            )
        ),
        ("--inprocess-restart", f"Trident does not support --inprocess-restart: {_RESILIENCY}"),
        ("--enable-ft-package", f"Trident does not support --enable-ft-package: {_RESILIENCY}"),
    ],
)
def test_unbuilt_resilience_flags_are_refused_with_one_line(argv, message):
    with pytest.raises(ValueError) as error:
        parse_args(argv.split())
    assert str(error.value) == message

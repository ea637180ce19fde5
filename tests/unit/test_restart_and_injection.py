"""The restart rules and the fault injector's grammar, without processes."""

from __future__ import annotations

import argparse

import pytest

from training.arguments.parser import parse_args
from training.faults import injection
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


_RESILIENCY = (
    "it needs NVIDIA's resiliency package and NCCL; Trident restarts under torchrun --max-restarts, at any "
    "world size, resuming from the latest complete checkpoint"
)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--inprocess-restart", f"Trident does not support --inprocess-restart: {_RESILIENCY}"),
        ("--enable-ft-package", f"Trident does not support --enable-ft-package: {_RESILIENCY}"),
    ],
)
def test_unbuilt_resilience_flags_are_refused_with_one_line(argv, message):
    with pytest.raises(ValueError) as error:
        parse_args(argv.split())
    assert str(error.value) == message


def test_result_validation_flags_parse_with_megatron_names_and_defaults():
    defaults = parse_args([])
    assert (defaults.rerun_mode, defaults.error_injection_rate, defaults.error_injection_type) == (
        "validate_results",
        0,
        "transient_error",
    )
    assert not defaults.check_for_spiky_loss and not defaults.check_for_large_grads
    assert defaults.result_rejected_tracker_filename is None
    flags = (
        "--rerun-mode disabled --check-for-spiky-loss --check-for-large-grads --error-injection-rate 100 "
        "--error-injection-type persistent_error --result-rejected-tracker-filename rejected.txt"
    )
    given = parse_args(flags.split())
    assert (given.rerun_mode, given.check_for_spiky_loss, given.check_for_large_grads) == (
        "disabled",
        True,
        True,
    )
    assert (given.error_injection_rate, given.error_injection_type) == (100, "persistent_error")
    assert given.result_rejected_tracker_filename == "rejected.txt"


def test_a_fault_fires_once_per_process_so_a_rerun_of_its_iteration_meets_none(monkeypatch):
    monkeypatch.setenv("TRIDENT_FAULT", "exception@forward:3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(injection, "_PLANNED", None)
    monkeypatch.setattr(injection, "_FIRED", set())
    injection.inject("forward", 2)
    with pytest.raises(
        RuntimeError, match=r"^injected fault \(TRIDENT_FAULT\): exception at forward of iteration 3"
    ):
        injection.inject("forward", 3)
    injection.inject("forward", 3)  # result validation's rerun of iteration 3

"""What a run prints at its end: a command that continues the run as printed.

The resume command is run for real, through torchrun, by ``test_pretrain.py`` (resume) and
``test_hf_parity.py`` (train a fine-tuned import longer); here its launcher and flags are checked
for each way a run can be launched (tests/dist/test_run_output.py checks that lines stay whole).
"""

from __future__ import annotations

import shlex
import sys

import pytest

from training.arguments.checks import validate_args
from training.arguments.parser import parse_args
from training.reporting import launch_command
from training.reporting.launch_command import next_command

FLAGS = (
    "--load imported --finetune --use-checkpoint-args --ckpt-step=5 --no-load-optim --train-iters 2 --lr 0"
)


KEPT = "--use-checkpoint-args --lr 0 --save 'out dir'"  # the --save of a run, quoted for the shell


def _next(monkeypatch, *, iteration: int = 2, launcher=None, parent=None, env=None, flags=FLAGS):
    """The summary's command for a run of ``script flags --save 'out dir'`` launched by ``launcher``."""
    argv = [*shlex.split(flags), "--save", "out dir"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setattr(sys, "orig_argv", [*(launcher or ["python3"]), "pretrain_gpt.py", *argv])
    monkeypatch.setattr(
        launch_command, "_cmdline", lambda pid: parent and [*parent, "pretrain_gpt.py", *argv]
    )
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return next_command(validate_args(parse_args(None), 1), iteration)


def test_the_next_command_keeps_torchruns_own_command_line(monkeypatch, tmp_path):
    torchrun = tmp_path / "torchrun"
    torchrun.write_text("#!/usr/bin/env python3\n")
    monkeypatch.setattr(launch_command.shutil, "which", lambda name: str(torchrun))
    rendezvous = "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint host:29500"
    env = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}
    found = _next(monkeypatch, parent=["/usr/bin/python3", str(torchrun), *rendezvous.split()], env=env)
    assert found.label == "train longer"  # --finetune, --load, --ckpt-step, --no-load-optim gone
    assert found.command == (
        f"torchrun {rendezvous} pretrain_gpt.py {KEPT} --load 'out dir' --train-iters 4 "
        "--override-opt_param-scheduler"
    )
    assert found.notes == ("run it on every node, as the original command was",)


def test_without_its_command_line_torchrun_is_rebuilt_from_its_environment(monkeypatch):
    env = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}
    found = _next(monkeypatch, iteration=1, env=env)
    assert (found.label, found.notes) == ("resume", ())  # stopped early: the same length, no override
    assert found.command == (
        f"torchrun --nproc-per-node 4 --standalone pretrain_gpt.py {KEPT} --load 'out dir' --train-iters 2"
    )
    found = _next(monkeypatch, env={**env, "WORLD_SIZE": "8"})
    assert found.command.startswith("torchrun --nproc-per-node 4 --nnodes 2 pretrain_gpt.py ")
    assert found.notes == (
        (
            "torchrun's command could not be read back: add its rendezvous flags (--rdzv-backend, "
            "--rdzv-endpoint, or --node-rank and --master-addr) and run it on every node"
        ),
    )


@pytest.mark.parametrize(
    "flags, iteration, tail",
    [
        (FLAGS, 2, "--load 'out dir' --train-iters 4 --override-opt_param-scheduler"),
        (  # sample-based (64 samples of the demo's 16): its own length doubled, the user's schedule kept
            "--train-samples 64 --use-checkpoint-opt_param-scheduler --lr 0",
            4,
            "--use-checkpoint-opt_param-scheduler --lr 0 --save 'out dir' --load 'out dir' --train-samples 128",
        ),
    ],
)
def test_without_a_launcher_the_interpreter_and_its_options_are_kept(monkeypatch, flags, iteration, tail):
    found = _next(monkeypatch, iteration=iteration, launcher=["python3", "-u"], flags=flags)
    assert found.command.startswith("python3 -u pretrain_gpt.py ") and found.command.endswith(tail)

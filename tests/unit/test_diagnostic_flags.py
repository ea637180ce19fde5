"""Megatron's diagnostic flags that change no result: ``--record-memory-history`` (the CUDA allocator's
history; off CUDA one line says it needs CUDA) and ``--logging-level`` (Python's root logger, which the
libraries log through). The CUDA side of the history: ``tests/unit/test_cuda.py``."""

from __future__ import annotations

import logging

import pytest

from tests.support.pretrain_run import pretrain_gpt_in_process
from training.reporting.logging_utils import set_logging_level

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --eval-interval 1000 --eval-iters 0 --lr 1e-3 --mock-data --num-workers 0 "
    "--tokenizer-type NullTokenizer --vocab-size 127 --seed 7 --train-iters 2 --log-interval 1"
)


@pytest.fixture
def root_level():
    """The root logger's level, put back after the test."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def test_off_cuda_the_memory_history_is_one_line_and_changes_nothing(capsys, tmp_path):
    plain = pretrain_gpt_in_process(argv=TINY.split())
    capsys.readouterr()
    path = tmp_path / "snapshot.pickle"
    recorded = pretrain_gpt_in_process(
        argv=[*TINY.split(), "--record-memory-history", "--memory-snapshot-path", str(path)]
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if "history" in line]
    assert lines == [
        (
            "--record-memory-history: the allocator history needs CUDA; this run computes on the CPU and goes "
            "on without it"
        )
    ]
    assert [s["lm loss"] for s in recorded.losses] == [s["lm loss"] for s in plain.losses]
    assert list(tmp_path.iterdir()) == []


def test_the_logging_level_is_the_root_loggers_for_the_run(root_level):
    logging.getLogger().setLevel(logging.WARNING)
    pretrain_gpt_in_process(argv=[*TINY.split(), "--logging-level", "40"])
    assert logging.getLogger().level == logging.ERROR


def test_without_the_flag_megatrons_environment_variable_sets_it(root_level, monkeypatch):
    logging.getLogger().setLevel(logging.WARNING)
    set_logging_level(None)
    assert logging.getLogger().level == logging.WARNING
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "10")
    set_logging_level(None)
    assert logging.getLogger().level == logging.DEBUG
    set_logging_level(30)  # the flag wins
    assert logging.getLogger().level == logging.WARNING

"""``tools/bench/pipelining.py``: Trident's engine (``pretrain()``) and ``torch.distributed.pipelining``
train the same real GPT stages, from the same weights on the same samples, to the same losses (issue
32's comparison; the speeds are the tool's to print, not a test's to time)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.torchrun_jobs import run_captured

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_both_engines_train_the_same_gpt_stages_to_the_same_losses():
    done = run_captured(
        [
            sys.executable,
            "tools/bench/pipelining.py",
            "--pp",
            "2",
            "--schedules",
            "interleaved",
            "--steps",
            "2",
        ],
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert (row["pp"], row["schedule"], row["pairs"]) == (2, "interleaved", 2)
    assert row["steps_compared"] == 5  # warm-up 2, timed 2, and the first (the torch side's build)
    assert row["max_loss_gap"] < 1e-5
    assert row["trident_tokens_per_s"] > 0 and row["torch_tokens_per_s"] > 0

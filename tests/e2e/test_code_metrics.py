"""A fresh reader's check: the README's reading path names the file of every frame of a real step."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.support.torchrun_jobs import run_captured


@pytest.mark.timeout(300)
def test_the_reading_path_names_every_frame_from_pretrain_to_the_model() -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    done = run_captured([sys.executable, "tools/code_metrics.py", "--frames"], env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    depth = re.search(r"frames from pretrain\(\) to GPTModel.forward, both counted: (\d+)", done.stdout)
    assert depth and int(depth[1]) <= 16, done.stdout[-2000:]
    assert "frames in files it leaves out: none" in done.stdout, done.stdout[-2000:]

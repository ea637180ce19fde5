"""``tools/gpu_check.py`` runs end to end in its CPU mode: the CUDA tests are collected and skipped,
the benchmark trains both contestants, and the table and the JSON line come out (issue 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.torchrun_jobs import run_captured

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # about 70 s, mostly its children's start-up
def test_the_gpu_check_runs_end_to_end_in_its_cpu_mode():
    done = run_captured(
        [sys.executable, "tools/gpu_check.py", "--device", "cpu", "--quick"],
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    *table, last = done.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["ok"] and result["gpu_check"]["device"] == "cpu"
    tests = {r["name"]: r["result"] for r in result["rows"] if r["step"] == "tests"}
    # test_cuda.py's 10, test_fp8.py's 6 (a recipe and format each), test_fp8_blockwise.py's 2,
    # test_cuda_graphs.py's 6
    assert len(tests) == 26 and tests.pop("(all)") == "exit 0"
    assert set(tests.values()) == {"skipped"}  # no GPU here: every cuda test collected, none run
    fp8 = [r for r in result["rows"] if r["step"] == "fp8"]
    assert {r["contestant"] for r in fp8} == {"bf16", "fp8 tensorwise", "fp8 delayed"}
    assert all(r["result"] == "ok" for r in fp8)
    bench = [r for r in result["rows"] if r["step"] == "bench"]
    assert {r["contestant"] for r in bench} == {"trident", "transformers", "trident --cuda-graph-impl local"}
    assert all(r["tokens_per_s"] > 0 and 0 < r["host_share"] < 1 for r in bench)
    zero = {r["config"]: r for r in result["rows"] if r["step"] == "zero"}
    assert list(zero) == ["distopt+overlap", "zero2+overlap", "zero3+prefetch", "zero3+step"]
    assert zero["distopt+overlap"]["vs_distopt"] == 1.0 and all(r["median_ms"] > 0 for r in zero.values())
    graphs = [r["detail"] for r in result["rows"] if r["step"] == "graphs"]
    assert graphs[0] == (
        "--cuda-graph-impl local: CUDA graphs need CUDA; this run computes on the CPU (gloo) and goes on "
        "without them"
    )
    assert table[0].startswith("gpu_check on cpu") and any(
        line.startswith("bench  tiny fp32 eager trident") for line in table
    )


def test_help_says_how_to_run_it_through_the_device_tool():
    done = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert 'run(command="python tools/gpu_check.py --wheels wheels", timeout_s=540' in done.stdout

"""FP8 under ``--compile`` through ``pretrain()``: inductor compiles in worker processes, so this run is
here, not with the FP8 layers in tests/unit/test_fp8.py."""

from __future__ import annotations

from tests.support.fp8_run import fp8_run


def test_compiled_layers_and_casts_follow_the_eager_fp8_run():
    """``--compile`` (inductor): the layers and the fused casts (values and transposed copy in one
    kernel) give the eager FP8 run's losses, within the bf16 rounding compiled element-wise work has."""
    eager, _ = fp8_run("--train-iters 4 --fp8-recipe tensorwise")
    compiled, _ = fp8_run("--train-iters 4 --fp8-recipe tensorwise --compile")
    assert max(abs(a - b) / a for a, b in zip(eager, compiled)) < 1e-3

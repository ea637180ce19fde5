"""FP8 under ``--compile`` through ``pretrain()``: inductor compiles in worker processes, so these runs are
here, not with the FP8 layers in tests/unit/test_fp8.py. All three are slow (inductor takes 30-50 s a
run here); the README's test command keeps FP8 under dynamo with the eager backend (tests/unit/test_fp8.py)."""

from __future__ import annotations

import pytest

from tests.support.fp8_run import IN_BLOCKS, fp8_run


@pytest.mark.slow
def test_compiled_layers_and_casts_follow_the_eager_fp8_run():
    """``--compile`` (inductor): the layers and the fused casts (values and transposed copy in one
    kernel) give the eager FP8 run's losses, within the bf16 rounding compiled element-wise work has."""
    eager, _ = fp8_run("--train-iters 4 --fp8-recipe tensorwise")
    compiled, _ = fp8_run("--train-iters 4 --fp8-recipe tensorwise --compile")
    assert max(abs(a - b) / a for a, b in zip(eager, compiled)) < 1e-3


@pytest.mark.slow
def test_compiled_run_with_weights_held_in_fp8_follows_the_eager_one():
    """``--fp8-param-gather`` under ``--compile``: the held weights are not cast, the inputs' and
    gradients' casts are compiled; the losses follow the eager run's as above."""
    held = "--train-iters 4 --fp8-recipe tensorwise --use-distributed-optimizer --fp8-param-gather"
    eager, _ = fp8_run(held)
    compiled, _ = fp8_run(f"{held} --compile")
    assert max(abs(a - b) / a for a, b in zip(eager, compiled)) < 1e-3


@pytest.mark.slow
def test_compiled_blockwise_run_follows_the_eager_one():
    """The blockwise recipe's 1 x 128 and 128 x 128 casts compiled by inductor cast what the eager ones
    cast (``tests/unit/test_fp8.py`` checks the bits with dynamo's eager backend)."""
    blockwise = f"--train-iters 4 {IN_BLOCKS}"
    eager, _ = fp8_run(blockwise)
    compiled, _ = fp8_run(f"{blockwise} --compile")
    assert max(abs(a - b) / a for a, b in zip(eager, compiled)) < 1e-3

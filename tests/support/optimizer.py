"""What the optimizer tests share (one process in tests/unit, real ranks in tests/dist)."""

from __future__ import annotations


def adam_state_sum(optimizer) -> float:
    """Sum of |every Adam moment and step count|: 0 when no update ever reached the state.

    A skip is decided on the device, so the fused kernel may create the (zero) moments without
    touching them; zero moments at step 0 are what a fresh state is."""
    return sum(float(t.abs().sum()) for state in optimizer.state.values() for t in state.values())

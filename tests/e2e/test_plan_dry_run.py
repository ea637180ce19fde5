"""The planner's dry run against a real 4-rank run: ``tools/plan_check_memory.py`` starts ``pretrain_gpt.py``
under torchrun (the dry run itself, one process with a fake process group: tests/unit/test_plan_dry_run.py)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_dry_run_matches_a_real_run_on_four_ranks():
    """``pretrain_gpt.py`` on 4 gloo ranks with its live tensor bytes counted, against the dry run of the
    same flags (``python tools/plan_check_memory.py real`` runs all three layouts)."""
    from tools.plan_check_memory import REAL_LAYOUTS, check_real

    rows = check_real({"PP4 1F1B": REAL_LAYOUTS["PP4 1F1B"]})
    assert len(rows) == 4 and all(abs(r["ratio"] - 1) < 0.05 for r in rows), rows

"""The redesign's measures held: no function over 60 lines, no import circle, one function-local import."""

from __future__ import annotations

from tools.code_metrics import LONG, Tree, reading_path


def test_no_long_function_no_import_circle_and_one_local_import() -> None:
    tree = Tree()
    assert tree.long_functions == [], f"functions over {LONG} lines: {tree.long_functions}"
    assert tree.circles() == []
    assert len(tree.local_imports) <= 1, tree.local_imports


def test_the_readme_reading_path_starts_at_the_entry_script_and_ends_at_the_model() -> None:
    path = reading_path()
    assert path[0] == "pretrain_gpt.py"
    assert path[-1] == "models/gpt/gpt_model.py"
    assert len(path) == len(set(path)) == 10

"""Dependencies point one way (DESIGN.md): ``pretrain_gpt.py, tools/, planner/ -> training/ -> models/ -> core/``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What each package must not import: the packages above it.
FORBIDDEN = {
    "core": ("models", "training", "planner", "tools"),
    "models": ("training", "planner", "tools"),
    "training": ("planner", "tools"),
    "planner": ("tools",),
}


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_each_package_imports_only_the_packages_below_it():
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package, forbidden in FORBIDDEN.items()
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(_imported(path) & set(forbidden))
    ]
    assert wrong == []

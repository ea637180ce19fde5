"""The README's two commands are what CI and a new user run: keep them honest."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readmes_test_command_then_the_slow_suite():
    *_, ci_command, slow_suite = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert _commands()[1] == ci_command
    assert slow_suite == "python -m pytest -q -m slow"
    assert "python -m pytest -q -m slow        #" in (ROOT / "README.md").read_text()


def test_first_command_installs_and_trains_through_the_pipeline():
    first = _commands()[0]
    assert first.startswith('pip install "torch==2.13.0" -e . && torchrun --nproc-per-node 4 pretrain_gpt.py')
    assert "--pipeline-model-parallel-size 4" in first


def test_torch_is_a_range_not_a_pin():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=[0-9.]+"', pyproject)


def test_the_layout_section_lists_every_module_and_only_modules_that_exist():
    """One line per module, so a newcomer finds each job in one place; a new module adds its line."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    tree = section[section.index("```\n") + 4 :]
    tree = tree[: tree.index("```")]
    listed, stack = set(), []  # (indent, directory) of the enclosing folders
    for line in tree.splitlines():
        name = line.split()[0]
        indent = len(line) - len(line.lstrip())
        stack = [(i, d) for i, d in stack if i < indent]
        path = "".join(d for _, d in stack) + name
        if name.endswith("/"):
            stack.append((indent, name))
        else:
            listed.add(path)
    modules = {
        str(p.relative_to(ROOT))
        for folder in ("core", "models", "training", "planner", "tools")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__init__.py"
    } | {"pretrain_gpt.py"}
    assert listed == modules

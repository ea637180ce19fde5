"""The README's two commands are what CI and a new user run: keep them honest."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readmes_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert _commands()[1] == ci_command


def test_first_command_installs_and_trains_through_the_pipeline():
    first = _commands()[0]
    assert first.startswith('pip install "torch==2.13.0" -e . && torchrun --nproc-per-node 4 pretrain_gpt.py')
    assert "--pipeline-model-parallel-size 4" in first


def test_torch_is_a_range_not_a_pin():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=[0-9.]+"', pyproject)

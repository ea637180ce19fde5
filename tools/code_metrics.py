"""How the code reads, counted: long functions, function-local imports, import circles, call depth.

The figures issue 21 asks for, from the source alone (``ast``, nothing imported) except the call
depth, which a short real run measures:

    python tools/code_metrics.py                 # functions over 60 lines, local imports, circles
    python tools/code_metrics.py --list          # ... with every function-local import named
    python tools/code_metrics.py --frames        # frames and files from pretrain() to GPTModel.forward,
                                                 # and which files the README's reading path leaves out

Counted in ``core/``, ``models/`` and ``training/``. A function-local import is an import of those
packages inside a function (``TYPE_CHECKING`` blocks excluded). Circles are strongly connected
components of the import graph counting every import (module level, ``TYPE_CHECKING`` and
function-local), a submodule importing its own package excluded.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "models", "training", "planner")
LONG = 60


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: None if is_package else -1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


class Tree:
    """The project's modules and, per module, its imports and its function-local imports."""

    def __init__(self) -> None:
        self.files = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
        self.modules = {_module(p) for p in self.files}
        self.edges: dict[str, set[str]] = {}
        self.local_imports: list[str] = []
        self.long_functions: list[tuple[int, str]] = []
        for path in self.files:
            self._read(path)

    def _resolve(self, name: str) -> str | None:
        while name and name not in self.modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    def _read(self, path: Path) -> None:
        module, tree = _module(path), ast.parse(path.read_text())
        is_package, where = path.name == "__init__.py", path.relative_to(ROOT)
        edges = self.edges.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found = {self._resolve(t) for t in _targets(module, node, is_package)}
                edges |= {m for m in found if m and m != module and not module.startswith(m + ".")}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONG:
                    self.long_functions.append((length, f"{where}:{node.lineno} {node.name}"))
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        found = [self._resolve(t) for t in _targets(module, inner, is_package)]
                        target = next((m for m in found if m), None)
                        if target:
                            self.local_imports.append(f"{where}:{inner.lineno} {node.name} -> {target}")

    def circles(self) -> list[list[str]]:
        """Strongly connected components with more than one module (Tarjan)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in self.edges.get(v, ()):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

        sys.setrecursionlimit(10_000)
        for v in sorted(self.edges):
            if v not in index:
                visit(v)
        return found


GROUP_READER_SCOPE = ("core", "models", "training/checkpoint")


def _is_global_read(call: ast.Call, aliases: set[str], names: set[str]) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in aliases:
        name = func.attr
    elif isinstance(func, ast.Name) and func.id in names:
        name = func.id
    else:
        return None
    return name if name.startswith("get_") or name == "model_parallel_is_initialized" else None


def global_group_readers() -> dict[str, list[str]]:
    """Module -> the ``parallel_state`` getters it calls (``line:name``), in core/, models/ and
    training/checkpoint/ (``parallel_state`` itself excluded). A caller that hands no groups in gets
    ``parallel_state.groups_or_default``, which is not a getter: these are the other readers."""
    readers: dict[str, list[str]] = {}
    for path in sorted(p for scope in GROUP_READER_SCOPE for p in (ROOT / scope).rglob("*.py")):
        if path.name == "parallel_state.py":
            continue
        tree = ast.parse(path.read_text())
        aliases, names = {"parallel_state"}, set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "core":
                aliases |= {a.asname or a.name for a in node.names if a.name == "parallel_state"}
            if isinstance(node, ast.ImportFrom) and node.module == "core.parallel_state":
                names |= {a.asname or a.name for a in node.names}
        calls = [
            (node.lineno, _is_global_read(node, aliases, names))
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
        ]
        found = sorted(f"{line}:{name}" for line, name in calls if name)
        if found:
            readers[str(path.relative_to(ROOT))] = found
    return readers


def frames() -> list[tuple[str, str]]:
    """(file, function) of every frame from ``pretrain`` to ``GPTModel.forward``, in a one-rank run."""
    sys.path.insert(0, str(ROOT))
    import pretrain_gpt
    from models.gpt import gpt_model

    chain: list[tuple[str, str]] = []
    original = gpt_model.GPTModel.forward

    def forward(self, *args, **kwargs):
        if not chain:
            callers = [(f.filename, f.function) for f in inspect.stack()[1:]]
            top = next(i for i, (_, name) in enumerate(callers) if name == "pretrain")
            chain.extend(
                [*reversed(callers[: top + 1]), (inspect.getsourcefile(original), "GPTModel.forward")]
            )
        return original(self, *args, **kwargs)

    gpt_model.GPTModel.forward = forward
    argv = (
        "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 100 --num-workers 0 --eval-iters 0"
    )
    pretrain_gpt.main(argv=argv.split())
    return chain


def reading_path() -> list[str]:
    """The files the README's reading path names, in order: the numbered list under "## Layout"."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 1)[0]
    items = re.findall(r"^\d+\. `([^`]+\.py)`", layout, flags=re.MULTILINE)
    return items


def _report_frames() -> None:
    chain = frames()
    ours = [(f, name) for f, name in chain if os.path.abspath(f).startswith(str(ROOT))]
    for file, name in chain:
        print(f"  {os.path.relpath(file, ROOT) if (file, name) in ours else 'torch'}: {name}")
    print(
        f"frames from pretrain() to GPTModel.forward, both counted: {len(chain)} ({len(ours)} in project "
        f"code, {len(chain) - len(ours)} torch's Module.__call__); project files: {len({f for f, _ in ours})}"
    )
    named = reading_path()
    unread = sorted({os.path.relpath(f, ROOT) for f, _ in ours} - set(named))
    print(
        f"the README's reading path names {len(named)} files; frames in files it leaves out: "
        f"{', '.join(unread) if unread else 'none'}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="name every function-local import")
    parser.add_argument("--frames", action="store_true", help="measure the call depth of a real step")
    args = parser.parse_args(argv)
    if args.frames:
        _report_frames()
        return
    tree = Tree()
    print(f"functions over {LONG} lines in {', '.join(PACKAGES)}: {len(tree.long_functions)}")
    for length, where in sorted(tree.long_functions, reverse=True):
        print(f"  {length:4d} {where}")
    print(f"function-local project imports: {len(tree.local_imports)}")
    for line in tree.local_imports if args.list else ():
        print(f"  {line}")
    circles = tree.circles()
    print(f"import circles (every import counted): {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    readers = global_group_readers()
    print(f"modules in {', '.join(GROUP_READER_SCOPE)} calling parallel_state's getters: {len(readers)}")
    for module, calls in readers.items():
        print(f"  {module}: {', '.join(calls)}")


if __name__ == "__main__":
    main()

"""The default training corpus: documentation text that every Python installation carries.

Trident's out-of-the-box run must train on real text without downloading anything. Every
CPython ships two sources of English prose: the docstrings in the standard library's ``.py``
files and the reference-manual topics in ``pydoc_data/topics.py``. This module reads both
*statically* (``ast``, never ``import``), so no module with import-time side effects
(``antigravity``, ``this``, ``tkinter``...) can run, and writes them as JSON lines
(``{"text": ...}`` per document), the input format of ``tools/preprocess_data.py``.

The corpus is deterministic for a given Python build (files are visited in sorted order) and
differs between Python versions, so the cache file name carries the full version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sysconfig
import tempfile
import time
import tokenize
from collections.abc import Iterator
from pathlib import Path

from training.reporting.logging_utils import print_line

# Directory names never descended into: tests (low-value, sometimes deliberately broken
# source), third-party packages, generated codec tables, and byte-code caches.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"}
)


def default_cache_dir() -> Path:
    """Trident's cache directory: ``$TRIDENT_CACHE`` if set, else ``~/.cache/trident``."""
    env = os.environ.get("TRIDENT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trident"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    Concurrent writers (several ranks building the same cache) are safe: each writes its own
    temporary file in the target directory and the last ``os.replace`` wins.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, qualifier: str) -> str:
    """A one-line header such as ``def Path.joinpath(self, *args)`` or ``class Path(PurePath)``."""
    name = f"{qualifier}{node.name}"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {name}({bases})" if bases else f"class {name}"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{prefix} {name}({ast.unparse(node.args)})"


def _definitions(body: list[ast.stmt], qualifier: str) -> Iterator[str]:
    """Yield ``header\\n\\ndocstring`` for every documented class/function, in source order."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield f"{_signature(node, qualifier)}:\n{doc}"
            if isinstance(node, ast.ClassDef):
                yield from _definitions(node.body, f"{qualifier}{node.name}.")


def module_document(path: Path, module_name: str) -> str | None:
    """The text of one module's documentation (module docstring, then each definition's), or None.

    Files that do not parse under this Python (e.g. deliberately broken test data) are skipped.
    """
    try:
        with tokenize.open(path) as f:  # honours PEP 263 encoding cookies
            tree = ast.parse(f.read(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None
    parts = []
    module_doc = ast.get_docstring(tree, clean=True)
    if module_doc:
        parts.append(f"Module {module_name}\n\n{module_doc}")
    parts.extend(_definitions(tree.body, ""))
    return "\n\n".join(parts) if parts else None


def _pydoc_topics(stdlib: Path) -> dict[str, str]:
    """The reference-manual topics of ``pydoc_data/topics.py``, read with ``ast`` (no import)."""
    path = stdlib / "pydoc_data" / "topics.py"
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return {str(k): str(v) for k, v in value.items()}
    return {}


def iter_stdlib_documents(stdlib_dir: str | os.PathLike | None = None) -> Iterator[str]:
    """Yield the corpus documents in a fixed order: one per documented module, then one per topic."""
    stdlib = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    files = []
    for root, dirs, names in os.walk(stdlib):
        rel_root = Path(root).relative_to(stdlib)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        if rel_root.parts and rel_root.parts[0] == "pydoc_data":
            continue
        files.extend(rel_root / n for n in names if n.endswith(".py"))
    for rel in sorted(files, key=lambda p: p.as_posix()):
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        text = module_document(stdlib / rel, ".".join(parts) or stdlib.name)
        if text:
            yield text
    for name, text in sorted(_pydoc_topics(stdlib).items()):
        text = text.strip()
        if text:
            yield text


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be written as UTF-8
        return False
    return True


def build_default_corpus(
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    stdlib_dir: str | os.PathLike | None = None,
    verbose: bool = True,
) -> Path:
    """Return the path of the default corpus (JSON lines), building and caching it on first use.

    Args:
        cache_dir: where the corpus is cached; defaults to :func:`default_cache_dir`.
        force: rebuild even if a cached copy exists.
        stdlib_dir: read another tree instead of this interpreter's standard library (tests).
        verbose: print the corpus' size and provenance.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    version = platform.python_version()
    impl = platform.python_implementation()
    if stdlib_dir is None:
        name = f"stdlib-docs-{impl.lower()}-{version}"
    else:
        digest = hashlib.sha1(str(Path(stdlib_dir).resolve()).encode()).hexdigest()[:10]
        name = f"docs-{digest}-{impl.lower()}-{version}"
    path = cache / f"{name}.jsonl"
    meta_path = cache / f"{name}.json"
    if path.is_file() and meta_path.is_file() and not force:
        if verbose:
            meta = json.loads(meta_path.read_text())
            print_line(f"default corpus: {path} (cached; {_describe(meta)})")
        return path

    start = time.perf_counter()
    lines = [
        json.dumps({"text": text}, ensure_ascii=False)
        for text in iter_stdlib_documents(stdlib_dir)
        if _encodable(text)
    ]
    data = ("\n".join(lines) + "\n").encode("utf-8") if lines else b""
    meta = {
        "source": "python standard library docstrings + pydoc_data topics",
        "python": f"{impl} {version}",
        "stdlib": str(stdlib_dir or sysconfig.get_paths()["stdlib"]),
        "documents": len(lines),
        "bytes": len(data),
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    atomic_write_bytes(path, data)
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2).encode())
    if verbose:
        print_line(f"default corpus: built {path} ({_describe(meta)})")
    return path


def _describe(meta: dict) -> str:
    return (
        f"{meta['python']}, {meta['documents']} documents, "
        f"{meta['bytes'] / 1e6:.1f} MB, built in {meta['build_seconds']} s"
    )

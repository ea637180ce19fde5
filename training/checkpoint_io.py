"""Checkpoint files: atomic writes, safetensors files of flat or nested states, no pickle.

Every file is written to a temporary name in its directory, fsynced and renamed over the target, so a
reader sees either the old file or the whole new one. Nested states (optimizer, RNG) become their
tensors plus a JSON skeleton; :func:`read_header` checks a safetensors file is whole before it is read.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "atomic_write",
    "flatten_state",
    "read_header",
    "unflatten_state",
    "write_tensors",
    "write_text",
]


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit this run; the message names the file."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a temporary file in the same directory, fsync it, rename it over ``path``."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def write_text(path: str, text: str) -> None:
    """Atomically replace ``path`` with a file holding ``text``."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)

    atomic_write(path, write)


def write_tensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors needs contiguous CPU tensors that share no storage: copy any that do not comply."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    ready = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and (ptr in seen or t.untyped_storage().nbytes() != t.nbytes):
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        ready[name] = t
    atomic_write(path, lambda tmp: save_file(ready, tmp, metadata=metadata))


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], str]:
    """A nested state as its tensors (keyed by path, e.g. ``state/0/exp_avg``) and a JSON skeleton."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = path or "."
            while key in tensors:
                key += "#"
            tensors[key] = obj
            return {"__tensor__": key}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: enc(v, f"{path}/{k}".lstrip("/")) for k, v in obj.items()}
            for k in obj:
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    raise TypeError(f"cannot store dict key {k!r} at '{path}' without pickle")
            return {"__dict__": [[k, enc(v, f"{path}/{k}".lstrip("/"))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            items = [enc(v, f"{path}/{i}".lstrip("/")) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else {"__tuple__": items}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalar
            return obj.item()
        raise TypeError(
            f"cannot store {type(obj).__name__} at '{path}' without pickle; use tensors, "
            "numbers, strings, lists and dicts"
        )

    skeleton = json.dumps(enc(state, ""))
    return tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: str) -> Any:
    """Inverse of :func:`flatten_state`."""

    def dec(obj: Any) -> Any:
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(dec(v) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: dec(v) for k, v in obj["__dict__"]}
        return {k: dec(v) for k, v in obj.items()}

    return dec(json.loads(skeleton))


def read_header(path: str) -> dict:
    """The safetensors header, after checking the file is whole (its size matches what the header says)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    bad = f"checkpoint file {path} is truncated or corrupt"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{bad}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CheckpointError(f"{bad}: its header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise CheckpointError(f"{bad}: its safetensors header cannot be parsed") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{bad}: its header describes {8 + n + end} bytes but the file has {size}")
    return header

"""Weights & Biases tracking: one rank logs, offline when there is no key, resumable by run id.

Only the first rank of the last pipeline stage (the one that has the loss) talks to W&B, every
iteration, with W&B's system metrics and console capture on; every other rank gets a ``NullRun``
with the same methods that does nothing, so the training loop never branches on rank. Without an API key (or with ``WANDB_MODE=offline``) runs are written offline
under ``--wandb-save-dir``; ``read_offline_history`` reads such a run's logged scalars back.
"""

from __future__ import annotations

import json
import netrc
import os
import struct
from pathlib import Path
from typing import Any


class NullRun:
    """Stands in for a W&B run on ranks that do not log."""

    id: str | None = None
    dir: str | None = None

    def log(self, metrics: dict, step: int | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """ "offline" unless a key is configured and ``WANDB_MODE`` does not say otherwise."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    return "online" if _has_api_key() else "offline"


def start_run(
    *,
    project: str | None,
    name: str | None,
    save_dir: str | None,
    config: dict[str, Any],
    run_id: str | None,
    is_logging_rank: bool,
):
    """The W&B run for this rank: a real one on the logging rank when ``project`` is set, else a NullRun.

    ``run_id`` (from a checkpoint) resumes the same run; offline this writes a new run directory
    that carries the same id.
    """
    if not project or not is_logging_rank:
        return NullRun()
    import wandb

    directory = Path(save_dir or "wandb-runs")
    directory.mkdir(parents=True, exist_ok=True)
    mode = wandb_mode()
    return wandb.init(
        project=project,
        name=name,
        dir=str(directory),
        config=_jsonable(config),
        id=run_id,
        resume="allow" if run_id else None,
        mode=mode,
        # W&B's defaults: system metrics (CPU, GPU, memory) and console capture on. WANDB_CONSOLE=off
        # and WANDB_X_DISABLE_STATS=true turn them off (see the README).
        settings=wandb.Settings(silent=True),
    )


def _jsonable(config: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        try:
            json.dumps(value)
            out[key] = value
        except TypeError:
            out[key] = str(value)
    return out


# --------------------------------------------------------------------------------------------------
# Reading offline runs back (tests, and users without a W&B server)
# --------------------------------------------------------------------------------------------------
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    """The raw records of a ``.wandb`` file (a LevelDB-style log after a 7-byte ':W&B' header)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (bad header {data[:4]!r})")
    records, partial, pos = [], b"", 7
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            partial = chunk
        elif kind == _MIDDLE:
            partial += chunk
        elif kind == _LAST:
            records.append(partial + chunk)
    return records


def read_offline_history(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"id": run id, "config": {...}, "history": [{key: value, "_step": n}, ...]}`` of an offline run."""
    from wandb.proto import wandb_internal_pb2

    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}")
    result: dict[str, Any] = {"id": None, "config": {}, "history": []}
    for raw in _records(files[0]):
        record = wandb_internal_pb2.Record.FromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            result["id"] = record.run.run_id
            for item in record.run.config.update:
                result["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                result["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            result["history"].append(row)
    return result

"""Checkpoints as safetensors and JSON, no pickle; a crash mid-save never loses the previous checkpoint.

One directory per iteration, Megatron's tracker file next to them::

    DIR/latest_checkpointed_iteration.txt             the iteration number; written last, atomically
    DIR/iter_0000100/manifest.json                    iteration, samples, sizes, args, scheduler, extra
    DIR/iter_0000100/model_tp{t}_pp{p}.safetensors    weights of one (TP, PP) rank (DP rank 0 writes it)
    DIR/iter_0000100/optim_tp{t}_pp{p}_dp{d}.safetensors   optimizer state of every rank
    DIR/iter_0000100/rng_tp{t}_pp{p}_dp{d}.safetensors     RNG states of every rank

Parameter names carry global layer numbers, so a model file is a flat ``name -> tensor`` dict (all
virtual chunks of a rank merged). Nested states (optimizer, RNG) are stored as their tensors plus a
JSON skeleton in the safetensors metadata. Every file is written to a temporary name, fsynced and
renamed; after a barrier rank 0 writes the manifest and then the tracker, so a reader sees either
the old checkpoint or the whole new one. Loading checks the tracker, the manifest, the parallel
sizes and every file's header on every rank before any collective, so a bad checkpoint makes every
rank raise the same :class:`CheckpointError`; per-rank shape checks are agreed on with one small
all-reduce so that those, too, fail on every rank instead of hanging.
"""

from __future__ import annotations

import json
import os
import random
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint_io import (
    CheckpointError,
    flatten_state,
    read_header,
    unflatten_state,
    write_tensors,
    write_text,
)

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "current_parallel",
    "get_rng_state",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "set_rng_state",
]

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
FORMAT = "trident-checkpoint-v1"


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` read for this rank; parts that were not asked for are None."""

    iteration: int
    consumed_samples: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict | None
    scheduler_state: dict | None
    rng_state: dict | None
    manifest: dict


# ------------------------------------------------------------------------------------------------
# File names and the manifest (writing and reading the files: training.checkpoint_io)
# ------------------------------------------------------------------------------------------------


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _names(p: Mapping[str, int]) -> dict[str, list[str]]:
    """Every file a checkpoint with these parallel sizes holds, by kind."""
    grid = [(t, q, d) for q in range(p["pp"]) for t in range(p["tp"]) for d in range(p["dp"])]
    return {
        "model": [f"model_tp{t}_pp{q}.safetensors" for t, q, d in grid if d == 0],
        "optimizer": [f"optim_tp{t}_pp{q}_dp{d}.safetensors" for t, q, d in grid],
        "rng": [f"rng_tp{t}_pp{q}_dp{d}.safetensors" for t, q, d in grid],
    }


def _json_subset(args: Namespace | Mapping | None) -> dict[str, Any]:
    """The JSON-serialisable part of the run's arguments (dtypes as strings)."""
    out: dict[str, Any] = {}
    for key, value in (vars(args) if isinstance(args, Namespace) else dict(args or {})).items():
        if isinstance(value, torch.dtype):
            value = str(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------------
# RNG states
# ------------------------------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """Python ``random``, numpy, torch CPU (and CUDA when present) and the tensor-parallel tracker states."""
    import numpy as np

    from core.tensor_parallel import get_rng_tracker

    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "random": [version, list(keys), gauss],
        "numpy": [name, np_keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch_cpu": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned, so the next draws repeat exactly."""
    import numpy as np

    from core.tensor_parallel import get_rng_tracker

    version, keys, gauss = state["random"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    get_rng_tracker().set_states(state["tracker"])


# ------------------------------------------------------------------------------------------------
# Save (and the agreement step that save and load share)
# ------------------------------------------------------------------------------------------------


def _agree(error: str | None) -> None:
    """Raise on every rank if any rank failed: the lowest failing rank's message is broadcast to all."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error:
            raise CheckpointError(error)
        return
    from core.device import current_device

    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    first = torch.tensor([rank if error else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return
    data = torch.tensor(list((error or "").encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], device=device)
    dist.broadcast(length, src)
    buf = data if rank == src else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    message = bytes(buf.cpu().tolist()).decode()
    raise CheckpointError(message if rank == src else f"rank {src}: {message}")


def _sizes(parallel: Mapping[str, Any]) -> dict[str, int]:
    """The sizes of a ``parallel`` dict, after checking its ranks lie inside them."""
    for axis in ("tp", "pp", "dp"):
        if not 0 <= parallel[f"{axis}_rank"] < parallel[axis]:
            raise ValueError(
                f"parallel {axis}_rank {parallel[f'{axis}_rank']} is outside {axis} size {parallel[axis]}"
            )
    return {"tp": parallel["tp"], "pp": parallel["pp"], "dp": parallel["dp"], "vpp": parallel.get("vpp") or 1}


def current_parallel() -> dict[str, int]:
    """This rank's ``parallel`` dict from ``core.parallel_state`` (a world of one when it is not set up)."""
    from core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "vpp": 1}
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def save_checkpoint(
    save_dir: str,
    iteration: int,
    *,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping | None,
    scheduler_state: Mapping | None,
    rng_state: Mapping | None,
    args: Namespace | Mapping | None,
    consumed_samples: int,
    parallel: Mapping[str, Any],
    extra: Mapping | None = None,
) -> str:
    """Write this rank's files of ``DIR/iter_XXXXXXX``; rank (0, 0, 0) then commits it. Call on every rank.

    ``rng_state=None`` saves :func:`get_rng_state`. A failure on any rank raises :class:`CheckpointError`
    on every rank and leaves the tracker, hence the previous checkpoint, untouched. Returns the
    iteration directory.
    """
    t, q, d = parallel["tp_rank"], parallel["pp_rank"], parallel["dp_rank"]
    path = iteration_dir(save_dir, iteration)
    sizes = _sizes(parallel)
    manifest = {
        "format": FORMAT,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "parallel": sizes,
        "files": _names(sizes),
        "args": _json_subset(args),
        "scheduler": None if scheduler_state is None else dict(scheduler_state),
        "extra": dict(extra or {}),
    }
    try:  # on every rank, before any file is touched: the same error everywhere
        manifest_text = json.dumps(manifest, indent=1)
    except (TypeError, ValueError) as err:
        raise TypeError(f"scheduler_state and extra must be JSON-serialisable: {err}") from None
    error = None
    try:
        os.makedirs(path, exist_ok=True)
        if d == 0:
            model_file = os.path.join(path, f"model_tp{t}_pp{q}.safetensors")
            write_tensors(model_file, model_state, {"format": FORMAT})
        for kind, state in (("optim", optimizer_state or {}), ("rng", rng_state or get_rng_state())):
            tensors, skeleton = flatten_state(state)
            write_tensors(
                os.path.join(path, f"{kind}_tp{t}_pp{q}_dp{d}.safetensors"),
                tensors,
                {"format": FORMAT, "skeleton": skeleton},
            )
    except Exception as err:  # noqa: BLE001 -- reported on every rank by _agree, so no rank waits forever
        error = f"saving checkpoint {path} failed: {type(err).__name__}: {err}"
    _agree(error)  # doubles as the barrier: every rank's files are complete before the commit
    if t == q == d == 0:
        try:
            write_text(os.path.join(path, MANIFEST), manifest_text)
            write_text(os.path.join(save_dir, TRACKER), str(iteration))  # the commit point: last
        except OSError as err:
            error = f"committing checkpoint {path} failed: {err}"
    _agree(error)
    return path


# ------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------


def read_tracker(root: str) -> int | str | None:
    """The iteration the tracker names (``"release"`` for a release checkpoint), None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise CheckpointError(
            f"checkpoint tracker {path} is corrupt: expected an iteration number, got {text!r}"
        )
    return int(text)


def _describe(p: Mapping[str, int]) -> str:
    return f"TP={p['tp']} PP={p['pp']}" + (f" VPP={p['vpp']}" if p["vpp"] > 1 else "") + f" DP={p['dp']}"


def _check_shapes(path: str, header: dict, expected: Mapping[str, tuple]) -> None:
    saved = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    problems = [
        f"tensor '{k}' has shape {saved[k]} in the checkpoint but {tuple(s)} in the model"
        for k, s in expected.items()
        if k in saved and saved[k] != tuple(s)
    ]
    problems += [
        f"tensor '{k}' {tuple(s)} is missing from the checkpoint"
        for k, s in expected.items()
        if k not in saved
    ]
    problems += [
        f"the checkpoint has tensor '{k}' {s} that the model does not"
        for k, s in saved.items()
        if k not in expected
    ]
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint file {path} does not match the model: " + "; ".join(problems[:3]) + more
        )


def load_checkpoint(
    load_dir: str,
    *,
    parallel: Mapping[str, Any],
    expected_model_shapes: Mapping[str, tuple],
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    missing_ok: bool = False,
) -> LoadedCheckpoint | None:
    """Read the latest checkpoint in ``load_dir`` for this rank; call on every rank.

    ``finetune`` (Megatron's ``--finetune``, also implied by a ``release`` checkpoint) loads the
    weights only and starts at iteration 0 with 0 consumed samples; ``load_optim=False``
    (``--no-load-optim``) skips optimizer and scheduler state, ``load_rng=False`` the RNG states.
    With no tracker file, ``missing_ok=True`` returns None (Megatron starts from scratch then);
    otherwise that, like any other problem, raises :class:`CheckpointError`.
    """
    marker = read_tracker(load_dir)
    if marker is None:
        if missing_ok:
            return None
        raise CheckpointError(f"no checkpoint in {load_dir}: {os.path.join(load_dir, TRACKER)} is missing")
    finetune = finetune or marker == "release"
    path = os.path.join(load_dir, "release") if marker == "release" else iteration_dir(load_dir, marker)
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
        saved = {k: int(manifest["parallel"][k]) for k in ("tp", "pp", "dp", "vpp")}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is missing") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    ours = _sizes(parallel)
    load_optim, load_rng = load_optim and not finetune, load_rng and not finetune
    shape_differs = any(saved[k] != ours[k] for k in ("tp", "pp", "vpp"))
    if shape_differs or (saved["dp"] != ours["dp"] and (load_optim or load_rng)):
        hint = (
            "convert it with tools/convert_checkpoint.py (coming)"
            if shape_differs
            else "optimizer and RNG states are per data-parallel rank: pass --no-load-optim --no-load-rng "
            "(or --finetune) to load only the weights"
        )
        raise CheckpointError(
            f"checkpoint {path} was saved with {_describe(saved)}, this run has {_describe(ours)}; {hint}"
        )
    names = _names(saved)
    kinds = ["model"] + ["optimizer"] * load_optim + ["rng"] * load_rng
    headers = {name: read_header(os.path.join(path, name)) for kind in kinds for name in names[kind]}

    t, q, d = parallel["tp_rank"], parallel["pp_rank"], parallel["dp_rank"]
    mine = {
        "model": f"model_tp{t}_pp{q}.safetensors",
        "optimizer": f"optim_tp{t}_pp{q}_dp{d}.safetensors",
        "rng": f"rng_tp{t}_pp{q}_dp{d}.safetensors",
    }
    states: dict[str, Any] = {"optimizer": None, "rng": None}
    error = None
    try:
        from safetensors.torch import load_file

        _check_shapes(os.path.join(path, mine["model"]), headers[mine["model"]], expected_model_shapes)
        for kind in kinds:
            file = os.path.join(path, mine[kind])
            try:
                tensors = load_file(file)
                meta = headers[mine[kind]].get("__metadata__") or {}
                states[kind] = tensors if kind == "model" else unflatten_state(tensors, meta["skeleton"])
            except Exception as err:  # noqa: BLE001 -- any read failure becomes one error naming the file
                raise CheckpointError(f"checkpoint file {file} cannot be read: {err}") from None
    except CheckpointError as err:
        error = str(err)
    _agree(error)
    return LoadedCheckpoint(
        iteration=0 if finetune else manifest["iteration"],
        consumed_samples=0 if finetune else manifest["consumed_samples"],
        model_state=states["model"],
        optimizer_state=states["optimizer"],
        scheduler_state=manifest.get("scheduler") if load_optim else None,
        rng_state=states["rng"],
        manifest=manifest,
    )


# ------------------------------------------------------------------------------------------------
# --exit-signal-handler
# ------------------------------------------------------------------------------------------------

"""Saving a live run's checkpoint in three steps: describe, write, commit.

:func:`describe` (the training thread, nothing written) lists this rank's files and the tensors
each holds, as the live tensors themselves (optimizer state included: views, no copies), and
captures everything the manifest will say. :func:`write_files` writes them, atomically, and
returns their records (sizes and checksums); it is plain file I/O, so it may run on any thread,
from host copies of the tensors (:mod:`training.checkpoint.staging`). :func:`commit` then runs on
every rank: an agreement that every rank's files are complete, the records gathered, and rank 0
writes the manifest and then the tracker, the commit point. A failure anywhere before the tracker
leaves the previous checkpoint the tracker's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from core.parallel_state import ParallelGroups
from core.tensor_parallel.fp8 import fp8_state_dict
from core.transformer.initialization import unstacked
from training.checkpoint.convert import parallelism_of
from training.checkpoint.files import TensorFileWriter, flatten_state, fsync_dir
from training.checkpoint.format import (
    FORMAT,
    CheckpointError,
    TensorSpec,
    canonical_order,
    expert_file,
    iteration_dir,
    model_file,
    optim_file,
    rng_file,
)
from training.checkpoint.images import write_image
from training.checkpoint.live import (
    RankSplit,
    checkpoint_tensors,
    is_sharded,
    merge_param_groups,
    model_parameters,
    optimizer_tensors,
    unwrap,
)
from training.checkpoint.rng import get_rng_state
from training.checkpoint.specs import specs_of_params, tied_tensors
from training.checkpoint.staging import FileToWrite, HostStaging, SaveRequest
from training.checkpoint.writer import copy_tokenizer, manifest_header, write_manifest
from training.faults.agreement import gather, raise_first_error

__all__ = [
    "FileToWrite",
    "SaveRequest",
    "agree",
    "check_json",
    "commit",
    "describe",
    "failure",
    "save_checkpoint",
    "write_files",
]


def check_json(scheduler_state: Mapping | None, extra: Mapping | None) -> None:
    """Raise TypeError (a caller's bug, not a failed save) unless both can go into the manifest."""
    try:
        json.dumps([dict(scheduler_state or {}), dict(extra or {})])
    except (TypeError, ValueError) as err:
        raise TypeError(f"scheduler_state and extra must be JSON-serialisable: {err}") from None


def failure(path: str, err: BaseException) -> str:
    """The one-line message of a save of ``path`` that raised ``err``."""
    return f"saving checkpoint {path} failed: {type(err).__name__}: {err}"


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


def _frozen(value: Any) -> Any:
    """A deep copy of a JSON value, so a later change by the run cannot reach a save in flight."""
    return None if value is None else json.loads(json.dumps(value))


def _ownership(specs: Mapping[str, TensorSpec], p: RankSplit) -> Callable[[str], str | None]:
    """``owns(name)``: "dense" or "expert" if this rank writes parameter ``name`` (and, unsharded, its
    optimizer state), else None. A dense weight is written by data-parallel rank 0, a TP-replicated
    one by TP rank 0 of those; an MoE expert (never TP-split: other TP ranks hold other experts) by
    the first of its expert-data-parallel replicas."""

    def owns(name: str) -> str | None:
        spec = specs[name]
        if spec.expert is not None:
            return "expert" if p.edp_rank == 0 else None
        first = p.dp_rank == 0 and (spec.partition is not None or p.tp_rank == 0)
        return "dense" if first else None

    return owns


def _tensor_files(
    params: Mapping[str, torch.Tensor], specs: dict[str, TensorSpec], p: RankSplit, optimizer
) -> tuple[dict[str, FileToWrite], Any, Any]:
    """This rank's weight and optimizer files (``specs``, by checkpoint tensor, gains the optimizer
    state's), with the optimizer's parameter groups and loss-scaler state. ``params``: the model's
    parameters, stored by :func:`checkpoint_tensors` (a stacked expert parameter slice by slice)."""
    t, q, d = p.tp_rank, p.pp_rank, p.dp_rank
    meta = {"format": FORMAT}
    files: dict[str, FileToWrite] = {}

    def ordered(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: tensors[key] for key in canonical_order(tensors, lambda name: specs[name].owner)}

    owns = _ownership(specs, p)
    for name, tp_rank, keep in ((model_file(t, q), t, "dense"), (expert_file(q, p.ep_rank), 0, "expert")):
        mine = {n: w.detach() for n, w in checkpoint_tensors(params).items() if owns(n) == keep}
        if mine or (keep == "dense" and d == 0):  # replicated over DP (an expert over expert DP): one writer
            files[name] = FileToWrite(ordered(mine), tp_rank, meta)
    if optimizer is None:
        return files, None, None
    experts = any(spec.expert is not None for spec in specs.values())
    sharded = is_sharded(optimizer, p.dp, p.edp if experts else 1)
    # unsharded state is replicated like its weights: the same writers
    state = optimizer_tensors(optimizer, params, specs, tp_rank=t, sharded=sharded, owns=owns)
    if getattr(optimizer, "state_is_a_replica", False):  # another distributed-optimizer instance writes it
        state.tensors.clear()
        state.flat.clear()
    specs.update(state.specs)
    if state.tensors or d == 0 or sharded:
        whole = frozenset(key for key in state.tensors if state.specs[key].partition is None)
        files[optim_file(t, q, d)] = FileToWrite(ordered(state.tensors), t, meta, state.flat, whole)
    return files, state.param_groups, state.grad_scaler


def describe(
    root: str,
    iteration: int,
    *,
    model_chunks: Sequence[nn.Module],
    optimizer=None,
    scheduler_state: Mapping | None = None,
    consumed_samples: int = 0,
    tokenizer: Mapping[str, Any] | None = None,
    args: Namespace | Mapping | None = None,
    extra: Mapping | None = None,
    rng_state: Mapping | None = None,
    groups: ParallelGroups | None = None,
) -> SaveRequest:
    """This rank's files of ``root/iter_XXXXXXX`` and the manifest's content; nothing is written or copied.

    The tensors are the live ones (views of the optimizer state): write them before the next
    optimizer step changes them, or stage host copies first. ``rng_state=None`` takes
    :func:`~training.checkpoint.rng.get_rng_state` now. ``groups``: the run's process groups, which
    say where this rank sits (see :meth:`RankSplit.of` for None).
    """
    p = RankSplit.of(groups)
    t, q, d = p.tp_rank, p.pp_rank, p.dp_rank
    module = unwrap(model_chunks[0])
    config = module.config
    params = model_parameters(model_chunks)
    specs = specs_of_params(checkpoint_tensors(params).items(), p.tp, config.make_vocab_size_divisible_by)
    held = (
        optimizer.held_weights_in_model_dtype() if hasattr(optimizer, "held_weights_in_model_dtype") else {}
    )
    # a held expert stack's master values under each expert's name, as a 16-bit stack is stored
    masters = dict(
        logical for name, master in held.items() for logical in unstacked(name, params[name], master)
    )
    for name, master in masters.items():  # a weight held in FP8 is stored as its master values
        specs[name] = dataclasses.replace(specs[name], dtype=master.dtype)
    files, param_groups, grad_scaler = _tensor_files(params | masters, specs, p, optimizer)
    rng_tensors, skeleton = flatten_state(
        _with_fp8(get_rng_state() if rng_state is None else rng_state, model_chunks)
    )
    files[rng_file(t, q, d)] = FileToWrite(rng_tensors, 0, {"format": FORMAT, "skeleton": skeleton})
    stored = {key for f in files.values() for key in f.tensors}
    local = {
        "tensors": {n: s.to_json() for n, s in specs.items() if n in stored},
        "groups": _frozen(param_groups),
        "grad_scaler": _frozen(grad_scaler),
    }
    manifest = _manifest_content(module, p.dp, iteration, consumed_samples, optimizer is not None)
    manifest.update(
        scheduler=_frozen(None if scheduler_state is None else dict(scheduler_state)),
        args=_json_subset(args),
        extra=_frozen(dict(extra or {})),
    )
    tokenizer = tokenizer if p.first else None
    return SaveRequest(root, iteration, files, local, tokenizer, manifest, commits=p.first)


def _with_fp8(rng_state: Mapping, model_chunks: Sequence[nn.Module]) -> Mapping:
    """The RNG states, and the delayed FP8 recipe's amax histories and scales of this rank's layers
    (by module name, under ``"fp8"``): per-rank state that exact resumption needs."""
    fp8 = fp8_state_dict(model_chunks)
    return {**rng_state, "fp8": fp8} if fp8 else rng_state


def _manifest_content(
    module: nn.Module, dp: int, iteration: int, consumed_samples: int, has_optimizer: bool
) -> dict[str, Any]:
    """What the manifest says of the model and the run at this save (see :func:`manifest_header`)."""
    config = module.config
    return {
        "header": {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "parallelism": parallelism_of(config, dp),
            "config": {**config.to_dict(), "context_parallel_size": 1},  # a checkpoint records no CP split
            "vocab_size": module.vocab_size,
            "padded_vocab_size": module.padded_vocab_size,
            "max_sequence_length": module.max_sequence_length,
        },
        "tied": tied_tensors(config.untie_embeddings_and_output_weights),
        "has_optimizer": has_optimizer,
    }


def _write(path: str, spec: FileToWrite, to_host: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    if spec.image is not None:
        record = write_image(path, spec.image)
    else:
        entries = [(key, t.dtype, tuple(t.shape)) for key, t in spec.tensors.items()]
        with TensorFileWriter(path, entries, spec.metadata) as fh:
            for key, tensor in spec.tensors.items():
                fh.write(key, to_host(tensor))
            record = fh.close(sync_dir=False)  # write_files syncs the directory once
    for key, piece in record["pieces"].items():
        piece["tp_rank"] = 0 if key in spec.whole else spec.tp_rank
        if key in spec.flat:
            piece["flat"] = list(spec.flat[key])
    return record


def write_files(
    request: SaveRequest,
    *,
    to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
    after_file: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write this rank's files (each under a temporary name, renamed when whole); rank 0 copies the
    tokenizer in. Returns what rank 0 needs of this rank for the manifest. Plain file I/O: any thread.

    ``to_host(tensor)`` gives the bytes of a tensor that is not on the host
    (:meth:`~training.checkpoint.staging.HostStaging.to_host`); ``after_file(name)`` runs after each
    file is in place (a test stops a write half way with it).
    """
    path = request.path
    os.makedirs(path, exist_ok=True)
    records = {}
    for name, spec in request.files.items():
        records[name] = _write(os.path.join(path, name), spec, to_host or torch.Tensor.cpu)
        if after_file is not None:
            after_file(name)
    fsync_dir(path)  # the renames are durable before rank 0 commits
    tokenizer = None
    if request.tokenizer is not None:
        tokenizer = copy_tokenizer(request.tokenizer["files"], path, request.tokenizer["type"])
    return {**request.local, "files": records, "tokenizer": tokenizer}


def _optimizer_record(gathered: list[dict]) -> dict:
    """The manifest's ``optimizer``: hyperparameters per parameter group and the loss scaler's state."""
    record = merge_param_groups([g["groups"] for g in gathered if g["groups"] is not None]) or {}
    scalers = [g["grad_scaler"] for g in gathered if g["grad_scaler"] is not None]
    return record | {"grad_scaler": scalers[0] if scalers else None}


def commit(request: SaveRequest | None, local: dict | None, error: str | None, group=None) -> None:
    """On every rank, once its files are written (or its ``error``): fail all ranks if any failed,
    else rank 0 writes the manifest and then the tracker. Collectives on ``group`` only."""
    agree(error, group)  # doubles as the barrier: every rank's files are complete before the commit
    gathered = gather(local, group)
    if request is not None and request.commits:
        try:
            _commit_manifest(request, local, gathered)
        except Exception as err:  # noqa: BLE001 -- every rank waits in agree for rank 0's verdict
            error = f"committing checkpoint {request.path} failed: {type(err).__name__}: {err}"
    agree(error, group)


def agree(error: str | None, group=None) -> None:
    """Every rank raises :class:`CheckpointError` if any failed (the first failing rank's message);
    the one agreement of saving and loading, over ``group`` (default: the whole job)."""
    raise_first_error(error, group, error_type=CheckpointError)


def _commit_manifest(request: SaveRequest, local: dict, gathered: list[dict]) -> None:
    saved = request.manifest
    manifest = manifest_header(**saved["header"], tokenizer=local["tokenizer"])
    manifest.update(
        tensors={n: s for g in gathered for n, s in g["tensors"].items()},
        tied=saved["tied"],
        optimizer=_optimizer_record(gathered) if saved["has_optimizer"] else None,
        scheduler=saved["scheduler"],
        files={f: r for g in gathered for f, r in g["files"].items()},
        args=saved["args"],
        extra=saved["extra"],
    )
    write_manifest(request.root, request.iteration, manifest)  # the tracker, the commit point, comes last


def save_checkpoint(
    save_dir: str,
    iteration: int,
    *,
    staging: HostStaging | None = None,
    after_file: Callable[[str], None] | None = None,
    **state: Any,
) -> str:
    """Write this rank's files of ``DIR/iter_XXXXXXX``; rank 0 then commits it. Call on every rank.

    ``state``: the keyword arguments of :func:`describe` (``model_chunks``, ``optimizer``,
    ``scheduler_state``, ``consumed_samples``, ``tokenizer`` as ``{"type", "files": {role: path}}``
    whose files are copied in, ``args``, ``extra``, ``rng_state``, ``groups``); ``after_file``: as
    :func:`write_files`'s. Training waits: the live
    tensors are written, a GPU tensor through ``staging``'s reused pinned buffer. A failure on any
    rank raises :class:`CheckpointError` on every rank and leaves the tracker, hence the previous
    checkpoint, untouched. Returns the iteration directory.
    """
    check_json(state.get("scheduler_state"), state.get("extra"))
    path = iteration_dir(save_dir, iteration)
    staging = staging or HostStaging()
    request, local, error = None, None, None
    try:
        request = describe(save_dir, iteration, **state)
        local = write_files(request, to_host=staging.to_host, after_file=after_file)
    except Exception as err:  # noqa: BLE001 -- reported on every rank by commit, so no rank waits forever
        error = failure(path, err)
    commit(request, local, error)
    return path

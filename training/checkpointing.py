"""Checkpoints of a training run: every rank saves its shards, and loads its slices at any split.

The format and the resharding live in :mod:`training.checkpoint`; this module connects them to the
live run. :func:`save_checkpoint` describes every parameter (global name, full shape, TP split,
owner in the layout) and stores the optimizer state by parameter name (with the distributed
optimizer, every data-parallel rank its own flat ranges of it; see :mod:`training.checkpoint.live`),
so :func:`load_checkpoint` can rebuild this rank's shards from a checkpoint saved at another
TP/PP/VPP/layout/DP, with or without the distributed optimizer: each rank reads only the pieces
that overlap its slices, optimizer state included. The fp16 loss scaler's state goes in the
manifest. Saving writes every file under a temporary name and renames it; after a barrier rank 0
writes the manifest and then the tracker, so a crash mid-save leaves the previous checkpoint in place. Every problem becomes one
:class:`CheckpointError` naming the file (and tensor), raised on every rank by :func:`_agree` before
any collective could hang.
"""

from __future__ import annotations

import json
import os
import random
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.checkpoint import (
    Checkpoint,
    CheckpointError,
    find_checkpoint,
    flatten_state,
    parallelism_of,
    read_tracker,
    remove_stale_temp_files,
    tied_tensors,
)
from training.checkpoint.files import TensorFileWriter, fsync_dir, probe_writable
from training.checkpoint.format import (
    FORMAT,
    TensorSpec,
    canonical_order,
    expert_file,
    iteration_dir,
    model_file,
    optim_file,
    optimizer_tensor_name,
    rng_file,
)
from training.checkpoint.live import (
    check_spec,
    is_sharded,
    merge_param_groups,
    model_parameters,
    optimizer_tensors,
    read_optimizer_state,
    unwrap,
)
from training.checkpoint.specs import check_same_model, specs_of_params
from training.checkpoint.writer import copy_tokenizer, manifest_header, write_manifest

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "current_parallel",
    "get_rng_state",
    "load_checkpoint",
    "prepare_save_dir",
    "read_tracker",
    "save_checkpoint",
    "set_rng_state",
]


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored on this rank (model, optimizer and RNG are already applied)."""

    path: str
    iteration: int
    consumed_samples: int
    scheduler_state: dict | None
    manifest: dict
    resharded: bool
    """The checkpoint was saved at another TP/PP/VPP/layout/DP split than this run's."""
    rng_restored: int
    """Ranks (in the whole job) whose RNG states came from the checkpoint; the others kept fresh seeds."""


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
# Agreement between ranks
# ------------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(error: str | None) -> None:
    """Raise on every rank if any rank failed: the lowest failing rank's message is broadcast to all."""
    if not _distributed():
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
    own = rank == src or error == message  # a rank that hit the same problem needs no "rank N:"
    raise CheckpointError(message if own else f"rank {src}: {message}")


def _sum_over_ranks(value: int) -> int:
    if not _distributed():
        return value
    from core.device import current_device

    total = torch.tensor([value], device=current_device())
    dist.all_reduce(total)
    return int(total.item())


def current_parallel() -> dict[str, int]:
    """This rank's ``parallel`` dict from ``core.parallel_state`` (a world of one when it is not set up).

    Its data-parallel size and rank count DP x CP: context-parallel ranks hold the same weights, the
    distributed optimizer shards over all of them, and a checkpoint records no CP split.
    """
    from core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {
            "tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "vpp": 1,
            "ep": 1, "ep_rank": 0, "edp": 1, "edp_rank": 0,
        }  # fmt: skip
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_world_size(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
    }


def prepare_save_dir(save_dir: str) -> list[str]:
    """At startup: check ``--save`` is a writable directory (a write probe on every rank), then delete the
    temporary files of killed saves (rank 0); complete checkpoints are never touched. Returns the
    files removed."""
    error, removed = None, []
    try:
        probe_writable(save_dir)
    except CheckpointError as err:
        error = str(err)
    _agree(error)  # every probe is done before rank 0 looks for stale temporary files
    if not _distributed() or dist.get_rank() == 0:
        try:
            removed = remove_stale_temp_files(save_dir)
        except OSError as err:
            error = f"cannot clean temporary files of interrupted saves in --save {save_dir}: {err}"
    _agree(error)
    return removed


# ------------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------------


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


def _write(
    path: str, tensors: Mapping[str, torch.Tensor], tp_rank: int, metadata: Mapping[str, str], owner=None
) -> dict:
    if owner is not None:
        tensors = {key: tensors[key] for key in canonical_order(tensors, owner)}
    with TensorFileWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata) as fh:
        for key, tensor in tensors.items():
            fh.write(key, tensor)
        record = fh.close(sync_dir=False)  # save_checkpoint syncs the directory once
    for piece in record["pieces"].values():
        piece["tp_rank"] = tp_rank
    return record


def _optimizer_record(optimizer, gathered: list[dict]) -> dict | None:
    """The manifest's ``optimizer``: hyperparameters per parameter group and the loss scaler's state."""
    if optimizer is None:
        return None
    record = merge_param_groups([g["groups"] for g in gathered if g["groups"] is not None]) or {}
    scalers = [g["grad_scaler"] for g in gathered if g["grad_scaler"] is not None]
    return record | {"grad_scaler": scalers[0] if scalers else None}


def _gather(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _ownership(specs: Mapping[str, TensorSpec], p: Mapping[str, int]):
    """``owns(name)``: "dense" or "expert" if this rank writes parameter ``name`` (and, unsharded, its
    optimizer state), else None. A dense weight is written by data-parallel rank 0, a TP-replicated
    one by TP rank 0 of those; an MoE expert (never TP-split: other TP ranks hold other experts) by
    the first of its expert-data-parallel replicas."""

    def owns(name: str) -> str | None:
        spec = specs[name]
        if spec.expert is not None:
            return "expert" if p["edp_rank"] == 0 else None
        first = p["dp_rank"] == 0 and (spec.partition is not None or p["tp_rank"] == 0)
        return "dense" if first else None

    return owns


def save_checkpoint(
    save_dir: str,
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
) -> str:
    """Write this rank's files of ``DIR/iter_XXXXXXX``; rank 0 then commits it. Call on every rank.

    ``tokenizer`` is ``{"type": ..., "files": {role: path}}``; the files are copied in.
    ``rng_state=None`` saves :func:`get_rng_state`. A failure on any rank raises
    :class:`CheckpointError` on every rank and leaves the tracker, hence the previous checkpoint,
    untouched. Returns the iteration directory.
    """
    p = current_parallel()
    t, q, d = p["tp_rank"], p["pp_rank"], p["dp_rank"]
    path = iteration_dir(save_dir, iteration)
    module = unwrap(model_chunks[0])
    config = module.config
    error, local = None, {}
    try:
        json.dumps([dict(scheduler_state or {}), dict(extra or {})])
    except (TypeError, ValueError) as err:
        raise TypeError(f"scheduler_state and extra must be JSON-serialisable: {err}") from None
    try:
        params = model_parameters(model_chunks)
        specs = specs_of_params(params.items(), p["tp"], config.make_vocab_size_divisible_by)
        os.makedirs(path, exist_ok=True)
        files, groups, grad_scaler = {}, None, None
        owner = lambda name: specs[name].owner
        owns = _ownership(specs, p)
        for file, tp_rank, keep in (
            (model_file(t, q), t, "dense"),
            (expert_file(q, p["ep_rank"]), 0, "expert"),
        ):
            mine = {n: w for n, w in params.items() if owns(n) == keep}
            if mine or (
                keep == "dense" and d == 0
            ):  # replicated over DP (an expert over expert DP): one writer
                files[file] = _write(os.path.join(path, file), mine, tp_rank, {"format": FORMAT}, owner)
        experts = any(spec.expert is not None for spec in specs.values())
        sharded = optimizer is not None and is_sharded(optimizer, p["dp"], p["edp"] if experts else 1)
        if optimizer is not None:  # unsharded state is replicated like its weights: the same writers
            state = optimizer_tensors(optimizer, params, specs, tp_rank=t, sharded=sharded, owns=owns)
            specs.update(state.specs)
            groups, grad_scaler = state.param_groups, state.grad_scaler
            if state.tensors or d == 0 or sharded:
                record = _write(
                    os.path.join(path, optim_file(t, q, d)), state.tensors, t, {"format": FORMAT}, owner
                )
                for key, (start, end) in state.flat.items():
                    record["pieces"][key]["flat"] = [start, end]
                files[optim_file(t, q, d)] = record
        tensors, skeleton = flatten_state(rng_state if rng_state is not None else get_rng_state())
        meta = {"format": FORMAT, "skeleton": skeleton}
        files[rng_file(t, q, d)] = _write(os.path.join(path, rng_file(t, q, d)), tensors, 0, meta)
        fsync_dir(path)  # the renames above are durable before rank 0 commits
        record = None
        if t == q == d == 0 and tokenizer is not None:
            record = copy_tokenizer(tokenizer["files"], path, tokenizer["type"])
        stored = {key for record in files.values() for key in record["pieces"]}
        local = {
            "files": files,
            "tensors": {n: s.to_json() for n, s in specs.items() if n in stored},
            "groups": groups,
            "grad_scaler": grad_scaler,
            "tokenizer": record,
        }
    except Exception as err:  # noqa: BLE001 -- reported on every rank by _agree, so no rank waits forever
        error = f"saving checkpoint {path} failed: {type(err).__name__}: {err}"
    _agree(error)  # doubles as the barrier: every rank's files are complete before the commit
    gathered = _gather(local)
    if t == q == d == 0:
        try:
            manifest = manifest_header(
                iteration=iteration,
                consumed_samples=consumed_samples,
                parallelism=parallelism_of(config, p["dp"]),
                config={**config.to_dict(), "context_parallel_size": 1},  # a checkpoint records no CP split
                vocab_size=module.vocab_size,
                padded_vocab_size=module.padded_vocab_size,
                max_sequence_length=module.max_sequence_length,
                tokenizer=local["tokenizer"],
            )
            manifest.update(
                tensors={n: s for g in gathered for n, s in g["tensors"].items()},
                tied=tied_tensors(config.untie_embeddings_and_output_weights),
                optimizer=_optimizer_record(optimizer, gathered),
                scheduler=None if scheduler_state is None else dict(scheduler_state),
                files={f: r for g in gathered for f, r in g["files"].items()},
                args=_json_subset(args),
                extra=dict(extra or {}),
            )
            write_manifest(save_dir, iteration, manifest)  # the tracker, the commit point, comes last
        except Exception as err:  # noqa: BLE001 -- every rank waits in _agree for rank 0's verdict
            error = f"committing checkpoint {path} failed: {type(err).__name__}: {err}"
    _agree(error)
    return path


# ------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------


def load_checkpoint(
    load_dir: str,
    *,
    model_chunks: Sequence[nn.Module],
    optimizer=None,
    iteration: int | None = None,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    verify: bool = True,
    exit_on_missing: bool = False,
) -> LoadedCheckpoint | None:
    """Restore this rank's model shards (and optimizer and RNG state) from ``load_dir``; call on every rank.

    The checkpoint may come from any TP/PP/VPP/layout/DP split. ``iteration`` is ``--ckpt-step``
    (default: the tracker's). ``finetune`` (also implied by a ``release`` checkpoint) loads weights
    only and starts at iteration 0; ``load_optim=False`` skips optimizer and scheduler state,
    ``load_rng=False`` the RNG states, ``verify=False`` the checksums. A missing or empty
    directory returns None (start from scratch) unless ``exit_on_missing``.
    """
    p = current_parallel()
    error, path, loaded = None, None, None
    try:
        path = find_checkpoint(load_dir, iteration)
        if path is None and exit_on_missing:
            raise CheckpointError(
                f"no checkpoint in {load_dir} to load (--exit-on-missing-checkpoint); the directory "
                + (
                    "holds no latest_checkpointed_iteration.txt"
                    if os.path.isdir(load_dir)
                    else "does not exist"
                )
            )
        if path is not None:
            loaded = _read_this_rank(
                Checkpoint(path, verify=verify), model_chunks, optimizer, p, load_optim, load_rng, finetune
            )
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 -- reported on every rank by _agree, so no rank waits forever
        error = f"loading checkpoint {path or load_dir} failed: {type(err).__name__}: {err}"
    _agree(error)
    if path is None:
        return None
    ckpt, optimizer_state, rng_state, finetune = loaded
    if optimizer is not None:
        optimizer.reload_model_params()
        if optimizer_state is not None:
            optimizer.load_param_state_by_name(optimizer_state)
    if rng_state is not None:
        set_rng_state(rng_state)
    ours = parallelism_of(unwrap(model_chunks[0]).config, p["dp"])
    return LoadedCheckpoint(
        path=path,
        iteration=0 if finetune else ckpt.iteration,
        consumed_samples=0 if finetune else int(ckpt.manifest.get("consumed_samples", 0)),
        scheduler_state=ckpt.manifest.get("scheduler") if (load_optim and not finetune) else None,
        manifest=ckpt.manifest,
        resharded=ours != ckpt.parallel,
        rng_restored=_sum_over_ranks(int(rng_state is not None)),
    )


def _read_this_rank(ckpt: Checkpoint, model_chunks, optimizer, p, load_optim, load_rng, finetune):
    """Copy this rank's shards into the model; return (ckpt, optimizer state dict, RNG state, finetune)."""
    finetune = finetune or os.path.basename(ckpt.path) == "release"
    load_optim, load_rng = load_optim and not finetune, load_rng and not finetune
    module = unwrap(model_chunks[0])
    check_same_model(ckpt.manifest["model"]["config"], module.config.to_dict(), ckpt.path)
    params = model_parameters(model_chunks)
    specs = specs_of_params(params.items(), p["tp"], module.config.make_vocab_size_divisible_by)
    for name, param in params.items():
        check_spec(ckpt, name, specs[name])
        source = name  # an fp32 model loading a bf16 run takes the fp32 master copy when there is one
        master = optimizer_tensor_name("main_param", name)
        if (
            param.dtype == torch.float32
            and ckpt.spec(name).dtype != torch.float32
            and ckpt.has_tensor(master)
        ):
            source = master
        with torch.no_grad():
            param.copy_(ckpt.read_shard(source, p["tp_rank"], p["tp"]))
    optimizer_state = None
    if load_optim and optimizer is not None:
        optimizer_state = read_optimizer_state(ckpt, optimizer, params, p)
    rng_state = ckpt.read_rng_state(p["tp_rank"], p["pp_rank"], p["dp_rank"]) if load_rng else None
    return ckpt, optimizer_state, rng_state, finetune

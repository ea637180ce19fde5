"""A live run's load: every rank reads its slices of a checkpoint saved at any split.

The format and the resharding live beside it in :mod:`training.checkpoint`. :func:`save_checkpoint`
(:mod:`training.checkpoint.save`) describes every parameter
(global name, full shape, TP split, owner in the layout) and stores the optimizer state by parameter
name (with the distributed optimizer, every data-parallel rank its own flat ranges of it; see
:mod:`training.checkpoint.live`), so :func:`load_checkpoint` can rebuild this rank's shards from a
checkpoint saved at another TP/PP/VPP/layout/DP, with or without the distributed optimizer: each
rank reads only the pieces that overlap its slices, optimizer state included. The fp16 loss
scaler's state goes in the manifest. Saving writes every file under a temporary name and renames
it; after a barrier rank 0 writes the manifest and then the tracker, so a crash mid-save leaves the
previous checkpoint in place. A training run saves through
:class:`~training.checkpoint.async_save.CheckpointSaver` (``--async-save`` writes in the
background). Every problem becomes one :class:`CheckpointError` naming the file (and tensor),
raised on every rank (:func:`~training.checkpoint.save.agree`) before any collective could hang.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.parallel_state import ParallelGroups
from core.tensor_parallel.fp8 import fp8_states, load_fp8_state_dict
from core.tensor_parallel.fp8_params import held_weight
from core.transformer.initialization import unstacked
from training.checkpoint.convert import parallelism_of
from training.checkpoint.files import probe_writable, remove_stale_temp_files
from training.checkpoint.format import CheckpointError, optimizer_tensor_name
from training.checkpoint.live import (
    RankSplit,
    check_spec,
    checkpoint_tensors,
    model_parameters,
    read_optimizer_state,
    unwrap,
)
from training.checkpoint.reader import Checkpoint, complete_checkpoints, find_checkpoint, read_tracker
from training.checkpoint.rng import get_rng_state, set_rng_state
from training.checkpoint.save import agree, save_checkpoint
from training.checkpoint.specs import check_same_model, specs_of_params
from training.faults.agreement import distributed, gather, sum_over_ranks
from training.reporting.logging_utils import print_rank_0

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "RankSplit",
    "get_rng_state",
    "load_checkpoint",
    "model_parameters",
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


def prepare_save_dir(save_dir: str) -> list[str]:
    """At startup: check ``--save`` is a writable directory (a write probe on every rank), then delete the
    temporary files of killed saves (rank 0); complete checkpoints are never touched. Returns the
    files removed."""
    error, removed = None, []
    try:
        probe_writable(save_dir)
    except CheckpointError as err:
        error = str(err)
    agree(error)  # every probe is done before rank 0 looks for stale temporary files
    if not distributed() or dist.get_rank() == 0:
        try:
            removed = remove_stale_temp_files(save_dir)
        except OSError as err:
            error = f"cannot clean temporary files of interrupted saves in --save {save_dir}: {err}"
    agree(error)
    return removed


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
    groups: ParallelGroups | None = None,
    fall_back: bool = False,
) -> LoadedCheckpoint | None:
    """Restore this rank's model shards (and optimizer and RNG state) from ``load_dir``; call on every rank.

    The checkpoint may come from any TP/PP/VPP/layout/DP split. ``iteration`` is ``--ckpt-step``
    (default: the tracker's). ``finetune`` (also implied by a ``release`` checkpoint) loads weights
    only and starts at iteration 0; ``load_optim=False`` skips optimizer and scheduler state,
    ``load_rng=False`` the RNG states, ``verify=False`` the checksums. A missing or empty
    directory returns None (start from scratch) unless ``exit_on_missing``. ``groups``: the run's
    process groups (see :meth:`RankSplit.of` for None). ``fall_back`` (a torchrun restart, with no one
    to ask): when the latest checkpoint cannot be loaded, say why and load the previous complete one.
    """
    p = RankSplit.of(groups)
    for chunk in model_chunks:  # ZeRO-3 gathers: weights are read into whole parameters, then kept (a
        getattr(chunk, "finish_param_sync", lambda: None)()  # collective, before anything can fail)
    path, error = _locate(load_dir, iteration, exit_on_missing)
    while True:
        loaded = None
        if error is None and path is not None:
            loaded, error = _read_or_error(
                path, verify, model_chunks, optimizer, p, load_optim, load_rng, finetune
            )
        try:
            agree(error)
            break
        except CheckpointError as err:
            if not fall_back or iteration is not None:
                raise
            path, error = _previous(err, load_dir, path), None
    if path is None:
        for chunk in model_chunks:
            getattr(chunk, "keep_gathered_params", lambda: None)()
        return None
    ckpt, optimizer_state, rng_state, fp8_saved, finetune = loaded
    _apply_states(model_chunks, optimizer, optimizer_state, rng_state, fp8_saved)
    ours = parallelism_of(unwrap(model_chunks[0]).config, p.dp)
    return LoadedCheckpoint(
        path=path,
        iteration=0 if finetune else ckpt.iteration,
        consumed_samples=0 if finetune else int(ckpt.manifest.get("consumed_samples", 0)),
        scheduler_state=ckpt.manifest.get("scheduler") if (load_optim and not finetune) else None,
        manifest=ckpt.manifest,
        resharded=ours != ckpt.parallel,
        rng_restored=sum_over_ranks(int(rng_state is not None)),
    )


def _locate(load_dir: str, iteration: int | None, exit_on_missing: bool) -> tuple[str | None, str | None]:
    """(the directory to load or None, this rank's error or None)."""
    try:
        return _find(load_dir, iteration, exit_on_missing), None
    except CheckpointError as err:
        return None, str(err)


def _read_or_error(path: str, verify: bool, *args) -> tuple[tuple | None, str | None]:
    """(what this rank read from ``path``, None), or (None, why it could not): every error becomes a
    message, which ``agree`` reports on every rank, so that no rank waits forever."""
    try:
        return _read_this_rank(Checkpoint(path, verify=verify), *args), None
    except CheckpointError as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001
        return None, f"loading checkpoint {path} failed: {type(err).__name__}: {err}"


def _previous(err: CheckpointError, load_dir: str, path: str | None) -> str:
    """The complete checkpoint before ``path`` (before none: the latest), once it is said why ``path``
    could not be loaded; ``err`` again when there is none."""
    earlier = complete_checkpoints(load_dir, _iteration_of(path))
    if not earlier:
        raise err
    print_rank_0(f"{err}; falling back to {earlier[0]}, the previous complete checkpoint")
    return earlier[0]


def _iteration_of(path: str | None) -> int | None:
    """The iteration of directory ``iter_0000100`` (None: any, e.g. when the tracker itself is corrupt)."""
    digits = os.path.basename(path or "").removeprefix("iter_")
    return int(digits) if digits.isdigit() else None


def _find(load_dir: str, iteration: int | None, exit_on_missing: bool) -> str | None:
    """The iteration directory to load, or None to start afresh (error: --exit-on-missing-checkpoint)."""
    path = find_checkpoint(load_dir, iteration)
    if path is None and exit_on_missing:
        raise CheckpointError(
            f"no checkpoint in {load_dir} to load (--exit-on-missing-checkpoint); the directory "
            + ("holds no latest_checkpointed_iteration.txt" if os.path.isdir(load_dir) else "does not exist")
        )
    return path


def _apply_states(
    model_chunks, optimizer, optimizer_state: dict | None, rng_state: dict | None, fp8_saved: dict
) -> None:
    """After every rank read its shards: refresh the optimizer's weights, restore its state, the RNG
    and the FP8 amax histories saved beside it (by module name; a layer with none starts afresh)."""
    for chunk in model_chunks:  # ZeRO-3: this rank's shard of the loaded weights, the rest freed
        getattr(chunk, "keep_gathered_params", lambda: None)()
    if optimizer is not None:
        optimizer.reload_model_params()
        if optimizer_state is not None:
            optimizer.load_param_state_by_name(optimizer_state)
    # Every rank's changed lengths, said once by rank 0, which may hold no FP8 layer (the first stage
    # under --first-last-layers-bf16).
    changed = {pair for pair in load_fp8_state_dict(model_chunks, fp8_saved) if pair[0] != pair[1]}
    for saved, length in sorted(set().union(*gather(changed))):
        kept = f"the {length} most recent kept" if saved > length else f"all {saved} kept, the rest zero"
        print_rank_0(
            f"FP8: the checkpoint's amax histories hold {saved} steps and --fp8-amax-history-len is "
            f"{length}: {kept}; the scales are computed from them"
        )
    if rng_state is not None:
        set_rng_state(rng_state)


def _read_this_rank(ckpt: Checkpoint, model_chunks, optimizer, p: RankSplit, load_optim, load_rng, finetune):
    """Copy this rank's shards into the model; return (ckpt, optimizer state dict, RNG state, the saved
    FP8 states, finetune)."""
    finetune = finetune or os.path.basename(ckpt.path) == "release"
    load_optim, load_rng = load_optim and not finetune, load_rng and not finetune
    module = unwrap(model_chunks[0])
    check_same_model(ckpt.manifest["model"]["config"], module.config.to_dict(), ckpt.path)
    params = model_parameters(model_chunks)
    tensors = checkpoint_tensors(params)  # a stacked expert parameter as views of its slices
    specs = specs_of_params(tensors.items(), p.tp, module.config.make_vocab_size_divisible_by)
    held = _held_tensors(params)
    for name, param in tensors.items():
        check_spec(ckpt, name, specs[name])
        # An fp32 model, or a weight held in FP8, loading a 16-bit run takes the fp32 master copy when
        # there is one; a weight held in FP8 keeps the values for the optimizer, which casts them.
        source = name
        master = optimizer_tensor_name("main_param", name)
        if (
            (param.dtype == torch.float32 or name in held)
            and ckpt.spec(name).dtype != torch.float32
            and ckpt.has_tensor(master)
        ):
            source = master
        value = ckpt.read_shard(source, p.tp_rank, p.tp)
        if name in held:
            _keep_for_the_optimizer(*held[name], value)
            continue
        with torch.no_grad():
            param.copy_(value)
    optimizer_state = None
    if load_optim and optimizer is not None:
        optimizer_state = read_optimizer_state(ckpt, optimizer, params, p)
    rng_state = ckpt.read_rng_state(p.tp_rank, p.pp_rank, p.dp_rank) if load_rng else None
    states = [state for _, state in fp8_states(model_chunks)]
    fp8_saved = _saved_fp8_states(ckpt, any(s.expert for s in states)) if states and not finetune else {}
    return ckpt, optimizer_state, rng_state, fp8_saved, finetune


def _held_tensors(params: dict[str, nn.Parameter]) -> dict[str, tuple[nn.Parameter, int | None]]:
    """Each checkpoint tensor of a weight held in FP8, by name: the weight, and which expert of a held
    stack it is (None: the whole weight)."""
    out = {}
    for name, param in params.items():
        if held_weight(param) is not None:
            pieces = unstacked(name, param)
            stacked = len(pieces) > 1 or pieces[0][0] != name
            out.update({logical: (param, i if stacked else None) for i, (logical, _) in enumerate(pieces)})
    return out


def _keep_for_the_optimizer(param: nn.Parameter, expert: int | None, value: torch.Tensor) -> None:
    """A held weight's loaded values (expert ``expert``'s of a stack), kept for the optimizer, which
    takes them as its main copy and casts them (``Fp8Weight.high_precision``)."""
    meta = held_weight(param)
    value = value.to(param.device)
    if expert is None:
        meta.high_precision = value
        return
    if meta.high_precision is None or meta.high_precision.dtype != value.dtype:
        meta.high_precision = torch.empty(param.shape, dtype=value.dtype, device=param.device)
    meta.high_precision[expert].copy_(value)


def _saved_fp8_states(ckpt: Checkpoint, experts: bool) -> dict:
    """The delayed FP8 recipe's histories of every saving pipeline rank, by module name (with or without
    ``--no-load-rng``: they are training state, not randomness). A dense layer's are the same on every TP,
    DP and CP rank (reduced over that group), so the first TP and DP rank's file of each pipeline rank
    holds them all; routed experts live on other tensor- and data-parallel ranks, so with experts every
    rank's file is read (PP x TP x DP small files). A load at another split finds each layer's by name."""
    saved: dict = {}
    for pp_rank in range(ckpt.parallel.pp):
        for tp_rank in range(ckpt.parallel.tp if experts else 1):
            for dp_rank in range(ckpt.parallel.dp if experts else 1):
                state = ckpt.read_rng_state(tp_rank, pp_rank, dp_rank) or {}
                saved.update({fp8_state_name(k): v for k, v in state.get("fp8", {}).items()})
    return saved


_UNSTACKED_FP8 = re.compile(r"\.local_experts\.(\d+)\.(linear_fc[12])\.fp8_state\.")


def fp8_state_name(saved: str) -> str:
    """Today's name of a saved FP8 state: an expert's, saved before experts were stacked as
    ``...experts.local_experts.{e}.linear_fc1.fp8_state.*``, is ``...experts.linear_fc1.fp8_state.{e}.*``."""
    return _UNSTACKED_FP8.sub(r".\2.fp8_state.\1.", saved)

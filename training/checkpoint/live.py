"""A live run's model and optimizer by name: what a checkpoint stores, and back.

The optimizer's own state dict numbers parameters in group order (torch's convention), which
depends on the split; the checkpoint stores each state under ``optimizer.state.<key>.<parameter
name>`` instead, split over TP like its parameter, so it reshards with the weights. Every optimizer
flavour exports its state through ``param_state_by_name()`` (:mod:`core.optimizer.param_state`):
per parameter name, the flat range ``[start, end)`` of the TP-local tensor it steps, that range of
every per-element state (``exp_avg``, ``exp_avg_sq``, and ``main_param``, the fp32 master copy of
a 16-bit parameter) and the per-parameter scalars (``step``). Saving writes it in one of two forms:

* an unsharded optimizer (every data-parallel rank holds the same state): DP rank 0 writes each
  state shaped like its TP shard, one whole piece per TP rank, in ``optim_tp{t}_pp{p}_dp0``;
* the distributed optimizer (ZeRO-1) at DP > 1: every DP rank ``d`` writes its own ranges, 1-D,
  in ``optim_tp{t}_pp{p}_dp{d}``, each piece tagged ``"flat": [start, end]`` in the manifest; a
  scalar goes once, from the rank whose range starts at the parameter's first element. The
  ranges of all DP ranks tile each TP shard, so each file holds 1/DP of the state (give or take
  a bucket's padding).

Loading is the same for both: each rank asks :meth:`Checkpoint.read_flat_range` for exactly the
ranges its optimizer steps (the whole TP shard, unless it is a distributed optimizer), which the
reader cuts from whatever pieces overlap them, after resharding over TP if the TP size changed;
:func:`read_optimizer_state` hands them over in ``param_state_by_name`` form. So a checkpoint
loads at any DP (and TP/PP) size, with or without the distributed optimizer. The loss scaler's
state (fp16) is saved in the manifest beside the parameter groups.

A rank's MoE experts are one stacked parameter per projection; the checkpoint stores each slice
under its expert's own name (:func:`checkpoint_tensors`), and their optimizer state too: a flat range
of the stacked parameter is cut at the slices' borders (:func:`unstacked_entries`), and joined again
on load (:func:`slice_ranges`), so experts reshard over EP by name as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core import parallel_state as ps
from core.parallel_state import ParallelGroups
from core.transformer.initialization import logical_tensors, unstacked
from training.checkpoint.format import (
    CheckpointError,
    TensorSpec,
    optimizer_tensor_name,
    split_optimizer_tensor_name,
)
from training.checkpoint.reader import Checkpoint

__all__ = [
    "OptimizerTensors",
    "RankSplit",
    "check_spec",
    "checkpoint_tensors",
    "is_sharded",
    "merge_param_groups",
    "model_parameters",
    "optimizer_tensors",
    "read_optimizer_state",
    "slice_ranges",
    "unstacked_entries",
    "unwrap",
]


@dataclass(frozen=True, kw_only=True)
class RankSplit:
    """Where this rank sits in the split a checkpoint is saved or loaded at.

    ``dp`` counts DP x CP: context-parallel ranks hold the same weights, the distributed optimizer
    shards over all of them, and a checkpoint records no CP split. ``edp`` is the expert
    data-parallel size (the replicas of this rank's experts)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    edp: int = 1
    edp_rank: int = 0

    @classmethod
    def of(cls, groups: ParallelGroups | None) -> RankSplit:
        """The split ``groups`` describe; None: Megatron's global groups if they are set up (callers
        that do not hand theirs in), else a world of one."""
        groups = ps.groups_or_default(groups)
        if groups is None:
            return cls()
        found: dict[str, int] = {}
        for field, name in (("tp", "tp"), ("pp", "pp"), ("dp", "dp_cp"), ("ep", "ep"), ("edp", "expt_dp")):
            found[field], found[f"{field}_rank"] = groups.size(name), groups.rank_in(name)
        return cls(**found)

    @property
    def first(self) -> bool:
        """The job's first rank of every model-parallel and data-parallel group (it commits a save)."""
        return self.tp_rank == self.pp_rank == self.dp_rank == 0


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside a data-parallel wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def model_parameters(model_chunks: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    """This rank's parameters by global name, each once (virtual chunks merged)."""
    params: dict[str, nn.Parameter] = {}
    for chunk in model_chunks:
        for name, param in unwrap(chunk).named_parameters():
            if name in params and params[name] is not param:
                raise RuntimeError(f"two model chunks on this rank both hold {name!r}")
            params[name] = param
    return params


PARAM_STATE_FIELDS = ("start", "end", "numel", "shape")
"""Keys of a ``param_state_by_name`` entry that describe its range rather than hold state."""


def is_sharded(optimizer, dp_size: int, expert_dp_size: int = 1) -> bool:
    """Whether each data-parallel rank holds only its own part of the optimizer state (the distributed
    optimizer shards dense parameters over DP and MoE experts over expert DP)."""
    distributed = bool(getattr(optimizer.config, "use_distributed_optimizer", False))
    return distributed and max(dp_size, expert_dp_size) > 1


@dataclass
class OptimizerTensors:
    """What one rank writes of the optimizer state, by logical name (see the module docstring)."""

    tensors: dict[str, torch.Tensor]
    specs: dict[str, TensorSpec]
    flat: dict[str, tuple[int, int]]
    """The range ``[start, end)`` of the TP shard that each 1-D piece holds (distributed optimizer)."""
    param_groups: list[dict]
    grad_scaler: dict | None


def optimizer_tensors(
    optimizer,
    params: Mapping[str, nn.Parameter],
    specs: Mapping[str, TensorSpec],
    *,
    tp_rank: int,
    sharded: bool,
    owns: Callable[[str], object] | None = None,
) -> OptimizerTensors:
    """This rank's optimizer state to write: whole TP shards, or (``sharded``) its own flat ranges,
    as views of the live state (nothing is copied; see :mod:`training.checkpoint.staging`).

    Unsharded, the state follows the weights: ``owns(name)`` says whether this rank writes them
    (default: TP rank 0 for a TP-replicated parameter; the caller picks the data-parallel rank).
    Sharded, every data-parallel rank writes its own ranges, a TP-replicated parameter's on TP rank
    0 only; an MoE expert (never TP-split: other TP ranks hold other experts) on every rank holding a
    range of it. A scalar state goes once: from the rank whose range starts at element 0, on TP rank
    0 unless it is an expert's. ``params`` are the model's parameters (:func:`model_parameters`);
    ``specs`` are by checkpoint name, a stacked parameter's state going under each expert's
    (:func:`unstacked_entries`).
    """
    state = optimizer.param_state_by_name(copy=False)
    out = OptimizerTensors({}, {}, {}, [], state.get("grad_scaler"))
    for name, entry in state["params"].items():
        if name not in params:
            raise CheckpointError(
                f"the optimizer steps a parameter '{name}' that the model chunks do not hold"
            )
        for logical, piece in unstacked_entries(name, entry, params[name]):
            _add_state(out, logical, piece, specs[logical], tp_rank=tp_rank, sharded=sharded, owns=owns)
    out.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    return out


def _add_state(
    out: OptimizerTensors,
    name: str,
    entry: dict,
    spec: TensorSpec,
    *,
    tp_rank: int,
    sharded: bool,
    owns: Callable[[str], object] | None,
) -> None:
    """What this rank writes of tensor ``name``'s state (its ``param_state_by_name`` entry), into ``out``."""
    start, end = entry["start"], entry["end"]
    whole_on_every_tp_rank = spec.partition is None and spec.expert is None
    if owns is not None and not sharded:
        if not owns(name):
            return
    elif whole_on_every_tp_rank and tp_rank != 0:
        return
    for key, value in entry.items():
        if key in PARAM_STATE_FIELDS or not isinstance(value, torch.Tensor):
            continue
        logical = optimizer_tensor_name(key, name)
        if value.dim() == 0:  # replicated over TP and DP: written once
            if start == 0 and (tp_rank == 0 or spec.expert is not None):
                out.tensors[logical] = value
                out.specs[logical] = TensorSpec((), value.dtype, None, spec.owner, spec.expert)
            continue
        if value.dim() != 1 or value.numel() != end - start:
            raise CheckpointError(
                f"optimizer state '{key}' of parameter '{name}' has shape {tuple(value.shape)}, neither "
                f"one value per element of its range [{start}, {end}) nor a scalar: cannot say how it "
                "is split"
            )
        out.specs[logical] = dataclasses.replace(spec, dtype=value.dtype)
        if sharded:
            out.tensors[logical], out.flat[logical] = value, (start, end)
        else:
            out.tensors[logical] = value.view(entry["shape"])


def checkpoint_tensors(params: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores, by name: every parameter, a stacked one (MoE experts) as its
    slices under each expert's own name (views: copying into one loads the parameter)."""
    return dict(logical_tensors(params.items()))


def slice_ranges(name: str, param: torch.Tensor, start: int, end: int) -> list[tuple[str, int, int, int]]:
    """The checkpoint tensors that the flat range ``[start, end)`` of parameter ``name`` covers, each as
    ``(its name, start and end in it, where it starts in [start, end))``: the parameter itself, or the
    slices of a stacked one that the range meets."""
    pieces = unstacked(name, param)
    size = pieces[0][1].numel()
    out = []
    for i, (logical, _) in enumerate(pieces):
        lo, hi = max(start, i * size), min(end, (i + 1) * size)
        if lo < hi:
            out.append((logical, lo - i * size, hi - i * size, lo - start))
    return out


def unstacked_entries(name: str, entry: dict, param: torch.Tensor) -> list[tuple[str, dict]]:
    """A ``param_state_by_name`` entry by checkpoint tensor: itself, or one per expert of a stacked
    parameter that its range meets (views; a per-parameter scalar such as ``step`` goes with each)."""
    start, end = entry["start"], entry["end"]
    ranges = slice_ranges(name, param, start, end)
    if len(ranges) == 1 and ranges[0][0] == name:
        return [(name, entry)]
    shape, out = list(param.shape[1:]), []
    for logical, lo, hi, offset in ranges:
        piece: dict[str, Any] = {"start": lo, "end": hi, "numel": math.prod(shape), "shape": shape}
        for key, value in entry.items():
            if key in PARAM_STATE_FIELDS or not isinstance(value, torch.Tensor):
                continue
            per_element = value.dim() == 1 and value.numel() == end - start
            piece[key] = value[offset : offset + hi - lo] if per_element else value
        out.append((logical, piece))
    return out


def merge_param_groups(per_rank: list[list[dict]]) -> dict[str, Any] | None:
    """Optimizer hyperparameters per (wd_mult, lr_mult) group, from whichever ranks have the group."""
    if not per_rank:
        return None
    merged: dict[tuple, dict] = {}
    for groups in per_rank:
        for group in groups:
            merged.setdefault((group.get("wd_mult"), group.get("lr_mult")), group)
    return {"param_groups": list(merged.values())}


def check_spec(ckpt: Checkpoint, name: str, ours: TensorSpec) -> None:
    """Raise unless the checkpoint has ``name`` with the model's full shape and split."""
    if not ckpt.has_tensor(name):
        raise CheckpointError(f"checkpoint {ckpt.path} has no tensor '{name}', which the model has")
    saved = ckpt.spec(name)
    if (saved.shape, saved.partition) != (ours.shape, ours.partition):
        raise CheckpointError(
            f"checkpoint {ckpt.path}: tensor '{name}' has full shape {saved.shape} split {saved.partition} "
            f"in the checkpoint but {ours.shape} split {ours.partition} in the model"
            + _vocabulary_hint(name, saved, ours)
        )


def _vocabulary_hint(name: str, saved: TensorSpec, ours: TensorSpec) -> str:
    """For a word embedding or output layer that differs in its rows only: the tokenizers differ."""
    vocabulary = name.endswith(("word_embeddings.weight", "output_layer.weight"))
    if not vocabulary or saved.shape[1:] != ours.shape[1:]:
        return ""
    return (
        f": the checkpoint's vocabulary has {saved.shape[0]} token ids and this run's tokenizer "
        f"{ours.shape[0]}; use the checkpoint's tokenizer (--use-checkpoint-args takes it), or with "
        f"--tokenizer-type NullTokenizer (N + 1 ids) --vocab-size {saved.shape[0] - 1}"
    )


def read_optimizer_state(
    ckpt: Checkpoint, optimizer, params: Mapping[str, nn.Parameter], p: RankSplit
) -> dict:
    """This rank's optimizer state from the checkpoint, for ``optimizer.load_param_state_by_name``.

    Each entry holds exactly the range the optimizer steps on this rank (a stacked parameter's joined
    from its experts' tensors). A 16-bit parameter with no saved master copy takes it from fp32
    weights (an fp32 run's); otherwise it keeps the copy ``reload_model_params`` made of the loaded
    weights.
    """
    saved = ckpt.manifest.get("optimizer")
    if saved is None:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds no optimizer state; pass --no-load-optim or --finetune "
            "to load only the weights"
        )
    keys = sorted({split[0] for n in ckpt.specs if (split := split_optimizer_tensor_name(n)) is not None})
    names = {id(param): name for name, param in params.items()}
    entries = {}
    for shard in optimizer.shards:
        name = names.get(id(shard.model_param))
        if name is None:
            raise CheckpointError(
                f"the optimizer steps a parameter '{shard.name}' that the model chunks do not hold"
            )
        param = shard.model_param
        entry: dict[str, Any] = {
            "start": shard.start,
            "end": shard.end,
            "numel": param.numel(),
            "shape": list(param.shape),
        }
        entry.update(_saved_state(ckpt, keys, slice_ranges(name, param, shard.start, shard.end), param, p))
        entries[shard.name] = entry
    by_kind = {(g.get("wd_mult"), g.get("lr_mult")): g for g in saved.get("param_groups") or []}
    groups = [
        {k: v for k, v in g.items() if k != "params"} | by_kind.get((g.get("wd_mult"), g.get("lr_mult")), {})
        for g in optimizer.param_groups
    ]
    return {"param_groups": groups, "params": entries, "grad_scaler": saved.get("grad_scaler")}


def _saved_state(
    ckpt: Checkpoint,
    keys: list[str],
    ranges: list[tuple[str, int, int, int]],
    param: torch.Tensor,
    p: RankSplit,
) -> dict[str, torch.Tensor]:
    """The saved state of one range of ``param``, which covers the checkpoint tensors ``ranges``
    (:func:`slice_ranges`): per-element state joined over them, a scalar from the first."""

    def read(key: str | None) -> torch.Tensor:
        pieces = [
            ckpt.read_flat_range(
                name if key is None else optimizer_tensor_name(key, name), p.tp_rank, p.tp, lo, hi
            )
            for name, lo, hi, _ in ranges
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    first = ranges[0][0]
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        logical = optimizer_tensor_name(key, first)
        if not ckpt.has_tensor(logical) or (key == "main_param" and param.dtype == torch.float32):
            continue  # an fp32 parameter is its own master copy, loaded with the weights
        per_element = ckpt.spec(logical).shape == ckpt.spec(first).shape
        out[key] = read(key) if per_element else ckpt.read_shard(logical)
    if "main_param" not in out and param.dtype != torch.float32 and ckpt.spec(first).dtype == torch.float32:
        out["main_param"] = read(None)  # an fp32 run's weights
    return out

"""A live run's model and optimizer by name: what a checkpoint stores, and back.

The optimizer's own state dict numbers parameters in group order (torch's convention), which
depends on the split; the checkpoint stores each state under ``optimizer.state.<key>.<parameter
name>`` instead, split like its parameter, so it reshards with the weights. These helpers convert
between the two through the optimizer's public API (``param_groups``, ``get_main_param``).

The distributed optimizer (ZeRO-1) plugs in here. Its ``param_state_by_name()`` gives, per
parameter name, the flat range ``[start, end)`` of the TP-local tensor that this data-parallel rank
owns, with that range of every per-element state (``exp_avg``, ``exp_avg_sq``, ``main_param``).
Saving it means: every DP rank ``d`` writes its ranges to ``optim_tp{t}_pp{p}_dp{d}.safetensors``
(1-D tensors under the same logical names) and tags each piece in the manifest with
``"flat": [start, end]`` besides its ``tp_rank``; scalar states (``step``) go once, from DP rank 0.
Loading at any DP size is :meth:`Checkpoint.read_flat_range` of the rank's own range, which the
reader assembles from whatever pieces overlap it, after resharding over TP if the TP size changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from training.checkpoint.format import (
    CheckpointError,
    TensorSpec,
    optimizer_tensor_name,
    split_optimizer_tensor_name,
)
from training.checkpoint.reader import Checkpoint
from training.checkpoint.specs import optimizer_tensor_spec

__all__ = [
    "check_spec",
    "merge_param_groups",
    "model_parameters",
    "optimizer_tensors",
    "read_optimizer_state",
    "unwrap",
]


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


def param_names_by_index(optimizer, params: Mapping[str, nn.Parameter]) -> list[str]:
    """The parameter name of every index in the optimizer's state dict (torch numbers them group by group)."""
    by_main = {}
    for name, param in params.items():
        try:
            by_main[id(optimizer.get_main_param(param))] = name
        except KeyError:
            continue  # not optimised (requires_grad=False)
    return [by_main[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_tensors(optimizer, params, specs) -> tuple[dict[str, torch.Tensor], dict, list[dict]]:
    """The optimizer's state keyed by logical name, their specs, and its param groups (JSON)."""
    state = optimizer.state_dict()
    names = param_names_by_index(optimizer, params)
    tensors, tensor_specs = {}, {}
    for key, value in state["state"].items():
        index, state_key = key.split(".", 1)
        name = names[int(index)]
        logical, spec = optimizer_tensor_spec(state_key, name, value, params[name], specs[name])
        tensors[logical], tensor_specs[logical] = value, spec
    groups = [{k: v for k, v in g.items() if k != "num_params"} for g in state["param_groups"]]
    return tensors, tensor_specs, groups


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
        )


def read_optimizer_state(
    ckpt: Checkpoint, optimizer, params: Mapping[str, nn.Parameter], p: Mapping[str, int]
) -> dict:
    """The optimizer's own (index-keyed) state dict, rebuilt from the checkpoint's name-keyed tensors."""
    saved = ckpt.manifest.get("optimizer")
    if saved is None:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds no optimizer state; pass --no-load-optim or --finetune "
            "to load only the weights"
        )
    keys = sorted({split_optimizer_tensor_name(n)[0] for n in ckpt.specs if split_optimizer_tensor_name(n)})
    state = {}
    for index, name in enumerate(param_names_by_index(optimizer, params)):
        for key in keys:
            logical = optimizer_tensor_name(key, name)
            if ckpt.has_tensor(logical):
                state[f"{index}.{key}"] = ckpt.read_shard(logical, p["tp_rank"], p["tp"])
        separate_main = optimizer.get_main_param(params[name]) is not params[name]
        if separate_main and f"{index}.main_param" not in state and ckpt.spec(name).dtype == torch.float32:
            state[f"{index}.main_param"] = ckpt.read_shard(
                name, p["tp_rank"], p["tp"]
            )  # an fp32 run's weights
    by_kind = {(g.get("wd_mult"), g.get("lr_mult")): g for g in saved["param_groups"]}
    groups = []
    for group in optimizer.param_groups:
        current = {k: v for k, v in group.items() if k != "params"}
        restored = by_kind.get((group.get("wd_mult"), group.get("lr_mult")), {})
        groups.append(current | restored | {"num_params": len(group["params"])})
    return {"param_groups": groups, "state": state}

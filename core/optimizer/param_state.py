"""Optimizer state per parameter name, as flat ranges of each TP-local parameter: independent of DP.

A checkpoint should not care how data parallelism cut the optimizer state, so this is the form it
is exported in::

    {
      "param_groups": [{"lr": ..., "weight_decay": ..., "betas": [..], ..., "params": [names]}],
      "params": {
        "decoder.layers.0.mlp.linear_fc1.weight": {
          "start": 0, "end": 4096,           # the flat range [start, end) of the TP-local tensor
          "numel": 8192, "shape": [64, 128], # the whole TP-local tensor
          "exp_avg": Tensor[end - start], "exp_avg_sq": Tensor[end - start],  # per-element state
          "step": Tensor[],                  # per-parameter state, as the inner optimizer keeps it
          "main_param": Tensor[end - start], # fp32 main copy, only for 16-bit parameters
        },
        ...
      },
      "grad_scaler": {"scale": ..., ...},   # with loss scaling only
    }

A non-distributed optimizer exports every parameter whole (``start = 0, end = numel``); the
distributed optimizer exports this data-parallel rank's ranges. Loading takes entries whose range
*covers* this rank's (equal, or larger, e.g. the ranges of several ranks joined), so state saved
at one DP size loads at another once the ranges are joined or cut. Per-element tensors are 1-D;
they take the main parameter's shape again on load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from core.optimizer.optimizer import MegatronOptimizer


def _check_unique(optimizer: MegatronOptimizer) -> None:
    seen: set[str] = set()
    for shard in optimizer._shards:
        if shard.name in seen:
            raise ValueError(
                f"two parameters are both named {shard.name!r}: per-name optimizer state needs unique "
                "names across the model chunks"
            )
        seen.add(shard.name)


def export_param_state(optimizer: MegatronOptimizer) -> dict:
    """``optimizer``'s state per parameter name (see the module docstring); tensors are copies."""
    _check_unique(optimizer)
    by_main = {id(s.main_param): s for s in optimizer._shards}
    groups = []
    for group in optimizer.optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append(hyper | {"params": [by_main[id(p)].name for p in group["params"]]})
    params = {}
    for shard in optimizer._shards:
        main = shard.main_param
        entry: dict = {
            "start": shard.start,
            "end": shard.end,
            "numel": shard.model_param.numel(),
            "shape": list(shard.model_param.shape),
        }
        for key, value in optimizer.optimizer.state.get(main, {}).items():
            if isinstance(value, torch.Tensor):
                per_element = value.numel() == main.numel() and value.dim() > 0
                entry[key] = value.detach().reshape(-1).clone() if per_element else value.detach().clone()
        if shard.copy:
            entry["main_param"] = main.detach().reshape(-1).clone()
        params[shard.name] = entry
    out = {"param_groups": groups, "params": params}
    if optimizer.grad_scaler is not None:
        out["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return out


def import_param_state(optimizer: MegatronOptimizer, state: dict) -> None:
    """Load :func:`export_param_state` output into ``optimizer``: each of its shards takes its range."""
    _check_unique(optimizer)
    saved_groups, groups = state["param_groups"], optimizer.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"optimizer state has {len(saved_groups)} parameter groups, this optimizer {len(groups)}"
        )
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    for shard in optimizer._shards:
        entry = state["params"].get(shard.name)
        if entry is None:
            raise ValueError(f"optimizer state has no entry for parameter {shard.name!r}")
        if entry["numel"] != shard.model_param.numel() or not (
            entry["start"] <= shard.start and shard.end <= entry["end"]
        ):
            raise ValueError(
                f"optimizer state for {shard.name!r} covers [{entry['start']}, {entry['end']}) of "
                f"{entry['numel']} elements; this rank needs [{shard.start}, {shard.end}) of "
                f"{shard.model_param.numel()}"
            )
        lo, hi = shard.start - entry["start"], shard.end - entry["start"]
        main = shard.main_param
        per_param = {}
        for key, value in entry.items():
            if key in ("start", "end", "numel", "shape") or not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 1 and value.numel() == entry["end"] - entry["start"]:
                value = value[lo:hi].reshape(main.shape)
                value = value.to(device=main.device, dtype=main.dtype if key == "main_param" else value.dtype)
            per_param[key] = value.clone()
        if "main_param" in per_param:
            with torch.no_grad():
                main.copy_(per_param.pop("main_param"))
        loaded[id(main)] = per_param
    for group, saved in zip(groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    inner_state = optimizer.optimizer.state
    fused = optimizer.fused  # torch's fused kernels keep the step count on the device, foreach on the host
    for shard in optimizer._shards:
        per_param = loaded[id(shard.main_param)]
        if per_param:
            inner_state[shard.main_param] = {
                k: v.to(shard.main_param.device) if v.dim() or fused else v for k, v in per_param.items()
            }
        else:
            inner_state.pop(shard.main_param, None)
    if optimizer.grad_scaler is not None and state.get("grad_scaler") is not None:
        optimizer.grad_scaler.load_state_dict(state["grad_scaler"])

"""Optimizer state per parameter name, as flat ranges of each TP-local parameter: independent of DP.

What an optimizer steps is a list of :class:`ParamShard` records (a range of a parameter and the
tensor stepped for it); the functions here take those records, the inner torch optimizer and the
grad scaler as arguments, so they need nothing private of :mod:`core.optimizer.optimizer`.

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
          "main_param": Tensor[end - start], # fp32 main copy, only for 16-bit parameters stepped in fp32
        },
        ...
      },
      "grad_scaler": {"scale": ..., ...},   # with loss scaling only
    }

Exporting with ``copy=False`` gives views of the live state instead of copies: a checkpoint stages
them into host memory itself, so saving allocates no device memory (cloning the state on the
device cost 12 bytes per parameter, an out-of-memory at the first save of a large model). Loading
copies into the state tensors the optimizer already holds, for the same reason.

A non-distributed optimizer exports every parameter whole (``start = 0, end = numel``); the
distributed optimizer exports this data-parallel rank's ranges. Loading takes entries whose range
*covers* this rank's (equal, or larger, e.g. the ranges of several ranks joined), so state saved
at one DP size loads at another once the ranges are joined or cut. Per-element tensors are 1-D;
they take the main parameter's shape again on load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(eq=False)
class ParamShard:
    """The part ``[start, end)`` of a flattened model parameter that an optimizer steps, and how.

    ``main_param`` is the tensor the inner optimizer steps on: the model parameter itself (fp32
    models), an fp32 copy (``copy=True``: 16-bit models), or a view of the parameter's range (fp32
    parameters under the distributed optimizer). A 16-bit model whose ``main_params_dtype`` is its own
    dtype is stepped as an fp32 one is: on the parameter, or a view of its range.
    """

    name: str
    model_param: nn.Parameter
    main_param: torch.Tensor
    start: int
    end: int
    copy: bool
    param_view: torch.Tensor | None = None
    """Where this range of the model's values lives when not in the parameter itself (ZeRO-3's
    persistent shard, or ZeRO-2's); None: in the parameter."""
    grad_view: torch.Tensor | None = None
    """Where this range's reduced gradient lives when not in ``main_grad`` (ZeRO-2/3's reduced shard)."""
    held_in_fp8: bool = False
    """The model holds this range in FP8 (``--fp8-param-gather``): the optimizer casts ``main_param`` into
    it with the weight's scale (:func:`core.tensor_parallel.fp8_params.cast_held_weights`), never copies."""

    def model_grad(self) -> torch.Tensor | None:
        """The model's reduced gradient of this range (``main_grad`` if any, else ``.grad``), shaped as main."""
        if self.grad_view is not None:
            return self.grad_view.view_as(self.main_param)
        grad = getattr(self.model_param, "main_grad", None)
        if grad is None:
            grad = self.model_param.grad
        if grad is None or grad.shape == self.main_param.shape:  # the whole parameter
            return grad
        return grad.reshape(-1)[self.start : self.end].view_as(self.main_param)

    def model_view(self) -> torch.Tensor:
        """The model parameter's values of this range, shaped as main (writes go to the model)."""
        if self.param_view is not None:
            return self.param_view.view_as(self.main_param)
        return self.model_param.detach().reshape(-1)[self.start : self.end].view_as(self.main_param)


def _check_unique(shards: Sequence[ParamShard]) -> None:
    seen: set[str] = set()
    for shard in shards:
        if shard.name in seen:
            raise ValueError(
                f"two parameters are both named {shard.name!r}: per-name optimizer state needs unique "
                "names across the model chunks"
            )
        seen.add(shard.name)


def export_param_state(
    shards: Sequence[ParamShard], inner: torch.optim.Optimizer, grad_scaler: Any = None, *, copy: bool = True
) -> dict:
    """The state ``inner`` (the torch optimizer stepping the shards' main parameters) keeps, per
    parameter name (see the module docstring), with ``grad_scaler``'s numbers if given; tensors are
    copies, or (``copy=False``) views of the live state that the next optimizer step changes."""
    _check_unique(shards)
    by_main = {id(s.main_param): s for s in shards}
    groups = []
    for group in inner.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append(hyper | {"params": [by_main[id(p)].name for p in group["params"]]})
    params = {}
    for shard in shards:
        main = shard.main_param
        entry: dict = {
            "start": shard.start,
            "end": shard.end,
            "numel": shard.model_param.numel(),
            "shape": list(shard.model_param.shape),
        }
        for key, value in inner.state.get(main, {}).items():
            if isinstance(value, torch.Tensor):
                per_element = value.numel() == main.numel() and value.dim() > 0
                entry[key] = _export(value.detach().reshape(-1) if per_element else value.detach(), copy)
        if shard.copy:
            entry["main_param"] = _export(main.detach().reshape(-1), copy)
        params[shard.name] = entry
    out = {"param_groups": groups, "params": params}
    if grad_scaler is not None:
        out["grad_scaler"] = grad_scaler.state_dict()
    return out


def _export(value: torch.Tensor, copy: bool) -> torch.Tensor:
    return value.clone() if copy else value


def import_param_state(
    shards: Sequence[ParamShard],
    inner: torch.optim.Optimizer,
    state: dict,
    *,
    grad_scaler: Any = None,
    fused: bool = False,
) -> None:
    """Load :func:`export_param_state` output into ``inner`` (and ``grad_scaler``): each shard takes
    its range. ``fused``: ``inner`` is one of torch's fused optimizers (step counts on the device).

    Everything is checked before anything changes. A state tensor the optimizer already holds with
    the same shape and dtype is overwritten in place, so loading into a trained optimizer needs no
    second copy of its state on the device.
    """
    _check_unique(shards)
    saved_groups, groups = state["param_groups"], inner.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"optimizer state has {len(saved_groups)} parameter groups, this optimizer {len(groups)}"
        )
    loaded = [(shard, _slices(shard, state["params"].get(shard.name))) for shard in shards]
    for group, saved in zip(groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    inner_state = inner.state  # torch's fused kernels keep the step count on the device, foreach on the host
    with torch.no_grad():
        for shard, per_param in loaded:
            main = shard.main_param
            if "main_param" in per_param:
                main.copy_(per_param.pop("main_param"))
            if not per_param:
                inner_state.pop(main, None)
                continue
            old = inner_state.get(main, {})
            inner_state[main] = {
                key: _into(old.get(key), value, main, fused) for key, value in per_param.items()
            }
    if grad_scaler is not None and state.get("grad_scaler") is not None:
        grad_scaler.load_state_dict(state["grad_scaler"])


def _slices(shard: ParamShard, entry: dict | None) -> dict[str, torch.Tensor]:
    """The parts of ``entry`` that ``shard`` steps, shaped like its main parameter (views, no copies)."""
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
    out = {}
    for key, value in entry.items():
        if key in ("start", "end", "numel", "shape") or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 1 and value.numel() == entry["end"] - entry["start"]:
            value = value[lo:hi].reshape(shard.main_param.shape)
        out[key] = value
    return out


def _into(old, value: torch.Tensor, main: torch.Tensor, fused: bool) -> torch.Tensor:
    """``value`` as optimizer state of ``main``: copied into ``old`` when it fits, else a new tensor.

    A scalar (Adam's ``step``) stays on the host for the foreach kernels; torch's fused kernels keep
    it on the device. Per-element state takes ``main``'s dtype: the moments of fp32 main weights and of
    weights stepped in the model's dtype (``main_params_dtype``) load from each other's checkpoints.
    """
    if value.dim() == 0:
        if not fused:
            return value.clone()
        dtype = value.dtype
    else:
        dtype = main.dtype
    if isinstance(old, torch.Tensor) and (old.shape, old.dtype, old.device) == (
        value.shape,
        dtype,
        main.device,
    ):
        return old.copy_(value)
    return value.to(device=main.device, dtype=dtype, copy=True)

"""Optimizers that step from data-parallel gradient buffers, clip by the global norm, and skip bad steps.

Two flavours, as in Megatron:

* :class:`FP32Optimizer` — an fp32 model; the inner torch optimizer steps on the model's own
  parameters, with ``param.main_grad`` (the data-parallel buffer) handed to it as the gradient.
* :class:`Float16OptimizerWithFloat16Params` — a bf16 model. bf16 has too few mantissa bits for
  small updates to register (``w + lr * u == w`` for most of training), so the optimizer keeps an
  fp32 *main* copy of each bf16 parameter, steps on that with fp32 gradients, and copies the result
  back into the bf16 model. fp32 parameters in the same model are stepped directly.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``. A non-finite global norm
(a NaN or Inf anywhere in the model) skips the update on every rank (the norm is global, so they
agree) and leaves parameters and optimizer state untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from core.flags import flag
from core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    grad_stats_group,
    param_counts_for_norm,
)
from core.tensor_parallel.utils import copy_tensor_model_parallel_attributes

_HALF = (torch.bfloat16, torch.float16)
_COPIED_ATTRIBUTES = ("shared", "shared_embedding", "sequence_parallel")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer settings (Megatron's ``OptimizerConfig`` field names and defaults)."""

    optimizer: Literal["adam", "sgd"] = flag("adam", group="training")
    """"adam" (decoupled weight decay, i.e. AdamW, as Megatron's Adam) or "sgd"."""
    lr: float | None = flag(None, group="learning rate")
    """Initial learning rate; the scheduler overwrites it every step."""
    min_lr: float | None = flag(None, group="learning rate", cli_default=0.0)
    """Floor of the learning-rate decay (read by the scheduler's builder)."""
    weight_decay: float = 0.01
    """Decoupled weight decay for matrices; biases and norms get none (see ``get_param_groups``)."""
    bf16: bool = False
    """The model is bf16: keep fp32 main parameters and step on those."""
    fp16: bool = flag(False, group="mixed precision")
    """fp16 needs dynamic loss scaling, which Trident does not implement: must stay False."""
    params_dtype: torch.dtype = torch.float32
    adam_beta1: float = 0.9
    """Adam's decay rate of the running mean of gradients."""
    adam_beta2: float = 0.999
    """Adam's decay rate of the running mean of squared gradients."""
    adam_eps: float = 1e-08
    """Added to Adam's denominator for numerical stability."""
    sgd_momentum: float = 0.9
    """Momentum of SGD (with ``optimizer="sgd"``)."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping (the norm is still computed)."""
    log_num_zeros_in_grad: bool = flag(False, group="logging")
    """Count zero gradient elements every step (third value of ``step()``)."""
    use_distributed_optimizer: bool = flag(False, group="distributed")
    """ZeRO-1 style sharding of optimizer state; not implemented, must stay False."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"OptimizerConfig.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.fp16:
            raise ValueError(
                "fp16 training needs loss scaling, which Trident does not implement; use bf16=True"
            )
        if self.use_distributed_optimizer:
            raise ValueError("use_distributed_optimizer=True is not implemented in Trident; set it to False")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


class MegatronOptimizer:
    """Common machinery: gradient hand-over, global norm, clipping, skip-on-NaN, state dicts.

    Subclasses differ only in how they pair each model parameter with the parameter the inner
    optimizer steps on (``self._pairs``: (model param, main param), the same tensor for fp32).
    ``model_chunks`` lets ``zero_grad`` also zero the chunks' data-parallel gradient buffers.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model_chunks: Iterable[nn.Module] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.model_chunks = list(model_chunks or [])
        self._pairs: list[tuple[nn.Parameter, torch.Tensor]] = []

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the scheduler writes ``lr`` and ``weight_decay`` here)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner optimizer's per-parameter state (keyed by main parameter)."""
        return self.optimizer.state

    def get_loss_scale(self) -> torch.Tensor:
        """Always 1: bf16 and fp32 need no loss scaling (kept for Megatron-style training loops)."""
        return torch.ones(())

    def get_parameters(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps on (fp32 main parameters), in group order."""
        return [main for _, main in self._pairs]

    def get_main_param(self, model_param: nn.Parameter) -> torch.Tensor:
        """The fp32 tensor stepped on for ``model_param`` (itself for fp32 parameters)."""
        for model, main in self._pairs:
            if model is model_param:
                return main
        raise KeyError("parameter is not managed by this optimizer")

    # -- gradients ----------------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Give every main parameter its gradient: the model's ``main_grad`` (data-parallel buffer,
        already reduced) if it has one, else ``.grad``; cast to fp32 for bf16 models."""
        for model_param, main_param in self._pairs:
            grad = getattr(model_param, "main_grad", None)
            if grad is None:
                grad = model_param.grad
            if main_param is model_param:
                if grad is not None and grad is not model_param.grad:  # hand the buffer view over
                    model_param.grad = grad if grad.dtype == model_param.dtype else grad.to(model_param.dtype)
            else:
                main_param.grad = None if grad is None else grad.float()
                model_param.grad = None  # the bf16 copy is no longer needed

    def _main_grads(self, for_norm: bool) -> list[torch.Tensor]:
        return [
            main.grad
            for model, main in self._pairs
            if main.grad is not None and (not for_norm or param_counts_for_norm(model))
        ]

    def get_grad_norm(self) -> float:
        """Global L2 norm of the gradients, each weight counted once across TP, PP (and DP)."""
        return get_grad_norm_fp32(self._main_grads(for_norm=True), 2.0, grad_stats_group())

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip all gradients to global norm ``clip_grad``; return the norm before clipping."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self._main_grads(for_norm=False), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        """Zero gradient elements in the whole model (a sign of dead units or underflow)."""
        return count_zeros_fp32(self._main_grads(for_norm=True), grad_stats_group())

    # -- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """Clip, step and copy back; skipped (returns False) when the global grad norm is not finite."""
        self.prepare_grads()
        grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm):
            return False, grad_norm, None
        if self.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(self._main_grads(for_norm=False), self.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def _copy_main_params_to_model_params(self) -> None:
        for model_param, main_param in self._pairs:
            if main_param is not model_param:
                model_param.data.copy_(main_param.data)

    def reload_model_params(self) -> None:
        """Refresh the fp32 main copies from the model (after loading model weights only)."""
        with torch.no_grad():
            for model_param, main_param in self._pairs:
                if main_param is not model_param:
                    main_param.copy_(model_param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all ``.grad`` tensors and zero the data-parallel ``main_grad`` buffers."""
        covered: set[int] = set()
        for chunk in self.model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
                covered.update(id(p) for p in chunk.parameters())
        for model_param, main_param in self._pairs:
            for p in {id(model_param): model_param, id(main_param): main_param}.values():
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            main_grad = getattr(model_param, "main_grad", None)
            if main_grad is not None and id(model_param) not in covered:
                main_grad.zero_()

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"param_groups": [JSON-ready dicts], "state": {"<index>.<name>": tensor}}``.

        Parameters are numbered in group order, as torch does; ``<index>.main_param`` holds the fp32
        main copy of a bf16 parameter, so resuming loses no precision. No pickled objects: the
        tensors go to safetensors, the rest to JSON.
        """
        inner = self.optimizer.state_dict()
        groups = [
            {k: _jsonable(v) for k, v in g.items() if k != "params"} | {"num_params": len(g["params"])}
            for g in inner["param_groups"]
        ]
        tensors = {
            f"{i}.{name}": torch.as_tensor(value).detach().clone()
            for i, per_param in inner["state"].items()
            for name, value in per_param.items()
            if value is not None
        }
        for i, (model_param, main_param) in enumerate(self._ordered_pairs()):
            if main_param is not model_param:
                tensors[f"{i}.main_param"] = main_param.detach().clone()
        return {"param_groups": groups, "state": tensors}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict`'s output (possibly read back from safetensors + JSON)."""
        current = self.optimizer.param_groups
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in current] != [g["num_params"] for g in saved]:
            raise ValueError(
                f"optimizer state has groups of {[g['num_params'] for g in saved]} parameters, this "
                f"optimizer {[len(g['params']) for g in current]}: the model or its groups differ"
            )
        groups, start = [], 0
        for now, old in zip(current, saved):
            group = {
                k: (tuple(v) if isinstance(now.get(k), tuple) else v)
                for k, v in old.items()
                if k != "num_params"
            }
            groups.append(group | {"params": list(range(start, start + len(now["params"])))})
            start += len(now["params"])
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in state_dict["state"].items():
            index, name = key.split(".", 1)
            per_param.setdefault(int(index), {})[name] = tensor
        mains = {i: per_param[i].pop("main_param") for i in list(per_param) if "main_param" in per_param[i]}
        self.optimizer.load_state_dict(
            {"state": {i: s for i, s in per_param.items() if s}, "param_groups": groups}
        )
        with torch.no_grad():
            for i, (model_param, main_param) in enumerate(self._ordered_pairs()):
                if i in mains and main_param is not model_param:
                    main_param.copy_(mains[i])

    def _ordered_pairs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Pairs in the inner optimizer's parameter numbering."""
        by_main = {id(main): (model, main) for model, main in self._pairs}
        return [by_main[id(p)] for g in self.optimizer.param_groups for p in g["params"]]


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the inner optimizer steps on the model's parameters directly."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model_chunks: Iterable[nn.Module] | None = None,
    ) -> None:
        super().__init__(optimizer, config, model_chunks)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.dtype != torch.float32:
                    raise TypeError(
                        f"FP32Optimizer got a {param.dtype} parameter; use "
                        "Float16OptimizerWithFloat16Params (OptimizerConfig.bf16=True)"
                    )
                self._pairs.append((param, param))


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16 model with fp32 main parameters: the inner optimizer steps on fp32 copies.

    ``optimizer`` is built on the model's parameters; each bf16 one is swapped, in its group, for
    an fp32 clone that carries the same tensor-parallel and tied-weight attributes.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model_chunks: Iterable[nn.Module] | None = None,
    ) -> None:
        super().__init__(optimizer, config, model_chunks)
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if param.dtype in _HALF:
                    main = param.detach().clone().float()
                    copy_tensor_model_parallel_attributes(main, param)
                    for name in _COPIED_ATTRIBUTES:
                        if hasattr(param, name):
                            setattr(main, name, getattr(param, name))
                    group["params"][index] = main
                    if param in optimizer.state:
                        optimizer.state[main] = optimizer.state.pop(param)
                    self._pairs.append((param, main))
                elif param.dtype == torch.float32:
                    self._pairs.append((param, param))
                else:
                    raise TypeError(
                        f"cannot optimise a {param.dtype} parameter; expected bfloat16 or float32"
                    )

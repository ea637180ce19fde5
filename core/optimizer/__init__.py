"""Mixed-precision optimizers (fp32, bf16, fp16 with loss scaling, distributed) with global-norm
clipping, parameter groups and the LR schedule.

optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-4, bf16=True, clip_grad=1.0), model_chunks)
scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-4, min_lr=3e-5,
                                    lr_warmup_steps=100, lr_decay_steps=10_000, lr_decay_style="cosine")
update_successful, grad_norm, num_zeros = optimizer.step()
if update_successful:
    scheduler.step(1)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from core import parallel_state as ps
from core.device import current_device
from core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    param_counts_for_norm,
)
from core.optimizer.distrib_optimizer import DistributedOptimizer
from core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from core.optimizer.lr_scheduler import OptimizerParamScheduler
from core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    OptimizerConfig,
    StepOutcome,
)
from core.optimizer.param_state import ParamShard
from core.parallel_state import ParallelGroups

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronOptimizer",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "ParamShard",
    "StepOutcome",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "get_param_groups",
    "has_fused_kernel",
    "param_counts_for_norm",
]

Condition = Callable[[str, nn.Parameter], bool]


def default_no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: biases and every 1-D parameter (norm weights) are not decayed.

    Decay pulls weights towards zero to regularise matrices; for a norm's gain (which should stay
    near one) or a bias it only does harm.
    """
    return name.endswith(".bias") or param.ndim == 1


def get_param_groups(
    model_chunks: nn.Module | Iterable[nn.Module],
    weight_decay: float,
    *,
    no_weight_decay_cond: Condition | None = None,
    scale_lr_cond: Condition | None = None,
    lr_mult: float = 1.0,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> list[dict]:
    """Trainable parameters of all chunks in groups of equal (``wd_mult``, ``lr_mult``).

    Each group is a torch parameter-group dict with ``params``, ``weight_decay`` (already
    multiplied), ``wd_mult`` and ``lr_mult`` (read by the scheduler). Groups come in a fixed order,
    decayed first, so optimizer checkpoints line up across runs; empty groups are left out.

    With ``decoupled_lr`` (Megatron's ``--decoupled-lr``), parameters marked
    ``is_embedding_or_output_parameter`` (the input embedding and the output layer) go into groups of
    their own with ``max_lr=decoupled_lr`` and ``min_lr=decoupled_min_lr`` (if given), which the
    scheduler uses instead of its own.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    no_wd = no_weight_decay_cond or default_no_weight_decay
    groups: dict[tuple[float, float, bool], list[nn.Parameter]] = {}
    seen: set[int] = set()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            wd_mult = 0.0 if no_wd(name, param) else 1.0
            scaled = scale_lr_cond is not None and scale_lr_cond(name, param)
            decoupled = decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
            groups.setdefault((wd_mult, lr_mult if scaled else 1.0, decoupled), []).append(param)
    ordered = sorted(groups, key=lambda key: (key[2], -key[0], key[1]))
    out = []
    for key in ordered:
        group = {
            "params": groups[key],
            "wd_mult": key[0],
            "lr_mult": key[1],
            "weight_decay": weight_decay * key[0],
        }
        if key[2]:
            group["max_lr"] = decoupled_lr
            if decoupled_min_lr is not None:
                group["min_lr"] = decoupled_min_lr
        out.append(group)
    return out


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: nn.Module | Iterable[nn.Module],
    *,
    no_weight_decay_cond: Condition | None = None,
    scale_lr_cond: Condition | None = None,
    lr_mult: float = 1.0,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    fused: bool | None = None,
    pg_collection: ParallelGroups | None = None,
) -> MegatronOptimizer:
    """The optimizer for these chunks: AdamW (or SGD) on fp32 parameters, fp32 main copies for a
    bf16/fp16 model, loss scaling for fp16, and with ``use_distributed_optimizer`` all of it for
    this data-parallel rank's shard only (the chunks must then be ``DistributedDataParallel``
    wrappers built with ``use_distributed_optimizer=True``). ``fused``: torch's fused kernel (True),
    its foreach one (False), or the fused one where the device has it (None). ``pg_collection``: the
    model's process groups (default: ``parallel_state``'s when set up, else one process), which say what
    this rank counts in global gradient norms and where they are summed."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    pg_collection = ps.groups_or_default(pg_collection)
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr must be set (the scheduler then drives it every step)")
    groups = get_param_groups(
        chunks,
        config.weight_decay,
        no_weight_decay_cond=no_weight_decay_cond,
        scale_lr_cond=scale_lr_cond,
        lr_mult=lr_mult,
        decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr,
    )
    if not groups:
        # An empty pipeline stage (a layout such as "Ett|t||tL") owns no parameters. torch refuses an
        # empty parameter list, so it gets one empty group: its step is a no-op, yet it still joins
        # every collective its peers run (grad-norm all-reduce, checkpoint agreement).
        groups = [{"params": [], "wd_mult": 1.0, "lr_mult": 1.0, "weight_decay": config.weight_decay}]
    inner = _inner_optimizer(config, groups, chunks, fused)
    if config.use_distributed_optimizer:
        cls = DistributedOptimizer
    elif config.bf16 or config.fp16:
        cls = Float16OptimizerWithFloat16Params
    else:
        cls = FP32Optimizer
    return cls(inner, config, chunks, pg_collection)


def _inner_optimizer(
    config: OptimizerConfig, groups: list[dict], chunks: list[nn.Module], fused: bool | None
) -> torch.optim.Optimizer:
    """torch's AdamW (or SGD): fused where the device has the kernel, foreach elsewhere.

    The fused kernel updates every tensor in one launch and takes the skip flag and the clipping
    factor as device tensors (see ``MegatronOptimizer.step_on_device``); both forms compute the same
    update (within 1e-6 in fp32, tested).
    """
    if config.optimizer == "adam":
        cls = torch.optim.AdamW
        kwargs = {
            "lr": config.lr,
            "weight_decay": config.weight_decay,
            "betas": (config.adam_beta1, config.adam_beta2),
            "eps": config.adam_eps,
        }
    else:
        cls, kwargs = torch.optim.SGD, {"lr": config.lr, "weight_decay": config.weight_decay}
        kwargs["momentum"] = config.sgd_momentum
    if fused is None:
        devices = {p.device for chunk in chunks for p in chunk.parameters()} or {current_device()}
        fused = len(devices) == 1 and has_fused_kernel(cls, next(iter(devices)))
    return cls(groups, **kwargs, **({"fused": True} if fused else {"foreach": True}))


@functools.cache
def has_fused_kernel(cls: type[torch.optim.Optimizer], device: torch.device) -> bool:
    """Whether ``cls(..., fused=True)`` steps on ``device`` with this torch (tried once on one element).

    CUDA has fused AdamW on every torch the project allows; CPUs from torch 2.4; SGD's arrived later.
    """
    try:
        param = torch.nn.Parameter(torch.zeros(1, device=device))
        param.grad = torch.zeros(1, device=device)
        cls([param], lr=0.0, fused=True).step()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True

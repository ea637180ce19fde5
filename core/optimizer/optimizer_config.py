"""Optimizer settings (Megatron's ``OptimizerConfig``, in its own module as in Megatron Core)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from core.distributed.distributed_data_parallel_config import DTYPES
from core.flags import flag
from core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from core.problems import Problem, ProblemsError, problem

__all__ = ["OptimizerConfig", "main_params_problems", "make_grad_scaler"]


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
    """The model is fp16: fp32 main parameters, and dynamic loss scaling unless ``loss_scale`` is set."""
    params_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    """The dtype of the weights the optimizer steps (Megatron-FSDP's ``main_params_dtype``): fp32 main
    copies of a 16-bit model, or the model's own dtype, when the optimizer steps the model's weights (or
    their data-parallel shards) directly and keeps its state in that dtype, with no main copy."""
    loss_scale: float | None = flag(None, group="mixed precision")
    """A constant loss scale (fp16 or bf16); None with fp16 means dynamic loss scaling."""
    initial_loss_scale: float = flag(2.0**32, group="mixed precision")
    """Dynamic loss scaling: the starting scale."""
    min_loss_scale: float = flag(1.0, group="mixed precision")
    """Dynamic loss scaling: the scale never backs off below this."""
    loss_scale_window: float = flag(1000, group="mixed precision")
    """Dynamic loss scaling: steps without overflow before the scale doubles."""
    hysteresis: int = flag(2, group="mixed precision")
    """Dynamic loss scaling: overflows tolerated before the scale halves."""
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
    """Shard main parameters and optimizer state over data-parallel ranks (ZeRO-1); the model
    chunks must be wrapped in ``DistributedDataParallel`` with ``use_distributed_optimizer=True``."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"OptimizerConfig.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 cannot both be True")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if problems := main_params_problems(self):
            raise ProblemsError("OptimizerConfig", problems)
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be > 0 or None (dynamic), got {self.loss_scale}")


_FP16_MAIN = (
    "(fp16 main weights) is not built: Adam's moments would be fp16 too, where its epsilon (1e-8) and small "
    "squared gradients round to 0 and the updates blow up; use fp32 (the default)"
)
_STEPS = "the optimizer steps fp32 main copies or the {model} weights themselves"


def main_params_problems(config: Any) -> list[Problem]:
    """What ``main_params_dtype`` may be: fp32 main copies, or the model's own dtype where that is bf16.

    fp16 main weights would keep Adam's moments in fp16, where its epsilon (1e-8) and small squared
    gradients round to 0: a DP2 fp16 run that way diverged at its fifth iteration (loss 21.2 against 5.37).
    The command line's wording names the flag with the value given (``auto`` included)."""
    main = config.main_params_dtype
    model = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    short = {dtype: name for name, dtype in DTYPES.items()}
    values = {"main": short.get(main, str(main)), "model": short[model]}
    if main not in (torch.float32, model):
        message = "{main_params_dtype} {main} must be fp32 or the model's dtype ({model}): " + _STEPS
        flag_message = "{main_params_dtype} must be fp32, auto or the model's dtype ({model}): " + _STEPS
        return [problem(message, "main_params_dtype", command_line=flag_message, **values)]
    if main == torch.float16:
        flag_message = "{main_params_dtype} " + _FP16_MAIN
        return [
            problem(
                "{main_params_dtype} {main} " + _FP16_MAIN,
                "main_params_dtype",
                command_line=flag_message,
                **values,
            )
        ]
    return []


def make_grad_scaler(config: OptimizerConfig) -> ConstantGradScaler | None:
    """Megatron's choice: a constant scale if ``loss_scale`` is set, dynamic scaling for fp16, else none."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_interval=int(config.loss_scale_window),
            hysteresis=config.hysteresis,
        )
    return None

"""LayerNorm and RMSNorm with Megatron's parameter bookkeeping.

The norms are replicated on every TP rank. Under sequence parallelism each rank normalises only
its slice of the sequence, so its weight gradient is a partial sum: the parameters are marked
``sequence_parallel`` for ``finalize_model_grads`` to all-reduce them over the TP group. Both
norms compute their statistics in fp32 whatever the activations' dtype, so bf16 runs stay stable:
``F.layer_norm`` and ``F.rms_norm`` (torch >= 2.4) accumulate in fp32 internally, so 16-bit
activations are not copied to fp32 and back around them.

With ``layernorm_zero_centered_gamma`` (Megatron's ``--apply-layernorm-1p``) the weight holds
gamma - 1: it starts at zero and the norm scales by ``1 + weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.device import param_device
from core.transformer.initialization import mark_init
from core.transformer.transformer_config import TransformerConfig

_HAS_RMS_NORM = hasattr(F, "rms_norm")
"""torch >= 2.4 has ``F.rms_norm`` (one fused kernel on GPUs); older versions write it out."""


def _norm_param(size: int, config: TransformerConfig, fill: float) -> nn.Parameter:
    param = nn.Parameter(torch.full((size,), fill, device=param_device(config), dtype=config.params_dtype))
    param.sequence_parallel = config.sequence_parallel
    mark_init(param, "ones" if fill == 1.0 else "zeros")
    return param


class _Norm(nn.Module):
    """What both norms hold: ``eps`` and the scale ``weight`` (gamma, or gamma - 1 when zero-centred)."""

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _norm_param(hidden_size, config, 0.0 if self.zero_centered_gamma else 1.0)


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the hidden dimension."""

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(hidden_size, config)
        self.bias = _norm_param(hidden_size, config, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered_gamma:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        # 1 + a small 16-bit weight would round in 16 bits: form gamma, and normalise, in fp32.
        gamma = self.weight.float() + 1
        return F.layer_norm(x.float(), x.shape[-1:], gamma, self.bias.float(), self.eps).to(x.dtype)


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * weight``: LayerNorm without centring or bias (LLaMA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + 1 if self.zero_centered_gamma else self.weight
        if _HAS_RMS_NORM:
            return F.rms_norm(x, x.shape[-1:], gamma, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return gamma * normed.to(x.dtype)


def build_norm(hidden_size: int, config: TransformerConfig) -> nn.Module:
    """The norm ``config.normalization`` names."""
    return (
        RMSNorm(hidden_size, config) if config.normalization == "RMSNorm" else LayerNorm(hidden_size, config)
    )

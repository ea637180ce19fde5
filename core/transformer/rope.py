"""Rotary position embeddings in the Hugging Face LLaMA ("rotate half") convention.

Channel ``i`` of the rotated part is paired with channel ``i + rotary_dim / 2`` (not with its
neighbour, as in the original RoPE paper and Megatron's ``rotary_interleaved``); this is the
layout of every Hugging Face LLaMA checkpoint, so weights convert without permuting rows. With
``rotary_percent < 1`` only the first ``rotary_dim`` channels of a head rotate (GPT-NeoX style).
The angles are computed in fp32 and cast to the activations' dtype at the end.
"""

from __future__ import annotations

import einops
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Produces the ``(cos, sin)`` tables for given positions; holds no trainable parameters."""

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[s]`` or ``[b, s]`` -> cos, sin of shape ``[s, rotary_dim]`` / ``[b, s, rotary_dim]``."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the last dimension."""
    first, second = einops.rearrange(x, "... (two d) -> two ... d", two=2)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[b, heads, s, d]``; the rest pass through.

    ``cos``/``sin`` are ``[s, r]`` (shared by the batch) or ``[b, s, r]`` (per-sample positions).
    """
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotated * cos + rotate_half(rotated) * sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)

"""Rotary position embeddings in the Hugging Face LLaMA ("rotate half") convention.

Channel ``i`` of the rotated part is paired with channel ``i + rotary_dim / 2`` (not with its
neighbour, as in the original RoPE paper and Megatron's ``rotary_interleaved``); this is the
layout of every Hugging Face LLaMA checkpoint, so weights convert without permuting rows. With
``rotary_percent < 1`` only the first ``rotary_dim`` channels of a head rotate (GPT-NeoX style).
The angles are computed in fp32 and cast to the activations' dtype at the end.

Llama-3.1 RoPE scaling (``--use-rope-scaling``) stretches the context by slowing the slow
frequencies only: a frequency whose wavelength exceeds ``original_positions / low_freq_factor``
is divided by ``factor``, one shorter than ``original_positions / high_freq_factor`` is kept, and
those between are blended linearly in ``original_positions / wavelength``. The constants are
Meta's, Megatron's and Hugging Face's ``rope_type: llama3`` defaults.
"""

from __future__ import annotations

import math

import torch
from torch import nn

LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def llama3_scaled_frequencies(
    inv_freq: torch.Tensor,
    factor: float,
    *,
    low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
    high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
    original_max_positions: int = LLAMA3_ORIGINAL_MAX_POSITIONS,
) -> torch.Tensor:
    """Llama-3.1's rescaled inverse frequencies (the same arithmetic as Megatron's and HF's)."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Produces the ``(cos, sin)`` tables for given positions; holds no trainable parameters.

    ``scaling_factor``: Llama-3.1 RoPE scaling by this factor (None: plain RoPE). The inverse
    frequencies live on the compute device, and the tables of the usual positions ``0 .. s-1``
    are cached there per dtype (:meth:`for_length`): a microbatch then costs no kernel and no
    host-to-device copy, which from pageable host memory would block the host.
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float,
        scaling_factor: float | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (base**exponents)
        if scaling_factor is not None:
            inv_freq = llama3_scaled_frequencies(inv_freq, scaling_factor)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[s]`` or ``[b, s]`` -> fp32 cos, sin of shape ``[s, rotary_dim]`` / ``[b, s, rotary_dim]``."""
        inv_freq = self.inv_freq
        if inv_freq.device != positions.device:  # a copy between devices waits: only when needed
            inv_freq = inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def for_length(
        self, length: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of positions ``0 .. length-1``, ``[length, rotary_dim]`` in ``dtype``: views of a
        cached table, equal to ``forward(arange(length))`` cast to ``dtype``.

        The table grows (to the next power of two) when a longer sequence comes; it is rebuilt after
        the module moves (``.to()`` moves ``inv_freq``, and the key includes the device).
        """
        device = self.inv_freq.device if device is None else torch.device(device)
        key = (dtype, device)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < length:
            size = 1 << max(length - 1, 0).bit_length()
            cos, sin = self.forward(torch.arange(size, device=device))
            table = (cos.to(dtype), sin.to(dtype))
            self._tables[key] = table
        return table[0][:length], table[1][:length]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[b, ..., s, d]``; the rest pass through.

    ``cos``/``sin`` are ``[s, r]`` (shared by the batch) or ``[b, s, r]`` (per-sample positions); any
    number of head dimensions may sit between batch and sequence (``[b, groups, heads, s, d]``). They
    are cast to ``x``'s dtype (a no-op for :meth:`RotaryEmbedding.for_length`'s tables).
    """
    if cos.dim() == 3:
        heads = (1,) * (x.dim() - 3)
        cos, sin = (
            cos.view(cos.shape[0], *heads, *cos.shape[1:]),
            sin.view(sin.shape[0], *heads, *sin.shape[1:]),
        )
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)

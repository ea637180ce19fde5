"""The blockwise FP8 recipe (``--fp8-recipe blockwise``): DeepSeek-V3's scaling, Transformer Engine's
``Float8BlockScaling``.

Every block of 128 values has its own float32 scale, made from the block's own absolute maximum at the
moment it is cast (current scaling: no history, nothing to reduce across ranks). Inputs and output
gradients are cast in 1 x 128 blocks along the dimension a product sums over; weights in 128 x 128
tiles, so a weight's transposed copy (the input gradient's operand) has the same blocks, transposed::

    y  = x   @ w^T    x: 1 x 128 along features     w: 128 x 128 tiles
    dx = g   @ w      g: 1 x 128 along features     w^T: the same tiles
    dw = g^T @ x      g^T and x^T: 1 x 128 along tokens

One outlier then coarsens the rounding of 128 values, not of the whole tensor, which is why E4M3 is
precise enough for gradients too (``--fp8-format e4m3``; ``hybrid`` still casts them to E5M2).

A block never straddles two tensor-parallel shards when a layer's features per rank are multiples of
128 (``fp8_shape_problem``), so every TP split casts exactly what one device casts. Tokens may end in a
partial block (padded with zeros for its maximum).

Each product here is written ``a @ b^T`` with both operands ``[rows, K]`` and their scales along ``K``
(:func:`block_product`). It runs as DeepSeek-V3 defines it: FP8 values, float32 scales applied per
block, float32 accumulation. It dequantises the operands block by block and multiplies in float32, on
every device. That gives the recipe's numerics but not its speed: torch's blockwise FP8 kernel
(``torch.nn.functional.scaled_mm``, Hopper and cuBLAS 12.9) is not called yet, as it has not been
checked on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 128
"""Values per block: a 1 x 128 row block, or each side of a 128 x 128 weight tile."""


class BlockCast(NamedTuple):
    """A 2-D operand ``[rows, K]`` cast to FP8 with one scale per block."""

    values: torch.Tensor
    """``[rows, K]`` FP8 values, row-major."""
    inverse_scales: torch.Tensor
    """float32, ``[rows, ceil(K / 128)]`` for 1 x 128 blocks, ``[ceil(rows / 128), ceil(K / 128)]`` for
    128 x 128 tiles: what each block's values are multiplied by to dequantise."""
    tiled: bool = False
    """128 x 128 tiles (a weight), else 1 x 128 blocks along ``K``."""

    def transposed(self) -> BlockCast:
        """A tiled operand's transpose (``[K, rows]``): the same tiles, transposed, no new rounding."""
        if not self.tiled:
            raise ValueError("only a 128 x 128 tiled operand transposes without a new cast")
        return BlockCast(self.values.t().contiguous(), self.inverse_scales.t().contiguous(), tiled=True)


def _blocks(count: int) -> int:
    return -(-count // BLOCK)


def scale_from_amax(amax: torch.Tensor, fp8_max: float | torch.Tensor, margin: int = 0) -> torch.Tensor:
    """``fp8_max / amax / 2**margin``; 1 where the amax is zero or not finite (nothing to scale by).
    Every recipe's rule, per tensor or per block (``core.tensor_parallel.fp8`` imports it from here)."""
    good = torch.isfinite(amax) & (amax > 0)
    scale = fp8_max / torch.where(good, amax, 1.0) / (2.0**margin)
    return torch.where(good, scale, torch.ones_like(scale))


def saturated_cast(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scales`` in float32 (``scales`` broadcast: one, or one per block), saturated to ``dtype``'s
    range and rounded to it: every recipe's cast (``core.tensor_parallel.fp8`` imports it from here)."""
    fp8_max = torch.finfo(dtype).max
    return (values.float() * scales).clamp(-fp8_max, fp8_max).to(dtype)


def quantize_rows(tensor: torch.Tensor, dtype: torch.dtype) -> BlockCast:
    """``tensor`` ``[rows, K]`` cast to ``dtype`` in 1 x 128 blocks along ``K``."""
    rows, k = tensor.shape
    blocks = _blocks(k)
    padded = F.pad(tensor.detach().float(), (0, blocks * BLOCK - k)).view(rows, blocks, BLOCK)
    scale = scale_from_amax(padded.abs().amax(dim=-1), torch.finfo(dtype).max)
    values = saturated_cast(padded, scale.unsqueeze(-1), dtype)
    return BlockCast(values.view(rows, blocks * BLOCK)[:, :k].contiguous(), scale.reciprocal())


def _tiles(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` ``[rows, K]`` in float32, zero-padded to whole tiles, as ``[rows/128, 128, K/128, 128]``."""
    rows, k = matrix.shape
    row_blocks, k_blocks = _blocks(rows), _blocks(k)
    padded = F.pad(matrix.detach().float(), (0, k_blocks * BLOCK - k, 0, row_blocks * BLOCK - rows))
    return padded.view(row_blocks, BLOCK, k_blocks, BLOCK)


def tile_amaxes(matrix: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of each 128 x 128 tile of ``matrix`` ``[rows, K]``: float32,
    ``[ceil(rows / 128), ceil(K / 128)]``."""
    return _tiles(matrix).abs().amax(dim=(1, 3))


def _cast_tiles(tiles: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    values = saturated_cast(tiles, scales[:, None, :, None], dtype)
    return values.view(scales.shape[0] * BLOCK, scales.shape[1] * BLOCK)[: shape[0], : shape[1]].contiguous()


def cast_in_tiles(matrix: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``matrix`` ``[rows, K]`` cast to ``dtype``, each 128 x 128 tile times its scale (``scales``
    ``[ceil(rows / 128), ceil(K / 128)]``): the values :func:`quantize_tiles` gives with these scales."""
    return _cast_tiles(_tiles(matrix), scales, dtype, matrix.shape)


def quantize_tiles(tensor: torch.Tensor, dtype: torch.dtype) -> BlockCast:
    """``tensor`` ``[rows, K]`` cast to ``dtype`` in 128 x 128 tiles."""
    tiles = _tiles(tensor)
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), torch.finfo(dtype).max)
    return BlockCast(_cast_tiles(tiles, scale, dtype, tensor.shape), scale.reciprocal(), tiled=True)


def dequantize_blocks(cast: BlockCast) -> torch.Tensor:
    """The operand in float32: each block's values times its inverse scale."""
    rows, k = cast.values.shape
    inverse = cast.inverse_scales
    if cast.tiled:
        inverse = inverse.repeat_interleave(BLOCK, dim=0)[:rows]
    inverse = inverse.repeat_interleave(BLOCK, dim=1)[:, :k]
    return cast.values.float() * inverse


def block_product(a: BlockCast, b: BlockCast, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` (``[m, K] x [n, K] -> [m, n]``): FP8 values with their block scales, float32
    accumulation (module docstring)."""
    return (dequantize_blocks(a) @ dequantize_blocks(b).t()).to(out_dtype)

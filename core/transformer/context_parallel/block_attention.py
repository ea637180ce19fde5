"""Attention over one block of keys with its log-sum-exp, and the backward of such a block.

Ring attention computes a query block against one key/value block at a time and merges the partial
results by their log-sum-exp (``lse``, the log of each row's softmax denominator). PyTorch's fused
attention kernels return that ``lse``, and their backwards take the *final* output and ``lse``: fed
those, a block's backward yields exactly that block's share of the full gradients (the softmax
probabilities it recomputes are the global ones). So the ring needs only these two functions:

* :func:`attention_with_lse` ``(q, k, v) -> (out, lse)``;
* :func:`attention_with_lse_backward` ``(dout, q, k, v, out, lse) -> (dq, dk, dv)``.

Kernels, chosen by device and dtype: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward (fp32, fp64, bf16); on CUDA ``aten._scaled_dot_product_flash_attention`` for fp16
and bf16 and ``aten._scaled_dot_product_efficient_attention`` otherwise (the memory-efficient
kernel pads its ``lse`` to a multiple of 32 rows on some versions; only the first rows are used).
Where an op is missing (older or other builds) or the dtype is not covered, :func:`_math_forward`
and :func:`_math_backward` compute the same in plain PyTorch, in fp32. ``lse`` is
``[b, heads, queries]`` in fp32 (fp64 for fp64 inputs). ``causal`` means the usual lower triangle
with as many queries as keys.

Attention dropout takes the plain path: the kernels draw their masks from a generator state that
the ring cannot replay block by block. A block's mask comes from its own generator seeded with
``dropout_seed``, so its backward draws the same mask again. Dropping probabilities and then
rescaling rows commutes, so blocks dropped separately still merge by their lse.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
_CPU_FLASH = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_CUDA_FLASH = getattr(_aten, "_scaled_dot_product_flash_attention", None)
_CUDA_FLASH_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_backward", None)
_CUDA_EFFICIENT = getattr(_aten, "_scaled_dot_product_efficient_attention", None)
_CUDA_EFFICIENT_BACKWARD = getattr(_aten, "_scaled_dot_product_efficient_attention_backward", None)
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

FORCE_MATH = False
"""Tests set this to compare the fused kernels with the plain computation."""


def backend(query: torch.Tensor) -> str:
    """Which kernel computes blocks for tensors like ``query``: cpu_flash, cuda_flash, cuda_efficient or math."""
    if FORCE_MATH:
        return "math"
    if query.device.type == "cpu" and query.dtype in _CPU_DTYPES and _CPU_FLASH and _CPU_FLASH_BACKWARD:
        return "cpu_flash"
    if query.device.type == "cuda":
        half = query.dtype in (torch.float16, torch.bfloat16)
        if (
            half
            and _CUDA_FLASH
            and _CUDA_FLASH_BACKWARD
            and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256
        ):
            return "cuda_flash"
        if _CUDA_EFFICIENT and _CUDA_EFFICIENT_BACKWARD:
            return "cuda_efficient"
    return "math"


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dropout: tuple[float, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` over ``[b, heads, s, d]`` (heads equal for q, k, v), and its lse.

    ``dropout``: (probability, seed) of this block's attention dropout, or None.
    """
    if dropout is not None:
        return _math_forward(query, key, value, causal, scale, dropout)
    kind = backend(query)
    if kind == "cpu_flash":
        return _CPU_FLASH(query, key, value, 0.0, causal, scale=scale)
    if kind == "cuda_flash":
        out, lse, *_ = _CUDA_FLASH(query, key, value, 0.0, causal, False, scale=scale)
        return out, lse
    if kind == "cuda_efficient":
        out, lse, *_ = _CUDA_EFFICIENT(query, key, value, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : query.shape[-2]].float()
    return _math_forward(query, key, value, causal, scale)


def attention_with_lse_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dropout: tuple[float, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final ``out`` and ``lse`` of its query rows (module docstring).

    ``dropout``: the (probability, seed) its forward used, or None.
    """
    if dropout is not None:
        return _math_backward(grad_out, query, key, value, out, lse, causal, scale, dropout)
    kind = backend(query)
    if kind == "cpu_flash":
        return _CPU_FLASH_BACKWARD(grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)
    if kind == "cuda_flash":
        return _cuda_flash_backward(grad_out, query, key, value, out, lse, causal, scale)
    if kind == "cuda_efficient":
        return _cuda_efficient_backward(grad_out, query, key, value, out, lse, causal, scale)
    return _math_backward(grad_out, query, key, value, out, lse, causal, scale)


def _cuda_flash_backward(grad_out, query, key, value, out, lse, causal, scale):
    empty = torch.empty(0, dtype=torch.int64, device=query.device)
    seed = offset = torch.zeros((), dtype=torch.int64, device=query.device)
    return _CUDA_FLASH_BACKWARD(
        grad_out, query, key, value, out, lse.contiguous(), empty, empty,
        query.shape[-2], key.shape[-2], 0.0, causal, seed, offset, scale=scale,
    )  # fmt: skip


def _cuda_efficient_backward(grad_out, query, key, value, out, lse, causal, scale):
    rows = lse.shape[-1]
    padded = lse.new_zeros(*lse.shape[:-1], -(-rows // 32) * 32)
    padded[..., :rows] = lse
    seed = offset = torch.zeros((), dtype=torch.int64, device=query.device)
    grad_q, grad_k, grad_v, _ = _CUDA_EFFICIENT_BACKWARD(
        grad_out, query, key, value, None, out, padded, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale,
    )  # fmt: skip
    return grad_q, grad_k, grad_v


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """The plain computation's dtype: fp64 stays, everything else goes to fp32."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _scores(query, key, causal, scale) -> torch.Tensor:
    scores = torch.matmul(_wide(query), _wide(key).transpose(-2, -1)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        allowed = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _dropout_scale(probs: torch.Tensor, dropout: tuple[float, int] | None) -> torch.Tensor | float:
    """This block's dropout mask with the survivors' ``1 / (1 - p)`` (1.0 without dropout)."""
    if dropout is None:
        return 1.0
    p, seed = dropout
    generator = torch.Generator(device=probs.device).manual_seed(seed)
    keep = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype) >= p
    return keep.to(probs.dtype) / (1.0 - p)


def _math_forward(query, key, value, causal, scale, dropout=None):
    scores = _scores(query, key, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    probs = probs * _dropout_scale(probs, dropout)
    return torch.matmul(probs, _wide(value)).to(query.dtype), lse


def _math_backward(grad_out, query, key, value, out, lse, causal, scale, dropout=None):
    scores = _scores(query, key, causal, scale)
    probs = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1))
    kept = _dropout_scale(probs, dropout)
    grad_wide = _wide(grad_out)
    grad_v = torch.matmul((probs * kept).transpose(-2, -1), grad_wide)
    grad_probs = torch.matmul(grad_wide, _wide(value).transpose(-2, -1)) * kept
    row_dot = (grad_wide * _wide(out)).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_dot) * scale
    grad_q = torch.matmul(grad_scores, _wide(key))
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), _wide(query))
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)

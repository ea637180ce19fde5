"""What the log line reports besides the loss: model FLOPs, TFLOP/s per rank, MFU and peak memory.

FLOPs are counted as Megatron's ``num_floating_point_operations`` counts them for a dense GPT: every
matrix multiply once forward and twice backward (3x), two FLOPs per multiply-add, attention scores
included with the causal half only, GQA's smaller key/value projections and SwiGLU's third matrix
accounted for. Embedding lookups, norms, activations and the softmax are left out, as there. An
MoE layer counts the experts a token is routed to (top-k) and the shared experts: active parameters.

MFU is achieved TFLOP/s per rank over the device's peak: ``--peak-tflops``, or the dense 16-bit
tensor-core peak of a known GPU (:data:`PEAK_TFLOPS`). On a CPU there is no honest default, so MFU
is left out unless ``--peak-tflops`` is given.
"""

from __future__ import annotations

import resource
import sys

import torch

from core.transformer.moe.moe_config import parse_moe_layer_freq

# Dense (no sparsity) bf16/fp16 tensor-core peaks, TFLOP/s, from the vendors' data sheets. Checked in
# order: the first name that occurs in torch.cuda.get_device_name() wins, so variants come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("V100", 125.0),
    ("T4", 65.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def num_floating_point_operations(args, batch_size: int, padded_vocab_size: int) -> float:
    """FLOPs of one training iteration over ``batch_size`` sequences (Megatron's formula, dense GPT)."""
    seq, hidden, layers = args.seq_length, args.hidden_size, args.num_layers
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    query = args.kv_channels * args.num_attention_heads
    key_value = args.kv_channels * groups
    matrix_factor = 3 * 2  # forward + two backward GEMMs, two FLOPs per multiply-add
    attention = matrix_factor * (
        hidden * (query + 2 * key_value)  # QKV projection
        + query * seq / 2 * 2  # QK^T and (QK^T)V, causal half only
        + query * hidden  # output projection
    )
    mlp = matrix_factor * hidden * _mlp_width(args) * (3 if args.swiglu else 2)
    logits = matrix_factor * hidden * padded_vocab_size
    return float(batch_size * seq * (layers * attention + mlp + logits))


def _mlp_width(args) -> int:
    """The MLP inner width summed over the layers, counting what a token goes through (its active
    parameters): a dense layer's FFN, or an MoE layer's top-k experts plus its shared experts
    (Megatron's count; the router's small GEMM is left out, as there)."""
    layers = args.num_layers
    if getattr(args, "num_moe_experts", None) is None:
        return layers * args.ffn_hidden_size
    freq = parse_moe_layer_freq(args.moe_layer_freq)
    pattern = [i % freq == 0 for i in range(layers)] if isinstance(freq, int) else [bool(v) for v in freq]
    expert = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    moe = expert * args.moe_router_topk + (args.moe_shared_expert_intermediate_size or 0)
    return sum(moe if is_moe else args.ffn_hidden_size for is_moe in pattern)


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """Peak TFLOP/s of one device: ``given`` (``--peak-tflops``), a known GPU's, or None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's peak allocated bytes on a GPU, the peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def memory_stats(device: torch.device) -> dict[str, int]:
    """Megatron's ``mem-*`` W&B keys: CUDA's allocator statistics, or the peak resident set on a CPU."""
    if device.type != "cuda":
        return {"mem-max-allocated-bytes": peak_memory_bytes(device)}
    stats = torch.cuda.memory_stats(device)
    return {
        "mem-reserved-bytes": stats["reserved_bytes.all.current"],
        "mem-allocated-bytes": stats["allocated_bytes.all.current"],
        "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
        "mem-allocated-count": stats["allocation.all.current"],
    }

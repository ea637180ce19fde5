"""The numbers the log line reports: Megatron's FLOP count (hand-checked), MFU's peak, peak memory."""

from __future__ import annotations

import pytest
import torch

from training.arguments.checks import validate_args
from training.arguments.parser import parse_args
from training.reporting.throughput import (
    memory_stats,
    num_floating_point_operations,
    peak_memory_bytes,
    peak_tflops,
)


def test_flops_of_the_default_model_match_the_hand_count():
    args = validate_args(parse_args([]), 1)  # the tiny default: 4 layers, hidden 128, seq 128, batch 16
    h, s, layers, vocab, tokens = 128, 128, 4, 4096, 16 * 128
    attention = 6 * (h * 3 * h + h * s + h * h)  # QKV, QK^T and (QK^T)V over the causal half, output
    mlp = 6 * h * 4 * h * 2  # two matrices, 4h wide
    logits = 6 * h * vocab
    assert (attention, mlp, logits) == (491_520, 786_432, 3_145_728)
    per_iteration = tokens * (layers * (attention + mlp) + logits)
    assert per_iteration == 16_911_433_728
    assert num_floating_point_operations(args, args.global_batch_size, vocab) == per_iteration
    # MFU at a stated peak of 1 TFLOP/s for a 0.5 s iteration on one rank:
    assert per_iteration / (0.5 * 1e12) / 1.0 == pytest.approx(0.033822867456)


def test_flops_count_fewer_key_value_heads_and_swiglus_third_matrix():
    base = "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 64 --micro-batch-size 1"
    base = [*base.split(), "--train-iters", "1", "--lr", "1e-3"]
    mha = validate_args(parse_args(base), 1)
    gqa = validate_args(parse_args(base + ["--group-query-attention", "--num-query-groups", "2"]), 1)
    gelu = validate_args(parse_args([*base, "--ffn-hidden-size", "512"]), 1)
    swiglu = validate_args(parse_args([*base, "--ffn-hidden-size", "512", "--swiglu"]), 1)
    flops = {n: num_floating_point_operations(a, 1, 0) for n, a in (("mha", mha), ("gqa", gqa))}
    # GQA: K and V shrink from 256 to 64 rows each: per layer and token 6 * 256 * 2 * 192 FLOPs fewer.
    assert flops["mha"] - flops["gqa"] == 64 * 2 * 6 * 256 * 2 * 192
    # SwiGLU's gate is a third 256 x 512 matrix: per layer and token 6 * 256 * 512 FLOPs more.
    extra = num_floating_point_operations(swiglu, 1, 0) - num_floating_point_operations(gelu, 1, 0)
    assert extra == 64 * 2 * 6 * 256 * 512


def test_moe_flops_count_the_active_experts_and_shared_experts_only():
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 64 --micro-batch-size 1"
    base = [*base.split(), "--train-iters", "1", "--lr", "1e-3", "--ffn-hidden-size", "512", "--swiglu"]
    dense = num_floating_point_operations(validate_args(parse_args(base), 1), 1, 0)
    moe = [*base, "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"]
    moe += ["--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "[1,1,0,1]"]
    flops = num_floating_point_operations(validate_args(parse_args(moe), 1), 1, 0)
    # Three MoE layers: each token goes through 2 experts of 128 and the shared 64 (SwiGLU: 3 matrices)
    # instead of the dense 512; the other 6 experts and the router are not counted.
    assert dense - flops == 64 * 3 * 6 * 256 * 3 * (512 - (2 * 128 + 64))


def test_peak_tflops_is_stated_or_known_and_blank_on_a_cpu():
    assert peak_tflops(torch.device("cpu"), None) is None
    assert peak_tflops(torch.device("cpu"), 2.5) == 2.5


def test_peak_memory_is_the_resident_set_on_a_cpu():
    peak = peak_memory_bytes(torch.device("cpu"))
    assert 10 * 2**20 < peak < 64 * 2**30
    assert memory_stats(torch.device("cpu")) == {
        "mem-max-allocated-bytes": peak_memory_bytes(torch.device("cpu"))
    }

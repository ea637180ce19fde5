"""Peak memory and time of the loss: the plain vocabulary-parallel cross-entropy against the fused ones.

What is measured is the output layer and the loss together, forward and backward, from the final
hidden states ``[tokens, hidden]`` to their gradient and the output weight's: the logits, every fp32
copy, what autograd keeps for backward and every temporary. The plain path is Trident's without
``--cross-entropy-loss-fusion`` (``vocab_parallel_cross_entropy(logits.float(), ...)``), the fused one
``fused_vocab_parallel_cross_entropy(logits, ...)`` (``--cross-entropy-fusion-impl native``), and the
output layer inside the loss, ``linear_cross_entropy(hidden, weight, ...)`` (``... linear``).

Peak bytes are counted from the allocator's own records: on a CPU, every allocation and free the
profiler sees (``profile_memory=True``), summed in time order; on a GPU, ``max_memory_allocated``
above what was allocated before. Times are medians of ``--steps`` runs taking turns: on a GPU wall
time, on a CPU the process's CPU time with ``--threads`` threads (default 1), which other processes
on a shared machine disturb far less than wall time.

    python tools/bench/cross_entropy.py                          # vocab 32K x 4K tokens, bf16 and fp32
    python tools/bench/cross_entropy.py --device cuda --vocab 128256 --tokens 8192

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from core.tensor_parallel import fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
from core.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from tools.op_profile import measure as probe_step


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The most bytes ``fn`` held at once beyond what was allocated when it started."""
    return probe_step(fn, device).peak


def loss_step(
    kind: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    slice_bytes: int | None = None,
) -> Callable:
    """One forward and backward of the output layer and the loss (``kind``: plain, fused or linear),
    gradients left in ``.grad`` (``slice_bytes``: the fused losses' fp32 working memory, default their
    device's)."""

    def step() -> None:
        if kind == "linear":
            loss = linear_cross_entropy(
                hidden, weight, target, vocab_size=weight.shape[0], slice_bytes=slice_bytes
            )
        else:
            logits = hidden @ weight.t()  # held while the loss runs, as the model holds them
            if kind == "fused":
                loss = fused_vocab_parallel_cross_entropy(logits, target, slice_bytes=slice_bytes)
            else:
                loss = vocab_parallel_cross_entropy(logits.float(), target)
        loss.sum().backward()
        hidden.grad = weight.grad = None

    return step


def _seconds(step: Callable[[], None], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.process_time()
        step()
        return time.process_time() - start
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device, dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    steps = {name: loss_step(name, hidden, weight, target) for name in ("plain", "fused", "linear")}
    peaks = {name: peak_bytes(step, device) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(_seconds(step, device))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "logits_mib": args.tokens * args.vocab * dtype.itemsize / 2**20,
        "plain_peak_mib": peaks["plain"] / 2**20,
        "fused_peak_mib": peaks["fused"] / 2**20,
        "linear_peak_mib": peaks["linear"] / 2**20,
        "peak_ratio": peaks["fused"] / peaks["plain"],
        "linear_peak_ratio": peaks["linear"] / peaks["plain"],
        "plain_ms": ms["plain"],
        "fused_ms": ms["fused"],
        "linear_ms": ms["linear"],
        "time_ratio": ms["fused"] / ms["plain"],
        "linear_time_ratio": ms["linear"] / ms["plain"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (on a CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = [measure(args, getattr(torch, name), device) for name in args.dtypes]
    print(
        f"output layer + loss, forward and backward: vocab {args.vocab}, {args.tokens} tokens, hidden "
        f"{args.hidden}, {device.type}, peak bytes above the start, median of {args.steps} runs "
        f"({'wall' if device.type == 'cuda' else f'CPU time, {args.threads} thread(s)'})"
    )
    head = f"{'dtype':>9}{'logits MiB':>12}{'plain MiB':>11}{'fused MiB':>11}{'ratio':>7}{'linear MiB':>12}{'ratio':>7}"
    print(head + f"{'plain ms':>10}{'fused ms':>10}{'linear ms':>11}")
    for r in rows:
        print(
            f"{r['dtype']:>9}{r['logits_mib']:>12.0f}{r['plain_peak_mib']:>11.0f}{r['fused_peak_mib']:>11.0f}"
            f"{r['peak_ratio']:>7.2f}{r['linear_peak_mib']:>12.0f}{r['linear_peak_ratio']:>7.2f}"
            f"{r['plain_ms']:>10.0f}{r['fused_ms']:>10.0f}{r['linear_ms']:>11.0f}"
        )
    result = {"benchmark": "bench_cross_entropy", "vocab": args.vocab, "tokens": args.tokens, "results": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

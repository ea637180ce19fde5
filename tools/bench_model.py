"""Tokens/s of one forward+backward step of a small GPTModel at several tensor-parallel sizes.

Each TP size runs in its own group of spawned gloo ranks (CPU); every rank computes with
``cores // tp`` threads so the runs share the machine's cores alike. A step is forward, per-token
loss, backward; the time is the median of ``--steps`` steps after ``--warmup`` untimed ones.

    python tools/bench_model.py                          # GPT-2 style, hidden 256, 4 layers, seq 256, mbs 4
    python tools/bench_model.py --tp 1 2 --steps 10 --model llama

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core import parallel_state
from core.tensor_parallel import model_parallel_seed
from models.gpt import GPTModel, preset


def _rank(rank: int, tp: int, args: argparse.Namespace, init_file: str, results) -> None:
    threads = max(1, (os.cpu_count() or 1) // tp)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_seed(1234)
    config = preset(
        args.model,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=tp,
        sequence_parallel=args.sequence_parallel and tp > 1,
        **(
            {}
            if args.dropout is None
            else {"hidden_dropout": args.dropout, "attention_dropout": args.dropout}
        ),
    )
    model = GPTModel(config, args.vocab, args.seq)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(tokens, labels=labels).mean().backward()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(
            {
                "times": times,
                "threads": threads,
                "params_per_rank": sum(p.numel() for p in model.parameters()),
            }
        )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run(tp: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="trident-bench-") as tmp:
        mp.start_processes(
            _rank, args=(tp, args, os.path.join(tmp, "rendezvous"), results), nprocs=tp, start_method="spawn"
        )
        out = results.get(timeout=5)
    median = statistics.median(out["times"])
    return {
        "tp": tp,
        "threads_per_rank": out["threads"],
        "median_step_ms": median * 1000,
        "min_step_ms": min(out["times"]) * 1000,
        "tokens_per_s": args.mbs * args.seq / median,
        "params_per_rank": out["params_per_rank"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--dropout",
        type=float,
        default=None,
        help="hidden and attention dropout (default: the preset's, 0.1 for gpt2, 0 for llama)",
    )
    args = parser.parse_args()

    rows = [run(tp, args) for tp in args.tp]
    dropout = "preset" if args.dropout is None else args.dropout
    print(
        f"{args.model}: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
        f"mbs {args.mbs}, vocab {args.vocab}, dropout {dropout}, sequence parallel {args.sequence_parallel}, "
        f"{os.cpu_count()} cores, median of {args.steps} steps"
    )
    print(f"{'TP':>3}{'threads/rank':>14}{'params/rank':>13}{'median ms':>11}{'min ms':>9}{'tokens/s':>11}")
    for row in rows:
        print(
            f"{row['tp']:>3}{row['threads_per_rank']:>14}{row['params_per_rank']:>13,}"
            f"{row['median_step_ms']:>11.1f}{row['min_step_ms']:>9.1f}{row['tokens_per_s']:>11.0f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "bench_model",
                "model": args.model,
                "hidden": args.hidden,
                "layers": args.layers,
                "seq": args.seq,
                "mbs": args.mbs,
                "vocab": args.vocab,
                "dropout": dropout,
                "sequence_parallel": args.sequence_parallel,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()

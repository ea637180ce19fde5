"""Context parallelism: saved activations per rank, and how well the ring hides its transfers.

``--world`` spawned ranks (4; gloo on CPU, NCCL on GPUs) train a small LLaMA (RoPE, GQA) on one long sequence.

* **Memory.** The bytes autograd saves for backward during one forward (``saved_tensors_hooks``,
  each storage counted once, parameters left out), per rank, at CP = 1 (every rank holds the whole
  sequence) and at CP = ``--cp`` (each holds ``seq / CP`` tokens). The goal at CP = 4 is <= 0.3x.
* **Overlap.** With ``--cp-comm-type p2p`` each attention layer runs a ring: while a block's
  attention is computed, the next key/value block is already on its way. Per training step (forward
  and backward), the seconds spent computing attention blocks against the seconds spent waiting for
  a block that had not arrived yet (``ring_timings``; each the largest over the ranks), and their
  ratio per step; the table gives medians over ``--steps`` steps, the JSON line every step's ratio
  too. A ratio near 0 means the transfers hide behind the computation. ``--measure`` picks one half:
  the bytes are exact whatever the load, the times need a quiet machine.

    python tools/bench/context_parallel.py
    python tools/bench/context_parallel.py --measure memory          # exact bytes: needs no quiet machine
    flock /work/coord/bench.lock python tools/bench/context_parallel.py --measure overlap --steps 7
    flock /work/coord/bench.lock python tools/bench/context_parallel.py --measure overlap --world 2 --cp 2
    python tools/bench/context_parallel.py --seq 8192 --hidden 256 --layers 2 --steps 5

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from core import parallel_state
from core.device import current_device
from core.tensor_parallel import model_parallel_seed
from core.transformer.context_parallel import get_batch_on_this_cp_rank, ring_timings
from models.gpt import GPTModel, llama_config
from tools.bench.args import add_int_flags, benchmark_parser
from tools.bench.ranks import init_rank, spawn


def _model(args: argparse.Namespace, cp: int) -> GPTModel:
    config = llama_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        ffn_hidden_size=args.hidden * 3,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=cp,
        cp_comm_type=args.cp_comm_type,
    )
    return GPTModel(config, args.vocab, args.seq).to(current_device())


def _batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    return {k: v.to(current_device()) for k, v in get_batch_on_this_cp_rank(batch).items()}


def saved_activation_bytes(model: GPTModel, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd keeps for backward during one forward: each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(batch["tokens"], labels=batch["labels"]).sum()
    loss.backward()
    return sum(seen.values())


def _timed_steps(
    model: GPTModel, batch: dict[str, torch.Tensor], steps: int
) -> list[tuple[float, float, float]]:
    """(step, attention, waiting) seconds per step, each the largest over the ranks."""
    out = []
    for _ in range(steps):
        dist.barrier()
        with ring_timings() as timings:
            start = time.perf_counter()
            model(batch["tokens"], labels=batch["labels"]).sum().backward()
            elapsed = time.perf_counter() - start
        row = torch.tensor([elapsed, timings.attention, timings.waiting], dtype=torch.float64)
        dist.all_reduce(row, op=dist.ReduceOp.MAX)
        out.append(tuple(row.tolist()))
    return out


def _rank(rank: int, args: argparse.Namespace, init_file: str, results) -> None:
    init_rank(rank, args.world, init_file, threads=1)
    report = {"memory": {}, "overlap": {}}
    for cp in sorted({1, 2, args.cp} if args.measure != "overlap" else {2, args.cp}):
        if args.world % cp:
            continue
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        model_parallel_seed(1234)
        model, batch = _model(args, cp), _batch(args)
        if args.measure in ("memory", "both"):
            nbytes = torch.tensor([saved_activation_bytes(model, batch)], dtype=torch.float64)
            dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)
            report["memory"][cp] = nbytes.item()
        if cp > 1 and args.cp_comm_type == "p2p" and args.measure in ("overlap", "both"):
            _timed_steps(model, batch, args.warmup)
            report["overlap"][cp] = _timed_steps(model, batch, args.steps)
        parallel_state.destroy_model_parallel()
    if rank == 0:
        results.put(report)
    dist.destroy_process_group()


def _print_memory(memory: dict[int, float]) -> None:
    print(f"{'saved activations per rank':<28}{'MiB':>10}{'vs CP=1':>10}")
    for cp, nbytes in memory.items():
        print(f"{f'CP={cp}':<28}{nbytes / 2**20:>10.1f}{nbytes / memory[1]:>10.3f}")


def _print_overlap(per_cp: dict[int, list[tuple[float, float, float]]]) -> dict[int, dict[str, float]]:
    """The ring's table (medians over the steps) and its JSON form."""
    print(f"{'ring, per step (medians)':<28}{'step ms':>10}{'attn ms':>10}{'wait ms':>10}{'wait/attn':>11}")
    overlap = {}
    for cp, rows in per_cp.items():
        step, attention, waiting = (statistics.median(column) for column in zip(*rows))
        ratios = [w / a for _, a, w in rows]
        overlap[cp] = {
            "step_ms": round(step * 1000, 1),
            "attention_ms": round(attention * 1000, 1),
            "waiting_ms": round(waiting * 1000, 1),
            "waiting_over_attention": round(statistics.median(ratios), 4),
            "waiting_over_attention_per_step": [round(r, 4) for r in ratios],
        }
        print(
            f"{f'CP={cp}':<28}{step * 1000:>10.1f}{attention * 1000:>10.1f}{waiting * 1000:>10.1f}"
            f"{overlap[cp]['waiting_over_attention']:>11.3f}"
        )
    return overlap


def main(argv=None) -> dict:
    parser = benchmark_parser(__doc__, seq=4096, layers=2, hidden=128, heads=4, groups=2, vocab=512)
    parser.add_argument("--cp", type=int, default=4, choices=(2, 4))
    parser.add_argument(
        "--world",
        type=int,
        default=4,
        choices=(2, 4),
        help="ranks (spawned processes); on a 2-core machine --world 2 --cp 2 gives each rank a core",
    )
    parser.add_argument("--cp-comm-type", default="p2p", choices=("p2p", "a2a", "allgather"))
    add_int_flags(parser, steps=5, warmup=1)
    parser.add_argument(
        "--measure",
        default="both",
        choices=("memory", "overlap", "both"),
        help="saved activations (exact, load does not matter), the ring's timings (needs a quiet machine), or both",
    )
    args = parser.parse_args(argv)
    if args.world % args.cp:
        parser.error(f"--cp ({args.cp}) must divide --world ({args.world})")
    report = spawn(_rank, args, world=args.world)
    print(
        f"LLaMA {args.layers} layers x hidden {args.hidden}, {args.heads} heads / {args.groups} groups, one "
        f"sequence of {args.seq} tokens, {args.world} ranks, cp_comm_type {args.cp_comm_type}"
    )
    memory = report["memory"]
    summary = {"benchmark": "bench_context_parallel", "seq": args.seq, "world": args.world}
    if memory:
        _print_memory(memory)
        summary["saved_activation_mib"] = {cp: round(b / 2**20, 2) for cp, b in memory.items()}
        summary[f"cp{args.cp}_vs_cp1_saved_activations"] = round(memory[args.cp] / memory[1], 4)
    if report["overlap"]:
        summary["ring"] = _print_overlap(report["overlap"])
    summary["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

"""MoE speed in one run: an 8-expert top-2 model against a dense model of the same active size, and
where an MoE step's time goes at expert parallelism 2.

Two spawned ranks (gloo on CPU, NCCL on GPUs), data parallel over both. Each holds two LLaMA-style
models with the same attention and the same parameters per token:

* ``dense``: an MLP of width ``topk x --expert-ffn``;
* ``moe``: ``--experts`` experts of width ``--expert-ffn``, top-``topk`` routing, split over the
  two ranks (EP = 2, each rank four experts), the ``--dispatcher`` token dispatcher.

They train taking turns, step by step (zero_grad, forward/backward over the microbatches, the
optimizer step, timed between barriers, the slower rank counting), so machine noise hits both
alike; medians over ``--steps`` after ``--warmup``. In the MoE model identity markers around each
layer's routing, dispatch, expert computation and combine record when forward and backward pass
them, which splits the step into routing (router forward and backward), dispatcher (dispatch and
combine: permutation and all-to-all, both ways) and expert compute; "other" is the rest (attention,
norms, embedding, loss, optimizer, data-parallel reduction).

    python tools/bench/moe.py
    python tools/bench/moe.py --layers 4 --hidden 256 --expert-ffn 256 --seq 128 --grouped

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
from core.distributed import DistributedDataParallelConfig
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.tensor_parallel import model_parallel_seed
from core.transformer.moe.moe_layer import MoELayer
from models.gpt import GPTModel, llama_config, parallelize_gpt, pipeline_layout
from tools.bench.args import add_int_flags, benchmark_parser
from tools.bench.ranks import init_rank, slowest_seconds, spawn, token_batches, train_step

REGIONS = ("routing", "dispatcher", "experts")
EVENTS: list[tuple[str, str, float]] = []
"""(marker, "forward" or "backward", time) of the MoE model's markers in the current step."""


class _Mark(torch.autograd.Function):
    """Identity; notes when forward and backward pass it."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        EVENTS.append((name, "forward", time.perf_counter()))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        EVENTS.append((ctx.name, "backward", time.perf_counter()))
        return grad, None


def _instrumented_forward(self: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
    """``MoELayer.forward`` with markers between its parts (the same computation)."""
    hidden = _Mark.apply(hidden, "input")
    probs, routing_map = self.router(hidden)
    probs = _Mark.apply(probs, "routed")
    tokens = hidden.reshape(-1, hidden.shape[-1])
    expert_input, counts, plan = self.token_dispatcher.dispatch(tokens, probs, routing_map)
    expert_input = _Mark.apply(expert_input, "dispatched")
    expert_output = _Mark.apply(self.experts(expert_input, counts), "computed")
    return _Mark.apply(self.token_dispatcher.combine(expert_output, plan), "combined").view_as(hidden)


def _split(events: list[tuple[str, str, float]]) -> dict[str, float]:
    """Seconds per region from one step's markers (layers in order forward, reversed backward)."""
    out = dict.fromkeys(REGIONS, 0.0)
    forward = [(n, t) for n, phase, t in events if phase == "forward"]
    for i in range(0, len(forward), 5):
        (_, t_in), (_, t_routed), (_, t_disp), (_, t_comp), (_, t_comb) = forward[i : i + 5]
        out["routing"] += t_routed - t_in
        out["dispatcher"] += (t_disp - t_routed) + (t_comb - t_comp)
        out["experts"] += t_comp - t_disp
    backward = [(n, t) for n, phase, t in events if phase == "backward"]
    at = {}
    for name, t in backward:  # backward: combined -> computed -> dispatched -> routed -> input, per layer
        at[name] = t
        if name == "input" and len(at) == 5:
            out["dispatcher"] += (at["computed"] - at["combined"]) + (at["routed"] - at["dispatched"])
            out["experts"] += at["dispatched"] - at["computed"]
            out["routing"] += at["input"] - at["routed"]
            at = {}
    return out


def _build(moe: bool, args: argparse.Namespace):
    common = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_query_groups": args.heads,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    if moe:
        config = llama_config(
            **common,
            ffn_hidden_size=args.expert_ffn,
            num_moe_experts=args.experts,
            moe_router_topk=args.topk,
            moe_aux_loss_coeff=1e-2,
            moe_token_dispatcher_type=args.dispatcher,
            moe_grouped_gemm=args.grouped,
            expert_model_parallel_size=2,
        )
    else:
        config = llama_config(**common, ffn_hidden_size=args.topk * args.expert_ffn)
    config.deallocate_pipeline_outputs = False
    ddp_config = DistributedDataParallelConfig()
    model = parallelize_gpt(
        lambda **stage: GPTModel(config, args.vocab, args.seq, **stage).to(current_device()),
        layout=pipeline_layout(config),
        ddp_config=ddp_config,
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4), model.chunks)
    return model.chunks[0], optimizer, model.schedule_hooks(optimizer)


def _rank(rank: int, args: argparse.Namespace, init_file: str, results) -> None:
    init_rank(rank, 2, init_file, threads=max(1, (os.cpu_count() or 2) // 2))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)  # DP = 2, EP = 2
    model_parallel_seed(1234)
    MoELayer.forward = _instrumented_forward
    runs = {"dense": _build(False, args), "moe": _build(True, args)}
    batches = token_batches(args.vocab, args.mbs, args.seq, args.microbatches, seed=rank)
    times: dict[str, list[float]] = {name: [] for name in runs}
    splits: list[dict[str, float]] = []
    for step in range(args.warmup + args.steps):
        for name, (ddp, optimizer, hooks) in runs.items():
            EVENTS.clear()
            elapsed = slowest_seconds(
                lambda m=ddp, o=optimizer, h=hooks: train_step(m, o, batches, args.seq, args.mbs, h)
            )
            if step >= args.warmup:
                times[name].append(elapsed)
                if name == "moe":
                    splits.append(_split(EVENTS))
    gathered = [None, None]
    dist.all_gather_object(gathered, splits)
    if rank == 0:
        results.put((times, gathered))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, layers=4, hidden=256, heads=4, experts=8, topk=2, expert_ffn=256)
    parser.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall")
    parser.add_argument("--grouped", action="store_true", help="--moe-grouped-gemm")
    add_int_flags(parser, seq=128, mbs=2, microbatches=2, vocab=4096, steps=10, warmup=2)
    return parser


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    times, splits = spawn(_rank, args)
    return report(args, times, splits)


def report(args: argparse.Namespace, times: dict[str, list[float]], splits: list[list[dict]]) -> dict:
    """The table and the JSON line."""
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = 2 * args.microbatches * args.mbs * args.seq  # per step, both data-parallel ranks
    # Per step and region, the slower rank's seconds; then the median over steps.
    region = {
        r: statistics.median(max(s[step][r] for s in splits) for step in range(len(splits[0])))
        for r in REGIONS
    }
    moe = medians["moe"]
    other = moe - sum(region.values())
    print(
        f"DP=2 on 2 ranks; {args.layers} layers x hidden {args.hidden}; dense MLP {args.topk * args.expert_ffn} "
        f"vs {args.experts} experts of {args.expert_ffn}, top-{args.topk}, EP=2 ({args.dispatcher}"
        f"{', grouped GEMM' if args.grouped else ''}); {args.microbatches} microbatches of {args.mbs} x "
        f"{args.seq} per rank; {args.steps} steps each, taking turns"
    )
    print(f"{'model':<8}{'median ms':>11}{'tokens/s':>11}{'vs dense':>10}")
    for name in ("dense", "moe"):
        print(
            f"{name:<8}{medians[name] * 1000:>11.1f}{tokens / medians[name]:>11.0f}{medians['dense'] / medians[name]:>10.3f}"
        )
    print(f"{'MoE step':<12}{'ms':>8}{'share':>8}")
    for name, seconds in (*region.items(), ("other", other)):
        print(f"{name:<12}{seconds * 1000:>8.1f}{seconds / moe:>8.1%}")
    summary = {
        "benchmark": "bench_moe",
        "median_ms": {name: round(m * 1000, 1) for name, m in medians.items()},
        "tokens_per_s": {name: round(tokens / m) for name, m in medians.items()},
        "moe_vs_dense_tokens_per_s": round(medians["dense"] / moe, 4),
        "moe_split_ms": {name: round(s * 1000, 2) for name, s in (*region.items(), ("other", other))},
        "dispatcher_share_of_step": round(region["dispatcher"] / moe, 4),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

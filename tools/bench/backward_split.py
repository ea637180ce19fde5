"""What does the zero-bubble split cost? I + W against one fused backward, on real GPT stages.

A middle pipeline stage (GPT-2 or LLaMA decoder layers, the stage input needing a gradient) runs its
forward, then either one fused backward (B) or the input-gradient pass (I) followed by the
weight-gradient pass (W) of ``core.pipeline_parallel.backward_split``; PyTorch's own
``stage_backward_input`` / ``stage_backward_weight`` (torch.distributed.pipelining) run as a third
way. The three take turns repetition by repetition, each first in turn, so machine noise hits them alike.
``(I + W) / B`` near 1 means the split recomputes nothing; the graph walk that finds where weight
branches join the input path is its only extra work.

    python tools/bench/backward_split.py
    python tools/bench/backward_split.py --hidden-size 512 --seq-length 512 --repeats 11
    python tools/bench/backward_split.py --compile inductor --cpu-time     # compiled layers (--compile)
    python tools/bench/backward_split.py --compile inductor --whole-layer  # naive: linears compiled too

With ``--compile`` the stage's layers are compiled as ``--compile`` compiles them (linear layers
eager, see ``core.transformer.compile``), the weight gradients accumulated into ``main_grad``
(``--gradient-accumulation-fusion``) unless ``--no-fusion``; ``--whole-layer`` compiles each layer
whole instead, linears included, to show what that costs: one autograd node per layer, whose whole
backward W runs a second time.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from core.transformer.transformer_block import TransformerBlock
from models.gpt.presets import gpt2_config, llama_config
from tools.bench.args import add_int_flags, benchmark_parser


def _stage(kind: str, args) -> TransformerBlock:
    common = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    if args.compile and not args.whole_layer:
        common.update(
            compile=True,
            compile_backend=args.compile,
            gradient_accumulation_fusion=not args.no_fusion,
            pipeline_schedule="zb-h1",  # compiled as for a zero-bubble schedule
        )
    config = gpt2_config(**common) if kind == "gpt" else llama_config(num_query_groups=2, **common)
    stage = TransformerBlock(config, list(range(args.num_layers)), post_process=False)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(torch.ones_like(p) if "norm.weight" in name else torch.randn_like(p) * 0.02)
    if (
        config.gradient_accumulation_fusion
    ):  # main_grad and its hooks, as the data-parallel wrapper makes them
        return DistributedDataParallel(config, DistributedDataParallelConfig(), stage)
    if args.whole_layer:
        from torch._functorch import config as functorch_config

        functorch_config.donated_buffer = False  # I keeps the graph for W
        for layer in stage.layers.values():
            layer.compile(backend=args.compile)
    return stage


CPU_TIME = False


def _timed(fn) -> float:
    clock = time.process_time if CPU_TIME else time.perf_counter
    start = clock()
    fn()
    return clock() - start


def _one_repeat(stage, x, grad, way: str) -> dict[str, float]:
    stage_input = x.clone().requires_grad_(True)
    output = stage(stage_input)
    if way == "fused":
        return {"B": _timed(lambda: fused_backward(output, grad))}
    if way == "trident":
        held = {}
        i = _timed(lambda: held.update(w=backward_input(output, grad, stage_input)[1]))
        return {"I": i, "W": _timed(lambda: backward_weight(held["w"]))}
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    held = {}
    params = list(stage.parameters())

    def torch_input():
        held["groups"] = stage_backward_input([output], [grad], [stage_input], iter(params))[1]

    i = _timed(torch_input)
    return {"I": i, "W": _timed(lambda: stage_backward_weight(iter(params), held["groups"]))}


def measure(kind: str, args) -> dict:
    torch.manual_seed(0)
    fused = _stage(kind, args)
    stages = {"fused": fused, "trident": _stage(kind, args)}
    if not args.compile:  # torch's split, for comparison, on eager stages
        stages["torch"] = _stage(kind, args)
    for stage in stages.values():
        stage.load_state_dict(fused.state_dict())
    x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size)
    grad = torch.randn_like(x)
    times: dict[str, list[dict[str, float]]] = {way: [] for way in stages}
    ways = list(stages)
    for repeat in range(args.repeats + 1):
        for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:  # each goes first in turn
            stage = stages[way]
            stage.zero_grad(set_to_none=True)
            if hasattr(stage, "zero_grad_buffer"):
                stage.zero_grad_buffer()
            result = _one_repeat(stage, x, grad, way)
            if repeat:  # the first repeat warms up allocator and kernels
                times[way].append(result)

    def median(way: str, part: str) -> float:
        return statistics.median(t[part] for t in times[way])

    def median_sum(way: str) -> float:
        return statistics.median(t["I"] + t["W"] for t in times[way])

    fused = median("fused", "B")
    nan = float("nan")
    torch_way = "torch" in times
    return {
        "model": kind,
        "fused_ms": round(fused * 1e3, 2),
        "input_ms": round(median("trident", "I") * 1e3, 2),
        "weight_ms": round(median("trident", "W") * 1e3, 2),
        "split_over_fused": round(median_sum("trident") / fused, 4),
        "torch_input_ms": round(median("torch", "I") * 1e3, 2) if torch_way else nan,
        "torch_weight_ms": round(median("torch", "W") * 1e3, 2) if torch_way else nan,
        "torch_split_over_fused": round(median_sum("torch") / fused, 4) if torch_way else nan,
    }


def main(argv=None) -> dict:
    parser = benchmark_parser(__doc__, num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=256)
    add_int_flags(parser, micro_batch_size=4, repeats=15, threads=1)
    parser.add_argument("--compile", default=None, help="compile the layers with this torch.compile backend")
    parser.add_argument("--whole-layer", action="store_true", help="with --compile: linears compiled too")
    parser.add_argument(
        "--no-fusion", action="store_true", help="with --compile: no gradient accumulation fusion"
    )
    parser.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time")
    args = parser.parse_args(argv)
    global CPU_TIME
    CPU_TIME = args.cpu_time
    torch.set_num_threads(args.threads)
    rows = [measure(kind, args) for kind in ("gpt", "llama")]
    print(
        f"middle stage: {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length} x batch "
        f"{args.micro_batch_size}, {args.threads} thread(s), median of {args.repeats}; load {os.getloadavg()[0]:.1f}; "
        f"compile {args.compile or 'off'}{' (whole layers)' if args.whole_layer else ''}, "
        f"{'CPU' if args.cpu_time else 'wall'} time"
    )
    print(
        f"{'model':<7}{'B ms':>9}{'I ms':>9}{'W ms':>9}{'(I+W)/B':>9}{'torch I':>9}{'torch W':>9}{'(I+W)/B':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<7}{r['fused_ms']:>9.1f}{r['input_ms']:>9.1f}{r['weight_ms']:>9.1f}"
            f"{r['split_over_fused']:>9.3f}{r['torch_input_ms']:>9.1f}{r['torch_weight_ms']:>9.1f}"
            f"{r['torch_split_over_fused']:>9.3f}"
        )
    summary = {
        "benchmark": "bench_backward_split",
        "load": os.getloadavg()[0],
        "args": vars(args),
        "results": rows,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

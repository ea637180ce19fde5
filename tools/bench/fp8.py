"""FP8 against bf16: tokens/s and peak memory of ``pretrain_gpt.py``, and the loss gap over a run.

Every contestant is a real ``pretrain_gpt.py`` run (``torchrun`` when ``--nproc`` > 1) with
``--log-interval 1``; the figures are read from its log lines. Contestants run one after another
on the same data, from the same initial weights (same ``--seed``).

    python tools/bench/fp8.py speed --device cuda                       # Llama-3-8B-shaped stack, compiled
    python tools/bench/fp8.py speed --device cuda --config llama-1b
    python tools/bench/fp8.py loss --config small-llama --iters 300     # CPU: the loss gap on real text
    python tools/bench/fp8.py layer --device cuda                       # one linear layer's three products
    python tools/bench/fp8.py loss --config small-gpt --iters 300 --nproc 4 \\
        --extra "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule zb-h1"
    python tools/bench/fp8.py loss --config small-gpt --iters 300 --nproc 4 --fp8-extra=--fp8-param-gather \\
        --extra "--use-distributed-optimizer --tensor-model-parallel-size 2 --sequence-parallel"

``speed``: bf16, FP8 tensorwise and FP8 delayed, each with ``--compile`` unless ``--no-compile``; the
first ``--warmup`` iterations (compilation) are dropped, the median of the rest gives tokens/s, and
each FP8 contestant is compared with bf16 in the same run. ``llama3-8b`` is the Llama-3 8B layer
(hidden 4096, FFN 14,336, 32 heads, GQA 8, seq 8192) stacked ``--layers`` deep (8 by default) with the
vocabulary cut to 32,768 so that the output layer (bf16 in every contestant) takes the share of the
step it takes in the 32-layer model with 128,256 tokens. ``llama-1b`` is bench_model's (16 x 2048).

``loss``: bf16, FP8 tensorwise and FP8 delayed for ``--iters`` iterations on the built-in corpus
(Python's docstrings, tokenised by Trident's SentencePiece model: real text, no download). Printed
per FP8 contestant: the largest per-iteration loss gap to bf16 (Megatron's test threshold is 0.05)
and the mean loss of the last 50 iterations against bf16's (goal: within 1%).

``layer``: one ``ColumnParallelLinear`` forward and backward at Llama-3 8B's FC1 and FC2 and LLaMA ~1B's
QKV shapes (a small one on a CPU): bf16, FP8 with eager casts and FP8 with compiled casts, timed on the
device (``TRIDENT_BENCH_PROFILE=1`` prints the compiled run's kernels).

``TRIDENT_BENCH_LOG=FILE`` appends each contestant's command and the tail of its output to FILE.

Prints a table, then one JSON line (``{"bench_fp8": ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.bench.args import llama_flags

CONFIGS = {
    "llama3-8b": {
        "layers": 8,
        "hidden": 4096,
        "ffn": 14336,
        "heads": 32,
        "groups": 8,
        "seq": 8192,
        "vocab": 32768,
        "mbs": 1,
        "gbs": 1,
    },
    "llama-1b": {
        "layers": 16,
        "hidden": 2048,
        "ffn": 8192,
        "heads": 32,
        "groups": 8,
        "seq": 4096,
        "vocab": 128256,
        "mbs": 1,
        "gbs": 1,
    },
    "gpu-llama": {
        "layers": 8,
        "hidden": 1024,
        "ffn": 2816,
        "heads": 16,
        "groups": 4,
        "seq": 1024,
        "mbs": 8,
        "gbs": 32,
    },
    "tiny-llama": {
        "layers": 2,
        "hidden": 64,
        "ffn": 160,
        "heads": 4,
        "groups": 2,
        "seq": 64,
        "vocab": 512,
        "mbs": 2,
        "gbs": 4,
    },
    "small-llama": {
        "layers": 4,
        "hidden": 128,
        "ffn": 352,
        "heads": 4,
        "groups": 2,
        "seq": 128,
        "mbs": 4,
        "gbs": 16,
    },
    "small-gpt": {
        "layers": 4,
        "hidden": 128,
        "ffn": 512,
        "heads": 4,
        "seq": 128,
        "mbs": 4,
        "gbs": 16,
        "arch": "gpt",
    },
}
CONTESTANTS = {
    "bf16": [],
    "fp8 tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8 delayed": [
        "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
        "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max",
    ],
    "fp8 blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}  # fmt: skip
_FIELDS = {
    "ms": r"elapsed time per iteration \(ms\): ([\d.]+)",
    "loss": r"lm loss: ([\d.E+-]+)",
    "peak_mib": r"peak memory per rank \(MB\): (\d+)",
}


def model_flags(spec: dict) -> list[str]:
    """The configuration's model and batch flags."""
    flags = (
        f"--num-layers {spec['layers']} --hidden-size {spec['hidden']} --num-attention-heads {spec['heads']} "
        f"--seq-length {spec['seq']} --max-position-embeddings {spec['seq']} "
        f"--micro-batch-size {spec['mbs']} --global-batch-size {spec['gbs']}"
    ).split()
    if spec.get("arch", "llama") == "llama":
        return flags + llama_flags(spec["ffn"], spec["groups"])
    return flags + ["--ffn-hidden-size", str(spec["ffn"])]


def command(spec: dict, args: argparse.Namespace, contestant: str, iters: int) -> list[str]:
    """The contestant's command line: the model, its data, bf16, the FP8 flags and ``--extra``."""
    flags = model_flags(spec) + [
        "--train-iters", str(iters), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(min(10, iters // 10)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--seed", "1234",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10**6),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
    ]  # fmt: skip
    if "vocab" in spec and "--data-path" not in args.extra:  # mock tokens of the configuration's vocabulary
        flags += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec["vocab"] - 1)]
    if args.mode == "speed":
        flags += [
            "--cross-entropy-loss-fusion",
            "--gradient-accumulation-fusion",
            "--use-distributed-optimizer",
        ]
        if not args.no_compile:
            flags += ["--compile"]
    flags += CONTESTANTS[contestant] + shlex.split(args.extra)
    if contestant != "bf16":
        flags += shlex.split(args.fp8_extra)
    if args.nproc > 1:
        return ["torchrun", "--nproc-per-node", str(args.nproc), "pretrain_gpt.py", *flags]
    return [sys.executable, "pretrain_gpt.py", *flags]


def run_contestant(cmd: list[str], limit: float) -> dict:
    """Run one command; per-iteration figures from its log lines, or the reason it has none."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {limit:.0f} s"}
    out: dict = {key: [] for key in _FIELDS}
    for line in done.stdout.splitlines():
        if " iteration " not in line or "lm loss" not in line:
            continue
        for key, pattern in _FIELDS.items():
            match = re.search(pattern, line)
            if match:
                out[key].append(float(match.group(1)))
    out["seconds"] = time.perf_counter() - start
    log = os.environ.get("TRIDENT_BENCH_LOG")  # a file that collects every contestant's output tail
    if log:
        with open(log, "a") as f:
            tail = (done.stdout + done.stderr).splitlines()[-40:]
            f.write(f"==== {shlex.join(cmd)}\n" + "\n".join(tail) + "\n")
    if done.returncode != 0 or not out["loss"]:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        out["error"] = f"exit {done.returncode}: " + " | ".join(tail)
    return out


def speed_rows(spec: dict, runs: dict, args: argparse.Namespace) -> list[dict]:
    tokens = spec["gbs"] * spec["seq"]
    rows = []
    for name, run in runs.items():
        if "error" in run:
            rows.append({"contestant": name, "error": run["error"]})
            continue
        timed = run["ms"][args.warmup :] or run["ms"][-1:]
        ms = statistics.median(timed)
        rows.append(
            {
                "contestant": name,
                "step_ms": ms,
                "tokens_per_s": tokens / ms * 1000,
                "peak_mib": max(run["peak_mib"], default=0),
                "iters_timed": len(timed),
            }
        )
    base = next((r for r in rows if r["contestant"] == "bf16" and "step_ms" in r), None)
    for row in rows:
        if base is not None and "step_ms" in row:
            row["vs_bf16"] = base["step_ms"] / row["step_ms"]
            row["peak_vs_bf16"] = row["peak_mib"] / base["peak_mib"] if base["peak_mib"] else None
    return rows


def loss_rows(runs: dict) -> list[dict]:
    base = runs.get("bf16", {})
    rows = []
    for name, run in runs.items():
        if "error" in run:
            rows.append({"contestant": name, "error": run["error"]})
            continue
        row = {
            "contestant": name,
            "iters": len(run["loss"]),
            "final_loss": run["loss"][-1],
            "losses": run["loss"],
        }
        last = run["loss"][-50:]
        row["last50_mean"] = statistics.fmean(last)
        if name != "bf16" and base.get("loss"):
            n = min(len(base["loss"]), len(run["loss"]))
            gaps = [abs(a - b) for a, b in zip(base["loss"][:n], run["loss"][:n])]
            row["max_gap"] = max(gaps)
            row["max_gap_iter"] = gaps.index(row["max_gap"]) + 1
            row["max_gap_after_50"] = max(gaps[50:], default=None)
            ref = statistics.fmean(base["loss"][-50:])
            row["last50_vs_bf16"] = row["last50_mean"] / ref - 1
        rows.append(row)
    return rows


def print_table(args: argparse.Namespace, rows: list[dict], load: float) -> None:
    print(f"bench_fp8 {args.mode} | {args.config} | {args.device} | nproc {args.nproc} | load {load:.2f}")
    if args.extra:
        print(f"  extra flags: {args.extra}")
    if args.fp8_extra:
        print(f"  FP8 contestants only: {args.fp8_extra}")
    for row in rows:
        if "error" in row:
            print(f"  {row['contestant']:<16} error: {row['error']}")
        elif args.mode == "speed":
            ratio = f"{row['vs_bf16']:.3f}x" if "vs_bf16" in row else "n/a"
            print(
                f"  {row['contestant']:<16} {row['step_ms']:>10.1f} ms {row['tokens_per_s']:>10.0f} tok/s "
                f"{ratio:>8} vs bf16 | peak {row['peak_mib']:.0f} MiB ({row['iters_timed']} iterations timed)"
            )
        else:
            gap = (
                f"max gap {row['max_gap']:.4f} (iteration {row['max_gap_iter']}; after iteration 50: "
                f"{row['max_gap_after_50'] or 0:.4f}), last 50 "
                f"{row['last50_vs_bf16']:+.3%} vs bf16"
                if "max_gap" in row
                else "reference"
            )
            print(
                f"  {row['contestant']:<16} {row['iters']} iterations, final {row['final_loss']:.4f}, "
                f"last-50 mean {row['last50_mean']:.4f} | {gap}"
            )


LAYER_SHAPES = [  # (tokens, in, out): Llama-3 8B's fc1 and fc2 at seq 8192, LLaMA ~1B's qkv at seq 4096
    (8192, 4096, 28672),
    (8192, 14336, 4096),
    (4096, 2048, 3072),
]


def layer_rows(device: str, repeats: int) -> list[dict]:
    """One ``ColumnParallelLinear`` forward and backward per shape: bf16, FP8 with eager casts and FP8
    with compiled casts, timed on the device; with ``TRIDENT_BENCH_PROFILE`` set, the compiled FP8
    run's kernels are printed."""
    import torch

    from core.device import building_on
    from core.tensor_parallel import ColumnParallelLinear
    from core.tensor_parallel.fp8 import Fp8Recipe, compile_fp8_casts
    from core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True)
    dev = torch.device(device)
    rows = []

    def timed(layer, x, grad) -> float:
        def step():
            x.grad = None
            layer.weight.grad = None
            layer(x)[0].backward(grad)

        for _ in range(3):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats * 1000

    for tokens, k, n in LAYER_SHAPES if device == "cuda" else [(256, 256, 512)]:
        with building_on(dev):
            layer = ColumnParallelLinear(k, n, config=cfg, init_method=torch.nn.init.zeros_, bias=False)
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
        row = {"shape": f"{tokens}x{k}x{n}", "bf16_ms": timed(layer, x, grad)}
        flops = 6 * tokens * k * n
        with building_on(dev):
            layer.enable_fp8(Fp8Recipe(format="hybrid", scaling="tensorwise"))
        row["fp8_eager_casts_ms"] = timed(layer, x, grad)
        compile_fp8_casts([layer])
        row["fp8_compiled_casts_ms"] = timed(layer, x, grad)
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        row["fp8_tflops"] = flops / row["fp8_compiled_casts_ms"] / 1e9
        if os.environ.get("TRIDENT_BENCH_PROFILE") and dev.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    layer(x)[0].backward(grad)
                torch.cuda.synchronize()
            print(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
            )
        rows.append(row)
        print(
            f"  {row['shape']:<18} bf16 {row['bf16_ms']:.3f} ms ({row['bf16_tflops']:.0f} TFLOP/s) | fp8 eager "
            f"casts {row['fp8_eager_casts_ms']:.3f} ms | fp8 compiled casts {row['fp8_compiled_casts_ms']:.3f} ms "
            f"({row['fp8_tflops']:.0f} TFLOP/s, {row['bf16_ms'] / row['fp8_compiled_casts_ms']:.2f}x)"
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["speed", "loss", "layer"])
    parser.add_argument("--config", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=None, help="override the configuration's layers")
    parser.add_argument("--iters", type=int, default=None, help="iterations (speed: 12, loss: 300)")
    parser.add_argument("--warmup", type=int, default=4, help="speed: leading iterations not timed")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) per contestant")
    parser.add_argument("--no-compile", action="store_true", help="speed: eager contestants")
    parser.add_argument(
        "--contestants",
        nargs="+",
        default=["bf16", "fp8 tensorwise", "fp8 delayed"],
        choices=list(CONTESTANTS),
    )
    parser.add_argument("--extra", default="", help="flags added to every contestant's command line")
    parser.add_argument(
        "--fp8-extra", default="", help="flags added to the FP8 contestants only (--fp8-param-gather)"
    )
    parser.add_argument("--limit", type=float, default=600.0, help="seconds each contestant may run")
    args = parser.parse_args(argv)
    args.config = args.config or ("llama3-8b" if args.mode == "speed" else "small-llama")
    spec = dict(CONFIGS[args.config])
    if args.layers:
        spec["layers"] = args.layers
    iters = args.iters or (12 if args.mode == "speed" else 300)
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if args.mode == "layer":
        rows = layer_rows(args.device, 20)
        print(json.dumps({"bench_fp8": {"mode": "layer", "device": args.device}, "rows": rows}))
        return {"rows": rows}
    runs = {}
    for name in args.contestants:
        runs[name] = run_contestant(command(spec, args, name, iters), args.limit)
    rows = speed_rows(spec, runs, args) if args.mode == "speed" else loss_rows(runs)
    load = os.getloadavg()[0]
    print_table(args, rows, load)
    result = {"bench_fp8": {"mode": args.mode, "config": args.config, "spec": spec, "device": args.device,
                            "nproc": args.nproc, "extra": args.extra, "load": load}, "rows": rows}  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

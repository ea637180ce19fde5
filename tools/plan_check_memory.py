"""Check the planner's memory model: against the fake-tensor dry run, and the dry run against a real run.

    python tools/plan_check_memory.py model            # LLaMA-3 8B TP2xPP4xDP8, 70B TP8xPP8 VPP2 + dist-opt,
                                                       # GPT-3 175B TP8xPP16: every pipeline rank, model vs
                                                       # dry run, with Megatron's theoretical formula beside them
    python tools/plan_check_memory.py model --config llama3-8b --ranks 0 3
    python tools/plan_check_memory.py model --config llama3-70b-zero3 --ranks 0 7  # ZeRO-3, microbatch scope
    python tools/plan_check_memory.py model --config llama3-8b-selective  # where Megatron's formula
                                                       # reports activations (sequence parallel + selective)
    python tools/plan_check_memory.py real             # 4 gloo ranks, a small GPT, three layouts: the real
                                                       # run's tracked live tensor bytes vs the dry run, per rank
    python tools/plan_check_memory.py gpu              # one GPU (tools/gpu_check.py runs it): a ~0.5B LLaMA
                                                       # stage, bf16: the model and the fake dry run (GPU
                                                       # kernels) vs torch.cuda.max_memory_allocated of a real step

``gpu`` plans and runs one stage (world size 1) on this machine's GPU: the planner's figure (GPU kernels),
the dry run under fake tensors placed on the GPU, and the same step for real on NCCL, where the CUDA
caching allocator's ``max_memory_allocated`` from the step's start (and the dry run's counter of live
bytes, run on the real tensors) are measured; ``--device cpu --quick`` runs the same path on the CPU
with a tiny model, where only the counter measures. ``model`` compares per pipeline rank the model's peak (with the CPU's attention kernels, which the dry
run runs) with the dry run's; ``real`` runs ``pretrain_gpt.py`` under ``torchrun`` with every rank's
tensors counted by the same :class:`~planner.live_bytes.LiveBytes` the dry run uses, takes the
peak of the third iteration, and dry-runs the same flags. Each prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.pipeline_parallel.layout import even_layout
from planner.candidate import Candidate
from planner.inputs import read_input

GB = 1e9

CONFIGS = {
    # preset, flags, candidate. Global batches are cut to a few microbatches per stage: peaks do not
    # depend on the count once every schedule's warm-up is full, and fake steps cost time per op.
    "llama3-8b": (
        "llama3-8b",
        ["--global-batch-size", "128"],
        {"tp": 2, "pp": 4, "dp": 8, "num_microbatches": 16},
    ),
    "llama3-70b": (
        "llama3-70b",
        ["--global-batch-size", "128"],
        {"tp": 8, "pp": 8, "dp": 8, "vpp": 2, "num_microbatches": 16, "dp_sharding": "optim"},
    ),
    # ZeRO-3 at microbatch scope under pipelining: only the units in flight gathered (the model charges
    # them at the activation peak, an upper bound: tests/unit/test_plan_dry_run.py says why)
    "llama3-70b-zero3": (
        "llama3-70b",
        ["--global-batch-size", "128"],
        {
            "tp": 8,
            "pp": 8,
            "dp": 8,
            "vpp": 2,
            "num_microbatches": 16,
            "dp_sharding": "optim_grads_params",
            "dp_sharding_scope": "microbatch",
        },
    ),
    "gpt3-175b": (
        "gpt3-175b",
        ["--global-batch-size", "256"],
        {"tp": 8, "pp": 16, "dp": 8, "num_microbatches": 32},
    ),
    # FP8 products (tensorwise): FP8 saved inputs and the weights' FP8 copies
    "llama3-8b-fp8": (
        "llama3-8b",
        ["--global-batch-size", "128", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
        {"tp": 2, "pp": 4, "dp": 8, "num_microbatches": 16},
    ),
    # the one setting Megatron's formula reports activations for: sequence parallel + selective
    "llama3-8b-selective": (
        "llama3-8b",
        ["--global-batch-size", "128"],
        {"tp": 2, "pp": 4, "dp": 8, "num_microbatches": 16, "recompute": "selective"},
    ),
}
DEFAULT = ["llama3-8b", "llama3-70b", "gpt3-175b"]

SMALL_GPT = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--vocab-size 8191 --global-batch-size 16 --hidden-dropout 0.1 --attention-dropout 0.1 --bf16"
)
REAL_LAYOUTS = {
    "PP4 1F1B": {"tp": 1, "pp": 4, "dp": 1, "micro_batch_size": 2, "num_microbatches": 8},
    "TP2xPP2 zb-h1, selective": {
        "tp": 2, "pp": 2, "dp": 1, "schedule": "zb-h1", "recompute": "selective", "micro_batch_size": 2,
        "num_microbatches": 8,
    },
    "PP2xVPP2xDP2 dist-opt": {
        "tp": 1, "pp": 2, "dp": 2, "vpp": 2, "micro_batch_size": 2, "num_microbatches": 4,
        "dp_sharding": "optim",
    },
}  # fmt: skip


def _candidate(spec, fields: dict) -> Candidate:
    cand = Candidate(**{"micro_batch_size": 1, **fields})
    placement = cand.rule.placement
    return replace(cand, layout=even_layout(spec.num_layers, cand.pp, cand.vpp, placement).to_string())


def check_model(names: list[str], ranks: list[int] | None) -> list[dict]:
    from planner.dry_run import dry_run
    from planner.megatron_formula import megatron_memory
    from planner.memory import rank_memory
    from planner.report import candidate_args
    from pretrain_gpt import forward_step

    rows = []
    for name in names:
        preset, flags, fields = CONFIGS[name]
        plan_input = read_input(flags, preset=preset)
        spec, cand = plan_input.spec, _candidate(plan_input.spec, fields)
        argv = candidate_args(plan_input.base_flags, cand)
        megatron = megatron_memory(spec, cand)
        first = rank_memory(spec, cand, 0)
        print(f"{name} {cand.split()} {cand.schedule_label} mbs {cand.micro_batch_size} {cand.recompute}: first stage, "
              f"Megatron's formula {megatron['weights_and_optimizer'] / GB:.2f} GB weights+optimizer + "
              f"{megatron['activations'] / GB:.2f} GB activations; the model (GPU kernels) {first.static / GB:.2f} + "
              f"{(first.activations + first.transient + first.buffers) / GB:.2f} GB at the schedule's peak, "
              f"{first.peak / GB:.2f} GB in all", flush=True)  # fmt: skip
        for rank in ranks if ranks is not None else range(cand.pp):
            started = time.perf_counter()
            model = rank_memory(spec, cand, rank, device="cpu")
            gpu = rank_memory(spec, cand, rank, device="cuda")
            measured = dry_run(argv, world_size=cand.world_size, pp_rank=rank, vocab_size=spec.vocab_size,
                               forward_step_func=forward_step)  # fmt: skip
            row = {
                "config": name, "split": cand.split(), "pp_rank": rank, "dry_run_peak": measured.peak,
                "model_peak": model.peak, "model_peak_gpu_kernels": gpu.peak, "ratio": model.peak / measured.peak,
                "dry_run": measured.as_dict(), "megatron": megatron,
                "seconds": time.perf_counter() - started,
            }  # fmt: skip
            rows.append(row)
            print(f"  pp rank {rank:2d}: dry run {measured.peak / GB:7.2f} GB  model {model.peak / GB:7.2f} GB "
                  f"({row['ratio'] - 1:+.2%})  static {measured.static / GB:.2f} GB  "
                  f"[{row['seconds']:.0f} s]", flush=True)  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------------
# The dry run against a real run
# --------------------------------------------------------------------------------------------------


def _worker(out_dir: str) -> None:
    """One ``torchrun`` rank: ``pretrain_gpt`` with its tensors counted; the third iteration's peak."""
    import torch.distributed as dist

    import pretrain_gpt
    from planner.live_bytes import LiveBytes
    from training import pretrain

    tracker = LiveBytes()
    found: dict = {}

    def hook(state) -> None:
        if state.iteration == 2:
            tracker.reset_peak()
        elif state.iteration == 3:
            found["peak"] = tracker.peak
            found["rank"] = dist.get_rank()
            from core import parallel_state as ps

            found["pp_rank"] = ps.get_pipeline_model_parallel_rank()

    argv = sys.argv[sys.argv.index("--") + 1 :]
    with tracker:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=argv, tokenizer_provider=pretrain_gpt.tokenizer_provider,
                 iteration_hook=hook)  # fmt: skip
    with open(os.path.join(out_dir, f"rank{found['rank']}.json"), "w") as f:
        json.dump(found, f)


def check_real(layouts: dict | None = None) -> list[dict]:
    from planner.dry_run import dry_run
    from planner.report import candidate_args
    from pretrain_gpt import forward_step

    plan_input = read_input(SMALL_GPT.split())
    rows = []
    for name, fields in (layouts or REAL_LAYOUTS).items():
        cand = _candidate(plan_input.spec, fields)
        argv = candidate_args(plan_input.base_flags, cand) + ["--train-iters", "3", "--eval-iters", "0",
                                                              "--num-workers", "0", "--log-interval", "1"]  # fmt: skip
        with tempfile.TemporaryDirectory() as out:
            command = ["torchrun", "--nproc-per-node", "4", __file__, "--worker", out, "--", *argv]
            subprocess.run(
                command, check=True, env={**os.environ, "PYTHONPATH": _root()}, capture_output=True
            )
            real = []
            for r in range(4):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    real.append(json.load(f))
        dry = {}
        for pp_rank in sorted({r["pp_rank"] for r in real}):
            dry[pp_rank] = dry_run(argv, world_size=4, pp_rank=pp_rank, vocab_size=plan_input.spec.vocab_size,
                                   forward_step_func=forward_step).peak  # fmt: skip
        print(f"{name} ({cand.split()} {cand.schedule_label}):", flush=True)
        for r in real:
            ratio = dry[r["pp_rank"]] / r["peak"]
            rows.append({"layout": name, "rank": r["rank"], "pp_rank": r["pp_rank"], "real_peak": r["peak"],
                         "dry_run_peak": dry[r["pp_rank"]], "ratio": ratio})  # fmt: skip
            print(f"  rank {r['rank']} (pp {r['pp_rank']}): real {r['peak'] / 1e6:8.2f} MB  dry run "
                  f"{dry[r['pp_rank']] / 1e6:8.2f} MB  ({ratio - 1:+.2%})", flush=True)  # fmt: skip
    return rows


GPU_LLAMA = (
    "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
    "--ffn-hidden-size 5632 --seq-length 2048 --max-position-embeddings 2048 --vocab-size 31999 "
    "--global-batch-size 4 --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16"
)
TINY_LLAMA = GPU_LLAMA.replace(
    "--num-layers 8 --hidden-size 2048", "--num-layers 2 --hidden-size 256"
).replace(
    "--ffn-hidden-size 5632 --seq-length 2048 --max-position-embeddings 2048 --vocab-size 31999",
    "--ffn-hidden-size 704 --seq-length 128 --max-position-embeddings 128 --vocab-size 1023",
)
GPU_LAYOUTS = {
    "mbs 2 x 2 microbatches": {"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 2, "num_microbatches": 2},
    "same, selective recompute": {
        "tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 2, "num_microbatches": 2, "recompute": "selective",
    },
    "same, distributed optimizer": {
        "tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 2, "num_microbatches": 2, "dp_sharding": "optim",
    },
}  # fmt: skip


def _one_line(err: Exception) -> str:
    """An exception as one table cell: its type and its message's first line."""
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:200]}"


def check_gpu(device: str, quick: bool) -> list[dict]:
    """Per layout of :data:`GPU_LAYOUTS`, one stage at world size 1: the model's peak, the fake dry
    run's on ``device``, and the same step run for real (live bytes counted; on a GPU the allocator's
    ``max_memory_allocated`` from the step's start). A failure is a row's error, not the end."""
    import gc

    import torch
    import torch.distributed as dist

    from planner.dry_run import dry_run
    from planner.memory import rank_memory
    from planner.report import candidate_args
    from pretrain_gpt import forward_step

    plan_input = read_input((TINY_LLAMA if quick else GPU_LLAMA).split())
    spec, cuda = plan_input.spec, device == "cuda"
    cases = []
    for name, fields in GPU_LAYOUTS.items():
        cand = _candidate(spec, fields)
        argv = candidate_args(plan_input.base_flags, cand)
        row = {"layout": name, "model_peak": rank_memory(spec, cand, 0, device=device).peak}
        try:  # fake tensors on this device: its kernels decide what attention keeps
            row["dry_run_peak"] = dry_run(argv, world_size=1, pp_rank=0, vocab_size=spec.vocab_size,
                                          forward_step_func=forward_step, device=device).peak  # fmt: skip
        except Exception as err:  # noqa: BLE001 -- a row of the table, the next measurement still runs
            row["dry_run_error"] = _one_line(err)
        cases.append((row, argv))
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1
    )
    try:
        for row, argv in cases:
            if cuda:
                torch.cuda.set_device(0)
            try:
                counted = dry_run(argv, world_size=1, pp_rank=0, vocab_size=spec.vocab_size,
                                  forward_step_func=forward_step, fake=False,
                                  step_started=torch.cuda.reset_peak_memory_stats if cuda else None)  # fmt: skip
                row["live_bytes_peak"] = counted.peak
                if cuda:
                    row["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
            except Exception as err:  # noqa: BLE001
                row["real_error"] = _one_line(err)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            real = row.get("cuda_max_allocated", row.get("live_bytes_peak"))
            for key in ("model_peak", "dry_run_peak", "live_bytes_peak"):
                if real and key in row:
                    row[f"{key}_vs_real"] = row[key] / real
            figures = "  ".join(f"{k} {row[k] / GB:.3f} GB" for k in
                                ("model_peak", "dry_run_peak", "live_bytes_peak", "cuda_max_allocated") if k in row)  # fmt: skip
            print(f"{row['layout']}: {figures}", flush=True)
            for key in ("dry_run_error", "real_error"):
                if key in row:
                    print(f"  {key}: {row[key]}", flush=True)
    finally:
        dist.destroy_process_group()
    return [row for row, _ in cases]


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    if "--worker" in sys.argv:
        _worker(sys.argv[sys.argv.index("--worker") + 1])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["model", "real", "gpu"])
    parser.add_argument("--config", nargs="*", choices=list(CONFIGS), default=DEFAULT)
    parser.add_argument("--ranks", nargs="*", type=int, help="pipeline ranks (default: all)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="gpu: where to run")
    parser.add_argument("--quick", action="store_true", help="gpu: a tiny model (the CPU mode)")
    args = parser.parse_args()
    if args.what == "gpu":
        rows = check_gpu(args.device, args.quick)
        ratios = [r[k] for r in rows for k in ("model_peak_vs_real", "dry_run_peak_vs_real") if k in r]
        worst = max((abs(x - 1) for x in ratios), default=None)
        print(json.dumps({"check": "gpu", "device": args.device, "rows": rows, "largest_difference": worst}))
        return
    rows = check_model(args.config, args.ranks) if args.what == "model" else check_real()
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"largest difference: {worst:.2%} over {len(rows)} ranks; load average {os.getloadavg()[0]:.1f}")
    print(json.dumps({"check": args.what, "rows": rows, "largest_difference": worst}))


if __name__ == "__main__":
    main()

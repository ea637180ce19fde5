"""``tools/plan.py``: the planner's command line. Its own flags say what cluster to plan for and what to
do; every other flag is a Megatron flag, read by the project's parser (``training/arguments/parser.py``).

    python tools/plan.py --preset llama3-8b --num-gpus 64
    python tools/plan.py --preset llama3-70b --num-gpus 512 --use-distributed-optimizer --dry-run 2
    python tools/plan.py --hf-config config.json --seq-length 4096 --global-batch-size 256 --num-gpus 32
    python tools/plan.py --num-layers 8 --hidden-size 512 ... --num-gpus 4 --profile-local
    python tools/plan.py --preset llama3-8b --num-gpus 64 --from-timeline runs/timeline
"""

from __future__ import annotations

import argparse
import sys

from planner.dry_run import dry_run_report
from planner.hardware import GPUS, Cluster
from planner.inputs import read_input
from planner.model_spec import ModelSpec, describe
from planner.profile import LocalProfile, local_cluster
from planner.rebalance import rebalance_report
from planner.report import format_table, result_json, run_rank_line
from planner.search import search

__all__ = ["describe_cluster", "main", "planner_parser"]


def planner_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/plan.py",
        description="Plan a Trident run: every split, schedule, micro-batch size, recomputation and layout "
        "that fits, ranked by simulated step time. Megatron's model and training flags (as "
        "pretrain_gpt.py takes them) describe the model; the flags below describe the cluster.",
        allow_abbrev=False,
    )
    model = parser.add_argument_group("model (or Megatron's model flags)")
    model.add_argument(
        "--preset", help="a named model: gpt3-175b, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b"
    )
    model.add_argument("--hf-config", help="a Hugging Face config.json (LLaMA or GPT-2 family)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--num-gpus", type=int, required=True, help="GPUs (ranks) in the run")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)} (peak, memory, bandwidths)")
    cluster.add_argument("--gpu-memory-gb", type=float, help="override the GPU's memory")
    cluster.add_argument("--peak-tflops", type=float, help="override the GPU's dense 16-bit peak")
    cluster.add_argument(
        "--peak-fp8-tflops", type=float, help="override the GPU's dense FP8 peak (--fp8-format's products)"
    )
    cluster.add_argument(
        "--peak-fp32-tflops",
        type=float,
        help="override the GPU's dense FP32 peak (--fp8-recipe blockwise's dequantised products)",
    )
    cluster.add_argument(
        "--compute-efficiency", type=float, help="fraction of peak a layer reaches (default 0.6)"
    )
    cluster.add_argument("--hbm-tb-s", type=float, help="override the device memory bandwidth")
    cluster.add_argument(
        "--intra-node-bandwidth-gb-s", type=float, help="achieved per-GPU bandwidth in a node"
    )
    cluster.add_argument(
        "--inter-node-bandwidth-gb-s", type=float, help="achieved per-GPU bandwidth across nodes"
    )
    cluster.add_argument("--intra-node-latency-us", type=float, help="seconds per message in a node, in µs")
    cluster.add_argument(
        "--inter-node-latency-us", type=float, help="seconds per message across nodes, in µs"
    )
    cluster.add_argument("--memory-headroom", type=float, default=0.9, help="share of memory a plan may use")
    run = parser.add_argument_group("what to do")
    run.add_argument("--top", type=int, default=10, help="candidates to rank and show")
    run.add_argument(
        "--json", action="store_true", help="end with one JSON line of candidates and rejections"
    )
    run.add_argument("--dry-run", type=int, default=0, metavar="N",
                     help="build the real stages of the top N under fake tensors and measure their peak")  # fmt: skip
    run.add_argument("--profile-local", action="store_true",
                     help="measure per-layer costs on this machine and plan with them (this machine's ranks)")  # fmt: skip
    run.add_argument("--from-timeline", metavar="DIR",
                     help="a real run's --timeline-dir: propose a rebalanced layout for its split")  # fmt: skip
    return parser


def _cluster(opts: argparse.Namespace) -> Cluster:
    if opts.gpu not in GPUS:
        raise SystemExit(
            f"tools/plan.py: error: --gpu {opts.gpu!r} is not known; use one of {', '.join(GPUS)}"
        )
    if opts.num_gpus > opts.gpus_per_node and opts.num_gpus % opts.gpus_per_node:
        raise SystemExit(
            f"tools/plan.py: error: --num-gpus {opts.num_gpus} is not a whole number of nodes of "
            f"--gpus-per-node {opts.gpus_per_node}"
        )
    cluster = Cluster(
        opts.num_gpus, min(opts.gpus_per_node, opts.num_gpus), GPUS[opts.gpu], opts.memory_headroom
    )
    overrides = {
        "memory_gb": opts.gpu_memory_gb,
        "peak_tflops": opts.peak_tflops,
        "fp8_peak_tflops": opts.peak_fp8_tflops,
        "fp32_peak_tflops": opts.peak_fp32_tflops,
        "compute_efficiency": opts.compute_efficiency,
        "hbm_tb_s": opts.hbm_tb_s,
        "intra_node_gb_s": opts.intra_node_bandwidth_gb_s,
        "inter_node_gb_s": opts.inter_node_bandwidth_gb_s,
        "intra_node_latency_us": opts.intra_node_latency_us,
        "inter_node_latency_us": opts.inter_node_latency_us,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    return cluster.with_gpu(**given) if given else cluster


def describe_cluster(cluster: Cluster, spec: ModelSpec) -> list[str]:
    """The ``cluster:`` line, and what was measured on this machine where it was (``--profile-local``)."""
    gpu = cluster.gpu
    line = (
        f"cluster: {cluster.num_gpus} x {gpu.name} ({cluster.gpus_per_node} per node), "
        f"{gpu.peak_tflops:g} TFLOP/s peak at {gpu.compute_efficiency:.0%} achievable, "
        f"{gpu.intra_node_gb_s:.3g} GB/s and {gpu.intra_node_latency_us:.3g} µs a message in a "
        f"node, {gpu.inter_node_gb_s:.3g} GB/s and {gpu.inter_node_latency_us:.3g} µs across nodes"
    )
    if spec.fp8 and spec.fp8_blockwise:
        peak = cluster.blockwise_peak_tflops
        line += f"; blockwise FP8 products dequantised, in float32 at {peak:g} TFLOP/s peak"
        line += "" if gpu.fp32_peak_tflops else " (FP32 peak unknown: the 16-bit one; --peak-fp32-tflops)"
    elif spec.fp8:
        line += f"; FP8 products at {cluster.fp8_peak_tflops:g} TFLOP/s peak"
        line += "" if gpu.fp8_peak_tflops else " (no FP8 tensor cores: the 16-bit peak)"
    host = cluster.host
    if host.optimizer_element_seconds is None:
        return [line]
    return [
        line,
        (
            f"measured here: {host.action_seconds * 1e3:.3g} ms an action and {host.step_seconds * 1e3:.3g} ms a "
            f"step (the engine), the optimizer {host.optimizer_tensor_seconds * 1e6:.3g} µs a tensor and "
            f"{host.optimizer_element_seconds * 1e9:.3g} ns an element"
        )
        + _slowdown_text(host)
        + _collectives_text(host),
    ]


def _slowdown_text(host) -> str:
    """``; compute slowed 1 / 1.02 / 1.31 / 1.95x with 1 / 2 / 3 / 4 ranks computing``: the shared-core
    curve the schedule is timed with (nothing where it was not measured)."""
    if not host.slowdown:
        return ""
    counts = " / ".join(str(k) for k in range(1, len(host.slowdown) + 1))
    return f"; compute slowed {' / '.join(f'{s:.3g}' for s in host.slowdown)}x with {counts} ranks computing"


def _collectives_text(host) -> str:
    """``; TP, CP and DP collectives with all 4 ranks busy, ms at 4 / 256 / 4096 KiB: 4 ranks all_gather
    1.2 / 3.4 / 9, ...``: each kind at the sizes it was measured at (the largest list in the heading)."""
    if not host.collectives:
        return ""
    sizes = max((tuple(b for b, _ in points) for _, points in host.collectives), key=len)
    groups = ", ".join(
        f"{size} ranks {kind} " + " / ".join(f"{t * 1e3:.2g}" for _, t in points)
        for (kind, size), points in host.collectives
    )
    heading = " / ".join(f"{b / 1024:g}" for b in sizes)
    return f"; TP, CP and DP collectives with all {host.collectives_world} ranks busy, ms at {heading} KiB: {groups}"


def main(argv: list[str] | None = None, *, forward_step_func=None) -> int:
    """Run the planner; ``forward_step_func`` (``pretrain_gpt.forward_step``) is what ``--dry-run`` steps."""

    opts, megatron_argv = planner_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        plan_input = read_input(megatron_argv, preset=opts.preset, hf_config=opts.hf_config)
    except ValueError as err:
        print(f"tools/plan.py: error: {err}", file=sys.stderr)
        return 2
    cluster = _cluster(opts)
    profile, device = None, "cuda"
    if opts.profile_local:
        cluster = local_cluster(opts.num_gpus, plan_input.spec.precision)
        profile, device = LocalProfile(plan_input.spec, plan_input.args), "cpu"
    print(describe(plan_input.spec))
    print("\n".join(describe_cluster(cluster, plan_input.spec)))
    for note in plan_input.notes:
        print(f"note: {note}")
    fixed, run = plan_input.fixed, None
    if opts.from_timeline:
        report, profile, run = rebalance_report(plan_input, cluster, opts.from_timeline, profile)
        print(report)
        print(
            "re-ranked with the refitted costs (every split, schedule and layout; the run's own flags fix none):"
        )
        fixed = {}
    try:
        result = search(
            plan_input.spec,
            cluster,
            global_batch_size=plan_input.global_batch_size,
            fixed=fixed,
            allow_distributed_optimizer=plan_input.distributed_optimizer_allowed,
            top=opts.top,
            profile=profile,
            device=device,
        )
    except ValueError as err:  # the user's fixed sizes fit no split (--num-distributed-optimizer-instances)
        print(f"tools/plan.py: error: {err}", file=sys.stderr)
        return 2
    print(format_table(result, cluster, plan_input.base_flags))
    if run is not None:
        print(run_rank_line(result, run))
    if opts.dry_run and result.candidates:
        if forward_step_func is None:
            raise ValueError("--dry-run needs the forward step: run it as tools/plan.py")
        print(dry_run_report(result.candidates[: opts.dry_run], plan_input, forward_step_func))
    if opts.json:
        print(result_json(result, plan_input.base_flags))
    return 0

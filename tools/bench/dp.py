"""Data-parallel step time: gradient-reduce overlap, the distributed optimizer and ZeRO-2/3, DP = 2, one run.

Two spawned ranks (``--world``; gloo on CPU, NCCL on GPUs) each hold a copy per configuration of one GPT (8 layers, hidden
512 by default) and train them with the real schedule, DDP wrapper and optimizer, taking turns step
by step so that machine noise hits all four alike:

* ``plain``: buckets reduced after backward (``finish_grad_sync``), full optimizer on every rank;
* ``overlap``: ``overlap_grad_reduce``, each bucket's all-reduce launched as soon as its gradients
  are final in the last microbatch's backward;
* ``distopt``: the distributed optimizer (reduce-scatter, sharded step, parameter all-gather);
* ``distopt+overlap``: both, with the parameter all-gather overlapped with the next forward;
* ``zero2+overlap``: ``optim_grads`` (ZeRO-2) at microbatch scope (the default without pipelining):
  every microbatch's buckets reduce-scattered into 1/DP gradient shards, otherwise as
  ``distopt+overlap``;
* ``zero3+overlap``: ``optim_grads_params`` (ZeRO-3) at microbatch scope: also each layer's parameters
  gathered before its forward and its backward, synchronously (the chunk's own weights and the last
  layer once, kept from forward into backward);
* ``zero3+prefetch``: ZeRO-3 with ``overlap_param_gather``: the next layer's gather launched while a
  layer computes;
* ``zero2+step`` and ``zero3+step``: ZeRO-2 and ZeRO-3 (with the prefetch) at step scope
  (``data_parallel_sharding_scope='step'``, the default under pipelining): each bucket's gradients
  accumulate over the step's microbatches and are reduce-scattered once, in the last microbatch's
  backward, and ZeRO-3 gathers each bucket at its first use and keeps it until the optimizer step: per
  bucket and step one reduce-scatter and one all-gather, as ``distopt+overlap``.
* ``hsdp+overlap``: the distributed optimizer in two instances of one rank each
  (``num_distributed_optimizer_instances=2``, HSDP): nothing to reduce inside an instance, each bucket
  all-reduced over the two instances, launched during backward as the next bucket's is (the traffic of
  ``overlap``, and every rank steps the whole optimizer, as in ``plain``);
* ``fsdp2``: torch's ``fully_shard`` (FSDP2) on the same model, the reference for ``zero3+prefetch``:
  each decoder layer one unit and the rest the root's, resharded after forward and gathered again in
  backward but for the root (torch's default) and the last layer (torchtitan's choice), as Trident's,
  gradients reduce-scattered every microbatch, the next unit's gather prefetched;
  ``torch.optim.AdamW`` (foreach) on the shards and ``clip_grad_norm_``, as Megatron's optimizer clips
  (weight decay on every parameter: the step's cost, not its training, is compared);
* ``fsdp2+step``: the same at step scope, the reference for ``zero3+step``: not resharded after
  forward, and before the last microbatch neither resharded after backward nor reduced
  (``set_reshard_after_backward``, ``set_requires_gradient_sync``): one gather and one reduce-scatter
  a unit and step.

A step is zero_grad, forward/backward over the microbatches, the optimizer step; it is timed on
every rank between barriers and the slowest rank counts. Medians over ``--steps`` steps after
``--warmup``; ratios against ``plain``.

    python tools/bench/dp.py
    python tools/bench/dp.py --layers 8 --hidden 512 --seq 64 --microbatches 4 --bucket-size 2000000
    python tools/bench/dp.py --configs distopt+overlap zero3+prefetch fsdp2 zero3+step fsdp2+step
                                 # ZeRO-3 against torch's FSDP2 at both scopes
    python tools/bench/dp.py --configs plain overlap hsdp+overlap   # HSDP's reduction over the instances
    python tools/bench/dp.py --world 1 --configs distopt+overlap zero3+prefetch zero3+step   # on one GPU:
                                 # what sharding costs where there is nothing to share (the issue's <= 1.05x)

At ``--world 1`` the collectives are local copies, so a strategy's ratio to ``distopt+overlap`` is its
bookkeeping alone: the bucket views, ZeRO-3's frees and re-allocations, the hooks.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from core import parallel_state
from core.device import current_device
from core.distributed import DistributedDataParallelConfig
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.tensor_parallel import model_parallel_seed
from models.gpt import GPTModel, parallelize_gpt, pipeline_layout, preset
from tools.bench.args import add_int_flags, benchmark_parser
from tools.bench.ranks import init_rank, slowest_seconds, spawn, token_batches, train_step

CONFIGS = {
    "plain": {},
    "overlap": {"overlap_grad_reduce": True},
    "distopt": {"use_distributed_optimizer": True},
    "distopt+overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "zero2+overlap": {
        "use_distributed_optimizer": True,
        "data_parallel_sharding_strategy": "optim_grads",
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "zero3+overlap": {
        "use_distributed_optimizer": True,
        "data_parallel_sharding_strategy": "optim_grads_params",
        "overlap_grad_reduce": True,
    },
    "zero3+prefetch": {
        "use_distributed_optimizer": True,
        "data_parallel_sharding_strategy": "optim_grads_params",
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "zero2+step": {
        "use_distributed_optimizer": True,
        "data_parallel_sharding_strategy": "optim_grads",
        "data_parallel_sharding_scope": "step",
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "zero3+step": {
        "use_distributed_optimizer": True,
        "data_parallel_sharding_strategy": "optim_grads_params",
        "data_parallel_sharding_scope": "step",
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "hsdp+overlap": {
        "use_distributed_optimizer": True,
        "num_distributed_optimizer_instances": 2,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
}
TORCH_FSDP2 = {"fsdp2": False, "fsdp2+step": True}
"""The configurations that are not Trident's: torch's ``fully_shard``, at microbatch or step scope
(module docstring)."""

RATIOS = {  # JSON key: (configuration, over configuration), where both ran
    "overlap_vs_plain": ("overlap", "plain"),
    "distopt_vs_plain": ("distopt", "plain"),
    "distopt_overlap_vs_overlap": ("distopt+overlap", "overlap"),
}


def _config(args: argparse.Namespace):
    config = preset(
        "gpt2",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    config.deallocate_pipeline_outputs = False
    return config


def _build(name: str, args: argparse.Namespace):
    """Trident's model, optimizer and schedule hooks under configuration ``name``."""
    config = _config(args)
    ddp_config = DistributedDataParallelConfig(bucket_size=args.bucket_size, **CONFIGS[name])
    optimizer_config = OptimizerConfig(
        lr=1e-4, use_distributed_optimizer=ddp_config.use_distributed_optimizer
    )
    model = parallelize_gpt(  # as training does: bucket hooks launch reductions during the last backward
        lambda **stage: GPTModel(config, args.vocab, args.seq, **stage).to(current_device()),
        layout=pipeline_layout(config),
        ddp_config=ddp_config,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model.chunks)
    return model.chunks[0], optimizer, model.schedule_hooks(optimizer)


def _fsdp2_step_function(args: argparse.Namespace, step_scope: bool, batches: list) -> Callable[[], None]:
    """The same GPT under torch's ``fully_shard`` and its AdamW (module docstring); one step as
    ``train_step`` takes it: the microbatches' mean loss, clipping, the optimizer step."""
    from torch.distributed.fsdp import fully_shard

    # The model's output (the per-token loss) is a view; nothing here changes it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model = GPTModel(_config(args), args.vocab, args.seq).to(current_device())
    layers = list(model.decoder.layers.values())
    for index, layer in enumerate(layers):  # the last one's backward follows at once: kept (torchtitan)
        fully_shard(layer, reshard_after_forward=not step_scope and index < len(layers) - 1)
    fully_shard(model, reshard_after_forward=False if step_scope else None)  # None: the root is kept
    optimizer_config = OptimizerConfig(lr=1e-4)
    adam = torch.optim.AdamW(
        model.parameters(), lr=optimizer_config.lr, weight_decay=optimizer_config.weight_decay, foreach=True
    )

    def step() -> None:
        adam.zero_grad(set_to_none=True)
        for micro, (tokens, labels) in enumerate(batches):
            if step_scope:
                last = micro == len(batches) - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            (model(tokens, labels=labels).float().mean() / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optimizer_config.clip_grad, foreach=True)
        adam.step()

    return step


def _instances(name: str) -> int:
    """The distributed-optimizer instances configuration ``name`` runs in (the ranks split into)."""
    return CONFIGS.get(name, {}).get("num_distributed_optimizer_instances", 1)


def _rank(rank: int, args: argparse.Namespace, init_file: str, results) -> None:
    init_rank(rank, args.world, init_file, threads=max(1, (os.cpu_count() or 2) // args.world))
    instances = max(map(_instances, args.configs))
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=instances)  # DP = world
    model_parallel_seed(1234)
    batches = token_batches(args.vocab, args.mbs, args.seq, args.microbatches, seed=rank)
    steps = {name: _step_function(name, args, batches) for name in args.configs}
    times: dict[str, list[float]] = {name: [] for name in args.configs}
    for step in range(args.warmup + args.steps):
        for name, step_function in steps.items():
            elapsed = slowest_seconds(step_function)
            if step >= args.warmup:
                times[name].append(elapsed)
    if rank == 0:
        results.put(times)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _step_function(name: str, args: argparse.Namespace, batches: list) -> Callable[[], None]:
    """One training step of configuration ``name``'s own model, as a call."""
    if name in TORCH_FSDP2:
        return _fsdp2_step_function(args, TORCH_FSDP2[name], batches)
    ddp, optimizer, hooks = _build(name, args)

    def step_with_buffers() -> None:
        ddp.zero_grad_buffer()
        train_step(ddp, optimizer, batches, args.seq, args.mbs, hooks)
        if not ddp.ddp_config.shard_params:  # ZeRO-3 gathers each layer in the next forward
            ddp.finish_param_sync()  # the next forward of this model could overlap it; others come first

    return step_with_buffers


def main(argv=None) -> dict:
    parser = benchmark_parser(
        __doc__, layers=8, hidden=512, heads=8, seq=64, mbs=1, microbatches=4, vocab=4096
    )
    parser.add_argument("--bucket-size", type=int, default=2_000_000, help="elements per bucket")
    parser.add_argument("--world", type=int, choices=[1, 2], default=2, help="ranks, all data-parallel")
    every = [*CONFIGS, *TORCH_FSDP2]
    parser.add_argument(
        "--configs", nargs="+", choices=every, default=every, metavar="NAME",
        help=f"the configurations to time (default: all; {', '.join(every)})",
    )  # fmt: skip
    add_int_flags(parser, steps=10, warmup=2)
    args = parser.parse_args(argv)
    if args.configs == every:  # by default, what this many ranks can run
        args.configs = [name for name in every if _instances(name) <= args.world]
    if too_big := [name for name in args.configs if _instances(name) > args.world]:
        parser.error(f"{', '.join(too_big)} needs --world 2 (two distributed-optimizer instances)")
    times = spawn(_rank, args, world=args.world)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = "plain" if "plain" in medians else next(iter(medians))
    params = args.layers * 12 * args.hidden**2 + args.vocab * args.hidden
    print(
        f"DP={args.world}, GPT {args.layers} layers x hidden {args.hidden} (~{params / 1e6:.0f}M parameters), "
        f"{args.microbatches} microbatches of {args.mbs} x {args.seq}, buckets of {args.bucket_size} "
        f"elements; {args.steps} steps each, taking turns"
    )
    print(f"{'configuration':<18}{'median ms':>11}{'p25 ms':>9}{'p75 ms':>9}{'vs ' + base:>20}")
    for name, ts in times.items():
        p25, _, p75 = statistics.quantiles(ts, n=4)
        ratio = medians[name] / medians[base]
        print(f"{name:<18}{medians[name] * 1000:>11.1f}{p25 * 1000:>9.1f}{p75 * 1000:>9.1f}{ratio:>20.3f}")
    zero_vs_distopt = {}
    if "distopt+overlap" in medians:
        for name in (n for n in medians if n.startswith(("zero", "fsdp2"))):
            zero_vs_distopt[name] = round(medians[name] / medians["distopt+overlap"], 4)
            print(f"{name} / distopt+overlap: {zero_vs_distopt[name]:.3f}")
    summary = {
        "benchmark": "bench_dp",
        "world": args.world,
        "device": current_device().type,
        "median_ms": {name: round(m * 1000, 1) for name, m in medians.items()},
        "zero_vs_distopt": zero_vs_distopt,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    for key, (name, over) in RATIOS.items():
        if name in medians and over in medians:
            summary[key] = round(medians[name] / medians[over], 4)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

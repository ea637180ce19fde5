"""Precision and data-parallel flags: 16-bit formats, loss scaling, the gradient-reduction dtype and
the sharding strategy (Megatron's ``--use-distributed-optimizer`` and Megatron-FSDP flags).

Part of :func:`training.arguments.checks.derive_args`: what combines, and what a flag turns on (every
sharding strategy but no_shard shards the optimizer, so it turns the distributed optimizer on).
"""

from __future__ import annotations

import argparse

from core.distributed.distributed_data_parallel_config import DTYPES, ZERO_STRATEGIES, resolve_sharding_scope
from core.optimizer.optimizer_config import main_params_problems
from core.pipeline_parallel.placement import V
from core.pipeline_parallel.schedule_rules import schedule_rule
from training.arguments.schema import flag_name as _flag

__all__ = ["derive_precision_and_data_parallel", "instances_problem", "sharding_report"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def derive_precision_and_data_parallel(args: argparse.Namespace) -> None:
    """16-bit formats and loss scaling checked; the gradient-reduction dtype and sharding strategy derived."""
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive: give at most one")
    for dest in ("loss_scale", "initial_loss_scale", "min_loss_scale", "peak_tflops"):
        value = getattr(args, dest)
        _require(value is None or value > 0, f"{_flag(dest)} must be > 0, got {value}")
    _require(
        args.min_loss_scale <= args.initial_loss_scale,
        f"--min-loss-scale ({args.min_loss_scale}) must be <= --initial-loss-scale ({args.initial_loss_scale})",
    )
    # Megatron's gradient dtype: bf16 accumulates and reduces in fp32 unless --grad-reduce-in-bf16;
    # fp16 in fp16 unless --accumulate-allreduce-grads-in-fp32; fp32 in fp32.
    accumulate_in_fp32 = args.accumulate_allreduce_grads_in_fp32
    if not args.grad_reduce_in_fp32:  # --grad-reduce-in-bf16
        _require(args.bf16, "--grad-reduce-in-bf16 needs --bf16 (other parameters reduce in their own dtype)")
        _require(
            not accumulate_in_fp32,
            "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are mutually exclusive",
        )
    elif args.fp16:
        args.grad_reduce_in_fp32 = accumulate_in_fp32
    _megatron_fsdp_dtypes(args)
    _check_data_parallel_sharding(args)
    _check_instances(args)
    if args.fp8_param_gather:
        _require(
            args.use_distributed_optimizer, "--fp8-param-gather only supported with distributed optimizer"
        )
    if args.overlap_param_gather:
        _require(
            args.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (only it gathers parameters)",
        )
        _require(
            args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron)"
        )


def _megatron_fsdp_dtypes(args: argparse.Namespace) -> None:
    """Megatron-FSDP's ``--megatron-fsdp-*-dtype`` flags (only with ``--use-megatron-fsdp``, as in Megatron):
    the main weights in fp32 or the model's dtype (``OptimizerConfig.main_params_dtype``); the main
    gradients' dtype is the one ``--grad-reduce-in-bf16`` sets, given another way; the communication dtype
    goes to the buckets."""
    given = [d for d in _FSDP_DTYPES if d in args.explicit_args]
    _require(
        args.use_megatron_fsdp or not given,
        f"{', '.join(_flag(d) for d in given)} take{'s' if len(given) == 1 else ''} effect only with "
        "--use-megatron-fsdp (as in Megatron); add it",
    )
    model = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    params = args.megatron_fsdp_main_params_dtype
    args.main_params_dtype = DTYPES[model if params == "auto" else params]
    if problems := main_params_problems(args):  # the optimizer config's rule, with the flag as given
        raise ValueError(
            problems[0].render(
                lambda _: f"{_flag('megatron_fsdp_main_params_dtype')} {params}", command_line=True
            )
        )
    grads = args.megatron_fsdp_main_grads_dtype
    if grads == "auto":
        return
    _require(
        grads in ("fp32", model),
        f"--megatron-fsdp-main-grads-dtype {grads} must be fp32 or the model's dtype ({model})",
    )
    in_fp32 = grads == "fp32" or model == "fp32"
    if in_fp32:
        clash = "grad_reduce_in_fp32" in args.explicit_args  # --grad-reduce-in-bf16
    else:
        clash = args.accumulate_allreduce_grads_in_fp32
    _require(
        not clash,
        f"--megatron-fsdp-main-grads-dtype {grads} contradicts "
        + ("--grad-reduce-in-bf16" if in_fp32 else "--accumulate-allreduce-grads-in-fp32"),
    )
    args.grad_reduce_in_fp32 = in_fp32


_FSDP_DTYPES = (
    "megatron_fsdp_main_params_dtype",
    "megatron_fsdp_main_grads_dtype",
    "megatron_fsdp_grad_comm_dtype",
)


def _check_data_parallel_sharding(args: argparse.Namespace) -> None:
    """``--use-megatron-fsdp`` and ``--data-parallel-sharding-strategy``: the strategy the run uses, which
    turns the distributed optimizer on (every strategy but no_shard shards the optimizer)."""
    given = args.data_parallel_sharding_strategy
    if given is not None and given != "no_shard":
        _require(
            args.use_megatron_fsdp,
            f"--data-parallel-sharding-strategy {given} takes effect only with --use-megatron-fsdp (as in "
            "Megatron); add it" + (", or use --use-distributed-optimizer alone" if given == "optim" else ""),
        )
    strategy = given or (
        "optim_grads_params"
        if args.use_megatron_fsdp
        else "optim"
        if args.use_distributed_optimizer
        else "no_shard"
    )
    _require(
        not (strategy == "no_shard" and args.use_distributed_optimizer),
        "--data-parallel-sharding-strategy no_shard shards nothing, but --use-distributed-optimizer shards "
        "the optimizer state: give --data-parallel-sharding-strategy optim, or drop one of them",
    )
    _require(
        not (
            strategy in ZERO_STRATEGIES
            and schedule_rule(args.pipeline_schedule).placement == V
            and not args.untie_embeddings_and_output_weights
        ),
        f"--data-parallel-sharding-strategy {strategy} cannot shard the tied embedding that --pipeline-schedule "
        f"{args.pipeline_schedule} puts in both model chunks of rank 0 yet: give "
        "--untie-embeddings-and-output-weights, or --data-parallel-sharding-strategy optim",
    )
    _require(
        not (args.init_model_with_meta_device and args.use_megatron_fsdp and strategy == "no_shard"),
        "--init-model-with-meta-device is not supported or necessary with --use-megatron-fsdp "
        "--data-parallel-sharding-strategy no_shard (as in Megatron-FSDP): every rank holds the whole model "
        "anyway; drop the flag or pick a sharding strategy",
    )
    unit = args.suggested_communication_unit_size
    _require(
        unit is None or unit > 0,
        f"--suggested-communication-unit-size must be a positive number of elements, got {unit}",
    )
    scope = args.data_parallel_sharding_scope
    _require(
        scope == "auto" or strategy in ZERO_STRATEGIES,
        f"--data-parallel-sharding-scope {scope} says how long ZeRO-2/3 keep a bucket whole, but the strategy is "
        f"{strategy}, which keeps every bucket whole: give --use-megatron-fsdp --data-parallel-sharding-strategy "
        "optim_grads or optim_grads_params, or drop the scope",
    )
    if strategy in ZERO_STRATEGIES:
        args.data_parallel_sharding_scope = resolve_sharding_scope(scope, args.pipeline_model_parallel_size)
    args.data_parallel_sharding_strategy = strategy
    if strategy != "no_shard":
        args.use_distributed_optimizer = True


def _check_instances(args: argparse.Namespace) -> None:
    """``--num-distributed-optimizer-instances`` and ``--outer-dp-sharding-strategy`` (HSDP): N instances
    of DPxCP / N ranks each (and of EDP / N expert replicas), the outer strategy only over ZeRO-3
    (Megatron-FSDP's rules)."""
    edp, ep, pp = None, args.expert_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_moe_experts is not None:  # experts: sharded over EDP / N of their replicas
        edp = args.world_size // (ep * pp)
    problem = instances_problem(
        args.num_distributed_optimizer_instances,
        args.outer_dp_sharding_strategy,
        strategy=args.data_parallel_sharding_strategy,
        distributed=args.use_distributed_optimizer,
        dp=args.data_parallel_size,
        cp=args.context_parallel_size,
        edp=edp,
        edp_from=f"world size {args.world_size} / (--expert-model-parallel-size {ep} x "
        f"--pipeline-model-parallel-size {pp}) = ",
    )
    _require(problem is None, problem or "")


def instances_problem(
    instances: int,
    outer: str,
    *,
    strategy: str | None,
    distributed: bool,
    dp: int | None = None,
    cp: int = 1,
    edp: int | None = None,
    edp_from: str = "",
) -> str | None:
    """Why ``--num-distributed-optimizer-instances instances`` with ``--outer-dp-sharding-strategy outer``
    cannot run (one line), or None: the training flags' check, which the planner reuses before it knows
    the split (``dp`` None: the sizes are not checked; ``distributed``: the strategy is not no_shard;
    ``edp_from``: how the expert data-parallel size ``edp`` was found, said before it)."""
    flag = f"--num-distributed-optimizer-instances {instances}"
    if instances < 1:
        return f"--num-distributed-optimizer-instances must be >= 1, got {instances}"
    if instances > 1 and not distributed:
        return (
            f"{flag} replicates the distributed optimizer: give --use-distributed-optimizer or "
            "--use-megatron-fsdp (as in Megatron)"
        )
    if instances > 1 and dp is not None and dp * cp % instances:
        return f"{flag} must divide the data-parallel size x context-parallel size ({dp} x {cp} = {dp * cp})"
    if instances > 1 and edp is not None and edp % instances:
        return f"{flag} must divide the expert data-parallel size ({edp_from}{edp})"
    if outer == "optim" and strategy != "optim_grads_params":
        return (
            "--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params "
            f"(as in Megatron-FSDP), got {strategy}"
        )
    if outer == "optim" and instances == 1:
        return (
            "--outer-dp-sharding-strategy optim shards over the distributed-optimizer instances: give "
            "--num-distributed-optimizer-instances 2 or more"
        )
    return None


def sharding_report(args: argparse.Namespace) -> list[str]:
    """The start report's line on ZeRO-2/3: the strategy, its scope and the collectives per bucket and step
    (none for the strategies that keep every bucket whole)."""
    strategy, scope = args.data_parallel_sharding_strategy, args.data_parallel_sharding_scope
    if strategy not in ZERO_STRATEGIES:
        return []
    zero3 = strategy == "optim_grads_params"
    m = getattr(args, "num_microbatches", None)
    if scope == "step":
        traffic, held = "1 all-gather, 1 reduce-scatter per bucket", "its chunks' whole gradients"
        held += " and parameters" if zero3 else ""
    else:
        twice, once = (f"2M = {2 * m}", f"M = {m}") if isinstance(m, int) else ("2M", "M")
        gathers = f"{twice} all-gathers" if zero3 else "1 all-gather"
        if zero3 and args.pipeline_model_parallel_size == 1:  # core.distributed.sharding_units
            gathers += (
                f" ({once} for the chunk's own weights and the last layer, kept from forward into backward)"
            )
        traffic, held = f"{gathers}, {once} reduce-scatters per bucket", "only the layers in flight"
    pp = args.pipeline_model_parallel_size
    why = f" (auto: {f'{pp} pipeline stages' if pp > 1 else 'no pipeline'})"
    why = "" if "data_parallel_sharding_scope" in args.explicit_args else why
    unit = args.suggested_communication_unit_size
    limits = []
    if unit is not None and scope != "step":
        limits.append(f"reduce-scatters in flight up to {unit:,} elements")
    if unit is not None and zero3 and args.overlap_param_gather:
        limits.append(f"all-gathers prefetched up to {unit // 2:,}")
    limits = f" ({', '.join(limits)}: --suggested-communication-unit-size)" if limits else ""
    return [
        (
            f"data-parallel sharding: {strategy} ({'ZeRO-3' if zero3 else 'ZeRO-2'}) at {scope} scope{why}, "
            f"per step {traffic}; a rank holds {held}{limits} during the step, 1/DP between steps"
        )
    ]

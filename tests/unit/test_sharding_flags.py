"""Megatron-FSDP's flags: which strategy a command line gets, and one exact line for each refusal."""

from __future__ import annotations

import pytest
import torch

from training.arguments.checks import derive_args
from training.arguments.parser import parse_args, startup_report

_INSTEAD = (
    "use --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params (Trident's ZeRO-3 on its "
    "own buckets, which composes with tensor and pipeline parallelism)"
)
_NOT_YET = (
    "Trident shards over data parallelism with --use-megatron-fsdp --data-parallel-sharding-strategy "
    "{optim,optim_grads,optim_grads_params}, --num-distributed-optimizer-instances and "
    "--outer-dp-sharding-strategy; this knob of it is not built"
)


def _derived(argv: str) -> dict:
    return derive_args(parse_args(argv.split()), 4)


@pytest.mark.parametrize(
    ("argv", "strategy", "distributed"),
    [
        ("", "no_shard", None),
        ("--use-megatron-fsdp", "optim_grads_params", True),  # Megatron-FSDP's default
        ("--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather", "optim_grads_params", True),
        ("--use-megatron-fsdp --gradient-accumulation-fusion", "optim_grads_params", True),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
            "optim_grads_params",
            True,
        ),
        ("--use-distributed-optimizer", "optim", True),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim", "optim", True),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "optim_grads", True),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard", "no_shard", None),
    ],
)
def test_the_strategy_follows_megatrons_flags(argv, strategy, distributed):
    derived = _derived(argv)
    assert derived["data_parallel_sharding_strategy"] == strategy
    assert derived.get("use_distributed_optimizer") == distributed  # every strategy but no_shard turns it on


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            "--data-parallel-sharding-strategy optim",
            (
                "--data-parallel-sharding-strategy optim takes effect only with --use-megatron-fsdp (as in Megatron); "
                "add it, or use --use-distributed-optimizer alone"
            ),
        ),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --use-distributed-optimizer",
            (
                "--data-parallel-sharding-strategy no_shard shards nothing, but --use-distributed-optimizer shards the "
                "optimizer state: give --data-parallel-sharding-strategy optim, or drop one of them"
            ),
        ),
        (
            (
                "--use-megatron-fsdp --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                "--pipeline-schedule zbv --num-layers 4"
            ),
            (
                "--data-parallel-sharding-strategy optim_grads_params cannot shard the tied embedding that "
                "--pipeline-schedule zbv puts in both model chunks of rank 0 yet: give "
                "--untie-embeddings-and-output-weights, or --data-parallel-sharding-strategy optim"
            ),
        ),
        (
            "--use-megatron-fsdp --num-distributed-optimizer-instances 3",
            (
                "--num-distributed-optimizer-instances 3 must divide the data-parallel size x context-parallel size "
                "(4 x 1 = 4)"
            ),
        ),
        (
            "--num-distributed-optimizer-instances 2",
            (
                "--num-distributed-optimizer-instances 2 replicates the distributed optimizer: give "
                "--use-distributed-optimizer or --use-megatron-fsdp (as in Megatron)"
            ),
        ),
        (
            "--use-megatron-fsdp --num-distributed-optimizer-instances 0",
            "--num-distributed-optimizer-instances must be >= 1, got 0",
        ),
        (
            (
                "--use-distributed-optimizer --num-distributed-optimizer-instances 2 --num-experts 4 "
                "--expert-model-parallel-size 4"
            ),
            (
                "--num-distributed-optimizer-instances 2 must divide the expert data-parallel size (world size 4 / "
                "(--expert-model-parallel-size 4 x --pipeline-model-parallel-size 1) = 1)"
            ),
        ),
        (
            (
                "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --num-distributed-optimizer-instances 2 "
                "--outer-dp-sharding-strategy optim"
            ),
            (
                "--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params "
                "(as in Megatron-FSDP), got optim_grads"
            ),
        ),
        (
            "--use-distributed-optimizer --data-parallel-sharding-scope step",
            (
                "--data-parallel-sharding-scope step says how long ZeRO-2/3 keep a bucket whole, but the strategy "
                "is optim, which keeps every bucket whole: give --use-megatron-fsdp --data-parallel-sharding-strategy "
                "optim_grads or optim_grads_params, or drop the scope"
            ),
        ),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --data-parallel-sharding-scope microbatch",
            (
                "--data-parallel-sharding-scope microbatch says how long ZeRO-2/3 keep a bucket whole, but the "
                "strategy is no_shard, which keeps every bucket whole: give --use-megatron-fsdp "
                "--data-parallel-sharding-strategy optim_grads or optim_grads_params, or drop the scope"
            ),
        ),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --init-model-with-meta-device",
            (
                "--init-model-with-meta-device is not supported or necessary with --use-megatron-fsdp "
                "--data-parallel-sharding-strategy no_shard (as in Megatron-FSDP): every rank holds the whole "
                "model anyway; drop the flag or pick a sharding strategy"
            ),
        ),
        (
            "--use-megatron-fsdp --outer-dp-sharding-strategy optim",
            (
                "--outer-dp-sharding-strategy optim shards over the distributed-optimizer instances: give "
                "--num-distributed-optimizer-instances 2 or more"
            ),
        ),
        (
            "--use-megatron-fsdp --suggested-communication-unit-size 0",
            "--suggested-communication-unit-size must be a positive number of elements, got 0",
        ),
        (
            "--megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype fp32",
            (
                "--megatron-fsdp-main-grads-dtype, --megatron-fsdp-grad-comm-dtype take effect only with "
                "--use-megatron-fsdp (as in Megatron); add it"
            ),
        ),
        (
            "--bf16 --use-megatron-fsdp --megatron-fsdp-main-params-dtype fp16",
            (
                "--megatron-fsdp-main-params-dtype fp16 must be fp32, auto or the model's dtype (bf16): the "
                "optimizer steps fp32 main copies or the bf16 weights themselves"
            ),
        ),
        (
            "--fp16 --use-megatron-fsdp --megatron-fsdp-main-params-dtype auto",
            (
                "--megatron-fsdp-main-params-dtype auto (fp16 main weights) is not built: Adam's moments would "
                "be fp16 too, where its epsilon (1e-8) and small squared gradients round to 0 and the updates "
                "blow up; use fp32 (the default)"
            ),
        ),
        (
            "--use-megatron-fsdp --megatron-fsdp-main-params-dtype bf16",
            (
                "--megatron-fsdp-main-params-dtype bf16 must be fp32, auto or the model's dtype (fp32): the "
                "optimizer steps fp32 main copies or the fp32 weights themselves"
            ),
        ),
        (
            "--fp16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16",
            "--megatron-fsdp-main-grads-dtype bf16 must be fp32 or the model's dtype (fp16)",
        ),
        (
            "--bf16 --use-megatron-fsdp --grad-reduce-in-bf16 --megatron-fsdp-main-grads-dtype fp32",
            "--megatron-fsdp-main-grads-dtype fp32 contradicts --grad-reduce-in-bf16",
        ),
        (
            "--fp16 --use-megatron-fsdp --accumulate-allreduce-grads-in-fp32 --megatron-fsdp-main-grads-dtype fp16",
            "--megatron-fsdp-main-grads-dtype fp16 contradicts --accumulate-allreduce-grads-in-fp32",
        ),
    ],
)
def test_contradicting_strategies_are_one_line(argv, message):
    with pytest.raises(ValueError) as error:
        _derived(argv)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("argv", "scope", "line"),
    [
        (
            "--use-megatron-fsdp --pipeline-model-parallel-size 2 --num-layers 4",
            "step",
            (
                "data-parallel sharding: optim_grads_params (ZeRO-3) at step scope (auto: 2 pipeline stages), per step "
                "1 all-gather, 1 reduce-scatter per bucket; a rank holds its chunks' whole gradients and parameters "
                "during the step, 1/DP between steps"
            ),
        ),
        (
            "--use-megatron-fsdp",
            "microbatch",
            (
                "data-parallel sharding: optim_grads_params (ZeRO-3) at microbatch scope (auto: no pipeline), per step "
                "2M = 16 all-gathers (M = 8 for the chunk's own weights and the last layer, kept from forward into "
                "backward), M = 8 reduce-scatters per bucket; a rank holds only the layers in flight during "
                "the step, 1/DP between steps"
            ),
        ),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --data-parallel-sharding-scope step",
            "step",
            (
                "data-parallel sharding: optim_grads (ZeRO-2) at step scope, per step 1 all-gather, 1 reduce-scatter "
                "per bucket; a rank holds its chunks' whole gradients during the step, 1/DP between steps"
            ),
        ),
        (
            (
                "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --pipeline-model-parallel-size 2 "
                "--num-layers 4 --data-parallel-sharding-scope microbatch"
            ),
            "microbatch",
            (
                "data-parallel sharding: optim_grads (ZeRO-2) at microbatch scope, per step 1 all-gather, M = 8 "
                "reduce-scatters per bucket; a rank holds only the layers in flight during the step, 1/DP between steps"
            ),
        ),
        (
            "--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather --suggested-communication-unit-size 3000000",
            "microbatch",
            (
                "data-parallel sharding: optim_grads_params (ZeRO-3) at microbatch scope (auto: no pipeline), per step "
                "2M = 16 all-gathers (M = 8 for the chunk's own weights and the last layer, kept from forward into "
                "backward), M = 8 reduce-scatters per bucket; a rank holds only the layers in flight "
                "(reduce-scatters in flight up to 3,000,000 elements, all-gathers prefetched up to 1,500,000: "
                "--suggested-communication-unit-size) during the step, 1/DP between steps"
            ),
        ),
        ("--use-distributed-optimizer", "auto", None),
        ("--use-distributed-optimizer --suggested-communication-unit-size 3000000", "auto", None),
    ],
)
def test_the_sharding_scope_follows_the_pipeline_and_the_start_report_states_its_traffic(argv, scope, line):
    """``auto``: step scope under pipelining, microbatch scope without; 8 microbatches of one sample at DP4
    (world 4 over PP: DP2 with the pipeline, so 16 samples a step in both)."""
    from training.arguments.checks import validate_args

    dp = 2 if "--pipeline-model-parallel-size 2" in argv else 4
    args = validate_args(
        parse_args([*argv.split(), "--micro-batch-size", "1", "--global-batch-size", str(8 * dp)]), 4
    )
    assert args.data_parallel_sharding_scope == scope
    lines = [x for x in startup_report(args) if x.startswith("data-parallel sharding")]
    assert lines == ([line] if line else [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--use-torch-fsdp2", f"Trident does not support --use-torch-fsdp2: {_INSTEAD}"),
        (
            "--torch-fsdp2-no-reshard-after-forward",
            f"Trident does not support --torch-fsdp2-no-reshard-after-forward: {_INSTEAD}",
        ),
        (
            "--megatron-fsdp-version 2",
            (
                "Trident does not support --megatron-fsdp-version 2: Trident's Megatron-FSDP is version 1, "
                f"Megatron's default; {_INSTEAD}"
            ),
        ),
        (
            "--megatron-fsdp-enable-fine-grained-param-gather",
            f"Trident does not support --megatron-fsdp-enable-fine-grained-param-gather yet: {_NOT_YET}",
        ),
    ],
)
def test_unbuilt_fsdp_flags_are_refused_with_one_line(argv, message):
    with pytest.raises(ValueError) as error:
        parse_args(argv.split())
    assert str(error.value) == message


def test_megatron_fsdp_version_1_is_megatrons_default_and_what_trident_runs():
    args = parse_args(["--use-megatron-fsdp", "--megatron-fsdp-version", "1"])
    assert args.megatron_fsdp_version == 1 and args.use_megatron_fsdp


@pytest.mark.parametrize(
    ("argv", "instances", "outer"),
    [
        (
            "--use-distributed-optimizer --num-distributed-optimizer-instances 2",
            2,
            "no_shard",
        ),  # megatron-core
        (
            "--use-megatron-fsdp --num-distributed-optimizer-instances 4",
            4,
            "no_shard",
        ),  # HSDP, DP4: DDP over ZeRO-3 of 1
        (
            "--use-megatron-fsdp --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
            2,
            "optim",
        ),
        (
            (
                "--use-distributed-optimizer --num-distributed-optimizer-instances 2 --num-experts 4 "
                "--expert-model-parallel-size 2"
            ),
            2,
            "no_shard",
        ),  # MoE: EP2 at DP4, expert DP 2 in two instances of one replica
    ],
)
def test_hsdp_flags_reach_the_data_parallel_config(argv, instances, outer):
    from training.run import build_run

    ddp = build_run(parse_args(argv.split()), 4).ddp
    assert (ddp.num_distributed_optimizer_instances, ddp.outer_dp_sharding_strategy) == (instances, outer)


@pytest.mark.parametrize(
    ("argv", "grad_reduce_in_fp32", "comm"),
    [
        ("--bf16 --use-megatron-fsdp", True, "auto"),  # Megatron's rule for its buckets: fp32 for bf16
        ("--bf16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16", False, "auto"),
        ("--bf16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype fp32", True, "auto"),
        (
            "--bf16 --use-megatron-fsdp --grad-reduce-in-bf16 --megatron-fsdp-main-grads-dtype auto",
            False,
            "auto",
        ),
        ("--fp16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype fp32", True, "auto"),
        ("--fp16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype fp16", False, "auto"),
        ("--use-megatron-fsdp --megatron-fsdp-main-params-dtype auto", True, "auto"),  # an fp32 model's
        ("--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype bf16", True, "bf16"),
        (
            "--bf16 --use-megatron-fsdp --grad-reduce-in-bf16 --megatron-fsdp-grad-comm-dtype fp32",
            False,
            "fp32",
        ),
    ],
)
def test_megatron_fsdps_dtype_flags_reach_the_gradient_buffers(argv, grad_reduce_in_fp32, comm):
    """``--megatron-fsdp-main-grads-dtype`` says what ``--grad-reduce-in-bf16`` says, another way (``auto``
    leaves it to that flag); ``--megatron-fsdp-grad-comm-dtype`` goes to the wrapper as it is."""
    from training.run import build_run

    ddp = build_run(parse_args(argv.split()), 4).ddp
    assert (ddp.grad_reduce_in_fp32, ddp.megatron_fsdp_grad_comm_dtype) == (grad_reduce_in_fp32, comm)


@pytest.mark.parametrize(
    ("argv", "dtype"),
    [
        ("--bf16 --use-megatron-fsdp", torch.float32),  # Megatron's default: fp32 main weights
        ("--bf16", torch.float32),
        ("--bf16 --use-megatron-fsdp --megatron-fsdp-main-params-dtype auto", torch.bfloat16),
        ("--bf16 --use-megatron-fsdp --megatron-fsdp-main-params-dtype bf16", torch.bfloat16),
        ("--fp16 --use-megatron-fsdp --megatron-fsdp-main-params-dtype fp32", torch.float32),
        ("--use-megatron-fsdp --megatron-fsdp-main-params-dtype auto", torch.float32),
    ],
)
def test_the_main_params_dtype_reaches_the_optimizer_config(argv, dtype):
    from training.run import build_run

    assert build_run(parse_args(argv.split()), 4).optimizer.main_params_dtype == dtype


def test_an_outer_strategy_that_does_not_exist_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim_grads"])
    assert "invalid choice: 'optim_grads'" in capsys.readouterr().err


def test_a_strategy_name_that_does_not_exist_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero3"])
    assert "invalid choice: 'zero3'" in capsys.readouterr().err


def test_fsdp_dtensor_is_accepted_and_the_start_says_trident_writes_its_own_format():
    args = parse_args(["--ckpt-format", "fsdp_dtensor"])
    derive_args(args, 1)
    lines = [line for line in startup_report(args) if "--ckpt-format" in line]
    assert lines == [
        (
            "accepted, no effect here: --ckpt-format fsdp_dtensor (torch, torch_dist and fsdp_dtensor all write "
            "Trident's own format, which any sharding strategy and any split can load)"
        )
    ]


def test_the_planner_takes_distributed_optimizer_instances():
    """HSDP's flags fix the plan's instances (the planner prices them: tests/unit/test_plan.py), and leave
    the base command line: each candidate's flags carry them back."""
    from planner.inputs import read_input

    flags = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    plan_input = read_input([*flags, "--global-batch-size", "8"], preset="llama3-8b")
    assert plan_input.fixed == {"instances": 2}
    assert "--num-distributed-optimizer-instances" not in plan_input.base_flags

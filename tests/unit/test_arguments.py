"""Megatron flag names and defaults, the tiny demo, config files, and every validation message (no processes)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.support.flags import assert_refused
from tests.support.flags import megatron_args as _args
from training.arguments.checks import validate_args
from training.arguments.parser import TINY_DEMO, build_parser, parse_args, transformer_config_from_args
from training.arguments.schema import FLAGS

BRIEF_FLAGS = re.findall(
    r"--[a-z0-9-]+",
    """
--tensor-model-parallel-size --pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage
--num-virtual-stages-per-pipeline-rank --pipeline-model-parallel-layout
--microbatch-group-size-per-virtual-pipeline-stage --num-layers --hidden-size --ffn-hidden-size
--num-attention-heads --group-query-attention --num-query-groups --kv-channels --seq-length
--max-position-embeddings --micro-batch-size --global-batch-size --train-iters --lr --min-lr
--lr-decay-style --lr-warmup-iters --lr-warmup-fraction --lr-decay-iters --weight-decay --clip-grad
--adam-beta1 --adam-beta2 --adam-eps --init-method-std --hidden-dropout --attention-dropout
--make-vocab-size-divisible-by --eod-mask-loss --overlap-grad-reduce --recompute-method
--recompute-granularity --recompute-num-layers --no-load-optim --no-load-rng --finetune --bf16 --seed
--save --load --save-interval --eval-interval --eval-iters --log-interval --data-path --split
--tokenizer-type --tokenizer-model --vocab-size --wandb-project --wandb-exp-name --wandb-save-dir
--sequence-parallel --position-embedding-type --normalization --swiglu
--untie-embeddings-and-output-weights --disable-bias-linear --exit-interval --exit-signal-handler
--check-for-nan-in-loss-and-grad --max-consecutive-skipped-iterations --pipeline-schedule
--calculate-per-token-loss --config
""",
)


# A complete Megatron command line (the tiny demo is off): every required flag, Megatron's defaults for the rest.
FULL = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 "
    "--train-iters 100 --lr 1e-3"
)
DATA = "--data-path A --tokenizer-type NullTokenizer --vocab-size 1000"


# --------------------------------------------------------------------------------------------------
# Flags, dests, defaults
# --------------------------------------------------------------------------------------------------


def test_every_flag_of_the_brief_is_accepted():
    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert set(BRIEF_FLAGS) <= options


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        ("--tensor-model-parallel-size 2", "tensor_model_parallel_size", 2),
        ("--microbatch-group-size-per-virtual-pipeline-stage 4", "microbatch_group_size_per_vp_stage", 4),
        ("--disable-bias-linear", "add_bias_linear", False),
        ("--no-check-for-nan-in-loss-and-grad", "check_for_nan_in_loss_and_grad", False),
        ("--persistent-save-interval 7", "save_interval", 7),
        ("--data-path 0.3 A 0.7 B", "data_path", ["0.3", "A", "0.7", "B"]),
        ("--no-load-optim", "no_load_optim", True),
        ("--no-load-rng", "no_load_rng", True),
        ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", True),
        ("--position-embedding-type rope", "position_embedding_type", "rope"),
        ("--normalization RMSNorm", "normalization", "RMSNorm"),
        ("--lr-decay-style linear", "lr_decay_style", "linear"),
        ("--adam-eps 1e-5", "adam_eps", 1e-5),
        ("--tokenizer-type NullTokenizer", "tokenizer_type", "NullTokenizer"),
        ("--wandb-exp-name run1", "wandb_exp_name", "run1"),
        ("--pipeline-schedule gpipe", "pipeline_schedule", "gpipe"),
    ],
)
def test_megatron_flag_names_parse_to_megatron_dests(argv, dest, value):
    assert getattr(parse_args(argv.split()), dest) == value


def test_flags_not_in_the_tiny_demo_keep_megatron_defaults():
    args = parse_args([])
    megatron = {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "min_lr": 0.0,
        "weight_decay": 0.01,
        "clip_grad": 1.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "init_method_std": 0.02,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
        "make_vocab_size_divisible_by": 128,
        "num_query_groups": 1,
        "group_query_attention": False,
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "swiglu": False,
        "add_bias_linear": True,
        "no_load_optim": None,
        "no_load_rng": None,
        "finetune": False,
        "check_for_nan_in_loss_and_grad": False,
        "wandb_project": "",
        "data_path": None,
        "split": None,
        "ffn_hidden_size": None,
        "kv_channels": None,
        "lr_decay_iters": None,
        "recompute_granularity": None,
        "sequence_parallel": False,
        "bf16": False,
        "max_consecutive_skipped_iterations": 10,
        "pipeline_schedule": "1f1b",
        "exit_interval": None,
        "save": None,
        "load": None,
    }
    assert {k: getattr(args, k) for k in megatron} == megatron
    assert len({f.dest for f in FLAGS}) == len(FLAGS)  # one flag per attribute (--[no-]check-... is one)


def test_the_bare_command_is_the_tiny_demo():
    args = parse_args([])
    assert {k: getattr(args, k) for k in TINY_DEMO} == TINY_DEMO
    assert (args.max_position_embeddings, args.save_interval) == (128, None)  # validation derives it
    assert args.using_default_model and args.using_default_data and args.explicit_args == []
    assert args.tokenizer_type == "GPTSentencePieceTokenizer"
    args = validate_args(args, 1)
    assert (args.global_batch_size, args.num_microbatches, args.data_parallel_size) == (16, 4, 1)
    assert args.save_interval == 100  # --train-iters
    assert (args.ffn_hidden_size, args.kv_channels, args.params_dtype) == (512, 32, torch.float32)
    assert args.lr_warmup_iters == 0 and args.lr_warmup_fraction == 0.1  # 10 of the 100 iterations


@pytest.mark.parametrize(
    "world, pp, gbs, microbatches", [(4, 4, 16, 4), (4, 1, 16, 1), (8, 1, 32, 1), (3, 1, 24, 2)]
)
def test_default_global_batch_is_the_smallest_multiple_of_mbs_x_dp_from_16(world, pp, gbs, microbatches):
    args = _args(f"--pipeline-model-parallel-size {pp}", world)
    assert (args.global_batch_size, args.num_microbatches) == (gbs, microbatches)


def test_given_flags_are_recorded_and_same_as_defaults_follow_them():
    args = _args(f"{FULL} --num-layers 8 --seq-length 256 --train-iters 40 {DATA} --global-batch-size 8")
    assert (args.num_layers, args.max_position_embeddings, args.save_interval) == (8, 256, 40)
    assert not args.using_default_model and not args.using_default_data
    assert args.split == "969,30,1"  # Megatron's legacy default when --data-path has no --split
    assert args.explicit_args == [
        "data_path",
        "global_batch_size",
        "hidden_size",
        "lr",
        "micro_batch_size",
        "num_attention_heads",
        "num_layers",
        "seq_length",
        "tokenizer_type",
        "train_iters",
        "vocab_size",
    ]


@pytest.mark.parametrize(
    "argv, fraction, iters",
    [("--lr-warmup-iters 3", None, 3), ("--lr-warmup-fraction 0.2", 0.2, 0), ("--train-iters 10", 0.1, 0)],
)
def test_a_given_warmup_replaces_the_demo_warmup(argv, fraction, iters):
    args = _args(argv)
    assert (args.lr_warmup_fraction, args.lr_warmup_iters) == (fraction, iters)


# --------------------------------------------------------------------------------------------------
# --config
# --------------------------------------------------------------------------------------------------


def test_yaml_config_with_dashes_and_underscores_and_cli_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "num-layers: 6\nhidden_size: 256\nlr: 1e-4\ndisable-bias-linear: true\n"
        "data_path: 0.5 A 0.5 B\nswiglu: true\nnum-query-groups: null\n"
    )
    args = parse_args(["--config", str(path), "--hidden-size", "64"])
    assert (args.num_layers, args.hidden_size, args.lr, args.add_bias_linear) == (6, 64, 1e-4, False)
    assert (args.data_path, args.swiglu, args.num_query_groups) == (["0.5", "A", "0.5", "B"], True, 1)
    assert not args.using_default_model and not args.using_default_data


def test_toml_config_with_sections(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "pipeline-model-parallel-size = 2\n[model]\nnum_attention_heads = 8\n"
        'add_bias_linear = false\n[data]\ndata-path = ["A"]\ntokenizer-type = "NullTokenizer"\n'
    )
    args = parse_args(["--config", str(path)])
    assert (args.pipeline_model_parallel_size, args.num_attention_heads) == (2, 8)
    assert (args.add_bias_linear, args.data_path, args.tokenizer_type) == (False, ["A"], "NullTokenizer")


KEYS_HINT = "keys are flag names such as 'tensor-model-parallel-size' or 'tensor_model_parallel_size'"


@pytest.mark.parametrize(
    "text, message",
    [
        ("num-layer: 4\n", f"unknown key 'num-layer' (did you mean 'num-layers'?); {KEYS_HINT}"),
        ("model:\n  frobnicate: 1\n", f"unknown key 'model.frobnicate'; {KEYS_HINT}"),
        ("num-layers: 4.5\n", "key 'num-layers' (--num-layers) expects int, got 4.5"),
        ("bf16: yes please\n", "key 'bf16' (--bf16) expects a bool, got 'yes please'"),
        (
            "normalization: BatchNorm\n",
            "key 'normalization' must be one of ['LayerNorm', 'RMSNorm'], got 'BatchNorm'",
        ),
        ("- 1\n- 2\n", "expected a mapping of flag names to values, got list"),
        ("a: [\n", "cannot parse it as YAML"),
    ],
)
def test_config_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"config file {path}: {message}")):
        parse_args(["--config", str(path)])


# --------------------------------------------------------------------------------------------------
# Validation: one ValueError naming the flags and the numbers
# --------------------------------------------------------------------------------------------------

VALIDATION_ERRORS = [
    (
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2",
        12,
        (
            "world size (12) must be divisible by --tensor-model-parallel-size (4) x "
            "--pipeline-model-parallel-size (2) = 8"
        ),
    ),
    (
        "--global-batch-size 10 --micro-batch-size 2",
        4,
        "--global-batch-size (10) must be divisible by --micro-batch-size (2) x data-parallel size (4) = 8",
    ),
    (
        "--tensor-model-parallel-size 3",
        3,
        "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (3)",
    ),
    (
        "--group-query-attention --num-query-groups 3",
        1,
        "--num-attention-heads (4) must be divisible by --num-query-groups (3)",
    ),
    (
        "--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2",
        2,
        "--num-query-groups (1) must be divisible by --tensor-model-parallel-size (2)",
    ),
    (
        f"{FULL} --hidden-size 130",
        1,
        "--hidden-size (130) must be divisible by --num-attention-heads (4) unless --kv-channels is given",
    ),
    (
        f"{FULL} --ffn-hidden-size 101 --tensor-model-parallel-size 2",
        2,
        "--ffn-hidden-size (101) must be divisible by --tensor-model-parallel-size (2)",
    ),
    (
        f"{FULL} --swiglu --hidden-size 16",
        1,
        "--swiglu with --hidden-size 16 gives an FFN size of 0 (int(8*hidden/3/64)*64); give --ffn-hidden-size",
    ),
    (
        f"{FULL} --seq-length 256 --max-position-embeddings 128",
        1,
        (
            "--seq-length (256) must be <= --max-position-embeddings (128) with --position-embedding-type "
            "learned_absolute"
        ),
    ),
    (
        f"{FULL} --sequence-parallel --tensor-model-parallel-size 4 --seq-length 130 --max-position-embeddings 256",
        4,
        "--seq-length (130) must be divisible by --tensor-model-parallel-size (4) with --sequence-parallel",
    ),
    ("--num-layers 0", 1, "--num-layers must be >= 1, got 0"),
    ("--hidden-dropout 1.0", 1, "--hidden-dropout must be in [0, 1), got 1.0"),
    ("--lr 1e-4 --min-lr 1e-3", 1, "--min-lr (0.001) must be <= --lr (0.0001)"),
    (
        "--lr-warmup-fraction 0.1 --lr-warmup-iters 5",
        1,
        "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive: give at most one",
    ),
    (
        f"{FULL} --train-iters 10 --lr-warmup-iters 10",
        1,
        (
            "--lr-warmup-iters (10) must be < the decay iterations (10, from --lr-decay-iters or else "
            "--train-iters)"
        ),
    ),
    ("--tokenizer-type NullTokenizer", 1, "--tokenizer-type NullTokenizer needs --vocab-size"),
    (
        f"{FULL} {DATA} --split 1,2,3,4",
        1,
        "--split '1,2,3,4': expected up to three comma-separated weights, e.g. 969,30,1",
    ),
    (
        "--recompute-granularity full",
        1,
        "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers",
    ),
    (
        "--recompute-granularity selective --recompute-num-layers 1",
        1,
        "--recompute-granularity selective takes neither --recompute-method nor --recompute-num-layers",
    ),
    (
        "--recompute-method block",
        1,
        "--recompute-method and --recompute-num-layers need --recompute-granularity full",
    ),
    (
        "--cross-entropy-fusion-impl linear",
        1,
        "--cross-entropy-fusion-impl linear needs --cross-entropy-loss-fusion (it says how that fusion is done)",
    ),
]


@pytest.mark.parametrize("argv, world, message", VALIDATION_ERRORS)
def test_validation_errors_name_flags_and_numbers(argv, world, message):
    assert_refused(argv, message, world)


def test_sequence_parallel_is_disabled_at_tp1_with_a_note(capsys):
    args = _args("--sequence-parallel")
    assert args.sequence_parallel is False
    assert "--sequence-parallel has no effect with --tensor-model-parallel-size 1" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# Virtual pipeline stages and layouts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, vpp",
    [
        ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2", 2),
        ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 4", None),
        ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 2),
        ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 1", None),
        ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t|t|tL", 2),
        ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E,t*2|t*2,L", None),
    ],
)
def test_virtual_pipeline_size_comes_from_one_of_three_flags(argv, vpp):
    assert _args(argv, 2).virtual_pipeline_model_parallel_size == vpp


EXCLUSIVE = "are mutually exclusive: give at most one"
LAYOUT = "--pipeline-model-parallel-layout: pipeline layout"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 2",
            f"--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank {EXCLUSIVE}",
        ),
        (
            "--num-virtual-stages-per-pipeline-rank 2 --pipeline-model-parallel-layout Et|t|t|tL",
            f"--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout {EXCLUSIVE}",
        ),
        (
            "--num-layers 5 --num-layers-per-virtual-pipeline-stage 1",
            (
                "--num-layers (5) must be divisible by --pipeline-model-parallel-size (2) to use "
                "--num-layers-per-virtual-pipeline-stage"
            ),
        ),
        (
            "--num-layers 6 --num-layers-per-virtual-pipeline-stage 2",
            "layers per pipeline rank (6 / 2 = 3) must be divisible by --num-layers-per-virtual-pipeline-stage (2)",
        ),
        (
            "--pipeline-model-parallel-layout Et|tL",
            f"{LAYOUT} 'Et|tL': the layout has 2 decoder layers ('t') but num_layers is 4",
        ),
        (
            "--pipeline-model-parallel-layout Et*4|L|E",
            (
                f"{LAYOUT} 'Et*4|L|E': 3 stages are not a multiple of pipeline-model-parallel size 2 "
                "(stage s runs on pp_rank s % 2)"
            ),
        ),
        (
            "--num-virtual-stages-per-pipeline-rank 2 --pipeline-schedule gpipe",
            "--pipeline-schedule gpipe cannot run virtual pipeline stages (2 per rank); the 1f1b schedule interleaves them",
        ),
        (
            "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 12",
            (
                "number of microbatches (3) leaves a last group of 1 when grouped by "
                "microbatch_group_size_per_vp_stage (2); with interleaving the remainder must be 0 or at least "
                "pipeline_model_parallel_size (2) — with the default group size the microbatch count must be a "
                "multiple of the pipeline size (interleaved schedule, 2 virtual stages per rank; microbatches = "
                "--global-batch-size (12) / (--micro-batch-size (4) x data-parallel size (1)) = 3)"
            ),
        ),
    ],
)
def test_virtual_pipeline_errors(argv, message):
    assert_refused(f"--pipeline-model-parallel-size 2 {argv}", message, 2)


def test_virtual_stages_need_more_than_one_pipeline_rank():
    assert_refused(
        "--num-virtual-stages-per-pipeline-rank 2",
        "--num-virtual-stages-per-pipeline-rank gives 2 virtual stages per rank, which needs "
        "--pipeline-model-parallel-size > 1",
    )
    assert_refused(
        "--num-layers 2 --pipeline-model-parallel-layout Et|tL",
        "--pipeline-model-parallel-layout gives 2 virtual stages per rank, which needs "
        "--pipeline-model-parallel-size > 1",
    )


def test_interleaving_needs_at_least_pp_microbatches():
    assert_refused(
        "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 8",
        "interleaved pipeline schedule needs at least pipeline_model_parallel_size (4) microbatches, "
        "got 2; raise the global batch size or lower --pipeline-model-parallel-size (interleaved "
        "schedule, 2 virtual stages per rank; microbatches = --global-batch-size (8) / "
        "(--micro-batch-size (4) x data-parallel size (1)) = 2)",
        4,
    )


# --------------------------------------------------------------------------------------------------
# TransformerConfig keyword arguments
# --------------------------------------------------------------------------------------------------


def test_transformer_config_maps_swiglu_gqa_bf16_and_sizes():
    args = _args(
        "--swiglu --group-query-attention --num-query-groups 2 --tensor-model-parallel-size 2 "
        "--bf16 --normalization RMSNorm --position-embedding-type rope --sequence-parallel "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
        4,
    )
    config = transformer_config_from_args(args)
    assert config["ffn_hidden_size"] == 320  # int(4 * 128 * 2 / 3 / 64) * 64, Megatron's SwiGLU default
    assert (config["gated_linear_unit"], config["activation_func"]) == (True, F.silu)
    assert (config["num_query_groups"], config["kv_channels"], config["sequence_parallel"]) == (2, 32, True)
    assert config["params_dtype"] == config["pipeline_dtype"] == torch.bfloat16 and config["bf16"]
    assert config["tensor_model_parallel_size"] == config["virtual_pipeline_model_parallel_size"] == 2
    assert (config["normalization"], config["position_embedding_type"], config["seed"]) == (
        "RMSNorm",
        "rope",
        1234,
    )
    plain = transformer_config_from_args(_args())
    assert (plain["num_query_groups"], plain["gated_linear_unit"]) == (None, False)
    assert plain["activation_func"] is F.gelu


def test_transformer_config_needs_validated_args():
    with pytest.raises(ValueError, match="call validate_args"):
        transformer_config_from_args(parse_args([]))


CONFIG_CASES = [
    "",
    (
        "--swiglu --group-query-attention --num-query-groups 2 --tensor-model-parallel-size 2 --bf16 "
        "--normalization RMSNorm --position-embedding-type rope --sequence-parallel"
    ),
    (
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t|t|tL "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    ),
]


@pytest.mark.parametrize("argv", CONFIG_CASES)
def test_transformer_config_accepts_the_keyword_arguments(argv):
    from core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_from_args(_args(argv, 2)))
    assert config.num_layers == 4 and config.hidden_size == 128

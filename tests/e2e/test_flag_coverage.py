"""Megatron flag coverage: every flag works, is accepted with no effect (and says so), or is rejected in one line.

Also: every accepted flag is read by a real run, the tiny demo's rules and banner, Megatron's defaults
and required flags on full command lines, ``--help`` sections, the backend fallback and run control.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from core import device
from core.transformer.transformer_config import openai_gelu
from tests.support.flags import assert_refused
from tests.support.flags import megatron_args as _args
from tests.support.torchrun_jobs import job_env, run_captured
from training.arguments.parser import (
    build_parser,
    parse_args,
    startup_report,
    transformer_config_from_args,
)
from training.arguments.schema import (
    BY_OPTION,
    COVERAGE,
    FLAGS,
    GROUPS,
    NO_EFFECT,
    NOT_YET,
    UNSUPPORTED,
    WORKS,
    coverage_of,
    not_yet,
)
from training.run import build_run
from training.run_control import ExitTimer, ManualGC

ROOT = Path(__file__).resolve().parents[2]
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3"
)
DATA = "--tokenizer-type NullTokenizer --vocab-size 1000"
MOE = (
    "this MoE option is not implemented (Trident's MoE: top-k softmax routing, aux_loss/seq_aux_loss "
    "and z-loss balancing, capacity with dropping or padding, shared experts, alltoall or allgather "
    "dispatch, experts whole on each expert-parallel rank)"
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """A tiny Megatron indexed dataset: 40 documents of 40 token ids below 1000."""
    from tests.support.torchrun_jobs import write_tiny_dataset

    prefix = tmp_path_factory.mktemp("data") / "tiny_text_document"
    return str(write_tiny_dataset(prefix, documents=40, length=40, vocab=1000))


# --------------------------------------------------------------------------------------------------
# The coverage table against the issue's list of Megatron flags
# --------------------------------------------------------------------------------------------------

ISSUE_FLAGS = {
    WORKS: "--context-parallel-size --expert-model-parallel-size --distributed-backend --exit-duration-in-mins "
    "--manual-gc --manual-gc-interval --distributed-timeout-minutes --ddp-bucket-size --ckpt-step "
    "--use-checkpoint-args --exit-on-missing-checkpoint --fp16 --loss-scale --loss-scale-window "
    "--use-distributed-optimizer --overlap-param-gather --grad-reduce-in-bf16 --init-model-with-meta-device "
    "--use-megatron-fsdp --data-parallel-sharding-strategy=optim --num-distributed-optimizer-instances "
    "--outer-dp-sharding-strategy "
    "--tokenizer-type=GPT2BPETokenizer --tokenizer-type=Llama2Tokenizer "
    "--tokenizer-type=HuggingFaceTokenizer --vocab-file --merge-file --mock-data --num-workers --data-cache-path "
    "--no-mmap-bin-files --train-data-path --valid-data-path --test-data-path --train-samples --lr-decay-samples "
    "--lr-warmup-samples --decoupled-lr --decoupled-min-lr --start-weight-decay --end-weight-decay "
    "--weight-decay-incr-style --lr-decay-style=WSD --lr-decay-style=inverse-square-root --lr-wsd-decay-style "
    "--lr-wsd-decay-iters --lr-wsd-decay-samples --tensorboard-dir --profile --profile-step-start "
    "--profile-step-end --profile-ranks --dataloader-type --checkpoint-activations --recompute-activations "
    "--rotary-base --rotary-percent --apply-layernorm-1p --no-position-embedding --norm-epsilon --openai-gelu "
    "--use-rope-scaling --rope-scaling-factor --cross-entropy-loss-fusion --num-experts --moe-router-topk --moe-grouped-gemm "
    "--moe-aux-loss-coeff --moe-layer-freq --moe-token-dispatcher-type=alltoall --moe-ffn-hidden-size "
    "--moe-shared-expert-intermediate-size --moe-expert-capacity-factor --moe-router-pre-softmax "
    "--rampup-batch-size --step-batch-size-schedule --fp8-format --fp8-recipe --fp8-amax-history-len "
    "--fp8-amax-compute-algo --fp8-margin --no-fp8-wgrad --first-last-layers-bf16 --fp8-param-gather "
    "--suggested-communication-unit-size --megatron-fsdp-main-params-dtype --megatron-fsdp-main-grads-dtype "
    "--megatron-fsdp-grad-comm-dtype",
    NO_EFFECT: "--log-throughput --attention-backend --use-mcore-models --empty-unused-memory-level "
    "--no-create-attention-mask-in-dataloader --no-masked-softmax-fusion "
    "--tiktoken-pattern --use-pytorch-profiler --data-impl --ckpt-format --fp8-interval --megatron-fsdp-version",
    NOT_YET: "--megatron-fsdp-enable-fine-grained-param-gather",
    UNSUPPORTED: "--moe-enable-deepep --moe-router-load-balancing-type=sinkhorn "
    "--tokenizer-type=TikTokenizer --ckpt-format=zarr --ckpt-format=torch_dcp --use-torch-fsdp2 "
    "--torch-fsdp2-no-reshard-after-forward --megatron-fsdp-version=2",
}


@pytest.mark.parametrize("status", list(ISSUE_FLAGS))
def test_every_flag_of_the_issue_is_classified(status):
    for option in ISSUE_FLAGS[status].replace("=", " ").split("--")[1:]:
        option = "--" + option.strip()
        assert coverage_of(option).status == status, option
        assert coverage_of(option).reason or status == WORKS, option
        if status in (WORKS, NO_EFFECT):
            flag = BY_OPTION[option.split(" ")[0]]  # accepted, so a config field declares it
            assert " " not in option or option.split(" ")[1] in flag.choices, option


def test_rejected_flags_are_hidden_from_help_and_named_in_its_epilog():
    text = build_parser().format_help()
    options = {
        o
        for action in build_parser()._actions
        if action.help != argparse.SUPPRESS
        for o in action.option_strings
    }
    for option, entry in COVERAGE.items():
        assert (option in options) == (not entry.rejected), option
        if entry.rejected:
            assert option.replace(" ", "=") in text.split("rejects")[1].split(), option
    assert "--moe-*" in text and "--megatron-fsdp-*" in text


def test_every_shown_flag_has_help_text():
    """From the field's docstring, or help= for a flag that stores False (``--disable-bias-linear``)."""
    assert [f.name for f in FLAGS if not coverage_of(f.name).rejected and len(f.help) < 10] == []


def test_a_field_shared_by_several_configs_is_one_flag_of_one_type():
    from dataclasses import fields

    from training.arguments.schema import SECTIONS, _annotation

    for cls, _ in SECTIONS:
        for field in fields(cls):
            flag = next((f for f in FLAGS if f.dest == field.name), None)
            if flag is not None and flag.owner is not cls and not issubclass(cls, flag.owner):
                assert _annotation(cls, field.name, field.type) == _annotation(
                    flag.owner, field.name, next(f for f in fields(flag.owner) if f.name == field.name).type
                ), f"{cls.__name__}.{field.name}"


# --------------------------------------------------------------------------------------------------
# (c) rejected: one line saying why
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--num-experts 8 --moe-enable-deepep --moe-router-score-function sigmoid --moe-grouped-gemm",
            f"Trident does not support --moe-enable-deepep, --moe-router-score-function sigmoid: {MOE}",
        ),
        (
            "--fp8-format hybrid --fp8-param-gather --norm-epsilon 1e-6 --openai-gelu --moe-use-upcycling",
            f"Trident does not support --moe-use-upcycling: {MOE}",
        ),
        (
            "--num-experts 8 --moe-router-load-balancing-type sinkhorn",
            f"Trident does not support --moe-router-load-balancing-type sinkhorn: {MOE}",
        ),
        (
            "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
            (
                "Trident does not support --cross-entropy-fusion-impl te: Trident uses no Transformer Engine: "
                "--cross-entropy-fusion-impl native (the default) or linear (the output layer fused in, logits "
                "never held)"
            ),
        ),
        (
            "--tokenizer-type TikTokenizer --tiktoken-pattern v2",
            (
                "Trident does not support --tokenizer-type TikTokenizer: Trident has no tiktoken tokenizer; save the "
                "tokenizer as a Hugging Face tokenizer folder and use --tokenizer-type HuggingFaceTokenizer"
            ),
        ),
    ],
)
def test_rejected_flags_raise_one_line_saying_why(argv, message):
    assert_refused(argv, message)


def test_a_not_yet_flag_says_yet_and_why(monkeypatch):
    """The "not supported yet" path, tested with entries made here (--cuda-graph-impl full_iteration is one)."""
    monkeypatch.setitem(COVERAGE, "--rotary-base", not_yet("a test entry"))
    monkeypatch.setitem(COVERAGE, "--openai-gelu", not_yet("a test entry"))
    with pytest.raises(ValueError) as err:
        parse_args(
            ["--openai-gelu", "--moe-enable-deepep", "--rotary-base", "1e6", "--tensorboard-dir", "tb"]
        )
    assert str(err.value) == (
        f"Trident does not support --openai-gelu, --rotary-base yet: a test entry; "
        f"Trident does not support --moe-enable-deepep: {MOE}"
    )
    assert "--rotary-base" in build_parser().format_help().split("rejects")[1].split()


def test_rejected_keys_in_a_config_file_are_rejected_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("fp16: true\nmoe-use-upcycling: true\n")
    with pytest.raises(
        ValueError, match=f"^{re.escape(f'Trident does not support --moe-use-upcycling: {MOE}')}"
    ):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--expert-model-parallel-size 4",
            "--expert-model-parallel-size 4 needs --num-experts (a model with experts)",
        ),
    ],
)
def test_parallel_sizes_above_one_are_rejected_and_one_is_accepted(argv, message):
    assert_refused(argv, message, 4)
    args = _args("--context-parallel-size 1 --expert-model-parallel-size 1")
    assert (args.context_parallel_size, args.expert_model_parallel_size) == (1, 1)


def test_context_parallel_sizes_above_one_work_and_take_their_ranks_from_data_parallelism():
    args = _args("--context-parallel-size 2 --cp-comm-type a2a", 8)
    assert (args.context_parallel_size, args.cp_comm_type, args.data_parallel_size) == (2, ["a2a"], 4)


def test_pretrain_exits_with_one_line_on_a_rejected_flag(capsys):
    from training.faults import run_main
    from training.training import pretrain

    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: pretrain(None, None, None, argv=["--moe-enable-deepep"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        f": error: Trident does not support --moe-enable-deepep: {MOE}"
    ), err


def test_model_flags_reach_the_transformer_config_with_megatrons_defaults():
    rope_and_norm = (
        "rotary_base",
        "rotary_percent",
        "layernorm_epsilon",
        "rope_scaling",
        "rope_scaling_factor",
        "layernorm_zero_centered_gamma",
    )
    args = _args("")
    config = transformer_config_from_args(args)
    assert [config[key] for key in rope_and_norm] == [10000.0, 1.0, 1e-5, False, 8.0, False]
    assert config["activation_func"] is torch.nn.functional.gelu
    assert (args.fp16, args.use_distributed_optimizer, args.grad_reduce_in_fp32) == (False, False, True)
    config = transformer_config_from_args(
        _args(
            "--position-embedding-type rope --no-position-embedding --rotary-base 500000 --rotary-percent 0.5 "
            "--use-rope-scaling --rope-scaling-factor 32 --norm-epsilon 1e-6 --apply-layernorm-1p --openai-gelu"
        )
    )
    assert [config[key] for key in rope_and_norm] == [500000, 0.5, 1e-6, True, 32.0, True]
    assert config["activation_func"] is openai_gelu and config["position_embedding_type"] == "rope"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--no-position-embedding",
            (
                "--no-position-embedding needs --position-embedding-type rope (as in Megatron, where it is "
                "deprecated); for a model with no position information at all use --position-embedding-type none"
            ),
        ),
        (
            "--swiglu --openai-gelu",
            "--openai-gelu and --swiglu exclude each other: SwiGLU's gate uses SiLU, not GELU",
        ),
    ],
)
def test_model_flags_that_do_not_fit_together_are_one_error(argv, message):
    assert_refused(argv, message)


# --------------------------------------------------------------------------------------------------
# (b) accepted, no effect: listed in --help, reported once at start
# --------------------------------------------------------------------------------------------------


def test_no_effect_flags_are_reported_at_start_and_listed_in_help():
    args = _args(
        "--use-mcore-models --attention-backend fused --no-masked-softmax-fusion --tiktoken-pattern v2"
    )
    assert startup_report(args)[-1] == (
        "accepted, no effect here: --attention-backend fused (attention is PyTorch's "
        "scaled_dot_product_attention); --use-mcore-models (Trident has one model implementation, built like "
        "Megatron Core's); --no-masked-softmax-fusion (softmax is one PyTorch call, never a fused kernel); "
        "--tiktoken-pattern v2 (only a TikTokenizer reads it, and Trident has none)"
    )
    assert not any(line.startswith("accepted") for line in startup_report(_args("")))
    helps = {o: action.help for action in build_parser()._actions for o in action.option_strings}
    for option, entry in COVERAGE.items():
        if entry.status == NO_EFFECT:
            assert f"Accepted, no effect here: {entry.reason}." in helps[option], option


# --------------------------------------------------------------------------------------------------
# --help sections
# --------------------------------------------------------------------------------------------------


def test_help_is_grouped_like_megatrons():
    parser = build_parser()
    titles = [
        line[:-1] for line in parser.format_help().splitlines() if line.endswith(":") and line[0] != " "
    ]
    assert titles == ["options", *GROUPS]
    sections = {
        group.title: [
            o for a in group._group_actions if a.help != argparse.SUPPRESS for o in a.option_strings
        ]
        for group in parser._action_groups
    }
    expected = {
        "network size": "--num-layers --hidden-size --num-attention-heads --seq-length --swiglu --disable-bias-linear",
        "regularization": "--hidden-dropout --attention-dropout --weight-decay --clip-grad --adam-beta2",
        "training": "--micro-batch-size --global-batch-size --train-iters --recompute-granularity --manual-gc",
        "initialization": "--seed --init-method-std",
        "learning rate": "--lr --min-lr --lr-decay-style --lr-warmup-iters --lr-warmup-fraction",
        "checkpointing": "--save --load --save-interval --persistent-save-interval --finetune",
        "mixed precision": "--bf16",
        "distributed": "--tensor-model-parallel-size --pipeline-model-parallel-size --distributed-backend "
        "--overlap-grad-reduce --pipeline-model-parallel-layout",
        "validation": "--eval-interval --eval-iters",
        "data and dataloader": "--data-path --split --eod-mask-loss",
        "tokenizer": "--tokenizer-type --tokenizer-model --vocab-size",
        "logging": "--wandb-project --wandb-exp-name --wandb-save-dir --log-throughput",
    }
    for section, options in expected.items():
        assert set(options.split()) <= set(sections[section]), section
    shown = [o for options in sections.values() for o in options]
    assert len(shown) == len(set(shown))  # each flag in one section


# --------------------------------------------------------------------------------------------------
# Defaults: the tiny demo only fills in, only while no model-size flag and no data source is given
# --------------------------------------------------------------------------------------------------

DEMO_LINE = (
    "tiny demo (no model-size flag but --num-layers, no data source): filled in {filled}--hidden-size 128 "
    "--num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 100 "
    "--lr 0.001 --lr-decay-style cosine --lr-warmup-fraction 0.1 --log-interval 10 --eval-interval 50 "
    "--eval-iters 5{given}"
)
DATA_LINE = (
    "no data source (--data-path, --mock-data): training on the built-in corpus (this Python's standard-library "
    "docstrings and pydoc topics) with Trident's own SentencePiece tokenizer"
)


def test_the_banner_says_exactly_what_the_demo_filled_in():
    assert startup_report(_args("")) == [DEMO_LINE.format(filled="--num-layers 4 ", given=""), DATA_LINE]
    args = _args("--num-layers 4")
    assert startup_report(args) == [
        DEMO_LINE.format(filled="", given="; as given: --num-layers 4"),
        DATA_LINE,
    ]
    assert args.num_layers == 4 and args.using_default_model
    line = startup_report(_args("--num-layers 2 --train-iters 7 --log-interval 1 --lr-warmup-iters 2"))[0]
    assert "--train-iters" not in line.split(";")[0] and "--lr-warmup-fraction" not in line
    assert line.endswith("; as given: --num-layers 2 --train-iters 7 --log-interval 1")


@pytest.mark.parametrize(
    "argv",
    [
        "--hidden-dropout 0 --attention-dropout 0",
        "--bf16",
        "--adam-beta2 0.95 --weight-decay 0.1 --clip-grad 0.5",
        "--lr-decay-style linear --lr-warmup-iters 5 --min-lr 1e-5",
        "--log-interval 1 --eval-iters 0 --wandb-project p",
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel",
        "--swiglu --normalization RMSNorm --position-embedding-type rope --kv-channels 16",
    ],
)
def test_dropout_precision_optimizer_schedule_logging_and_parallel_flags_keep_the_demo(argv):
    args = _args(argv, 4)
    assert args.using_default_model and args.hidden_size == 128 and args.tiny_demo_off_by == []


@pytest.mark.parametrize(
    "argv, off_by",
    [
        ("--hidden-size 64", ["--hidden-size"]),
        ("--num-attention-heads 8", ["--num-attention-heads"]),
        ("--seq-length 64", ["--seq-length"]),
        ("--ffn-hidden-size 256", ["--ffn-hidden-size"]),
        ("--data-path A", ["--data-path"]),
        ("--seq-length 64 --data-path A", ["--seq-length", "--data-path"]),
    ],
)
def test_a_model_size_flag_or_a_data_source_turns_the_demo_off(argv, off_by):
    args = parse_args(argv.split())
    assert not args.using_default_model and args.tiny_demo_off_by == off_by and args.tiny_demo_filled == {}
    assert (args.lr, args.train_iters, args.micro_batch_size, args.log_interval) == (None, None, None, 100)


def test_a_full_command_line_gets_megatrons_defaults(dataset):
    args = _args(f"{MODEL} --data-path {dataset} {DATA} --global-batch-size 8", 2)
    assert (args.lr_warmup_iters, args.lr_warmup_fraction, args.lr_decay_style) == (0, None, "linear")
    assert (args.log_interval, args.eval_interval, args.eval_iters) == (100, 1000, 100)
    assert (args.split, args.min_lr, args.weight_decay, args.hidden_dropout) == ("969,30,1", 0.0, 0.01, 0.1)
    assert startup_report(args) == []
    no_gbs = _args(f"{MODEL} --data-path {dataset} {DATA}".replace("--global-batch-size 4", ""), 2)
    assert no_gbs.global_batch_size == 4  # Megatron: micro-batch 2 x data-parallel 2
    assert _args(f"{MODEL} --train-iters 10").lr_warmup_iters == 0  # the issue's failing command line


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--hidden-size 64",
            (
                "--num-layers, --num-attention-heads, --seq-length, --micro-batch-size, --train-iters, --lr are "
                "required: Megatron has no default for them, and the tiny demo that fills them in is off because "
                "--hidden-size was given"
            ),
        ),
        (
            f"{MODEL} --data-path A",
            (
                "--tokenizer-type is required: Megatron has no default for it, and the tiny demo that fills it in is "
                "off because --hidden-size, --num-attention-heads, --seq-length, --data-path were given"
            ),
        ),
        (
            "--num-layers 2 --hidden-size 32 --seq-length 16 --micro-batch-size 2 --data-path A",
            (
                "--num-attention-heads, --train-iters, --lr, --tokenizer-type are required: Megatron has no default "
                "for them, and the tiny demo that fills them in is off because --hidden-size, --seq-length, "
                "--data-path were given"
            ),
        ),
    ],
)
def test_values_megatron_requires_are_errors_naming_the_flags(argv, message):
    assert_refused(argv, message)


# --------------------------------------------------------------------------------------------------
# Run control and the backend
# --------------------------------------------------------------------------------------------------


def test_manual_gc_collects_at_fixed_steps_only():
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        collector = ManualGC(enabled=True, interval=2, around_eval=False)
        with collector:
            assert not gc.isenabled() and collections == [2]  # a full collection at the start
            collector.after_step(1)
            collector.after_step(2)
            with collector.evaluation():
                pass
            assert collections == [2, 2]
        assert gc.isenabled()
        with ManualGC(enabled=False, interval=1, around_eval=True):
            assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.enable()


def test_exit_timer_asks_every_rank():
    asked = []
    assert not ExitTimer(None, asked.append).expired() and asked == []
    assert ExitTimer(0, lambda local: asked.append(local) or True).expired() and asked == [True]
    assert not ExitTimer(60, lambda local: local).expired()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_nccl_without_cuda_falls_back_to_gloo_with_one_warning(capsys):
    try:
        assert device.select_backend("nccl") == "gloo" and device.current_device() == torch.device("cpu")
        assert capsys.readouterr().err == (
            "WARNING: --distributed-backend nccl needs CUDA, which this machine does not have: using gloo\n"
        )
        assert device.select_backend("gloo") == "gloo" and capsys.readouterr().err == ""
    finally:
        device.select_backend(None)


# --------------------------------------------------------------------------------------------------
# Every accepted flag is read: a recording namespace and recording configs through a real one-rank run
# --------------------------------------------------------------------------------------------------


class RecordingNamespace(argparse.Namespace):
    """An ``args`` namespace that remembers the name of every attribute read from it."""

    def __init__(self) -> None:
        super().__init__()
        self.__dict__["_reads"] = set()

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if not name.startswith("_"):
            super().__getattribute__("__dict__")["_reads"].add(name)
        return value


def _record_config_reads(monkeypatch, reads: set[str]) -> None:
    """Record every field read on any instance of the dataclasses that declare flags: after validation
    the run is described by those typed objects (``training.run.Run``), and the loop reads them."""
    for cls in {flag.owner for flag in FLAGS}:

        def getattribute(self, name: str, _original=cls.__getattribute__):
            if not name.startswith("_"):
                reads.add(name)
            return _original(self, name)

        monkeypatch.setattr(cls, "__getattribute__", getattribute)


READ_ON_OTHER_PATHS = {
    "--sgd-momentum": "read by get_megatron_optimizer with --optimizer sgd (tests/dist/test_distributed_optimizer.py)",
    "--memory-snapshot-path": "read where --record-memory-history records, on CUDA (tests/unit/test_cuda.py)",
}
"""Flags the run below does not read because they belong to another path, and where they are read."""


def _unread(reads: set[str]) -> set[str]:
    """Accepted flags (all but the rejected ones) whose attribute nobody read; --config is read by
    parse_args itself before any namespace exists."""
    return {f.name for f in FLAGS if not coverage_of(f.name).rejected and f.dest not in reads} - {"--config"}


def _nan_on_first_call(forward_step):
    """pretrain_gpt's forward step, with a NaN loss on its first call (the skip-a-bad-step path)."""
    calls = itertools.count()

    def step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        if next(calls):
            return output, loss_func

        def nan_loss(output_tensor):
            loss, *counts, logs = loss_func(output_tensor)  # (loss, log) or (loss sum, tokens, log)
            return loss * float("nan"), *counts, {k: v * float("nan") for k, v in logs.items()}

        return output, nan_loss

    return step


def _pretrain(argv: list[str], forward_step=pretrain_gpt.forward_step, namespace=None):
    from training.training import pretrain

    args = parse_args(argv, namespace=namespace)
    return args, pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        forward_step,
        tokenizer_provider=pretrain_gpt.tokenizer_provider,
        args=args,
    )


def test_every_accepted_flag_is_read(dataset, tmp_path, capsys, monkeypatch):
    checkpoints = str(tmp_path / "ckpt")
    argv = [
        *f"{MODEL} --data-path {dataset} {DATA} --split 90,10,0 --eval-interval 1 --eval-iters 1".split(),
        *("--log-interval", "1", "--save", checkpoints, "--load", checkpoints, "--manual-gc"),
        *("--manual-gc-interval", "2", "--exit-duration-in-mins", "1000", "--distributed-backend", "gloo"),
        *("--tensorboard-dir", str(tmp_path / "tb"), "--profile", "--profile-step-start", "1"),
        *("--profile-step-end", "2", "--num-workers", "1", "--data-cache-path", str(tmp_path / "cache")),
        *("--decoupled-lr", "2e-3", "--dataloader-type", "cyclic", "--check-for-spiky-loss"),
        *("--check-for-large-grads", "--result-rejected-tracker-filename", str(tmp_path / "rejected.txt")),
    ]
    namespace, typed_reads = RecordingNamespace(), set()
    _record_config_reads(monkeypatch, typed_reads)
    _, state = _pretrain(argv, _nan_on_first_call(pretrain_gpt.forward_step), namespace)
    assert _unread(namespace._reads | typed_reads) == set(READ_ON_OTHER_PATHS)
    assert state.iteration == 3 and state.skipped_iterations == 1 and len(state.losses) == 3
    assert (tmp_path / "ckpt" / "iter_0000003").is_dir() and gc.isenabled()
    assert list((tmp_path / "cache").glob("*GPTDataset-train-shuffle_index.npy"))  # --data-cache-path
    trace = json.loads((tmp_path / "tb" / "rank0.pt.trace.json").read_text())  # iteration 2 only
    assert trace["traceEvents"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(losses) == [2, 3] and losses[3] == pytest.approx(
        state.losses[-1]["lm loss"], rel=1e-6
    )  # 1 was NaN
    assert [e.step for e in events.Scalars("validation/lm loss")] == [1, 2, 3]
    # The check can fail: before the run, the flags only the training loop reads are unread.
    partial, typed_reads = RecordingNamespace(), set()
    build_run(parse_args(argv, namespace=partial), 1)
    assert {
        "--wandb-project",
        "--exit-signal-handler",
        "--manual-gc",
        "--finetune",
        "--eod-mask-loss",
    } <= _unread(partial._reads | typed_reads)
    out = capsys.readouterr().out
    assert "validation loss at iteration 3" in out
    summary = out[out.index("run summary: 3 iterations in ") :].splitlines()
    assert re.match(r"  final train lm loss: \d\.\d{4} \| final validation lm loss: \d\.\d{4}$", summary[1])
    assert summary[2] == f"  checkpoint: {checkpoints} (iteration 3)"
    assert summary[3].startswith("  train longer: ") and summary[3].endswith(
        f"--save {checkpoints} --manual-gc --manual-gc-interval 2 --exit-duration-in-mins 1000 --distributed-backend "
        f"gloo --tensorboard-dir {tmp_path / 'tb'} --profile --profile-step-start 1 --profile-step-end 2 --num-workers "
        f"1 --data-cache-path {tmp_path / 'cache'} --decoupled-lr 2e-3 --dataloader-type cyclic --check-for-spiky-loss "
        f"--check-for-large-grads --result-rejected-tracker-filename {tmp_path / 'rejected.txt'} --load {checkpoints} "
        "--train-iters 6 --override-opt_param-scheduler"
    )  # the flags as given, --load once (at the end), --train-iters replaced
    assert summary[4] == "    (pretrain() was given these flags directly: pass them to it again)"
    assert summary[5] == f"  TensorBoard: tensorboard --logdir {tmp_path / 'tb'}"


def test_exit_duration_saves_and_exits_after_the_step_that_ran_out(dataset, tmp_path, capsys):
    argv = f"{MODEL} --data-path {dataset} {DATA} --split 90,10,0 --eval-iters 0 --exit-duration-in-mins 0".split()
    _, state = _pretrain([*argv, "--train-iters", "50", "--save", str(tmp_path)])
    assert state.iteration == 1
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (
        "--exit-duration-in-mins 0 reached: saving a checkpoint at iteration 1 and exiting"
        in capsys.readouterr().out
    )


# --------------------------------------------------------------------------------------------------
# A Megatron-style command line through the real entry script
# --------------------------------------------------------------------------------------------------


def test_megatron_command_line_trains_with_megatrons_defaults(dataset, tmp_path):
    """The issue's command line (own data instead of --mock-data); --split 969,30,1 leaves no test documents."""
    argv = (
        f"{MODEL} --data-path {dataset} --tokenizer-type NullTokenizer --vocab-size 1024 --eval-iters 1 "
        "--use-mcore-models --no-masked-softmax-fusion"
    ).split()
    done = run_captured(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv], env=job_env(), timeout=120, cwd=tmp_path
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    iterations = [line for line in out.splitlines() if "] iteration " in line]
    assert len(iterations) == 1, out  # log every 100
    assert re.match(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        3/       3 \|", iterations[0])
    assert iterations[0].endswith("| ETA: 0:00:00 |")
    assert re.search(r"\| lm loss: \d\.\d{6}E\+\d\d \|", iterations[0])
    assert out.count("accepted, no effect here: ") == 1
    assert "accepted, no effect here: --use-mcore-models (" in out and "; --no-masked-softmax-fusion (" in out
    assert out.count("WARNING: --split 969,30,1 leaves no documents in the test split of") == 1
    assert "tiny demo" not in out and "validation loss" not in out  # --eval-interval 1000

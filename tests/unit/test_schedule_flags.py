"""The learning-rate and weight-decay flags: sample-based runs, WSD, inverse square root, decoupled LR."""

from __future__ import annotations

import math

import pytest

from core.optimizer import get_param_groups
from core.optimizer.lr_scheduler import OptimizerParamScheduler
from tests.support.flags import assert_refused, megatron_args
from tests.support.gpt_model import SEQ, VOCAB, make_config
from training.lr_schedule import scheduler_kwargs

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --lr 1e-3"
)
DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 100 --global-batch-size 16"


def _args(argv: str):
    return megatron_args(f"{MODEL} {DATA} {argv}")


class _Groups:
    """Just what the scheduler touches of an optimizer."""

    def __init__(self, *groups: dict) -> None:
        self.param_groups = list(groups)


def _curve(argv: str, points: list[int]) -> list[float]:
    """The learning rate after each of ``points`` iterations (global batch 16)."""
    groups = _Groups({})
    scheduler = OptimizerParamScheduler(groups, **scheduler_kwargs(_args(argv)))
    out = []
    for iteration in points:
        scheduler.num_steps = 0
        scheduler.step(iteration * 16)
        out.append(groups.param_groups[0]["lr"])
    return out


def test_sample_based_flags_give_the_iteration_based_schedule():
    samples = _args(
        "--train-samples 160 --lr-decay-samples 128 --lr-warmup-samples 32 --lr-decay-style cosine"
    )
    iters = _args("--train-iters 10 --lr-decay-iters 8 --lr-warmup-iters 2 --lr-decay-style cosine")
    assert samples.train_iters == 10 and samples.save_interval == 10
    assert scheduler_kwargs(samples) == scheduler_kwargs(iters)
    odd = _args("--train-samples 170 --lr-warmup-fraction 0.1")  # Megatron: samples // global batch
    assert odd.train_iters == 10 and scheduler_kwargs(odd)["lr_warmup_steps"] == pytest.approx(17.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--train-iters 10 --train-samples 160",
            "--train-iters and --train-samples are mutually exclusive: give one",
        ),
        (
            "--train-iters 10 --lr-decay-samples 100",
            (
                "--lr-decay-samples needs --train-samples (sample-based training); with --train-iters use "
                "--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters"
            ),
        ),
        (
            "--train-samples 160 --lr-decay-iters 5 --lr-warmup-iters 1",
            (
                "--lr-decay-iters, --lr-warmup-iters are for iteration-based training; with --train-samples use "
                "--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples"
            ),
        ),
        (
            "--train-samples 160 --lr-warmup-samples 200",
            "--lr-warmup-samples (200) must be < the decay samples (160, from --lr-decay-samples or else --train-samples)",
        ),
        ("--train-samples 8", "--train-samples (8) is less than one global batch (--global-batch-size 16)"),
        (
            "--train-iters 10 --lr-decay-style WSD",
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final anneal)",
        ),
        ("--train-iters 10 --lr-wsd-decay-style cosine", "--lr-wsd-decay-style needs --lr-decay-style WSD"),
        (
            "--train-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters 11",
            "--lr-wsd-decay-iters (11) must be > 0 and at most the decay iterations (10)",
        ),
        (
            "--train-iters 10 --start-weight-decay 0",
            (
                "--start-weight-decay needs --weight-decay-incr-style linear or cosine (with constant, the weight decay "
                "is --weight-decay)"
            ),
        ),
        (
            "--train-iters 10 --weight-decay-incr-style linear",
            "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay",
        ),
        ("--train-iters 10 --decoupled-min-lr 1e-5", "--decoupled-min-lr needs --decoupled-lr"),
        (
            "--train-iters 10 --lr-warmup-samples 3 --lr-warmup-fraction 0.1",
            (
                "--lr-warmup-samples needs --train-samples (sample-based training); with --train-iters use "
                "--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters"
            ),
        ),
    ],
)
def test_schedule_flag_errors_name_the_flags(argv, message):
    assert_refused(f"{MODEL} {DATA} {argv}", message)


def test_wsd_and_inverse_square_root_follow_megatrons_formulas():
    wsd = _curve(
        "--train-iters 100 --lr-warmup-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters 20",
        [5, 50, 80, 90, 100],
    )
    assert wsd[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # warm-up, then stable until the last 20 iterations
    assert wsd[3] == pytest.approx(1e-3 * (2 * 0.5**0.5 - 1))  # exponential anneal, halfway
    assert wsd[4] == pytest.approx(0.0)
    cosine_wsd = _curve(
        "--train-iters 100 --lr-decay-style WSD --lr-wsd-decay-iters 20 --lr-wsd-decay-style cosine --min-lr 1e-4",
        [90],
    )
    assert cosine_wsd == pytest.approx([1e-4 + 0.5 * (math.cos(math.pi * 0.5) + 1) * 9e-4])
    isr = _curve("--train-iters 100 --lr-warmup-iters 4 --lr-decay-style inverse-square-root", [4, 16, 64])
    assert isr == pytest.approx([1e-3, 1e-3 * (4 / 16) ** 0.5, 1e-3 * (4 / 64) ** 0.5])


def test_weight_decay_ramps_over_the_run():
    args = _args(
        "--train-iters 10 --weight-decay-incr-style linear --start-weight-decay 0.0 --end-weight-decay 0.1"
    )
    groups = _Groups({"wd_mult": 1.0}, {"wd_mult": 0.0})
    scheduler = OptimizerParamScheduler(groups, **scheduler_kwargs(args))
    scheduler.step(5 * 16)
    assert [g["weight_decay"] for g in groups.param_groups] == pytest.approx([0.05, 0.0])


def test_decoupled_lr_drives_the_embedding_and_output_layer():
    from models.gpt import GPTModel

    model = GPTModel(make_config("llama"), VOCAB, SEQ)  # untied: embedding and output layer are two weights
    groups = get_param_groups(model, 0.1, decoupled_lr=5e-3, decoupled_min_lr=5e-4)
    decoupled = [g for g in groups if "max_lr" in g]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for g in decoupled for p in g["params"]) == [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ]
    args = _args(
        "--train-iters 10 --lr-decay-style linear --min-lr 1e-4 --decoupled-lr 5e-3 --decoupled-min-lr 5e-4"
    )
    optimizer = _Groups(*groups)
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_kwargs(args))
    scheduler.step(5 * 16)
    lrs = sorted({g["lr"] for g in optimizer.param_groups})
    assert lrs == pytest.approx([1e-4 + 0.5 * (1e-3 - 1e-4), 5e-4 + 0.5 * (5e-3 - 5e-4)])
    assert all("max_lr" not in g for g in get_param_groups(model, 0.1))  # off without --decoupled-lr

"""Megatron's flags as ``pretrain_gpt.py`` reads them, the one-line error that refuses bad ones, and a
tiny model's flags."""

from __future__ import annotations

import argparse
import re

import pytest

from training.arguments.checks import validate_args
from training.arguments.parser import parse_args


def megatron_args(argv: str = "", world_size: int = 1) -> argparse.Namespace:
    """``argv`` parsed and checked for ``world_size`` ranks, as training does before it builds anything."""
    return validate_args(parse_args(argv.split()), world_size)


def assert_refused(argv: str, message: str, world_size: int = 1) -> None:
    """Training refuses ``argv`` at ``world_size`` ranks with a ValueError saying exactly ``message``."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        megatron_args(argv, world_size)


# A tiny model on mock data: the batch-size tests append their batch and length flags.
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
)

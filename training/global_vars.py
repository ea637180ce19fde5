"""Megatron's ``get_args()`` / ``get_tokenizer()`` for entry scripts; ``core/`` never reads these."""

from __future__ import annotations

import argparse
from typing import Any

_ARGS: argparse.Namespace | None = None
_TOKENIZER: Any = None


def set_global_variables(args: argparse.Namespace, tokenizer: Any) -> None:
    global _ARGS, _TOKENIZER
    _ARGS, _TOKENIZER = args, tokenizer


def get_args() -> argparse.Namespace:
    if _ARGS is None:
        raise RuntimeError(
            "arguments are not set yet: get_args() works once training.pretrain() has parsed them"
        )
    return _ARGS


def get_tokenizer() -> Any:
    if _TOKENIZER is None:
        raise RuntimeError("the tokenizer is not built yet: get_tokenizer() works inside training.pretrain()")
    return _TOKENIZER

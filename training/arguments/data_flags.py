"""The data and tokenizer flags checked together, before any process group or file is opened.

Part of :func:`training.arguments.checks.derive_args`; the readers (``training.data.builder``) parse the
same blends and split, so a run refused here would have failed there, only later and on every rank.
"""

from __future__ import annotations

import argparse

from training.arguments.config import DATA_SOURCE_FLAGS, DEFAULT_SPLIT
from training.arguments.schema import BY_OPTION
from training.arguments.schema import flag_name as _flag
from training.data.builder import parse_data_path, parse_split

__all__ = ["check_data_flags"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_data_flags(args: argparse.Namespace) -> None:
    """One data source, per-split paths with a train path, the tokenizer's files, readable blends, and
    the split (``--split`` defaults to Megatron's with one data path or mock data)."""
    sources = [f for f in DATA_SOURCE_FLAGS if getattr(args, BY_OPTION[f].dest) not in (None, False)]
    _require(len(sources) <= 1, f"{' and '.join(sources)} are mutually exclusive: give one data source")
    per_split = [_flag(d) for d in ("valid_data_path", "test_data_path") if getattr(args, d) is not None]
    _require(
        not per_split or args.train_data_path is not None,
        f"{', '.join(per_split)} {'needs' if len(per_split) == 1 else 'need'} --train-data-path",
    )
    kind = args.tokenizer_type
    if kind == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    if kind == "GPT2BPETokenizer":
        _require(
            args.vocab_file is not None and args.merge_file is not None,
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file",
        )
    if kind == "HuggingFaceTokenizer":
        _require(
            args.tokenizer_model is not None,
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model: a local folder saved by "
            "transformers (tokenizer.json, tokenizer_config.json); nothing is downloaded",
        )
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, dest) is not None:
            try:
                parse_data_path(getattr(args, dest))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{_flag(dest)}: {err}") from None
    if (args.data_path is not None or args.mock_data) and args.split is None:
        args.split = DEFAULT_SPLIT
    if args.split is not None:
        parse_split(args.split)  # its ValueError already names --split

"""Command-line arguments with Megatron-LM's flag names and defaults, generated from the config schema.

``parse_args`` reads ``--config FILE`` (YAML or TOML; keys are flag names with dashes or
underscores) and then the command line, which overrides the file; it returns Megatron's flat
namespace (``args.num_layers``, ``args.lr``, ...). :func:`training.run.build_run` then checks the
flags together and describes the run by typed objects; ``config_from_args`` builds any typed config
from a validated namespace (``get_args()``). The flags themselves, their types,
defaults and help, and which Megatron flags are rejected, live in :mod:`training.arguments.schema`.

Defaults are Megatron's. Only the bare command is different: while no model-size flag other than
``--num-layers`` (``--hidden-size``, ``--num-attention-heads``, ``--seq-length``,
``--ffn-hidden-size``) and no data source (``--data-path``, ``--mock-data``) is given, the tiny demo
(``TINY_DEMO``) fills in the values that were not given, and the run says which. Without a data
source, the run trains on the built-in corpus with Trident's own SentencePiece tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
import textwrap
from typing import Any

import torch.nn.functional as F

from core.transformer.transformer_config import TransformerConfig, openai_gelu
from training.arguments.config import DATA_SOURCE_FLAGS
from training.arguments.config_file import REJECTED_DEST, load_config
from training.arguments.data_parallel_flags import sharding_report
from training.arguments.schema import (
    BY_DEST,
    BY_OPTION,
    COVERAGE,
    FLAGS,
    GROUPS,
    NO_EFFECT,
    NOT_YET,
    REJECTED_PREFIXES,
    Flag,
    coverage_of,
    rejected_values,
)
from training.errors import UsageError

__all__ = [
    "TINY_DEMO",
    "build_parser",
    "config_from_args",
    "config_kwargs",
    "load_config",
    "parse_args",
    "parse_args_or_usage_error",
    "startup_report",
    "transformer_config_from_args",
]

TINY_DEMO: dict[str, Any] = {
    # What the bare command trains: a 4-layer, 128-wide GPT for 100 iterations, in a minute on a CPU.
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "seq_length": 128,
    "micro_batch_size": 4,
    "train_iters": 100,
    "lr": 1e-3,
    "lr_decay_style": "cosine",
    "lr_warmup_fraction": 0.1,
    "log_interval": 10,
    "eval_interval": 50,
    "eval_iters": 5,
}
"""The tiny demo's values (and --global-batch-size: the smallest multiple of micro-batch x DP >= 16)."""
DEMO_OFF_MODEL_FLAGS = ("--hidden-size", "--num-attention-heads", "--seq-length", "--ffn-hidden-size")
DEFAULT_TOKENIZER = "GPTSentencePieceTokenizer"
SAME_AS: dict[str, str] = {"max_position_embeddings": "seq_length"}
"""Flags that default to another flag's value as given (``--save-interval``, which defaults to the run's
length, is derived in validation: a sample-based run's length is known only then)."""


# --------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------


def _help(flag: Flag) -> str:
    entry = coverage_of(flag.name)
    text = flag.help
    if entry.status == NO_EFFECT:
        text = f"{text} Accepted, no effect here: {entry.reason}."
    elif entry.only:
        text = f"{text} Only {', '.join(map(str, entry.only))}: {entry.reason}."
    shown = [] if flag.kind is bool or flag.default in (None, "", []) else [f"default: {flag.default}"]
    if flag.dest in TINY_DEMO:
        shown.append(f"tiny demo: {TINY_DEMO[flag.dest]}")
    return (f"{text} [{'; '.join(shown)}]" if shown else text).replace("%", "%%")


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, without breaking flag names at their hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()),
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )


def build_parser() -> argparse.ArgumentParser:
    """The parser, grouped like Megatron's; absent flags stay absent from its namespace."""
    rejected = [o for o, c in COVERAGE.items() if c.rejected]
    parser = argparse.ArgumentParser(
        prog=os.path.basename(sys.argv[0]) or "pretrain_gpt.py",
        usage="%(prog)s [--flag value ...]",
        description="Trident: Megatron-style 3D-parallel GPT training. Flags have Megatron's names and "
        "defaults; with no model-size or data flags, a tiny demo GPT trains on a built-in corpus.",
        epilog="Megatron flags Trident rejects, with one line saying why when given, are "
        + " ".join([o.replace(" ", "=") for o in rejected] + [p + "*" for p in REJECTED_PREFIXES]),
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for flag in FLAGS:
        hidden = coverage_of(flag.name).rejected
        kw: dict[str, Any] = {
            "dest": flag.dest,
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS if hidden else _help(flag),
        }
        if flag.kind is bool:
            action = "store_true" if flag.stores(flag.name) else "store_false"
            groups[flag.group].add_argument(*flag.options, action=action, **kw)
            if flag.negation:
                opposite = "store_false" if action == "store_true" else "store_true"
                kw["help"] = argparse.SUPPRESS if hidden else f"Opposite of {flag.name}."
                groups[flag.group].add_argument(flag.negation, action=opposite, **kw)
        else:
            if flag.choices:  # values the table rejects are parsed, then rejected with a reason
                kw["choices"] = flag.choices + rejected_values(flag.name)
                kw["metavar"] = "{" + ",".join(map(str, flag.choices)) + "}"
            groups[flag.group].add_argument(*flag.options, type=flag.kind, nargs=flag.nargs, **kw)
    for option in rejected:
        if option not in BY_OPTION and " " not in option:  # no field: take any values, then say why
            parser.add_argument(
                option,
                nargs="*",
                dest=REJECTED_DEST + option,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    return parser


# --------------------------------------------------------------------------------------------------
# Parsing: given values, rejections, the tiny demo, Megatron's defaults
# --------------------------------------------------------------------------------------------------


def _rejection(options: list[str]) -> str:
    """One line: every rejected flag, grouped by reason."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for option in options:
        entry = coverage_of(option)
        by_reason.setdefault((entry.status, entry.reason), []).append(option)
    return "; ".join(
        f"Trident does not support {', '.join(opts)}{' yet' if status == NOT_YET else ''}: {reason}"
        for (status, reason), opts in by_reason.items()
    )


def _unknown(parser: argparse.ArgumentParser, extras: list[str]) -> list[str]:
    """Flags of rejected families (``--moe-*``) among the unparsed tokens; anything else is an error."""
    rejected, bad, skipping_values = [], [], False
    for token in extras:
        if token.startswith("--"):
            option = token.split("=", 1)[0]
            skipping_values = coverage_of(option).rejected
            if skipping_values:
                rejected.append(option)
            else:
                bad.append(token)
        elif not skipping_values:  # a value of a rejected flag is skipped with it
            bad.append(token)
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return rejected


def _given(argv: list[str] | None) -> dict[str, Any]:
    """Values given in ``--config`` and on the command line (which wins), by dest; rejects what
    Trident does not support with one ``ValueError``, its flags in command-line order."""
    parser = build_parser()
    parsed, extras = parser.parse_known_args(argv)
    rejected = _unknown(parser, extras)
    cli = vars(parsed)
    given = load_config(cli["config"]) if cli.get("config") else {}
    given.update(cli)
    rejected += [k[len(REJECTED_DEST) :] for k in given if k.startswith(REJECTED_DEST)]
    for dest, value in given.items():
        flag = BY_DEST.get(dest)
        if flag is not None and coverage_of(flag.name).rejected:
            rejected.append(flag.name)
        elif flag is not None and flag.choices and coverage_of(f"{flag.name} {value}").rejected:
            rejected.append(f"{flag.name} {value}")
    if rejected:
        tokens = [t.split("=", 1)[0] for t in (sys.argv[1:] if argv is None else argv)]
        first = {option: option.split(" ", 1)[0] for option in rejected}
        order = {o: tokens.index(first[o]) if first[o] in tokens else len(tokens) for o in rejected}
        raise ValueError(_rejection(sorted(order, key=order.get)))
    return given


def parse_args(
    argv: list[str] | None = None, namespace: argparse.Namespace | None = None
) -> argparse.Namespace:
    """Megatron-named flags from ``--config`` and the command line (which wins), defaults filled in.

    Besides one attribute per flag, sets ``using_default_model`` (the tiny demo is on),
    ``using_default_data`` (no data source: the built-in corpus), ``tiny_demo_filled`` (dest ->
    value the demo filled in), ``tiny_demo_off_by`` (the flags that turned it off) and
    ``explicit_args`` (the dests given) and ``command_line`` (the tokens parsed, from which the
    end-of-run summary builds its resume command). A rejected flag raises one ``ValueError`` saying why.
    ``namespace``: the object to fill (as argparse's), a new ``Namespace`` by default.
    """
    given = _given(argv)
    given_flags = {BY_DEST[k].name for k in given}
    off_by = [f for f in (*DEMO_OFF_MODEL_FLAGS, *DATA_SOURCE_FLAGS) if f in given_flags]
    filled: dict[str, Any] = {}
    if not off_by:
        filled = {k: v for k, v in TINY_DEMO.items() if k not in given}
        if {"lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"} & set(given):
            filled.pop("lr_warmup_fraction", None)
        if "train_samples" in given:  # a sample-based demo: its length comes from --train-samples
            filled.pop("train_iters", None)
    values = {f.dest: list(f.default) if isinstance(f.default, list) else f.default for f in FLAGS}
    values.update(filled)
    values.update(given)
    no_data_source = not any(f in given_flags for f in DATA_SOURCE_FLAGS)
    if "tokenizer_type" not in given and {"vocab_file", "merge_file"} <= set(given):
        values["tokenizer_type"] = "GPT2BPETokenizer"  # as Megatron's scripts that give only the files
    elif no_data_source and "tokenizer_type" not in given:
        values["tokenizer_type"] = DEFAULT_TOKENIZER
    for dest, source in SAME_AS.items():
        if dest not in given:
            values[dest] = values[source]
    args = namespace if namespace is not None else argparse.Namespace()
    for key, value in values.items():
        setattr(args, key, value)
    args.using_default_model = not off_by
    args.using_default_data = no_data_source
    args.tiny_demo_filled = filled
    args.tiny_demo_off_by = off_by
    args.explicit_args = sorted(given)
    args.command_line = list(sys.argv[1:] if argv is None else argv)
    return args


def parse_args_or_usage_error(argv: list[str] | None) -> argparse.Namespace:
    """``parse_args``, with the errors the entry point prints once as one line.

    A command line that cannot be parsed, or names a flag Trident rejects, raises
    :class:`~training.errors.UsageError` (exit status 2). argparse's own message is captured rather
    than printed, and only rank 0 prints ``--help``. Checking the flags together is
    :func:`training.run.build_run`'s job.
    """
    rank0 = os.environ.get("RANK", "0") == "0"
    captured = io.StringIO()
    quiet_stdout = contextlib.nullcontext() if rank0 else contextlib.redirect_stdout(io.StringIO())
    try:
        with contextlib.redirect_stderr(captured), quiet_stdout:
            return parse_args(argv)
    except SystemExit as exit_:
        if exit_.code in (0, None):  # --help
            raise
        lines = captured.getvalue().strip().splitlines() or [f"invalid command line {argv}"]
        raise UsageError(lines[-1].split(": error: ", 1)[-1] + " (see --help)") from None
    except ValueError as err:  # a rejected flag, or a --config file that cannot be used
        raise UsageError(str(err)) from None


# --------------------------------------------------------------------------------------------------
# Typed configs from the namespace
# --------------------------------------------------------------------------------------------------


def config_kwargs(config_class: type, args: argparse.Namespace) -> dict[str, Any]:
    """Every init field of ``config_class`` whose name is an attribute of ``args`` (flags, and the
    values ``validate_args`` derives such as ``params_dtype``), by name."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(config_class)
        if f.init and hasattr(args, f.name)
    }


def config_from_args(config_class: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """``config_class`` (a core config dataclass) built from validated ``args``."""
    return config_class(**(config_kwargs(config_class, args) | overrides))


def transformer_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``TransformerConfig`` from validated args: its fields by name, plus the
    ones that Megatron flags set indirectly (``--swiglu``, ``--openai-gelu``, ``--group-query-attention``,
    ``--apply-layernorm-1p``).

    Sequence length and position count are ``GPTModel`` arguments, not config fields: pass
    ``args.max_position_embeddings`` as its ``max_sequence_length``.
    """
    if not hasattr(args, "data_parallel_size"):
        raise ValueError("call validate_args(args, world_size) first")
    config = config_kwargs(TransformerConfig, args)
    config["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    config["gated_linear_unit"] = args.swiglu
    config["activation_func"] = F.silu if args.swiglu else openai_gelu if args.openai_gelu else F.gelu
    config["layernorm_zero_centered_gamma"] = args.apply_layernorm_1p
    return config


# --------------------------------------------------------------------------------------------------
# What the run says about its flags at start
# --------------------------------------------------------------------------------------------------


def _spelled(dest: str, value: Any) -> str:
    """``--flag value`` as one would type it (a bool flag alone)."""
    flag = BY_DEST[dest]
    if flag.kind is bool:
        return flag.name if value == flag.stores(flag.name) else flag.negation or f"{flag.name}={value}"
    if isinstance(value, list):
        return " ".join([flag.name, *map(str, value)])
    return f"{flag.name} {value}"


def startup_report(args: argparse.Namespace) -> list[str]:
    """Lines the run prints once at start: what the tiny demo filled in, what ``--use-checkpoint-args``
    took from the checkpoint, the default data, and the flags accepted with no effect here."""
    lines = []
    if args.using_default_model:
        filled = " ".join(_spelled(k, v) for k, v in args.tiny_demo_filled.items())
        line = f"tiny demo (no model-size flag but --num-layers, no data source): filled in {filled}"
        kept = [_spelled(k, getattr(args, k)) for k in TINY_DEMO if k in args.explicit_args]
        lines.append(line + (f"; as given: {' '.join(kept)}" if kept else ""))
    taken = getattr(args, "checkpoint_args_taken", None)
    if taken:
        values = " ".join(_spelled(k, v) for k, v in taken["values"].items())
        lines.append(
            f"--use-checkpoint-args: the model flags not given come from {taken['path']}: {values} "
            "(the others equal their defaults); give a flag to override the checkpoint's value"
        )
    if args.using_default_data:
        tokenizer = (
            "Trident's own SentencePiece tokenizer"
            if args.tokenizer_type == DEFAULT_TOKENIZER and args.tokenizer_model is None
            else f"--tokenizer-type {args.tokenizer_type}"
        )
        lines.append(
            "no data source (--data-path, --mock-data): training on the built-in corpus (this Python's "
            f"standard-library docstrings and pydoc topics) with {tokenizer}"
        )
    lines += sharding_report(args)
    no_effect = []
    for flag in FLAGS:
        entry = coverage_of(flag.name)
        if entry.status != NO_EFFECT:
            continue  # read only the no-effect flags: test_every_accepted_flag_is_read counts reads
        value = getattr(args, flag.dest)
        if value != flag.default:
            no_effect.append(f"{_spelled(flag.dest, value)} ({entry.reason})")
    if no_effect:
        lines.append("accepted, no effect here: " + "; ".join(no_effect))
    return lines

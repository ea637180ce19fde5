"""The command line the benchmarks start from: the docstring as the help, the integer knobs as a table.

Every benchmark has its own sizes with its own defaults (``--layers 8`` for ``bench_dp``, 4 for
``bench_moe``, ...). What they share is the way of declaring them, kept here once, so that a
benchmark's parser reads as a table of flag -> default.
"""

from __future__ import annotations

import argparse

__all__ = ["add_int_flags", "benchmark_parser", "llama_flags"]


def benchmark_parser(doc: str | None, **int_defaults: int) -> argparse.ArgumentParser:
    """A parser whose ``--help`` prints ``doc`` as written (its command lines keep their line breaks),
    with the integer flags of :func:`add_int_flags` first."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_flags(parser, **int_defaults)
    return parser


def add_int_flags(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """For each ``name=default``, in the order given: ``--name`` (underscores as dashes) taking an int."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def llama_flags(ffn_hidden_size: int, num_query_groups: int) -> list[str]:
    """What makes ``pretrain_gpt.py``'s model a LLaMA: RMSNorm, SwiGLU, RoPE, no biases, an untied output
    layer and grouped-query attention."""
    return (
        "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
        f"--untie-embeddings-and-output-weights --ffn-hidden-size {ffn_hidden_size} "
        f"--group-query-attention --num-query-groups {num_query_groups}"
    ).split()

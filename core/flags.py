"""Command-line metadata on config fields, as plain data: core configs say how a field is spelled as a flag.

A field of a config dataclass becomes a command-line flag named after it (``num_layers`` ->
``--num-layers``), with its type, its default and its docstring as help; ``training/arguments/schema.py``
turns the configs into the parser. Most fields need nothing from this module. It is for the
exceptions, and core never imports argparse or anything from ``training/``:

    add_bias_linear: bool = flag(True, name="--disable-bias-linear", help="No biases ...")  # Megatron's
    hidden_size: int = flag(0, group="network size")                   # another --help group
    num_query_groups: int | None = flag(None, cli_default=1)           # Megatron's flag default
    deallocate_pipeline_outputs: bool = not_a_flag(True)               # set by code, never a flag
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

__all__ = [
    "FLAG_METADATA_KEY",
    "UNSET",
    "FlagSpec",
    "flag",
    "flag_default",
    "flag_spec",
    "not_a_flag",
    "option_name",
]

FLAG_METADATA_KEY = "trident_flag"
"""The key under which a field's :class:`FlagSpec` sits in ``dataclasses.Field.metadata``."""


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""``cli_default`` not given: the flag's default is the field's."""


@dataclass(frozen=True)
class FlagSpec:
    """How one config field appears on the command line (every part optional)."""

    is_flag: bool = True
    """False: the field is set by code (derived sizes, hooks, switches with no Megatron flag)."""
    name: str | None = None
    """The flag, when it is not ``--`` + the field name with dashes (Megatron's odd spellings).
    A bool field whose default is True is stored False by this flag (``--disable-bias-linear``)."""
    aliases: tuple[str, ...] = ()
    """Further spellings of the same flag (``--persistent-save-interval``)."""
    negation: str | None = None
    """A second flag that stores the opposite of a bool (``--no-check-for-nan-in-loss-and-grad``)."""
    group: str | None = None
    """The ``--help`` section, when not the one of the field's config class."""
    help: str | None = None
    """Help text, when the field's docstring does not suit the command line."""
    cli_default: Any = UNSET
    """The flag's default, when Megatron's differs from the dataclass default (e.g. None vs 1)."""


def flag(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    name: str | None = None,
    aliases: tuple[str, ...] = (),
    negation: str | None = None,
    group: str | None = None,
    help: str | None = None,
    cli_default: Any = UNSET,
) -> Any:
    """A dataclass field with command-line metadata (see :class:`FlagSpec`)."""
    spec = FlagSpec(
        name=name, aliases=aliases, negation=negation, group=group, help=help, cli_default=cli_default
    )
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={FLAG_METADATA_KEY: spec}
    )


def not_a_flag(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A dataclass field that no flag sets."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={FLAG_METADATA_KEY: FlagSpec(is_flag=False)},
    )


def flag_spec(field: dataclasses.Field) -> FlagSpec:
    """``field``'s command-line metadata (a plain field: every part its default)."""
    return field.metadata.get(FLAG_METADATA_KEY, FlagSpec())


def flag_default(field: dataclasses.Field) -> Any:
    """The value ``field``'s flag stores when not given: ``cli_default``, else the field's default (None
    for a field without one)."""
    spec = flag_spec(field)
    if spec.cli_default is not UNSET:
        return spec.cli_default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return None if field.default is MISSING else field.default


def option_name(field: dataclasses.Field) -> str:
    """The flag that sets ``field``: its ``name``, else ``--`` and the field's name with dashes, as
    ``--no-...`` for a field whose flag defaults to True (the flag stores False)."""
    spec = flag_spec(field)
    if spec.name is not None:
        return spec.name
    dashed = field.name.replace("_", "-")
    return f"--no-{dashed}" if flag_default(field) is True else f"--{dashed}"

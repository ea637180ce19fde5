"""A refused setting as data: the config fields it involves and one message naming them.

A rule is stated once, beside the config that owns its fields. The Python API reports it with the
field names (``num_moe_experts``), the command line with Megatron's flag names (``--num-experts``),
both from the same :class:`Problem`: so the two refuse exactly the same configurations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "ProblemsError", "problem"]


@dataclass(frozen=True)
class Problem:
    """One invalid combination of settings.

    ``message`` names each field as a ``{field}`` placeholder, which :meth:`render` fills with a name
    (the field's own, or its flag); ``values`` fill the other placeholders (numbers, settings).
    """

    fields: tuple[str, ...]
    message: str
    values: Mapping[str, Any] = field(default_factory=dict)
    command_line: str | None = None
    """The command line's own wording, where its long-standing message differs from the API's (the
    same placeholders); None where one message serves both."""

    def render(self, name: Callable[[str], str] = str, *, command_line: bool = False) -> str:
        """The message with each field called ``name(field)``; ``command_line`` picks the CLI's wording."""
        template = self.command_line if command_line and self.command_line is not None else self.message
        return template.format_map({**self.values, **{f: name(f) for f in self.fields}})

    def __str__(self) -> str:
        return self.render()


def problem(message: str, *fields: str, command_line: str | None = None, **values: Any) -> Problem:
    """A :class:`Problem` about ``fields``: ``problem("{a} ({n}) must be > 0", "a", n=0)``."""
    return Problem(fields, message, values, command_line)


class ProblemsError(ValueError):
    """A config refused at construction: ``str()`` is the one line, ``problems`` the structured ones."""

    def __init__(self, what: str, problems: list[Problem]) -> None:
        super().__init__(f"invalid {what}: " + "; ".join(map(str, problems)))
        self.problems = problems

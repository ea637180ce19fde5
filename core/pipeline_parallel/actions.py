"""The vocabulary of schedule tables: action kinds, ``Action`` and its text form, and the grid.

An action is written as PyTorch writes it: chunk, kind, microbatch. ``1F3`` is chunk 1's forward
of microbatch 3; ``0SEND_B2`` posts the send of chunk 0's input gradient for microbatch 2. Tests
and error messages use the same form in both directions::

    parse_tables('''
        0F0 0F1 0B0 0B1
        0F0 0B0 0F1 0B1
    ''')                                   # one line per pipeline rank
    format_tables(tables, marks={1: 2})    # the rank x step grid, rank 1's step 2 marked [..]

A table that fails a check (a receive after its consumer, receives out of the senders' order, a
deadlock) raises :class:`TableError`, whose message ends with that grid and the bad steps marked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple


class ActionKind(str, Enum):
    """What an action does. Compute: forward, fused backward, input-gradient, weight-gradient.
    Communication (added by lowering): post a send or a receive of an activation (``_F``) or of a
    gradient (``_B``)."""

    F = "F"
    B = "B"
    I = "I"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


# The members as module constants: attribute lookups on an Enum class are slow, and the simulator
# and the lowering ask about kinds millions of times in the deadlock sweep.
F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
COMPUTE = frozenset((F, B, I, W))
SENDS = frozenset((SEND_F, SEND_B))
RECEIVES = frozenset((RECV_F, RECV_B))


class Action(NamedTuple):
    """One step of a rank's table: ``kind`` on ``microbatch`` with this rank's model chunk ``chunk``."""

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.value}{self.microbatch}"


_TEXT = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


def parse_action(text: str) -> Action:
    """The action written ``text`` (``2F0``, ``1SEND_F3``)."""
    match = _TEXT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not an action: write chunk, kind, microbatch, e.g. 2F0 or 1SEND_F3")
    chunk, kind, microbatch = match.groups()
    return Action(ActionKind(kind), int(microbatch), int(chunk))


def parse_tables(text: str) -> list[list[Action]]:
    """Tables written one pipeline rank per line, actions separated by spaces (blank lines skipped).

    A grid :func:`format_tables` printed reads back too: its ``step:`` row is skipped, a row's
    ``rank N:`` label dropped and a marked ``[1F3]`` read as ``1F3``.
    """
    tables = []
    for line in text.strip().splitlines():
        label, colon, rest = line.partition(":")
        if not line.strip() or label.strip() == "step":
            continue
        tables.append([parse_action(word.strip("[]")) for word in (rest if colon else line).split()])
    return tables


def format_tables(tables: list[list[Action]], marks: Mapping[int, int] | None = None) -> str:
    """A rank x step grid, one row per rank under a row of step numbers; ``marks`` (rank -> step)
    puts those cells in brackets."""
    marks = marks or {}
    width = max((len(str(a)) for t in tables for a in t), default=3) + 2
    steps = max((len(t) for t in tables), default=0)
    label = len(f"rank {len(tables) - 1}:")

    def cell(rank: int, step: int, action: Action) -> str:
        return (f"[{action}]" if marks.get(rank) == step else f" {action} ").rjust(width)

    header = "step:".ljust(label) + "".join(f"{s} ".rjust(width) for s in range(steps))
    rows = [
        f"rank {r}:".ljust(label) + "".join(cell(r, s, a) for s, a in enumerate(t))
        for r, t in enumerate(tables)
    ]
    return "\n".join(line.rstrip() for line in [header, *rows])


class TableError(ValueError):
    """A table that breaks a rule; the message ends with the grid, the offending steps marked."""

    def __init__(self, message: str, tables: list[list[Action]], marks: Mapping[int, int]) -> None:
        super().__init__(f"{message}\n{format_tables(tables, marks)}")
        self.problem, self.marks = message, dict(marks)


class ScheduleDeadlock(RuntimeError):
    """The tables (or the posts of a run) wait on each other in a cycle; with ``tables``, the message
    ends with their grid, where each rank waits (``marks``: rank -> step) in brackets."""

    def __init__(
        self, message: str, tables: list[list[Action]] | None = None, marks: Mapping[int, int] | None = None
    ) -> None:
        super().__init__(message if tables is None else f"{message}\n{format_tables(tables, marks)}")

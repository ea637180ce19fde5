"""Pipeline layout strings (Megatron's ``--pipeline-model-parallel-layout``) -> layers per stage.

A layout string says which layers each pipeline stage builds: ``E`` the embedding, ``t`` a decoder
(transformer) layer, ``m`` an MTP layer, ``L`` the final norm, output head and loss. ``|`` ends a
stage, ``x*N`` repeats one character (``|`` included), ``(...)*N`` repeats a group (no nesting, the
count is required, ``N`` may be 0), and commas are purely cosmetic. Stage ``s`` runs on
``pp_rank = s % pp_size`` as virtual chunk ``vpp_rank = s // pp_size`` (Megatron's loop); under the
ZBV schedule's V placement (``placement="v"``, two chunks per rank) stage ``s >= pp_size`` runs on
rank ``2 pp_size - 1 - s`` instead (see :mod:`core.pipeline_parallel.placement`). Either way the
string lists stages in the order data flows through them, and decoder layers are numbered
globally in that order. Megatron's example ``"Et*3|(tt|)*29,m|L"`` on 16 ranks is 32 stages: the
embedding and 3 layers on stage 0, two layers on each of stages 1-29, the MTP layer on stage 30
and the loss on stage 31.

Parity with Megatron-LM (``megatron/core/transformer/pipeline_parallel_layer_layout.py``,
``parse_str_to_list`` and ``validate_layer_layout``, plus the VPP check in ``TransformerConfig``):
every string written in the grammar above gives exactly Megatron's stages, and every string
Megatron rejects is rejected here, as a ``ValueError`` naming the problem and its position in the
original string (Megatron only asserts). Deliberate differences:

* Megatron expands repeats with two regular expressions after dropping commas, so it also accepts
  a few strings outside the grammar: ``x*0`` deleting any stray character (``"Ex*0|L"``,
  ``"E(*0|L"``), a second repeat after a group's (``"(tt)*2*3"`` repeats only the last ``t``),
  and groups that expand into repeat syntax (``"t*(3)*1"``). Those are typos whose meaning is an
  accident of the regexes; they are rejected here with the position of the culprit.
* ``num_layers=None`` / ``mtp_num_layers=None`` mean "do not check the count". Megatron always has
  ``num_layers`` and reads ``mtp_num_layers=None`` as zero; pass ``mtp_num_layers=0`` for that.

The MTP rules are Megatron's as its code enforces them: no ``t`` after the first ``m``, every
``m`` in the last virtual stage of its rank, and all ``m`` in one stage. (Megatron's message says
"not on the first pp rank", but its check only covers rank 0's non-last virtual stages, so ``m`` on
rank 0's last virtual stage is accepted there, and therefore here.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from core.pipeline_parallel.placement import V_CHUNKS, Placement

__all__ = ["PipelineLayout", "even_layout", "parse_layout", "parse_stages"]

EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
_LAYER_SYMBOLS = frozenset((EMBEDDING, DECODER, MTP, LOSS))
_ATOMS = _LAYER_SYMBOLS | {"|"}  # what a single-character repeat may apply to
_NAMES = {EMBEDDING: "embedding", DECODER: "decoder layer", MTP: "MTP layer", LOSS: "loss"}

_Symbol = tuple[str, int | None]  # a layer symbol and where it came from in the string (if known)


# --------------------------------------------------------------------------------------------------
# Syntax: string -> stages of (symbol, source position)
# --------------------------------------------------------------------------------------------------


class _Parser:
    """Recursive-descent reader of the layout grammar that remembers each symbol's source position.

    Commas are dropped before anything else, as Megatron does, so ``t*1,0`` still means ten layers;
    positions stay those of the original string so that errors point at what the user typed.
    """

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"pipeline layout must be a str, got {type(text).__name__}")
        self.text = text
        self.tokens = [(c, i) for i, c in enumerate(text) if c != ","]
        self.i = 0

    def fail(self, message: str) -> NoReturn:
        raise ValueError(f"pipeline layout '{self.text}': {message}")

    def peek(self, ahead: int = 0) -> tuple[str, int] | None:
        j = self.i + ahead
        return self.tokens[j] if j < len(self.tokens) else None

    def parse(self) -> list[list[_Symbol]]:
        flat: list[_Symbol] = []
        while (tok := self.peek()) is not None:
            char, pos = tok
            if char in _ATOMS:
                flat += self.atom()
            elif char == "(":
                flat += self.group()
            elif char == ")":
                self.fail(f"unbalanced ')' at position {pos}")
            else:
                self.stray(char, pos)
        stages: list[list[_Symbol]] = [[]]
        for sym in flat:
            if sym[0] == "|":
                stages.append([])
            else:
                stages[-1].append(sym)
        return stages

    def atom(self) -> list[_Symbol]:
        """One symbol or '|', with an optional ``*N``."""
        sym = self.tokens[self.i]
        self.i += 1
        nxt = self.peek()
        return [sym] * (self.repeat() if nxt is not None and nxt[0] == "*" else 1)

    def group(self) -> list[_Symbol]:
        """``( item+ )*N``: Megatron only expands parentheses that carry a count."""
        _, open_pos = self.tokens[self.i]
        self.i += 1
        body: list[_Symbol] = []
        empty = True
        while (tok := self.peek()) is not None and tok[0] != ")":
            char, pos = tok
            empty = False
            if char in _ATOMS:
                body += self.atom()
            elif char == "(":
                self.fail(f"nested '(' at position {pos} (groups cannot be nested)")
            else:
                self.stray(char, pos)
        if tok is None:
            self.fail(f"unbalanced '(' at position {open_pos}")
        if empty:
            self.fail(f"empty group '()' at position {open_pos}")
        self.i += 1
        nxt = self.peek()
        if nxt is None or nxt[0] != "*":
            self.fail(f"group opened at position {open_pos} needs a repeat count '*N' after its ')'")
        return body * self.repeat()

    def repeat(self) -> int:
        """Read the ``*N`` the parser stands on; the count may be 0 but not negative or chained."""
        star = self.tokens[self.i][1]
        self.i += 1
        digits = ""
        while (tok := self.peek()) is not None and tok[0].isdecimal():  # what regex \d accepts
            digits += tok[0]
            self.i += 1
        if not digits:
            nxt = self.peek(1)
            if tok is not None and tok[0] == "-" and nxt is not None and nxt[0].isdecimal():
                self.fail(f"negative repeat count at position {tok[1]} (counts are whole numbers >= 0)")
            self.fail(f"'*' at position {star} is not followed by a repeat count")
        if tok is not None and tok[0] == "*":
            self.fail(f"second '*' at position {tok[1]}: a repeat count cannot be repeated")
        return int(digits)

    def stray(self, char: str, pos: int) -> NoReturn:
        """A character that cannot start an item here."""
        if char == "*":
            prev = self.tokens[self.i - 1][0] if self.i else None
            after = " (it follows '(')" if prev == "(" else ""
            self.fail(f"'*' at position {pos} has nothing to repeat{after}")
        if char.isdecimal():
            self.fail(f"number at position {pos} is not preceded by '*'")
        self.fail(
            f"unknown symbol {char!r} at position {pos} "
            "(expected E, t, m, L, '|', '(', ')', '*', digits or ',')"
        )


def parse_stages(layout: str) -> tuple[tuple[str, ...], ...]:
    """The stages a layout string describes, syntax only (Megatron's ``parse_str_to_list``).

    Useful before the pipeline size is known, e.g. to count stages; ``parse_layout`` also checks
    the layout against the sizes and Megatron's placement rules.
    """
    return tuple(tuple(sym for sym, _ in stage) for stage in _Parser(layout).parse())


# --------------------------------------------------------------------------------------------------
# Semantics: Megatron's validate_layer_layout
# --------------------------------------------------------------------------------------------------


def _check_rules(
    stages: list[list[_Symbol]],
    pp_size: int,
    num_layers: int | None,
    mtp_num_layers: int | None,
    fail: Callable[[str], NoReturn],
) -> None:
    """Megatron's checks on what the stages hold, in its order; ``fail`` adds the layout's name."""
    vpp_size = len(stages) // pp_size
    flat = [(sym, pos, s) for s, stage in enumerate(stages) for sym, pos in stage]

    def at(pos: int | None, stage: int) -> str:
        return f"at position {pos}" if pos is not None else f"in stage {stage}"

    def count(symbol: str) -> list[tuple[str, int | None, int]]:
        return [entry for entry in flat if entry[0] == symbol]

    if not flat:
        fail("the layout holds no layers; it must start with 'E' and end with 'L'")
    sym, pos, s = flat[0]
    if sym != EMBEDDING:
        fail(f"the first layer must be 'E' (embedding), got '{sym}' ({_NAMES[sym]}) {at(pos, s)}")
    sym, pos, s = flat[-1]
    if sym != LOSS:
        fail(f"the last layer must be 'L' (loss), got '{sym}' ({_NAMES[sym]}) {at(pos, s)}")
    for symbol in (EMBEDDING, LOSS):
        found = count(symbol)
        if len(found) != 1:
            where = ", ".join(dict.fromkeys(at(p, st) for _, p, st in found))
            fail(f"'{symbol}' ({_NAMES[symbol]}) must appear exactly once, found {len(found)} ({where})")
    num_decoder = len(count(DECODER))
    if num_layers is not None and num_decoder != num_layers:
        fail(f"the layout has {num_decoder} decoder layers ('t') but num_layers is {num_layers}")
    mtps = count(MTP)
    if mtp_num_layers is not None and len(mtps) != mtp_num_layers:
        fail(f"the layout has {len(mtps)} MTP layers ('m') but mtp_num_layers is {mtp_num_layers}")
    if not mtps:
        return
    first_mtp = next(i for i, entry in enumerate(flat) if entry[0] == MTP)
    late = next((entry for entry in flat[first_mtp:] if entry[0] == DECODER), None)
    if late is not None:
        fail(
            f"decoder layer 't' {at(late[1], late[2])} comes after the MTP layer "
            f"{at(mtps[0][1], mtps[0][2])}; all decoder layers must precede the MTP layers"
        )
    for _, pos, s in mtps:
        if s // pp_size != vpp_size - 1:
            fail(
                f"MTP layer 'm' {at(pos, s)} is in stage {s} (pp_rank {s % pp_size}, vpp_rank "
                f"{s // pp_size}); MTP layers must be in the last virtual stage of their rank "
                f"(vpp_rank {vpp_size - 1})"
            )
    mtp_stages = sorted({s for _, _, s in mtps})
    if len(mtp_stages) > 1:
        fail(f"the MTP layers are split over stages {mtp_stages}; they must all be in one stage")


# --------------------------------------------------------------------------------------------------
# The layout object
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineLayout:
    """Which layers each (pp_rank, vpp_rank) stage builds; the model builder's single source of truth.

    Build it with ``parse_layout`` (from a string) or ``even_layout`` (the default split). Direct
    construction checks structure and Megatron's placement rules, but cannot report positions.
    """

    stages: tuple[tuple[str, ...], ...]
    """Layer symbols per stage, in stage order (stage ``s`` = ``vpp_rank * pp_size + pp_rank``)."""

    pp_size: int
    """Pipeline-model-parallel size: the number of ranks the stages are dealt to."""

    placement: str = "loop"
    """How stages are dealt to ranks: "loop" (Megatron, stage s on rank s % pp) or "v" (ZBV)."""

    def __post_init__(self) -> None:
        stages = tuple(tuple(stage) for stage in self.stages)
        object.__setattr__(self, "stages", stages)
        _check_size("pipeline-model-parallel size", self.pp_size)
        bad = sorted({sym for stage in stages for sym in stage} - _LAYER_SYMBOLS)
        if bad:
            raise ValueError(f"pipeline layout symbols must be E, t, m or L, got {bad}")
        if not stages or len(stages) % self.pp_size:
            raise ValueError(
                f"{len(stages)} pipeline stages are not a positive multiple of "
                f"pipeline-model-parallel size {self.pp_size}"
            )
        Placement(self.pp_size, len(stages) // self.pp_size, self.placement)  # checks the placement

        def fail(message: str) -> NoReturn:
            raise ValueError(f"pipeline layout '{self.to_string()}': {message}")

        _check_rules([[(sym, None) for sym in stage] for stage in stages], self.pp_size, None, None, fail)

    @property
    def vpp_size(self) -> int:
        """Virtual stages (model chunks) per pipeline rank; 1 without interleaving."""
        return len(self.stages) // self.pp_size

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_placement(self) -> Placement:
        """Stage <-> (pp_rank, vpp_rank) of this layout."""
        return Placement(self.pp_size, self.vpp_size, self.placement)

    @property
    def num_decoder_layers(self) -> int:
        return sum(stage.count(DECODER) for stage in self.stages)

    @property
    def num_mtp_layers(self) -> int:
        return sum(stage.count(MTP) for stage in self.stages)

    def stage_index(self, pp_rank: int, vpp_rank: int | None = None) -> int:
        """Stage number of a chunk; ``vpp_rank=None`` (Megatron's ``vp_stage``) only without VPP."""
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(
                f"pp_rank {pp_rank} is out of range for pipeline-model-parallel size {self.pp_size}"
            )
        if vpp_rank is None:
            if self.vpp_size != 1:
                raise ValueError(
                    f"vpp_rank is required: the layout has {self.vpp_size} virtual stages per rank"
                )
            vpp_rank = 0
        if not 0 <= vpp_rank < self.vpp_size:
            raise ValueError(f"vpp_rank {vpp_rank} is out of range for virtual pipeline size {self.vpp_size}")
        return self.stage_placement.stage(pp_rank, vpp_rank)

    def stage_layers(self, pp_rank: int, vpp_rank: int | None = None) -> list[str]:
        """The symbols of that stage, in order."""
        return list(self.stages[self.stage_index(pp_rank, vpp_rank)])

    def _global_indices(self, symbol: str, pp_rank: int, vpp_rank: int | None) -> list[int]:
        stage = self.stage_index(pp_rank, vpp_rank)
        offset = sum(s.count(symbol) for s in self.stages[:stage])
        return list(range(offset, offset + self.stages[stage].count(symbol)))

    def decoder_layers(self, pp_rank: int, vpp_rank: int | None = None) -> list[int]:
        """Global 0-based indices of the stage's decoder layers (numbered in stage order).

        These are the numbers checkpoints use, so a checkpoint does not depend on the split.
        """
        return self._global_indices(DECODER, pp_rank, vpp_rank)

    def mtp_layers(self, pp_rank: int, vpp_rank: int | None = None) -> list[int]:
        """Global 0-based indices of the stage's MTP layers."""
        return self._global_indices(MTP, pp_rank, vpp_rank)

    def has_embedding(self, pp_rank: int, vpp_rank: int | None = None) -> bool:
        """True for the one stage that owns the embedding (Megatron's ``pre_process``)."""
        return EMBEDDING in self.stages[self.stage_index(pp_rank, vpp_rank)]

    def has_loss(self, pp_rank: int, vpp_rank: int | None = None) -> bool:
        """True for the one stage that owns final norm, output head and loss (``post_process``)."""
        return LOSS in self.stages[self.stage_index(pp_rank, vpp_rank)]

    def has_mtp(self, pp_rank: int, vpp_rank: int | None = None) -> bool:
        return MTP in self.stages[self.stage_index(pp_rank, vpp_rank)]

    @staticmethod
    def _compact(stage: tuple[str, ...]) -> str:
        """A stage in layout syntax with runs folded, e.g. ``E,t*3``; '' for an empty stage."""
        runs: list[list] = []
        for sym in stage:
            if runs and runs[-1][0] == sym:
                runs[-1][1] += 1
            else:
                runs.append([sym, 1])
        return ",".join(sym if n == 1 else f"{sym}*{n}" for sym, n in runs)

    def to_string(self) -> str:
        """A layout string that ``parse_layout`` turns back into this layout (to pin a default split)."""
        return "|".join(self._compact(stage) for stage in self.stages)

    def table(self) -> str:
        """A pp_rank x vpp_rank grid of what each stage holds; equal neighbouring ranks share a row."""
        rows: list[tuple[int, int, list[str]]] = []  # first rank, last rank, cells
        for pp in range(self.pp_size):
            cells = [
                self._compact(self.stages[self.stage_index(pp, v)]) or "(empty)" for v in range(self.vpp_size)
            ]
            if rows and rows[-1][2] == cells:
                rows[-1] = (rows[-1][0], pp, cells)
            else:
                rows.append((pp, pp, cells))
        grid = [[""] + [f"vpp_rank {v}" for v in range(self.vpp_size)]]
        for first, last, cells in rows:
            grid.append([f"pp_rank {first}" if first == last else f"pp_rank {first}-{last}"] + cells)
        widths = [max(len(row[c]) for row in grid) for c in range(len(grid[0]))]
        lines = [
            "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in grid
        ]
        head = (
            f"PipelineLayout: pp_size={self.pp_size}, vpp_size={self.vpp_size}, "
            + ("V placement, " if self.placement == "v" else "")
            + f"{self.num_stages} stages, {self.num_decoder_layers} decoder layers"
        )
        return "\n".join([head] + lines)

    def __str__(self) -> str:
        return self.table()


# --------------------------------------------------------------------------------------------------
# Constructors
# --------------------------------------------------------------------------------------------------


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def parse_layout(
    layout: str,
    pp_size: int,
    vpp_size: int | None = None,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    placement: str = "loop",
) -> PipelineLayout:
    """Parse and validate a ``--pipeline-model-parallel-layout`` string as Megatron does.

    ``vpp_size=None`` infers the virtual size from the number of stages; a given one must agree,
    since the layout already fixes it. ``num_layers`` / ``mtp_num_layers`` are checked when given.
    ``placement="v"`` deals the stages to ranks in a V (ZBV), which needs 2 stages per rank.
    """
    _check_size("pipeline-model-parallel size", pp_size)
    if vpp_size is not None:
        _check_size("virtual pipeline size", vpp_size)
    parser = _Parser(layout)
    stages = parser.parse()
    if len(stages) % pp_size:
        parser.fail(
            f"{len(stages)} stages are not a multiple of pipeline-model-parallel size {pp_size} "
            f"(stage s runs on pp_rank s % {pp_size})"
        )
    detected = len(stages) // pp_size
    if vpp_size is not None and vpp_size != detected:
        parser.fail(
            f"{len(stages)} stages on pipeline-model-parallel size {pp_size} make {detected} virtual "
            f"stages per rank, but virtual pipeline size {vpp_size} was given"
        )
    if placement == "v" and detected != V_CHUNKS:
        parser.fail(
            f"the V placement (ZBV) needs {V_CHUNKS} stages per pipeline rank, i.e. {V_CHUNKS * pp_size} "
            f"stages, got {len(stages)}"
        )
    _check_rules(stages, pp_size, num_layers, mtp_num_layers, parser.fail)
    return PipelineLayout(tuple(tuple(sym for sym, _ in stage) for stage in stages), pp_size, placement)


def even_layout(
    num_layers: int, pp_size: int, vpp_size: int | None = None, placement: str = "loop"
) -> PipelineLayout:
    """The split used when no layout string is given.

    The embedding goes on the first stage (pp_rank 0, vpp_rank 0) and the loss on the last
    (pp_rank pp_size-1, vpp_rank vpp_size-1). The ``num_layers`` decoder layers are dealt to the
    ``pp_size * vpp_size`` stages in stage order, ``num_layers // stages`` each, and the remainder
    one apiece to the earliest stages: 7 layers on 4 stages give 2, 2, 2, 1. No layer is dropped;
    with fewer layers than stages the last stages are empty, which is legal. Under the V placement
    (``placement="v"``) the first and last stage are both on pp_rank 0.
    """
    _check_size("pipeline-model-parallel size", pp_size)
    vpp = 1 if vpp_size is None else vpp_size
    _check_size("virtual pipeline size", vpp)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
    num_stages = pp_size * vpp
    base, extra = divmod(num_layers, num_stages)
    stages = [[DECODER] * (base + (s < extra)) for s in range(num_stages)]
    stages[0].insert(0, EMBEDDING)
    stages[-1].append(LOSS)
    return PipelineLayout(tuple(tuple(stage) for stage in stages), pp_size, placement)

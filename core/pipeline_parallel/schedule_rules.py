"""One record per pipeline schedule: the only place that names a schedule or states its rules.

Each :class:`ScheduleRule` says what the rest of Trident asks about a schedule: its name (the
``--pipeline-schedule`` value, or a table name only tests and tools use), where its stages sit
(Megatron's loop or ZBV's V), how many model chunks a rank runs, whether its backward is split
into input and weight gradients (zero bubble), its textbook bubble and the function of
:mod:`~core.pipeline_parallel.schedule_tables` that builds its compute table. The config, the
argument checks, compile, the tables, the planner and the timeline all ask here, so adding a
schedule means adding a record (and its table builder).

The builder is named, not imported: the tables module asks this one for the rules, and this module
stays a leaf that imports only the placement geometry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.pipeline_parallel.placement import LOOP, V_CHUNKS, Placement, V

__all__ = [
    "CLI_SCHEDULES",
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "PipelineSchedule",
    "ScheduleRule",
    "placement_for",
    "rule_for_label",
    "schedule_rule",
]


@dataclass(frozen=True)
class ScheduleRule:
    """What one pipeline schedule is, as data."""

    name: str
    """The schedule's name: ``--pipeline-schedule``'s value, or (``on_command_line=False``) a name
    only the tables, tests and tools use."""
    builder: str
    """The function of ``schedule_tables`` that builds one rank's compute table. One that runs
    virtual chunks (``interleaves``) takes ``(pp, vpp, microbatches, rank, group size, forward_only)``,
    any other ``(pp, microbatches, rank, forward_only)``."""
    placement: str = LOOP
    """Where stage ``s`` runs: Megatron's loop (rank ``s % pp``) or the V (ZBV)."""
    chunks: int | None = None
    """Model chunks per pipeline rank the schedule runs, or None: as many as there are virtual stages."""
    interleaves: bool = False
    """Runs its chunks in Megatron's interleaved order: microbatches in groups of N per chunk, whose
    counts ``schedule_tables.check_interleaving`` rules on."""
    interleaved_form: str | None = None
    """The schedule this one runs as with more than one chunk per rank (1F1B becomes interleaved 1F1B)."""
    interleaved_label: str | None = None
    """How reports and timelines name the schedule when it runs more than one chunk per rank."""
    split_backward: bool = False
    """Splits each backward into ``I`` (input gradient) and ``W`` (weight gradient): zero bubble."""
    bubble_stages: float = 1.0
    """Each rank's textbook idle time over ``pp - 1`` stages' forward and backward, with F = I = W
    (Qi et al. 2024): 1 for 1F1B and GPipe; a stage is a chunk, so interleaving divides a rank's
    bubble by its chunks; ZB-H1 and ZBV leave a third (the W's fill the rest)."""
    holds_every_microbatch: bool = False
    """Keeps every microbatch's activations until its backward (GPipe), so its peak grows with the
    microbatch count instead of settling into a steady state."""
    on_command_line: bool = True
    """A ``--pipeline-schedule`` choice (``interleaved`` is ``1f1b`` with virtual stages there)."""

    def chunks_problem(self, vpp_size: int) -> str | None:
        """Why this schedule cannot run ``vpp_size`` model chunks per pipeline rank, or None if it can.

        The config, the tables and the argument checks all ask here and phrase the answer with
        their own names.
        """
        if self.chunks is None or vpp_size == self.chunks:
            return None
        if self.chunks == 1:
            return (
                f"cannot run virtual pipeline stages ({vpp_size} per rank); the {_INTERLEAVING_NAME} "
                "schedule interleaves them"
            )
        shape = " (a V)" if self.placement == V else ""
        return f"runs exactly {self.chunks} model chunks per pipeline rank{shape}, got {vpp_size}"

    def running(self, vpp_size: int) -> ScheduleRule:
        """The record of the schedule that runs at ``vpp_size`` chunks per rank (raises if none can)."""
        problem = self.chunks_problem(vpp_size)
        if problem:
            raise ValueError(f"the {self.name} schedule {problem}")
        if vpp_size > 1 and self.interleaved_form is not None:
            return schedule_rule(self.interleaved_form)
        return self

    def groups_microbatches(self, vpp_size: int) -> bool:
        """Whether at ``vpp_size`` chunks per rank the microbatch count must suit the interleaved
        order's groups (``schedule_tables.check_interleaving``)."""
        return vpp_size > 1 and (self.interleaves or self.interleaved_form is not None)

    def label(self, vpp_size: int) -> str:
        """The schedule as reports and timelines name it at ``vpp_size`` chunks per rank."""
        return self.interleaved_label if vpp_size > 1 and self.interleaved_label else self.name

    def textbook_bubble(self, pp_size: int, vpp_size: int, num_microbatches: int) -> float:
        """The textbook idle share of all ranks' time, ``(p - 1) s / (v m + (p - 1) s)`` with ``s``
        :attr:`bubble_stages` (``(p - 1) / (v m + p - 1)`` for interleaved 1F1B)."""
        idle = (pp_size - 1) * self.bubble_stages
        return idle / (vpp_size * num_microbatches + idle)

    def placement_for(self, pp_size: int, vpp_size: int = 1) -> Placement:
        """Stage <-> (rank, chunk) for this schedule."""
        return Placement(pp_size, vpp_size, self.placement)


_RULES = (
    ScheduleRule(
        name="1f1b",
        builder="one_f_one_b_table",
        interleaved_form="interleaved",
        interleaved_label="interleaved-1f1b",
    ),
    ScheduleRule(name="gpipe", builder="gpipe_table", chunks=1, holds_every_microbatch=True),
    ScheduleRule(
        name="zb-h1",
        builder="zero_bubble_table",
        interleaves=True,
        interleaved_label="interleaved-zb",
        split_backward=True,
        bubble_stages=1 / 3,
    ),
    ScheduleRule(
        name="zbv",
        builder="zbv_table",
        placement=V,
        chunks=V_CHUNKS,
        split_backward=True,
        bubble_stages=1 / 3,
    ),
    ScheduleRule(name="interleaved", builder="interleaved_table", interleaves=True, on_command_line=False),
)
_BY_NAME = {rule.name: rule for rule in _RULES}
_INTERLEAVING_NAME = next(rule.name for rule in _RULES if rule.interleaved_form is not None)

DEFAULT_SCHEDULE = "1f1b"
"""Megatron's schedule, and ``--pipeline-schedule``'s default."""
SCHEDULES = tuple(rule.name for rule in _RULES)
"""Every schedule the tables build."""
CLI_SCHEDULES = tuple(rule.name for rule in _RULES if rule.on_command_line)
"""``--pipeline-schedule``'s choices (``ModelParallelConfig.pipeline_schedule``'s values)."""
PipelineSchedule = Literal[CLI_SCHEDULES]  # type: ignore[valid-type]  # the choices, from the records


def schedule_rule(name: str) -> ScheduleRule:
    """The record of schedule ``name``."""
    rule = _BY_NAME.get(name)
    if rule is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {SCHEDULES}")
    return rule


def placement_for(schedule: str, pp_size: int, vpp_size: int = 1) -> Placement:
    """The placement a schedule needs: the V for ZBV, Megatron's loop for every other schedule."""
    return schedule_rule(schedule).placement_for(pp_size, vpp_size)


def rule_for_label(label: str) -> ScheduleRule:
    """The command-line schedule a report or timeline label names (``interleaved-zb`` -> zb-h1)."""
    # Timelines written before reports and timelines shared their labels say "interleaved 1f1b".
    wanted = label.replace(" ", "-")
    for rule in _RULES:
        if rule.on_command_line and wanted in (rule.name, rule.interleaved_label):
            return rule
    raise ValueError(f"no pipeline schedule is labelled {label!r}")

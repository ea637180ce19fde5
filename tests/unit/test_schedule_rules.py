"""The schedule records: each one's builder, bubble and placement agree with the tables, and no other
module of the engine, the model, training or the planner names a schedule."""

import ast
import re
from pathlib import Path

import pytest

from core.model_parallel_config import ModelParallelConfig
from core.pipeline_parallel import schedule_tables
from core.pipeline_parallel.actions import B, I, W
from core.pipeline_parallel.placement import PLACEMENTS, V_CHUNKS, V
from core.pipeline_parallel.schedule_rules import (
    CLI_SCHEDULES,
    DEFAULT_SCHEDULE,
    SCHEDULES,
    rule_for_label,
    schedule_rule,
)
from core.pipeline_parallel.simulator import simulate
from tools.bench.schedules import SCHEDULES as BENCH_CELLS
from tools.bench.schedules import config_schedule, runs
from training.arguments.parser import build_parser
from training.arguments.schema import BY_DEST

ROOT = Path(__file__).resolve().parents[2]
RULES = [schedule_rule(name) for name in SCHEDULES]


def _chunk_counts(rule) -> tuple[int, ...]:
    """The chunks per rank a schedule runs: its fixed count, else one and two (interleaved)."""
    return (rule.chunks,) if rule.chunks is not None else (1, 2)


@pytest.mark.parametrize("rule", RULES, ids=SCHEDULES)
def test_every_record_names_a_builder_of_the_tables(rule):
    assert callable(getattr(schedule_tables, rule.builder, None)), rule.builder
    assert rule.placement in PLACEMENTS
    assert (rule.placement == V) == (rule.chunks == V_CHUNKS)


@pytest.mark.parametrize("rule", RULES, ids=SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("rounds", [2, 4])
def test_simulated_bubble_is_the_records_textbook_bubble(rule, pp, rounds):
    """F = I = W (a fused backward costs two forwards), each chunk its share of the rank's work."""
    m = rounds * pp
    for vpp in _chunk_counts(rule):
        tables = schedule_tables.build_tables(rule.name, pp, vpp, m)
        result = simulate(tables, rule.placement_for(pp, vpp), forward_cost=1 / vpp, backward_cost=2 / vpp)
        assert result.bubble_fraction == pytest.approx(rule.textbook_bubble(pp, vpp, m), abs=1e-12), vpp


@pytest.mark.parametrize("rule", RULES, ids=SCHEDULES)
def test_a_split_backward_is_in_the_table_exactly_when_the_record_says(rule):
    kinds = {
        a.kind for vpp in _chunk_counts(rule) for a in schedule_tables.build_table(rule.name, 2, vpp, 4, 0)
    }
    assert (
        (kinds >= {I, W} and B not in kinds) if rule.split_backward else (B in kinds and not kinds & {I, W})
    )


def test_a_schedule_refuses_the_chunks_its_record_refuses():
    for rule in RULES:
        for vpp in (1, 2, 3):
            problem = rule.chunks_problem(vpp)
            if problem is None:
                schedule_tables.build_table(rule.name, 2, vpp, 4, 0)
            else:
                with pytest.raises(ValueError, match=f"^{re.escape(f'the {rule.name} schedule {problem}')}$"):
                    schedule_tables.build_table(rule.name, 2, vpp, 4, 0)


def test_the_command_line_offers_exactly_the_records_on_it():
    action = next(a for a in build_parser()._actions if "--pipeline-schedule" in a.option_strings)
    assert tuple(action.choices) == CLI_SCHEDULES
    assert BY_DEST["pipeline_schedule"].default == DEFAULT_SCHEDULE == ModelParallelConfig().pipeline_schedule
    assert set(CLI_SCHEDULES) < set(SCHEDULES)  # "interleaved" is a table name only
    with pytest.raises(ValueError, match="^unknown pipeline schedule 'dualpipe'"):
        schedule_rule("dualpipe")


def test_labels_name_the_command_line_schedule_back():
    for name in CLI_SCHEDULES:
        rule = schedule_rule(name)
        for vpp in _chunk_counts(rule):
            assert rule_for_label(rule.label(vpp)) is rule
    assert schedule_rule("1f1b").label(2) == "interleaved-1f1b"
    assert rule_for_label("interleaved 1f1b").name == "1f1b"  # timelines written before the shared labels


def _schedule_names_outside_the_records() -> list[str]:
    names = set(SCHEDULES) | {rule.label(2) for rule in RULES}
    found = []
    for folder in ("core", "models", "training", "planner"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "schedule_rules.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    return found


def test_only_the_records_name_a_schedule():
    """Adding a schedule touches one record: no other module spells a schedule's name."""
    assert _schedule_names_outside_the_records() == []


def test_the_schedule_benchmark_asks_the_records():
    """``tools/bench/schedules.py`` runs each table as the records say: as the command-line schedule
    whose interleaved form it is, and at the microbatch counts Megatron's interleaving rule takes
    (at the default group size: a multiple of the pipeline size), here against that rule written out."""
    tables = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    assert [config_schedule(s) for s in tables] == ["gpipe", "1f1b", "1f1b", "zb-h1", "zbv"]
    for schedule, vpp in BENCH_CELLS:
        for pp in (2, 4):
            taken = [m for m in range(1, 13) if runs(schedule, vpp, pp, m)]
            expected = list(range(1, 13)) if vpp == 1 or schedule == "zbv" else list(range(pp, 13, pp))
            assert taken == expected, (schedule, vpp, pp)

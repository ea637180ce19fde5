"""Which tests start a process: the measurement behind the levels (tests/unit none, tests/dist always).

Off unless asked for; the root conftest loads it when ``TRIDENT_SPAWN_AUDIT`` names a report file:

    TRIDENT_SPAWN_AUDIT=/tmp/audit.tsv python -m pytest -q tests/unit tests/dist

Per test (setup, call and teardown together) it counts:

* ``procs``: processes started: ``multiprocessing`` (any start method, so ``torch.multiprocessing``,
  pools and data-loader workers too), ``subprocess`` (so ``torchrun`` and the entry points),
  ``os.fork``, ``os.system``, ``os.posix_spawn``, ``os.spawn*``, ``os.exec*``;
* ``pool_runs``: calls into ``tests/support/multirank.py``'s ranks (``RankPool.run``, hence
  ``run_on_ranks``);
* ``pool_fixture``: the test, or a fixture it uses, asks for the ``ranks`` pool: it spawns even when
  an earlier test started the pool or ran the fixture's ranks;
* ``pg_sizes``: process groups initialised in this process, with their world sizes (``gloo:1``);
* ``pretrain``: ``training.pretrain()`` called in this process.

A test *spawns* when ``procs`` or ``pool_runs`` is not 0 or ``pool_fixture`` holds. The report is a TSV,
one row per test, and the terminal summary names the tests on the wrong level. Python's audit events see
subprocesses and forks; the ``multiprocessing``, pool, process-group and pretrain counts wrap those
functions, which is why the audit is a plugin loaded on request and never part of a plain run.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch.distributed as dist

import training.training
from tests.support import multirank

AUDIT_EVENTS = {
    "subprocess.Popen",
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.posix_spawn",
    "os.spawn",
    "os.exec",
}
LEVELS = ("unit", "dist", "e2e")


@dataclass
class Counts:
    """What one test did, summed over its setup, call and teardown."""

    procs: int = 0
    started: list[str] = field(default_factory=list)
    pool_runs: int = 0
    pg_sizes: list[str] = field(default_factory=list)
    pretrain: int = 0
    pool_fixture: bool = False

    @property
    def spawns(self) -> bool:
        return self.procs > 0 or self.pool_runs > 0 or self.pool_fixture


class SpawnAudit:
    """A pytest plugin: counts per test, writes the report, names the tests on the wrong level."""

    def __init__(self, report_path: str):
        self.report_path = report_path
        self.counts: dict[str, Counts] = defaultdict(Counts)
        self.current: str | None = None
        self._instrument()

    def _note(self, what: str, value: str | None = None) -> None:
        if self.current is None:
            return
        counts = self.counts[self.current]
        if what == "pg":
            counts.pg_sizes.append(value or "?")
            return
        setattr(counts, what, getattr(counts, what) + 1)
        if what == "procs":
            counts.started.append(value or "?")

    def _on_audit_event(self, event: str, args: tuple) -> None:
        if event in AUDIT_EVENTS:
            program = args[1] if event == "subprocess.Popen" else args[0] if args else ""
            if isinstance(program, (list, tuple)):
                program = " ".join(str(a) for a in program[:3])
            self._note("procs", " ".join(f"{event} {program}".split())[:80])

    def _on_process_start(self, process, *_args, **_kwargs) -> None:
        target = getattr(process, "_target", None)
        self._note("procs", f"multiprocessing {getattr(target, '__qualname__', process.name)}")

    def _instrument(self) -> None:
        sys.addaudithook(self._on_audit_event)
        self._wrap(multiprocessing.process.BaseProcess, "start", self._on_process_start)
        self._wrap(multirank.RankPool, "run", lambda *a, **k: self._note("pool_runs"))
        self._wrap(dist, "init_process_group", self._note_group)
        self._wrap(training.training, "pretrain", lambda *a, **k: self._note("pretrain"))

    def _note_group(self, backend=None, *args, world_size: int = -1, **kwargs) -> None:
        size = world_size if world_size != -1 else os.environ.get("WORLD_SIZE", "?")
        self._note("pg", f"{backend}:{size}")

    @staticmethod
    def _wrap(owner, name: str, before) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            before(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = item.nodeid
        # A test whose fixtures stand on the module's pool spawns, even when an earlier test ran it.
        self.counts[item.nodeid].pool_fixture = "ranks" in getattr(item, "fixturenames", ())
        yield
        self.current = None

    def rows(self) -> list[tuple[str, str, Counts]]:
        return [(level_of(nodeid), nodeid, c) for nodeid, c in self.counts.items()]

    def pytest_terminal_summary(self, terminalreporter):
        rows = self.rows()
        with open(self.report_path, "w") as report:
            report.write("level\ttest\tspawns\tprocs\tpool_runs\tpool_fixture\tpg_sizes\tpretrain\tstarted\n")
            for level, nodeid, c in rows:
                pgs, started = ",".join(c.pg_sizes), "; ".join(sorted(set(c.started)))
                fields = (level, nodeid, int(c.spawns), c.procs, c.pool_runs, int(c.pool_fixture), pgs)
                report.write("\t".join(map(str, (*fields, c.pretrain, started))) + "\n")
        write = terminalreporter.write_line
        write(f"spawn audit ({self.report_path}):")
        for level in LEVELS:
            at = [c for lv, _, c in rows if lv == level]
            if at:
                n = sum(c.spawns for c in at)
                write(f"  tests/{level}: {len(at)} tests, {n} spawn, {len(at) - n} spawn none")
        wrong = [(lv, n, c) for lv, n, c in rows if (lv == "unit") == c.spawns and lv in ("unit", "dist")]
        for level, nodeid, c in wrong:
            write(f"  wrong level: {nodeid} (procs {c.procs}, pool runs {c.pool_runs})")
        for level, nodeid, c in rows:
            # The fake backend is one process playing one rank of a larger world: no peer, no message.
            if level == "unit" and any(not (s.endswith(":1") or s.startswith("fake:")) for s in c.pg_sizes):
                write(f"  unit test with a process group of more than one rank: {nodeid} {c.pg_sizes}")


def level_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "?"

"""The fault matrix: every fault kind x point x rank, with and without torchrun --max-restarts, on CPU ranks.

    python tools/fault_matrix.py                    # every cell (90; about 40-60 minutes on 2 cores)
    python tools/fault_matrix.py --cells kill@forward:0:restart exception@save:3:stop
    python tools/fault_matrix.py --quick            # one cell per kind and mode (10)

Each cell trains a tiny GPT (PP2 x DP2, 4 CPU ranks, 12 iterations, a checkpoint every 4) with one
fault injected through ``TRIDENT_FAULT`` (``training/faults/injection.py``): ``exception``, ``kill``
(SIGKILL), ``term`` (SIGTERM, no handler: the process ends) or ``hang`` at the ``forward``, ``data``,
``backward``, ``optimizer`` or ``save`` point of an iteration (6 for the first four, 8 for ``save``: a
checkpoint of iteration 4 exists), on rank 0 or rank 3. A ``restart`` cell runs under ``torchrun
--max-restarts 1``; a ``stop`` cell without restarts. ``write`` (the save of iteration 8 fails on the
rank after its first file) is a cell in both modes. Faults a run survives are cells too, in ``stop``
mode only (a restart never happens): ``slow`` at ``forward`` (the rank's forwards four times as long,
with ``--log-straggler``) and ``nan`` at ``forward`` (one iteration's forward outputs NaN) and at
``backward`` (the gradient reaching the rank's first forward output NaN).

What a cell must show, within its time limit (the watchdog's timeout is 15 s here, the process
groups' 30 s):

* ``restart``: the run finishes (exit 0) and its checkpoint of iteration 12 holds the same bytes as an
  uninterrupted run's (weights, optimizer state, RNG);
* ``slow``: the run finishes (exit 0) and the last straggler report names the slowed rank slowest;
* ``nan``: the run finishes (exit 0) with one NaN iteration counted and skipped;
* ``write``, ``stop``: as any stop cell below, and the tracker still names iteration 4;
* ``stop``: a non-zero exit, the fault reported in the output (the injected exception's message,
  torchrun's line for the signalled rank; for a hang, the watchdog's line that the ranks wait on each
  other), and the tracker naming a complete checkpoint;
* ``hang``, in both modes: the hang summary (``core/watchdog.py``) names the hung rank as the one the
  others wait on: for its pipeline messages (``rank 1 waits on rank 3's backward of ...``), for it to
  receive theirs (``rank 2 waits for its sends to rank 0 to be received (...)``), or in a collective it
  has not entered (``ranks 0,1,2 wait on rank 3, which has not entered gloo:all_reduce #29 ...``);
* both: no worker left running afterwards.

The table, then one JSON line with every cell's outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.torchrun_jobs import free_port

KINDS = ("exception", "kill", "term", "hang")
SURVIVED = {"slow": ("forward",), "nan": ("forward", "backward")}  # faults a run goes on through
POINTS = {"forward": 6, "data": 6, "backward": 6, "optimizer": 6, "save": 8}
RANKS = (0, 3)
MODES = ("restart", "stop")
FLAGS = shlex.split(
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --log-interval 1 --eval-interval 1000 --eval-iters 0 --lr 1e-3 "
    "--mock-data --lr-warmup-iters 2 --pipeline-model-parallel-size 2 --train-iters 12 "
    "--save-interval 4 --tokenizer-type NullTokenizer --vocab-size 1023 "
    "--distributed-timeout-minutes 1"
)
WATCHDOG_S = 15
"""The heartbeat watchdog's timeout; a rank that hangs while its heartbeat goes on is caught by the
process groups' timeout instead: ``PROCESS_GROUPS_S``, in place of the flag's whole minute."""
PROCESS_GROUPS_S = 30


@dataclass(frozen=True)
class Cell:
    kind: str
    point: str
    rank: int
    mode: str

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.point}:{self.rank}:{self.mode}"

    @classmethod
    def parse(cls, text: str) -> Cell:
        head, rank, mode = text.split(":")
        kind, point = head.split("@")
        return cls(kind, point, int(rank), mode)


def _launch(
    save: Path, *, fault: str, restarts: int, timeout: float, extra: list[str] | None = None
) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRIDENT_FAULT": fault}
    env["TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS"] = str(WATCHDOG_S)
    env["TRIDENT_TEST_PROCESS_GROUP_TIMEOUT_SECONDS"] = str(PROCESS_GROUPS_S)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", str(restarts)]
    cmd += [
        "--nproc-per-node",
        "4",
        str(ROOT / "pretrain_gpt.py"),
        *FLAGS,
        "--save",
        str(save),
        *(extra or []),
    ]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = 124, str(expired.stdout or "") + str(expired.stderr or "")
    return code, output, time.monotonic() - start


def _files(save: Path, iteration: int) -> dict | None:
    manifest = save / f"iter_{iteration:07d}" / "manifest.json"
    return json.loads(manifest.read_text())["files"] if manifest.is_file() else None


def _tracker_complete(save: Path) -> bool:
    tracker = save / "latest_checkpointed_iteration.txt"
    return not tracker.exists() or _files(save, int(tracker.read_text())) is not None


def _orphans(save: Path) -> int:
    found = subprocess.run(
        ["pgrep", "-f", f"--save {save}"], capture_output=True, text=True, check=False
    ).stdout
    return len(found.split())


def _hang_summary(cell: Cell, output: str) -> str | None:
    """The hang summary line, if it names the hung rank as the one the others wait on."""
    rank = cell.rank
    held = rf"(on rank {rank}(\b|'s)|sends to rank {rank} to be received)"
    for line in output.splitlines():
        if line.startswith("hang summary: ") and re.search(held, line):
            return line
    return None


def _named(cell: Cell, output: str) -> bool:
    """Whether the output names the fault: what the injected exception said, the silent rank, or the
    signalled rank in torchrun's summary."""
    if cell.kind in ("exception", "write"):
        return f"injected fault (TRIDENT_FAULT): {cell.kind} at {cell.point}" in output
    if cell.kind == "hang":  # the heartbeat goes on, so the one line says the ranks wait on each other
        said = "while every rank still answered" in output or f"rank {cell.rank} stopped answering" in output
        return said and _hang_summary(cell, output) is not None
    return f"rank      : {cell.rank} " in output and ("SIGKILL" in output or "SIGTERM" in output)


def _failure_excerpt(output: str) -> str:
    """What a failed cell prints: every line of the output naming an error (torchrun's summary at
    the end does not say why the ranks failed), then the output's end."""
    errors = [line for line in output.splitlines() if re.search(r"error|Error|Traceback", line)]
    return "\n".join(errors[:20]) + "\n...\n" + output[-1500:]


def _survived(cell: Cell, code: int, output: str) -> tuple[bool, str]:
    """A ``slow`` or ``nan`` cell's outcome: the run finished, and the fault shows as it should."""
    if cell.kind == "slow":
        reports = [line for line in output.splitlines() if line.startswith("stragglers, ")]
        named = bool(reports) and f"slowest rank {cell.rank} " in reports[-1]
        return code == 0 and named, f"exit {code}, " + ("slow rank named" if named else "slow rank NOT named")
    counted = "number of nan iterations:   1 |" in output
    return code == 0 and counted, f"exit {code}, " + (
        "NaN step skipped" if counted else "NaN step NOT counted"
    )


def _extra_flags(cell: Cell) -> list[str]:
    if cell.kind != "slow":
        return []
    port = free_port()  # for rank 0's straggler switch
    return ["--log-straggler", "--straggler-ctrlr-port", str(port), "--log-interval", "4"]


def run_cell(cell: Cell, reference: dict, workdir: Path, timeout: float) -> dict:
    save = workdir / cell.name.replace(":", "_").replace("@", "_")
    fault = f"{cell.kind}@{cell.point}:{POINTS[cell.point]}:rank={cell.rank}"
    if cell.kind == "slow":
        fault += ":factor=4"
    restarts = int(cell.mode == "restart")
    code, output, seconds = _launch(
        save, fault=fault, restarts=restarts, timeout=timeout, extra=_extra_flags(cell)
    )
    time.sleep(2)  # torchrun's last SIGTERMs land
    if cell.kind in SURVIVED:
        ok_outcome, what = _survived(cell, code, output)
    elif cell.mode == "restart":
        ok_outcome = code == 0 and _files(save, 12) == reference
        what = "finished, same bytes" if ok_outcome else f"exit {code}, final checkpoint differs or missing"
        if cell.kind == "hang":  # the first attempt's post-mortem
            named = _hang_summary(cell, output) is not None
            ok_outcome, what = (
                ok_outcome and named,
                what + (", hung rank named" if named else ", hung rank NOT named"),
            )
    else:
        ok_outcome = code not in (0, 124) and _named(cell, output)
        what = f"exit {code}, " + ("fault named" if _named(cell, output) else "fault NOT named")
        if cell.kind == "hang":
            what += ", hung rank named" if _hang_summary(cell, output) else ", hung rank NOT named"
        if cell.kind == "write":  # the failed save of iteration 8 left the tracker at iteration 4
            kept = (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
            ok_outcome, what = ok_outcome and kept, what + (", tracker at 4" if kept else ", tracker moved")
    orphans, complete = _orphans(save), _tracker_complete(save)
    passed = ok_outcome and orphans == 0 and complete and code != 124
    return {
        "cell": cell.name,
        "passed": passed,
        "outcome": what,
        "hang_summary": (_hang_summary(cell, output) or "") if cell.kind == "hang" else None,
        "seconds": round(seconds, 1),
        "orphans": orphans,
        "tracker_complete": complete,
        "tail": "" if passed else _failure_excerpt(output),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", nargs="*", help="cells as kind@point:rank:mode (default: all)")
    parser.add_argument("--quick", action="store_true", help="one restart and one stop cell per kind")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    args = parser.parse_args(argv)
    if args.cells:
        cells = [Cell.parse(text) for text in args.cells]
    elif args.quick:
        cells = [Cell(kind, "forward", 3, mode) for kind in KINDS for mode in MODES]
        cells += [Cell(kind, "forward", 3, "stop") for kind in SURVIVED]
    else:
        cells = [Cell(k, p, r, m) for k in KINDS for p in POINTS for r in RANKS for m in MODES]
        cells += [Cell("write", "save", r, m) for r in RANKS for m in MODES]
        cells += [Cell(k, p, r, "stop") for k, points in SURVIVED.items() for p in points for r in RANKS]
    with tempfile.TemporaryDirectory(prefix="trident-faults-") as tmp:
        workdir = Path(tmp)
        code, output, _ = _launch(workdir / "reference", fault="", restarts=0, timeout=args.timeout)
        reference = _files(workdir / "reference", 12)
        if code != 0 or reference is None:
            raise SystemExit(f"the uninterrupted reference run failed (exit {code}):\n{output[-3000:]}")
        results = []
        for cell in cells:
            results.append(run_cell(cell, reference, workdir, args.timeout))
            r = results[-1]
            print(
                f"{r['cell']:<28} {'pass' if r['passed'] else 'FAIL':<5} {r['seconds']:>6.1f} s  {r['outcome']}"
            )
            if r["hang_summary"] is not None:
                print(f"{'':<28} {r['hang_summary'] or 'no hang summary naming the hung rank'}")
            if not r["passed"]:
                print(r["tail"])
    load = [round(x, 2) for x in os.getloadavg()]
    summary = {
        "tool": "fault_matrix",
        "cells": len(results),
        "passed": sum(r["passed"] for r in results),
        "results": [{k: v for k, v in r.items() if k != "tail"} for r in results],
        "load_average": load,
    }
    print(f"{summary['passed']}/{summary['cells']} cells passed (load average {load})")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

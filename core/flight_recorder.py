"""torch's Flight Recorder, on by default (as in torchtitan), and its dump when a job hangs.

Each process group records its last collectives and point-to-point messages (what was asked, of which
group, in which state) in a ring buffer; torch 2.13 records for gloo as well as NCCL. :func:`enable`
sets the buffer's size before the process group exists, unless the environment already chose one
(``TORCH_FR_BUFFER_SIZE``, or NCCL's ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 0 turns it off). When the
watchdog ends a hung job, every rank writes :func:`dump`: the recorder's entries as JSON, with what the
rank itself was doing (its phase and schedule action) and its schedule position (its whole table, the
action it runs, the last it finished and the message it waits for), into :func:`dump_dir`.

When no rank waits for a pipeline message, the ranks wait in a collective; :func:`not_entered` reads
the dumps and names the collective some ranks have entered and others not (each process group numbers
its collectives, on every member alike): the ranks that have not entered it hold the others up. (Under
gloo the recorder does not say which collectives completed: a rank is taken to wait in its latest.)
"""

from __future__ import annotations

import json
import os
import tempfile

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
DIR_ENV = "TRIDENT_FLIGHT_RECORDER_DIR"
DEFAULT_ENTRIES = 2000


def enable(entries: int = DEFAULT_ENTRIES) -> None:
    """Record the last ``entries`` operations of every process group created after this call."""
    if BUFFER_ENV not in os.environ and NCCL_BUFFER_ENV not in os.environ:
        os.environ[BUFFER_ENV] = str(entries)


def dump_dir() -> str:
    """Where the ranks of this job write their dumps: ``TRIDENT_FLIGHT_RECORDER_DIR``, else a directory
    of the temporary directory named after torchrun's run id (the same on every rank of a job)."""
    given = os.environ.get(DIR_ENV)
    if given:
        return given
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    return os.path.join(tempfile.gettempdir(), f"trident-flight-recorder-{run_id}")


def read_dumps(ranks: list[int] | range) -> dict[int, dict]:
    """The dumps of ``ranks`` in :func:`dump_dir` that exist and parse, by rank."""
    dumps = {}
    for rank in ranks:
        try:
            with open(os.path.join(dump_dir(), f"rank_{rank}.json")) as fh:
                dumps[rank] = json.load(fh)
        except (OSError, ValueError):
            continue
    return dumps


class _Collectives:
    """One rank's collectives from its dump: the highest number it reached in each process group, and
    the one it is in now (its latest: a rank waits in one collective at a time)."""

    def __init__(self, dump: dict) -> None:
        entries = [e for e in (dump.get("flight_recorder") or {}).get("entries", []) if not e.get("is_p2p")]
        self.last: dict[str, int] = {}
        for entry in entries:
            group = entry["process_group"][0]
            self.last[group] = max(self.last.get(group, -1), int(entry["collective_seq_id"]))
        latest = max(entries, key=lambda e: e["record_id"], default=None)
        self.current = None
        if latest is not None:
            self.current = (
                latest["process_group"][0],
                int(latest["collective_seq_id"]),
                latest["profiling_name"],
            )


def _ranks(ranks: list[int] | set[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in sorted(ranks))


def _roots(rank: int, edges: dict[int, set[int]]) -> set[int]:
    """The ranks at the ends of ``rank``'s waits (ranks that wait for nobody); none along a circle."""
    roots, seen, todo = set(), {rank}, [rank]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt in seen:
                continue
            seen.add(nxt)
            if edges.get(nxt):
                todo.append(nxt)
            else:
                roots.add(nxt)
    return roots


def not_entered(dumps: dict[int, dict]) -> str | None:
    """``ranks 0,1,2 wait on rank 3, which has not entered gloo:all_reduce #29 of process group 0``.

    A rank waits in its latest collective for the members of that process group (the ranks whose dumps
    record any collective of it) that have not got to its number yet; following these waits ends at
    the ranks that wait for nobody. None when no rank waits for another."""
    ranks = {rank: _Collectives(dump) for rank, dump in dumps.items()}
    edges, waits_in = {}, {}
    for rank, mine in ranks.items():
        if mine.current is None:
            continue
        group, seq, name = mine.current
        behind = {r for r, theirs in ranks.items() if -1 < theirs.last.get(group, -1) < seq}
        if behind:
            edges[rank], waits_in[rank] = behind, f"{name} #{seq} of process group {group}"
    held: dict[int, list[int]] = {}
    for rank in sorted(edges):
        for root in _roots(rank, edges):
            held.setdefault(root, []).append(rank)
    parts = []
    for root, waiters in sorted(held.items(), key=lambda item: (-len(item[1]), item[0])):
        ops = dict.fromkeys(waits_in[r] for r in waiters if root in edges[r])
        verb = "waits" if len(waiters) == 1 else "wait"
        entered = f", which has not entered {' and '.join(ops)}" if ops else ""
        parts.append(f"{_ranks(waiters)} {verb} on rank {root}{entered}")
    return "; ".join(parts) or None


def dump(rank: int, doing: str, schedule: dict | None = None) -> str | None:
    """Write this rank's recorder entries, ``doing`` (its phase and schedule action) and ``schedule`` (its
    schedule position: the table, the running and last finished action, the message it waits for; see
    ``core.pipeline_parallel.position``) to ``<dump_dir>/rank_<rank>.json``; the path, or None when
    nothing could be written."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = json.loads(_dump_fr_trace_json())
        directory = dump_dir()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank_{rank}.json")
        with open(path, "w") as fh:
            record = {"rank": rank, "doing": doing, "schedule": schedule, "flight_recorder": trace}
            json.dump(record, fh, indent=1, default=str)
        return path
    except Exception:  # noqa: BLE001 -- a post-mortem must never stand in the way of the exit it explains
        return None

"""torch's Flight Recorder, on by default (as in torchtitan), and its dump when a job hangs.

Each process group records its last collectives and point-to-point messages (what was asked, of which
group, in which state) in a ring buffer; torch 2.13 records for gloo as well as NCCL. :func:`enable`
sets the buffer's size before the process group exists, unless the environment already chose one
(``TORCH_FR_BUFFER_SIZE``, or NCCL's ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 0 turns it off). When the
watchdog ends a hung job, every rank writes :func:`dump`: the recorder's entries as JSON, with what the
rank itself was doing (its phase and schedule action) and its schedule position (its whole table, the
action it runs, the last it finished and the message it waits for), into :func:`dump_dir`.
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

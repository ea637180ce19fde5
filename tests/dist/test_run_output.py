"""What a run prints: whole lines, from ranks printing at once.

Lines from different ranks never share a line of the launcher's output. torchrun starts its workers with ``python -u``: unbuffered, so ``print`` makes one write of the text
and another of the newline, and a rank can be paused in between (another of its threads, such as
the heartbeat watchdog or W&B, takes the interpreter) while another rank writes. The output then
has ``...(iteration 100)saved checkpoint ...`` and an empty line. Here four processes print at once
into one pipe, each through an unbuffered stdout that pauses after every write. The command printed
at the end of a run is checked in tests/unit/test_run_output.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torch.distributed  # noqa: F401 -- imported once here, not in each forked child

from training.reporting.logging_utils import print_line, print_rank_0

RANKS, LINES = 4, 100


class _PausingPipe(io.RawIOBase):
    """The write end of a pipe, unbuffered as ``python -u`` makes stdout, pausing after each write."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written = os.write(self.fd, bytes(data))
        time.sleep(0.001)  # as if another thread of this rank ran now
        return written


def _printed_at_once(say) -> list[str]:
    """What RANKS forked processes calling ``say`` LINES times each write into one pipe, split in lines."""
    read, write = os.pipe()
    children = []
    for rank in range(RANKS):
        pid = os.fork()
        if pid == 0:  # the child prints, then leaves without running the parent's cleanup
            code = 1
            try:
                os.close(read)
                sys.stdout = io.TextIOWrapper(_PausingPipe(write), write_through=True)
                for i in range(LINES):
                    say(f"rank {rank} line {i:03d} " + "." * 50)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as pipe:
        text = pipe.read()
    assert all(os.waitpid(pid, 0)[1] == 0 for pid in children)
    return text.split("\n")


def test_lines_printed_by_ranks_at_once_stay_whole():
    expected = sorted(f"rank {r} line {i:03d} " + "." * 50 for r in range(RANKS) for i in range(LINES))
    for say in (print_rank_0, print_line):  # no process group here: every process is "rank 0"
        lines = _printed_at_once(say)
        assert lines[-1] == "" and sorted(lines[:-1]) == expected


ENDING = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch.distributed as dist
from training.faults import ending_the_process

def late_writer():
    time.sleep(0.2)
    print("thread done", flush=True)

with ending_the_process():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    dist.all_reduce(torch_tensor := __import__("torch").ones(4))
    dist.destroy_process_group()
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=late_writer).start()
    idle_pool = ThreadPoolExecutor(2)  # as inductor's compile workers: idle, waiting for work
    idle_pool.submit(int).result()
    print("main done", flush=True)
    sys.exit({code!r})
"""


@pytest.mark.parametrize(
    ("code", "returncode", "stderr"), [(None, 0, ""), (3, 3, ""), ("bad flag", 1, "bad flag")]
)
def test_the_entry_points_end_does_what_finalization_would_then_exits_with_the_code(code, returncode, stderr):
    """pretrain_gpt.py ends through ``ending_the_process``: the remaining threads are joined (an idle thread
    pool stopped first, as finalization does) and the atexit handlers run before ``os._exit``, and the exit
    code is the one ``sys.exit`` was given."""
    done = subprocess.run(
        [sys.executable, "-c", ENDING.format(code=code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == returncode, done.stderr
    assert done.stdout.split("\n") == ["main done", "thread done", "atexit ran", ""]
    assert done.stderr.strip() == stderr

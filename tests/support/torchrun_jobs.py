"""Real ``torchrun`` jobs of ``pretrain_gpt.py`` on a tiny model and a tiny dataset, watched rank by rank.

``Job`` starts torchrun in its own session, reads its output on a thread, knows each worker's pid by
global rank (from ``/proc``), and can signal a worker or torchrun itself. The dataset is written by
the real ``IndexedDatasetBuilder`` and read with ``NullTokenizer``, so no tokenizer is trained.
The tests that run a command to its end (``torchrun`` or ``python``) and read its output afterwards use
``run_captured``; ``start_session`` is ``Job``'s start, for a test that reads the output itself.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 600

TINY = [
    "--num-layers", "4",
    "--hidden-size", "32",
    "--num-attention-heads", "2",
    "--seq-length", "16",
    "--micro-batch-size", "2",
    "--global-batch-size", "8",
    "--lr", "1e-3",
    "--lr-warmup-iters", "0",
    "--log-interval", "1",
    "--eval-iters", "0",
    "--hidden-dropout", "0",
    "--attention-dropout", "0",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(VOCAB),
    "--split", "90,10,0",
]  # fmt: skip


def write_tiny_dataset(
    prefix: Path, *, documents: int = 200, length: int = 60, seed: int = 0, vocab: int = VOCAB
) -> Path:
    """``prefix.bin``/``.idx`` of random ids below ``vocab``, through the real builder."""
    from training.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(documents):
        builder.add_document(rng.integers(0, vocab, size=length), [length])
    builder.finalize(f"{prefix}.idx")
    return prefix


TORCHRUN = "torch.distributed.run"
TRIDENT_RUN = "training.launch"
"""``trident-run``: torchrun's arguments, Trident's exit codes (``training/launch.py``)."""


def job_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def _ephemeral_ports() -> range:
    """The ports the kernel hands out to sockets bound or connected without one (Linux's default
    where ``/proc`` does not say)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A TCP port on loopback that is free now (a rendezvous endpoint, a straggler switch).

    It is drawn from outside the kernel's ephemeral range: a port the kernel picked could be handed
    again, before the job binds it, to one of the job's own sockets (gloo's pairs, the store's
    clients), and the job would then fail on a port already in use.
    """
    ephemeral = _ephemeral_ports()
    draw = random.Random(os.urandom(8))
    for _ in range(200):
        port = draw.randrange(10000, 65536)
        if port in ephemeral:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1}")


def torchrun_command(
    nproc: int,
    flags: list[str],
    *,
    launcher: list[str] | None = None,
    script: Path = ROOT / "pretrain_gpt.py",
    module: str = TORCHRUN,
) -> list[str]:
    """``python -m torch.distributed.run`` (standalone unless ``launcher`` says otherwise) of ``script``;
    ``module`` :data:`TRIDENT_RUN` for Trident's launcher, which takes torchrun's arguments."""
    launcher = launcher or ["--standalone"]
    return [
        sys.executable,
        "-m",
        module,
        *launcher,
        "--nproc-per-node",
        str(nproc),
        str(script),
        *flags,
    ]


def run_captured(
    cmd: list[str] | str,
    *,
    env: dict[str, str],
    timeout: float,
    cwd: Path | str | None = ROOT,
    shell: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end with its stdout and stderr kept apart as text; the exit code is the
    caller's to check (its assertion shows the output).

    A run past ``timeout`` is killed, with its whole session (torchrun's workers too: a script that
    calls ``pretrain()`` itself does not watch its launcher), and comes back as exit code 124 with what
    it had printed and a last stderr line saying so: the caller's assertion then shows where it stood
    (a pytest-timeout would show only the test's own stack)."""
    with start_session(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, shell=shell) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            return subprocess.CompletedProcess(cmd, 124, stdout, stderr + f"\n[killed after {timeout} s]\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def start_session(
    cmd: list[str] | str,
    *,
    env: dict[str, str],
    cwd: Path | str | None = ROOT,
    stderr: int = subprocess.STDOUT,
    shell: bool = False,
) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so that its whole process group can be signalled), its stdout
    a text pipe the caller reads as it comes, with stderr merged into it unless ``stderr`` says where."""
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        shell=shell,
        start_new_session=True,
    )


def worker_tracebacks(output: str) -> list[str]:
    """Traceback frames in the project's code (torchrun's own ChildFailedError traceback excluded)."""
    return re.findall(rf'File "{re.escape(str(ROOT))}/(?!tests/).*', output)


LINE_STARTS = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] (iteration|validation)|saved checkpoint |loaded checkpoint |run summary: "
    r"|training \d+ iterations from |  checkpoint: |  (resume|train longer): |  final train lm loss: "
)
"""How the lines a run prints start (the log line with its timestamp, the summary, the checkpoints)."""


def broken_lines(output: str) -> list[str]:
    """Lines that are not one rank's whole line: empty ones (a newline whose text went elsewhere), and
    ones with another line's start inside them (``...(iteration 100)saved checkpoint ...``)."""
    return [
        line
        for line in output.splitlines()
        if not line.strip() or any(m.start() > 0 for m in LINE_STARTS.finditer(line))
    ]


def losses(output: str) -> dict[int, float]:
    """Iteration -> ``lm loss`` from Megatron-style log lines."""
    found = re.findall(r" iteration +(\d+)/ *\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", output)
    return {int(i): float(v) for i, v in found}


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Job:
    """One torchrun job, its output collected as it comes."""

    def __init__(
        self,
        nproc: int,
        flags: list[str],
        *,
        env: dict[str, str],
        launcher: list[str] | None = None,
        module: str = TORCHRUN,
    ):
        self.nproc = nproc
        # A worker that faults, or that ``dump_stacks`` aborts, prints every thread's Python stack.
        env = {**env, "PYTHONFAULTHANDLER": "1"}
        self.proc = start_session(torchrun_command(nproc, flags, launcher=launcher, module=module), env=env)
        self.lines: list[str] = []
        self.known_workers: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        """Return once the output holds ``text``; else fail with the output, the workers' stacks in it
        where the job is still running at ``timeout`` (a hang)."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None:
                raise AssertionError(f"never saw {text!r} (the job ended):\n{self.output[-4000:]}")
            if time.monotonic() > deadline:
                self.dump_stacks()
                raise AssertionError(f"never saw {text!r} in {timeout} s:\n{self.output[-8000:]}")
            time.sleep(0.05)

    def dump_stacks(self) -> None:
        """Abort every worker, which makes each print its Python stacks (``PYTHONFAULTHANDLER``), and
        wait a moment for the text to arrive."""
        with contextlib.suppress(OSError, AssertionError, StopIteration):
            self.workers()
        for pid in self.known_workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(3)

    def wait_for_workers(self, timeout: float) -> dict[int, int]:
        """``workers()`` once torchrun has started all of them (after its rendezvous)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.workers()
            except (AssertionError, FileNotFoundError, StopIteration):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of torchrun's worker processes."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        ranks = {}
        for pid in map(int, children):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(item[5:]) for item in env if item.startswith(b"RANK="))
            ranks[rank] = pid
        assert len(ranks) == self.nproc, ranks
        self.known_workers.update(ranks)
        return ranks

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        self._reader.join(timeout=10)
        return self.output

    def kill(self) -> None:
        """Kill whatever is left of the job: torchrun's session, and the workers (each in its own)."""
        for pid in [self.proc.pid, *self.known_workers.values()]:
            if alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()


def run(
    nproc: int,
    flags: list[str],
    *,
    env: dict[str, str],
    timeout: float = 240,
    launcher: list[str] | None = None,
    module: str = TORCHRUN,
) -> tuple[int, str]:
    """Run a job to its end; (the launcher's exit code, everything it and its workers printed)."""
    job = Job(nproc, flags, env=env, launcher=launcher, module=module)
    output = job.finish(timeout)
    return job.proc.returncode, output

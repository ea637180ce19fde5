"""When ranks stop answering or torchrun dies: the heartbeat watchdog, and real torchrun jobs under signals.

The watchdog tests run several watchdogs in one process over one real ``torch.distributed`` store; a
"frozen" rank is one whose heartbeat writes stop, as a SIGSTOPped process's do. The job tests send
real signals to real torchrun workers: SIGSTOP to a middle rank (the empty stage of an
``Ett|t||tL`` layout, whose losses must also match one rank's), and SIGKILL to torchrun itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import threading
import time

import pytest
import torch.distributed as dist

from core.pipeline_parallel.position import Wait
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE
from core.pipeline_parallel.schedules import complete_tables
from core.watchdog import Watchdog, claim_report, is_communication_failure
from tests.support.torchrun_jobs import (
    TINY,
    Job,
    alive,
    job_env,
    losses,
    run,
    worker_tracebacks,
    write_tiny_dataset,
)
from training.checkpoint import open_checkpoint, read_tracker
from training.checkpoint.async_save import STALL_ENV


class FreezableStore:
    """One rank's handle on the shared store; once ``frozen`` its writes stop, as a SIGSTOPped rank's do."""

    def __init__(self, store):
        self.store, self.frozen = store, False

    def set(self, key, value):
        if not self.frozen:
            self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


@contextlib.contextmanager
def _running_watchdogs(world_size, timeout, messages, interval):
    """One started watchdog per rank on one store, each through its own freezable handle; all stopped on exit."""
    store = dist.HashStore()
    handles = [FreezableStore(store) for _ in range(world_size)]
    dogs = [
        Watchdog(
            handles[rank],
            rank,
            world_size,
            timeout,
            on_silent=messages.append,
            interval=interval,
            timeout_setting="the test's timeout",
        )
        for rank in range(world_size)
    ]
    try:
        for dog in dogs:
            dog.start()
        yield handles, dogs
    finally:
        for dog in dogs:
            dog.stop()


def test_watchdog_names_the_silent_rank_and_what_the_others_waited_in():
    """Rank 1 freezes, rank 3 has finished: only rank 1 is named, by ranks 0 and 2, after the timeout."""
    messages: list[str] = []
    with _running_watchdogs(4, 3.0, messages, interval=0.25) as (handles, dogs):
        dogs[1].enter("the loss check", 4)
        time.sleep(0.6)  # two heartbeats say so
        handles[1].frozen = True
        dogs[3].stop()  # finished: its last heartbeat says "done", so it is never called silent
        started = time.monotonic()
        for rank in (0, 2):
            dogs[rank].enter("forward-backward", 5)
        while len(messages) < 2 and time.monotonic() - started < 20:
            time.sleep(0.05)
        elapsed = time.monotonic() - started
    assert len(messages) == 2, messages  # one per waiting rank; the job's one report is training.faults'
    pattern = (
        r"rank 1 stopped answering: no heartbeat for \d+ s \(the last one said: the loss check at "
        r"iteration 4\); ranks 0,2 waited \d s for it in forward-backward at iteration 5 "
        r"\(the test's timeout\)"
    )
    for message in messages:
        assert re.fullmatch(pattern, message), message
    assert 3.0 - 0.25 - 0.3 <= elapsed <= 3.0 + 5, elapsed  # at the deadline, an interval early


def test_the_message_names_the_schedule_action_each_rank_was_in():
    """The training loop tells the watchdog each schedule action (``Watchdog.at``): the silent rank's
    last action and the one each other rank waits in are named."""
    messages: list[str] = []
    with _running_watchdogs(3, 3.0, messages, interval=0.25) as (handles, dogs):
        dogs[1].enter("forward-backward", 5)
        dogs[1].at("schedule action 4 of 8: 0F2")
        time.sleep(0.6)
        handles[1].frozen = True
        for rank, action in ((0, "5 of 8: 0RECV_B1"), (2, "3 of 8: 0RECV_F2")):
            dogs[rank].enter("forward-backward", 5)
            dogs[rank].at(f"schedule action {action}")
        started = time.monotonic()
        while len(messages) < 2 and time.monotonic() - started < 20:
            time.sleep(0.05)
    assert len(messages) == 2, messages
    pattern = (
        r"rank 1 stopped answering: no heartbeat for \d+ s \(the last one said: forward-backward, schedule "
        r"action 4 of 8: 0F2 at iteration 5\); ranks 0,2 waited up to \d s for it \(rank 0 in "
        r"forward-backward, schedule action 5 of 8: 0RECV_B1 at iteration 5; rank 2 in forward-backward, "
        r"schedule action 3 of 8: 0RECV_F2 at iteration 5\) \(the test's timeout\)"
    )
    for message in messages:
        assert re.fullmatch(pattern, message), message


def test_a_backend_timeout_with_every_rank_alive_says_what_each_rank_does():
    messages: list[str] = []
    with _running_watchdogs(3, 60.0, messages, interval=5.0) as (_, dogs):
        for rank, (phase, iteration) in enumerate(
            [("all-reduce", 3), ("checkpoint save", 3), ("all-reduce", 3)]
        ):
            dogs[rank].enter(phase, iteration)
            dogs[rank]._beat()  # as the next tick would
        text = dogs[0].explain_timeout()
    assert text == (
        "timed out after 60 s (the test's timeout) while every rank still answered: ranks 0,2 in all-reduce "
        "at iteration 3; rank 1 in checkpoint save at iteration 3. The ranks wait on each other: a collective "
        "that not every rank runs, or one rank far slower than the others"
    )
    assert messages == []


def test_a_waiting_rank_ends_quietly_once_another_rank_reported_the_error():
    store = dist.HashStore()
    ended = threading.Event()
    dog = Watchdog(store, 1, 2, 600.0, on_silent=print, on_reported_elsewhere=ended.set, interval=0.1)
    dog.start()
    try:
        dog.enter("forward-backward", 7)
        assert not ended.wait(0.6)  # nobody has reported anything: keep waiting
        assert claim_report(store, 0)
        assert ended.wait(5)
    finally:
        dog.stop()


def test_exactly_one_rank_claims_the_report():
    store = dist.HashStore()
    results: dict[int, bool] = {}
    threads = [
        threading.Thread(target=lambda r=r: results.update({r: claim_report(store, r)})) for r in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(8))
    assert sum(results.values()) == 1
    assert not claim_report(store, 99)


@pytest.mark.parametrize(
    "error, expected",
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4"), True),
        (
            RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv"),
            True,
        ),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, remote process exited"), True),
        (RuntimeError("3 consecutive iterations had a NaN/inf loss"), False),
        (ValueError("connection closed by peer"), False),
    ],
)
def test_communication_failures_are_told_from_other_errors(error, expected):
    assert is_communication_failure(error) is expected


# --------------------------------------------------------------------------------------------------
# Real torchrun jobs
# --------------------------------------------------------------------------------------------------

TIMEOUT_S = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny")


def _endless_pp2(data) -> list[str]:
    """Flags of a two-stage run on ``data`` that trains until it is stopped."""
    return [*TINY, "--pipeline-model-parallel-size", "2", "--train-iters", "100000", "--data-path", str(data)]


def _single_rank_losses(data, iterations: int) -> list[float]:
    """The same run on one rank, stopped after ``iterations`` (--train-iters sets the sample order, so
    it stays); in this process: pretrain starts and ends its own world of one."""
    import torch

    from tests.support.pretrain_run import pretrain_gpt_in_process

    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1): two cores are shared

    state = pretrain_gpt_in_process(
        argv=TINY + ["--train-iters", "100000", "--exit-interval", str(iterations), "--data-path", str(data)]
    )
    return [reported["lm loss"] for reported in state.losses]


def test_a_frozen_rank_ends_the_job_naming_it_and_empty_stages_train(data, tmp_path):
    """SIGSTOP the middle rank (the empty stage of 'Ett|t||tL'): the others exit within the timeout
    (+40 s), one line names rank 2 and what they waited in, each waiting rank dumps its flight recorder;
    the losses before match one rank's."""
    flags = TINY + ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Ett|t||tL"]
    job = Job(
        4,
        flags + ["--train-iters", "100000", "--data-path", str(data)],
        env=job_env(
            TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS=str(TIMEOUT_S), TRIDENT_FLIGHT_RECORDER_DIR=str(tmp_path)
        ),
    )
    try:
        job.wait_for(" iteration       10/", timeout=240)
        workers = job.workers()
        os.kill(workers[2], signal.SIGSTOP)
        stopped = time.monotonic()
        survivors = {rank: pid for rank, pid in workers.items() if rank != 2}
        exited: dict[int, float] = {}
        while len(exited) < len(survivors) and time.monotonic() - stopped < TIMEOUT_S + 40:
            exited.update(
                {
                    r: time.monotonic() - stopped
                    for r, p in survivors.items()
                    if r not in exited and not alive(p)
                }
            )
            time.sleep(0.1)
        print(f"seconds from SIGSTOP to each survivor's exit: {exited}")
        assert sorted(exited) == [0, 1, 3], (
            f"still running: {set(survivors) - set(exited)}\n{job.output[-3000:]}"
        )
        assert alive(workers[2])  # stopped, not dead: torchrun would SIGKILL it 30 s later; we do it now
        os.kill(workers[2], signal.SIGKILL)
        output = job.finish(timeout=60)
    finally:
        job.kill()
    reports = [line for line in output.splitlines() if "error:" in line]
    assert len(reports) == 1, output[-4000:]
    assert re.fullmatch(
        r"pretrain_gpt\.py: error: rank 2 stopped answering: no heartbeat for \d+ s \(the last one said: .+\); "
        r"ranks 0,1,3 waited (\d+ s for it in|up to \d+ s for it \(rank).* at iteration \d+\)? "
        rf"\(TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS={TIMEOUT_S}\)",
        reports[0],
    ), reports[0]
    print(reports[0])  # names each rank's schedule action when it waits in one (the wording: see above)
    assert (
        f"flight recorder (each rank's last collectives and schedule position): {tmp_path}/rank_*.json"
        in output
    )
    summary = [line for line in output.splitlines() if line.startswith("hang summary: ")]
    print(summary)  # the action depends on where rank 2 stopped: in the schedule, or in a collective
    assert len(summary) == 1 and re.fullmatch(
        r"hang summary: (ranks? [\d,]+ waits? on rank 2's (forward|backward) of microbatch \d, chunk 0"
        r"( and (forward|backward) of microbatch \d, chunk 0)* at iteration \d+.*|no rank waits for a pipeline "
        r"message .*|ranks? [\d,]+ waits? for (its|their) sends to rank 2 to be received \((activation|gradient) "
        r"of microbatch \d, chunk 0 at iteration \d+\).*)",
        summary[0],
    ), summary
    tables = complete_tables(DEFAULT_SCHEDULE, 4, 1, 4)
    for rank in (0, 1, 3):
        dumped = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert dumped["rank"] == rank and dumped["doing"], dumped["doing"]
        assert any(e["profiling_name"].startswith("gloo:") for e in dumped["flight_recorder"]["entries"])
        assert dumped["schedule"]["table"] == [str(action) for action in tables[rank]]
    assert not (tmp_path / "rank_2.json").exists()  # the frozen rank writes nothing
    assert worker_tracebacks(output) == [] and "Connection closed by peer" not in output
    assert job.proc.returncode == 1
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", output))
    assert codes["2"] == "-9" and all(codes[r] in ("1", "-15") for r in ("0", "1", "3")), codes
    trained = losses(output)
    reference = _single_rank_losses(data, 3)
    for i in (1, 2, 3):
        assert abs(trained[i] - reference[i - 1]) <= 5e-6 * abs(reference[i - 1]), (trained, reference)


def test_a_hang_names_the_action_every_rank_waits_on_and_each_rank_dumps_its_table(data, tmp_path):
    """TRIDENT_FAULT=hang@backward:3:rank=1 at PP=2: rank 1 hangs in its first backward of iteration 3
    (its heartbeat goes on, so it is not silent) and rank 0 waits for that backward's gradient until
    the process groups' timeout (``--distributed-timeout-minutes 1``, cut to 20 s for the test). The
    summary line names rank 1's backward; each rank's dump holds its whole table as the executor runs
    it, the action it runs, the last one it finished and the message it waits for."""
    env = job_env(
        TRIDENT_FAULT="hang@backward:3:rank=1",
        TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS=str(TIMEOUT_S),
        TRIDENT_TEST_PROCESS_GROUP_TIMEOUT_SECONDS="20",
        TRIDENT_FLIGHT_RECORDER_DIR=str(tmp_path),
    )
    code, output = run(2, [*_endless_pp2(data), "--distributed-timeout-minutes", "1"], env=env, timeout=300)
    lines = [
        line for line in output.splitlines() if line.startswith(("pretrain_gpt.py: error:", "flight", "hang"))
    ]
    print("\n".join(lines))
    assert code == 1 and len(lines) == 3, output[-4000:]
    waits = (
        "rank 0 in forward-backward (pipeline send/recv, data-parallel gradient all-reduce), schedule action 6 "
        "of 16: 0B0 (backward of microbatch 0, chunk 0) at iteration 3; rank 1 in forward-backward (pipeline "
        "send/recv, data-parallel gradient all-reduce), schedule action 4 of 16: 0B0 (backward of microbatch "
        "0, chunk 0) at iteration 3"
    )
    assert lines[0].startswith("pretrain_gpt.py: error: timed out after ") and waits in lines[0], lines[0]
    assert lines[1:] == [
        f"flight recorder (each rank's last collectives and schedule position): {tmp_path}/rank_*.json",
        "hang summary: rank 0 waits on rank 1's backward of microbatch 0, chunk 0 at iteration 3",
    ]
    tables = complete_tables(DEFAULT_SCHEDULE, 2, 1, 4)
    expected = {
        0: ({"index": 5, "action": "0B0", "what": "backward of microbatch 0, chunk 0"}, "0SEND_F1"),
        1: ({"index": 3, "action": "0B0", "what": "backward of microbatch 0, chunk 0"}, "0RECV_F1"),
    }
    for rank, (running, finished) in expected.items():
        schedule = json.loads((tmp_path / f"rank_{rank}.json").read_text())["schedule"]
        assert schedule["table"] == [str(action) for action in tables[rank]]
        assert schedule["iteration"] == 3 and schedule["running"] == running
        assert schedule["last_finished"] == {"index": running["index"] - 1, "action": finished}
    # rank 0 dumps the wait its position names (the record's fields: test_hang_post_mortem.py)
    waited = json.loads((tmp_path / "rank_0.json").read_text())["schedule"]["waits_for"]
    assert waited == Wait(peer=1, kind="gradient", microbatch=0, chunk=0, peer_chunk=0).as_dict()
    assert json.loads((tmp_path / "rank_1.json").read_text())["schedule"]["waits_for"] is None
    assert worker_tracebacks(output) == []


def _load_every_rank(ckpt, pp: int) -> int:
    """Read the tracker's checkpoint whole, as its ``pp`` pipeline ranks would, every checksum verified;
    its iteration."""
    iteration = read_tracker(str(ckpt))
    loaded = open_checkpoint(str(ckpt))
    assert loaded.iteration == iteration and loaded.parallel.pp == pp
    loaded.verify_headers()
    for name in loaded.tensor_names("all"):
        loaded.full_tensor(name)
    for rank in range(pp):
        assert loaded.read_rng_state(0, rank, 0) is not None
    return iteration


def test_killing_torchrun_ends_its_workers_and_keeps_the_last_checkpoint(data, tmp_path):
    """kill -9 of torchrun while it saves every iteration: no worker is left 30 s later, and the tracker's
    checkpoint loads on every rank."""
    ckpt = tmp_path / "ckpt"
    flags = _endless_pp2(data)
    job = Job(2, flags + ["--save", str(ckpt), "--save-interval", "1"], env=job_env())
    try:
        job.wait_for(" iteration        4/", timeout=240)
        time.sleep(random.uniform(0, 0.2))  # somewhere in the next save or step
        workers = job.workers()
        os.kill(job.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while any(alive(pid) for pid in workers.values()) and time.monotonic() - killed < 30:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
        left = [pid for pid in workers.values() if alive(pid)]
    finally:
        job.kill()
    print(f"workers gone {gone_after:.2f} s after torchrun was killed")
    assert left == [], f"workers {left} outlived torchrun by 30 s"
    assert _load_every_rank(ckpt, 2) >= 3


def test_kill_9_during_an_asynchronous_write_keeps_the_previous_checkpoint(data, tmp_path):
    """--async-save: iteration 2's checkpoint commits while training goes on; iteration 4's write stops
    after its first file (a test hook) while training goes on again; kill -9 of the whole job there
    leaves checkpoint 2 the tracker's, loadable on every rank."""
    ckpt = tmp_path / "ckpt"
    flags = _endless_pp2(data)
    flags += ["--save", str(ckpt), "--save-interval", "2", "--async-save"]
    job = Job(2, flags, env=job_env(**{STALL_ENV: "4"}))
    first_files = [ckpt / "iter_0000004" / f"model_tp0_pp{p}.safetensors" for p in (0, 1)]
    try:
        job.wait_for(" iteration        5/", timeout=240)  # training went on while iteration 4 is written
        deadline = time.monotonic() + 60
        while not all(f.is_file() for f in first_files) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = job.workers()
        for pid in [*workers.values(), job.proc.pid]:
            os.kill(pid, signal.SIGKILL)
    finally:
        job.kill()
    output = job.output
    assert f"saved checkpoint {ckpt}/iter_0000002" in output, output[-3000:]
    assert all(f.is_file() for f in first_files), sorted(os.listdir(ckpt / "iter_0000004"))
    assert not (ckpt / "iter_0000004" / "manifest.json").exists()
    assert _load_every_rank(ckpt, 2) == 2


def test_a_failed_background_write_stops_training_at_the_next_iteration(data, tmp_path):
    """--async-save where iteration 2's directory cannot be made (a file holds its name): the run stops
    at iteration 3 with one CheckpointError naming the path; checkpoint 1 stays the tracker's."""
    from tests.support.pretrain_run import pretrain_gpt_in_process
    from training.checkpoint import CheckpointError

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000002").write_text("not a directory")
    seen: list[int] = []

    def hook(state) -> None:  # the background write ends before the next iteration's check
        seen.append(state.iteration)
        for thread in threading.enumerate():
            if thread.name.startswith("checkpoint-writer"):
                thread.join()

    argv = TINY + ["--train-iters", "6", "--data-path", str(data), "--save", str(ckpt)]
    with pytest.raises(CheckpointError) as raised:
        pretrain_gpt_in_process(argv=argv + ["--save-interval", "1", "--async-save"], iteration_hook=hook)
    path = ckpt / "iter_0000002"
    assert (
        str(raised.value)
        == f"saving checkpoint {path} failed: FileExistsError: [Errno 17] File exists: '{path}'"
    )
    assert seen == [1, 2]  # iteration 3's check raised, before its hook
    assert _load_every_rank(ckpt, 1) == 1


# --------------------------------------------------------------------------------------------------
# What held before these changes, checked again (slow: pytest -m slow tests/e2e/test_faults.py)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("saving", [[], ["--async-save"]], ids=["sync", "async"])
def test_kill_9_of_a_worker_during_saves_always_leaves_a_loadable_checkpoint(data, tmp_path, saving):
    """Four times: SIGKILL one worker at a random moment of a run that saves every iteration (with
    --async-save: while a write is in flight, or being committed, most of the time)."""
    rng = random.Random(10)
    flags = _endless_pp2(data)
    for attempt in range(4):
        ckpt = tmp_path / f"ckpt{attempt}"
        job = Job(2, flags + ["--save", str(ckpt), "--save-interval", "1", *saving], env=job_env())
        try:
            job.wait_for(f" iteration {rng.randint(3, 6):8d}/", timeout=240)  # 1 is committed
            time.sleep(rng.uniform(0, 0.15))
            victim = rng.choice(sorted(job.workers().values()))
            os.kill(victim, signal.SIGKILL)
            output = job.finish(timeout=60)
        finally:
            job.kill()
        assert job.proc.returncode == 1, output[-3000:]
        iteration = _load_every_rank(ckpt, 2)
        partial = sorted(p.name for p in ckpt.glob("iter_*") if int(p.name[5:]) > iteration)
        print(f"attempt {attempt}: checkpoint {iteration} loads; uncommitted after it: {partial}")


@pytest.mark.slow
def test_resuming_after_kill_9_of_torchrun_repeats_the_uninterrupted_run(data, tmp_path):
    """Dropout on: the resumed run logs the uninterrupted run's losses, digit for digit."""
    flags = TINY + [
        "--pipeline-model-parallel-size", "2",
        "--train-iters", "12",
        "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1",
        "--data-path", str(data),
    ]  # fmt: skip
    straight = Job(2, flags, env=job_env())
    expected = losses(straight.finish(timeout=300))
    assert sorted(expected) == list(range(1, 13))
    ckpt = tmp_path / "ckpt"
    job = Job(2, flags + ["--save", str(ckpt), "--save-interval", "1"], env=job_env())
    try:
        job.wait_for(" iteration        6/", timeout=240)
        workers = job.workers()
        os.kill(job.proc.pid, signal.SIGKILL)
        while any(alive(pid) for pid in workers.values()):
            time.sleep(0.05)
    finally:
        job.kill()
    resumed_at = read_tracker(str(ckpt))
    resumed = Job(2, flags + ["--load", str(ckpt)], env=job_env())
    output = resumed.finish(timeout=300)
    assert f"loaded checkpoint {ckpt} at iteration {resumed_at}" in output, output[-3000:]
    assert losses(output) == {i: expected[i] for i in range(resumed_at + 1, 13)}

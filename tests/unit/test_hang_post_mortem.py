"""A hang's post-mortem without processes: where a rank is in its table and the message it waits for
(``core/pipeline_parallel/position.py``), and the summary line that follows the waits from rank to rank
to the one holding the others up (``core.watchdog.summarize_waits``).

The mailbox is a real one on links with no process group behind them; its posted receives hold real
``torch.distributed`` work objects, made from futures the test completes.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from core import flight_recorder
from core.pipeline_parallel.actions import Action, ActionKind
from core.pipeline_parallel.links import PipelineLinks
from core.pipeline_parallel.mailbox import Mailbox
from core.pipeline_parallel.messages import input_message, output_message
from core.pipeline_parallel.placement import Placement, V
from core.pipeline_parallel.position import SchedulePosition, Wait
from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE
from core.pipeline_parallel.schedules import complete_tables
from core.watchdog import Heartbeat, Watchdog, summarize_waits

GLOBAL_RANKS = [4, 6]  # pipeline ranks 0 and 1 are global ranks 4 and 6


def _mailbox(pp_rank: int, placement: Placement) -> Mailbox:
    links = PipelineLinks(pp_rank, GLOBAL_RANKS, groups={})
    return Mailbox(
        pp_rank=pp_rank,
        placement=placement,
        links=links,
        shape=(1,),
        dtype=torch.float32,
        variable_shapes=False,
        record=None,
    )


@contextlib.contextmanager
def _waiting(mailbox: Mailbox, action: Action):
    """``action``'s input is posted and the mailbox waits for it (on a thread, as the main thread of a
    rank would) until the block ends: then the receive completes and the mailbox hands the input over."""
    future = torch.futures.Future()
    message = input_message(action, mailbox.pp_rank, mailbox.placement)
    mailbox.inbox[message] = (torch.zeros(1), _create_work_from_future(future))
    waiter = threading.Thread(target=mailbox.input_of, args=(action,))
    waiter.start()
    try:
        while mailbox.waiting is None:
            time.sleep(0.001)
        yield
    finally:
        future.set_result([torch.zeros(1)])
        waiter.join()


def test_the_position_names_the_running_action_and_the_message_it_waits_for():
    table = list(complete_tables(DEFAULT_SCHEDULE, 2, 1, 4)[0])
    mailbox, position = _mailbox(0, Placement(2)), SchedulePosition()
    assert str(position) == "no schedule run yet" and position.as_dict() is None
    position.begin(table, mailbox)
    assert str(position) == "schedule starting (16 actions)" and position.waits_for() is None
    assert position.as_dict()["running"] is None and position.as_dict()["last_finished"] is None
    position.index = 5  # 0B0: its gradient comes from pipeline rank 1 (global rank 6)
    assert table[5] == Action(ActionKind.B, 0, 0)
    assert str(position) == "schedule action 6 of 16: 0B0 (backward of microbatch 0, chunk 0)"
    assert position.waits_for() is None  # not waiting (yet): computing
    with _waiting(mailbox, table[5]):
        assert position.waits_for() == Wait(peer=6, kind="gradient", microbatch=0, chunk=0, peer_chunk=0)
        assert position.waiting_on() == (6, "backward of microbatch 0, chunk 0")
        dumped = position.as_dict()
    assert position.waits_for() is None  # the gradient is in: the backward computes
    assert dumped["table"] == [str(action) for action in table]
    assert dumped["running"] == {"index": 5, "action": "0B0", "what": "backward of microbatch 0, chunk 0"}
    assert dumped["last_finished"] == {"index": 4, "action": "0SEND_F1"}
    assert dumped["waits_for"] == {
        "peer_rank": 6,
        "direction": "backward",
        "message": "gradient",
        "microbatch": 0,
        "chunk": 0,
        "peer_chunk": 0,
        "sending": False,
        "awaited": "rank 6's backward of microbatch 0, chunk 0",
    }
    position.index = len(table)
    assert str(position) == "schedule done (16 actions): sends completing, gradient reductions"
    assert position.as_dict()["last_finished"] == {"index": 15, "action": "0B3"}
    assert position.as_dict()["running"] is None


def test_a_rank_done_with_its_table_waits_for_its_sends_to_be_received():
    """Pipeline rank 1 (global 6) has run its whole table; its last gradient send, to pipeline rank 0
    (global 4), is not received yet: it waits for rank 4 to receive it, and the summary says so."""
    table = list(complete_tables(DEFAULT_SCHEDULE, 2, 1, 4)[1])
    mailbox, position = _mailbox(1, Placement(2)), SchedulePosition()
    position.begin(table, mailbox)
    position.index = len(table)
    future = torch.futures.Future()
    message = output_message(Action(ActionKind.B, 3, 0), 1, mailbox.placement)
    mailbox.sends.append((_create_work_from_future(future), message))
    finishing = threading.Thread(target=mailbox.finish)
    finishing.start()
    try:
        while mailbox.sending is None:
            time.sleep(0.001)
        wait = position.waits_for()
        waiting_on, dumped = position.waiting_on(), position.as_dict()["waits_for"]
    finally:
        future.set_result([torch.zeros(1)])
        finishing.join()
    assert wait == Wait(peer=4, kind="gradient", microbatch=3, chunk=0, peer_chunk=0, sending=True)
    assert waiting_on == (4, "gradient of microbatch 3, chunk 0", "send")
    assert dumped["awaited"] == "rank 4 to receive this rank's gradient of microbatch 3, chunk 0"
    assert dumped["sending"] is True and position.waits_for() is None and mailbox.sends == []
    beat = Heartbeat(1, "forward-backward", 6, 0.0, waiting_on)
    assert Heartbeat.decode(beat.encode().encode()) == beat
    beats = {
        0: _beat(6),
        1: _beat(6),
        2: Heartbeat(1, "forward-backward", 6, 0.0, (0, waiting_on[1], "send")),
        3: _beat(6),
    }
    assert summarize_waits(beats) == (
        "rank 2 waits for its sends to rank 0 to be received (gradient of microbatch 3, chunk 0 at iteration 6) "
        "(ranks 1,3 wait for no pipeline message)"
    )
    beats[1] = _beat(6, (0, "forward of microbatch 3, chunk 0"))
    beats[3] = _beat(6, (2, "backward of microbatch 0, chunk 0"))  # waits on a sender: held up by rank 0 too
    assert summarize_waits(beats) == (
        "ranks 1,3 wait on rank 0's forward of microbatch 3, chunk 0 at iteration 6; rank 2 waits for its sends "
        "to rank 0 to be received (gradient of microbatch 3, chunk 0 at iteration 6)"
    )


def test_the_awaited_action_is_in_the_senders_chunk():
    """The V (ZBV): rank 0's chunk 1 (the last stage) takes its input from rank 1's chunk 1."""
    mailbox, position = _mailbox(0, Placement(2, 2, V)), SchedulePosition()
    table = [Action(ActionKind.RECV_F, 2, 1), Action(ActionKind.F, 2, 1)]
    position.begin(table, mailbox)
    position.index = 1
    with _waiting(mailbox, table[1]):
        assert position.waits_for() == Wait(peer=6, kind="activation", microbatch=2, chunk=1, peer_chunk=1)
        assert position.waiting_on() == (6, "forward of microbatch 2, chunk 1")


def test_each_table_begun_is_progress_and_calls_back():
    begun: list[SchedulePosition] = []
    position = SchedulePosition(on_begin=begun.append)
    mailbox, table = _mailbox(0, Placement(2)), list(complete_tables(DEFAULT_SCHEDULE, 2, 1, 4)[0])
    position.begin(table, mailbox)
    first = position.progress()
    position.index = 0
    assert position.progress() != first
    position.index = len(table)
    done = position.progress()
    position.begin(table, mailbox)
    assert begun == [position, position] and position.progress() not in (first, done)


def test_the_watchdog_counts_a_moving_index_as_progress_and_beats_the_wait():
    """The main thread only stores the index; the watchdog's thread sees it move at its next tick."""
    dog = Watchdog(dist.HashStore(), 4, 2, 60.0, on_silent=print, interval=5.0)
    table = list(complete_tables(DEFAULT_SCHEDULE, 2, 1, 4)[0])
    mailbox, position = _mailbox(0, Placement(2)), SchedulePosition(on_begin=dog.at)
    dog.enter("forward-backward", 3)
    position.begin(table, mailbox)
    position.index = 5
    time.sleep(0.2)
    dog._note_progress()  # the tick: the index moved since the table began
    assert dog.waited() >= 0.2  # progress at the earliest since the previous tick
    time.sleep(0.2)
    dog._note_progress()  # nothing moved
    assert dog.waited() >= 0.4
    position.index = 6
    dog._note_progress()
    assert dog.waited() < 0.2
    position.index = 9  # 0B1, waiting for its gradient
    with _waiting(mailbox, table[9]):
        beat = Heartbeat.decode(dog._own_beat().encode().encode())
    assert beat.phase == "forward-backward, schedule action 10 of 16: 0B1 (backward of microbatch 1, chunk 0)"
    assert beat.waiting_on == (6, "backward of microbatch 1, chunk 0") and beat.iteration == 3


def _beat(iteration: int | None, waiting_on: tuple[int, str] | None = None) -> Heartbeat:
    return Heartbeat(1, "forward-backward", iteration, 0.0, waiting_on)


def test_the_summary_follows_the_waits_to_the_rank_that_holds_everyone_up():
    beats = {
        0: _beat(5, (1, "backward of microbatch 0, chunk 0")),
        1: _beat(5, (2, "backward of microbatch 0, chunk 0")),
        2: _beat(5, (3, "forward of microbatch 3, chunk 1")),
        3: _beat(5),
    }
    assert (
        summarize_waits(beats)
        == "ranks 0,1,2 wait on rank 3's forward of microbatch 3, chunk 1 at iteration 5"
    )
    beats[4] = _beat(5)  # waits in a collective
    beats[3] = _beat(5, (0, "a stale wait"))  # silent: its last beat does not count
    assert summarize_waits(beats, silent=[3]) == (
        "ranks 0,1,2 wait on rank 3's forward of microbatch 3, chunk 1 at iteration 5 (rank 4 waits for no "
        "pipeline message)"
    )


WAITS = {  # case: (each rank's last beat, the silent ranks, the summary)
    "two actions awaited from the holding rank": (
        {
            0: _beat(7, (2, "backward of microbatch 1, chunk 0")),
            1: _beat(7),
            2: _beat(7),
            3: _beat(7, (2, "forward of microbatch 4, chunk 0")),
        },
        [2],
        (
            "ranks 0,3 wait on rank 2's backward of microbatch 1, chunk 0 and forward of microbatch 4, "
            "chunk 0 at iteration 7 (rank 1 waits for no pipeline message)"
        ),
    ),
    "the same rank awaited at two iterations": (
        {
            0: _beat(4, (2, "backward of microbatch 1, chunk 0")),
            1: _beat(5, (2, "forward of microbatch 0, chunk 0")),
        },
        [],
        (
            "ranks 0,1 wait on rank 2's backward of microbatch 1, chunk 0 at iteration 4 and forward of "
            "microbatch 0, chunk 0 at iteration 5"
        ),
    ),
    "a circle": (
        {
            0: _beat(2, (1, "forward of microbatch 0, chunk 0")),
            1: _beat(2, (0, "backward of microbatch 0, chunk 0")),
        },
        [],
        (
            "ranks 0,1 wait on each other in a circle (rank 0 on rank 1's forward of microbatch 0, chunk 0 "
            "at iteration 2, rank 1 on rank 0's backward of microbatch 0, chunk 0 at iteration 2)"
        ),
    ),
    "no wait": (
        {0: _beat(2), 1: _beat(2)},
        [],
        "no rank waits for a pipeline message (each rank's flight recorder lists its collectives)",
    ),
}


@pytest.mark.parametrize("case", list(WAITS))
def test_the_summary_names_every_action_awaited_from_the_holding_rank_circles_and_no_wait(case):
    beats, silent, summary = WAITS[case]
    assert summarize_waits(beats, silent=silent) == summary


def test_a_heartbeat_without_a_wait_reads_back():
    assert Heartbeat.decode(b'[3, "done", null, 1.5]') == Heartbeat(3, "done", None, 1.5, None)
    beat = _beat(4, (1, "forward of microbatch 0, chunk 0"))
    assert Heartbeat.decode(beat.encode().encode()) == beat


def test_the_summary_takes_the_beat_a_rank_failed_in_over_its_last_done_beat():
    """A rank that timed out writes its post-mortem, then stops its watchdog (a ``done`` beat): the
    reporter's summary reads the beat it had when it wrote the post-mortem."""
    store = dist.HashStore()
    dog = Watchdog(store, 0, 3, 60.0, on_silent=print, interval=5.0)
    dog.enter("forward-backward", 3)
    store.set("trident/heartbeat/1", Heartbeat(9, "done", None, 0.0).encode())
    store.set("trident/heartbeat/2", _beat(3).encode())
    failed = {1: _beat(3, (2, "forward of microbatch 0, chunk 0"))}
    assert (
        dog.summary([])
        == "hang summary: no rank waits for a pipeline message (each rank's flight recorder lists its collectives)"
    )
    assert dog.summary([], failed) == (
        "hang summary: rank 1 waits on rank 2's forward of microbatch 0, chunk 0 at iteration 3 (rank 0 waits "
        "for no pipeline message)"
    )


def _dump(*collectives: tuple[str, int]) -> dict:
    """A rank's dump whose recorder holds ``(process group, collective number)`` in the order made."""
    entries = [
        {"record_id": i, "process_group": [group, ""], "collective_seq_id": seq, "profiling_name": "gloo:all_reduce",
         "is_p2p": False}
        for i, (group, seq) in enumerate(collectives)
    ]  # fmt: skip
    return {"flight_recorder": {"entries": entries}}


def test_when_every_rank_waits_in_a_collective_the_dumps_name_the_rank_that_has_not_entered_it():
    """PP2 x DP2 as a hang at the optimizer leaves it: rank 3 has not entered the default group's
    collective 29 that ranks 0,1,2 wait in. Then a chain: rank 3 waits in group 22 for rank 1, which
    waits in group 1 for rank 0, as rank 2 does in group 21: all three wait on rank 0."""
    level = [("21", 5), ("0", 28)]
    dumps = {
        0: _dump(*level, ("0", 29)),
        1: _dump(*level, ("0", 29)),
        2: _dump(*level, ("0", 29)),
        3: _dump(*level),
    }
    assert flight_recorder.not_entered(dumps) == (
        "ranks 0,1,2 wait on rank 3, which has not entered gloo:all_reduce #29 of process group 0"
    )
    chained = {
        0: _dump(("1", 5), ("21", 5)),
        1: _dump(("1", 5), ("22", 5), ("22", 6), ("1", 6)),
        2: _dump(("21", 5), ("21", 6)),
        3: _dump(("22", 5), ("22", 6), ("22", 7)),
    }
    assert flight_recorder.not_entered(chained) == (
        "ranks 1,2,3 wait on rank 0, which has not entered gloo:all_reduce #6 of process group 1 and "
        "gloo:all_reduce #6 of process group 21"
    )
    assert flight_recorder.not_entered({0: _dump(*level), 1: _dump(*level)}) is None

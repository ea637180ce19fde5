"""Lowering: compute tables become complete tables, with every send and receive an explicit action.

A compute table says what each rank computes; the complete table also says when each message is
posted. For every compute action whose output goes to a stage on another rank, ``SEND_F`` (an
activation) or ``SEND_B`` (an input gradient) follows it at once: sends never wait. For every
compute action whose input comes from another rank, ``RECV_F`` or ``RECV_B`` is placed
``lookahead`` compute actions ahead of it, so the data can arrive while the rank computes.

Links. Messages travel on directed links (source rank -> destination rank), one two-rank group
each. On every link the receiver posts its receives in exactly the order the sender posts the
sends (it can, since it can build the sender's table): a receive that the sender sends earlier
than another is moved ahead of it. NCCL runs a group's operations in order, so on its own link a
message waits only for the messages before it, in the order both ends agree on; and activations and
gradients between the same two ranks can never be confused.

Variable sequence lengths. An activation's shape travels first, and its data receive can only be
posted once the shape has arrived; so with ``variable_shapes`` a receive waits for its shape where
it stands, and is placed right before its consumer (lookahead 1) where that wait costs nothing new.

Messages between two chunks of one rank (PP=1 with virtual stages; ZBV's turn at the bottom of the
V) need no action: the executor hands them over locally.
"""

from __future__ import annotations

from collections import defaultdict

from core.pipeline_parallel.actions import COMPUTE, SENDS, Action, ActionKind, B, F, I, TableError
from core.pipeline_parallel.messages import (
    Link,
    Message,
    input_message,
    is_remote,
    link_of,
    message_of,
    output_message,
)
from core.pipeline_parallel.placement import Placement

_SEND_OF = {F: ActionKind.SEND_F, B: ActionKind.SEND_B, I: ActionKind.SEND_B}
_RECV_OF = {F: ActionKind.RECV_F, B: ActionKind.RECV_B, I: ActionKind.RECV_B}


def lower(
    tables: list[list[Action]],
    placement: Placement,
    *,
    lookahead: int = 2,
    variable_shapes: bool = False,
) -> list[list[Action]]:
    """Complete tables: ``tables`` with a send after every producer and a receive ahead of every consumer.

    ``lookahead`` counts compute actions, the consumer included: 1 posts a receive right before its
    consumer, 2 (the default) before the compute action that precedes it. ``variable_shapes``
    forces 1 (see the module docstring).
    """
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1 (1 = receive right before the consumer), got {lookahead}")
    if variable_shapes:
        lookahead = 1
    sends = [_with_sends(table, rank, placement) for rank, table in enumerate(tables)]
    link_order = _link_order(sends, placement)
    return [_with_receives(sends[r], r, placement, link_order, lookahead) for r in range(len(tables))]


def _with_sends(table: list[Action], rank: int, placement: Placement) -> list[Action]:
    out: list[Action] = []
    for action in table:
        out.append(action)
        if action.kind in _SEND_OF and is_remote(output_message(action, rank, placement), placement):
            out.append(Action(_SEND_OF[action.kind], action.microbatch, action.chunk))
    return out


def _link_order(tables: list[list[Action]], placement: Placement) -> dict[Link, dict[Message, int]]:
    """Every link's messages, numbered in the order the sender posts them."""
    order: dict[Link, dict[Message, int]] = defaultdict(dict)
    for rank, table in enumerate(tables):
        for action in table:
            if action.kind in SENDS:
                message = message_of(action, rank, placement)
                position = order[link_of(message, placement)]
                position[message] = len(position)
    return order


def _with_receives(
    table: list[Action],
    rank: int,
    placement: Placement,
    link_order: dict[Link, dict[Message, int]],
    lookahead: int,
) -> list[Action]:
    """Insert this rank's receives: each ``lookahead`` computes ahead, in every link's send order."""
    computes = [a for a in table if a.kind in COMPUTE]
    wanted: dict[Message, tuple[int, Action]] = {}  # message -> (slot, its receive action)
    for index, action in enumerate(computes):
        message = input_message(action, rank, placement) if action.kind in _RECV_OF else None
        if is_remote(message, placement):
            receive = Action(_RECV_OF[action.kind], action.microbatch, action.chunk)
            wanted[message] = (max(0, index - lookahead + 1), receive)
    slots: dict[Message, int] = {}
    position_of: dict[Message, int] = {}
    for link, positions in link_order.items():
        if link[1] != rank:
            continue
        earliest = len(computes)
        for message in sorted(positions, key=positions.get, reverse=True):  # a link's receives in order
            earliest = min(earliest, wanted[message][0])
            slots[message] = earliest
        position_of.update(positions)
    by_slot: dict[int, list[Action]] = defaultdict(list)
    for message in sorted(slots, key=lambda m: (slots[m], placement.rank(m.src_stage), position_of[m])):
        by_slot[slots[message]].append(wanted[message][1])
    out: list[Action] = []
    index = 0
    for action in table:
        if action.kind in COMPUTE:
            out += by_slot.pop(index, [])
            index += 1
        out.append(action)
    return out


def validate(tables: list[list[Action]], placement: Placement) -> None:
    """Check complete tables; raises :class:`TableError` naming the first problem, the grid below it.

    Every remote input has its receive earlier on the consumer's rank; every message is sent once
    and received once; on every link the receives come in the order of the sends.
    """
    sent: dict[Link, list[Message]] = defaultdict(list)
    received: dict[Link, list[tuple[Message, int]]] = defaultdict(list)  # (message, step of its receive)
    for rank, table in enumerate(tables):
        posted: set[Message] = set()
        for step, action in enumerate(table):
            if action.kind in COMPUTE:
                needed = input_message(action, rank, placement) if action.kind in _RECV_OF else None
                if is_remote(needed, placement) and needed not in posted:
                    problem = f"rank {rank} step {step}: {action} runs before its receive of {needed}"
                    raise TableError(problem, tables, {rank: step})
                continue
            message = message_of(action, rank, placement)
            if message is None or not is_remote(message, placement):
                raise TableError(
                    f"rank {rank} step {step}: {action} has no message to another rank", tables, {rank: step}
                )
            if action.kind in SENDS:
                sent[link_of(message, placement)].append(message)
            else:
                received[link_of(message, placement)].append((message, step))
            posted.add(message)
    for link in sent.keys() | received.keys():
        receives = [message for message, _ in received[link]]
        if sent[link] != receives:
            first = next(
                (step for (message, step), want in zip(received[link], sent[link]) if message != want),
                received[link][-1][1] if received[link] else None,
            )
            raise TableError(
                f"link {link[0]} -> {link[1]}: receives {receives} do not match the sends {sent[link]}",
                tables,
                {} if first is None else {link[1]: first},
            )

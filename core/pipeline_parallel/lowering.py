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
from typing import NamedTuple

from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.schedule_tables import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
)

ACTIVATION, GRADIENT = "activation", "gradient"  # the two kinds of pipeline message

_SEND_OF = {F: SEND_F, B: SEND_B, I: SEND_B}
_RECV_OF = {F: RECV_F, B: RECV_B, I: RECV_B}


class Message(NamedTuple):
    """One tensor between two stages: an activation going forward or a gradient coming back."""

    kind: str
    microbatch: int
    src_stage: int
    dst_stage: int


Link = tuple[int, int]  # (source pp rank, destination pp rank)


_FORWARD = frozenset((F, SEND_F, RECV_F))
_BACKWARD = frozenset((B, I, SEND_B, RECV_B))


def output_message(action: Action, pp_rank: int, placement: Placement) -> Message | None:
    """What ``action`` produces for another stage (an F's activation, a B's or I's input gradient)."""
    kind, stage = action.kind, placement.stage(pp_rank, action.chunk)
    if kind in _FORWARD and stage < placement.num_stages - 1 and kind != RECV_F:
        return Message(ACTIVATION, action.microbatch, stage, stage + 1)
    if kind in _BACKWARD and stage > 0 and kind != RECV_B:
        return Message(GRADIENT, action.microbatch, stage, stage - 1)
    return None


def input_message(action: Action, pp_rank: int, placement: Placement) -> Message | None:
    """What ``action`` needs from another stage (an F's input, a B's or I's output gradient)."""
    kind, stage = action.kind, placement.stage(pp_rank, action.chunk)
    if kind in _FORWARD and stage > 0 and kind != SEND_F:
        return Message(ACTIVATION, action.microbatch, stage - 1, stage)
    if kind in _BACKWARD and stage < placement.num_stages - 1 and kind != SEND_B:
        return Message(GRADIENT, action.microbatch, stage + 1, stage)
    return None


def message_of(action: Action, pp_rank: int, placement: Placement) -> Message:
    """The message a communication action sends or receives."""
    if action.kind in (SEND_F, SEND_B):
        return output_message(action, pp_rank, placement)
    return input_message(action, pp_rank, placement)


def link_of(message: Message, placement: Placement) -> Link:
    return placement.rank(message.src_stage), placement.rank(message.dst_stage)


def is_remote(message: Message | None, placement: Placement) -> bool:
    """Whether the message goes to another rank (messages between chunks of one rank stay local)."""
    return message is not None and placement.rank(message.src_stage) != placement.rank(message.dst_stage)


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
            if action.kind in (SEND_F, SEND_B):
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
    """Check complete tables; raises ``ValueError`` naming the first problem.

    Every remote input has its receive earlier on the consumer's rank; every message is sent once
    and received once; on every link the receives come in the order of the sends.
    """
    sent: dict[Link, list[Message]] = defaultdict(list)
    received: dict[Link, list[Message]] = defaultdict(list)
    for rank, table in enumerate(tables):
        posted: set[Message] = set()
        for step, action in enumerate(table):
            if action.kind in COMPUTE:
                needed = input_message(action, rank, placement) if action.kind in _RECV_OF else None
                if is_remote(needed, placement) and needed not in posted:
                    raise ValueError(f"rank {rank} step {step}: {action} runs before its receive of {needed}")
                continue
            message = message_of(action, rank, placement)
            if message is None or not is_remote(message, placement):
                raise ValueError(f"rank {rank} step {step}: {action} has no message to another rank")
            is_send = action.kind in (SEND_F, SEND_B)
            (sent if is_send else received)[link_of(message, placement)].append(message)
            posted.add(message)
    for link in sent.keys() | received.keys():
        if sent[link] != received[link]:
            raise ValueError(
                f"link {link[0]} -> {link[1]}: receives {received[link]} do not match the sends {sent[link]}"
            )

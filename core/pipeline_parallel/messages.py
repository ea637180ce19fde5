"""The pipeline's messages: what goes between two stages, on which link, for which action.

A message is an activation going forward or an input gradient coming back, between two stages;
its link is the pair of pipeline ranks those stages run on. Lowering places the sends and
receives of messages, the transport posts them on their link, the mailbox hands over the ones
between two chunks of one rank, and the simulator replays them.
"""

from __future__ import annotations

from typing import NamedTuple

from core.pipeline_parallel.actions import RECV_B, RECV_F, SEND_B, SEND_F, SENDS, Action, B, F, I
from core.pipeline_parallel.placement import Placement

ACTIVATION, GRADIENT = "activation", "gradient"  # the two kinds of pipeline message


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
    if action.kind in SENDS:
        return output_message(action, pp_rank, placement)
    return input_message(action, pp_rank, placement)


def link_of(message: Message, placement: Placement) -> Link:
    return placement.rank(message.src_stage), placement.rank(message.dst_stage)


def is_remote(message: Message | None, placement: Placement) -> bool:
    """Whether the message goes to another rank (messages between chunks of one rank stay local)."""
    return message is not None and placement.rank(message.src_stage) != placement.rank(message.dst_stage)

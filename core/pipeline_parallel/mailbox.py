"""A rank's pipeline messages while it runs its table: outputs waiting for their send, posted receives.

The executor's handlers speak in actions; the mailbox turns an action into its message (which
stage sends what to which, :mod:`~core.pipeline_parallel.lowering`) and posts it on its link
(:class:`~core.pipeline_parallel.p2p_communication.PipelineLinks`). A compute action leaves its output
here and the ``SEND`` that follows it posts it; a ``RECV`` posts a receive into a fresh buffer and the
compute action that needs it waits for it. Messages between two chunks of this rank are handed over
here without communication.

Variable sequence lengths: an activation's shape travels first as a small int64 message, and its
receive waits for the shape before posting the data; a gradient has the shape of the activation
this rank sent for the same microbatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.device import current_device
from core.pipeline_parallel.actions import Action
from core.pipeline_parallel.links import PipelineLinks
from core.pipeline_parallel.messages import ACTIVATION, GRADIENT, Message, input_message, output_message
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.record import Event, ScheduleRecord


class PipelineShapeError(ValueError):
    """A stage sent a tensor whose shape or dtype is not the one the schedule was given."""


class Mailbox:
    """This rank's messages: outputs waiting for their SEND, posted receives, local hand-overs."""

    def __init__(
        self,
        *,
        pp_rank: int,
        placement: Placement,
        links: PipelineLinks | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        variable_shapes: bool,
        record: ScheduleRecord | None,
        shape_origin: str = "",
    ):
        self.pp_rank, self.placement, self.links, self.record = pp_rank, placement, links, record
        self.shape, self.dtype, self.variable = shape, dtype, variable_shapes
        self.shape_origin = shape_origin
        self.device = current_device()
        self.outbox: dict[Message, torch.Tensor] = {}
        self.inbox: dict[Message, tuple[torch.Tensor, dist.Work | None]] = {}
        self.sent_shapes: dict[tuple[int, int], tuple[int, ...]] = {}  # (microbatch, stage) -> shape
        self.sends: list[tuple[dist.Work, Message]] = []
        self.waiting: Message | None = None
        """The message whose receive this rank waits for now (still set if the wait failed): what a
        post-mortem reads (:mod:`~core.pipeline_parallel.position`)."""
        self.sending: Message | None = None
        """The message whose send this rank waits to complete (its receive posted by the peer), at the
        table's end (:meth:`finish`); still set if the wait failed. Read as ``waiting`` is."""
        if links is not None:
            links.record = self._log_post if record is not None else None

    # -- what the compute handlers need ---------------------------------------------------------
    def input_of(self, action: Action) -> torch.Tensor | None:
        """The tensor ``action`` consumes (an F's input, a B's or I's output gradient); None if the
        stage has no such input (the first stage's F, the last stage's backward)."""
        message = input_message(action, self.pp_rank, self.placement)
        if message is None:
            return None
        tensor, work = self.inbox.pop(message)
        if work is not None:
            self._wait(work, (message, "data"))
        return tensor

    def output_of(self, action: Action, tensor: torch.Tensor | None) -> None:
        """What ``action`` produced for the next (F) or previous (B, I) stage: kept for its SEND, or
        handed straight to this rank's chunk that needs it."""
        message = output_message(action, self.pp_rank, self.placement)
        if message is None:
            return
        tensor = tensor.detach()
        if self.placement.rank(message.dst_stage) != self.pp_rank:
            self.outbox[message] = tensor.contiguous()
        else:
            self.inbox[message] = (tensor, None)

    # -- the communication actions --------------------------------------------------------------
    def send(self, action: Action) -> None:
        message = output_message(action, self.pp_rank, self.placement)
        tensor = self.outbox.pop(message)
        if not self.variable and (tensor.shape != self.shape or tensor.dtype != self.dtype):
            raise PipelineShapeError(self._mismatch(message, tensor))
        peer = self.placement.rank(message.dst_stage)
        if message.kind == ACTIVATION and self.variable:  # its shape goes first
            self.sent_shapes[(message.microbatch, message.src_stage)] = tuple(tensor.shape)
            shape = torch.tensor(tensor.shape, dtype=torch.int64, device=self.device)
            work = self.links.post(True, peer, shape, message.kind, "shape", (message, "shape"))
            self.sends.append((work, message))
        self.sends.append(
            (self.links.post(True, peer, tensor, message.kind, "data", (message, "data")), message)
        )

    def receive(self, action: Action) -> None:
        """Post the receive (with variable lengths: receive the shape first and wait for it)."""
        message = input_message(action, self.pp_rank, self.placement)
        peer = self.placement.rank(message.src_stage)
        shape = self.shape
        if message.kind == GRADIENT and self.variable:  # it has the shape of the activation sent
            shape = self.sent_shapes.get((message.microbatch, message.dst_stage))
            if shape is None:
                raise RuntimeError(
                    f"schedule error: receive of {message} posted before its activation was sent"
                )
        elif self.variable:
            buffer = torch.empty(len(self.shape), dtype=torch.int64, device=self.device)
            work = self.links.post(False, peer, buffer, message.kind, "shape", (message, "shape"))
            self._wait(work, (message, "shape"))
            shape = tuple(buffer.tolist())
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        work = self.links.post(False, peer, buffer, message.kind, "data", (message, "data"))
        self.inbox[message] = (buffer, work)

    def finish(self) -> None:
        """Wait until every send has completed (its buffer may then be freed)."""
        for work, message in self.sends:
            self.sending = message
            work.wait()
        self.sending = None
        self.sends.clear()

    def _mismatch(self, message: Message, tensor: torch.Tensor) -> str:
        """Fixed shapes: both sides size their buffers from the schedule's arguments, and gloo would
        accept a short message into a larger buffer (garbage) or abort on a longer one, so say it here."""
        what = "activation" if message.kind == ACTIVATION else "gradient"
        origin = f" ({self.shape_origin})" if self.shape_origin else ""
        return (
            f"pipeline stage {message.src_stage} sends the {what} of microbatch {message.microbatch} to "
            f"stage {message.dst_stage} with shape {tuple(tensor.shape)} and dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}, but the schedule expects shape {tuple(self.shape)} "
            f"and dtype {str(self.dtype).removeprefix('torch.')}{origin}: give the seq_length and "
            "micro_batch_size the model really uses (or variable_seq_lengths=True)"
        )

    def _wait(self, work: dist.Work, key: tuple) -> None:
        self.waiting = key[0]
        if self.record is None:
            work.wait()
            self.waiting = None
            return
        self.record.comm_log.append(("wait", key))
        start = self.record.clock.now()
        work.wait()
        self.waiting = None
        message = key[0]
        kind = "WAIT_F" if message.kind == ACTIVATION else "WAIT_B"
        chunk = self.placement.rank_and_chunk(message.dst_stage)[1]
        self.record.events.append(Event(kind, message.microbatch, chunk, start, self.record.clock.now()))

    def _log_post(self, link, is_send, peer, key) -> None:
        self.record.comm_log.append(("post", link, [(is_send, peer, key)]))

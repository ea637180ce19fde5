"""The one executor: a plain interpreter of complete tables.

A complete table (:mod:`~core.pipeline_parallel.lowering`) lists everything a rank does, in order:
compute (``F`` forward, ``B`` backward, or its halves ``I`` input gradient and ``W`` weight
gradient) and communication (post a send, post a receive). :func:`run_table` hands each action to
the small handler of its kind; nothing is decided at run time that the table does not say. A
handler gets only what it needs: a stage (one model chunk's forward and backward), the mailbox
(messages in and out), the losses, the gradient-sync hooks.

Sends never block: a compute action leaves its output in the mailbox and the ``SEND`` that follows
posts it. Receives are posted where the table says and waited for by the action that needs them.
Messages between two chunks of this rank go through the mailbox without communication.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from core.device import current_device
from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from core.pipeline_parallel.hooks import ScheduleHooks, ScheduleSettings
from core.pipeline_parallel.losses import LossLogs, parse_loss
from core.pipeline_parallel.lowering import (
    ACTIVATION,
    GRADIENT,
    Message,
    input_message,
    is_remote,
    output_message,
)
from core.pipeline_parallel.p2p_communication import PipelineLinks
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.schedule_tables import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ActionKind,
    B,
    F,
    I,
    W,
)


class Event(NamedTuple):
    """One timed thing a rank did: a table action (``kind`` its name), or a wait for a received message
    (``WAIT_F`` an activation, ``WAIT_B`` a gradient; ``chunk`` the one that needs it)."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class ScheduleRecord:
    """What a run did, for tests, timelines and benchmarks (pass one in to have it filled)."""

    events: list[Event] = field(default_factory=list)
    comm_log: list[tuple] = field(default_factory=list)  # as simulator.comm_logs describes
    peak_in_flight: int = 0
    num_tokens: torch.Tensor | None = None
    start: float = 0.0
    end: float = 0.0
    tables: tuple | None = None  # every rank's complete table, as run
    placement: Placement | None = None


@dataclass
class StepContext:
    """Everything a run needs besides its table; built by the Megatron-named entry points."""

    forward_step_func: Callable
    data_iterators: list[Iterator | None]
    chunks: list[torch.nn.Module]
    num_microbatches: int
    settings: ScheduleSettings
    hooks: ScheduleHooks
    tensor_shape: tuple[int, ...]
    forward_only: bool
    collect_non_loss_data: bool
    pp_rank: int
    placement: Placement
    links: PipelineLinks | None = None
    record: ScheduleRecord | None = None


# --------------------------------------------------------------------------------------------------
# Messages in and out
# --------------------------------------------------------------------------------------------------


class Mailbox:
    """This rank's messages: outputs waiting for their SEND, posted receives, local hand-overs."""

    def __init__(self, ctx: StepContext):
        self.links, self.record, self.placement = ctx.links, ctx.record, ctx.placement
        self.variable = ctx.settings.variable_seq_lengths
        self.shape, self.dtype = ctx.tensor_shape, ctx.settings.pipeline_dtype
        self.device = current_device()
        self.outbox: dict[Message, torch.Tensor] = {}
        self.inbox: dict[Message, tuple[torch.Tensor, dist.Work | None]] = {}
        self.sent_shapes: dict[
            tuple[int, int], tuple[int, ...]
        ] = {}  # (microbatch, stage) -> activation shape
        self.sends: list[dist.Work] = []
        if self.links is not None:
            self.links.record = self._log_post if self.record is not None else None

    def produce(self, message: Message, tensor: torch.Tensor, remote: bool) -> None:
        """A computed output: kept for its SEND, or handed straight to this rank's consumer."""
        tensor = tensor.detach()
        if remote:
            self.outbox[message] = tensor.contiguous()
        else:
            self.inbox[message] = (tensor, None)

    def send(self, message: Message) -> None:
        tensor = self.outbox.pop(message)
        peer = self.placement.rank(message.dst_stage)
        if message.kind == ACTIVATION and self.variable:  # its shape goes first
            self.sent_shapes[(message.microbatch, message.src_stage)] = tuple(tensor.shape)
            shape = torch.tensor(tensor.shape, dtype=torch.int64, device=self.device)
            self.sends.append(self.links.post(True, peer, shape, message.kind, "shape", (message, "shape")))
        self.sends.append(self.links.post(True, peer, tensor, message.kind, "data", (message, "data")))

    def receive(self, message: Message) -> None:
        """Post the receive (with variable lengths: receive the shape first and wait for it)."""
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
        self.inbox[message] = (
            buffer,
            self.links.post(False, peer, buffer, message.kind, "data", (message, "data")),
        )

    def take(self, message: Message) -> torch.Tensor:
        """The input ``message`` carries, waiting for it if it has not arrived."""
        tensor, work = self.inbox.pop(message)
        if work is not None:
            self._wait(work, (message, "data"))
        return tensor

    def finish(self) -> None:
        """Wait until every send has completed (its buffer may then be freed)."""
        for work in self.sends:
            work.wait()
        self.sends.clear()

    def _wait(self, work: dist.Work, key: tuple) -> None:
        if self.record is None:
            work.wait()
            return
        self.record.comm_log.append(("wait", key))
        start = time.perf_counter()
        work.wait()
        message = key[0]
        kind = "WAIT_F" if message.kind == ACTIVATION else "WAIT_B"
        chunk = self.placement.rank_and_chunk(message.dst_stage)[1]
        self.record.events.append(Event(kind, message.microbatch, chunk, start, time.perf_counter()))

    def _log_post(self, link, is_send, peer, key) -> None:
        self.record.comm_log.append(("post", link, [(is_send, peer, key)]))


# --------------------------------------------------------------------------------------------------
# One model chunk: forward and backward of its microbatches
# --------------------------------------------------------------------------------------------------


class Stage:
    """One chunk of this rank as a pipeline stage: runs its microbatches' forward and backward."""

    def __init__(self, ctx: StepContext, chunk: int):
        self.chunk, self.module = chunk, ctx.chunks[chunk]
        self.stage = ctx.placement.stage(ctx.pp_rank, chunk)
        self.is_first, self.is_last = self.stage == 0, self.stage == ctx.placement.last_stage
        self.forward_step_func, self.data = ctx.forward_step_func, ctx.data_iterators[chunk]
        self.num_chunks, self.forward_only = len(ctx.chunks), ctx.forward_only
        self.deallocate = ctx.settings.deallocate_pipeline_outputs and not self.is_last
        self.grad_scale_func = ctx.hooks.grad_scale_func
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # microbatch -> (input, output)
        self.weight_grads: dict[int, object] = {}

    def forward(self, received: torch.Tensor | None) -> tuple[torch.Tensor, Callable]:
        """Run ``forward_step_func`` on this chunk; returns (output, loss function)."""
        if received is not None and not self.forward_only:
            received.requires_grad_(True)
        if self.num_chunks > 1:
            from core import parallel_state

            parallel_state.set_virtual_pipeline_model_parallel_rank(self.chunk)
        _set_input_tensor(self.module, [received])
        with torch.no_grad() if self.forward_only else torch.enable_grad():
            output, loss_func = self.forward_step_func(self.data, self.module)
        return output, loss_func

    def keep(self, microbatch: int, received: torch.Tensor | None, output: torch.Tensor) -> None:
        """Hold what backward needs; free the output's storage once sent (backward needs its graph only)."""
        self.saved[microbatch] = (received, output)
        if self.deallocate:
            deallocate_output(output)

    def backward(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """B: the whole backward; returns the input's gradient (None on the first stage)."""
        received, output = self._pop(microbatch)
        fused_backward(output, grad)
        if received is None:
            return None
        return received.grad if received.grad is not None else torch.zeros_like(received)

    def backward_input(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """I: the input's gradient only; the weight gradients wait for W."""
        received, output = self._pop(microbatch)
        input_grad, self.weight_grads[microbatch] = backward_input(output, grad, received)
        return input_grad

    def backward_weight(self, microbatch: int) -> None:
        """W: the parameters' gradients of a microbatch whose I has run."""
        backward_weight(self.weight_grads.pop(microbatch))

    def _pop(self, microbatch: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        received, output = self.saved.pop(microbatch)
        if self.is_last and self.grad_scale_func is not None:
            output = self.grad_scale_func(output)
        return received, output


# --------------------------------------------------------------------------------------------------
# Losses and gradient-sync hooks
# --------------------------------------------------------------------------------------------------


class Losses:
    """The last stage's loss contract: scaled losses to backpropagate, logs, the step's token count."""

    def __init__(self, ctx: StepContext):
        self.num_microbatches, self.per_token = ctx.num_microbatches, ctx.settings.calculate_per_token_loss
        self.non_loss_data = ctx.collect_non_loss_data and ctx.forward_only
        self.logs = LossLogs()
        self.num_tokens = torch.zeros((), dtype=torch.int64, device=current_device())

    def apply(self, loss_func: Callable, output: torch.Tensor) -> torch.Tensor:
        result = loss_func(output)
        if self.non_loss_data:
            self.logs.append(result)
            return output
        loss = parse_loss(result, num_microbatches=self.num_microbatches, per_token=self.per_token)
        summed = loss.num_tokens is not None
        if self.logs.summed is not None and self.logs.summed != summed:
            raise TypeError("loss_func returned a 2-tuple for some microbatches and a 3-tuple for others")
        self.logs.summed = summed
        self.logs.append(loss.log)
        if summed:
            self.num_tokens += loss.num_tokens.to(self.num_tokens.device, torch.int64)
        return loss.loss


class GradSync:
    """Data-parallel reduction suspended (``no_sync``) until each chunk's last weight-gradient step.

    That step (a B, or under zero-bubble a W) runs with the suspension lifted, so buckets launch
    their reductions while it runs; ``grad_sync`` is then called as a catch-all. With one
    ``no_sync`` per chunk only that chunk's suspension is lifted; with one for all chunks it is
    lifted for each chunk's last step and restored after it while other chunks still compute.
    """

    def __init__(self, hooks: ScheduleHooks, chunks: list[torch.nn.Module], table: list[Action]):
        self.hooks, self.chunks = hooks, chunks
        self.per_chunk = isinstance(hooks.no_sync, (list, tuple))
        self.last = {a.chunk: i for i, a in enumerate(table) if a.kind in (B, W)}
        self.contexts: dict[int, object] = {}

    def suspend(self) -> None:
        for chunk in range(len(self.chunks)) if self.per_chunk else [0]:
            no_sync = self.hooks.for_chunk("no_sync", chunk)
            if no_sync is not None and chunk not in self.contexts:
                self.contexts[chunk] = context = no_sync()
                context.__enter__()

    def weight_step(self, index: int, chunk: int):
        """Context for the weight-gradient step at ``index`` of the table."""
        return _LastStep(self, chunk) if self.last.get(chunk) == index else nullcontext()

    def lift(self, chunk: int) -> None:
        context = self.contexts.pop(chunk if self.per_chunk else 0, None)
        if context is not None:
            context.__exit__(None, None, None)

    def resume(self) -> None:
        for chunk in list(self.contexts):
            self.lift(chunk)


class _LastStep:
    def __init__(self, sync: GradSync, chunk: int):
        self.sync, self.chunk = sync, chunk

    def __enter__(self) -> None:
        self.sync.lift(self.chunk)

    def __exit__(self, *exc) -> None:
        grad_sync = self.sync.hooks.for_chunk("grad_sync", self.chunk)
        if grad_sync is not None and exc[0] is None:
            grad_sync(self.sync.chunks[self.chunk].parameters())
        if not self.sync.per_chunk and self.sync.last and self.chunk != _last_chunk(self.sync.last):
            self.sync.suspend()  # one context for all chunks: other chunks still accumulate


def _last_chunk(last: dict[int, int]) -> int:
    return max(last, key=last.get)


# --------------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------------


def run_table(table: list[Action], ctx: StepContext) -> LossLogs:
    """Run this rank's complete table; returns the loss functions' logs (on the last stage)."""
    stages = [Stage(ctx, c) for c in range(len(ctx.chunks))]
    mailbox, losses = Mailbox(ctx), Losses(ctx)
    sync = GradSync(ctx.hooks, ctx.chunks, table)
    count = _InFlight()
    timers = ctx.hooks.timers
    handlers: dict[ActionKind, Callable[[int, Action], None]] = {
        F: lambda i, a: _forward(a, stages[a.chunk], ctx, mailbox, losses, count),
        B: lambda i, a: _backward(a, stages[a.chunk], ctx, mailbox, sync.weight_step(i, a.chunk), count),
        I: lambda i, a: _backward_input(a, stages[a.chunk], ctx, mailbox),
        W: lambda i, a: _backward_weight(a, stages[a.chunk], sync.weight_step(i, a.chunk), count),
        SEND_F: lambda i, a: mailbox.send(output_message(a, ctx.pp_rank, ctx.placement)),
        SEND_B: lambda i, a: mailbox.send(output_message(a, ctx.pp_rank, ctx.placement)),
        RECV_F: lambda i, a: mailbox.receive(input_message(a, ctx.pp_rank, ctx.placement)),
        RECV_B: lambda i, a: mailbox.receive(input_message(a, ctx.pp_rank, ctx.placement)),
    }
    record = ctx.record
    if record is not None:
        record.start = time.perf_counter()
    if not ctx.forward_only:
        sync.suspend()
    for index, action in enumerate(table):
        start = time.perf_counter() if record is not None else 0.0
        with _timer(timers, action.kind):
            handlers[action.kind](index, action)
        if record is not None:
            _record(record, action, start)
    mailbox.finish()
    sync.resume()
    _finish_step(ctx, losses, count)
    return losses.logs


def _record(record: ScheduleRecord, action: Action, start: float) -> None:
    """The action's event; a compute action starts once the wait for its input (its own event) ended."""
    end = time.perf_counter()
    if record.events and record.events[-1].kind.startswith("WAIT") and record.events[-1].end >= start:
        start = record.events[-1].end
    record.events.append(Event(action.kind.value, action.microbatch, action.chunk, start, end))


def _forward(action, stage: Stage, ctx: StepContext, mailbox: Mailbox, losses: Losses, count) -> None:
    message = input_message(action, ctx.pp_rank, ctx.placement)
    received = mailbox.take(message) if message is not None else None
    output, loss_func = stage.forward(received)
    if stage.is_last:
        output = losses.apply(loss_func, output)
    else:
        out = output_message(action, ctx.pp_rank, ctx.placement)
        mailbox.produce(out, output, is_remote(out, ctx.placement))
    if not ctx.forward_only:
        stage.keep(action.microbatch, received, output)
        count.add(1)


def _backward(action, stage: Stage, ctx: StepContext, mailbox: Mailbox, weight_step, count) -> None:
    grad = _output_grad(action, ctx, mailbox)
    with weight_step:
        input_grad = stage.backward(action.microbatch, grad)
    count.add(-1)
    _send_input_grad(action, ctx, mailbox, input_grad)


def _backward_input(action, stage: Stage, ctx: StepContext, mailbox: Mailbox) -> None:
    grad = _output_grad(action, ctx, mailbox)
    _send_input_grad(action, ctx, mailbox, stage.backward_input(action.microbatch, grad))


def _backward_weight(action, stage: Stage, weight_step, count) -> None:
    with weight_step:
        stage.backward_weight(action.microbatch)
    count.add(-1)


def _output_grad(action, ctx: StepContext, mailbox: Mailbox) -> torch.Tensor | None:
    message = input_message(action, ctx.pp_rank, ctx.placement)
    return mailbox.take(message) if message is not None else None


def _send_input_grad(action, ctx: StepContext, mailbox: Mailbox, input_grad: torch.Tensor | None) -> None:
    out = output_message(action, ctx.pp_rank, ctx.placement)
    if out is not None:
        mailbox.produce(out, input_grad, is_remote(out, ctx.placement))


def _finish_step(ctx: StepContext, losses: Losses, count: _InFlight) -> None:
    if ctx.record is not None:
        ctx.record.end = time.perf_counter()
        ctx.record.peak_in_flight = count.peak
        ctx.record.num_tokens = losses.num_tokens
    finalize = ctx.hooks.finalize_model_grads
    if finalize is not None and not ctx.forward_only:
        finalize(ctx.chunks, losses.num_tokens if ctx.settings.calculate_per_token_loss else None)


class _InFlight:
    """Microbatch-chunks forwarded but not yet through their weight gradients, and the peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, delta: int) -> None:
        self.now += delta
        self.peak = max(self.peak, self.now)


_NO_TIMER = nullcontext()


def _timer(timers, kind: ActionKind):
    """Megatron's timers around compute: "forward-compute" and "backward-compute"."""
    if timers is None or kind not in (F, B, I, W):
        return _NO_TIMER
    return _Timed(timers("forward-compute" if kind == F else "backward-compute", log_level=2))


class _Timed:
    def __init__(self, timer):
        self.timer = timer

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.stop()


def deallocate_output(output: torch.Tensor) -> None:
    """Free an output's storage once it has been sent: backward needs only its ``grad_fn``.

    The sent copy keeps the old storage alive until the send completes. Views are left alone
    (replacing a view's data would not free its base), and so are leaves: an empty stage returns
    its input, whose gradient is accumulated into that very tensor.
    """
    if output is not None and output._base is None and output.grad_fn is not None:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def _set_input_tensor(module: torch.nn.Module, tensors: list) -> None:
    target = module
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module  # unwrap data-parallel or other wrappers
    if not hasattr(target, "set_input_tensor"):
        raise TypeError(
            f"model chunk {type(module).__name__} has no set_input_tensor(tensors); pipeline stages "
            "need one to receive their input"
        )
    target.set_input_tensor(tensors)

"""The one executor: a plain interpreter of complete tables.

A complete table (:mod:`~core.pipeline_parallel.lowering`) lists everything a rank does, in order:
compute (``F`` forward, ``B`` backward, or its halves ``I`` input gradient and ``W`` weight
gradient) and communication (post a send, post a receive). :func:`run_table` hands each action to
the small handler of its kind; nothing is decided at run time that the table does not say. A
handler gets only what it needs: the stage (one model chunk's forward and backward), the mailbox
(messages in and out, :mod:`~core.pipeline_parallel.mailbox`), the losses, the gradient-sync step,
the in-flight count.

Sends never block: a compute action leaves its output in the mailbox and the ``SEND`` that follows
posts it. Receives are posted where the table says and waited for by the action that needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from core.device import current_device
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.actions import COMPUTE, Action, ActionKind, B, F, I, W
from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from core.pipeline_parallel.hooks import ScheduleHooks, ScheduleSettings
from core.pipeline_parallel.links import PipelineLinks
from core.pipeline_parallel.losses import LossLogs, parse_loss
from core.pipeline_parallel.mailbox import Mailbox
from core.pipeline_parallel.placement import Placement
from core.pipeline_parallel.record import Event, ScheduleRecord

__all__ = ["Event", "ScheduleRecord", "StepContext", "deallocate_output", "run_table"]


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
    groups: ParallelGroups | None = None
    """This rank's process groups (None: one process); the loss reduces over its context-parallel group."""
    record: ScheduleRecord | None = None
    shape_origin: str = ""
    """How ``tensor_shape`` was derived (``seq_length``, ``micro_batch_size``, ...), for errors."""


# --------------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------------


def run_table(table: list[Action], ctx: StepContext) -> LossLogs:
    """Run this rank's complete table; returns the loss functions' logs (on the loss stage)."""
    stages = [Stage(ctx, chunk) for chunk in range(len(ctx.chunks))]
    mailbox = Mailbox(
        pp_rank=ctx.pp_rank,
        placement=ctx.placement,
        links=ctx.links,
        shape=ctx.tensor_shape,
        dtype=ctx.settings.pipeline_dtype,
        variable_shapes=ctx.settings.variable_seq_lengths,
        record=ctx.record,
        shape_origin=ctx.shape_origin,
    )
    losses, sync, count = Losses(ctx), ReductionWindow(ctx.hooks, ctx.chunks, table), InFlight()
    handlers: dict[ActionKind, Callable[[int, Action], None]] = {  # partial: no frame of its own
        F: partial(_forward, stages=stages, mailbox=mailbox, losses=losses, count=count),
        B: partial(_backward, stages=stages, mailbox=mailbox, sync=sync, count=count),
        I: partial(_backward_input, stages=stages, mailbox=mailbox),
        W: partial(_backward_weight, stages=stages, sync=sync, count=count),
        ActionKind.SEND_F: lambda i, a: mailbox.send(a),
        ActionKind.SEND_B: lambda i, a: mailbox.send(a),
        ActionKind.RECV_F: lambda i, a: mailbox.receive(a),
        ActionKind.RECV_B: lambda i, a: mailbox.receive(a),
    }
    record, timers, position = ctx.record, ctx.hooks.timers, ctx.hooks.position
    if record is not None:
        record.start = record.clock.now()
    if not ctx.forward_only:
        sync.suspend()
        if ctx.hooks.auxiliary_loss_scale is not None:
            ctx.hooks.auxiliary_loss_scale(_auxiliary_loss_scale(ctx))
    if position is not None:
        position.begin(table, mailbox)
    for index, action in enumerate(table):
        if position is not None:
            position.index = index  # all a post-mortem needs; the rest is derived when asked
        start = record.clock.now() if record is not None else 0.0
        with _timer(timers, action.kind):
            handlers[action.kind](index, action)
        if record is not None:
            _record(record, action, start)
    if position is not None:
        position.index = len(table)
    mailbox.finish()
    sync.resume()
    _finish_step(ctx, losses, count)
    return losses.logs


def _auxiliary_loss_scale(ctx: StepContext) -> torch.Tensor:
    """The weight of losses computed inside the model (MoE routers) in this step's objective: the main
    loss's scale, over the microbatch count (times CP) unless the loss is per token (Megatron's)."""
    scale = torch.ones((), device=current_device())
    if ctx.hooks.grad_scale_func is not None:
        scale = ctx.hooks.grad_scale_func(scale)
    if not ctx.settings.calculate_per_token_loss:
        scale = scale * ctx.settings.context_parallel_size / ctx.num_microbatches
    return scale


def _forward(
    index: int, action: Action, *, stages: list[Stage], mailbox: Mailbox, losses: Losses, count: InFlight
) -> None:
    stage = stages[action.chunk]
    received = mailbox.input_of(action)
    output, loss_func = stage.forward(received)
    if stage.is_last:
        output = losses.apply(loss_func, output)
    else:
        mailbox.output_of(action, output)
    if stage.keep(action.microbatch, received, output):
        count.add(1)


def _backward(
    index: int,
    action: Action,
    *,
    stages: list[Stage],
    mailbox: Mailbox,
    sync: ReductionWindow,
    count: InFlight,
) -> None:
    grad = mailbox.input_of(action)
    with sync.weight_step(index, action.chunk):
        input_grad = stages[action.chunk].backward(action.microbatch, grad)
    count.add(-1)
    mailbox.output_of(action, input_grad)


def _backward_input(index: int, action: Action, *, stages: list[Stage], mailbox: Mailbox) -> None:
    grad = mailbox.input_of(action)
    mailbox.output_of(action, stages[action.chunk].backward_input(action.microbatch, grad))


def _backward_weight(
    index: int, action: Action, *, stages: list[Stage], sync: ReductionWindow, count: InFlight
) -> None:
    with sync.weight_step(index, action.chunk):
        stages[action.chunk].backward_weight(action.microbatch)
    count.add(-1)


def _record(record: ScheduleRecord, action: Action, start) -> None:
    """The action's event (its start is moved past a wait for its input by ``ScheduleRecord.timed``)."""
    record.events.append(Event(action.kind.value, action.microbatch, action.chunk, start, record.clock.now()))


def _finish_step(ctx: StepContext, losses: Losses, count: InFlight) -> None:
    if ctx.record is not None:
        ctx.record.end = ctx.record.clock.now()
        ctx.record.peak_in_flight = count.peak
        ctx.record.num_tokens = losses.num_tokens
    finalize = ctx.hooks.finalize_model_grads
    if finalize is not None and not ctx.forward_only:
        finalize(ctx.chunks, losses.num_tokens if ctx.settings.calculate_per_token_loss else None)
        if ctx.record is not None:
            ctx.record.finalized = ctx.record.clock.now()


# --------------------------------------------------------------------------------------------------
# One model chunk: forward and backward of its microbatches
# --------------------------------------------------------------------------------------------------


class Stage:
    """One chunk of this rank as a pipeline stage: runs its microbatches' forward and backward."""

    def __init__(self, ctx: StepContext, chunk: int):
        self.chunk, self.module = chunk, ctx.chunks[chunk]
        stage = ctx.placement.stage(ctx.pp_rank, chunk)
        self.is_first, self.is_last = stage == 0, stage == ctx.placement.last_stage
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
        _set_input_tensor(self.module, [received])
        with torch.no_grad() if self.forward_only else torch.enable_grad():
            output, loss_func = self.forward_step_func(self.data, self.module)
        return output, loss_func

    def keep(self, microbatch: int, received: torch.Tensor | None, output: torch.Tensor) -> bool:
        """Hold what backward needs (nothing when forward only); whether anything was kept.

        Once sent, an output's storage is freed: backward needs only its graph."""
        if self.forward_only:
            return False
        self.saved[microbatch] = (received, output)
        if self.deallocate:
            deallocate_output(output)
        return True

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
        if self.is_last and self.grad_scale_func is not None:  # fp16 loss scaling
            output = self.grad_scale_func(output)
        return received, output


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


# --------------------------------------------------------------------------------------------------
# Losses, gradient-sync hooks, in-flight count, timers
# --------------------------------------------------------------------------------------------------


class Losses:
    """The loss stage's contract: scaled losses to backpropagate, logs, the step's token count."""

    def __init__(self, ctx: StepContext):
        self.num_microbatches, self.per_token = ctx.num_microbatches, ctx.settings.calculate_per_token_loss
        self.non_loss_data = ctx.collect_non_loss_data and ctx.forward_only
        self.logs = LossLogs()
        self.num_tokens = torch.zeros((), dtype=torch.int64, device=current_device())
        self.cp_group = (
            ctx.groups.cp if ctx.groups is not None and ctx.settings.context_parallel_size > 1 else None
        )

    def apply(self, loss_func: Callable, output: torch.Tensor) -> torch.Tensor:
        result = loss_func(output)
        if self.non_loss_data:
            self.logs.append(result)
            return output
        loss = parse_loss(
            result,
            num_microbatches=self.num_microbatches,
            per_token=self.per_token,
            context_parallel_group=self.cp_group,
        )
        summed = loss.num_tokens is not None
        if self.logs.summed is not None and self.logs.summed != summed:
            raise TypeError("loss_func returned a 2-tuple for some microbatches and a 3-tuple for others")
        self.logs.summed = summed
        self.logs.append(loss.log)
        if summed:
            tokens = loss.num_tokens.to(torch.int64)
            if tokens.device != self.num_tokens.device:  # a copy waits for the device: only when needed
                tokens = tokens.to(self.num_tokens.device)
            self.num_tokens += tokens
        return loss.loss


class ReductionWindow:
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
        self.last_chunk = max(self.last, key=self.last.get) if self.last else None
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
    """A chunk's last weight-gradient step: reduction lifted while it runs, ``grad_sync`` after it."""

    def __init__(self, sync: ReductionWindow, chunk: int):
        self.sync, self.chunk = sync, chunk

    def __enter__(self) -> None:
        self.sync.lift(self.chunk)

    def __exit__(self, *exc) -> None:
        grad_sync = self.sync.hooks.for_chunk("grad_sync", self.chunk)
        if grad_sync is not None and exc[0] is None:
            grad_sync(self.sync.chunks[self.chunk].parameters())
        if not self.sync.per_chunk and self.chunk != self.sync.last_chunk:
            self.sync.suspend()  # one context for all chunks: other chunks still accumulate


class InFlight:
    """Microbatch-chunks forwarded but not yet through their weight gradients, and the peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, delta: int) -> None:
        self.now += delta
        self.peak = max(self.peak, self.now)


_NO_TIMER = nullcontext()


def _timer(timers, kind: ActionKind):
    """Megatron's timers around compute: "forward-compute" and "backward-compute"."""
    if timers is None or kind not in COMPUTE:
        return _NO_TIMER
    return _Timed(timers("forward-compute" if kind == F else "backward-compute", log_level=2))


class _Timed:
    def __init__(self, timer):
        self.timer = timer

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.stop()

"""The one executor: runs any schedule table on this rank, deriving every send and receive from it.

For each compute action the executor knows where its input comes from and where its output goes
(stage ``s`` talks to ``s - 1`` and ``s + 1``). Receives are posted ahead of need (``lookahead``
actions) and sends never block the sender.

Ordering. Between any two ranks the receiver posts its receives in exactly the order the sender
posts the matching sends; the receiver can do this because it can build the sender's table too
(tables are pure functions). Activations and gradients between the same two ranks (PP=2 with
virtual stages) can therefore never swap, whatever the backend's matching rule.

Links. With the groups :func:`core.parallel_state.initialize_model_parallel` creates, every message
is posted as its own ``batch_isend_irecv`` on the two-rank group of its link (activations r -> r+1,
gradients r+1 -> r). NCCL runs one group's operations in order on one stream and a send completes
only once its receive is posted, so on a single pipeline group a receive posted ahead of need
blocks every later operation of that rank, its sends included, and two ranks can end up waiting for
each other. On its own link a message waits only for the messages before it on that link, in the
order both ends agree on, so the run is deadlock-free whenever the table itself is
(:func:`core.pipeline_parallel.simulator.check_rendezvous` checks a recorded run under exactly these
rules). With a caller's own pipeline group (``p2p_communicator=``) there are no link groups and
what falls between two computations goes out as one batch on that group: right on gloo, not
NCCL-safe.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from core.device import current_device
from core.pipeline_parallel.p2p_communication import ACTIVATION, GRADIENT, P2PMessage, post_batch
from core.pipeline_parallel.schedule_tables import Action, rank_and_chunk, stage_of

LOOKAHEAD = 2  # receives are posted this many actions before they are needed


@dataclass
class ScheduleRecord:
    """What a run did, for tests, timelines and benchmarks (pass one in to have it filled)."""

    events: list[tuple[str, float, float]] = field(default_factory=list)  # (action, compute start, end)
    # What the rank posted and waited for, in order, for check_rendezvous: ("post", group, ops) with
    # ops (is_send, peer pp rank, (kind, microbatch, destination stage, part)), or ("wait", that key).
    comm_log: list[tuple] = field(default_factory=list)
    peak_in_flight: int = 0
    num_tokens: torch.Tensor | None = None


@dataclass
class _Incoming:
    """A message this rank receives: where it comes from and, once posted, its buffer and request."""

    kind: str
    microbatch: int
    dst_stage: int
    src_rank: int
    position: int  # index in its channel: receives are posted in this order
    shape_buffer: torch.Tensor | None = None
    shape_request: dist.Work | None = None
    buffer: torch.Tensor | None = None
    request: dist.Work | None = None


@dataclass
class StepContext:
    """Everything a run needs besides the table; built by the Megatron-named entry points."""

    forward_step_func: Callable
    data_iterators: list[Iterator | None]
    chunks: list[torch.nn.Module]
    num_microbatches: int
    config: Any
    tensor_shape: tuple[int, ...]
    forward_only: bool
    collect_non_loss_data: bool
    pp_rank: int
    pp_size: int
    pp_group: dist.ProcessGroup | None
    all_tables: list[list[Action]]  # index = pp_rank; the peers' tables fix the message order
    record: ScheduleRecord | None = None
    pp_channels: Mapping[tuple[str, int, int], dist.ProcessGroup] | None = None  # per-link groups


def _produced(action: Action, pp_rank: int, pp_size: int, last_stage: int) -> tuple[str, int] | None:
    """(kind, destination stage) of the message an action sends, or None."""
    stage = stage_of(pp_rank, action.chunk, pp_size)
    if action.kind == "F" and stage < last_stage:
        return ACTIVATION, stage + 1
    if action.kind == "B" and stage > 0:
        return GRADIENT, stage - 1
    return None


def _needed(action: Action, pp_rank: int, pp_size: int, last_stage: int) -> tuple[str, int] | None:
    """(kind, source stage) of the message an action consumes, or None."""
    stage = stage_of(pp_rank, action.chunk, pp_size)
    if action.kind == "F" and stage > 0:
        return ACTIVATION, stage - 1
    if action.kind == "B" and stage < last_stage:
        return GRADIENT, stage + 1
    return None


class _Comm:
    """This rank's messages for one run: receives posted in each sender's order, non-blocking sends.

    Everything queued between two computations leaves as one batch (``flush``). When the previous
    and next stage are this very rank (PP=1 with virtual chunks) tensors are handed over locally.
    """

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.group_ranks = (
            dist.get_process_group_ranks(ctx.pp_group)
            if ctx.pp_size > 1
            else [dist.get_rank() if dist.is_initialized() else 0]
        )
        self.pp_rank_of = {global_rank: i for i, global_rank in enumerate(self.group_ranks)}
        self.links = ctx.pp_channels or {}
        self.device = current_device()
        self.variable = bool(getattr(ctx.config, "variable_seq_lengths", False))
        pp, me = ctx.pp_size, ctx.pp_rank
        self.last_stage = pp * len(ctx.chunks) - 1
        self.channels: dict[int, list[_Incoming]] = defaultdict(list)  # per sender, in its order
        self.incoming: dict[tuple[str, int, int], _Incoming] = {}
        for src, table in enumerate(ctx.all_tables):
            if src == me:
                continue
            for action in table:
                out = _produced(action, src, pp, self.last_stage)
                if out and rank_and_chunk(out[1], pp)[0] == me:
                    msg = _Incoming(out[0], action.microbatch, out[1], src, len(self.channels[src]))
                    self.channels[src].append(msg)
                    self.incoming[(msg.kind, msg.microbatch, msg.dst_stage)] = msg
        self.cursor = {src: 0 for src in self.channels}
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.sent_shapes: dict[tuple[int, int], tuple[int, ...]] = {}  # (mb, stage) -> activation shape
        self.pending: list[tuple[P2PMessage, _Incoming | None, tuple]] = []  # (message, receive, key)
        self.sends: list[dist.Work] = []

    # -- sending ----------------------------------------------------------------------------
    def send(self, kind: str, microbatch: int, src_stage: int, dst_stage: int, tensor: torch.Tensor) -> None:
        dst_rank = rank_and_chunk(dst_stage, self.ctx.pp_size)[0]
        if dst_rank == self.ctx.pp_rank:
            self.local[(kind, microbatch, dst_stage)] = tensor.detach()
            return
        peer, label = self.group_ranks[dst_rank], f"mb {microbatch} stage {src_stage}->{dst_stage}"
        tensor = tensor.detach().contiguous()
        if kind == ACTIVATION and self.variable:
            self.sent_shapes[(microbatch, src_stage)] = tuple(tensor.shape)
            shape = torch.tensor(tensor.shape, dtype=torch.int64, device=self.device)
            key = (kind, microbatch, dst_stage, "shape")
            self.pending.append((P2PMessage(True, shape, peer, kind, "shape", label), None, key))
        key = (kind, microbatch, dst_stage, "data")
        self.pending.append((P2PMessage(True, tensor, peer, kind, "data", label), None, key))

    # -- receiving --------------------------------------------------------------------------
    def prefetch(self, actions: list[Action]) -> None:
        """Queue the receives these upcoming actions need, as far as channel order allows."""
        for action in actions:
            need = _needed(action, self.ctx.pp_rank, self.ctx.pp_size, self.last_stage)
            if need:
                self._queue_through(
                    (need[0], action.microbatch, stage_of(self.ctx.pp_rank, action.chunk, self.ctx.pp_size)),
                    block=False,
                )

    def take(self, kind: str, microbatch: int, stage: int) -> torch.Tensor:
        """The tensor received for ``stage``, waiting for it if it has not arrived."""
        key = (kind, microbatch, stage)
        if key in self.local:
            return self.local.pop(key)
        msg = self.incoming.pop(key)
        if msg.request is None:
            self._queue_through(key, block=True, msg=msg)
            self.flush()
        self._log("wait", (kind, microbatch, stage, "data"))
        msg.request.wait()
        return msg.buffer

    def _queue_through(self, key, block: bool, msg: _Incoming | None = None) -> None:
        msg = msg or self.incoming.get(key)
        if msg is None:
            return
        channel = self.channels[msg.src_rank]
        while self.cursor[msg.src_rank] <= msg.position:
            if not self._queue_one(channel[self.cursor[msg.src_rank]], block):
                return
            self.cursor[msg.src_rank] += 1

    def _queue_one(self, msg: _Incoming, block: bool) -> bool:
        peer, label = self.group_ranks[msg.src_rank], f"mb {msg.microbatch} stage {msg.dst_stage}"
        if not self.variable:
            shape = self.ctx.tensor_shape
        elif msg.kind == GRADIENT:  # a gradient has the shape of the activation this rank sent
            shape = self.sent_shapes.get((msg.microbatch, msg.dst_stage))
            if shape is None:
                if block:
                    raise RuntimeError(
                        f"schedule error: gradient for microbatch {msg.microbatch} at stage "
                        f"{msg.dst_stage} needed before its activation was sent"
                    )
                return False
        else:  # a variable-length activation: its shape travels first
            if msg.shape_request is None and msg.shape_buffer is None:
                msg.shape_buffer = torch.empty(
                    len(self.ctx.tensor_shape), dtype=torch.int64, device=self.device
                )
                key = (msg.kind, msg.microbatch, msg.dst_stage, "shape")
                self.pending.append(
                    (P2PMessage(False, msg.shape_buffer, peer, msg.kind, "shape", label), msg, key)
                )
            if msg.shape_request is None:
                if not block:
                    return False
                self.flush()
            if not block and not msg.shape_request.is_completed():
                return False
            self._log("wait", (msg.kind, msg.microbatch, msg.dst_stage, "shape"))
            msg.shape_request.wait()
            shape = tuple(msg.shape_buffer.tolist())
        msg.buffer = torch.empty(shape, dtype=self.ctx.config.pipeline_dtype, device=self.device)
        key = (msg.kind, msg.microbatch, msg.dst_stage, "data")
        self.pending.append((P2PMessage(False, msg.buffer, peer, msg.kind, "data", label), msg, key))
        return True

    # -- posting ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Post everything queued since the last computation: each message on its link, else one batch."""
        if not self.pending:
            return
        if self.links:
            requests = []
            for message, _, key in self.pending:
                link = self._link(message)
                requests += post_batch([message], self.links[link])
                self._log("post", link, [(message.is_send, self.pp_rank_of[message.peer], key)])
        else:
            requests = post_batch([m for m, _, _ in self.pending], self.ctx.pp_group)
            ops = [(m.is_send, self.pp_rank_of[m.peer], key) for m, _, key in self.pending]
            self._log("post", "pp", ops)
        for (message, incoming, _), request in zip(self.pending, requests):
            if message.is_send:
                self.sends.append(request)
            elif message.part == "shape":
                incoming.shape_request = request
            else:
                incoming.request = request
        self.pending.clear()
        self.sends = [r for r in self.sends if not r.is_completed()]

    def _link(self, message: P2PMessage) -> tuple[str, int, int]:
        """(kind, source pp rank, destination pp rank) of the link a message travels on."""
        peer, me = self.pp_rank_of[message.peer], self.ctx.pp_rank
        return (message.kind, me, peer) if message.is_send else (message.kind, peer, me)

    def _log(self, *entry) -> None:
        if self.ctx.record is not None:
            self.ctx.record.comm_log.append(entry)

    def finish(self) -> None:
        self.flush()
        for request in self.sends:
            request.wait()
        self.sends.clear()


class _GradSync:
    """Megatron's gradient-sync hooks: reduction suspended until each chunk's last backward.

    Without ``grad_sync_func`` the suspension (``no_sync_func``) is lifted for a chunk's last
    backward, so the data-parallel hooks fire while it runs; with it, ``grad_sync_func`` is called
    with the chunk's parameters right after that backward. Either way each chunk's reduction
    overlaps the remaining backward work.
    """

    def __init__(self, ctx: StepContext, table: list[Action]):
        cfg = ctx.config
        self.no_sync_func = getattr(cfg, "no_sync_func", None)
        self.grad_sync_func = getattr(cfg, "grad_sync_func", None)
        self.chunks = ctx.chunks
        self.last_backward = {a.chunk: i for i, a in enumerate(table) if a.kind == "B"}
        self.context = None
        self.synced: set[int] = set()

    def disable(self) -> None:
        if self.no_sync_func is not None and self.context is None:
            self.context = self.no_sync_func()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def before_backward(self, index: int, chunk: int) -> None:
        if self.grad_sync_func is None and self.last_backward.get(chunk) == index:
            self.enable()

    def after_backward(self, index: int, chunk: int) -> None:
        if self.last_backward.get(chunk) != index:
            return
        if self.grad_sync_func is not None:
            self.enable()
            self._call_sync(chunk)
        self.synced.add(chunk)
        if len(self.synced) < len(self.last_backward):
            self.disable()

    def finish(self) -> None:
        self.enable()

    def _call_sync(self, chunk: int) -> None:
        fn = (
            self.grad_sync_func[chunk]
            if isinstance(self.grad_sync_func, (list, tuple))
            else self.grad_sync_func
        )
        fn(self.chunks[chunk].parameters())


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backward from ``output`` with ``grad_output``, calling the C++ autograd engine directly.

    ``torch.autograd.backward`` checks that the gradient's shape matches the output's; after
    ``deallocate_output`` the output's data is a 1-element placeholder, so that check would fail
    although the graph (all backward needs) is intact. The engine itself does not check.
    """
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


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


def _set_virtual_rank(chunk: int, num_chunks: int) -> None:
    if num_chunks > 1:
        from core import parallel_state

        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)


def _apply_loss(ctx: StepContext, loss_func: Callable, output, store: list):
    """Megatron's loss contract; returns (loss to backpropagate, token count or None)."""
    result = loss_func(output)
    if ctx.collect_non_loss_data and ctx.forward_only:
        store.append(result)
        return output, None
    per_token = bool(getattr(ctx.config, "calculate_per_token_loss", False))
    if isinstance(result, tuple) and len(result) == 3:
        loss, num_tokens, log = result
        if not per_token:  # never in place: the caller may share this tensor with its logs
            loss = loss / num_tokens / ctx.num_microbatches
    elif isinstance(result, tuple) and len(result) == 2:
        if per_token:
            raise ValueError(
                "config.calculate_per_token_loss needs loss_func to return "
                "(loss_sum, num_tokens, log_dict), got a 2-tuple"
            )
        loss, log = result
        loss, num_tokens = loss / ctx.num_microbatches, None
    else:
        raise TypeError(
            "loss_func must return (loss, log_dict) or (loss_sum, num_tokens, log_dict), got "
            f"{type(result).__name__}"
        )
    store.append(log)
    return loss, num_tokens


def run_table(table: list[Action], ctx: StepContext) -> list:
    """Run this rank's table; returns the loss functions' log dicts (on the last stage)."""
    pp, me = ctx.pp_size, ctx.pp_rank
    last_stage = pp * len(ctx.chunks) - 1
    comm = _Comm(ctx)
    sync = _GradSync(ctx, table)
    store: list = []
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    total_tokens = torch.zeros((), dtype=torch.int64, device=comm.device)
    deallocate = bool(getattr(ctx.config, "deallocate_pipeline_outputs", False))
    in_flight = peak = 0
    if not ctx.forward_only:
        sync.disable()
    comm.prefetch(table[:LOOKAHEAD])
    comm.flush()
    for index, action in enumerate(table):
        stage = stage_of(me, action.chunk, pp)
        key = (action.microbatch, action.chunk)
        if action.kind == "F":
            received = comm.take(ACTIVATION, action.microbatch, stage) if stage > 0 else None
            start = time.perf_counter()
            if received is not None and not ctx.forward_only:
                received.requires_grad_(True)
            _set_virtual_rank(action.chunk, len(ctx.chunks))
            chunk = ctx.chunks[action.chunk]
            _set_input_tensor(chunk, [received])
            with torch.no_grad() if ctx.forward_only else torch.enable_grad():
                output, loss_func = ctx.forward_step_func(ctx.data_iterators[action.chunk], chunk)
                if stage == last_stage:
                    output, num_tokens = _apply_loss(ctx, loss_func, output, store)
                    if num_tokens is not None:
                        total_tokens += torch.as_tensor(num_tokens, device=comm.device).to(torch.int64)
            if stage < last_stage:
                comm.send(ACTIVATION, action.microbatch, stage, stage + 1, output)
            if not ctx.forward_only:
                inputs[key], outputs[key] = received, output
                in_flight += 1
                peak = max(peak, in_flight)
                if deallocate and stage < last_stage:
                    deallocate_output(output)
        else:
            grad = comm.take(GRADIENT, action.microbatch, stage) if stage < last_stage else None
            start = time.perf_counter()
            _set_virtual_rank(action.chunk, len(ctx.chunks))
            received, output = inputs.pop(key), outputs.pop(key)
            sync.before_backward(index, action.chunk)
            if output.requires_grad:
                if grad is None:
                    scale = getattr(ctx.config, "grad_scale_func", None)  # fp16 loss scaling (Megatron)
                    torch.autograd.backward(output if scale is None else scale(output))
                else:
                    custom_backward(output, grad)
            sync.after_backward(index, action.chunk)
            in_flight -= 1
            if stage > 0:
                input_grad = received.grad if received.grad is not None else torch.zeros_like(received)
                comm.send(GRADIENT, action.microbatch, stage, stage - 1, input_grad)
        if ctx.record is not None:
            ctx.record.events.append((str(action), start, time.perf_counter()))
        comm.prefetch(table[index + 1 : index + 1 + LOOKAHEAD])
        comm.flush()
    comm.finish()
    if not ctx.forward_only:
        sync.finish()
    if ctx.record is not None:
        ctx.record.peak_in_flight = peak
        ctx.record.num_tokens = total_tokens
    finalize = getattr(ctx.config, "finalize_model_grads_func", None)
    if finalize is not None and not ctx.forward_only:
        per_token = bool(getattr(ctx.config, "calculate_per_token_loss", False))
        finalize(ctx.chunks, total_tokens if per_token else None)
    return store

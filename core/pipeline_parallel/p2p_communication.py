"""Point-to-point messages between neighbouring pipeline stages.

Every exchange is one ``batch_isend_irecv`` of ``P2POp``s, never a bare blocking send/recv.

Keeping activations and gradients apart. With PP=2 and virtual stages the previous and the next
stage are the same rank, so one batch can carry an activation *and* a gradient to the same peer.
gloo matches messages between two ranks by tag, then by arrival order; NCCL ignores tags and
matches by order alone. Megatron posts "send to prev" before "send to next" but "recv from prev"
before "recv from next", so on the receiving side the activation lands in the gradient buffer and
the other way round — same shapes, no error, wrong training. Here every batch is put in one
canonical order, the same on both sides: per peer, activations before gradients, shapes before
data (``_ORDER``). The message kind also travels as the tag, so gloo could not confuse them even
if the order were broken.

``TRIDENT_P2P_VERBOSE=1`` logs every operation with rank, peer, kind and shape: the cheapest hang
debugger there is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.device import current_device
from core.model_parallel_config import ModelParallelConfig
from core.parallel_state import ACTIVATION, GRADIENT

# Canonical position of a message within a batch between two ranks; also its gloo tag.
_ORDER = {(ACTIVATION, "shape"): 1, (ACTIVATION, "data"): 2, (GRADIENT, "shape"): 3, (GRADIENT, "data"): 4}
_VERBOSE = os.environ.get("TRIDENT_P2P_VERBOSE", "0") not in ("", "0")

Shape = Sequence[int] | torch.Size


@dataclass
class P2PMessage:
    """One operation of a batch: send or receive ``tensor`` to/from global rank ``peer``."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    kind: str = ACTIVATION  # ACTIVATION travels forward, GRADIENT backward
    part: str = "data"  # "shape" messages precede "data" ones when shapes vary
    label: str = ""  # for verbose logs, e.g. "mb 3 chunk 1"

    @property
    def tag(self) -> int:
        return _ORDER[(self.kind, self.part)]


def post_batch(messages: list[P2PMessage], group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Post ``messages`` as one batch, in the order given; returns the requests to wait on."""
    if not messages:
        return []
    if _VERBOSE:
        me = dist.get_rank()
        for m in messages:
            print(
                f"[p2p rank {me}] {'send' if m.is_send else 'recv'} {m.kind}/{m.part} "
                f"{'->' if m.is_send else '<-'} {m.peer} {tuple(m.tensor.shape)} {m.label}",
                file=sys.stderr,
                flush=True,
            )
    ops = [
        dist.P2POp(dist.isend if m.is_send else dist.irecv, m.tensor, m.peer, group, m.tag) for m in messages
    ]
    return dist.batch_isend_irecv(ops)


def canonical_order(messages: list[P2PMessage]) -> list[P2PMessage]:
    """Sort a batch so both sides of every rank pair post their operations in the same order."""
    return sorted(messages, key=lambda m: (m.peer, m.tag))


def is_single_shape(x) -> bool:
    """True for one shape (a sequence of ints, or None when shapes travel with the data), False for a list."""
    return (
        x is None
        or isinstance(x, torch.Size)
        or (isinstance(x, (list, tuple)) and all(isinstance(d, int) for d in x))
    )


class P2PCommunicator:
    """Megatron's pipeline point-to-point API over one pipeline process group.

    ``is_first_stage``/``is_last_stage`` arguments say whether this chunk has a neighbour on that
    side (with virtual stages the ring wraps around: the last rank's next is rank 0).
    """

    def __init__(self, pp_group: dist.ProcessGroup, config: ModelParallelConfig):
        self.pp_group = pp_group
        self.config = config
        ranks = dist.get_process_group_ranks(pp_group)
        me = ranks.index(dist.get_rank())
        self.pp_rank, self.pp_size = me, len(ranks)
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        self.device = current_device()

    # -- the one primitive ------------------------------------------------------------------
    def communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape | None,
        wait_on_reqs: bool = True,
    ):
        """Send/receive with both neighbours in one batch; returns (from_prev, from_next, requests).

        Sends to next and receives from prev are activations; the other two are gradients.
        """
        if self.pp_size == 1:
            raise RuntimeError("P2PCommunicator needs a pipeline of at least 2 ranks")
        prev_shape = next_shape = tensor_shape
        if self.config.variable_seq_lengths:
            prev_shape, next_shape = self._exchange_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next
            )
        elif (recv_prev or recv_next) and tensor_shape is None:
            raise ValueError("tensor_shape is required to receive when config.variable_seq_lengths is False")
        from_prev = self._empty(prev_shape) if recv_prev else None
        from_next = self._empty(next_shape) if recv_next else None
        messages = []
        if tensor_send_next is not None:
            messages.append(P2PMessage(True, tensor_send_next.contiguous(), self.next_rank, ACTIVATION))
        if from_prev is not None:
            messages.append(P2PMessage(False, from_prev, self.prev_rank, ACTIVATION))
        if tensor_send_prev is not None:
            messages.append(P2PMessage(True, tensor_send_prev.contiguous(), self.prev_rank, GRADIENT))
        if from_next is not None:
            messages.append(P2PMessage(False, from_next, self.next_rank, GRADIENT))
        reqs = post_batch(canonical_order(messages), self.pp_group)
        if wait_on_reqs:
            for req in reqs:
                req.wait()
            reqs = []
        return from_prev, from_next, reqs

    def _empty(self, shape: Shape) -> torch.Tensor:
        return torch.empty(
            tuple(shape), dtype=self.config.pipeline_dtype, device=self.device, requires_grad=True
        )

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        """Variable sequence lengths: each message's shape travels first, as one int64 tensor."""

        def shape_of(t):
            return torch.tensor(t.shape, dtype=torch.int64, device=self.device)

        prev_buf = torch.empty(3, dtype=torch.int64, device=self.device) if recv_prev else None
        next_buf = torch.empty(3, dtype=torch.int64, device=self.device) if recv_next else None
        messages = []
        if send_next is not None:
            messages.append(P2PMessage(True, shape_of(send_next), self.next_rank, ACTIVATION, "shape"))
        if prev_buf is not None:
            messages.append(P2PMessage(False, prev_buf, self.prev_rank, ACTIVATION, "shape"))
        if send_prev is not None:
            messages.append(P2PMessage(True, shape_of(send_prev), self.prev_rank, GRADIENT, "shape"))
        if next_buf is not None:
            messages.append(P2PMessage(False, next_buf, self.next_rank, GRADIENT, "shape"))
        for req in post_batch(canonical_order(messages), self.pp_group):
            req.wait()
        return (None if prev_buf is None else prev_buf.tolist()), (
            None if next_buf is None else next_buf.tolist()
        )

    # -- Megatron's names -------------------------------------------------------------------
    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        """Receive the input activation from the previous stage (None on the first stage)."""
        if is_first_stage:
            return None if is_single_shape(tensor_shapes) else [None] * len(tensor_shapes)
        return self._each(
            tensor_shapes,
            lambda s: self.communicate(
                tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False, tensor_shape=s
            )[0],
        )

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        """Receive the gradient of this stage's output from the next stage (None on the last stage)."""
        if is_last_stage:
            return None if is_single_shape(tensor_shapes) else [None] * len(tensor_shapes)
        return self._each(
            tensor_shapes,
            lambda s: self.communicate(
                tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True, tensor_shape=s
            )[1],
        )

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if not is_last_stage:
            for t in _as_list(output_tensors):
                self.communicate(
                    tensor_send_next=t,
                    tensor_send_prev=None,
                    recv_prev=False,
                    recv_next=False,
                    tensor_shape=None,
                )

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if not is_first_stage:
            for t in _as_list(input_tensor_grads):
                self.communicate(
                    tensor_send_next=None,
                    tensor_send_prev=t,
                    recv_prev=False,
                    recv_next=False,
                    tensor_shape=None,
                )

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        """Send the output forward and receive its gradient back, in one batch."""
        if is_last_stage:
            return None if is_single_shape(tensor_shapes) else [None] * len(tensor_shapes)
        return self._zip(
            output_tensors,
            tensor_shapes,
            lambda t, s: self.communicate(
                tensor_send_next=t, tensor_send_prev=None, recv_prev=False, recv_next=True, tensor_shape=s
            )[1],
        )

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        """Send the input gradient back and receive the next input, in one batch."""
        if is_first_stage:
            return None if is_single_shape(tensor_shapes) else [None] * len(tensor_shapes)
        return self._zip(
            input_tensor_grads,
            tensor_shapes,
            lambda t, s: self.communicate(
                tensor_send_next=None, tensor_send_prev=t, recv_prev=True, recv_next=False, tensor_shape=s
            )[0],
        )

    def send_forward_recv_forward(
        self, output_tensor, recv_prev: bool, tensor_shape, overlap_p2p_comm: bool = False
    ):
        """Send to the next stage and receive from the previous one (interleaved schedules)."""
        from_prev, _, reqs = self.communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=None,
            recv_prev=recv_prev,
            recv_next=False,
            tensor_shape=tensor_shape,
            wait_on_reqs=not overlap_p2p_comm,
        )
        return (from_prev, reqs) if overlap_p2p_comm else from_prev

    def send_backward_recv_backward(
        self, input_tensor_grad, recv_next: bool, tensor_shape, overlap_p2p_comm: bool = False
    ):
        """Send a gradient to the previous stage and receive one from the next (interleaved schedules)."""
        _, from_next, reqs = self.communicate(
            tensor_send_next=None,
            tensor_send_prev=input_tensor_grad,
            recv_prev=False,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait_on_reqs=not overlap_p2p_comm,
        )
        return (from_next, reqs) if overlap_p2p_comm else from_next

    def send_forward_backward_recv_forward_backward(
        self, output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape
    ):
        """All four at once: returns (input from prev, output gradient from next)."""
        from_prev, from_next, _ = self.communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )
        return from_prev, from_next

    @staticmethod
    def _each(tensor_shapes, fn):
        if is_single_shape(tensor_shapes):
            return fn(tensor_shapes)
        return [fn(s) for s in tensor_shapes]

    @staticmethod
    def _zip(tensors, tensor_shapes, fn):
        if is_single_shape(tensor_shapes):
            return fn(tensors, tensor_shapes)
        return [fn(t, s) for t, s in zip(tensors, tensor_shapes)]


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]

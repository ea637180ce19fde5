"""Megatron's ``P2PCommunicator``: its pipeline point-to-point API, posting on Trident's links.

Trident's own schedules post through :class:`~core.pipeline_parallel.links.PipelineLinks`
directly; this module keeps Megatron's API (``recv_forward``, ``send_forward_recv_backward``, ...)
for code written against it, and a schedule accepts one as ``p2p_communicator=``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.device import current_device
from core.model_parallel_config import ModelParallelConfig
from core.pipeline_parallel.links import PipelineLinks
from core.pipeline_parallel.messages import ACTIVATION, GRADIENT, Link

Shape = Sequence[int] | torch.Size


def is_single_shape(x) -> bool:
    """True for one shape (a sequence of ints, or None when shapes travel with the data), False for a list."""
    return (
        x is None
        or isinstance(x, torch.Size)
        or (isinstance(x, (list, tuple)) and all(isinstance(d, int) for d in x))
    )


_NEIGHBOUR = {
    "next": ("tensor_send_next", "recv_next", 1),
    "prev": ("tensor_send_prev", "recv_prev", 0),
}
"""Per neighbour: ``communicate``'s keyword to send to it, its keyword to receive from it, and the
index of what comes from it in ``communicate``'s result."""


class P2PCommunicator:
    """Megatron's pipeline point-to-point API, posting on the same links as the executor.

    ``is_first_stage``/``is_last_stage`` arguments say whether this chunk has a neighbour on that
    side (with virtual stages the ring wraps around: the last rank's next is rank 0). Each call
    posts its messages in one canonical order, the same on both ends: activations before gradients,
    shapes before data. So with PP=2, where the previous and the next rank are the same, an
    activation and a gradient can never land in each other's buffer (Megatron's batched order can
    make that happen on gloo; a test shows it).
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
        self.links = PipelineLinks(me, ranks, _channels_of(pp_group))

    # -- the one primitive ------------------------------------------------------------------
    def communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None = None,
        tensor_send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shape: Shape | None = None,
        wait_on_reqs: bool = True,
    ):
        """Send/receive with both neighbours; returns (from_prev, from_next, requests).

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
        nxt, prev = (self.pp_rank + 1) % self.pp_size, (self.pp_rank - 1) % self.pp_size
        planned = [  # the canonical order: activations, then gradients
            (True, nxt, tensor_send_next, ACTIVATION),
            (False, prev, from_prev, ACTIVATION),
            (True, prev, tensor_send_prev, GRADIENT),
            (False, nxt, from_next, GRADIENT),
        ]
        reqs = [
            self.links.post(is_send, peer, t.contiguous() if is_send else t, kind)
            for is_send, peer, t, kind in planned
            if t is not None
        ]
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
        nxt, prev = (self.pp_rank + 1) % self.pp_size, (self.pp_rank - 1) % self.pp_size
        planned = [
            (True, nxt, None if send_next is None else shape_of(send_next), ACTIVATION),
            (False, prev, prev_buf, ACTIVATION),
            (True, prev, None if send_prev is None else shape_of(send_prev), GRADIENT),
            (False, nxt, next_buf, GRADIENT),
        ]
        for is_send, peer, t, kind in planned:
            if t is not None:
                self.links.post(is_send, peer, t, kind, "shape").wait()
        return (None if prev_buf is None else prev_buf.tolist()), (
            None if next_buf is None else next_buf.tolist()
        )

    # -- Megatron's names -------------------------------------------------------------------
    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        """Receive the input activation from the previous stage (None on the first stage)."""
        if is_first_stage:
            return _nothing_for(tensor_shapes)
        return self._each(tensor_shapes, lambda s: self.communicate(recv_prev=True, tensor_shape=s)[0])

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        """Receive the gradient of this stage's output from the next stage (None on the last stage)."""
        if is_last_stage:
            return _nothing_for(tensor_shapes)
        return self._each(tensor_shapes, lambda s: self.communicate(recv_next=True, tensor_shape=s)[1])

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if not is_last_stage:
            for t in _as_list(output_tensors):
                self.communicate(tensor_send_next=t)

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if not is_first_stage:
            for t in _as_list(input_tensor_grads):
                self.communicate(tensor_send_prev=t)

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        """Send the output forward and receive its gradient back."""
        return self._exchange("next", output_tensors, tensor_shapes, is_last_stage)

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        """Send the input gradient back and receive the next input."""
        return self._exchange("prev", input_tensor_grads, tensor_shapes, is_first_stage)

    def send_forward_recv_forward(
        self, output_tensor, recv_prev: bool, tensor_shape, overlap_p2p_comm: bool = False
    ):
        """Send to the next stage and receive from the previous one (interleaved schedules)."""
        return self._send_and_receive(
            "next", "prev", output_tensor, recv_prev, tensor_shape, overlap_p2p_comm
        )

    def send_backward_recv_backward(
        self, input_tensor_grad, recv_next: bool, tensor_shape, overlap_p2p_comm: bool = False
    ):
        """Send a gradient to the previous stage and receive one from the next (interleaved schedules)."""
        return self._send_and_receive(
            "prev", "next", input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm
        )

    def _exchange(self, neighbour: str, tensors, tensor_shapes, no_neighbour: bool):
        """Each tensor to ``neighbour`` and its reply back (1F1B's steady state); None without one."""
        if no_neighbour:
            return _nothing_for(tensor_shapes)
        return self._zip(
            tensors, tensor_shapes, lambda t, s: self._send_and_receive(neighbour, neighbour, t, True, s)
        )

    def _send_and_receive(
        self,
        send_to: str,
        receive_from: str,
        tensor,
        recv: bool,
        tensor_shape,
        overlap_p2p_comm: bool = False,
    ):
        """``tensor`` to neighbour ``send_to`` and, if ``recv``, a tensor from ``receive_from``; with
        ``overlap_p2p_comm`` also the pending requests (the caller waits on them)."""
        send_key = _NEIGHBOUR[send_to][0]
        _, recv_key, side = _NEIGHBOUR[receive_from]
        received = self.communicate(
            **{send_key: tensor, recv_key: recv}, tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm
        )
        return (received[side], received[2]) if overlap_p2p_comm else received[side]

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


def _channels_of(pp_group: dist.ProcessGroup) -> Mapping[Link, dist.ProcessGroup]:
    """parallel_state's link groups of ``pp_group``, which must be its pipeline group."""
    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_group() is not pp_group:
        raise ValueError(
            "P2PCommunicator posts on the pipeline links initialize_model_parallel creates (one group per "
            "direction and neighbour, NCCL-safe); pass parallel_state.get_pipeline_model_parallel_group()"
        )
    return ps.get_pipeline_model_parallel_channel_groups()


def _nothing_for(tensor_shapes):
    """What a receive returns where there is no neighbour: None, or a None per shape."""
    return None if is_single_shape(tensor_shapes) else [None] * len(tensor_shapes)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]

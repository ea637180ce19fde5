"""The per-link transport between pipeline stages: every message its own non-blocking post on its link.

``PipelineLinks`` is this rank's end of every directed link to a pipeline neighbour. Each link has
its own two-rank process group (:func:`core.parallel_state.initialize_model_parallel` creates
them), and every message is its own non-blocking operation on its link, never a bare blocking
send/recv. NCCL runs one group's operations in order and a send completes only once its receive is
posted; on its own link a message waits only for the messages before it on that link, which the
two ends post in the same order. The executor and Megatron's ``P2PCommunicator``
(:mod:`~core.pipeline_parallel.p2p_communication`) both post through here.

On NCCL each message is a one-operation ``batch_isend_irecv`` (a group call, as Megatron posts
them). On other backends that call would only wrap the same ``isend``/``irecv``, so it is called
directly: posting is on the critical path of every pipeline hop, and on a 2-core gloo machine the
wrapper took about 80 of the 330 microseconds a post costs between compute actions.

The message kind and part also travel as the gloo tag (activation/gradient x shape/data), so even
if two messages between the same ranks were ever posted in different orders gloo could not swap
them. ``TRIDENT_P2P_VERBOSE=1`` logs every operation with rank, peer, kind and shape: the cheapest
hang debugger there is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from core.parallel_state import ParallelGroups
from core.pipeline_parallel.messages import ACTIVATION, GRADIENT, Link

_TAG = {(ACTIVATION, "shape"): 1, (ACTIVATION, "data"): 2, (GRADIENT, "shape"): 3, (GRADIENT, "data"): 4}
_VERBOSE = os.environ.get("TRIDENT_P2P_VERBOSE", "0") not in ("", "0")


class PipelineLinks:
    """This rank's directed links: ``groups[(src, dst)]`` is the two-rank group of pp ranks src -> dst.

    ``record(link, is_send, peer, key)`` is called for every post, in posting order (for tests and
    timelines).
    """

    def __init__(
        self,
        pp_rank: int,
        global_ranks: Sequence[int],
        groups: Mapping[Link, dist.ProcessGroup],
    ) -> None:
        self.pp_rank, self.global_ranks = pp_rank, list(global_ranks)
        self.groups = groups
        self.record: Callable[[Link, bool, int, object], None] | None = None
        self.batched = {
            link: dist.get_backend(group) == "nccl" for link, group in groups.items() if pp_rank in link
        }

    @classmethod
    def from_groups(cls, groups: ParallelGroups) -> PipelineLinks:
        """The links of this rank's pipeline, as ``initialize_model_parallel`` set them up."""
        return cls(groups.rank_in("pp"), groups.ranks["pp"], groups.pp_channels)

    @property
    def pp_size(self) -> int:
        return len(self.global_ranks)

    def post(
        self,
        is_send: bool,
        peer: int,
        tensor: torch.Tensor,
        kind: str,
        part: str = "data",
        key: object = None,
    ) -> dist.Work:
        """Post one send to, or receive from, pipeline rank ``peer`` on their link; returns its request."""
        link = (self.pp_rank, peer) if is_send else (peer, self.pp_rank)
        group = self.groups[link]
        if self.record is not None:
            self.record(link, is_send, peer, key)
        if _VERBOSE:
            # One write per line, so that lines of ranks sharing the launcher's stderr never merge.
            sys.stderr.write(
                f"[p2p rank {dist.get_rank()}] {'send' if is_send else 'recv'} {kind}/{part} "
                f"{'->' if is_send else '<-'} {self.global_ranks[peer]} {tuple(tensor.shape)} {key or ''}\n"
            )
            sys.stderr.flush()
        op, tag, other = (dist.isend if is_send else dist.irecv), _TAG[(kind, part)], self.global_ranks[peer]
        if self.batched[link]:
            (work,) = dist.batch_isend_irecv([dist.P2POp(op, tensor, other, group, tag)])
            return work
        return op(tensor, other, group=group, tag=tag)

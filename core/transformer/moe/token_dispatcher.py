"""Token dispatchers: bring each token to the ranks holding its experts, and the results back.

Both dispatchers hand the experts one ``[tokens, h]`` tensor sorted by local expert (expert ``j``'s
tokens are rows ``sum(counts[:j]) : sum(counts[:j+1])``), and both apply the routing
probabilities at the end, on the rank the token came from: ``out[t] = sum_e probs[t, e] * y_e(t)``,
so the experts see plain tokens and ``combine`` adds each token's experts in global expert order.

* ``alltoall`` (Megatron's MoEAlltoAllTokenDispatcher): tokens are sorted by global expert,
  exchanged with one ``all_to_all`` over the expert-parallel group (rank ``p`` sends the tokens of
  the experts ``p'`` holds), regrouped from (source rank, expert) to (expert, source rank), and the
  same way back. The counts per (rank, expert) are all-gathered first: the splits must be known
  on the host.
* ``allgather`` (Megatron's MoEAllGatherTokenDispatcher): every rank all-gathers the tokens,
  probabilities and routing of its group, computes its experts' share, and a reduce-scatter sums
  the shares back onto the tokens' own ranks.

With an expert-parallel group of one both are a permutation on one rank: nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core.parallel_state import group_rank, group_size
from core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from core.tensor_parallel.utils import all_gather_single


class _AllToAll(torch.autograd.Function):
    """Rows ``input_splits[p]`` go to rank ``p``; ``output_splits[p]`` arrive from it. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), ctx.group, input_splits, output_splits), None, None, None


def all_to_all(
    x: torch.Tensor, group: ProcessGroup | None, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` with uneven splits along dim 0 (identity without a group)."""
    if group is None:
        return x
    return _AllToAll.apply(x, group, output_splits, input_splits)


def sort_chunks(x: torch.Tensor, sizes: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x`` cut along dim 0 into chunks of ``sizes`` (in row-major order of ``sizes``' flat view),
    reassembled in ``order``."""
    chunks = torch.split(x, sizes.reshape(-1).tolist(), dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


@dataclass
class DispatchPlan:
    """What ``combine`` needs to undo one ``dispatch``."""

    token_index: torch.Tensor
    """Row of each dispatched (token, expert) pair in this rank's tokens (or in the gathered ones)."""
    probs: torch.Tensor
    """The routing probability of each pair, in the same order (autograd flows into the router)."""
    num_tokens: int
    counts: torch.Tensor | None = None
    """alltoall: pairs per (source rank, local expert) as received, ``[ep, local experts]``."""
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None


def _permute(routing_map: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert, then token: ``(token_index, probs of the pairs)``."""
    expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
    return token_index, probs[token_index, expert_index]


def _unpermute(y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``out[t] = sum over t's pairs of prob * y`` (pairs added in expert order)."""
    weighted = y * plan.probs.unsqueeze(-1).to(y.dtype)
    out = y.new_zeros((plan.num_tokens, y.shape[-1]))
    return out.index_add(0, plan.token_index, weighted)


class AllToAllTokenDispatcher:
    """Megatron's ``alltoall`` dispatcher over the expert-parallel group ``group``."""

    def __init__(self, num_experts: int, group: ProcessGroup | None) -> None:
        self.num_experts, self.group = num_experts, group
        self.ep = group_size(group)
        self.ep_rank = group_rank(group)
        self.num_local_experts = num_experts // self.ep

    def dispatch(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        """``tokens`` ``[t, h]`` -> (this rank's experts' input sorted by expert, tokens per local expert, plan)."""
        token_index, pair_probs = _permute(routing_map, probs)
        per_expert = routing_map.sum(dim=0)
        plan = DispatchPlan(token_index, pair_probs, tokens.shape[0])
        permuted = tokens.index_select(0, token_index)
        if self.group is None:
            return permuted, per_expert.tolist(), plan
        gathered = per_expert.new_empty(self.ep * self.num_experts)
        all_gather_single(gathered, per_expert, group=self.group)
        gathered = gathered.view(self.ep, self.num_experts)
        mine = slice(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)
        plan.counts = gathered[:, mine].cpu()  # [source rank, local expert]
        plan.send_splits = per_expert.view(self.ep, self.num_local_experts).sum(dim=1).tolist()
        plan.recv_splits = plan.counts.sum(dim=1).tolist()
        received = all_to_all(permuted, self.group, plan.recv_splits, plan.send_splits)
        by_expert = sort_chunks(received, plan.counts, self._to_expert_major())
        return by_expert, plan.counts.sum(dim=0).tolist(), plan

    def combine(self, expert_output: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The experts' output (in ``dispatch``'s order) -> ``[t, h]`` for this rank's tokens."""
        if self.group is not None:
            by_rank = sort_chunks(expert_output, plan.counts.t(), self._to_rank_major())
            expert_output = all_to_all(by_rank, self.group, plan.send_splits, plan.recv_splits)
        return _unpermute(expert_output, plan)

    def _to_expert_major(self) -> list[int]:
        """Chunk order (source rank, expert) -> (expert, source rank), chunks numbered rank-major."""
        return [p * self.num_local_experts + j for j in range(self.num_local_experts) for p in range(self.ep)]

    def _to_rank_major(self) -> list[int]:
        """The inverse: chunks numbered expert-major, reassembled rank-major."""
        return [j * self.ep + p for p in range(self.ep) for j in range(self.num_local_experts)]


class AllGatherTokenDispatcher:
    """Megatron's ``allgather`` dispatcher over the expert-parallel group ``group``."""

    def __init__(self, num_experts: int, group: ProcessGroup | None) -> None:
        self.num_experts, self.group = num_experts, group
        ep = group_size(group)
        rank = group_rank(group)
        self.num_local_experts = num_experts // ep
        self.local = slice(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)

    def dispatch(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        if self.group is not None:
            tokens = gather_from_sequence_parallel_region(tokens, True, self.group)
            probs = gather_from_sequence_parallel_region(probs, True, self.group)
            routing_map = _gather_rows(routing_map, self.group)
        local_map = routing_map[:, self.local]
        token_index, pair_probs = _permute(local_map, probs[:, self.local])
        plan = DispatchPlan(token_index, pair_probs, tokens.shape[0])
        return tokens.index_select(0, token_index), local_map.sum(dim=0).tolist(), plan

    def combine(self, expert_output: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        out = _unpermute(expert_output, plan)
        if self.group is None:
            return out
        return reduce_scatter_to_sequence_parallel_region(out, self.group)


def _gather_rows(mask: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """A boolean ``[t, e]`` gathered along dim 0 over ``group`` (no gradient)."""
    as_int = mask.to(torch.uint8)
    out = as_int.new_empty((dist.get_world_size(group) * mask.shape[0], mask.shape[1]))
    all_gather_single(out, as_int.contiguous(), group=group)
    return out.bool()


def build_token_dispatcher(kind: str, num_experts: int, group: ProcessGroup | None):
    """The dispatcher ``--moe-token-dispatcher-type`` names."""
    if kind == "alltoall":
        return AllToAllTokenDispatcher(num_experts, group)
    if kind == "allgather":
        return AllGatherTokenDispatcher(num_experts, group)
    raise ValueError(f"moe_token_dispatcher_type must be 'alltoall' or 'allgather', got {kind!r}")

"""Which global ranks form each process group, from the sizes and the order: pure maths, no processes.

Every global rank is a point on a grid whose axes are named by ``order`` (Megatron's default
``"tp-cp-ep-dp-pp"``), the first axis varying fastest; a group holds the ranks that differ only
along its axes (see :mod:`core.parallel_state`, which creates the groups these functions describe).
:func:`generate_parallel_groups` gives Megatron's dense groups, :func:`generate_expert_groups`
megatron-core's second decomposition for MoE layers, :func:`generate_instance_groups` the
distributed optimizer's instances (HSDP) and :func:`generate_expert_instance_groups` the same split of the
expert data-parallel groups, :func:`pipeline_channels` the two-rank link
groups of a pipeline and :func:`link_warm_up_order` the one order in which all ranks warm them up.
Tested without processes; the planner and the rendezvous checker use them too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_AXES = ("tp", "cp", "ep", "dp", "pp")

# Group name -> the grid axes its members differ along. The dict order is the order in which every
# rank creates the groups (torch requires all ranks to create all groups in one order); it follows
# Megatron's initialize_model_parallel. The embedding groups are derived from the pp groups.
_GROUP_AXES: dict[str, tuple[str, ...]] = {
    "dp_cp": ("dp", "cp"),
    "dp": ("dp",),
    "cp": ("cp",),
    "mp": ("tp", "pp"),
    "tp": ("tp",),
    "pp": ("pp",),
    "tp_dp_cp": ("tp", "dp", "cp"),
    "tp_dp": ("tp", "dp"),
}
GROUP_NAMES: tuple[str, ...] = (*_GROUP_AXES, "embd", "pos_embd")

# Expert groups (megatron-core's second decomposition of the same ranks, for MoE layers): the grid
# axes are expert-tensor (tp), expert-model (ep), expert-data (dp) and pp, in the same ``order``, with
# cp of size 1. Creation order follows megatron-core's initialize_model_parallel.
_EXPERT_GROUP_AXES: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("tp",),
    "expt_tp_ep": ("tp", "ep"),
    "expt_tp_ep_pp": ("tp", "ep", "pp"),
    "expt_dp": ("dp",),
}
EXPERT_GROUP_NAMES: tuple[str, ...] = ("tp_cp", *_EXPERT_GROUP_AXES)
"""The groups MoE layers need: ``tp_cp`` (the dense grid's tensor x context: ranks sharing one
sequence, over which a router counts tokens per expert) and the expert groups."""


def _parse_order(order: str) -> tuple[str, ...]:
    """Split and check ``order``: all five axes, once each, so every rank maps to one grid point."""
    names = tuple(order.lower().split("-"))
    if sorted(names) != sorted(_AXES):
        raise ValueError(
            f"order {order!r} must name each of tp, cp, ep, dp, pp exactly once, "
            f"joined by '-' (Megatron's default is {DEFAULT_ORDER!r})"
        )
    return names


def _offsets(axes: Sequence[tuple[int, int]]) -> list[int]:
    """Every rank offset reachable along ``axes`` ((size, stride) pairs), the first axis fastest."""
    offsets = [0]
    for size, stride in axes:
        offsets = [offset + index * stride for index in range(size) for offset in offsets]
    return offsets


def _orthogonal_groups(
    sizes: Mapping[str, int], order: Sequence[str], members: Sequence[str]
) -> list[list[int]]:
    """Partition the grid into groups whose ranks differ only along the ``members`` axes.

    Same enumeration as Megatron's generate_masked_orthogonal_rank_groups: groups are numbered by
    the other axes and ranks within a group by the member axes, in ``order`` with the first fastest.
    """
    inside, outside, stride = [], [], 1
    for axis in order:
        (inside if axis in members else outside).append((sizes[axis], stride))
        stride *= sizes[axis]
    within = _offsets(inside)
    return [[base + offset for offset in within] for base in _offsets(outside)]


def embedding_ranks(pipeline_ranks: Sequence[int]) -> list[int]:
    """Ranks holding a copy of the word embedding: the first and the last pipeline stage."""
    return [pipeline_ranks[0]] if len(pipeline_ranks) == 1 else [pipeline_ranks[0], pipeline_ranks[-1]]


def position_embedding_ranks(pipeline_ranks: Sequence[int]) -> list[int]:
    """Ranks holding the learned position embedding: the first pipeline stage only."""
    return [pipeline_ranks[0]]


def pipeline_channels(pipeline_size: int) -> list[tuple[int, int]]:
    """The directed links of one pipeline group as (source pp rank, destination pp rank), in creation order.

    Each rank and the next, both ways, including the wrap-around pair of the last rank and the
    first that virtual stages use.
    """
    channels: list[tuple[int, int]] = []
    for r in range(pipeline_size if pipeline_size > 2 else pipeline_size - 1):
        channels += [(r, (r + 1) % pipeline_size), ((r + 1) % pipeline_size, r)]
    return channels


def link_warm_up_order(pipelines: Sequence[Sequence[int]]) -> list[tuple[int, int, int, int]]:
    """Every pipeline link of the job as ``(src, dst)`` in global ranks, with its pipeline's pp ranks
    ``(src_pp, dst_pp)``: the one order in which all ranks warm their links up.

    Pipelines in ``layout["pp"]`` order, each one's links in :func:`pipeline_channels` order. A rank
    warms up only its own links, in this order. That cannot deadlock, whatever blocks: the first
    link in the order that is not yet done has both its ranks done with every earlier link, so both
    are at it, and it completes.
    """
    order = []
    for members in pipelines:
        for src, dst in pipeline_channels(len(members)):
            order.append((members[src], members[dst], src, dst))
    return order


def _check_size(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def generate_parallel_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
) -> dict[str, list[list[int]]]:
    """All groups of every kind for these sizes, as lists of global ranks (Megatron's layout).

    Keys: ``tp``, ``cp``, ``dp``, ``pp``, ``dp_cp`` (data parallel with context parallel folded
    in: what gradients are reduced over), ``mp`` (tp x pp: one model replica), ``tp_dp``,
    ``tp_dp_cp`` (tensor-and-data), ``embd`` (first and last rank of each pipeline group) and
    ``pos_embd`` (first rank of each pipeline group). The data-parallel size is what the other
    sizes leave of ``world_size``; expert parallelism is a size-1 axis of ``order``.

    Raises ValueError, before anything is created, for sizes < 1, a malformed ``order`` or a world
    size the sizes do not divide: the same inputs fail the same way on every rank.
    """
    for name, value in (
        ("world_size", world_size),
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
    ):
        _check_size(name, value)
    axes = _parse_order(order)
    model_size = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_size:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size ({pipeline_model_parallel_size}) "
            f"x context_parallel_size ({context_parallel_size}) = {model_size}"
        )
    sizes = {
        "tp": tensor_model_parallel_size,
        "cp": context_parallel_size,
        "ep": 1,
        "dp": world_size // model_size,
        "pp": pipeline_model_parallel_size,
    }
    groups = {name: _orthogonal_groups(sizes, axes, members) for name, members in _GROUP_AXES.items()}
    groups["embd"] = [embedding_ranks(ranks) for ranks in groups["pp"]]
    groups["pos_embd"] = [position_embedding_ranks(ranks) for ranks in groups["pp"]]
    return groups


def _expert_sizes(
    world_size: int, expert_tensor_parallel_size: int, expert_model_parallel_size: int, pipeline_size: int
) -> dict[str, int]:
    """The expert grid's axis sizes (etp, cp=1, ep, edp, pp); ValueError where they do not divide the world."""
    for name, value in (
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("expert_tensor_parallel_size", expert_tensor_parallel_size),
    ):
        _check_size(name, value)
    expert_model_size = expert_tensor_parallel_size * expert_model_parallel_size * pipeline_size
    if world_size % expert_model_size:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size "
            f"({expert_tensor_parallel_size}) x expert_model_parallel_size ({expert_model_parallel_size}) "
            f"x pipeline_model_parallel_size ({pipeline_size}) = {expert_model_size}"
        )
    return {
        "tp": expert_tensor_parallel_size,
        "cp": 1,
        "ep": expert_model_parallel_size,
        "dp": world_size // expert_model_size,
        "pp": pipeline_size,
    }


def generate_expert_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
) -> dict[str, list[list[int]]]:
    """The expert groups of megatron-core for these sizes, as lists of global ranks.

    megatron-core lays the same ranks out a second time for MoE layers: expert-tensor (etp) x
    expert-model (ep) x expert-data (edp) x pp, in the same ``order`` with a cp axis of size 1, so
    with the default order ``rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))``
    and ``edp = world / (etp * ep * pp)``. Keys: ``tp_cp`` (from the dense grid, see
    ``EXPERT_GROUP_NAMES``), ``ep`` (ranks holding different experts of one
    layer: the all-to-all group), ``expt_tp``, ``expt_tp_ep``, ``expt_tp_ep_pp`` (one expert
    replica: gradient norms over experts) and ``expt_dp`` (replicas of the same experts: expert
    gradients are reduced over it). Raises ValueError, before anything is created, where
    megatron-core would refuse: etp x ep x pp not dividing the world, or an order with pp before dp
    whose expert and dense pipeline groups differ.
    """
    dense = generate_parallel_groups(
        world_size, tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size, order
    )
    sizes = _expert_sizes(
        world_size, expert_tensor_parallel_size, expert_model_parallel_size, pipeline_model_parallel_size
    )
    axes = _parse_order(order)
    dense_dp = len(dense["dp"][0])
    if axes[-1] != "pp" and pipeline_model_parallel_size > 1 and sizes["dp"] != dense_dp:
        raise ValueError(
            f"with order {order!r} (pp not last) the expert data-parallel size ({sizes['dp']}) must "
            f"equal the data-parallel size ({dense_dp}), as megatron-core requires"
        )
    dense_sizes = {"tp": tensor_model_parallel_size, "cp": context_parallel_size, "ep": 1, "dp": dense_dp}
    dense_sizes["pp"] = pipeline_model_parallel_size
    groups = {"tp_cp": _orthogonal_groups(dense_sizes, axes, ("tp", "cp"))}
    groups |= {name: _orthogonal_groups(sizes, axes, members) for name, members in _EXPERT_GROUP_AXES.items()}
    if _orthogonal_groups(sizes, axes, ("pp",)) != dense["pp"]:
        raise ValueError(
            f"with order {order!r} the expert layers' pipeline groups would differ from the dense "
            f"layers' (tensor x context = {tensor_model_parallel_size * context_parallel_size}, expert "
            f"tensor x expert model = {expert_tensor_parallel_size * expert_model_parallel_size}); put pp "
            "last in the order or make the two products equal"
        )
    return groups


INSTANCE_GROUP_NAMES: tuple[str, ...] = ("intra_dp_cp", "inter_dp_cp", "intra_dist_opt")
"""The groups of ``num_distributed_optimizer_instances`` > 1 (see :func:`generate_instance_groups`)."""


def generate_instance_groups(
    dp_cp_groups: Sequence[Sequence[int]], num_instances: int
) -> dict[str, list[list[int]]]:
    """The groups of a distributed optimizer replicated ``num_instances`` times (megatron-core's
    ``--num-distributed-optimizer-instances``; HSDP under Megatron-FSDP), from the data-parallel x
    context-parallel groups.

    Each data-parallel group (in group-rank order) is cut into ``num_instances`` consecutive blocks of
    DPxCP / N ranks, as megatron-core does, so an instance is a contiguous stretch of the DP axis
    (neighbouring ranks: one node when DP is innermost after TP and CP). Keys: ``intra_dp_cp`` (one
    block: the ranks a bucket is sharded over, megatron-core's intra-partial data-parallel group),
    ``inter_dp_cp`` (the ranks at the same position of every block: the replicas of one shard, over
    which the reduced shards are all-reduced, megatron-core's inter-instance group) and
    ``intra_dist_opt`` (every rank of one instance across TP, PP and CP: the shards of one whole
    optimizer, over which gradient norms are summed; in megatron-core's order, block position by block
    position). Raises ValueError, before anything is created, where N does not divide DPxCP.
    """
    block = _instance_block(dp_cp_groups, num_instances, "data-parallel size x context-parallel size")
    intra = [list(g[i * block : (i + 1) * block]) for g in dp_cp_groups for i in range(num_instances)]
    inter = [list(g[k::block]) for g in dp_cp_groups for k in range(block)]
    instances = [
        [rank for at in range(i * block, (i + 1) * block) for rank in sorted(g[at] for g in dp_cp_groups)]
        for i in range(num_instances)
    ]
    return {"intra_dp_cp": intra, "inter_dp_cp": inter, "intra_dist_opt": instances}


def _instance_block(groups: Sequence[Sequence[int]], num_instances: int, what: str) -> int:
    """The ranks of one instance in each of ``groups`` (each group's size / ``num_instances``); refuses
    a ``num_instances`` that does not divide that size, naming it as ``what``."""
    _check_size("num_distributed_optimizer_instances", num_instances)
    size = len(groups[0])
    if size % num_instances:
        raise ValueError(
            f"num_distributed_optimizer_instances ({num_instances}) must divide the {what} ({size})"
        )
    return size // num_instances


EXPERT_INSTANCE_GROUP_NAMES: tuple[str, ...] = ("intra_expt_dp", "inter_expt_dp")
"""The expert groups of ``num_distributed_optimizer_instances`` > 1 (see
:func:`generate_expert_instance_groups`)."""
SHARED_GROUPS: dict[str, str] = {"inter_expt_dp": "inter_dp_cp"}
"""Group name -> the group it is made as: megatron-core gives the dense and the expert layers one
inter-instance group (its ``get_inter_distributed_optimizer_instance_group`` returns the expert one)."""


def _hierarchical(ranks: Sequence[int], sizes: Sequence[int]) -> list[list[list[int]]]:
    """megatron-core's ``create_hierarchical_groups`` as rank lists: ``ranks`` (prod(sizes) of them) cut
    into groups of ``sizes[level]`` at each level, level 0 the consecutive ranks and each next level
    the ranks a stride of the levels below apart (sizes [2, 2] of 0..3: [0, 1] [2, 3], then [0, 2] [1, 3])."""
    levels = []
    for level, size in enumerate(sizes):
        below, above = math.prod(sizes[:level]), math.prod(sizes[level + 1 :])
        levels.append(
            [
                [ranks[(outer * size + k) * below + inner] for k in range(size)]
                for outer in range(above)
                for inner in range(below)
            ]
        )
    return levels


def generate_expert_instance_groups(
    expt_dp_groups: Sequence[Sequence[int]],
    inter_dp_cp_groups: Sequence[Sequence[int]],
    num_instances: int,
) -> dict[str, list[list[int]]]:
    """The expert data-parallel groups of a distributed optimizer replicated ``num_instances`` times, as
    megatron-core makes them: ``create_hierarchical_groups(rank, ranks, [EDP / N, N])`` over each expert
    data-parallel group. Keys: ``intra_expt_dp`` (EDP / N consecutive ranks of the group: what expert
    buckets are sharded over, megatron-core's intra-partial expert data-parallel group) and
    ``inter_expt_dp`` (the N ranks a block apart: the replicas of one expert shard, its inter-partial
    expert data-parallel group).

    megatron-core shares the inter group with the dense layers, which works because the two are the same
    ranks (so each rank sits in the same instance for both; gradient norms summed over an instance and
    the first instance's checkpoint writes cover the experts once): ``inter_dp_cp_groups`` must hold the
    same groups. Raises ValueError, before anything is created, where N does not divide the expert
    data-parallel size, or where the two inter groups would differ (never with megatron-core's orders,
    tp-cp-ep-dp-pp and tp-cp-ep-pp-dp; some others, such as cp before tp, would split them differently).
    """
    block = _instance_block(expt_dp_groups, num_instances, "expert data-parallel size")
    intra, inter = [], []
    for ranks in expt_dp_groups:
        inner, outer = _hierarchical(ranks, [block, num_instances])
        intra += inner
        inter += outer
    if sorted(inter) != sorted(list(g) for g in inter_dp_cp_groups):
        raise ValueError(
            "the expert layers' distributed-optimizer instances would differ from the dense layers' "
            f"(inter-instance groups {sorted(inter)} and {sorted(list(g) for g in inter_dp_cp_groups)}); "
            "use megatron-core's order tp-cp-ep-dp-pp or tp-cp-ep-pp-dp"
        )
    return {"intra_expt_dp": intra, "inter_expt_dp": inter}

"""Tensor, pipeline, data, context and expert parallel process groups, laid out exactly as Megatron-LM does.

Every global rank is a point on a grid whose axes are named by ``order`` (Megatron's default
``"tp-cp-ep-dp-pp"``), the first axis varying fastest::

    rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

A group of kind ``"tp-pp"`` (say) holds the ranks that differ only along the tp and pp axes. Keeping
tensor parallelism innermost puts each TP group on neighbouring ranks (one node, the fast links);
pipeline parallelism outermost sends only activations between nodes. Megatron's documented example,
16 ranks with TP=2 and PP=4, gives TP groups [0,1] [2,3] ... [14,15], PP groups [0,4,8,12]
[1,5,9,13] [2,6,10,14] [3,7,11,15] and DP groups [0,2] [1,3] [4,6] ... [13,15].

The group maths is pure and lives in :mod:`core.rank_groups` (:func:`generate_parallel_groups`,
tested without processes; importable from here too).
:func:`initialize_model_parallel` creates those groups and keeps this rank's in one
:class:`ParallelGroups` object, which the engine may be handed directly; the Megatron-named getters
below read that object, so code written against ``megatron.core.parallel_state`` reads naturally here.
Module state is that object plus the virtual-pipeline rank and size, nothing else.

Pipeline channels. Besides Megatron's groups, every directed link between neighbouring pipeline
ranks gets a two-rank group of its own: ``r -> r + 1`` and ``r + 1 -> r``, with ``r + 1`` wrapping
around to rank 0 (virtual stages; ZBV's V runs its second chunk back up the ranks, so both
directions carry activations and gradients). The pipeline executor posts each message on its
link's group, in the order the sender sends. NCCL runs the operations of one group in order on one
stream, and a send completes only once its receive is posted; with a single pipeline group, a
receive posted ahead of need would hold up every later send of that rank. One group per link makes
each link a first-in-first-out queue that nothing else waits behind (see
``core/pipeline_parallel/lowering.py``). That is ``2 * pp`` more groups per pipeline (2 at PP=2);
two-rank groups are cheap, and PyTorch itself creates one per pair of ranks for unbatched NCCL
send/recv. Every link exchanges one message at startup (:func:`warm_up_pipeline_links`), in one
global order, so NCCL's blocking communicator setup never happens inside a schedule.
"""

from __future__ import annotations

import atexit
import inspect
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, TCPStore
from torch.distributed.constants import default_pg_timeout

from core import flight_recorder
from core.device import bind_local_device, current_device, default_backend, local_device
from core.rank_groups import (  # the group maths, kept importable from here as in Megatron
    DEFAULT_ORDER,
    EXPERT_GROUP_NAMES,
    EXPERT_INSTANCE_GROUP_NAMES,
    GROUP_NAMES,
    INSTANCE_GROUP_NAMES,
    SHARED_GROUPS,
    _check_size,
    generate_expert_groups,
    generate_expert_instance_groups,
    generate_instance_groups,
    generate_parallel_groups,
    link_warm_up_order,
    pipeline_channels,
)

_NOT_INITIALIZED = "model parallel groups are not initialized; call initialize_model_parallel(...)"


def warm_up_pipeline_links(
    rank: int, pipelines: Sequence[Sequence[int]], channels: Mapping[tuple[int, int], ProcessGroup]
) -> None:
    """One exchange per pipeline link of this rank, in :func:`link_warm_up_order`: its communicator
    exists before any schedule runs.

    NCCL creates a group's communicator at the group's first operation, blocking both ranks until
    both arrive. Left to the schedule, that first operation would come in schedule order, which the
    rendezvous checker does not model (Megatron's interleaved schedule deadlocked in exactly this
    way). Each end posts a send and a receive as one batch on NCCL (the form the schedule posts, so
    the same communicator), plain isend/irecv elsewhere, and waits. It runs on gloo too: the code
    path is the same and the cost is a few small messages at startup.
    """
    device = current_device()
    for src, dst, src_pp, dst_pp in link_warm_up_order(pipelines):
        if rank not in (src, dst) or src == dst:
            continue
        group, peer = channels[(src_pp, dst_pp)], dst if rank == src else src
        out, into = torch.zeros(1, device=device), torch.empty(1, device=device)
        if dist.get_backend(group) == "nccl":
            ops = [dist.P2POp(dist.isend, out, peer, group), dist.P2POp(dist.irecv, into, peer, group)]
            works = dist.batch_isend_irecv(ops)
        else:
            works = [dist.isend(out, peer, group=group), dist.irecv(into, peer, group=group)]
        for work in works:
            work.wait()


# --------------------------------------------------------------------------------------------------
# This rank's groups
# --------------------------------------------------------------------------------------------------


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` (an optional group a layer was not given) is this rank alone."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's position in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's process groups and their members: everything the engine needs to communicate.

    One immutable object instead of Megatron's dozens of globals, so that a model, schedule or
    optimizer can be handed its groups explicitly (and tests can build several). ``embd`` and
    ``pos_embd`` are None on ranks that hold no embedding (their ``ranks`` entry is empty).
    """

    rank: int
    """This process's global rank."""
    tp: ProcessGroup = field(repr=False)
    pp: ProcessGroup = field(repr=False)
    dp: ProcessGroup = field(repr=False)
    cp: ProcessGroup = field(repr=False)
    dp_cp: ProcessGroup = field(repr=False)
    mp: ProcessGroup = field(repr=False)
    tp_dp: ProcessGroup = field(repr=False)
    tp_dp_cp: ProcessGroup = field(repr=False)
    embd: ProcessGroup | None = field(repr=False)
    pos_embd: ProcessGroup | None = field(repr=False)
    ranks: Mapping[str, tuple[int, ...]]
    """Group name -> global ranks of this rank's group of that kind, in group-rank order."""
    pp_channels: Mapping[tuple[int, int], ProcessGroup] = field(
        default_factory=lambda: MappingProxyType({}), repr=False
    )
    """(source pp rank, destination pp rank) -> two-rank group, for this rank's pipeline links."""
    tp_cp: ProcessGroup | None = field(default=None, repr=False)
    """Tensor x context parallel: the ranks sharing one sequence."""
    ep: ProcessGroup | None = field(default=None, repr=False)
    """Expert model parallel: ranks holding different experts of a layer (tokens travel over it)."""
    expt_tp: ProcessGroup | None = field(default=None, repr=False)
    """Expert tensor parallel (size 1: experts are never split over tensor parallelism here)."""
    expt_tp_ep: ProcessGroup | None = field(default=None, repr=False)
    """Expert tensor x expert model parallel."""
    expt_tp_ep_pp: ProcessGroup | None = field(default=None, repr=False)
    """Expert tensor x model x pipeline: one replica of every expert."""
    expt_dp: ProcessGroup | None = field(default=None, repr=False)
    """Expert data parallel: the replicas of this rank's experts (their gradients are reduced over it)."""
    intra_dp_cp: ProcessGroup | None = field(default=None, repr=False)
    """With N distributed-optimizer instances (N > 1; None otherwise): this rank's block of DPxCP / N
    ranks of ``dp_cp``, over which buckets are sharded (megatron-core's intra-partial data-parallel
    group; see :func:`core.rank_groups.generate_instance_groups`)."""
    inter_dp_cp: ProcessGroup | None = field(default=None, repr=False)
    """With N instances: the N ranks holding the same shard, one per instance (the inter-instance group)."""
    intra_dist_opt: ProcessGroup | None = field(default=None, repr=False)
    """With N instances: every rank of this rank's instance (gradient norms are summed over it)."""
    intra_expt_dp: ProcessGroup | None = field(default=None, repr=False)
    """With N instances: this rank's block of EDP / N ranks of ``expt_dp``, over which expert buckets are
    sharded (megatron-core's intra-partial expert data-parallel group; see
    :func:`core.rank_groups.generate_expert_instance_groups`)."""
    inter_expt_dp: ProcessGroup | None = field(default=None, repr=False)
    """With N instances: the N replicas of this rank's expert shard; the same group as ``inter_dp_cp``
    (megatron-core shares one inter-instance group between the dense and the expert layers)."""

    @property
    def num_distributed_optimizer_instances(self) -> int:
        """N: how many times the distributed optimizer is replicated over data parallelism (1: not)."""
        return len(self.ranks.get("inter_dp_cp", ())) or 1

    def size(self, name: str) -> int:
        """Number of ranks in this rank's group ``name`` (e.g. ``"tp"``)."""
        return len(self.ranks[name])

    def rank_in(self, name: str) -> int:
        """This rank's position in its group ``name``."""
        return self.ranks[name].index(self.rank)


_GROUPS: ParallelGroups | None = None
_CREATED: list[ProcessGroup] = []  # every group this rank created, for destroy_model_parallel
_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: int | None = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: int | None = None


def initialize_distributed(timeout: timedelta | None = None) -> bool:
    """Start torch.distributed for this process if nobody has yet; True if this call started it.

    ``timeout`` bounds every collective of the default group (Megatron's
    ``--distributed-timeout-minutes``; torch's default when None).

    Under torchrun the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says where to meet;
    a plain ``python script.py`` becomes a world of one through a private file rendezvous, so the
    same code path runs on a laptop without a launcher. The backend is core.device's choice (NCCL
    where GPUs exist, gloo elsewhere). Under NCCL the process is bound to its own GPU first and the
    group is told so (``device_id``), which makes NCCL create its communicators now rather than
    inside the first collective. Whoever started it ends it with :func:`destroy_distributed`.
    """
    if dist.is_initialized():
        return False
    flight_recorder.enable()  # read when the groups are made
    backend = default_backend()
    options: dict = {"backend": backend, "timeout": timeout}
    if backend == "nccl":
        bind_local_device()
        if _ACCEPTS_DEVICE_ID:
            options["device_id"] = local_device()
    if all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _attempt_store(rank, world_size, timeout or default_pg_timeout)
        dist.init_process_group(store=store, rank=rank, world_size=world_size, **options)
        return True
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != 1:
        raise RuntimeError(
            f"WORLD_SIZE is {world_size} but RANK/MASTER_ADDR are not set; "
            "launch multi-process runs with torchrun"
        )
    rendezvous_dir = tempfile.mkdtemp(prefix="trident-rendezvous-")
    atexit.register(shutil.rmtree, rendezvous_dir, ignore_errors=True)
    dist.init_process_group(init_method=f"file://{rendezvous_dir}/store", rank=0, world_size=1, **options)
    return True


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> PrefixStore:
    """The job's store at MASTER_ADDR:MASTER_PORT, seen under this launch attempt's own prefix.

    torchrun restarts workers (``--max-restarts``) against the same store: its agent's, which
    outlives them. Without a prefix per attempt the new workers would read the dead attempt's keys
    (gloo's peer addresses among them) and try to connect to processes that no longer exist.
    ``TORCHELASTIC_RESTART_COUNT`` numbers the attempts; outside torchrun it is absent (attempt 0).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    global _JOB_STORE
    _JOB_STORE = store
    return attempt_store()


def attempt_store(attempt: int | None = None) -> PrefixStore | None:
    """The job's store under launch attempt ``attempt``'s prefix (default: this process's attempt); None
    when the job was not started from MASTER_ADDR (a world of one). A restarted run reads what the
    attempt before it left there (its heartbeats: when it stopped)."""
    if _JOB_STORE is None:
        return None
    if attempt is None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return PrefixStore(f"trident/attempt{attempt}", _JOB_STORE)


_JOB_STORE: TCPStore | None = None


# ``device_id`` (eager NCCL communicators) arrived in torch 2.3's init_process_group; pyproject allows 2.3.
_ACCEPTS_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters


def destroy_distributed() -> None:
    """Destroy the model-parallel groups and the default group (the end of a run).

    Without this, gloo's worker threads can outlive the interpreter and the process dies with
    "terminate called without an active exception" (SIGABRT) after the work is done.
    """
    global _JOB_STORE
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _JOB_STORE = None


def _create_groups(
    rank: int, layout: dict[str, list[list[int]]], timeout: timedelta | None
) -> tuple[dict[str, ProcessGroup | None], dict[str, tuple[int, ...]]]:
    """Create every group of ``layout`` (every rank creates all, in one order); this rank's and their members."""
    names = GROUP_NAMES + EXPERT_GROUP_NAMES + INSTANCE_GROUP_NAMES + EXPERT_INSTANCE_GROUP_NAMES
    mine: dict[str, ProcessGroup | None] = dict.fromkeys(names)
    # Instance groups exist only with N > 1 distributed-optimizer instances: no entry otherwise.
    ranks: dict[str, tuple[int, ...]] = dict.fromkeys(GROUP_NAMES + EXPERT_GROUP_NAMES, ())
    for name in names:
        shared = SHARED_GROUPS.get(name)  # the same ranks as groups made already (their maker checks)
        for members in layout.get(name, ()):
            if shared is not None:
                if rank in members:
                    mine[name], ranks[name] = mine[shared], tuple(members)
                continue
            group = dist.new_group(ranks=members, timeout=timeout)
            if rank in members:
                _CREATED.append(group)
                mine[name], ranks[name] = group, tuple(members)
    return mine, ranks


def _create_pipeline_channels(
    rank: int, pipeline_groups: list[list[int]], timeout: timedelta | None
) -> dict[tuple[int, int], ProcessGroup]:
    """The two-rank groups between pipeline stages (see :func:`pipeline_channels`) that hold this rank."""
    channels: dict[tuple[int, int], ProcessGroup] = {}
    for members in pipeline_groups:
        for src, dst in pipeline_channels(len(members)):
            group = dist.new_group(ranks=[members[src], members[dst]], timeout=timeout)
            if rank in (members[src], members[dst]):
                _CREATED.append(group)
                channels[(src, dst)] = group
    return channels


def _layout(
    world: int, sizes: tuple[int, int, int], expert_size: int, instances: int, order: str
) -> dict[str, list[list[int]]]:
    """Every group of the job by name (``sizes``: tp, pp, cp), the instance groups only for N > 1."""
    layout = generate_parallel_groups(world, *sizes, order)
    layout |= generate_expert_groups(world, *sizes, expert_size, 1, order)
    if instances != 1:
        layout |= generate_instance_groups(layout["dp_cp"], instances)
        layout |= generate_expert_instance_groups(layout["expt_dp"], layout["inter_dp_cp"], instances)
    return layout


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    distributed_timeout_minutes: float | None = None,
) -> ParallelGroups:
    """Create Megatron's process groups on every rank and keep this rank's; return them.

    Must be called by every rank with the same arguments (each rank creates every group, in one
    order, as torch requires). Starts torch.distributed first if needed (:func:`initialize_distributed`).
    Sizes must divide the world size; bad sizes or ``order`` raise ValueError on every rank before
    any group exists. The expert groups (:func:`generate_expert_groups`) are created too; experts
    are never split over tensor parallelism here, so ``expert_tensor_parallel_size`` must be 1 (None
    means 1, where megatron-core defaults to the tensor-parallel size).
    Unlike Megatron, a virtual pipeline size is accepted with a pipeline size of 1 (several chunks
    on one rank), which keeps single-rank runs on the same code path. ``distributed_timeout_minutes``
    bounds every collective on the new groups (torch's default when None), as in Megatron.
    ``num_distributed_optimizer_instances`` N > 1 also creates megatron-core's groups of a distributed
    optimizer replicated N times (:func:`core.rank_groups.generate_instance_groups`, and for the experts
    :func:`core.rank_groups.generate_expert_instance_groups`); N must divide DP x CP and the expert
    data-parallel size.
    """
    global _GROUPS, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if _GROUPS is not None:
        raise RuntimeError(
            "model parallel groups are already initialized; call destroy_model_parallel() first"
        )
    if expert_tensor_parallel_size not in (None, 1):
        raise ValueError(
            f"expert_tensor_parallel_size must be 1 (experts are not split over tensor parallelism), "
            f"got {expert_tensor_parallel_size!r}"
        )
    if virtual_pipeline_model_parallel_size is not None:
        _check_size("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
    initialize_distributed()
    bind_local_device()  # also when someone else started torch.distributed: each rank on its own GPU
    world = dist.get_world_size()
    sizes = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size)
    layout = _layout(world, sizes, expert_model_parallel_size, num_distributed_optimizer_instances, order)
    rank = dist.get_rank()
    timeout = None if distributed_timeout_minutes is None else timedelta(minutes=distributed_timeout_minutes)
    mine, ranks = _create_groups(rank, layout, timeout)
    channels = _create_pipeline_channels(rank, layout["pp"], timeout)
    warm_up_pipeline_links(rank, layout["pp"], channels)
    _GROUPS = ParallelGroups(
        rank=rank, ranks=MappingProxyType(ranks), pp_channels=MappingProxyType(channels), **mine
    )
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None if virtual_pipeline_model_parallel_size is None else 0
    return _GROUPS


def groups_or_default(groups: ParallelGroups | None = None) -> ParallelGroups | None:
    """``groups`` when a caller hands them in; else Megatron's default, the groups
    :func:`initialize_model_parallel` set up; else None (a process of one). The one place where the
    engine falls back on this module's globals."""
    if groups is not None:
        return groups
    return _GROUPS if dist.is_initialized() else None


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and not been undone)."""
    return _GROUPS is not None


def destroy_model_parallel() -> None:
    """Forget and destroy this rank's groups so that another layout can be initialised in-process."""
    global _GROUPS, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _GROUPS = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
    if dist.is_initialized():
        for group in _CREATED:
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    _CREATED.clear()


def get_parallel_groups() -> ParallelGroups:
    """This rank's :class:`ParallelGroups`, to hand to code that takes its groups explicitly."""
    if _GROUPS is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return _GROUPS


# --------------------------------------------------------------------------------------------------
# Megatron-named getters
# --------------------------------------------------------------------------------------------------


def get_tensor_model_parallel_group() -> ProcessGroup:
    """Group sharing one layer's weight shards."""
    return get_parallel_groups().tp


def get_pipeline_model_parallel_group() -> ProcessGroup:
    """Group forming one pipeline (one rank per stage)."""
    return get_parallel_groups().pp


def get_pipeline_model_parallel_channel_groups() -> Mapping[tuple[int, int], ProcessGroup]:
    """This rank's pipeline links: (source pp rank, destination pp rank) -> two-rank group."""
    return get_parallel_groups().pp_channels


def get_data_parallel_group(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> ProcessGroup:
    """Replicas of the same shard; with context parallel, the group gradients are reduced over; with
    ``partial_data_parallel`` (and context parallel, as megatron-core requires) only this rank's
    distributed-optimizer instance of it (:func:`get_intra_partial_data_parallel_group`)."""
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError(
                "partial_data_parallel=True needs with_context_parallel=True (as in megatron-core)"
            )
        return get_intra_partial_data_parallel_group()
    groups = get_parallel_groups()
    return groups.dp_cp if with_context_parallel else groups.dp


def get_intra_partial_data_parallel_group() -> ProcessGroup:
    """The ranks buckets are sharded over: this rank's block of the DPxCP group with N distributed-optimizer
    instances, the whole DPxCP group without (megatron-core's ``get_data_parallel_group(
    with_context_parallel=True, partial_data_parallel=True)``)."""
    groups = get_parallel_groups()
    return groups.intra_dp_cp or groups.dp_cp


def get_inter_distributed_optimizer_instance_group() -> ProcessGroup:
    """The replicas of this rank's shard, one per distributed-optimizer instance (N > 1 only); dense and
    expert shards alike (megatron-core's inter-partial expert data-parallel group, the same ranks)."""
    group = get_parallel_groups().inter_dp_cp
    if group is None:
        raise RuntimeError("there is one distributed-optimizer instance: no inter-instance group")
    return group


def get_intra_distributed_optimizer_instance_group() -> ProcessGroup:
    """Every rank of this rank's distributed-optimizer instance (the world with one instance)."""
    return get_parallel_groups().intra_dist_opt or dist.group.WORLD


def get_context_parallel_group() -> ProcessGroup:
    """Group splitting one sequence for attention."""
    return get_parallel_groups().cp


def get_model_parallel_group() -> ProcessGroup:
    """All ranks holding one model replica (tp x pp)."""
    return get_parallel_groups().mp


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> ProcessGroup:
    """tp x dp (x cp): the ranks of one pipeline stage across all replicas."""
    groups = get_parallel_groups()
    return groups.tp_dp_cp if with_context_parallel else groups.tp_dp


def get_embedding_group() -> ProcessGroup:
    """First and last pipeline stage, which keep tied word embeddings in sync."""
    return _stage_group("embd", "an embedding group", "the first and last pipeline stages are")


def get_position_embedding_group() -> ProcessGroup:
    """The first pipeline stage of each pipeline (holder of the position embedding)."""
    return _stage_group("pos_embd", "a position-embedding group", "the first pipeline stage is")


def _stage_group(field: str, what: str, members: str) -> ProcessGroup:
    """A group only some pipeline stages belong to, or a RuntimeError naming who does."""
    groups = get_parallel_groups()
    group = getattr(groups, field)
    if group is None:
        raise RuntimeError(f"rank {groups.rank} is not in {what}; only {members}")
    return group


def get_tensor_model_parallel_world_size() -> int:
    """TP size."""
    return get_parallel_groups().size("tp")


def get_tensor_model_parallel_rank() -> int:
    """This rank's position in its TP group."""
    return get_parallel_groups().rank_in("tp")


def get_pipeline_model_parallel_world_size() -> int:
    """PP size (number of pipeline stages, not counting virtual chunks)."""
    return get_parallel_groups().size("pp")


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return get_parallel_groups().rank_in("pp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """DP size (x CP size if asked); 1 in a process without torch.distributed, as Megatron allows."""
    if not dist.is_initialized():
        return 1
    return get_parallel_groups().size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's position in its DP (or DP x CP) group; 0 without torch.distributed."""
    if not dist.is_initialized():
        return 0
    return get_parallel_groups().rank_in("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_world_size() -> int:
    """CP size; 1 in a process without torch.distributed."""
    return get_parallel_groups().size("cp") if dist.is_initialized() else 1


def get_context_parallel_rank() -> int:
    """This rank's position in its CP group; 0 without torch.distributed."""
    return get_parallel_groups().rank_in("cp") if dist.is_initialized() else 0


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of my TP group (the one that broadcasts to the others)."""
    return get_parallel_groups().ranks["tp"][0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of my DP (or DP x CP) group."""
    return get_parallel_groups().ranks["dp_cp" if with_context_parallel else "dp"][0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of my pipeline."""
    return get_parallel_groups().ranks["pp"][0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of my pipeline."""
    return get_parallel_groups().ranks["pp"][-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage; the last stage's next is the first (the ring wraps)."""
    groups = get_parallel_groups()
    pipeline = groups.ranks["pp"]
    return pipeline[(groups.rank_in("pp") + 1) % len(pipeline)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage; the first stage's previous is the last."""
    groups = get_parallel_groups()
    pipeline = groups.ranks["pp"]
    return pipeline[(groups.rank_in("pp") - 1) % len(pipeline)]


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """Model chunk currently running on this rank (set by the schedules); None without interleaving."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Record which model chunk runs next; the schedules call this before each chunk's forward."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline rank; None without interleaving."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the number of model chunks per pipeline rank."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def _virtual_stage(vp_stage: int | None) -> int:
    return vp_stage if vp_stage is not None else (_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK or 0)


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the first pipeline stage (the embedding, the data's token ids).

    With ``ignore_virtual=False`` and interleaving, only the first model chunk of the first rank
    counts: ``vp_stage`` names the chunk, else the rank last set by the schedule.
    """
    vpp = _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if not ignore_virtual and vpp is not None and _virtual_stage(vp_stage) != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last pipeline stage (output head and loss); see the first-stage twin."""
    vpp = _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if not ignore_virtual and vpp is not None and _virtual_stage(vp_stage) != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank (or, with ``ignore_virtual=False``, this chunk) holds a word embedding copy.

    False before initialisation, as in Megatron.
    """
    if _GROUPS is None or _GROUPS.embd is None:
        return False
    if ignore_virtual:
        return True
    members = _GROUPS.ranks["embd"]
    if _GROUPS.rank == members[0] and is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
        return True
    return _GROUPS.rank == members[-1] and is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


# --------------------------------------------------------------------------------------------------
# Megatron-named getters of the expert groups
# --------------------------------------------------------------------------------------------------


def _expert_group(name: str) -> ProcessGroup:
    group = getattr(get_parallel_groups(), name)
    if group is None:
        raise RuntimeError(f"the group {name!r} was not created (groups built without the MoE groups)")
    return group


def _expert_size(name: str) -> int:
    """Size of this rank's expert group ``name``; 1 in a process without torch.distributed."""
    return get_parallel_groups().size(name) if dist.is_initialized() else 1


def _expert_rank(name: str) -> int:
    return get_parallel_groups().rank_in(name) if dist.is_initialized() else 0


def get_tensor_and_context_parallel_group() -> ProcessGroup:
    """TP x CP: the ranks sharing one sequence (a router's token counts are summed over it)."""
    return _expert_group("tp_cp")


def get_expert_model_parallel_group() -> ProcessGroup:
    """Ranks holding different experts of one MoE layer: the token dispatcher's group."""
    return _expert_group("ep")


def get_expert_model_parallel_world_size() -> int:
    """EP size (1 without torch.distributed)."""
    return _expert_size("ep")


def get_expert_model_parallel_rank() -> int:
    """This rank's position in its EP group: it holds experts ``[rank * E / EP, (rank + 1) * E / EP)``."""
    return _expert_rank("ep")


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of the first member of my EP group."""
    return get_parallel_groups().ranks["ep"][0]


def get_expert_tensor_parallel_group() -> ProcessGroup:
    """Ranks sharing one expert's weight shards (always one rank here: experts are not TP-split)."""
    return _expert_group("expt_tp")


def get_expert_tensor_parallel_world_size() -> int:
    """Expert TP size (1)."""
    return _expert_size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    """This rank's position in its expert TP group (0)."""
    return _expert_rank("expt_tp")


def get_expert_tensor_and_model_parallel_group() -> ProcessGroup:
    """Expert TP x EP: the all-gather dispatcher's group."""
    return _expert_group("expt_tp_ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Expert TP x EP size."""
    return _expert_size("expt_tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """This rank's position in its expert TP x EP group."""
    return _expert_rank("expt_tp_ep")


def get_expert_tensor_model_pipeline_parallel_group() -> ProcessGroup:
    """Expert TP x EP x PP: one replica of every expert of the model (expert gradient norms)."""
    return _expert_group("expt_tp_ep_pp")


def get_expert_data_parallel_group(partial_expert_data_parallel: bool = False) -> ProcessGroup:
    """Replicas of this rank's experts: expert gradients are reduced (and sharded) over it. With
    ``partial_expert_data_parallel`` only this rank's distributed-optimizer instance of it, over which
    expert buckets are sharded (the whole group with one instance), as in megatron-core."""
    return _expert_group(_expert_data_parallel_name(partial_expert_data_parallel))


def _expert_data_parallel_name(partial: bool) -> str:
    """``intra_expt_dp`` if asked for the partial group and there are N > 1 instances, else ``expt_dp``."""
    return "intra_expt_dp" if partial and get_parallel_groups().intra_expt_dp is not None else "expt_dp"


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Expert DP size: world / (expert TP x EP x PP), or with ``partial_expert_data_parallel`` that / N;
    1 without torch.distributed."""
    if not dist.is_initialized():
        return 1
    return _expert_size(_expert_data_parallel_name(partial_expert_data_parallel))


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """This rank's position in its expert DP group (or, ``partial_expert_data_parallel``, its instance's)."""
    if not dist.is_initialized():
        return 0
    return _expert_rank(_expert_data_parallel_name(partial_expert_data_parallel))

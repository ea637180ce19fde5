"""The process groups an MoE layer talks over, given explicitly or read from parallel_state once."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from core import parallel_state as ps
from core.parallel_state import ParallelGroups


@dataclass(frozen=True)
class MoEGroups:
    """``None`` means a group of one (a plain process, or a size-1 group): nothing is communicated."""

    ep: ProcessGroup | None = None
    """Expert model parallel: the ranks holding the layer's experts, in order (tokens travel over it)."""
    tp_cp: ProcessGroup | None = None
    """Tensor x context parallel: the ranks whose tokens make up one sequence (token counts per
    expert are summed over it for the load-balancing loss)."""
    tp: ProcessGroup | None = None
    """Tensor parallel, the model's (the shared experts are split over it). Unlike the groups above,
    None here means ``parallel_state``'s, Megatron's default (no group in a process of one)."""

    @classmethod
    def from_parallel_state(cls, expert_model_parallel_size: int = 1) -> MoEGroups:
        """This rank's groups from ``core.parallel_state`` (a layer built without its groups); all
        ``None`` in a process without groups, where every expert is local."""
        groups = ps.groups_or_default()
        return cls() if groups is None else cls.of(groups, expert_model_parallel_size)

    @classmethod
    def of(cls, groups: ParallelGroups | None, expert_model_parallel_size: int = 1) -> MoEGroups:
        """An MoE layer's groups among the model's (None: a process of one, every expert local). Their
        expert-parallel size must be the config's."""
        if groups is None:
            return cls()
        if groups.size("ep") != expert_model_parallel_size:
            raise ValueError(
                f"the model config says expert_model_parallel_size {expert_model_parallel_size} but the "
                f"process groups were initialised with {groups.size('ep')}"
            )
        return cls(ep=_or_none(groups.ep), tp_cp=_or_none(groups.tp_cp), tp=groups.tp)


def _or_none(group: ProcessGroup | None) -> ProcessGroup | None:
    return None if group is None or dist.get_world_size(group) == 1 else group

"""Which pipeline rank runs which stage: Megatron's loop, or the V that ZBV needs.

Which schedule needs which placement is a schedule's rule (:mod:`~core.pipeline_parallel.schedule_rules`).

There are ``pp_size * vpp_size`` stages, numbered in the order data flows through the model.

* ``"loop"`` (Megatron's virtual pipeline): stage ``s`` runs on ``pp_rank = s % pp_size`` as model
  chunk ``s // pp_size``, so activations travel rank 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ...
* ``"v"`` (zero-bubble ZBV, two chunks per rank): stage ``s < pp`` runs on rank ``s`` as chunk 0 and
  stage ``s >= pp`` on rank ``2 pp - 1 - s`` as chunk 1. Activations go down the ranks and come
  back up: rank pp-1 hands its first chunk's output to its own second chunk, and the last stage
  (output head and loss) sits on rank 0 next to the first (embedding), so tied embeddings are one
  Parameter on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOP = "loop"
"""Megatron's virtual pipeline: stage ``s`` on rank ``s % pp_size``."""
V = "v"
"""ZBV's V: the second half of the stages comes back up the ranks."""
PLACEMENTS = (LOOP, V)
V_CHUNKS = 2
"""Model chunks per pipeline rank in the V: one on the way down the ranks, one on the way back up."""


@dataclass(frozen=True)
class Placement:
    """Stage <-> (pp_rank, chunk) for one pipeline."""

    pp_size: int
    vpp_size: int = 1
    style: str = LOOP

    def __post_init__(self) -> None:
        if self.pp_size < 1 or self.vpp_size < 1:
            raise ValueError(
                f"pipeline size ({self.pp_size}) and virtual pipeline size ({self.vpp_size}) must be >= 1"
            )
        if self.style not in PLACEMENTS:
            raise ValueError(f"stage placement must be one of {PLACEMENTS}, got {self.style!r}")
        if self.style == V and self.vpp_size != V_CHUNKS:
            raise ValueError(
                f"the V placement (ZBV) runs exactly {V_CHUNKS} model chunks per pipeline rank, got {self.vpp_size}"
            )
        # Lookup tables: schedules ask these questions hundreds of thousands of times.
        where = [self._rank_and_chunk(s) for s in range(self.num_stages)]
        object.__setattr__(self, "_where", tuple(where))
        object.__setattr__(self, "_ranks", tuple(r for r, _ in where))
        stages = {rc: s for s, rc in enumerate(where)}
        object.__setattr__(self, "_stages", stages)

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vpp_size

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1

    def stage(self, pp_rank: int, chunk: int) -> int:
        """The stage that ``pp_rank`` runs as model chunk ``chunk``."""
        return self._stages[(pp_rank, chunk)]

    def rank_and_chunk(self, stage: int) -> tuple[int, int]:
        """(pp_rank, chunk) that runs ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside the {self.num_stages} stages of this pipeline")
        return self._where[stage]

    def rank(self, stage: int) -> int:
        return self._ranks[stage]

    def _rank_and_chunk(self, stage: int) -> tuple[int, int]:
        chunk, offset = divmod(stage, self.pp_size)
        if self.style == V and chunk == 1:
            return self.pp_size - 1 - offset, 1
        return offset, chunk

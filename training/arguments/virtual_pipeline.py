"""The virtual pipeline size from Megatron's three flags that may set it, and the schedule's chunks.

``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank`` or a
``--pipeline-model-parallel-layout`` with more stages than ranks: at most one of them, whose count the
schedule's record (``core.pipeline_parallel.schedule_rules``) must be able to run. Part of
:func:`training.arguments.checks.derive_args`, before any process group.
"""

from __future__ import annotations

import argparse

from core.pipeline_parallel.layout import parse_layout
from core.pipeline_parallel.schedule_rules import schedule_rule
from training.arguments.schema import flag_name as _flag

__all__ = ["derive_virtual_pipeline"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def derive_virtual_pipeline(args: argparse.Namespace, pp: int) -> None:
    """``args.virtual_pipeline_model_parallel_size`` from the one flag that sets it, checked against the
    schedule (Megatron allows at most one of the three)."""
    chosen = [
        _flag(d)
        for d in (
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "pipeline_model_parallel_layout",
        )
        if getattr(args, d) is not None
    ]
    _require(len(chosen) <= 1, f"{' and '.join(chosen)} are mutually exclusive: give at most one")
    vpp = args.num_virtual_stages_per_pipeline_rank
    if args.pipeline_model_parallel_layout is not None:
        try:
            vpp = parse_layout(
                args.pipeline_model_parallel_layout,
                pp,
                num_layers=args.num_layers,
                mtp_num_layers=0,
                placement=schedule_rule(args.pipeline_schedule).placement,
            ).vpp_size
        except ValueError as err:
            raise ValueError(f"--pipeline-model-parallel-layout: {err}") from None
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers_per_virtual_pipeline_stage
        _require(
            args.num_layers % pp == 0,
            f"--num-layers ({args.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) to use --num-layers-per-virtual-pipeline-stage",
        )
        per_rank = args.num_layers // pp
        _require(
            per_rank % per_stage == 0,
            f"layers per pipeline rank ({args.num_layers} / {pp} = "
            f"{per_rank}) must be divisible by --num-layers-per-virtual-pipeline-stage ({per_stage})",
        )
        vpp = per_rank // per_stage
    args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    rule = schedule_rule(args.pipeline_schedule)
    problem, needed = rule.chunks_problem(vpp or 1), rule.chunks
    _require(
        problem is None,
        f"--pipeline-schedule {rule.name} {problem}"
        + (
            f": give --num-virtual-stages-per-pipeline-rank {needed} (or a --pipeline-model-parallel-layout "
            f"with {needed * pp} stages)"
            if needed and needed > 1
            else ""
        ),
    )
    if vpp and vpp > 1:
        _require(
            pp > 1,
            f"{chosen[0]} gives {vpp} virtual stages per rank, which needs --pipeline-model-parallel-size > 1",
        )

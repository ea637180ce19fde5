"""Reshard a Trident checkpoint to another TP x PP (x VPP, layout) split, offline, optimizer state included.

    python tools/convert_checkpoint.py --load runs/ckpt --save runs/ckpt_tp1pp4 \\
        --target-tensor-parallel-size 1 --target-pipeline-model-parallel-size 4

No process group is needed; tensors stream one at a time, so memory stays near one full tensor.
Megatron's converter names are accepted too: ``--load-dir``, ``--save-dir``,
``--target-pipeline-parallel-size``. The data-parallel size needs no conversion: ``--load`` at any DP
size reads the same files. RNG states are kept for ranks that exist in both splits; the others are
seeded afresh when training resumes, as Megatron seeds a new rank.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.checkpoint import CheckpointError, convert_checkpoint, open_checkpoint, target_split


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--load", "--load-dir", dest="load", required=True, help="Checkpoint directory to read."
    )
    parser.add_argument(
        "--iteration", type=int, default=None, help="Iteration to convert (default: the latest)."
    )
    parser.add_argument("--save", "--save-dir", dest="save", required=True, help="Directory to write into.")
    parser.add_argument(
        "--target-tensor-parallel-size", type=int, required=True, help="TP size of the new checkpoint."
    )
    parser.add_argument(
        "--target-pipeline-model-parallel-size",
        "--target-pipeline-parallel-size",
        dest="target_pipeline_model_parallel_size",
        type=int,
        required=True,
        help="PP size of the new checkpoint.",
    )
    parser.add_argument(
        "--target-num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Virtual stages per rank.",
    )
    parser.add_argument("--target-pipeline-model-parallel-layout", default=None, help="Layout string.")
    parser.add_argument("--no-verify-checkpoint", action="store_true", help="Skip checksum verification.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser


def _check_sizes(args: argparse.Namespace) -> None:
    for flag in ("target_tensor_parallel_size", "target_pipeline_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise CheckpointError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    vpp = args.target_num_virtual_stages_per_pipeline_rank
    if vpp is not None and args.target_pipeline_model_parallel_layout is not None:
        raise CheckpointError(
            "--target-num-virtual-stages-per-pipeline-rank and --target-pipeline-model-parallel-layout are "
            "mutually exclusive: the layout already fixes the virtual stages"
        )
    if vpp is not None and (vpp < 1 or (vpp > 1 and args.target_pipeline_model_parallel_size == 1)):
        raise CheckpointError(
            f"--target-num-virtual-stages-per-pipeline-rank {vpp} needs a value >= 1, and "
            "--target-pipeline-model-parallel-size > 1 for more than one"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_sizes(args)
        ckpt = open_checkpoint(args.load, args.iteration, verify=not args.no_verify_checkpoint)
        try:
            target, config = target_split(
                ckpt,
                tensor_parallel=args.target_tensor_parallel_size,
                pipeline_parallel=args.target_pipeline_model_parallel_size,
                virtual_stages=args.target_num_virtual_stages_per_pipeline_rank,
                layout=args.target_pipeline_model_parallel_layout,
            )
        except CheckpointError as err:
            raise CheckpointError(
                f"--target-tensor-parallel-size {args.target_tensor_parallel_size} "
                f"--target-pipeline-model-parallel-size {args.target_pipeline_model_parallel_size}"
                + (
                    f" --target-num-virtual-stages-per-pipeline-rank {args.target_num_virtual_stages_per_pipeline_rank}"
                    if args.target_num_virtual_stages_per_pipeline_rank
                    else ""
                )
                + (
                    f" --target-pipeline-model-parallel-layout '{args.target_pipeline_model_parallel_layout}'"
                    if args.target_pipeline_model_parallel_layout
                    else ""
                )
                + f": {err}"
            ) from None
        total = sum(ckpt.spec(n).nbytes for n in ckpt.tensor_names("all"))
        from tqdm import tqdm

        with tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=args.quiet) as bar:
            summary = convert_checkpoint(ckpt, args.save, target, config, progress=bar.update)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())

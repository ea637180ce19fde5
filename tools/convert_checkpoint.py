"""Convert checkpoints offline: reshard a Trident checkpoint, or export it to / import it from Hugging Face.

    # another TP x PP (x VPP, layout, EP) split, optimizer state included
    python tools/convert_checkpoint.py --load runs/ckpt --save runs/ckpt_tp1pp4 \\
        --target-tensor-parallel-size 1 --target-pipeline-model-parallel-size 4
    # a Hugging Face folder (config.json, safetensors, tokenizer) for AutoModelForCausalLM / AutoTokenizer
    python tools/convert_checkpoint.py --load runs/ckpt --to-hf runs/hf [--max-shard-size 5GB]
    # a Hugging Face LLaMA or GPT-2 folder -> a Trident checkpoint at any split
    python tools/convert_checkpoint.py --from-hf llama-folder --save runs/llama \\
        --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2

No process group is needed; tensors stream one at a time, so memory stays near one full tensor.
Megatron's converter names are accepted too: ``--load-dir``, ``--save-dir``,
``--target-pipeline-parallel-size``. The data-parallel size needs no conversion: ``--load`` at any DP
size reads the same files. RNG states are kept for ranks that exist in both splits; the others are
seeded afresh when training resumes, as Megatron seeds a new rank. An imported model trains with
``pretrain_gpt.py --load DIR --finetune --use-checkpoint-args`` and no model flags.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.checkpoint import CheckpointError, convert_checkpoint, open_checkpoint, target_split
from training.hf.exporter import DEFAULT_MAX_SHARD_SIZE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", "--load-dir", dest="load", help="Trident checkpoint directory to read.")
    parser.add_argument(
        "--iteration", type=int, default=None, help="Iteration to convert (default: the latest)."
    )
    parser.add_argument(
        "--save", "--save-dir", dest="save", help="Trident checkpoint directory to write into."
    )
    parser.add_argument(
        "--to-hf", metavar="OUT", help="Export --load as a Hugging Face model folder OUT (LLaMA or GPT-2)."
    )
    parser.add_argument(
        "--from-hf", metavar="DIR", help="Import the Hugging Face LLaMA or GPT-2 folder DIR into --save."
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="With --to-hf: largest safetensors file before the weights are sharded with an index "
        f"(default {DEFAULT_MAX_SHARD_SIZE}, as save_pretrained).",
    )
    parser.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=None,
        help="TP size of the new checkpoint (required to reshard; default 1 with --from-hf).",
    )
    parser.add_argument(
        "--target-pipeline-model-parallel-size",
        "--target-pipeline-parallel-size",
        dest="target_pipeline_model_parallel_size",
        type=int,
        default=None,
        help="PP size of the new checkpoint (required to reshard; default 1 with --from-hf).",
    )
    parser.add_argument(
        "--target-num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Virtual stages per rank.",
    )
    parser.add_argument("--target-pipeline-model-parallel-layout", default=None, help="Layout string.")
    parser.add_argument(
        "--target-expert-model-parallel-size",
        type=int,
        default=1,
        help="EP size of the new checkpoint (MoE: experts per file = experts / EP; default 1).",
    )
    parser.add_argument("--no-verify-checkpoint", action="store_true", help="Skip checksum verification.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser


def _check_mode(args: argparse.Namespace) -> str:
    """ "reshard", "to-hf" or "from-hf", after checking the flags that mode needs."""
    if args.to_hf and args.from_hf:
        raise CheckpointError("--to-hf and --from-hf exclude each other: convert one way per run")
    targets = (args.target_tensor_parallel_size, args.target_pipeline_model_parallel_size)
    split_flags = (
        *targets,
        args.target_num_virtual_stages_per_pipeline_rank,
        args.target_pipeline_model_parallel_layout,
    )
    if args.to_hf:
        if not args.load or args.save or any(v is not None for v in split_flags):
            raise CheckpointError(
                "--to-hf OUT exports the checkpoint --load DIR [--iteration N]; it takes no --save or --target-* flag"
            )
        return "to-hf"
    if args.from_hf:
        if not args.save or args.load or args.iteration is not None:
            raise CheckpointError("--from-hf DIR imports into --save OUT; it takes no --load or --iteration")
        args.target_tensor_parallel_size = targets[0] or 1
        args.target_pipeline_model_parallel_size = targets[1] or 1
        return "from-hf"
    missing = [
        flag
        for flag, value in (
            ("--load", args.load),
            ("--save", args.save),
            ("--target-tensor-parallel-size", targets[0]),
            ("--target-pipeline-model-parallel-size", targets[1]),
        )
        if value is None
    ]
    if missing:
        raise CheckpointError(
            f"resharding needs {', '.join(missing)} (or --to-hf OUT / --from-hf DIR for Hugging Face)"
        )
    return "reshard"


def _check_sizes(args: argparse.Namespace) -> None:
    for flag in (
        "target_tensor_parallel_size",
        "target_pipeline_model_parallel_size",
        "target_expert_model_parallel_size",
    ):
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


def _describe_target(args: argparse.Namespace) -> str:
    text = (
        f"--target-tensor-parallel-size {args.target_tensor_parallel_size} "
        f"--target-pipeline-model-parallel-size {args.target_pipeline_model_parallel_size}"
    )
    if args.target_num_virtual_stages_per_pipeline_rank:
        text += f" --target-num-virtual-stages-per-pipeline-rank {args.target_num_virtual_stages_per_pipeline_rank}"
    if args.target_pipeline_model_parallel_layout:
        text += f" --target-pipeline-model-parallel-layout '{args.target_pipeline_model_parallel_layout}'"
    if args.target_expert_model_parallel_size != 1:
        text += f" --target-expert-model-parallel-size {args.target_expert_model_parallel_size}"
    return text


def _target_split(args: argparse.Namespace) -> dict:
    """The --target-* flags as the keywords of ``target_split`` and ``import_from_hf``."""
    return {
        "tensor_parallel": args.target_tensor_parallel_size,
        "pipeline_parallel": args.target_pipeline_model_parallel_size,
        "virtual_stages": args.target_num_virtual_stages_per_pipeline_rank,
        "layout": args.target_pipeline_model_parallel_layout,
        "expert_parallel": args.target_expert_model_parallel_size,
    }


def _reshard(args: argparse.Namespace, bar) -> str:
    ckpt = open_checkpoint(args.load, args.iteration, verify=not args.no_verify_checkpoint)
    try:
        target, config = target_split(
            ckpt,
            **_target_split(args),
        )
    except CheckpointError as err:
        raise CheckpointError(f"{_describe_target(args)}: {err}") from None
    bar.reset(total=sum(ckpt.spec(n).nbytes for n in ckpt.tensor_names("all")))
    return convert_checkpoint(ckpt, args.save, target, config, progress=bar.update).line()


def _to_hf(args: argparse.Namespace, bar) -> str:
    from training.hf import export_to_hf, parse_size

    try:
        limit = parse_size(args.max_shard_size)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    ckpt = open_checkpoint(args.load, args.iteration, verify=not args.no_verify_checkpoint)
    bar.reset(total=sum(ckpt.spec(n).nbytes for n in ckpt.tensor_names("model")))
    return export_to_hf(ckpt, args.to_hf, max_shard_size=limit, progress=bar.update).line()


def _from_hf(args: argparse.Namespace, bar) -> str:
    from training.hf import import_from_hf

    try:
        summary = import_from_hf(
            args.from_hf,
            args.save,
            **_target_split(args),
            progress=bar.update,
        )
    except CheckpointError as err:
        if "target split" not in str(err):
            raise
        raise CheckpointError(f"{_describe_target(args)}: {err}") from None
    return summary.line()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    try:
        mode = _check_mode(args)
        if mode != "to-hf":
            _check_sizes(args)
        run = {"reshard": _reshard, "to-hf": _to_hf, "from-hf": _from_hf}[mode]
        with tqdm(unit="B", unit_scale=True, desc=mode.replace("-", " "), disable=args.quiet) as bar:
            line = run(args, bar)
    except (CheckpointError, ValueError) as err:  # HFConfigError is a ValueError naming the field
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

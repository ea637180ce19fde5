"""Generate text from a Trident checkpoint, with the tokenizer the checkpoint carries and a key/value cache.

    python tools/generate.py --load runs/ckpt --prompt "def fibonacci(n):" --max-new-tokens 64
    python tools/generate.py --load runs/ckpt --prompt "Once" --temperature 0.8 --top-k 50 --top-p 0.95 --seed 7
    python tools/generate.py --load runs/ckpt --prompt "Once" --greedy --json
    torchrun --nproc-per-node 2 tools/generate.py --load runs/ckpt --prompt "Once"    # tensor parallel, TP=2

The checkpoint may have been saved at any TP/PP split: one process loads it at TP=PP=1, resharding in
memory. Under ``torchrun`` every process is one tensor-parallel rank (TP = the world size, PP = 1);
rank 0 prints. Without a sampling flag decoding is greedy, as ``transformers``' ``generate()``.
Generation stops after the end-of-sequence token (kept in the output) or ``--max-new-tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "generate.py"
JSON_HELP = (
    'Print one JSON line instead of the text: {"tokens": [prompt ids + generated ids], "text": the '
    'prompt and its continuation, "top_logits": one list per generated token of its step\'s '
    "--top-logits highest raw next-token logits (before temperature, top-k and top-p) as "
    "[token id, logit] pairs, highest first}."
)


class InputError(ValueError):
    """A flag's value does not fit the checkpoint (prompt length, tokenizer)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory (a --save directory).")
    parser.add_argument(
        "--ckpt-step", type=int, default=None, help="Iteration to load (default: the latest)."
    )
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="Most tokens to generate (default 64)."
    )
    decoding = parser.add_argument_group("decoding (greedy unless a sampling flag is given)")
    decoding.add_argument("--greedy", action="store_true", help="Always take the most likely token.")
    decoding.add_argument(
        "--temperature", type=float, default=None, help="Sample; divide the logits by T first (default 1)."
    )
    decoding.add_argument(
        "--top-k", type=int, default=None, help="Sample from the K most likely tokens (0: all, the default)."
    )
    decoding.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="Sample from the fewest most likely tokens whose probability reaches P (default 1: all).",
    )
    decoding.add_argument(
        "--seed", type=int, default=1234, help="Seed of the sampling generator (default 1234, Megatron's)."
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help=JSON_HELP)
    output.add_argument(
        "--top-logits", type=int, default=5, help="Logits per step in --json's top_logits (default 5)."
    )
    parser.add_argument("--no-verify-checkpoint", action="store_true", help="Skip checksum verification.")
    return parser


def sampling_params(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Greedy, or sampling with the flags given; a contradiction or a bad value is a usage error."""
    from models.gpt.generation import SamplingParams

    given = [
        f"--{name.replace('_', '-')}"
        for name in ("temperature", "top_k", "top_p")
        if getattr(args, name) is not None
    ]
    if args.greedy and given:
        parser.error(f"--greedy cannot be combined with the sampling flag(s) {', '.join(given)}")
    checks = (
        ("--temperature", args.temperature, lambda v: v > 0, "must be > 0"),
        ("--top-k", args.top_k, lambda v: v >= 0, "must be >= 0 (0 keeps every token)"),
        ("--top-p", args.top_p, lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("--max-new-tokens", args.max_new_tokens, lambda v: v >= 1, "must be >= 1"),
        ("--top-logits", args.top_logits, lambda v: v >= 0, "must be >= 0"),
    )
    for flag, value, ok, rule in checks:
        if value is not None and not ok(value):
            parser.error(f"{flag} {value} {rule}")
    if not given:
        return SamplingParams(greedy=True)
    return SamplingParams(
        greedy=False,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k or 0,
        top_p=1.0 if args.top_p is None else args.top_p,
    )


def tokenize_prompt(loaded, args: argparse.Namespace) -> list[int]:
    """The prompt's ids, checked to fit the model's positions with --max-new-tokens after them."""
    try:
        ids = list(map(int, loaded.tokenizer.tokenize(args.prompt)))
    except ValueError as err:
        raise InputError(f"--prompt cannot be tokenized by the checkpoint's tokenizer: {err}") from None
    if not ids:
        raise InputError("--prompt is empty after tokenization; give at least one token of text")
    limit = loaded.max_sequence_length
    if len(ids) + args.max_new_tokens > limit:
        raise InputError(
            f"--prompt is {len(ids)} tokens and --max-new-tokens is {args.max_new_tokens}, {len(ids) + args.max_new_tokens} "
            f"positions in all, but the model has {limit} (its max_sequence_length); shorten the prompt "
            "or lower --max-new-tokens"
        )
    return ids


def _start_tensor_parallel() -> bool:
    """Under torchrun with more than one process: one tensor-parallel group of every rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    from core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]))
    return True


def _first_failure(error: str | None) -> int | None:
    """The lowest rank that failed before generation (None if none did), known on every rank, so
    that no rank waits in a collective for one that has stopped."""
    import torch
    import torch.distributed as dist

    from core.device import current_device

    world = dist.get_world_size()
    rank = torch.tensor([dist.get_rank() if error is not None else world], device=current_device())
    dist.all_reduce(rank, op=dist.ReduceOp.MIN)
    return None if rank.item() == world else int(rank.item())


class Stop(Exception):
    """Another rank failed and says why; this one ends quietly."""


def run(args: argparse.Namespace, sampling, distributed: bool) -> dict:
    """Load, tokenize and generate; the result for printing, on every rank."""
    import torch

    from core.device import current_device
    from core.tensor_parallel import gather_from_tensor_model_parallel_region
    from models.gpt.generation import generate
    from training.checkpoint import CheckpointError
    from training.inference import load_for_generation

    error, loaded, prompt = None, None, None
    try:
        try:
            loaded = load_for_generation(args.load, args.ckpt_step, verify=not args.no_verify_checkpoint)
        except CheckpointError as err:
            where = f"--load {args.load}" + (
                f" --ckpt-step {args.ckpt_step}" if args.ckpt_step is not None else ""
            )
            if distributed:
                where += (
                    f" at TP {os.environ['WORLD_SIZE']} (each torchrun process is one tensor-parallel rank)"
                )
            raise InputError(f"{where}: {err}") from None
        prompt = tokenize_prompt(loaded, args)
    except InputError as err:
        error = str(err)
    except Exception as err:  # a bug: its traceback in one process; under torchrun no rank may wait for it
        if not distributed:
            raise
        error = f"loading {args.load} failed: {type(err).__name__}: {err}"
    failed = _first_failure(error) if distributed else (None if error is None else 0)
    if failed is not None:
        raise InputError(error) if failed == int(os.environ.get("RANK", "0")) else Stop()
    device = current_device()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    result = generate(
        loaded.model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        vocab_size=loaded.vocab_size,
        eos_id=loaded.eos_id,
        sampling=sampling,
        generator=generator,
        num_top_logits=args.top_logits if args.json else 0,
        device=device,
        gather_logits=gather_from_tensor_model_parallel_region if distributed else None,
    )
    return {
        "tokens": result.tokens,
        "text": loaded.tokenizer.detokenize(result.tokens),
        "top_logits": [[[i, v] for i, v in step] for step in result.top_logits],
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sampling = sampling_params(parser, args)
    distributed = _start_tensor_parallel()
    rank = int(os.environ.get("RANK", "0"))
    try:
        output = run(args, sampling, distributed)
    except InputError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    except Stop:
        return 1
    finally:
        if distributed:
            from core import parallel_state

            parallel_state.destroy_distributed()
    if rank == 0:
        print(json.dumps(output) if args.json else output["text"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

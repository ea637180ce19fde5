"""What does the framework cost at one rank? ``pretrain()`` against a plain PyTorch loop, same model.

Both train the same ``GPTModel`` (TP = PP = DP = 1) on the same default-corpus samples with AdamW,
global-norm clipping and the same microbatching. The plain loop is what one would write by hand:
zero_grad, forward/backward per microbatch, clip, step. Runs alternate (Trident, plain, Trident,
plain, ...) so machine noise hits both alike; the medians of the step times are compared.

    python tools/bench_overhead.py                  # default tiny GPT, 3 rounds of 15 steps
    python tools/bench_overhead.py --rounds 5 --steps 20

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import pretrain_gpt
from core import parallel_state as ps
from training import get_args
from training.training import pretrain

WARMUP = 3


def _trident(flags: list[str]) -> list[float]:
    state = pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        pretrain_gpt.forward_step,
        argv=flags,
        tokenizer_provider=pretrain_gpt.tokenizer_provider,
    )
    return state.step_seconds[WARMUP:]


def _plain(steps: int) -> list[float]:
    """The same model and samples in a hand-written loop (reuses the args and tokenizer pretrain set)."""
    args = get_args()
    ps.initialize_model_parallel()  # TP = PP = 1: the layers find their (size-1) groups
    torch.manual_seed(args.seed)
    model = pretrain_gpt.model_provider()
    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider(args)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )
    mbs, m = args.micro_batch_size, args.global_batch_size // args.micro_batch_size
    times, consumed = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for _k in range(m):
            samples = [train_ds[consumed + i] for i in range(mbs)]
            consumed += mbs
            tokens = torch.stack([s["tokens"] for s in samples])
            labels = torch.stack([s["labels"] for s in samples])
            mask = torch.stack([s["loss_mask"] for s in samples])
            per_token = model(tokens, torch.stack([s["position_ids"] for s in samples]), labels=labels)
            loss = (per_token * mask).sum() / mask.sum() / m
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        times.append(time.perf_counter() - start)
    ps.destroy_distributed()
    return times[WARMUP:]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=15, help=f"steps per run; the first {WARMUP} are dropped"
    )
    args, model_flags = parser.parse_known_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    flags = [
        "--train-iters",
        str(args.steps),
        "--lr-warmup-iters",
        "1",
        "--eval-iters",
        "0",
        "--log-interval",
        str(10**6),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        *model_flags,
    ]
    trident, plain = [], []
    for _ in range(args.rounds):
        trident += _trident(flags)
        plain += _plain(args.steps)
    t_med, p_med = statistics.median(trident), statistics.median(plain)
    a = get_args()
    tokens = a.global_batch_size * a.seq_length
    print(
        f"one rank, {a.num_layers} layers x hidden {a.hidden_size}, global batch {a.global_batch_size} x "
        f"{a.seq_length} tokens, {args.rounds} alternating rounds x {args.steps - WARMUP} timed steps"
    )
    print(f"{'loop':<12}{'median ms':>11}{'tokens/s':>10}")
    print(f"{'plain torch':<12}{p_med * 1000:>11.1f}{tokens / p_med:>10.0f}")
    print(f"{'trident':<12}{t_med * 1000:>11.1f}{tokens / t_med:>10.0f}")
    print(f"overhead: {(t_med / p_med - 1) * 100:+.1f}%")
    summary = {
        "benchmark": "bench_overhead",
        "plain_ms": round(p_med * 1000, 2),
        "trident_ms": round(t_med * 1000, 2),
        "ratio": round(t_med / p_med, 4),
        "tokens_per_step": tokens,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

"""What does the framework cost at one rank? ``pretrain()`` against a plain PyTorch loop, same model.

Both train the same ``GPTModel`` (TP = PP = DP = 1) with AdamW, global-norm clipping and the same
microbatching, on the same samples read the same way (``training.data.batches.BatchStream`` in the
training process, ``--num-workers 0``: the dataset's samples stacked into microbatches). The plain loop is what one would write by hand:
zero_grad, forward/backward per microbatch, clip, step.

The two take turns step by step: ``pretrain()`` runs its iteration, then (through its
``iteration_hook``) the plain loop runs one step, and so on, so that machine noise hits both alike.
Each round is a fresh ``pretrain()`` and a fresh plain model; the first ``--warmup`` steps of a round
are dropped. Both wall time and the process's CPU time are measured (with one thread, CPU time is
what the step itself cost, which other processes on a shared machine disturb far less). Reported:
medians and quartiles, the ratio of medians with a bootstrap 95% interval over the step pairs, the
ratio of each round, the data path's own time per step (the same for both), and the load average.

    python tools/bench/overhead.py                     # default tiny GPT, 3 rounds x 40 timed steps
    python tools/bench/overhead.py --rounds 5 --steps 60
    python tools/bench/overhead.py --profile           # where pretrain()'s extra time goes (cProfile)

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import pretrain_gpt
from training import get_args
from training.data.batches import BatchStream


class PlainLoop:
    """The hand-written loop: same model provider, samples, optimizer settings and clipping."""

    def __init__(self) -> None:
        args = get_args()
        torch.manual_seed(args.seed)
        self.args = args
        self.model = pretrain_gpt.model_provider()
        self.dataset, _, _ = pretrain_gpt.train_valid_test_datasets_provider(args)
        params = list(self.model.named_parameters())
        decay = [p for n, p in params if p.ndim > 1]
        no_decay = [p for n, p in params if p.ndim <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
        )
        self.stream = BatchStream(
            self.dataset, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length
        )
        self.consumed = 0
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.data_seconds: list[float] = []

    def step(self) -> None:
        args = self.args
        m = args.global_batch_size // args.micro_batch_size
        start, cpu = time.perf_counter(), time.process_time()
        self.optimizer.zero_grad(set_to_none=True)
        read = time.perf_counter()
        batches = self.stream.step(self.consumed, m)
        data = time.perf_counter() - read
        for batch in batches:
            per_token = self.model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
            mask = batch["loss_mask"]
            loss = (per_token * mask).sum() / mask.sum() / m
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad)
        self.optimizer.step()
        self.consumed += args.global_batch_size
        self.seconds.append(time.perf_counter() - start)
        self.cpu_seconds.append(time.process_time() - cpu)
        self.data_seconds.append(data)


def _round(flags: list[str], warmup: int, profiler: cProfile.Profile | None) -> dict[str, list[float]]:
    """One pretrain() with the plain loop interleaved: per-step wall and CPU seconds of each side.

    A pretrain() iteration is everything between two calls of its hook (train step, scheduler,
    logging), so it is timed from the end of one hook call to the start of the next.
    """
    plain: list[PlainLoop] = []
    trident = {"wall": [], "cpu": []}
    last: list[tuple[float, float]] = []

    def after_iteration(state) -> None:
        now = (time.perf_counter(), time.process_time())
        if profiler is not None:  # profile pretrain()'s iterations from the second on, not the plain loop
            profiler.disable()
        if last:
            trident["wall"].append(now[0] - last[0][0])
            trident["cpu"].append(now[1] - last[0][1])
        if not plain:
            plain.append(PlainLoop())
        plain[0].step()
        last[:] = [(time.perf_counter(), time.process_time())]
        if profiler is not None and state.iteration < get_args().train_iters:
            profiler.enable()

    pretrain_gpt.main(argv=flags, iteration_hook=after_iteration)
    loop = plain[0]
    # Trident's first iteration is not timed (the hook had not run yet): align on the plain loop's 2nd.
    return {
        "trident": trident["wall"][warmup:],
        "trident_cpu": trident["cpu"][warmup:],
        "plain": loop.seconds[1:][warmup:],
        "plain_cpu": loop.cpu_seconds[1:][warmup:],
        "data": loop.data_seconds[1:][warmup:],
    }


def _bootstrap(trident: list[float], plain: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% interval of median(trident) / median(plain), resampling step pairs."""
    rng = random.Random(0)
    pairs = list(zip(trident, plain))
    ratios = []
    for _ in range(draws):
        sample = [rng.choice(pairs) for _ in pairs]
        ratios.append(statistics.median(t for t, _ in sample) / statistics.median(p for _, p in sample))
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each round")
    parser.add_argument("--profile", action="store_true", help="cProfile pretrain()'s iterations")
    args, model_flags = parser.parse_known_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    total = args.steps + args.warmup
    flags = [
        "--train-iters",
        str(total),
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
        "--num-workers",
        "0",
        *model_flags,
    ]
    profiler = cProfile.Profile() if args.profile else None
    load_before = os.getloadavg()
    runs = [_round(flags, args.warmup, profiler) for _ in range(args.rounds)]
    load_after = os.getloadavg()
    every = {key: [x for run in runs for x in run[key]] for key in runs[0]}
    a = get_args()
    tokens = a.global_batch_size * a.seq_length
    print(
        f"one rank, {a.num_layers} layers x hidden {a.hidden_size}, global batch {a.global_batch_size} x "
        f"{a.seq_length} tokens; {args.rounds} rounds x {args.steps} timed steps, taking turns step by step"
    )
    print(f"{'loop':<20}{'median ms':>11}{'p25 ms':>9}{'p75 ms':>9}{'tokens/s':>10}")
    for label, key in (("plain torch, wall", "plain"), ("trident, wall", "trident")):
        p25, median, p75 = statistics.quantiles(every[key], n=4)
        median = statistics.median(every[key])
        print(
            f"{label:<20}{median * 1000:>11.1f}{p25 * 1000:>9.1f}{p75 * 1000:>9.1f}{tokens / median:>10.0f}"
        )
    for label, key in (("plain torch, CPU", "plain_cpu"), ("trident, CPU", "trident_cpu")):
        p25, _, p75 = statistics.quantiles(every[key], n=4)
        median = statistics.median(every[key])
        print(f"{label:<20}{median * 1000:>11.1f}{p25 * 1000:>9.1f}{p75 * 1000:>9.1f}")
    summary = {"benchmark": "bench_overhead", "tokens_per_step": tokens}
    for kind, t_key, p_key in (("wall", "trident", "plain"), ("cpu", "trident_cpu", "plain_cpu")):
        ratio = statistics.median(every[t_key]) / statistics.median(every[p_key])
        low, high = _bootstrap(every[t_key], every[p_key])
        rounds = [statistics.median(r[t_key]) / statistics.median(r[p_key]) for r in runs]
        print(
            f"ratio trident / plain ({kind} time): {ratio:.4f}, 95% bootstrap interval {low:.4f} .. {high:.4f}; "
            f"per round {', '.join(f'{r:.4f}' for r in rounds)}"
        )
        summary[f"ratio_{kind}"] = round(ratio, 4)
        summary[f"ratio_{kind}_95"] = [round(low, 4), round(high, 4)]
        summary[f"ratio_{kind}_per_round"] = [round(r, 4) for r in rounds]
    summary["plain_ms"] = round(statistics.median(every["plain"]) * 1000, 2)
    summary["trident_ms"] = round(statistics.median(every["trident"]) * 1000, 2)
    summary["data_ms"] = round(statistics.median(every["data"]) * 1000, 2)
    summary["load_average"] = [round(x, 2) for x in load_after]
    print(f"data path (read and stack, the same code on both sides): {summary['data_ms']:.1f} ms per step")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

"""How long does training stall for a checkpoint, synchronously and with ``--async-save``? What memory does a save take?

Trains ``tools/bench/convert.py``'s LLaMA-style model of about 1 GB in fp32 (24 layers, hidden 896,
vocabulary 32000, untied output layer; with Adam's moments a checkpoint is about 3.2 GB) through the
real ``pretrain()`` in one process, saving every ``--save-interval`` iterations. The saves of one run
take turns: synchronous, asynchronous, synchronous, ... (``--saves`` of each), so the same model,
page cache and machine load serve both; each of ``--rounds`` runs is a fresh process starting with
the other mode. A first, untimed asynchronous save allocates the host buffers that every later one
reuses (its time is printed).

Each iteration is timed from one ``iteration_hook`` call to the next, so the time includes the save
(or, asynchronously, the staging copy, the writer's competition for the CPU and the commit). The
stall of one save is the time of the iterations from the save until it is committed (the save's own
iteration when synchronous; when asynchronous, up to the iteration whose check commits it) minus as
many median iterations of the same run away from any save. Reported: median stall per mode, their
ratio (the goal: asynchronous <= 0.25 x synchronous), the part of the stall the training thread spent
inside the saver (a synchronous save's whole write; an asynchronous one's staging copy and commit:
the rest is the writer competing for the CPU), the median step, and the load average.

``--memory`` measures instead how much resident memory one save adds at its peak (Linux's peak-RSS
counter, reset just before the save), the same model's Adam state filled as a step fills it: a
synchronous save through ``save_checkpoint`` (``training.checkpoint.load``'s, ``training.checkpointing``'s in
older trees)
too, so ``PYTHONPATH=<old tree> python tools/bench/async_save.py --memory`` gives the figure before a
change; then, where the tree has it, two asynchronous saves in a row (the first allocates the host
buffers, the second reuses them).

    python tools/bench/async_save.py                           # 2 runs, 3 saves of each mode per run
    python tools/bench/async_save.py --rounds 3 --num-layers 12 --dir /scratch/bench
    python tools/bench/async_save.py --threads 1 --saves 2   # training leaves a core to the writer
    python tools/bench/async_save.py --memory

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 32000


def model_flags(num_layers: int) -> list[str]:
    """bench_convert's model as Megatron flags, trained on 32-token samples one at a time."""
    flags = f"""--num-layers {num_layers} --hidden-size 896 --num-attention-heads 14 --group-query-attention
        --num-query-groups 2 --ffn-hidden-size 2560 --swiglu --normalization RMSNorm --disable-bias-linear
        --position-embedding-type rope --untie-embeddings-and-output-weights --seq-length 32
        --max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 1 --lr 1e-4
        --lr-warmup-iters 0 --hidden-dropout 0 --attention-dropout 0 --log-interval 100000
        --eval-iters 0 --tokenizer-type NullTokenizer --vocab-size {VOCAB} --split 100,0,0"""
    return flags.split()


# One timed run in a child process whose saves take turns between the modes (one process: the same
# model, page cache and machine load for all): every iteration's wall time (hook to hook), the part
# of it the training thread spent inside the saver (save, poll, wait), the tracker's iteration at its
# end, and the mode of each save. At world size 1 the saver needs no process group of its own, so
# switching it between synchronous and asynchronous from one save to the next is safe.
TIMED_RUN = """
import json, os, sys, time
import pretrain_gpt
from training.checkpoint import async_save, read_tracker
from training.training import pretrain

argv, save = sys.argv[2:], sys.argv[sys.argv.index("--save") + 1]
modes, chosen = sys.argv[1].split(","), []
marks, inside = [], {"depth": 0, "seconds": 0.0}

def timed(real):
    def call(self, *args, **kwargs):
        inside["depth"] += 1
        start = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            inside["depth"] -= 1
            if inside["depth"] == 0:
                inside["seconds"] += time.perf_counter() - start
    return call

def taking_turns(real):
    def call(self, *args, **kwargs):
        self.wait()  # the previous save's rest, if any, is not this save's cost
        mode = modes[len(chosen)] if len(chosen) < len(modes) else "sync"
        chosen.append(mode)
        self.async_save = mode != "sync"
        return real(self, *args, **kwargs)
    return call

async_save.CheckpointSaver.save = taking_turns(async_save.CheckpointSaver.save)
for name in ("save", "poll", "wait"):
    setattr(async_save.CheckpointSaver, name, timed(getattr(async_save.CheckpointSaver, name)))

def hook(state):
    marks.append((time.perf_counter(), inside["seconds"], read_tracker(save) if os.path.isdir(save) else None))
    inside["seconds"] = 0.0

start = time.perf_counter()
pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
         argv=argv, tokenizer_provider=pretrain_gpt.tokenizer_provider, iteration_hook=hook)
times = [b[0] - a[0] for a, b in zip([(start,)] + marks, marks)]
out = {"seconds": times, "blocked": [m[1] for m in marks], "tracker": [m[2] for m in marks], "modes": chosen}
print(json.dumps(out))
"""


# Peak resident memory of saves (VmHWM reset through /proc/self/clear_refs before each), the optimizer
# state filled as a training step fills it. Only APIs older trees have too, except the async part.
MEASURED_SAVES = """
import json, sys, time
import torch
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from models.gpt.presets import llama_config
try:
    from training.checkpoint import load as checkpointing
except ImportError:  # an older tree
    from training import checkpointing

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) // 1024 for line in fh if line.startswith(field + ":"))

def measured(save):
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before, start = status("VmRSS"), time.perf_counter()
    save()
    return {"rss_before_mb": before, "growth_mb": status("VmHWM") - before, "seconds": time.perf_counter() - start}

root, layers = sys.argv[1], int(sys.argv[2])
config = llama_config(num_layers=layers, hidden_size=896, num_attention_heads=14, num_query_groups=2)
try:  # trees before the training-layer redesign build the chunks in one call
    from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
    chunks = parallelize_gpt(gpt_provider(config, 32000, 32), layout=pipeline_layout(config)).modules
except ImportError:
    from models.gpt import build_model_chunks
    chunks = build_model_chunks(config, 32000, 32)
optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4), chunks)
for param in checkpointing.model_parameters(chunks).values():
    main = optimizer.get_main_param(param)
    optimizer.optimizer.state[main] = {
        "step": torch.tensor(1.0), "exp_avg": torch.full_like(main, 0.5), "exp_avg_sq": torch.full_like(main, 0.5)
    }
kw = dict(model_chunks=chunks, optimizer=optimizer)
out = {"sync": measured(lambda: checkpointing.save_checkpoint(root + "/sync", 1, **kw))}
try:
    from training.checkpoint.async_save import CheckpointSaver
except ImportError:
    CheckpointSaver = None
if CheckpointSaver is not None:
    saver = CheckpointSaver(async_save=True)
    for n in (1, 2):
        out[f"async, save {n}"] = measured(lambda: (saver.save(root + "/async", n, **kw), saver.wait()))
print(json.dumps(out))
"""


def _write_data(prefix: str, samples: int) -> None:
    """Random token ids through the real indexed-dataset builder (content does not matter here)."""
    import numpy as np

    from training.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(samples):
        builder.add_document(rng.integers(0, VOCAB, size=40), [40])
    builder.finalize(f"{prefix}.idx")


def _child(script: str, args: list[str], cwd: str, **extra_env: str) -> dict:
    """Run ``script`` in a fresh interpreter that imports the tree on PYTHONPATH (default: this one)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)}
    env.update(extra_env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=cwd, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


MODES = {"sync": "synchronous", "async": "--async-save"}


def stalls(run: dict, interval: int) -> tuple[list[tuple[str, float, float]], float]:
    """(mode, stall, time inside the saver) of each timed save, and the run's median iteration time
    away from saves (module docstring)."""
    seconds, blocked, tracker = run["seconds"], run["blocked"], run["tracker"]
    windows = []
    for n, save in enumerate(range(interval, len(seconds), interval)):  # the final save is not timed
        end = save
        while end < len(seconds) and tracker[end - 1] != save:
            end += 1
        if end >= save + interval:
            raise RuntimeError(f"the save at iteration {save} was not committed before the next one")
        windows.append((run["modes"][n], range(save, end + 1)))
    busy = {i for _, window in windows for i in window}
    base = statistics.median(s for i, s in enumerate(seconds, start=1) if i > 2 and i not in busy)
    out = []
    for mode, window in windows:
        stall = sum(seconds[i - 1] for i in window) - len(window) * base
        out.append((mode, stall, sum(blocked[i - 1] for i in window)))
    return out, base


def bench_stall(args, scratch: str) -> None:
    modes = ["sync", "async"]
    data = os.path.join(scratch, "data")
    iters = args.save_interval * (1 + args.saves * len(modes)) + args.save_interval // 2
    _write_data(data, iters + 10)
    flags = model_flags(args.num_layers) + ["--data-path", data, "--train-iters", str(iters)]
    flags += ["--save-interval", str(args.save_interval), "--async-save"]
    found: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    steps: list[float] = []
    for r in range(args.rounds):
        save = os.path.join(scratch, f"run{r}")
        order = modes[r % len(modes) :] + modes[: r % len(modes)]  # each round starts with another mode
        sequence = ["async"] + order * args.saves  # the first save allocates the host buffers: untimed
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        run = _child(TIMED_RUN, [",".join(sequence), *flags, "--save", save], scratch, **threads)
        (warmup, *these), base = stalls(run, args.save_interval)
        for mode, stall, inside in these:
            found[mode].append((stall, inside))
        steps.append(base)
        first = os.path.join(save, f"iter_{args.save_interval:07d}")
        checkpoint_bytes = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
        shown = "; ".join(f"{m} {a:.2f} ({b:.2f})" for m, a, b in these)
        print(
            f"round {r}: step {base:.2f} s; first save (allocates the host buffers) {warmup[1]:.2f} "
            f"({warmup[2]:.2f}); stall (inside the saver) per save: {shown}",
            flush=True,
        )
        shutil.rmtree(save)
    stall = {mode: statistics.median(a for a, _ in v) for mode, v in found.items()}
    inside = {mode: statistics.median(b for _, b in v) for mode, v in found.items()}
    print(
        f"\n{args.num_layers} layers, {checkpoint_bytes / 1e9:.2f} GB per checkpoint, {args.rounds} runs, "
        f"median step {statistics.median(steps):.2f} s away from saves"
    )
    width = max(len(MODES[m]) for m in modes) + 2
    print(f"{'':<{width}}{'median stall s':>16}{'inside saver s':>16}{'stall / sync':>14}{'saves':>7}")
    for mode in modes:
        row = f"{stall[mode]:>16.2f}{inside[mode]:>16.2f}{stall[mode] / stall['sync']:>14.3f}"
        print(f"{MODES[mode]:<{width}}{row}{len(found[mode]):>7}")
    summary = {
        "checkpoint_bytes": checkpoint_bytes,
        "median_stall_seconds": stall,
        "median_inside_saver_seconds": inside,
        "median_step_seconds": statistics.median(steps),
        "stalls": {mode: [a for a, _ in v] for mode, v in found.items()},
        "async_over_sync": stall["async"] / stall["sync"],
        "command": " ".join(sys.argv),
        "load_average": os.getloadavg()[0],
        "training_threads": args.threads,
    }
    print(json.dumps(summary))


def bench_memory(args, scratch: str) -> None:
    out = _child(MEASURED_SAVES, [scratch, str(args.num_layers)], scratch)
    print(f"{args.num_layers} layers, fp32 with Adam, one process")
    print(f"{'save':<22}{'RSS before MB':>14}{'peak growth MB':>16}{'seconds':>9}")
    for name, m in out.items():
        print(f"{name:<22}{m['rss_before_mb']:>14}{m['growth_mb']:>16}{m['seconds']:>9.2f}")
    print(json.dumps(out | {"load_average": os.getloadavg()[0]}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="Runs, each a fresh process.")
    parser.add_argument("--saves", type=int, default=3, help="Timed saves of each mode per run.")
    parser.add_argument("--save-interval", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=24, help="24: about 1 GB of fp32 weights.")
    parser.add_argument("--memory", action="store_true", help="Peak memory of a save instead of the stall.")
    parser.add_argument(
        "--threads", type=int, default=None, help="Training's CPU threads (default: torch's, every core)."
    )
    parser.add_argument("--dir", default=None, help="Scratch directory (default: a temporary one).")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="bench-async-save-", dir=args.dir)
    try:
        (bench_memory if args.memory else bench_stall)(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

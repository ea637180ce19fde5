"""How fast is ``tools/convert_checkpoint.py``, and how much memory does it hold? Against ``cp``.

Writes a checkpoint of a LLaMA-style model of about 1 GB in fp32 (24 layers, hidden 896, vocabulary
32000, untied output layer) at TP2 x PP2, then converts it to TP1 x PP4 several times, each time
right after copying the same files with ``cp -r`` (and ``cp -r`` followed by ``sync``, since the
converter fsyncs every file it writes). Each conversion runs as its own process (its time includes
starting Python and importing torch) and reports how much its resident memory grew during the
conversion (Linux's peak-RSS counter, reset after the imports), against the largest tensor and
the whole model.

    python tools/bench/convert.py                      # weights only, 3 rounds
    python tools/bench/convert.py --optimizer          # with Adam moments (3x the bytes)
    python tools/bench/convert.py --rounds 5 --dir /scratch/bench

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
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from models.gpt.presets import llama_config
from training.checkpoint import Parallelism, gpt_tensor_specs, write_checkpoint
from training.checkpoint.format import optimizer_tensor_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Runs the converter in a child process and reports its memory during the conversion alone: after the
# imports, writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current RSS (Linux).
MEASURED_CONVERT = """
import json, sys, time
from tools import convert_checkpoint

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) // 1024 for line in fh if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS")
start = time.perf_counter()
assert convert_checkpoint.main(sys.argv[1:]) == 0
seconds = time.perf_counter() - start
print(json.dumps({"rss_before_mb": before, "peak_mb": status("VmHWM"), "seconds": seconds}))
"""


def _run(cmd: list[str]) -> tuple[float, str]:
    """Wall seconds and standard output of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return seconds, out.decode()


def _write_source(root: str, with_optimizer: bool) -> tuple[int, int]:
    """The TP2 x PP2 source checkpoint; returns (bytes of all tensors, bytes of the largest)."""
    config = llama_config(num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2)
    specs, tied = gpt_tensor_specs(config, 32000, 2048)
    if with_optimizer:
        for name, spec in list(specs.items()):
            for state in ("exp_avg", "exp_avg_sq"):
                specs[optimizer_tensor_name(state, name)] = spec
    generator = torch.Generator().manual_seed(0)
    tensors = ((name, torch.randn(spec.shape, generator=generator)) for name, spec in specs.items())
    layout = "E,t*12|t*12,L"
    write_checkpoint(
        root,
        tensors,
        specs=specs,
        tied=tied,
        parallelism=Parallelism(2, 2, 1, layout),
        config=config.to_dict(),
        vocab_size=32000,
        max_sequence_length=2048,
        optimizer={"param_groups": []} if with_optimizer else None,
    )
    return sum(s.nbytes for s in specs.values()), max(s.nbytes for s in specs.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--optimizer", action="store_true", help="Include Adam moments.")
    parser.add_argument("--dir", default=None, help="Scratch directory (default: a temporary one).")
    args = parser.parse_args(argv)

    scratch = tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir)
    try:
        source = os.path.join(scratch, "source")
        started = time.perf_counter()
        total, largest = _write_source(source, args.optimizer)
        print(
            f"wrote the TP2xPP2 source ({total / 1e9:.2f} GB of tensors) in {time.perf_counter() - started:.1f} s"
        )
        files = os.path.join(source, "iter_0000000")
        file_bytes = sum(os.path.getsize(os.path.join(files, f)) for f in os.listdir(files))
        file_count = len(os.listdir(files))
        times: dict[str, list[float]] = {"cp": [], "cp + sync": [], "convert": [], "  of which work": []}
        memory: list[dict] = []
        for r in range(args.rounds):  # interleaved, so machine noise hits all three alike
            target = os.path.join(scratch, f"cp{r}")
            times["cp"].append(_run(["cp", "-r", files, target])[0])
            shutil.rmtree(target)
            times["cp + sync"].append(_run(["sh", "-c", f"cp -r {files} {target} && sync"])[0])
            shutil.rmtree(target)
            target = os.path.join(scratch, f"out{r}")
            flags = ["--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "4"]
            convert = [sys.executable, "-c", MEASURED_CONVERT, "--load", source, "--save", target, "--quiet"]
            seconds, out = _run([*convert, *flags])
            times["convert"].append(seconds)
            memory.append(json.loads(out.strip().splitlines()[-1]))
            times["  of which work"].append(memory[-1]["seconds"])  # without starting Python and torch
            shutil.rmtree(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    before = max(m["rss_before_mb"] for m in memory)
    grown = max(m["peak_mb"] - m["rss_before_mb"] for m in memory)
    print(f"\nTP2xPP2 -> TP1xPP4, {file_bytes / 1e9:.2f} GB in {file_count} files, {args.rounds} rounds")
    print(f"{'':<12}{'median s':>10}{'GB/s':>8}{'convert / this':>16}")
    for name, seconds in med.items():
        print(
            f"{name:<12}{seconds:>10.2f}{file_bytes / seconds / 1e9:>8.2f}{med['convert'] / seconds:>16.2f}"
        )
    print(
        f"converter RSS after its imports {before} MB; during the conversion it grew by at most {grown} MB = "
        f"{grown * 2**20 / largest:.1f} x the largest tensor ({largest / 2**20:.0f} MB) = "
        f"{grown * 2**20 / total * 100:.1f}% of all tensors ({total / 2**20:.0f} MB)"
    )
    summary = {
        "bytes": file_bytes,
        "largest_tensor_bytes": largest,
        "median_seconds": med,
        "convert_over_cp": med["convert"] / med["cp"],
        "convert_over_cp_sync": med["convert"] / med["cp + sync"],
        "rss_after_imports_mb": before,
        "rss_growth_mb": grown,
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

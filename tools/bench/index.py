"""Benchmark the dataset index builders: blending indices and the GPT sample index.

    python tools/bench/index.py                          # 3 and 8 datasets, 10M blended samples
    python tools/bench/index.py --samples 768000000      # the GPT-3 175B script's whole run (7.5 GB)
    python tools/bench/index.py --megatron-helpers /path/to/megatron_core/site-packages

The blending index of a run has ``sum_d ceil(n * w_d)`` samples for ``n = train_iters x
global_batch_size`` (``training/data/builder.py``): 768M for the GPT-3 175B example script's 500000 x
1536. Each builder is timed on the same inputs, in turns (compiled, megatron-core's C++ helper when
found, the pure-Python loop the compiled one replaced), and the output of each is checked equal to
the compiled one's. The Python loop is timed on a smaller size and scaled per sample. Prints a table,
then one JSON line.

megatron-core's ``helpers_cpp`` is a reference only, never a dependency: pass ``--megatron-helpers``
a directory holding ``megatron/core/datasets/helpers_cpp*.so`` (for example an unpacked
``megatron-core`` wheel); it is loaded alone, without importing megatron.
"""

from __future__ import annotations

import argparse
import glob
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from training.data.blended_dataset import build_blending_indices, fill_blending_indices, normalize
from training.data.gpt_dataset import build_sample_index

GPT3_175B_SAMPLES = 500_000 * 1536


def python_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The compiled builder's own loop run by the Python interpreter: what it replaced (the reference)."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    fill_blending_indices([float(x) for x in weights], dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def python_exhaustive_blending_indices(sizes) -> tuple[np.ndarray, np.ndarray]:
    """The pure-Python loop that ``build_exhaustive_blending_indices`` replaced."""
    total = int(sum(sizes))
    w = [s / total for s in sizes]
    taken = [0] * len(sizes)
    open_ = [d for d in range(len(sizes)) if sizes[d] > 0]
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    for i in range(total):
        scale = max(float(i), 1.0)
        best = max(open_, key=lambda d: (w[d] * scale - taken[d], -d))
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
        if taken[best] == sizes[best]:
            open_.remove(best)
    return dataset_index, dataset_sample_index


def load_megatron_helpers(root: str | None):
    """megatron-core's compiled ``helpers_cpp`` module from ``root`` (or sys.path), else None."""
    roots = [root] if root else sys.path
    for base in roots:
        found = glob.glob(os.path.join(base, "megatron", "core", "datasets", "helpers_cpp*.so"))
        if found:
            loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", found[0])
            spec = importlib.util.spec_from_file_location("helpers_cpp", found[0], loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
    return None


def _timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def _blend_row(weights, size: int, python_size: int, helpers, repeats: int) -> dict:
    def megatron(w, n):
        dataset_index, dataset_sample_index = np.empty(n, np.int16), np.empty(n, np.int64)
        helpers.build_blending_indices(dataset_index, dataset_sample_index, np.asarray(w), len(w), n, False)
        return dataset_index, dataset_sample_index

    builders = {"compiled": build_blending_indices, "python": python_blending_indices}
    if helpers is not None:
        builders["megatron"] = megatron
    build_blending_indices(weights, 10)  # compile (or load the cached machine code) before timing
    times: dict[str, list[float]] = {name: [] for name in builders}
    reference = None
    for _ in range(repeats):
        for name, fn in builders.items():  # in turns, so a load spike hits all of them
            n = python_size if name == "python" else size
            seconds, out = _timed(fn, weights, n)
            times[name].append(seconds / n)
            if name == "compiled":
                reference = out
            else:
                assert np.array_equal(out[0], reference[0][:n]) and np.array_equal(
                    out[1], reference[1][:n]
                ), f"{name} differs from the compiled builder"
            del out
    per_sample = {name: statistics.median(v) for name, v in times.items()}
    row = {
        "datasets": len(weights),
        "samples": size,
        "ns_per_sample": {k: round(v * 1e9, 1) for k, v in per_sample.items()},
        "python_over_compiled": round(per_sample["python"] / per_sample["compiled"], 1),
        "gpt3_175b_seconds": {k: round(v * GPT3_175B_SAMPLES, 1) for k, v in per_sample.items()},
    }
    if helpers is not None:
        row["compiled_over_megatron"] = round(per_sample["compiled"] / per_sample["megatron"], 2)
    return row


def _sample_index_row(num_documents: int, seq_length: int, helpers, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4096, num_documents, dtype=np.int32)
    document_index = rng.permutation(num_documents).astype(np.int32)
    tokens = int(lengths.sum())
    times: dict[str, list[float]] = {"compiled": []}
    if helpers is not None:
        times["megatron"] = []
    for _ in range(repeats):
        seconds, ours = _timed(build_sample_index, lengths, document_index, seq_length, 1, tokens)
        times["compiled"].append(seconds)
        if helpers is not None:
            seconds, theirs = _timed(
                helpers.build_sample_idx_int32, lengths, document_index, seq_length, 1, tokens, True, 1
            )
            times["megatron"].append(seconds)
            assert np.array_equal(ours, theirs), "the sample index differs from megatron-core's"
    medians = {k: statistics.median(v) for k, v in times.items()}
    row = {"documents": num_documents, "samples": (tokens - 1) // seq_length, "seconds": medians}
    if helpers is not None:
        row["compiled_over_megatron"] = round(medians["compiled"] / medians["megatron"], 2)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000, help="blended samples per timing")
    parser.add_argument("--python-samples", type=int, default=200_000, help="samples for the Python loop")
    parser.add_argument("--datasets", type=int, nargs="+", default=[3, 8], help="datasets per blend")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megatron-helpers", help="directory holding megatron/core/datasets/helpers_cpp*.so")
    args = parser.parse_args(argv)
    helpers = load_megatron_helpers(args.megatron_helpers)
    rows = []
    print(f"blending indices ({'with' if helpers else 'without'} megatron-core's helpers_cpp as reference)")
    print(
        f"{'datasets':>8} {'compiled ns/sample':>19} {'C++ ns/sample':>14} {'Python ns/sample':>17} "
        f"{'Python/compiled':>16} {'compiled/C++':>13} {'768M samples (s)':>17}"
    )
    for count in args.datasets:
        weights = normalize(np.random.default_rng(count).random(count).tolist())
        row = _blend_row(weights, args.samples, args.python_samples, helpers, args.repeats)
        rows.append(row)
        ns = row["ns_per_sample"]
        print(
            f"{count:>8} {ns['compiled']:>19.1f} {ns.get('megatron', float('nan')):>14.1f} {ns['python']:>17.1f} "
            f"{row['python_over_compiled']:>16.1f} {row.get('compiled_over_megatron', float('nan')):>13.2f} "
            f"{row['gpt3_175b_seconds']['compiled']:>17.1f}"
        )
    sample_index = _sample_index_row(1_000_000, 256, helpers, args.repeats)
    print(
        f"GPT sample index, {sample_index['documents']} documents, {sample_index['samples']} samples: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in sample_index["seconds"].items())
    )
    result = {"blending": rows, "sample_index": sample_index, "load_average": os.getloadavg()[0]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

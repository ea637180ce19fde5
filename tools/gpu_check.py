"""The one prepared command for a machine with a GPU: Trident's CUDA tests and its throughput, one table.

    python tools/gpu_check.py                      # on the GPU machine: about 6-7 minutes on one H200
    python tools/gpu_check.py --device cpu --quick # here: the same steps, tiny sizes, CUDA tests skipped

Steps, each a child process with its own time limit (a hang or a crash is a row of the table, not
the end of the check):

1. Packages: what Trident imports that this machine lacks. A machine without internet gets them as
   wheels: ``--wheels DIR`` installs the missing ones from ``DIR`` first (``pip install --no-index``).
2. ``pytest -m cuda`` on ``test_cuda.py``, ``test_fp8.py``, ``test_fp8_blockwise.py``, ``test_fp8_params.py``
   and ``test_cuda_graphs.py`` at world size 1 on NCCL: CUDA graphs (equal losses with and without,
   re-capture, microbatches in flight, the cap), CUDA-vs-CPU parity (fp32 with TF32 off within 1e-5,
   bf16 within 1e-2), flash attention with GQA, 20 steps under
   ``torch.cuda.set_sync_debug_mode("error")``, the distributed optimizer with overlap and the CUDA
   timeline, the peak device memory of a save and a load, the GPU's FP8 products against the CPU's,
   torch's blockwise FP8 kernel against the dequantised product, and the optimizer's cast of a shard of a
   weight held in 128x128 tiles. Each test's result and its printed
   figures.
3. ``tools/plan_check_memory.py gpu``: the planner's memory figure and its fake-tensor dry run (placed on
   the GPU, so its kernels decide what attention keeps) against ``torch.cuda.max_memory_allocated`` of
   the same step run for real, for one ~0.5B LLaMA stage in three layouts.
4. ``tools/bench/cross_entropy.py --device cuda``: the output layer and the loss at vocabulary 128,256,
   8,192 tokens, hidden 2048, bf16: peak ``max_memory_allocated`` and time of the plain loss, the
   native fused one and the output layer inside the loss (``--cross-entropy-fusion-impl linear``).
5. ``tools/bench/model.py --device cuda``: tokens/s and MFU of ``pretrain()`` (eager and ``--compile``)
   against the same model in a plain transformers loop, LLaMA ~1B at seq 4096 (one microbatch a step,
   then eight), GPT-2 124M at seq 1024, bf16. Each configuration is its own process; one that would
   not finish before ``--deadline`` is skipped and says so. GPT-2 124M runs a third phase with
   ``--cuda-graph-impl local`` (``--cuda-graphs``, about 20 s more): its tokens/s against the
   transformers + compile loop and against Trident eager, as ``graphs`` rows (on a CPU, ``--quick``:
   the run's one line saying CUDA graphs need CUDA). ``tests/unit/test_cuda_graphs.py``'s CUDA tests
   run in step 2.

6. (last, in what time the deadline leaves) ``tools/bench/dp.py --world 1``: ZeRO-2 and ZeRO-3 (prefetching, and at step scope) against the
   distributed optimizer with overlap, on one device where the collectives are local copies: sharding's
   own overhead (issue 29 asks <= 1.05x), a ~0.35B GPT in fp32, 4 microbatches (about 40 s).

7. ``tools/bench/fp8.py``: one linear layer's FP8 products against bf16 (Llama-3 8B's FC1 and FC2, LLaMA
   ~1B's QKV), then bf16, FP8 tensorwise and FP8 delayed trained by ``pretrain()`` with ``--compile`` on
   a Llama-3-8B-shaped stack (8 layers, seq 8192) and on LLaMA ~1B (tokens/s, peak memory), and the
   loss gap over 200 iterations (``--fp8-data``: the data flags of those runs); last, the 8B-shaped stack
   again with its FP8 weights held in FP8 (``--fp8-param-gather``). ``--only fp8`` runs the FP8 tests and
   this step alone.

It prints one table, then one JSON line (``{"gpu_check": ...}``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOW_TO_RUN = """\
Through the device tool (the `run` tool; its command runs in a copy of this repository):

  1. `status` says whether this session is lent a GPU (can_start_another) and how much device time
     is left (15 minutes per task, all tries together; a start takes a few of them).
  2. Wheels: the GPU machine has torch 2.11, transformers, safetensors, sentencepiece, einops and
     tensorboard, and no internet. What else Trident imports travels as wheels: here, run
       python tools/gpu_check.py --download-wheels wheels
     (pytest, pluggy, iniconfig, xxhash for Python 3.10-3.13; wandb and numba are not needed: W&B
     stays off and the check trains on mock data), then pass carry=["wheels"] to `run`.
  3. run(command="python tools/gpu_check.py --wheels wheels", timeout_s=540, carry=["wheels"])
     The check stops starting new steps after --deadline seconds (default 480), so a 540 s limit
     leaves room for one rerun of a failed step within the 15 minutes:
       run(command="python tools/gpu_check.py --wheels wheels --only tests", timeout_s=240, ...)
  4. Put the printed table in the note; the last line is the JSON. Call `give_back` when done.
"""

PACKAGES = {  # import name -> (pip name, needed for the check)
    "pytest": ("pytest", True),
    "xxhash": ("xxhash", True),
    "safetensors": ("safetensors", True),
    "sentencepiece": ("sentencepiece", True),
    "einops": ("einops", True),
    "numpy": ("numpy", True),
    "yaml": ("pyyaml", True),
    "tqdm": ("tqdm", True),
    "tokenizers": ("tokenizers", True),
    "transformers": ("transformers", True),
    "tensorboard": ("tensorboard", False),
    "wandb": ("wandb", False),
    "numba": ("numba", False),
    "pytest_timeout": ("pytest-timeout", False),
    "matplotlib": ("matplotlib", False),
}
WHEELS = ["pytest", "pluggy", "iniconfig", "packaging", "xxhash"]
"""What ``--download-wheels`` fetches: the needed packages the GPU machine is known to lack."""

QUICK_BENCH = ["--config", "tiny", "--dtype", "fp32", "--iters", "1", "--warmup", "1", "--no-compile"]
GRAPHS_CONFIG = "gpt2-124m"
"""The configuration bench runs a third time with ``--cuda-graph-impl local`` (``--cuda-graphs``): the
host-bound one, where graphs should pay (issue 32), against the transformers + compile loop."""


def missing_packages() -> tuple[list[str], list[str]]:
    """(needed, optional) pip names of the packages this interpreter cannot import."""
    needed, optional = [], []
    for module, (pip_name, required) in PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            (needed if required else optional).append(pip_name)
    return needed, optional


def install_wheels(directory: str, names: list[str]) -> str:
    """``pip install --no-index --find-links DIR`` the ``names``; returns pip's last line."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", directory, *names],
        check=False,
        capture_output=True,
        text=True,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"pip exited {done.returncode}"


def download_wheels(directory: str) -> None:
    """Fetch :data:`WHEELS` for CPython 3.10-3.13 on x86-64 Linux into ``directory`` (run it here)."""
    for version in ("3.10", "3.11", "3.12", "3.13"):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", version]
            + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64"]
            + ["-d", directory, *WHEELS],
            check=True,
        )


def child_env() -> dict[str, str]:
    """A step's environment: this checkout first on ``PYTHONPATH`` (wheels installed with
    ``--target`` stay on it), W&B off."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, WANDB_MODE="disabled")


CUDA_TESTS = [
    "tests/unit/test_cuda.py",
    "tests/unit/test_fp8.py",
    "tests/unit/test_fp8_blockwise.py",
    "tests/unit/test_fp8_params.py",
    "tests/unit/test_cuda_graphs.py",
]


def run_tests(device: str, limit: float, files: list[str] = CUDA_TESTS) -> list[dict]:
    """``pytest -m cuda`` over ``files`` in a child; one row per test with its printed lines."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "cuda.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", *files]
        command += ["-p", "no:cacheprovider", f"--junitxml={report}", "-o", "junit_logging=system-out"]
        env = child_env()
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU mode proves the path: every test skips
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=limit
            )
        except subprocess.TimeoutExpired:
            return [
                {"step": "tests", "name": "tests/unit/test_cuda.py", "result": f"timeout after {limit:.0f} s"}
            ]
        if not os.path.exists(report):
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return [
                {
                    "step": "tests",
                    "name": "tests/unit/test_cuda.py",
                    "result": "error",
                    "detail": " | ".join(tail),
                }
            ]
        rows = _junit_rows(report)
        rows.append(
            {
                "step": "tests",
                "name": "(all)",
                "result": f"exit {done.returncode}",
                "seconds": time.perf_counter() - start,
            }
        )
        return rows


def _junit_rows(path: str) -> list[dict]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        result, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                result, detail = (
                    {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[kind],
                    node.get("message", ""),
                )
        out = case.find("system-out")
        printed = (
            [line for line in (out.text or "").splitlines() if line and not line.startswith(("-", " ["))]
            if out is not None
            else []
        )
        rows.append(
            {
                "step": "tests",
                "name": case.get("name"),
                "result": result,
                "seconds": float(case.get("time", 0.0)),
                "detail": (detail.splitlines() or [""])[0][:160],
                "figures": [line for line in printed if ":" in line and "iteration" not in line][:3],
            }
        )
    return rows


def run_tool(command: list[str], limit: float) -> tuple[dict | None, str]:
    """Run a tools/ script in a child (:func:`child_env`) and read its final JSON line; returns
    (the JSON, "") or (None, why not: a timeout or the output's last lines)."""
    try:
        done = subprocess.run(
            [sys.executable, *command], cwd=ROOT, env=child_env(), check=False, capture_output=True, text=True,
            timeout=limit,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"timeout after {limit:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return None, " | ".join((done.stdout + done.stderr).strip().splitlines()[-2:])
    return json.loads(lines[-1]), ""


def _failed(step: str, key: str, name: str, why: str) -> dict:
    result = why if why.startswith("timeout") else "error"
    return {"step": step, key: name, "result": result, "detail": "" if why == result else why}


def run_bench(device: str, configs: list[str], quick: bool, deadline: float, started: float) -> list[dict]:
    """``tools/bench/model.py`` once per configuration, each in a child, while time is left."""
    rows = []
    for config in configs:
        left = deadline - (time.perf_counter() - started)
        if left < 30:
            rows.append({"step": "bench", "config": config, "result": f"skipped: {deadline:.0f} s deadline"})
            continue
        command = ["tools/bench/model.py", "--device", device]
        command += QUICK_BENCH if quick else ["--config", config, "--dtype", "bf16"]
        graphs = quick or config == GRAPHS_CONFIG
        result, why = run_tool(command + ["--cuda-graphs"] * graphs, left)
        if result is None:
            rows.append(_failed("bench", "config", config, why))
            continue
        rows += [{"step": "bench", "result": "ok", **row} for row in result["rows"] if "contestant" in row]
        if graphs:  # the graphs phase: replayed, or the run's one line saying it went on without them
            rows.append({"step": "graphs", "config": config, "result": "ok", "detail": result["cuda_graphs"]})
            rows += [
                {
                    "step": "graphs",
                    "config": config,
                    "result": "ok",
                    "detail": f"{r['ratio']}: {r['value']:.3f}",
                }
                for r in result["rows"]
                if "cuda-graph-impl" in r.get("ratio", "")
            ]
    return rows


def run_memory(device: str, quick: bool, limit: float) -> list[dict]:
    """``tools/plan_check_memory.py gpu`` in a child: one row per layout."""
    command = ["tools/plan_check_memory.py", "gpu", "--device", device] + (["--quick"] if quick else [])
    result, why = run_tool(command, limit)
    if result is None:
        return [_failed("memory", "layout", "(all)", why)]
    rows = []
    for row in result["rows"]:
        failed = "dry_run_error" in row or "real_error" in row
        rows.append({"step": "memory", "result": "error" if failed else "ok", **row})
    return rows


LOSS_SIZES = {  # tools/bench/cross_entropy.py: LLaMA-3's vocabulary and a 1B model's width on a GPU
    False: ["--vocab", "128256", "--tokens", "8192", "--hidden", "2048", "--dtypes", "bfloat16"],
    True: ["--vocab", "512", "--tokens", "64", "--hidden", "16", "--dtypes", "bfloat16", "--steps", "1"],
}


def run_loss(device: str, quick: bool, limit: float) -> list[dict]:
    """``tools/bench/cross_entropy.py`` in a child: the three losses' peak memory and time, one row."""
    result, why = run_tool(["tools/bench/cross_entropy.py", "--device", device, *LOSS_SIZES[quick]], limit)
    if result is None:
        return [_failed("loss", "dtype", "bfloat16", why)]
    return [{"step": "loss", "result": "ok", **row} for row in result["results"]]


ZERO_SIZES = {  # tools/bench/dp.py at world size 1: a ~0.35B GPT in fp32, Megatron's 40M-element buckets
    False: "--layers 12 --hidden 1536 --heads 12 --seq 2048 --vocab 32768 --microbatches 4 --bucket-size 40000000 "
    "--steps 6 --warmup 2",
    True: "--layers 2 --hidden 64 --heads 4 --seq 32 --vocab 512 --microbatches 2 --steps 2 --warmup 1",
}
ZERO_CONFIGS = ["distopt+overlap", "zero2+overlap", "zero3+prefetch", "zero3+step"]


def run_zero(quick: bool, limit: float) -> list[dict]:
    """``tools/bench/dp.py --world 1``: ZeRO-2 and ZeRO-3 (both scopes) against the distributed optimizer
    where no rank shares anything, so that the ratio is sharding's own overhead (issue 29: <= 1.05x)."""
    command = ["tools/bench/dp.py", "--world", "1", "--configs", *ZERO_CONFIGS, *ZERO_SIZES[quick].split()]
    result, why = run_tool(command, limit)
    if result is None:
        return [_failed("zero", "config", "(all)", why)]
    return [
        {
            "step": "zero",
            "config": name,
            "result": "ok",
            "device": result["device"],
            "median_ms": ms,
            "vs_distopt": result["zero_vs_distopt"].get(name, 1.0),
        }
        for name, ms in result["median_ms"].items()
    ]


FP8_RUNS = {  # (bench_fp8 arguments, seconds each contestant may take): the most telling first
    False: [
        (["layer"], 120),
        (["speed", "--config", "llama3-8b"], 170),
        (["loss", "--config", "gpu-llama", "--iters", "200"], 90),
        (["speed", "--config", "llama-1b", "--contestants", "bf16", "fp8 tensorwise"], 120),
        (
            [
                "speed",
                "--config",
                "llama3-8b",
                "--contestants",
                "bf16",
                "fp8 tensorwise",
                "--fp8-extra=--fp8-param-gather",
            ],
            170,
        ),
    ],
    True: [
        (["speed", "--config", "tiny-llama", "--iters", "5", "--warmup", "2", "--no-compile"], 120),
        (["loss", "--config", "tiny-llama", "--iters", "8", "--contestants", "bf16", "fp8 delayed"], 120),
    ],
}


def run_fp8(device: str, quick: bool, deadline: float, started: float, data: str) -> list[dict]:
    """``tools/bench/fp8.py``: bf16 against FP8, both compiled (a Llama-3-8B-shaped stack, LLaMA ~1B),
    and the loss gap over 200 iterations; ``data`` (``--fp8-data``) is the loss runs' data flags."""
    rows = []
    for arguments, each in FP8_RUNS[quick]:
        label = " ".join(arguments[:3]) + "".join(
            f" {a.split('=')[1]}" for a in arguments if a.startswith("--fp8-extra")
        )
        contestants = 1 if arguments[0] == "layer" else 2 if "--contestants" in arguments else 3
        left = deadline - (time.perf_counter() - started)
        if left < 30:
            rows.append({"step": "fp8", "run": label, "result": f"skipped: {deadline:.0f} s deadline"})
            continue
        command = ["tools/bench/fp8.py", *arguments, "--device", device, "--limit", str(each)]
        if arguments[0] == "loss" and data:
            command += ["--extra", data]
        result, why = run_tool(command, min(left, each * contestants + 20))
        if result is None:
            rows.append(_failed("fp8", "run", label, why))
            continue
        rows += [
            {"step": "fp8", "run": label, "result": "error" if "error" in r else "ok", **r}
            for r in result["rows"]
        ]
    return rows


def _print_fp8(rows: list[dict]) -> None:
    for r in rows:
        if r["step"] != "fp8":
            continue
        if r["result"] != "ok" or "contestant" not in r:
            print(
                f"{'fp8':<6} {r['run']:<34} {r.get('contestant', ''):<16} {r['result']} {r.get('error', r.get('detail', ''))}"
            )
        elif "shape" in r:
            print(
                f"{'fp8':<6} {'layer ' + r['shape']:<34} bf16 {r['bf16_ms']:.3f} ms, FP8 {r['fp8_compiled_casts_ms']:.3f} "
                f"ms ({r['bf16_ms'] / r['fp8_compiled_casts_ms']:.2f}x; eager casts {r['fp8_eager_casts_ms']:.3f} ms)"
            )
        elif "step_ms" in r:
            ratio = f"{r.get('vs_bf16', float('nan')):.3f}x"
            print(
                f"{'fp8':<6} {r['run']:<34} {r['contestant']:<16}{r['tokens_per_s']:>10.0f} tok/s "
                f"{r['step_ms']:>8.1f} ms {ratio:>8} vs bf16  peak {r['peak_mib']:.0f} MiB"
            )
        else:
            gap = (
                f"max gap {r['max_gap']:.4f}, last 50 {r['last50_vs_bf16']:+.3%}"
                if "max_gap" in r
                else "reference"
            )
            print(f"{'fp8':<6} {r['run']:<34} {r['contestant']:<16} final {r['final_loss']:.4f}  {gap}")


def _section(rows: list[dict], step: str, header: str) -> list[dict]:
    """The rows of ``step``, its column header printed first where there are any."""
    chosen = [r for r in rows if r["step"] == step]
    if chosen:
        print(header)
    return chosen


def print_table(env: dict, rows: list[dict]) -> None:
    print(f"gpu_check on {env['device']} | torch {env['torch']} | {env['packages']}")
    print(f"{'step':<6} {'test / configuration':<72} {'result':<9} {'s':>6}  figures")
    for r in rows:
        if r["step"] == "tests":
            figures = "; ".join(r.get("figures") or []) or r.get("detail", "")
            print(f"{'test':<6} {r['name']:<72} {r['result']:<9} {r.get('seconds', 0.0):>6.1f}  {figures}")
    memory_header = (
        f"{'memory':<6} {'layout':<32}{'model GB':>10}{'dry run GB':>12}{'counted GB':>12}{'CUDA max GB':>13}"
    )
    for r in _section(rows, "memory", memory_header):
        figures = [r.get(k) for k in ("model_peak", "dry_run_peak", "live_bytes_peak", "cuda_max_allocated")]
        cells = "".join(
            f"{x / 1e9:>{w}.3f}" if x else f"{'-':>{w}}" for x, w in zip(figures, (10, 12, 12, 13))
        )
        errors = " ".join(r[k] for k in ("dry_run_error", "real_error", "detail") if k in r)
        print(f"{'memory':<6} {r['layout']:<32}{cells}  {r['result']} {errors}")
    loss_header = f"{'loss':<6} {'dtype':<10}{'plain MiB':>10}{'native':>16}{'linear':>16}{'plain ms':>10}{'native':>9}{'linear':>9}"
    for r in _section(rows, "loss", loss_header):
        if r["result"] != "ok":
            print(f"{'loss':<6} {r['dtype']:<10} {r['result']} {r.get('detail', '')}")
            continue
        print(
            f"{'loss':<6} {r['dtype']:<10}{r['plain_peak_mib']:>10.0f}"
            f"{r['fused_peak_mib']:>9.0f} ({r['peak_ratio']:.2f}){r['linear_peak_mib']:>9.0f} ({r['linear_peak_ratio']:.2f})"
            f"{r['plain_ms']:>10.1f}{r['fused_ms']:>9.1f}{r['linear_ms']:>9.1f}"
        )
    _print_fp8(rows)
    for r in _section(
        rows, "zero", f"{'zero':<6} {'configuration (world size 1)':<32}{'median ms':>10}{'vs distopt':>12}"
    ):
        if r["result"] != "ok":
            print(f"{'zero':<6} {r['config']:<32} {r['result']} {r.get('detail', '')}")
            continue
        print(
            f"{'zero':<6} {r['config'] + ' on ' + r['device']:<32}{r['median_ms']:>10.1f}{r['vs_distopt']:>11.3f}x"
        )
    if any(r["step"] == "bench" for r in rows):
        print(
            f"{'bench':<6} {'config dtype phase contestant':<48}{'tokens/s':>10}{'MFU mg':>8}{'MFU tt':>8}{'step ms':>9}{'peak MiB':>10}{'host %':>8}"
        )
    for r in rows:
        if r["step"] == "graphs":
            print(f"{'graphs':<6} {r['config']:<13} {r['detail']}")
        if r["step"] != "bench":
            continue
        if r["result"] != "ok":
            print(f"{'bench':<6} {r['config']:<48} {r['result']} {r.get('detail', '')}")
            continue
        mfu = [f"{r[k]:.1%}" if r.get(k) is not None else "n/a" for k in ("mfu_megatron", "mfu_torchtitan")]
        label = f"{r['config']} {r['dtype']} {r['phase']} {r['contestant']}"
        host = "n/a" if r.get("host_share") is None else f"{r['host_share']:.1%}"
        print(
            f"{'bench':<6} {label:<48}{r['tokens_per_s']:>10.0f}{mfu[0]:>8}{mfu[1]:>8}"
            f"{r['step_ms']:>9.1f}{r['peak_step_mib']:>10.0f}{host:>8}"
        )


def environment(device: str) -> dict:
    """The device's name and torch's version (torch is imported only for a GPU's name: the steps'
    children import it themselves)."""
    name = "cpu"
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return {"device": name, "torch": importlib.metadata.version("torch")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=HOW_TO_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny benchmark sizes (the CPU mode CI runs)")
    parser.add_argument(
        "--only",
        choices=["tests", "memory", "loss", "zero", "bench", "fp8"],
        default=None,
        help="run one step only",
    )
    parser.add_argument(
        "--fp8-data",
        default="",
        help="data flags for the FP8 loss runs, one string (--fp8-data='--data-path P ...'; default: the "
        "built-in corpus, built on first use)",
    )
    parser.add_argument(
        "--config",
        nargs="+",
        default=["llama-1b", "llama-1b-ga8", "gpt2-124m"],
        help="bench_model configurations",
    )
    parser.add_argument(
        "--deadline", type=float, default=480.0, help="seconds after which no new step starts"
    )
    parser.add_argument("--wheels", default=None, help="install missing packages from this wheel directory")
    parser.add_argument(
        "--download-wheels", default=None, metavar="DIR", help="fetch the wheels (with internet)"
    )
    args = parser.parse_args(argv)
    if args.download_wheels:
        download_wheels(args.download_wheels)
        return {}
    started = time.perf_counter()
    needed, optional = missing_packages()
    installed = install_wheels(args.wheels, needed) if args.wheels and needed else ""
    if installed:
        needed, optional = missing_packages()
    env = environment(args.device)
    env["packages"] = (
        f"missing: {', '.join(needed) or 'none'} (optional absent: {', '.join(optional) or 'none'})"
    )
    rows: list[dict] = []
    if needed:
        rows.append(
            {
                "step": "tests",
                "name": "packages",
                "result": "error",
                "detail": f"pip install {' '.join(needed)}",
            }
        )
    if args.only in (None, "tests", "fp8") and not needed:
        files = (
            ["tests/unit/test_fp8.py", "tests/unit/test_fp8_blockwise.py", "tests/unit/test_fp8_params.py"]
            if args.only == "fp8"
            else CUDA_TESTS
        )
        rows += run_tests(
            args.device, max(min(args.deadline - (time.perf_counter() - started), 200.0), 30.0), files
        )
    if args.only in (None, "fp8") and not needed:
        rows += run_fp8(args.device, args.quick, args.deadline, started, args.fp8_data)
    if args.only in (None, "memory") and not needed:
        left = args.deadline - (time.perf_counter() - started)
        rows += run_memory(args.device, args.quick, max(min(left, 240.0), 30.0))
    if args.only in (None, "loss") and not needed:
        left = args.deadline - (time.perf_counter() - started)
        rows += run_loss(args.device, args.quick, max(min(left, 120.0), 30.0))
    if args.only in (None, "bench") and not needed:
        configs = ["tiny"] if args.quick else args.config
        rows += run_bench(args.device, configs, args.quick, args.deadline, started)
    if args.only in (None, "zero") and not needed:  # last: what time the deadline leaves
        left = args.deadline - (time.perf_counter() - started)
        if args.only == "zero" or left >= 30:
            rows += run_zero(args.quick, max(min(left, 90.0), 30.0))
        else:
            rows.append(
                {"step": "zero", "config": "(all)", "result": f"skipped: {args.deadline:.0f} s deadline"}
            )
    print_table(env, rows)
    bad = [
        r for r in rows if r["result"] in ("FAILED", "ERROR", "error") or r["result"].startswith("timeout")
    ]
    result = {
        "gpu_check": env,
        "ok": not bad,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main().get("ok", True) else 1)

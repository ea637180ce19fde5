"""Tokens/s and MFU of Trident's model trained by ``pretrain()`` at one rank, against a plain PyTorch loop.

The plain loop trains the same architecture built from Hugging Face ``transformers``
(``GPT2LMHeadModel`` / ``LlamaForCausalLM``, SDPA attention) from the same initial weights on the same
tokens: forward, fp32 cross-entropy, backward, gradient clipping, AdamW (``fused=True`` where the
device has the kernel, ``foreach`` elsewhere, as Trident's optimizer), bf16 by autocast over fp32 weights.
It runs eagerly and under ``torch.compile`` (the loss inside the compiled function); the two share one
model and optimizer and take turns, so only the eager loop's first loss equals Trident's (a check that
the architectures are the same). Trident runs ``pretrain()`` with
``--cross-entropy-loss-fusion --gradient-accumulation-fusion``, eagerly, then again with ``--compile``,
and with ``--cuda-graphs`` a third time with ``--cuda-graph-impl local`` (eager layers replayed from
CUDA graphs; on a CPU that run goes on without graphs, and the table's last line says so).

The contestants take turns: after each ``pretrain()`` iteration, its ``iteration_hook`` runs one step
of each plain loop on the microbatch Trident just trained on. The first ``--warmup`` iterations
(compilation) are dropped; figures are medians. A ``pretrain()`` iteration is timed from the end of
one hook call to the start of the next, so it includes the loop's own work. On a CPU the time is the
process's CPU time with ``--threads`` threads (1 by default: machine noise barely moves it); on a GPU
wall time between synchronisations. Trident's eager run and its compiled run are two phases, and the
plain loops run in both: the table gives every contestant of each phase (its ``phase`` column), and
each ratio compares figures of one phase (compiled against eager also normalised by the transformers
eager loop, which runs in both).

FLOPs per step, two ways, both stated: Megatron's count (``training/reporting/throughput.py``: every matmul
3x, causal attention halved, the output layer included) and torchtitan's (``6 N + 12 L H Q T`` per
token: N the parameters but the input embedding, attention not halved). MFU needs the device's peak
(the GPU table of ``training/reporting/throughput.py``, or ``--peak-tflops``). Peak memory is the most a step
allocated above what was allocated when it started (activations, gradients, temporaries): CUDA's
allocator on a GPU, the profiler's allocation records on a CPU, measured on one extra step. That
step is profiled, and its ``host %`` is the host's share of it (``tools/op_profile.host_share``): on a
GPU the time no kernel ran (the device waiting on the host), on a CPU the time outside ATen's
operators (Python, the autograd engine, the framework). The JSON also gives it in milliseconds
(``host_ms``: the share times the median step; the profiler's own cost counts in the share). With
``--profile`` that step's operators are printed side by side, Trident's against the transformers
loop's (``tools/op_profile.py``): where the eager layers differ, named op by op.

    python tools/bench/model.py                                   # CPU: GPT-2-small shape, fp32 and bf16
    python tools/bench/model.py --layers 4 --iters 6              # a quicker CPU run
    python tools/bench/model.py --no-compile --profile            # eager only, with the op-by-op profile
    python tools/bench/model.py --device cuda                     # GPU: GPT-2 124M seq 1024, LLaMA ~1B seq 4096, bf16
    python tools/bench/model.py --device cuda --config gpt2-124m --cuda-graphs   # and with CUDA graphs

Configurations (``--config``): ``gpt2-small`` (12 x 768, 12 heads, vocabulary 50304, seq 512, one
microbatch of 1, the CPU default), ``gpt2-124m`` (the same at seq 1024, microbatch 8) and ``llama-1b``
(16 x 2048, 32 heads, GQA 8, FFN 8192, vocabulary 128256, seq 4096, microbatch 1), the GPU defaults,
and ``llama-1b-ga8`` (the same, 8 microbatches a step);
``tiny`` (2 x 64) proves the path in seconds (``tools/gpu_check.py --device cpu --quick``).
``--microbatches N`` (default 1, or the configuration's): each step accumulates N microbatches before
its one optimizer step, on both sides (the plain loop's loss is the microbatches' mean, as Trident's),
so the optimizer's share of a step shrinks as in a real run's global batch.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_gpt
from core.optimizer import has_fused_kernel
from core.transformer.cuda_graphs import cuda_graphs_off_line
from models.gpt.hf_mapping import hf_architecture, hf_config_kwargs, to_hf
from tools.bench.args import llama_flags
from tools.op_profile import StepProbe, measure, print_comparison
from training.reporting.throughput import num_floating_point_operations, peak_tflops
from training.training import pretrain

CONFIGS = {
    "tiny": {  # tools/gpu_check.py --device cpu --quick: the path end to end, in seconds
        "arch": "gpt2",
        "layers": 2,
        "hidden": 64,
        "heads": 4,
        "vocab": 512,
        "seq": 64,
        "mbs": 2,
    },
    "gpt2-small": {
        "arch": "gpt2",
        "layers": 12,
        "hidden": 768,
        "heads": 12,
        "vocab": 50304,
        "seq": 512,
        "mbs": 1,
    },
    "gpt2-124m": {
        "arch": "gpt2",
        "layers": 12,
        "hidden": 768,
        "heads": 12,
        "vocab": 50304,
        "seq": 1024,
        "mbs": 8,
    },
    "llama-1b": {
        "arch": "llama",
        "layers": 16,
        "hidden": 2048,
        "heads": 32,
        "groups": 8,
        "ffn": 8192,
        "vocab": 128256,
        "seq": 4096,
        "mbs": 1,
    },
}
PHASE_FLAGS = {"eager": "", "compile": " --compile", "graphs": " --cuda-graph-impl local"}
"""What each phase adds to Trident's command line, as its contestant's label says."""
CONFIGS["llama-1b-ga8"] = dict(CONFIGS["llama-1b"], microbatches=8)
"""LLaMA ~1B with 8 microbatches a step: the optimizer's share of a step as in a real global batch."""


def trident_flags(spec: dict, args: argparse.Namespace, dtype: str, phase: str) -> list[str]:
    """``pretrain()``'s command line: the model, mock data of the whole vocabulary, one microbatch a step."""
    flags = (
        f"--num-layers {spec['layers']} --hidden-size {spec['hidden']} --num-attention-heads {spec['heads']} "
        f"--seq-length {spec['seq']} --max-position-embeddings {spec['seq']} --micro-batch-size {spec['mbs']} "
        f"--global-batch-size {spec['mbs'] * spec['microbatches']} --train-iters {args.warmup + args.iters + 1} --lr 1e-4 "
        f"--lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer "
        f"--vocab-size {spec['vocab'] - 1} --eval-iters 0 --eval-interval {10**6} --log-interval {10**6} "
        f"--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --cross-entropy-loss-fusion "
        f"--seed 1234"
    ).split()
    if args.gradient_accumulation_fusion:
        flags += ["--gradient-accumulation-fusion"]
    if spec["arch"] == "llama":
        flags += llama_flags(spec["ffn"], spec["groups"])
    else:
        flags += ["--openai-gelu"]
    if dtype == "bf16":
        flags += ["--bf16"]
    if phase == "compile":
        flags += ["--compile", "--compile-backend", args.backend]
    if phase == "graphs":  # eager layers, each replayed from CUDA graphs from its second call on
        flags += ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"]
    return flags


class PlainLoop:
    """The hand-written transformers loop: one step = forward, loss, backward, clip, AdamW.

    The eager and the compiled loop share one model and one optimizer (on a GPU two 1B models with
    their Adam states would not fit next to Trident's); they take turns training it.
    """

    def __init__(
        self, model, optimizer, dtype: str, device: torch.device, compiled: bool, backend: str
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.autocast = dtype == "bf16"
        self.loss = torch.compile(self._loss, backend=backend) if compiled else self._loss

    def _loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over ``microbatches`` (gradients accumulated, the loss their mean)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels in microbatches:
            loss = self.loss(tokens, labels) / len(microbatches)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        return total


def adamw(model, device: torch.device) -> torch.optim.AdamW:
    """AdamW as Trident's flags set it (weight decay on matrices only), with the kernel Trident's
    optimizer picks: torch's fused one where the device has it (CUDA; CPU from torch 2.4), else foreach."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    kind = {"fused": True} if has_fused_kernel(torch.optim.AdamW, device) else {"foreach": True}
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, **kind)


def hf_model(config, vocab: int, seq: int, state: dict, device: torch.device):
    """The transformers model of ``config`` with Trident's initial weights (fp32, SDPA attention)."""
    import transformers

    llama = hf_architecture(config) == "llama"
    kwargs = hf_config_kwargs(config, vocab, seq)
    cls_config = transformers.LlamaConfig if llama else transformers.GPT2Config
    hf_config = cls_config(**kwargs, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    model = (transformers.LlamaForCausalLM if llama else transformers.GPT2LMHeadModel)(hf_config)
    missing, unexpected = model.load_state_dict(to_hf(state, config, vocab), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"weights do not map onto transformers: missing {missing}, unexpected {unexpected}"
        )
    return model.to(device=device, dtype=torch.float32).train()


class Clock:
    """CPU time on a CPU, wall time between synchronisations on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()


def run_phase(spec, args, dtype: str, phase: str, plain: dict, device: torch.device) -> dict:
    """One ``pretrain()`` (``phase``: "eager", "compile" or "graphs") with the plain loops taking turns
    after each iteration."""
    clock = Clock(device)
    captured: dict = {}
    times: dict[str, list[float]] = {"trident": []}
    losses: dict[str, list[float]] = {"trident": []}
    ops: dict[str, dict] = {}
    last: list[float] = []
    batches: list[dict] = []

    def model_provider(*a, **k):
        model = pretrain_gpt.model_provider(*a, **k)
        captured.setdefault("config", model.config)
        captured.setdefault("flops", flops_per_step(spec, model))
        captured.setdefault(
            "state", {n: t.detach().float().cpu().clone() for n, t in model.state_dict().items()}
        )
        return model

    def forward_step(data_iterator, model):
        return pretrain_gpt.forward_step(_Recorder(data_iterator, batches), model)

    def hook(state) -> None:
        now = clock()
        final = state.iteration == args.warmup + args.iters + 1
        if final:  # the extra iteration measured memory only
            times["trident peak"] = [captured["memory"].stop()]
            times["trident host"] = [captured["memory"].host_share]
            ops["trident"] = captured["memory"].ops
        else:
            # Iteration 1 has no start mark (it is never timed: the warm-up drops it anyway).
            times["trident"].append(now - last[0] if last else float("nan"))
        if not plain:  # the plain loops start from Trident's initial weights
            model = hf_model(captured["config"], spec["vocab"], spec["seq"], captured["state"], device)
            optimizer = adamw(model, device)
            for name, comp in (("transformers", False), ("transformers+compile", True)):
                if not (comp and args.no_compile):
                    plain[name] = PlainLoop(model, optimizer, dtype, device, comp, args.backend)
        if len(batches) != spec["microbatches"]:
            raise RuntimeError(
                f"pretrain() read {len(batches)} microbatches in a step, not {spec['microbatches']}"
            )
        microbatches = [(b["tokens"].to(device), b["labels"].to(device)) for b in batches]
        batches.clear()
        for name, loop in plain.items():
            if final:  # the extra step measures memory only
                probe = measure(lambda loop=loop: loop.step(microbatches), device, args.profile)
                times[f"{name} peak"], ops[name] = [probe.peak], probe.ops
                times[f"{name} host"] = [probe.host_share]
                continue
            start = clock()
            loss = loop.step(microbatches)
            times.setdefault(name, []).append(clock() - start)
            losses.setdefault(name, []).append(float(loss))
        if state.iteration == args.warmup + args.iters:  # Trident's next (extra) iteration: memory
            captured["memory"] = StepProbe(device, args.profile)
        last[:] = [clock()]

    flags = trident_flags(spec, args, dtype, phase)
    state = pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        model_provider,
        forward_step,
        argv=flags,
        tokenizer_provider=pretrain_gpt.tokenizer_provider,
        iteration_hook=hook,
    )
    # The losses are read from the device at log steps (training/step_ledger.py): all are there at the end.
    losses["trident"] = [float(step["lm loss"]) for step in state.losses[: args.warmup + args.iters]]
    return {"times": times, "losses": losses, "flops": captured["flops"], "ops": ops}


class _Recorder:
    """The data iterator, remembering the microbatches it hands out (the plain loops train on them)."""

    def __init__(self, iterator, sink: list) -> None:
        self.iterator, self.sink = iterator, sink

    def __next__(self):
        batch = next(self.iterator)
        self.sink.append(batch)
        return batch


def flops_per_step(spec: dict, model) -> dict[str, float]:
    """FLOPs of one training step (all its microbatches), Megatron's way and torchtitan's way."""
    config = model.config
    tokens = spec["mbs"] * spec["seq"] * spec["microbatches"]
    megatron_args = SimpleNamespace(
        seq_length=spec["seq"],
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_query_groups=config.num_query_groups,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_attention_heads=config.num_attention_heads,
        kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size,
        swiglu=config.gated_linear_unit,
    )
    megatron = num_floating_point_operations(megatron_args, spec["mbs"] * spec["microbatches"], spec["vocab"])
    # torchtitan: parameters but the input embedding (a tied output layer still multiplies once).
    params = sum(p.numel() for n, p in model.named_parameters() if "embedding" not in n)
    if not config.untie_embeddings_and_output_weights:
        params += model.embedding.word_embeddings.weight.numel()
    heads, head_dim = config.num_attention_heads, config.kv_channels
    torchtitan = tokens * (6 * params + 12 * config.num_layers * heads * head_dim * spec["seq"])
    return {"megatron": float(megatron), "torchtitan": float(torchtitan)}


def summarise(spec, args, dtype: str, phases: dict, device: torch.device) -> list[dict]:
    """One row per contestant and phase: median step time, tokens/s, TFLOP/s and MFU both ways, peak memory.

    The plain loops run in both phases; each phase's figures are its own (the machine's speed may
    differ between phases, which is why the ratios compare within a phase)."""
    flops = phases["eager"]["flops"]
    peak = peak_tflops(device, args.peak_tflops)
    tokens = spec["mbs"] * spec["seq"] * spec["microbatches"]
    rows = []
    for phase_name, phase in phases.items():
        for name, series in phase["times"].items():
            if name.endswith((" peak", " host")):
                continue
            label = f"trident{PHASE_FLAGS[phase_name]}" if name == "trident" else name
            seconds = statistics.median(series[args.warmup :])
            host = phase["times"][f"{name} host"][0]
            row = {
                "contestant": label,
                "phase": phase_name,
                "dtype": dtype,
                "step_ms": seconds * 1e3,
                "tokens_per_s": tokens / seconds,
                "peak_step_mib": phase["times"][f"{name} peak"][0] / 2**20,
                "host_share": host,
                "host_ms": None if host is None else host * seconds * 1e3,
                "first_loss": phase["losses"][name][0] if phase["losses"][name] else float("nan"),
            }
            for way, count in flops.items():
                row[f"tflops_{way}"] = count / seconds / 1e12
                row[f"mfu_{way}"] = None if peak is None else count / seconds / 1e12 / peak
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--config", nargs="+", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--dtype", nargs="+", default=None, choices=["fp32", "bf16"])
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per phase")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first iterations per phase (>= 1)")
    parser.add_argument(
        "--microbatches", type=int, default=None,
        help="microbatches per step (gradient accumulation, one optimizer step for all of them); "
        "default: the configuration's",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of both sides")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument(
        "--gradient-accumulation-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Trident's linear layers accumulate weight gradients into main_grad themselves (and so stay "
        "eager under --compile); --no-gradient-accumulation-fusion, Trident's default, lets a TP=1 layer "
        "compile whole",
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="one more phase: Trident with --cuda-graph-impl local (on a CPU it runs without graphs, and says so)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true", help="print the operators of one step, Trident against transformers"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: pretrain()'s first iteration cannot be timed")
    device = torch.device(args.device)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    names = args.config or (["gpt2-small"] if device.type == "cpu" else ["gpt2-124m", "llama-1b"])
    dtypes = args.dtype or (["fp32", "bf16"] if device.type == "cpu" else ["bf16"])
    load = os.getloadavg()[0]
    rows = []
    for name in names:
        spec = dict(CONFIGS[name], name=name)
        spec["microbatches"] = args.microbatches or spec.get("microbatches", 1)
        if args.layers:
            spec["layers"] = args.layers
        for dtype in dtypes:
            plain: dict = {}
            phases = {"eager": run_phase(spec, args, dtype, "eager", plain, device)}
            if not args.no_compile:
                phases["compile"] = run_phase(spec, args, dtype, "compile", plain, device)
            if args.cuda_graphs:
                phases["graphs"] = run_phase(spec, args, dtype, "graphs", plain, device)
            rows += [
                dict(r, config=name, layers=spec["layers"], microbatches=spec["microbatches"])
                for r in summarise(spec, args, dtype, phases, device)
            ]
            rows += ratios(phases, args, dtype, name)
            if args.profile:
                print_profiles(phases, f"{name} {spec['layers']} layers {dtype}")
    print_table(rows, args, device, load)
    result = {
        "benchmark": "bench_model",
        "device": str(device),
        "load": [load, os.getloadavg()[0]],
        "rows": rows,
    }
    if args.cuda_graphs:  # what the graphs phase was: replayed graphs, or the run's one line without them
        result["cuda_graphs"] = (
            "captured and replayed"
            if device.type == "cuda"
            else cuda_graphs_off_line("local", device.type, "gloo")
        )
        print(result["cuda_graphs"])
    print(json.dumps(result))
    return result


def ratios(phases: dict, args, dtype: str, name: str) -> list[dict]:
    """Trident against each plain loop in the same phase, and compiled against eager (also normalised
    by the transformers eager loop, which runs in both phases)."""

    def median(phase: str, who: str) -> float:
        return statistics.median(phases[phase]["times"][who][args.warmup :])

    out = [
        {
            "config": name,
            "dtype": dtype,
            "ratio": "trident eager / transformers eager (tokens/s)",
            "value": median("eager", "transformers") / median("eager", "trident"),
        }
    ]
    if "compile" in phases:
        out += [
            {
                "config": name,
                "dtype": dtype,
                "ratio": "trident --compile / transformers+compile (tokens/s)",
                "value": median("compile", "transformers+compile") / median("compile", "trident"),
            },
            {
                "config": name,
                "dtype": dtype,
                "ratio": "trident --compile / trident eager (tokens/s)",
                "value": median("eager", "trident") / median("compile", "trident"),
            },
            {
                "config": name,
                "dtype": dtype,
                "ratio": "trident --compile / trident eager, each against transformers eager in its phase",
                "value": (median("eager", "trident") / median("eager", "transformers"))
                / (median("compile", "trident") / median("compile", "transformers")),
            },
        ]
    if "graphs" in phases:
        best = (
            "transformers+compile" if "transformers+compile" in phases["graphs"]["times"] else "transformers"
        )
        out += [
            {
                "config": name,
                "dtype": dtype,
                "ratio": f"trident --cuda-graph-impl local / {best} (tokens/s)",
                "value": median("graphs", best) / median("graphs", "trident"),
            },
            {
                "config": name,
                "dtype": dtype,
                "ratio": "trident --cuda-graph-impl local / trident eager, each against transformers eager in "
                "its phase",
                "value": (median("eager", "trident") / median("eager", "transformers"))
                / (median("graphs", "trident") / median("graphs", "transformers")),
            },
        ]
    return out


def print_profiles(phases: dict, title: str) -> None:
    """Trident's step against the transformers loop's, op by op, eager and (if run) compiled."""
    pairs = {"eager": ("trident", "transformers"), "compile": ("trident", "transformers+compile")}
    for phase_name, (ours, theirs) in pairs.items():
        if phase_name in phases:
            ops = phases[phase_name]["ops"]
            label = "trident --compile" if phase_name == "compile" else "trident"
            print_comparison(f"{title}, {label} vs {theirs}", (label, theirs), ops[ours], ops[theirs])


def print_table(rows: list[dict], args, device: torch.device, load: float) -> None:
    clock = "wall time" if device.type == "cuda" else f"CPU time, {args.threads} thread(s)"
    print(
        f"one rank on {device.type}; {args.iters} timed steps after {args.warmup}, medians of {clock}; "
        f"load {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(
        "FLOPs: megatron = training/reporting/throughput.py (matmuls x3, causal attention halved); "
        "torchtitan = 6 N + 12 L H Q T per token (N without the input embedding)"
    )
    head = f"{'config':<13}{'mb':>3}{'layers':>7}{'dtype':>6} {'phase':<8}{'contestant':<32}{'step ms':>9}{'tokens/s':>10}"
    head += (
        f"{'TF/s mg':>9}{'TF/s tt':>9}{'MFU mg':>8}{'MFU tt':>8}{'peak MiB':>10}{'host %':>8}{'loss 1':>8}"
    )
    print(head)
    for r in rows:
        if "contestant" not in r:
            continue
        mfu = [f"{r[k]:.1%}" if r[k] is not None else "n/a" for k in ("mfu_megatron", "mfu_torchtitan")]
        host = "n/a" if r["host_share"] is None else f"{r['host_share']:.1%}"
        print(
            f"{r['config']:<13}{r['microbatches']:>3}{r['layers']:>7}{r['dtype']:>6} {r['phase']:<8}"
            f"{r['contestant']:<32}{r['step_ms']:>9.0f}"
            f"{r['tokens_per_s']:>10.0f}{r['tflops_megatron']:>9.3f}{r['tflops_torchtitan']:>9.3f}"
            f"{mfu[0]:>8}{mfu[1]:>8}{r['peak_step_mib']:>10.0f}{host:>8}{r['first_loss']:>8.3f}"
        )
    for r in rows:
        if "ratio" in r:
            print(f"{r['config']} {r['dtype']}: {r['ratio']}: {r['value']:.3f}")


if __name__ == "__main__":
    main()

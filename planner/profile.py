"""``--profile-local``: per-layer costs measured on this machine, for the shapes the search costs.

Each shape (tensor-parallel size, context-parallel size, micro-batch size, recomputation) is measured
once, when the search first asks for it. Three real stages of the model are built, as a three-stage
pipeline ``E|t|L`` would build them, on one rank of a fake process group of that size (so
tensor-parallel layers have one rank's shapes, context-parallel attention runs its ring over one
rank's share of the sequence, and their collectives cost nothing: communication is modelled separately):
the embedding, one decoder layer and the loss stage (final norm, output layer, cross-entropy). Each
runs forward, input gradient (I) and weight gradient (W) with the executor's own backward halves
(:mod:`core.pipeline_parallel.backward_split`), one thread, as a ``torchrun`` rank does; the median
of a few repeats is kept.

A context-parallel rank's share is measured, not taken as ``1 / cp`` of the whole sequence: its
products are ``cp`` times smaller, and ring attention runs ``cp`` block attentions and merges their
results by log-sum-exp. On this machine's CPU ranks a CP2 rank's layer measured 1.06-1.36x half the
whole-sequence layer, and a CP4 rank's 1.11-2.14x a quarter (forward and backward, hidden 256-512,
128-256 tokens: ``tools/plan_check_time.py cp-share``).

The same fixed work is timed before and after each shape, and each shape's times are brought to the
load the first one saw (load from elsewhere drifts while a search measures).

A shape too large to run here in a fraction of a second is measured at fewer tokens (and, if its
weights would not fit, at a narrower width, head size kept) and scaled back by the ratio of FLOPs.

The local cluster (:func:`local_cluster`) is this machine: its ranks share its cores, and its
collectives, pipeline messages, core sharing, the engine's fixed costs per action and per step, and
the optimizer step's costs per tensor and per element are measured with as many real ranks as the
plan has (:mod:`planner.calibrate`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

from core import parallel_state as ps
from core.distributed.distributed_data_parallel_config import DTYPES
from core.pipeline_parallel.backward_split import backward_input, backward_weight
from core.tensor_parallel import model_parallel_seed
from core.transformer import TransformerConfig
from models.gpt import GPTModel
from planner.calibrate import measure_host
from planner.costs import LayerProfile
from planner.hardware import Cluster, Gpu
from planner.model_spec import ModelSpec
from training.arguments.parser import transformer_config_from_args

__all__ = ["LocalProfile", "local_cluster", "measure_shape"]

FLOPS_BUDGET = 2e10
"""Largest forward (FLOPs) measured as is; beyond it tokens are cut and times scaled back."""
PARAM_BUDGET = 1e9
"""Largest decoder layer (bytes of parameters) built as is; beyond it the layer is made narrower."""


def _time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


@contextlib.contextmanager
def _one_rank_of(world: int, rank: int, tp: int, cp: int):
    """Parallel state of one rank of a fake group (pipeline ``E|t|L``, tensor parallel ``tp``, context
    parallel ``cp``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(tp, world // (tp * cp), context_parallel_size=cp)
        model_parallel_seed(1234)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _stage_seconds(args, vocab: int, tp: int, cp: int, stage: int, batch: int, seq: int, repeats: int):
    """(F, I, W) seconds of stage ``stage`` of the pipeline ``E|t|L`` on one context-parallel rank's
    share of ``batch x seq`` tokens."""

    fields = transformer_config_from_args(args) | {
        "tensor_model_parallel_size": tp,
        "context_parallel_size": cp,
        "pipeline_model_parallel_size": 3,
        "pipeline_model_parallel_layout": "E|t|L",
        "num_layers": 1,
        "sequence_parallel": tp > 1,
    }
    with _one_rank_of(3 * tp * cp, stage * tp * cp, tp, cp):
        config = TransformerConfig(**fields)
        model = GPTModel(config, vocab, max(seq, args.max_position_embeddings), pre_process=stage == 0,
                         post_process=stage == 2)  # fmt: skip
        dtype = config.params_dtype
        rank_seq = seq // cp  # this rank's share of the sequence (which tokens does not change the time)
        tokens = torch.randint(0, vocab, (batch, rank_seq))
        positions = torch.arange(rank_seq).repeat(batch, 1)
        shard = rank_seq // tp

        def forward():
            if stage == 0:
                return None, model(tokens, positions)
            x = torch.randn(shard, batch, config.hidden_size, dtype=dtype, requires_grad=True)
            model.set_input_tensor([x])
            if stage == 1:
                return x, model(None, positions)
            return x, model(None, positions, labels=tokens).sum()

        pairs = [forward() for _ in range(repeats + 1)]  # one for warm-up
        f, _ = _time(forward, repeats)
        grads = []

        def input_grad():
            x, out = pairs.pop()
            grad = None if stage == 2 else torch.ones_like(out)
            input_gradient, weights = backward_input(out, grad, x)
            grads.append(weights)
            return input_gradient

        input_grad()
        i, _ = _time(input_grad, repeats)
        grads.pop(0)
        w, _ = _time(lambda: backward_weight(grads.pop()), repeats)
    return f, i, w


def measure_shape(
    args, spec: ModelSpec, tp: int, micro_batch_size: int, recompute: str, cp: int = 1, repeats: int = 3
) -> tuple:
    """(layer, embedding, loss) (F, I, W) seconds of one context-parallel rank for one shape, scaled
    to it where measured smaller."""
    import copy

    seq = spec.seq_length
    layer_flops = spec.layer_linear_flops(micro_batch_size * seq) / (tp * cp)
    scale_tokens = max(1.0, layer_flops / FLOPS_BUDGET)
    batch, run_seq = micro_batch_size, seq
    while scale_tokens > 1 and batch > 1:
        batch //= 2
        scale_tokens /= 2
    while scale_tokens > 1 and run_seq >= 256 and (run_seq // 2) % (2 * tp * cp) == 0:
        run_seq //= 2
        scale_tokens /= 2
    local = copy.copy(args)
    local.recompute_granularity = None if recompute == "none" else recompute
    local.recompute_method = "uniform" if recompute == "full" else None
    local.recompute_num_layers = 1 if recompute == "full" else None
    width = 1
    while (
        spec.layer_params(tp) / width**2 * spec.bytes_per_value > PARAM_BUDGET
        and local.num_query_groups % (2 * width * tp) == 0
    ):
        width *= 2
    if width > 1:
        local.hidden_size //= width
        local.num_attention_heads //= width
        local.num_query_groups //= width
        local.ffn_hidden_size //= width
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = [
            _stage_seconds(local, spec.vocab_size, tp, cp, stage, batch, run_seq, repeats)
            for stage in range(3)
        ]
    finally:
        torch.set_num_threads(threads)
    small = spec.with_(hidden_size=local.hidden_size, num_attention_heads=local.num_attention_heads,
                       num_query_groups=local.num_query_groups, ffn_hidden_size=local.ffn_hidden_size,
                       seq_length=run_seq)  # fmt: skip
    full_tokens, run_tokens = micro_batch_size * seq, batch * run_seq
    layer_ratio = (spec.layer_linear_flops(full_tokens) + spec.attention_core_flops(full_tokens)) / (
        small.layer_linear_flops(run_tokens) + small.attention_core_flops(run_tokens)
    )
    token_ratio = full_tokens / run_tokens
    ratios = (
        token_ratio * width,
        layer_ratio,
        spec.logits_flops(full_tokens) / small.logits_flops(run_tokens),
    )
    embedding, layer, loss = ([t * r for t in times] for times, r in zip(measured, ratios))
    return tuple(layer), tuple(embedding), tuple(loss)


class LocalProfile(LayerProfile):
    """Per-layer costs measured here, shape by shape as the search asks (module docstring)."""

    def __init__(self, spec: ModelSpec, args) -> None:
        super().__init__(layer=(0.0, 0.0, 0.0), source="--profile-local")
        self.spec, self.args = spec, args
        self.reference: float | None = None
        """Seconds of :func:`reference_seconds` around the first shape measured."""

    def for_shape(self, tp: int, micro_batch_size: int, recompute: str, cp: int = 1) -> tuple:
        """A shape's costs on one context-parallel rank, measured when first asked, brought to the load
        of the first shape: the same fixed work timed before and after each shape gives the factor
        (load from elsewhere on a shared machine drifts over the seconds a search measures)."""
        key = (tp, micro_batch_size, recompute, cp)
        if key not in self.by_shape:
            before = reference_seconds()
            measured = measure_shape(self.args, self.spec, tp, micro_batch_size, recompute, cp)
            now = (before + reference_seconds()) / 2
            self.reference = self.reference or now
            factor = self.reference / now
            self.by_shape[key] = tuple(tuple(factor * t for t in part) for part in measured)
        return self.by_shape[key]


def reference_seconds(repeats: int = 3) -> float:
    """Median seconds of a fixed stretch of one-thread compute (tens of milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 512), torch.randn(512, 512)

        def stretch() -> None:
            for _ in range(20):
                torch.nn.functional.gelu(a @ b)

        stretch()
        seconds, _ = _time(stretch, repeats)
    finally:
        torch.set_num_threads(threads)
    return seconds


# --------------------------------------------------------------------------------------------------
# This machine as a cluster
# --------------------------------------------------------------------------------------------------


def _matmul_tflops() -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(1024, 1024)
        a @ a
        seconds, _ = _time(lambda: a @ a, 5)
    finally:
        torch.set_num_threads(threads)
    return 2 * 1024**3 / seconds / 1e12


def local_cluster(num_ranks: int, precision: str = "bf16") -> Cluster:
    """This machine with ``num_ranks`` ranks on its cores (one thread each, as under torchrun): its
    collectives, messages, core sharing, engine and optimizer step (for parameters in ``precision``)
    measured by :func:`planner.calibrate.measure_host`."""
    cores = os.cpu_count() or 1
    found = measure_host(num_ranks, cores, dtype=DTYPES[precision])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    gpu = Gpu(
        name=f"CPU rank ({cores} cores shared)",
        peak_tflops=_matmul_tflops(),
        memory_gb=memory / num_ranks,
        hbm_tb_s=0.01,
        intra_node_gb_s=found.bandwidth / 1e9,
        inter_node_gb_s=found.bandwidth / 1e9,
        compute_efficiency=1.0,
        intra_node_latency_us=found.latency * 1e6,
        inter_node_latency_us=found.latency * 1e6,
    )
    return Cluster(num_ranks, num_ranks, gpu, cores=cores, host=found.host)

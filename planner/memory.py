"""Memory of one rank of a candidate: parameters, gradients, optimizer state, activations, buffers.

Static memory follows the data-parallel wrapper and the optimizer (``core/distributed``,
``core/optimizer``): parameters in their dtype (FP8 layers' weights also as an FP8 copy and its
transpose for the step; with ``--fp8-param-gather`` held in FP8, plus the transpose); one flat gradient buffer per model chunk (fp32 for
bf16 and fp32 models, fp16 for fp16), padded per bucket under the distributed optimizer; Adam's two
fp32 moments and, for 16-bit models, an fp32 main copy (with ``--megatron-fsdp-main-params-dtype auto``,
no copy and the moments in the model's dtype), all sharded over data parallelism (times context
parallelism) with the distributed optimizer.

Activations are walked along the rank's real compute table (``schedule_tables.build_table``): every
forward adds its stage's saved bytes (:mod:`planner.activations`), every backward (or W) takes
them off, and the peak is the largest total plus the transient of the action running at that moment.
So 1F1B's ``pp - rank`` in-flight microbatches, GPipe's all of them, an interleaved schedule's
warm-up and the deferred W of zero-bubble schedules all come out of the table itself.

Under ZeRO-2 and ZeRO-3 (``sharding``: Megatron-FSDP's ``optim_grads`` and ``optim_grads_params`` with
the scope of ``--data-parallel-sharding-scope``, :mod:`core.distributed.sharded_bucket`) a rank keeps
1/DP of the gradients (and under ZeRO-3 of the parameters) between steps, in buckets that follow the
layers (each padded to lcm(dp, 128)); during the schedule it holds the full buckets in use on top
(``RankMemory.gathered``): at step scope its chunks' whole gradients (and ZeRO-3's whole parameters,
still there at the optimizer step), at microbatch scope only the units in flight: the running chunk's
own weights (embedding, final norm, output layer) and two layers' parameters (the running one and the
prefetched next), three layers' gradients (the one in backward and two reductions in flight).

Under HSDP (``Candidate.instances`` N > 1, ``core.distributed.grad_buffer``) buckets are sharded over one
instance's DP x CP / N ranks, so a rank holds N times the shards above, the optimizer state included,
except that the outer ``optim`` splits the state over the N instances again (1/(DP x CP), as without
instances); buckets pad to lcm(the ranks the state is split over, 128).

The optimizer step has a peak of its own: static memory plus the gradient norm's temporaries (AdamW's
fused kernel allocates none): on a CPU a few bytes per 128-element block, on a GPU a number per tensor.

So does the end of backward under ``--megatron-fsdp-grad-comm-dtype`` (a dtype other than the gradients'):
each bucket's reduction sends a cast copy, and once the last backward has freed its activations every
bucket's copy is alive at once (ZeRO-2/3 at microbatch scope: only the reductions in flight, counted in
``gathered``), beside the word embedding's gradient whose accumulation launched the last reduction
(:attr:`RankMemory.reduction_peak`). The bytes the reductions move are counted in the dtype they travel in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from core.pipeline_parallel.schedule_tables import B, F, I, W, build_table
from planner.activations import Shape, StageActivations, stage_activations
from planner.candidate import ZERO_SHARDING, Candidate
from planner.model_spec import ModelSpec

__all__ = [
    "SHARDED_STRATEGIES",
    "RankMemory",
    "candidate_memory",
    "gathered_param_bytes",
    "memory_microbatches",
    "rank_memory",
    "rank_static",
    "reduced_buckets",
    "reduced_grad_bytes",
    "sharded_buckets",
    "stepped_tensors",
]

SHARD_ALIGNMENT = (
    128  # core.distributed.grad_buffer: buckets pad to lcm(dp, 128) under the distributed optimizer
)
DEFAULT_BUCKET = 40_000_000  # elements; max(this, 1e6 * dp) with overlap_grad_reduce on pipeline rank 0
SHARDED_STRATEGIES = ZERO_SHARDING
"""The strategies ``sharding=(strategy, scope)`` models: ZeRO-2 and ZeRO-3 (a candidate's own
``dp_sharding`` and scope unless ``sharding`` is given; ZeRO-1 is ``dp_sharding="optim"``)."""
UNITS_IN_FLIGHT = (2, 3)
"""At microbatch scope, the layers whose (parameters, gradients) a rank holds whole at once besides its
chunk's own weights: the running layer and the prefetched next one; the layer in backward and the two
reductions in flight (``core.distributed.sharded_bucket.MAX_IN_FLIGHT``)."""


def units_in_flight(layer: int, unit_size: int | None) -> tuple[int, int]:
    """:data:`UNITS_IN_FLIGHT` for layers of ``layer`` elements, or under ``--suggested-communication-unit-size``
    ``unit_size``: the running layer and the next ones whose gathers fit in half of it; the layer in
    backward and the reductions whose full buckets fit in it (at least one)."""
    if unit_size is None or layer == 0:
        return UNITS_IN_FLIGHT
    return 1 + unit_size // 2 // layer, 1 + max(1, unit_size // layer)


@dataclass
class RankMemory:
    """Bytes one rank holds: the breakdown and the peaks (the report's columns)."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    """Saved activations alive at the schedule's peak."""
    transient: float
    """What the action running at the peak adds on top (logits, gradients, recomputation)."""
    buffers: float
    """The step's microbatches (token ids, labels, masks, positions) and RoPE's cached tables."""
    optimizer_transient: float
    peak_in_flight: int = 0
    """Microbatch-chunks forwarded and not yet through their backward at the peak."""
    activation_terms: dict[str, float] = field(default_factory=dict)
    gathered: float = 0.0
    """ZeRO-2/3: the full parameter and gradient buckets held during the schedule on top of the shards
    (``params`` and ``grads`` are what stays between steps)."""
    gathered_at_step: float = 0.0
    """ZeRO-3 at step scope: the whole parameters, still gathered while the optimizer steps."""
    reduction_copies: float = 0.0
    """``--megatron-fsdp-grad-comm-dtype``: the cast copies of every gradient bucket, alive at once at the end
    of backward (after the last backward freed its activations, before the reductions land)."""
    last_weight_grad: float = 0.0
    """The word embedding's gradient in the model's dtype on the rank whose backward ends the step (its first
    chunk holds the embedding): still alive when its accumulation launches the last bucket's reduction."""

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def schedule_peak(self) -> float:
        return self.static + self.gathered + self.activations + self.transient + self.buffers

    @property
    def optimizer_peak(self) -> float:
        return self.static + self.gathered_at_step + self.optimizer_transient

    @property
    def reduction_peak(self) -> float:
        """The end of backward: the buckets held and every reduction's cast copy, no activations."""
        return self.static + self.gathered + self.reduction_copies + self.last_weight_grad + self.buffers

    @property
    def peak(self) -> float:
        return max(self.schedule_peak, self.optimizer_peak, self.reduction_peak)

    def as_dict(self) -> dict:
        return asdict(self) | {"peak": self.peak, "schedule_peak": self.schedule_peak}


# --------------------------------------------------------------------------------------------------
# Static memory
# --------------------------------------------------------------------------------------------------


def _layer_tensors(spec: ModelSpec, cand: Candidate) -> list[int]:
    """Sizes of one decoder layer's parameter tensors on one rank."""
    t, h = cand.tp, spec.hidden_size
    norm = [h, h] if spec.normalization == "LayerNorm" else [h]
    qkv = (spec.query_size + 2 * spec.kv_size) // t
    sizes = norm * 2 + [qkv * h, h * spec.query_size // t]
    if spec.add_bias_linear or spec.add_qkv_bias:
        sizes.append(qkv)
    if spec.add_bias_linear:
        sizes.append(h)
    branches = 2 if spec.gated else 1
    if spec.moe is not None:  # whole experts (no expert tensor parallelism), this rank's share of them
        f = spec.moe_ffn
        expert = [branches * f * h, h * f] + ([branches * f, h] if spec.add_bias_linear else [])
        return sizes + expert * (spec.moe.num_experts // cand.ep) + [h * spec.moe.num_experts]
    f = spec.ffn_hidden_size // t
    mlp = [branches * f * h, h * f] + ([branches * f, h] if spec.add_bias_linear else [])
    return sizes + mlp


def _chunk_tensors(
    spec: ModelSpec, cand: Candidate, symbols: tuple[str, ...], embedding_here: bool
) -> list[int]:
    """Parameter tensors' sizes of one chunk (they set bucket padding and the optimizer's temporaries)."""
    t, h = cand.tp, spec.hidden_size
    sizes: list[int] = []
    if "E" in symbols:
        sizes.append(spec.padded_vocab(t) // t * h)
        if spec.position_embedding_type == "learned_absolute":
            sizes.append(spec.max_position_embeddings * h)
    sizes += _layer_tensors(spec, cand) * symbols.count("t")
    if "L" in symbols:
        sizes += [h, h] if spec.normalization == "LayerNorm" else [h]
        if spec.untie_embeddings:
            sizes.append(spec.output_params(t))
        elif not embedding_here:  # a tied copy: stepped, but left out of the gradient norm
            sizes.append(-spec.output_params(t))
    return sizes


def _expert_elements(spec: ModelSpec, cand: Candidate, chunks: list[tuple[str, ...]]) -> int:
    """Elements of this rank's experts (their own buffers, sharded over expert data parallelism)."""
    if spec.moe is None:
        return 0
    per_expert = spec.mlp_params(1, spec.moe_ffn)
    layers = sum(c.count("t") for c in chunks)
    return layers * spec.moe.num_experts // cand.ep * per_expert


NORM_BLOCK = 128  # core.optimizer.clip_grads: a CPU norm sums blocks of this many elements in fp32
NORM_JOINED = 1 << 15  # and joins the whole blocks of tensors smaller than this into one copy


def _optimizer_transient(tensors: list[float], device: str) -> float:
    """The optimizer step's largest temporary: the gradient norm's. AdamW runs torch's fused kernel
    (``core.optimizer``: CUDA, and CPUs from torch 2.4), which allocates none.

    On a CPU the norm (``clip_grads._sum_of_squares_in_blocks``) copies the whole blocks of tensors under
    2^15 elements into one fp32 tensor (4 bytes an element of those) and keeps a block's fp32 norm per 128
    elements, joined, in float64 and squared: 4 + 4 + 8 + 8 bytes a block. On a GPU
    ``torch._foreach_norm`` in float64 gives one number per tensor (16 bytes with its square).
    """
    counted = [n for n in tensors if n > 0]  # negative: a tied copy, which the norm skips
    if device != "cpu":
        return 16.0 * len(counted)
    small = sum(n for n in counted if n < NORM_JOINED)
    return 4 * small + 24 * sum(counted) / NORM_BLOCK


def _padded(elements: int, cand: Candidate, pp_rank: int) -> float:
    """A chunk's gradient buffer: buckets padded to lcm(dp, 128) under the distributed optimizer (under HSDP
    lcm(the ranks the optimizer state is split over, 128); the bucket size follows the whole DP x CP)."""
    if not cand.distributed_optimizer:
        return elements
    shards = cand.dp * cand.cp
    pad = math.lcm(cand.state_shards, SHARD_ALIGNMENT)
    bucket = max(DEFAULT_BUCKET, 1_000_000 * shards) if pp_rank == 0 else elements or 1
    buckets = max(1, math.ceil(elements / bucket))
    return math.ceil(elements / pad) * pad + (buckets - 1) * pad / 2


class _Static(NamedTuple):
    params: float
    grads: float
    state: float
    transient: float
    gathered: float
    """Bytes of the distributed optimizer's parameter all-gather (the parameter buffers); ZeRO-2/3: of
    the whole buckets, once."""
    stepped_tensors: float
    """Tensors (or tensor shards) the rank's optimizer steps."""
    held: float = 0.0
    """ZeRO-2/3: full buckets held during the schedule (``RankMemory.gathered``)."""
    held_at_step: float = 0.0
    """ZeRO-3 at step scope: full parameters held while the optimizer steps."""
    reduced: float = 0.0
    """Bytes of the gradient reduction, once (the whole buffers, not the shards ZeRO-2/3 keep), as sent."""
    reduction_copies: float = 0.0
    """``--megatron-fsdp-grad-comm-dtype``: the cast copies of all the rank's gradient buckets, alive at once
    from their reductions' launch until they land after backward (but at ZeRO-2/3's microbatch scope, where
    the copies of the reductions in flight are in ``held``)."""
    padded: float = 0.0
    """Elements of the rank's gradient buffers (padded per bucket under the distributed optimizer)."""


_STATIC: dict[tuple, _Static] = {}
"""rank_static's answers: the search asks for every rank of every candidate, and the recomputation
and microbatch choices share them."""


def _static(spec: ModelSpec, cand: Candidate, pp_rank: int, device: str, sharding=None) -> _Static:
    """The candidate's static memory; ``sharding`` (ZeRO-2/3) defaults to the candidate's own."""
    return _cached_static(spec, cand, pp_rank, device, _checked(cand, sharding or cand.zero))


def _cached_static(spec: ModelSpec, cand: Candidate, pp_rank: int, device: str, sharding) -> _Static:
    """:func:`_rank_static` once per split, rank and sharding; ZeRO-2/3 start from ZeRO-1's figures."""
    key = (spec, cand.tp, cand.pp, cand.dp, cand.vpp, cand.cp, cand.ep, cand.schedule, cand.layout,
           cand.distributed_optimizer, cand.instances, cand.outer_sharded, pp_rank, device, sharding,
           cand.communication_unit_size)  # fmt: skip
    if key not in _STATIC:
        if len(_STATIC) > 1 << 16:
            _STATIC.clear()
        if sharding is None:
            _STATIC[key] = _rank_static(spec, cand, pp_rank, device)
        else:
            plain = _cached_static(spec, cand, pp_rank, device, None)
            _STATIC[key] = _sharded_rank_static(spec, cand, pp_rank, plain, sharding)
    return _STATIC[key]


def _checked(cand: Candidate, sharding: tuple[str, str] | None) -> tuple[str, str] | None:
    if sharding is None:
        return None
    strategy, scope = sharding
    if strategy not in SHARDED_STRATEGIES or scope not in ("step", "microbatch"):
        raise ValueError(
            f"sharding must be (one of {', '.join(SHARDED_STRATEGIES)}, step or microbatch); got {sharding!r}"
        )
    if not cand.distributed_optimizer:
        raise ValueError(f"sharding {strategy} builds on the distributed optimizer: the candidate has none")
    return sharding


def rank_static(
    spec: ModelSpec,
    cand: Candidate,
    pp_rank: int,
    device: str = "cuda",
    *,
    sharding: tuple[str, str] | None = None,
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer state, optimizer-step transient) of a pipeline rank, in bytes: what it
    holds between steps (``sharding``: ZeRO-2/3, ``(strategy, scope)``; see the module docstring)."""
    return _static(spec, cand, pp_rank, device, sharding)[:4]


def gathered_param_bytes(spec: ModelSpec, cand: Candidate, pp_rank: int) -> float:
    """Bytes a rank's parameter all-gather moves in (the distributed optimizer's): its parameter
    buffers, FP8 layers' weights at one byte an element under ``--fp8-param-gather``."""
    return _static(spec, cand, pp_rank, "cuda").gathered


def reduced_grad_bytes(spec: ModelSpec, cand: Candidate, pp_rank: int) -> float:
    """Bytes a rank's gradient reduction moves in a step (all-reduce, or reduce-scatter with the
    distributed optimizer): its whole gradient buffers, also under ZeRO-2/3, which keep only a shard."""
    return _static(spec, cand, pp_rank, "cuda").reduced


def sharded_buckets(spec: ModelSpec, cand: Candidate, pp_rank: int) -> list[tuple[int, int]]:
    """ZeRO-2/3's buckets of each of a rank's chunks: ``(elements, buckets)``, each bucket padded to
    lcm(dp x cp, 128) elements (a decoder layer's, and the chunk's own weights' ahead of and after them)."""
    chunks = [cand.symbols(pp_rank, v) for v in range(cand.vpp)]
    embedding_here = any("E" in c for c in chunks)
    out = []
    for symbols in chunks:
        own, layer, layers = _sharded_units(spec, cand, symbols, embedding_here)
        own_buckets = int("E" in symbols) + int("L" in symbols)
        out.append((own + layer * layers, own_buckets + layers))
    return out


def kept_after_forward(spec: ModelSpec, cand: Candidate, pp_rank: int) -> list[tuple[int, int]]:
    """ZeRO-3 at microbatch scope: the ``(elements, buckets)`` of each of a rank's chunks that stay gathered
    from a forward into its backward, so that the backward does not gather them again. Without a pipeline,
    the chunk's own weights and its last layer (``core.distributed.sharding_units``); else none."""
    chunks = [cand.symbols(pp_rank, v) for v in range(cand.vpp)]
    if cand.pp > 1:
        return [(0, 0)] * len(chunks)
    embedding_here = any("E" in c for c in chunks)
    out = []
    for symbols in chunks:
        own, layer, layers = _sharded_units(spec, cand, symbols, embedding_here)
        own_buckets = int("E" in symbols) + int("L" in symbols)
        out.append((own + layer * min(1, layers), own_buckets + min(1, layers)))
    return out


def reduced_buckets(spec: ModelSpec, cand: Candidate, pp_rank: int) -> int:
    """The buckets a rank's gradient reduction runs in: ZeRO-2/3's (:func:`sharded_buckets`), else one."""
    return sum(n for _, n in sharded_buckets(spec, cand, pp_rank)) if cand.zero else 1


def stepped_tensors(spec: ModelSpec, cand: Candidate, pp_rank: int) -> float:
    """Tensors (shards, with the distributed optimizer) a rank's optimizer steps."""
    return _static(spec, cand, pp_rank, "cuda").stepped_tensors


def _fp8_weight_bytes(spec: ModelSpec, cand: Candidate, layers: int) -> tuple[float, float]:
    """What FP8 changes in a rank's (parameter bytes, parameter all-gather bytes): an FP8 copy of each
    FP8 weight and its transposed copy, kept for the step (two bytes an element, not gathered); with
    ``--fp8-param-gather`` the weights are held in FP8, one byte an element instead of the model
    dtype's (``core/tensor_parallel/fp8_params.py``), which is what the all-gather moves, and the layer
    still keeps the transposed copy for the step (one byte)."""
    elements = spec.fp8_weight_elements(cand.tp, cand.ep) * layers
    if spec.fp8_param_gather:
        held = -elements * (spec.bytes_per_value - 1)
        return held + elements, held
    return 2 * elements, 0.0


def _sharded_units(
    spec: ModelSpec, cand: Candidate, symbols: tuple[str, ...], embedding_here: bool
) -> tuple[int, int, int]:
    """A chunk's buckets under ZeRO-2/3, each padded to lcm(dp x cp, 128) elements (under HSDP to
    lcm(:attr:`Candidate.state_shards`, 128)): (its own weights', in two buckets, the layers' own ahead of
    and after them; one layer's; the number of layers)."""
    return _units(spec, cand.tp, cand.ep, cand.state_shards, symbols, embedding_here)


@lru_cache(maxsize=4096)
def _units(spec: ModelSpec, tp: int, ep: int, shards: int, symbols: tuple[str, ...], embedding_here: bool):
    """:func:`_sharded_units` once per TP, EP, shard count and chunk kind (the search asks per rank)."""
    cand = Candidate(tp=tp, pp=1, dp=shards, ep=ep)  # the tensors' sizes depend on TP and EP only
    pad = math.lcm(shards, SHARD_ALIGNMENT)
    head = sum(_chunk_tensors(spec, cand, tuple(s for s in symbols if s == "E"), embedding_here))
    tail = sum(
        abs(n) for n in _chunk_tensors(spec, cand, tuple(s for s in symbols if s == "L"), embedding_here)
    )
    layer = sum(_layer_tensors(spec, cand))
    return _pad_to(head, pad) + _pad_to(tail, pad), _pad_to(layer, pad), symbols.count("t")


def _pad_to(elements: int, pad: int) -> int:
    return -(-elements // pad) * pad


def _sharded_static(spec: ModelSpec, cand: Candidate, chunks, sharding) -> tuple[float, float, float, float]:
    """ZeRO-2/3's (params, grads) between steps and the full buckets held during the schedule and at the
    optimizer step (see the module docstring), in bytes."""
    strategy, scope = sharding
    zero3 = strategy == "optim_grads_params"
    B, G = spec.bytes_per_value, spec.grad_bytes_per_value
    embedding_here = any("E" in c for c in chunks)
    units = [_sharded_units(spec, cand, c, embedding_here) for c in chunks]
    full = sum(own + layer * n for own, layer, n in units)
    shards = cand.shard_ranks  # under HSDP one instance's ranks: the instances hold replicas
    params, grads = full * B / (shards if zero3 else 1), full * G / shards
    if scope == "step":
        return params, grads, full * (G + (B if zero3 else 0)), full * B if zero3 else 0.0
    in_flight_params = in_flight_grads = 0
    for own, layer, n in units:
        gathers, reductions = units_in_flight(layer, cand.communication_unit_size)
        in_flight_params = max(in_flight_params, own + layer * min(n, gathers))
        in_flight_grads = max(in_flight_grads, own + layer * min(n, reductions))
    held = in_flight_grads * (G + spec.grad_comm_copy_bytes)  # and each reduction's cast copy, if any
    return params, grads, held + (in_flight_params * B if zero3 else 0), 0.0


def _rank_static(spec: ModelSpec, cand: Candidate, pp_rank: int, device: str) -> _Static:
    chunks = [cand.symbols(pp_rank, v) for v in range(cand.vpp)]
    embedding_here = any("E" in c for c in chunks)
    tensors = [_chunk_tensors(spec, cand, c, embedding_here) for c in chunks]
    elements = [sum(abs(n) for n in t) for t in tensors]
    total = sum(elements)
    padded = sum(_padded(e, cand, pp_rank) for e in elements)
    B = spec.bytes_per_value
    grad_bytes = spec.grad_bytes_per_value
    per_element_state = optimizer_bytes_per_element(spec)
    stepped = [n for chunk in tensors for n in chunk]
    count = len(stepped)
    steps = 4 * count  # Adam's step count, an fp32 scalar per stepped tensor
    if cand.distributed_optimizer:
        shards = cand.state_shards  # DP x CP, or under HSDP an instance's (times N with the outer optim)
        experts = _expert_elements(spec, cand, chunks)  # sharded over expert data parallelism instead
        expert_shards = cand.tp * cand.cp * cand.dp // cand.ep * shards // (cand.dp * cand.cp)
        params, grads = padded * B, padded * grad_bytes
        state = per_element_state * ((total - experts) / shards + experts / expert_shards) + steps / shards
        stepped = [n / shards for n in stepped]  # roughly: each rank steps 1/shards of every bucket
        count = math.ceil(count / shards)
    else:
        params, grads, state = total * B, total * grad_bytes, per_element_state * total + steps
    fp8_layers = sum(spec.fp8_layers(cand.layers_of(cand.stage_of(pp_rank, v))) for v in range(cand.vpp))
    fp8, fp8_gathered = _fp8_weight_bytes(spec, cand, fp8_layers)
    gathered = params + fp8_gathered
    params += fp8
    if spec.position_embedding_type == "rope":  # each chunk's RoPE frequencies (fp32, a buffer)
        params += cand.vpp * 2 * int(spec.kv_channels * spec.rotary_percent)
    transient = _optimizer_transient(stepped, device)
    main_bytes = B if spec.main_params_in_model_dtype else 4
    if grad_bytes != main_bytes:  # the optimizer steps on copies of the gradients in its dtype, all alive
        transient += main_bytes * sum(abs(n) for n in stepped)
    buffered = padded if cand.distributed_optimizer else total
    return _Static(params, grads, state, transient, gathered, count, padded=padded,
                   reduced=buffered * spec.grad_comm_bytes_per_value,
                   reduction_copies=buffered * spec.grad_comm_copy_bytes)  # fmt: skip


def optimizer_bytes_per_element(spec: ModelSpec) -> int:
    """Bytes of optimizer state per stepped element: Adam's two moments in the main weights' dtype, and
    for a 16-bit model with fp32 main weights the fp32 main copy (12); 8 for fp32; 4 for a 16-bit model
    stepped in its own dtype (``--megatron-fsdp-main-params-dtype auto``)."""
    if spec.main_params_in_model_dtype or spec.precision == "fp32":
        return 2 * spec.bytes_per_value
    return 12


def _sharded_rank_static(spec: ModelSpec, cand: Candidate, pp_rank: int, plain: _Static, sharding) -> _Static:
    """ZeRO-2/3's static memory from ZeRO-1's (``plain``): the shards and the buckets held in use."""
    chunks = [cand.symbols(pp_rank, v) for v in range(cand.vpp)]
    zero_params, zero_grads, held, held_at_step = _sharded_static(spec, cand, chunks, sharding)
    full = sum(elements for elements, _ in sharded_buckets(spec, cand, pp_rank))
    B, sent, copy = spec.bytes_per_value, spec.grad_comm_bytes_per_value, spec.grad_comm_copy_bytes
    params = plain.params + zero_params - plain.padded * B  # FP8 copies and RoPE tables as before
    gathered = plain.gathered + (full - plain.padded) * B
    copies = full * copy if sharding[1] == "step" else 0.0  # microbatch scope: in held
    return plain._replace(params=params, grads=zero_grads, gathered=gathered, held=held,
                          held_at_step=held_at_step, reduced=full * sent, reduction_copies=copies)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Activations along the schedule
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _states(schedule: str, pp: int, vpp: int, m: int, rank: int) -> tuple:
    """The moments of a rank's table where a peak can occur: ``(rows, group of each row, groups)``.

    A row is ``(saved microbatches per chunk, I-done microbatches per chunk)`` at one distinct moment
    while a (chunk, kind) action runs; ``groups`` lists those (chunk, kind) in table order. Memory at
    such a moment is linear in the chunks' byte counts, so a candidate's peak is one matrix-vector
    product per rank instead of a walk over every action.
    """
    saved, kept = [0] * vpp, [0] * vpp
    moments: dict[tuple, set] = {}
    for action in build_table(schedule, pp, vpp, m, rank):
        c = action.chunk
        if action.kind == F:
            saved[c] += 1
        elif action.kind == I:
            kept[c] += 1
        moments.setdefault((c, action.kind), set()).add(tuple(saved) + tuple(kept))
        if action.kind == B:
            saved[c] -= 1
        elif action.kind == W:
            saved[c] -= 1
            kept[c] -= 1
    rows = [_undominated(sorted(moment)) for moment in moments.values()]
    group = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    return np.array([row for r in rows for row in r], dtype=np.float64), group, tuple(moments)


def _undominated(rows: list[tuple]) -> list[tuple]:
    """The rows that no other row covers in every count: byte counts are never negative, so only these
    can hold the peak (a covering row holds as much; zero-bubble tables have many covered moments)."""
    table = np.array(rows, dtype=np.int32)
    covers = (table[:, None, :] >= table[None, :, :]).all(axis=2)  # [i, j]: row i covers row j
    np.fill_diagonal(covers, False)  # the rows are distinct: covering is strict
    return [row for row, covered in zip(rows, covers.any(axis=0)) if not covered]


def memory_microbatches(cand: Candidate) -> int:
    """A microbatch count with the same peaks as the candidate's, at most ``4 pp`` plus the remainder.

    Past the warm-up every schedule here repeats a steady state whose in-flight counts do not grow
    with more microbatches (GPipe's do, so it keeps its count); the remainder modulo ``pp`` is kept
    so the interleaved schedules' last group is the same.
    """
    m, pp = cand.num_microbatches, cand.pp
    if cand.rule.holds_every_microbatch or m <= 4 * pp:
        return m
    return 4 * pp + (m - 4 * pp) % pp


def _transient(chunk: StageActivations, kind) -> float:
    if kind == F:
        return chunk.forward_transient
    if kind == B:
        return chunk.backward_transient
    if kind == I:  # a stage whose input needs no gradient does its whole backward in W
        return chunk.backward_transient if chunk.kept_grads else 0.0
    return chunk.backward_transient / 2 if chunk.kept_grads else chunk.backward_transient


@lru_cache(maxsize=1024)
def _all_states(schedule: str, pp: int, vpp: int, m: int) -> tuple:
    """Every rank's :func:`_states` stacked: ``(rows, group of each row, (rank, chunk, kind) of each
    group, first row of each rank, rank of each row)``, so a candidate's ranks are walked at once."""
    per_rank = [_states(schedule, pp, vpp, m, rank) for rank in range(pp)]
    rows = np.concatenate([r[0] for r in per_rank])
    offsets = np.cumsum([0] + [len(r[2]) for r in per_rank[:-1]])
    group = np.concatenate([r[1] + offset for r, offset in zip(per_rank, offsets)])
    groups = tuple((rank, chunk, kind) for rank, r in enumerate(per_rank) for chunk, kind in r[2])
    sizes = [len(r[0]) for r in per_rank]
    starts = np.cumsum([0] + sizes[:-1])
    return rows, group, groups, starts, np.repeat(np.arange(pp), sizes)


def _walk(states: tuple, chunks: list[list[StageActivations]]) -> list[tuple[float, float, int]]:
    """Per rank: (saved bytes at the peak, transient at the peak, in-flight microbatch-chunks there).

    The peak of a rank is the first of its largest moments in table order."""
    rows, group, groups, starts, rank_of_row = states
    weights = np.array([[c.saved for c in ch] + [c.kept_grads for c in ch] for ch in chunks])
    extras = np.array([_transient(chunks[rank][chunk], kind) for rank, chunk, kind in groups])
    held = (rows * weights[rank_of_row]).sum(axis=1)
    total = held + extras[group]
    largest = np.maximum.reduceat(total, starts)[rank_of_row]
    index = np.arange(len(total))
    tops = np.minimum.reduceat(np.where(total == largest, index, len(total)), starts)
    in_flight = rows[tops, : len(chunks[0])].sum(axis=1)
    return [(float(held[t]), float(extras[group[t]]), int(n)) for t, n in zip(tops, in_flight)]


def rank_memory(
    spec: ModelSpec,
    cand: Candidate,
    pp_rank: int,
    *,
    device: str = "cuda",
    sharding: tuple[str, str] | None = None,
) -> RankMemory:
    """Predicted bytes of pipeline rank ``pp_rank`` (every TP/CP/DP rank of it holds the same)."""
    return candidate_memory(spec, cand, device=device, sharding=sharding)[pp_rank]


def candidate_memory(
    spec: ModelSpec, cand: Candidate, *, device: str = "cuda", sharding: tuple[str, str] | None = None
) -> list[RankMemory]:
    """Every pipeline rank's memory; the candidate's peak is the largest of them. ``sharding``: ZeRO-2/3
    as ``(strategy, scope)``, e.g. ``("optim_grads_params", "step")`` (needs the distributed optimizer)."""
    chunks, walks = _activations(spec, cand, device)
    return [
        _rank(spec, cand, rank, device, chunks[rank], *walks[rank], sharding=sharding)
        for rank in range(cand.pp)
    ]


_WALKS: dict[tuple, tuple] = {}
"""_activations' answers: the search weighs every data-parallel sharding of a layout at each recomputation,
and the activations do not depend on it."""


def _activations(spec: ModelSpec, cand: Candidate, device: str) -> tuple[list, list]:
    """Every rank's chunks' activations and the schedule's walk over them (:func:`_walk`)."""
    key = (spec, cand.tp, cand.pp, cand.vpp, cand.cp, cand.ep, cand.schedule, cand.micro_batch_size,
           cand.num_microbatches, cand.recompute, cand.layout, device)  # fmt: skip
    if key in _WALKS:
        return _WALKS[key]
    shape = Shape(
        seq=spec.seq_length // cand.cp,
        batch=cand.micro_batch_size,
        tp=cand.tp,
        sequence_parallel=cand.sequence_parallel,
        recompute=cand.recompute,
        device=device,
        cp=cand.cp,
    )
    chunks = []
    for rank in range(cand.pp):
        stages = [cand.stage_of(rank, v) for v in range(cand.vpp)]
        chunks.append(
            [
                _stage(spec, shape, cand.stages.stages[s], s == 0, spec.fp8_layers(cand.layers_of(s)))
                for s in stages
            ]
        )
    walks = _walk(_all_states(cand.schedule, cand.pp, cand.vpp, memory_microbatches(cand)), chunks)
    if len(_WALKS) > 1 << 12:
        _WALKS.clear()
    _WALKS[key] = chunks, walks
    return chunks, walks


@lru_cache(maxsize=4096)
def _stage(
    spec: ModelSpec, shape: Shape, symbols: tuple[str, ...], first: bool, fp8_layers: int
) -> StageActivations:
    """:func:`stage_activations`, once per stage kind (most stages of a candidate are alike)."""
    return stage_activations(spec, shape, symbols, first=first, fp8_layers=fp8_layers)


def _rank(spec, cand, pp_rank, device, chunks, held, transient, in_flight, *, sharding=None) -> RankMemory:
    static = _static(spec, cand, pp_rank, device, sharding)
    params, grads, state, opt_transient = static[:4]
    reads_data = any(c.terms.get("embedding") or "loss final norm" in c.terms for c in chunks)
    buffers = 28 * spec.seq_length * cand.micro_batch_size * cand.num_microbatches if reads_data else 0
    if spec.position_embedding_type == "rope":  # each chunk's cos/sin table, cached at its first forward
        table = 1 << max(spec.seq_length - 1, 0).bit_length()
        buffers += cand.vpp * 2 * spec.bytes_per_value * table * int(spec.kv_channels * spec.rotary_percent)
    terms: dict[str, float] = {}
    for chunk in chunks:
        for name, value in chunk.terms.items():
            terms[name] = terms.get(name, 0.0) + value
    return RankMemory(
        pp_rank,
        params,
        grads,
        state,
        held,
        transient,
        buffers,
        opt_transient,
        in_flight,
        terms,
        static.held,
        static.held_at_step,
        static.reduction_copies,
        _embedding_grad(spec, cand, chunks),
    )


def _embedding_grad(spec: ModelSpec, cand: Candidate, chunks) -> float:
    """The word embedding's gradient, in the model's dtype, where the rank's first chunk holds it."""
    if not chunks or not chunks[0].terms.get("embedding"):
        return 0.0
    return spec.output_params(cand.tp) * spec.bytes_per_value

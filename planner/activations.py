"""Bytes a microbatch leaves behind for its backward, term by term, as Trident's layers save them.

The terms follow the code, not a paper: each is a tensor that autograd keeps (or that the schedule
keeps) from a stage's forward until its backward, named after the operation that saves it. So the
model is checked term by term against the dry run, and a change to a layer shows up as a named
difference. Sizes are per microbatch on one rank: ``s`` the rank's sequence (``seq / cp``), ``b`` the
micro-batch size, ``t`` the tensor-parallel size, sequence-sharded tensors ``s / t`` long under
sequence parallelism; ``B`` bytes per value in the model's dtype.

What saves what in a decoder layer (``core/transformer``):

* each norm computes in fp32: a LayerNorm keeps its fp32 input copy and per-token statistics, an
  RMSNorm its fp32 input copy, the per-token ``rsqrt`` and the normalised values in ``B``;
* each column-parallel linear keeps its input; under sequence parallelism that is the all-gathered,
  whole-sequence tensor;
* attention keeps what the attention kernel saves: with a fused (flash) kernel its query, key and
  value inputs, output and log-sum-exp, where a key or value that is a view of the QKV projection's
  output keeps that whole output alive, and grouped-query heads repeated for more than one group
  per rank are copies; with PyTorch's math kernel (a CPU with attention dropout) fp32 copies of
  query, key and value and three ``s x s`` score tensors; under context parallelism the ring
  (``core/transformer/context_parallel/ring.py``) keeps contiguous copies of this rank's query, key
  and value, its output and log-sum-exp, and the output projection gets a copy;
* the MLP keeps its fc1 output (the gate's input), the activation's output and the fc2 input;
* dropout keeps its mask (one byte on a GPU, ``B`` on a CPU);
* the stage keeps its received input, while its sent output's storage is freed (Megatron's
  ``deallocate_output_tensor``); the loss stage keeps the fp32 softmax of its vocabulary shard.

Recomputation keeps less: ``selective`` the attention kernel's inputs only, ``full`` each layer's input.
The zero-bubble schedules retain the graph between ``I`` and ``W`` and keep the gradients arriving
at every weight's branch (:mod:`core.pipeline_parallel.backward_split`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.tensor_parallel.fp8_blockwise import BLOCK
from core.tensor_parallel.fused_cross_entropy import SLICE_BYTES as FUSED_SLICE_BYTES
from core.tensor_parallel.linear_cross_entropy import SLICE_BYTES as LINEAR_SLICE_BYTES
from planner.model_spec import ModelSpec

__all__ = ["Shape", "StageActivations", "layer_terms", "loss_terms", "stage_activations"]


@dataclass(frozen=True)
class Shape:
    """The per-rank activation shape of a candidate: what the terms are functions of."""

    seq: int
    """Tokens per sample on this rank (the sequence over context parallelism)."""
    batch: int
    tp: int
    sequence_parallel: bool
    recompute: str = "none"
    device: str = "cuda"
    """Whose kernels: "cuda" (fused attention with dropout, bool dropout masks) or "cpu"."""
    cp: int = 1
    """Context-parallel size (``seq`` is already this rank's share)."""

    @property
    def sharded_seq(self) -> int:
        return self.seq // self.tp if self.sequence_parallel else self.seq


@dataclass
class StageActivations:
    """Bytes of one stage (model chunk) per microbatch."""

    saved: float = 0.0
    """Held from the forward until the backward (B), or until W under zero-bubble schedules."""
    kept_grads: float = 0.0
    """Held from I until W: the gradients kept at the weights' branches."""
    forward_transient: float = 0.0
    """Extra bytes alive at the peak of the forward, on top of what it saves."""
    backward_transient: float = 0.0
    """Extra bytes alive at the peak of the backward."""
    terms: dict[str, float] = field(default_factory=dict)
    """``saved`` by name, for the report and the checks."""


def _attention_kernel(spec: ModelSpec, shape: Shape) -> str:
    """ "flash" (fused, saves q/k/v/out/lse) or "math" (PyTorch's unfused kernel, saves s x s scores)."""
    if spec.attention_softmax_in_fp32 and spec.precision != "fp32" and torch.__version__ < "2.5":
        return "explicit"  # only where SDPA's math kernel could reduce in 16 bits
    if shape.device == "cpu" and spec.attention_dropout > 0:
        return "math"
    return "flash"


def _norm(spec: ModelSpec, shape: Shape) -> float:
    """What one norm keeps: its input and per-token statistics (``F.rms_norm`` / ``F.layer_norm``).

    A CPU has no fused RMSNorm: ``F.rms_norm`` runs as fp32 operations that keep the fp32 input and
    the fp32 normalised values. A GPU's fused kernel keeps the input and the fp32 ``rsqrt``.
    """
    tokens = shape.sharded_seq * shape.batch
    h, B = spec.hidden_size, spec.bytes_per_value
    if spec.normalization == "RMSNorm":
        kept = 8 * tokens * h if shape.device == "cpu" else B * tokens * h
        return kept + 4 * tokens
    if spec.zero_centered_gamma:  # formed in fp32: the fp32 input copy and fp32 statistics
        return 4 * tokens * h + 8 * tokens + 8 * h
    return B * tokens * h + (2 * B if shape.device == "cpu" else 8) * tokens


def _attention(spec: ModelSpec, shape: Shape) -> dict[str, float]:
    """The attention core's saved tensors (after the QKV projection, before the output projection)."""
    s, b, t, B = shape.seq, shape.batch, shape.tp, spec.bytes_per_value
    d = spec.kv_channels
    heads, groups = spec.num_attention_heads // t, spec.num_query_groups // t
    per_group = spec.num_attention_heads // spec.num_query_groups
    q_bytes, kv_bytes = B * s * b * heads * d, B * s * b * groups * d
    mixed = B * s * b * (heads + 2 * groups) * d
    kernel = _attention_kernel(spec, shape)
    if kernel == "math":
        fp32 = 3 * 4 * s * b * heads * d
        scores = 3 * 4 * b * heads * s * s
        return {"attention q/k/v fp32 copies": fp32, "attention scores": scores, "proj input": q_bytes}
    if kernel == "explicit":
        scores = b * heads * s * s * (2 + 4 + B + (B if spec.attention_dropout > 0 else 0))
        return {"attention q/k/v": q_bytes + 2 * B * s * b * heads * d, "attention scores": scores,
                "proj input": q_bytes}  # fmt: skip
    lse = 4 * b * heads * s
    if shape.cp > 1:  # ring attention keeps contiguous copies of its q, k, v; RoPE's outputs are not kept
        return {"attention q, k, v (ring's copies)": q_bytes + 2 * kv_bytes, "attention output": q_bytes,
                "proj input (copied)": q_bytes, "attention lse": lse}  # fmt: skip
    rope = spec.position_embedding_type == "rope"
    terms: dict[str, float] = {}
    if rope:  # rotated query and key are new tensors; the value stays a view of the QKV output
        terms["attention q (rotated)"] = q_bytes
        terms["attention k (rotated)"] = kv_bytes
    elif groups > 1 and per_group > 1:  # the query heads of several groups are gathered by a copy,
        terms["attention q"] = q_bytes  # after which the kernel's output is laid out [b, h, s, d]
        terms["proj input (copied)"] = q_bytes
    terms["qkv output (viewed)"] = mixed
    terms["attention output"] = q_bytes  # the output projection's input is a view of it
    terms["attention lse"] = lse
    return terms


def _dropout_mask(spec: ModelSpec, shape: Shape) -> float:
    per_value = 1 if shape.device == "cuda" else spec.bytes_per_value
    return per_value * shape.sharded_seq * shape.batch * spec.hidden_size


def layer_terms(spec: ModelSpec, shape: Shape) -> dict[str, float]:
    """Bytes one decoder layer saves per microbatch, by name (recomputation applied)."""
    s, b, t, B, h = shape.seq, shape.batch, shape.tp, spec.bytes_per_value, spec.hidden_size
    if shape.recompute == "full":
        return {"layer input (full recompute)": B * shape.sharded_seq * b * h}
    L = B  # what a linear layer keeps of its input, per value: FP8 (blockwise: a float32 scale per 128)
    if spec.fp8 and spec.fp8_wgrad:
        L = 1 + 4 / BLOCK if spec.fp8_blockwise else 1
    terms = {"norms": 2 * _norm(spec, shape), "qkv input": L * s * b * h}
    attention = _attention(spec, shape)
    if spec.fp8:  # the output projection keeps its own FP8 copy, or instead of a bf16 one
        kept = next((k for k in ("proj input", "proj input (copied)") if k in attention), None)
        query = s * b * spec.num_attention_heads // t * spec.kv_channels
        if kept is not None:
            attention[kept] = L * query
        else:
            attention["proj input (FP8)"] = L * query
    if shape.recompute == "selective":  # the checkpoint keeps the kernel's inputs, not what it saves
        attention.pop("attention lse", None)
        attention.pop("attention scores", None)
        if "attention q/k/v fp32 copies" in attention:
            heads = spec.num_attention_heads // t
            attention.pop("attention q/k/v fp32 copies")
            attention["attention q, k, v"] = 3 * B * s * b * heads * spec.kv_channels
    terms.update(attention)
    if spec.moe is not None:
        terms.update(_moe_terms(spec, shape))
    else:
        f = spec.ffn_hidden_size // t
        terms["fc1 input"] = L * s * b * h
        terms["fc1 output"] = B * s * b * f * (2 if spec.gated else 1)
        # SwiGLU's own autograd function keeps only fc1's output; other activations keep theirs too
        terms["fc2 input"] = s * b * f * (L + (B if spec.gated and not spec.swiglu else 0))
    if spec.hidden_dropout > 0:
        terms["dropout masks"] = 2 * _dropout_mask(spec, shape)
    return terms


def _moe_terms(spec: ModelSpec, shape: Shape) -> dict[str, float]:
    """An MoE layer's MLP (``core/transformer/moe``), tokens routed evenly: each tensor-parallel rank
    routes its sequence shard, each token to ``topk`` experts, and the all-to-all brings a rank as
    many (token, expert) pairs as it sends. Experts are whole on each rank (no expert tensor
    parallelism). The router works in fp32: it keeps an fp32 copy of its input and weight, the top-k
    softmax and indices (and the full softmax for the balancing loss); the dispatch keeps the pairs'
    token indices; the experts their input, fc1 output and fc2 input; the combine the experts' output
    come back, the probabilities in the model's dtype and their product."""
    moe, B, h, f = spec.moe, spec.bytes_per_value, spec.hidden_size, spec.moe_ffn
    tokens = shape.sharded_seq * shape.batch
    pairs = tokens * moe.router_topk
    router = 4 * tokens * h + 4 * moe.num_experts * h + (4 + 8) * pairs
    if moe.aux_loss:
        router += 4 * tokens * moe.num_experts + 8 * pairs
    return {
        "router (fp32 input, weight, top-k)": router,
        "dispatched pairs' token indices": 8 * pairs,
        "experts' input": B * pairs * h,
        "experts' fc1 output": B * pairs * f * (2 if spec.gated else 1),
        "experts' fc2 input": B * pairs * f * (1 if spec.swiglu else 2 if spec.gated else 1),
        "combine (experts' output, weighted, probabilities)": 2 * B * pairs * h + B * pairs,
    }


def _layer_kept_grads(spec: ModelSpec, shape: Shape) -> float:
    """Gradients ``I`` keeps for ``W`` at one layer: at each linear's output and each norm's scale."""
    s, b, t, B, h = shape.seq, shape.batch, shape.tp, spec.bytes_per_value, spec.hidden_size
    qkv = (spec.query_size + 2 * spec.kv_size) // t
    f = (spec.moe_ffn if spec.moe is not None else spec.ffn_hidden_size) // t
    linear_outputs = qkv + h + (2 if spec.gated else 1) * f + h
    norms = 2 * shape.sharded_seq * h
    return B * (s * b * linear_outputs + norms * (2 if spec.normalization == "LayerNorm" else 1))


def _layer_transients(spec: ModelSpec, shape: Shape) -> tuple[float, float]:
    """Bytes alive at the peak of a layer's forward and backward beyond what stays saved."""
    s, b, t, B, h = shape.seq, shape.batch, shape.tp, spec.bytes_per_value, spec.hidden_size
    f = (spec.moe_ffn if spec.moe is not None else spec.ffn_hidden_size) // t
    branches = 2 if spec.gated else 1
    forward = B * s * b * h + 4 * shape.sharded_seq * b * h  # a row-parallel partial sum; a norm's square
    backward = B * s * b * (branches * f + 2 * f + h)  # gradients around the MLP
    if shape.recompute != "none":  # what recomputation left out comes back for the layer's backward
        kept = sum(layer_terms(spec, shape).values())
        backward += sum(layer_terms(spec, Shape(**{**shape.__dict__, "recompute": "none"})).values()) - kept
    return forward, backward


def loss_terms(spec: ModelSpec, shape: Shape) -> tuple[dict[str, float], float, float]:
    """The loss stage's saved bytes by name, and its forward and backward transients.

    Forward: the 16-bit logits, their fp32 copy and the shifted copy cross-entropy turns into the
    softmax, which it keeps; backward: the softmax becomes the gradient in place and is cast back.
    With ``--cross-entropy-loss-fusion`` (``core/tensor_parallel/fused_cross_entropy.py``) the loss
    keeps the logits themselves and per-token statistics, works through an fp32 slice of tokens at a
    time and writes the gradient over the logits; each transient is gone before the next one comes.
    """
    s, b, t, B, h = shape.seq, shape.batch, shape.tp, spec.bytes_per_value, spec.hidden_size
    vocab = spec.padded_vocab(t) // t
    logits = s * b * vocab
    saved = {"final norm": _norm(spec, shape), "output layer input": B * s * b * h}
    padded = spec.padded_vocab(t) != spec.vocab_size
    copies = (B if B != 4 else 0) * (2 if padded else 1)  # the logits, and their masked copy
    if spec.cross_entropy_linear:
        return _linear_loss_terms(saved, vocab, s * b, B, h, shape.device)
    if spec.cross_entropy_fusion:
        piece = (
            min(FUSED_SLICE_BYTES["cpu" if shape.device == "cpu" else "cuda"] // (4 * vocab), s * b)
            * 4
            * vocab
        )
        saved["cross-entropy logits (kept)"] = B * logits
        saved["cross-entropy statistics and targets"] = 21 * s * b  # max, sum of exp; padding, target
        masked = B * logits if padded else 0  # the padding mask's copy, and its gradient's
        return saved, max(piece, masked), max(piece, masked, B * s * b * h)
    saved["cross-entropy softmax (fp32)"] = 4 * logits
    saved["cross-entropy targets"] = 9 * s * b
    return saved, logits * (copies + 4), logits * copies + B * s * b * h


def _linear_loss_terms(
    saved: dict[str, float], vocab: int, tokens: int, B: int, h: int, device: str
) -> tuple[dict[str, float], float, float]:
    """``--cross-entropy-fusion-impl linear`` (``core/tensor_parallel/linear_cross_entropy.py``): the
    loss keeps the output layer's input and per token a log-sum-exp and its target; each slice's
    logits live only while the slice is worked on, in the model's dtype and in fp32, forward and
    again in backward, where the hidden states' gradient and an fp32 weight gradient are built."""
    piece = min(LINEAR_SLICE_BYTES["cpu" if device == "cpu" else "cuda"] // (4 * vocab), tokens) * vocab
    slice_bytes = piece * (4 + (B if B != 4 else 0))
    saved["cross-entropy log-sum-exp and targets"] = 13 * tokens  # fp32, a flag and an int64 a token
    forward = slice_bytes + 12 * tokens  # the slices, and the per-token maxima and sums
    backward = slice_bytes + B * piece + B * tokens * h + 4 * vocab * h
    return saved, forward, backward


def stage_activations(
    spec: ModelSpec, shape: Shape, symbols: tuple[str, ...], *, first: bool, fp8_layers: int | None = None
) -> StageActivations:
    """One stage's bytes per microbatch: its layers, embedding or loss, and its received input.
    ``fp8_layers``: how many of its layers run in FP8 (None: all of them, when the model does); the
    others (``--first-last-layers-bf16``) save 16-bit inputs."""
    out = StageActivations()
    layers = symbols.count("t")
    if layers:
        fp8 = layers if fp8_layers is None or not spec.fp8 else fp8_layers
        for count, kind in ((fp8, spec), (layers - fp8, spec.without_fp8())):
            for name, value in (layer_terms(kind, shape) if count else {}).items():
                out.terms[f"layer {name}"] = out.terms.get(f"layer {name}", 0) + count * value
        forward, backward = _layer_transients(spec, shape)
        out.forward_transient, out.backward_transient = forward, backward
        if shape.recompute != "full" and not first:  # the first stage's input needs no gradient: no I
            out.kept_grads = layers * _layer_kept_grads(spec, shape)
        if spec.position_embedding_type == "rope" and shape.cp > 1:  # this rank's positions of the
            rotary = int(spec.kv_channels * spec.rotary_percent)  # cached table, picked per microbatch
            out.terms["rotary cos/sin"] = 2 * spec.bytes_per_value * shape.seq * rotary
    if not first:
        out.terms["received input"] = (
            spec.bytes_per_value * shape.sharded_seq * shape.batch * spec.hidden_size
        )
    if "E" in symbols:
        out.terms["embedding"] = 9 * shape.seq * shape.batch * (2 if shape.tp > 1 else 1)
        if spec.hidden_dropout > 0:
            out.terms["embedding dropout mask"] = _dropout_mask(spec, shape)
    if "L" in symbols:
        if not first:  # I keeps the logits' gradient for the output layer's W, and the final norm's
            norm = (2 if spec.normalization == "LayerNorm" else 1) * shape.sharded_seq * spec.hidden_size
            vocab = spec.padded_vocab(shape.tp) // shape.tp
            out.kept_grads += spec.bytes_per_value * shape.batch * (shape.seq * vocab + norm)
        saved, forward, backward = loss_terms(spec, shape)
        out.terms.update({f"loss {k}": v for k, v in saved.items()})
        out.forward_transient = max(out.forward_transient, forward)
        out.backward_transient = max(out.backward_transient, backward)
    out.saved = sum(out.terms.values())
    return out

"""Megatron-LM's theoretical memory formula (``report_theoretical_memory``), restated for comparison.

Megatron estimates the first pipeline stage, which it takes to be the most loaded:

* weights and optimizer: the parameters of ``1/pp`` of the decoder layers plus the word embedding
  (plus the output layer when untied and unpipelined), over TP, at 18 bytes each (16-bit weight,
  fp32 gradient, fp32 main copy and two Adam moments), or ``6 + 12 / dp`` with the distributed
  optimizer;
* activations, from Korthikanti et al. (2022), Table 2: with sequence parallelism and selective
  recomputation ``s b h (18 + 4 ffn / h) / tp`` bytes per layer, otherwise
  ``s b h (10 + 24 / tp)`` (plus 5%), for all ``L`` layers (``pp`` microbatches in flight times
  ``L / pp`` layers), the embedding's input and dropout mask for ``pp`` microbatches, times
  ``1 + (pp - 1) / (pp vpp)`` when interleaved or ``min(1, m / pp)`` when not, and the output layer
  only without pipelining.

It has no notion of the loss stage, the schedule's actual table, transient peaks (logits, gradients,
the optimizer step) or the exact tensors a given implementation keeps; the comparison in
``tools/plan_check_memory.py`` shows where that matters.
"""

from __future__ import annotations

from planner.candidate import Candidate
from planner.model_spec import ModelSpec

__all__ = ["megatron_memory"]


def _parameters_on_first_stage(spec: ModelSpec, cand: Candidate) -> float:
    h, q = spec.hidden_size, spec.query_size
    norm = 2 if spec.normalization == "LayerNorm" else 1
    attention = 2 * h * h * (1 + spec.num_query_groups / spec.num_attention_heads) * q / h
    gate = 1.5 if spec.gated else 1.0
    experts = spec.moe.num_experts if spec.moe is not None else 1
    ffn = spec.moe_ffn if spec.moe is not None else spec.ffn_hidden_size
    layer = 2 * h * (ffn * experts * gate + norm) + attention
    block = spec.num_layers * layer + norm * h
    embedding = h * spec.padded_vocab(cand.tp)
    shard = (block / cand.pp + embedding) / cand.tp
    if spec.untie_embeddings and cand.pp == 1:
        shard += embedding / cand.tp
    return shard


def megatron_memory(spec: ModelSpec, cand: Candidate) -> dict[str, float]:
    """Megatron's (weights and optimizer, activations) bytes for the candidate's first stage."""
    per_param = 6 + 12 / (cand.dp * cand.cp) if cand.distributed_optimizer else 18
    weights = _parameters_on_first_stage(spec, cand) * per_param
    s, b, h, p = spec.seq_length, cand.micro_batch_size, spec.hidden_size, cand.pp
    with_sp = cand.sequence_parallel and cand.recompute == "selective"
    if with_sp:
        activations = s * b * h * (18 + 4 * spec.ffn_hidden_size / h) * spec.num_layers
    else:
        activations = s * b * h * (10 + 24 / cand.tp) * spec.num_layers
    activations += 8 * s * b * p + s * b * h * p  # embedding input and dropout mask, pp in flight
    if cand.vpp > 1:
        activations *= 1 + (p - 1) / (p * cand.vpp)
    elif p > 1:
        activations *= min(1.0, cand.num_microbatches / p)
    if p == 1:
        if with_sp:
            activations += s * b * h * 4 * (1 + spec.padded_vocab(cand.tp) / h)
        else:
            activations += (s * b * spec.padded_vocab(cand.tp) / cand.tp + s * b * h) * 2
    if with_sp:
        activations /= cand.tp
    else:
        activations *= 1.05
    return {"weights_and_optimizer": weights, "activations": activations, "total": weights + activations}

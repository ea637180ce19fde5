"""Seconds per pipeline action and per collective: the inputs of the step-time simulation.

Compute comes from FLOPs at an achievable fraction of the GPU's peak (``Cluster.achievable_flops``),
plus the memory-bound work around the matrix multiplies (norms, activations, softmax), counted as
the bytes a layer saves moved twice through device memory. A measured profile (``--profile-local``,
``--from-timeline``) replaces both with seconds per layer.

Communication uses ring formulas at the group's achieved bandwidth (inside a node or across nodes,
from where its ranks sit in Megatron's ``tp-cp-ep-dp-pp`` order):

* tensor parallelism: per layer two all-gathers and two reduce-scatters of the layer's ``[s, b, h]``
  activations each way under sequence parallelism (two all-reduces without it), on the critical path
  (Trident does not overlap them);
* context parallelism: ring attention passes key/value blocks ``cp - 1`` times each way, overlapped
  with the blocks' attention, so only what exceeds the attention's time shows;
* expert parallelism: two all-to-alls of the routed tokens each way per MoE layer, not overlapped;
* pipeline: one ``[s / cp (/ tp), b, h]`` message per boundary per microbatch;
* data parallelism: the gradient all-reduce (reduce-scatter plus parameter all-gather with the
  distributed optimizer) of each chunk, launched at its last backward (``--overlap-grad-reduce``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.plan.activations import Shape, stage_activations
from training.plan.candidate import Candidate
from training.plan.hardware import Cluster
from training.plan.model_spec import ModelSpec

__all__ = ["ActionCosts", "LayerProfile", "StageCostModel"]


@dataclass(frozen=True)
class ActionCosts:
    """Seconds one microbatch spends in a stage: forward, input gradient, weight gradient."""

    forward: float
    backward_input: float
    backward_weight: float

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight


@dataclass
class LayerProfile:
    """Measured seconds per microbatch, for one shape (``--profile-local``, ``--from-timeline``).

    ``layer``, ``embedding`` and ``loss`` are (forward, input gradient, weight gradient) of one
    decoder layer, the embedding and the loss (final norm, output layer, cross-entropy), at
    ``tokens`` tokens per microbatch and the candidate's tensor-parallel size; ``scale`` multiplies
    them (to reach the planned shape from a smaller measured one).
    """

    layer: tuple[float, float, float]
    embedding: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loss: tuple[float, float, float] = (0.0, 0.0, 0.0)
    source: str = "measured"
    by_shape: dict = field(default_factory=dict)
    """(tp, micro_batch_size, recompute) -> (layer, embedding, loss), when measured per shape."""

    def for_shape(self, tp: int, micro_batch_size: int, recompute: str) -> tuple:
        key = (tp, micro_batch_size, recompute)
        if key in self.by_shape:
            return self.by_shape[key]
        return self.layer, self.embedding, self.loss


def _ring(size: int, nbytes: float, bandwidth: float, *, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather / reduce-scatter (or all-reduce, twice the traffic) of ``nbytes``."""
    if size <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (size - 1) / size * nbytes / bandwidth


class StageCostModel:
    """Per-stage action costs and the step's collectives for one candidate on one cluster."""

    def __init__(
        self, spec: ModelSpec, cand: Candidate, cluster: Cluster, profile: LayerProfile | None = None
    ):
        self.spec, self.cand, self.cluster, self.profile = spec, cand, cluster, profile
        self.tokens = cand.micro_batch_size * spec.seq_length // cand.cp
        self.shape = Shape(
            seq=spec.seq_length // cand.cp,
            batch=cand.micro_batch_size,
            tp=cand.tp,
            sequence_parallel=cand.sequence_parallel,
            recompute=cand.recompute,
            device="cuda",
        )
        tp_stride, cp_stride = 1, cand.tp
        self.dp_stride, self.pp_stride = cand.tp * cand.cp, cand.tp * cand.cp * cand.dp
        self.tp_bw = cluster.bandwidth(tp_stride, cand.tp)
        self.cp_bw = cluster.bandwidth(cp_stride, cand.cp)
        self.ep_bw = cluster.bandwidth(self.dp_stride, cand.ep)
        self.dp_bw = cluster.bandwidth(self.dp_stride, cand.dp * cand.cp)
        self.pp_bw = cluster.bandwidth(self.pp_stride, 2)
        self._layer = self._layer_costs()
        self._embedding = self._embedding_costs()
        self._loss = self._loss_costs()

    # -- compute ---------------------------------------------------------------------------------
    def _flops_seconds(self, flops: float) -> float:
        return flops / (self.cand.tp * self.cluster.achievable_flops)

    def _memory_seconds(self, nbytes: float) -> float:
        return nbytes / (self.cluster.gpu.hbm_tb_s * 1e12)

    def _tp_layer_seconds(self) -> float:
        """One direction's tensor-parallel traffic of a layer (forward, or the input gradient)."""
        c, s = self.cand, self.spec
        activation = s.bytes_per_value * self.tokens * s.hidden_size
        if c.tp == 1:
            return 0.0
        if c.sequence_parallel:
            return 4 * _ring(c.tp, activation, self.tp_bw)
        return 2 * _ring(c.tp, activation, self.tp_bw, all_reduce=True)

    def _cp_layer_seconds(self, attention_seconds: float) -> float:
        """Ring attention's exposed key/value traffic of a layer, one direction."""
        c, s = self.cand, self.spec
        if c.cp == 1:
            return 0.0
        block = 2 * s.bytes_per_value * self.tokens * s.kv_size // c.tp
        return max(0.0, (c.cp - 1) * block / self.cp_bw - attention_seconds)

    def _ep_layer_seconds(self) -> float:
        c, s = self.cand, self.spec
        if s.moe is None or c.ep == 1:
            return 0.0
        routed = (
            s.moe.router_topk
            * s.bytes_per_value
            * self.shape.sharded_seq
            * c.micro_batch_size
            * s.hidden_size
        )
        return 2 * (c.ep - 1) / c.ep * routed / self.ep_bw

    def _layer_costs(self) -> ActionCosts:
        if self.profile is not None:
            layer, _, _ = self.profile.for_shape(
                self.cand.tp, self.cand.micro_batch_size, self.cand.recompute
            )
            return ActionCosts(*layer)
        s, c = self.spec, self.cand
        linear = self._flops_seconds(s.layer_linear_flops(self.tokens))
        core = self._flops_seconds(s.attention_core_flops(self.tokens) / c.cp)
        saved = sum(stage_activations(s, self.shape.__class__(**{**self.shape.__dict__, "recompute": "none"}),
                                      ("t",), first=True).terms.values())  # fmt: skip
        elementwise = self._memory_seconds(2 * saved)
        comm = self._tp_layer_seconds() + self._cp_layer_seconds(core) + self._ep_layer_seconds()
        forward = linear + core + elementwise + comm
        backward_input = linear + 2 * core + elementwise + comm
        backward_weight = linear
        if c.recompute == "full":
            backward_input += forward
        elif c.recompute == "selective":
            backward_input += core
        return ActionCosts(forward, backward_input, backward_weight)

    def _embedding_costs(self) -> ActionCosts:
        if self.profile is not None:
            _, embedding, _ = self.profile.for_shape(
                self.cand.tp, self.cand.micro_batch_size, self.cand.recompute
            )
            return ActionCosts(*embedding)
        s, c = self.spec, self.cand
        lookup = self._memory_seconds(2 * s.bytes_per_value * self.tokens * s.hidden_size)
        comm = _ring(
            c.tp,
            s.bytes_per_value * self.tokens * s.hidden_size,
            self.tp_bw,
            all_reduce=not c.sequence_parallel,
        )
        return ActionCosts(lookup + comm, 0.0, lookup + comm)

    def _loss_costs(self) -> ActionCosts:
        if self.profile is not None:
            _, _, loss = self.profile.for_shape(self.cand.tp, self.cand.micro_batch_size, self.cand.recompute)
            return ActionCosts(*loss)
        s, c = self.spec, self.cand
        logits = self._flops_seconds(s.logits_flops(self.tokens, c.tp))
        vocab_bytes = 4 * self.tokens * s.padded_vocab(c.tp) // c.tp
        softmax = self._memory_seconds(6 * vocab_bytes)  # copy, max, shift, exp, sum, divide
        gather = _ring(c.tp, s.bytes_per_value * self.tokens * s.hidden_size, self.tp_bw)
        return ActionCosts(
            logits + softmax + gather, logits + self._memory_seconds(3 * vocab_bytes) + gather, logits
        )

    def stage(self, symbols: tuple[str, ...]) -> ActionCosts:
        """Seconds of one microbatch in a stage holding ``symbols``."""
        layers = symbols.count("t")
        parts = [
            (layers, self._layer),
            (int("E" in symbols), self._embedding),
            (int("L" in symbols), self._loss),
        ]
        return ActionCosts(
            sum(n * p.forward for n, p in parts),
            sum(n * p.backward_input for n, p in parts),
            sum(n * p.backward_weight for n, p in parts),
        )

    # -- communication between stages and at the step's end ---------------------------------------
    def p2p_seconds(self) -> float:
        """One pipeline message (an activation or its gradient)."""
        s = self.spec
        message = s.bytes_per_value * self.shape.sharded_seq * self.cand.micro_batch_size * s.hidden_size
        return message / self.pp_bw

    def grad_sync_seconds(self, grad_bytes: float, param_bytes: float) -> float:
        """A rank's data-parallel gradient reduction (and parameter all-gather with the distributed optimizer)."""
        size = self.cand.dp * self.cand.cp
        if self.cand.distributed_optimizer:
            return _ring(size, grad_bytes, self.dp_bw)
        return _ring(size, grad_bytes, self.dp_bw, all_reduce=True)

    def param_gather_seconds(self, param_bytes: float) -> float:
        if not self.cand.distributed_optimizer:
            return 0.0
        return _ring(self.cand.dp * self.cand.cp, param_bytes, self.dp_bw)

    def optimizer_seconds(self, stepped_elements: float) -> float:
        """Adam over this rank's elements: memory-bound, ~36 bytes read or written per element."""
        return self._memory_seconds(36 * stepped_elements)

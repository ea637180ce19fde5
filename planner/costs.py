"""Seconds per pipeline action and per collective: the inputs of the step-time simulation.

Compute comes from FLOPs at an achievable fraction of the GPU's peak (``Cluster.achievable_flops``),
plus the memory-bound work around the matrix multiplies (norms, activations, softmax), counted as
the bytes a layer saves moved twice through device memory. A measured profile (``--profile-local``,
``--from-timeline``) replaces both with seconds per layer.

With ``--fp8-format`` the decoder layers' linear products that run in FP8 (``ModelSpec.fp8_products``)
are costed at the FP8 peak (``Cluster.fp8_peak_tflops``), their weight gradients too unless
``--no-fp8-wgrad`` or a microbatch whose tokens per rank are not a multiple of 16 keeps them in the
model's dtype (the blockwise recipe's products are dequantised and multiplied in float32: costed at the
FP32 peak, ``Cluster.blockwise_peak_tflops``); the
attention core, the output layer and everything else stay at the 16-bit peak (:class:`MatmulRates`
says which rate a candidate used). The casts are element-wise work: each FP8
operand is read twice (its amax, then the scaled cast) and written in one byte, plus its transposed
copy where a product needs it (:data:`CAST_READS`); inputs and output gradients per microbatch, the
weights once per step (with ``--fp8-param-gather`` they are held in FP8: only their transposed copy).
Decoder layers kept out of FP8 by ``--first-last-layers-bf16`` cost what a 16-bit layer does, in the
stages that hold them.

Communication uses ring formulas at the group's achieved bandwidth and per-message latency (inside
a node or across nodes, from where its ranks sit in Megatron's ``tp-cp-ep-dp-pp`` order):

* tensor parallelism: per layer two all-gathers and two reduce-scatters of the layer's ``[s, b, h]``
  activations each way under sequence parallelism (two all-reduces without it), on the critical path
  (Trident does not overlap them); the loss adds the vocabulary-parallel cross-entropy's three
  all-reduces of per-token values. Where ``--profile-local`` measured them (``HostCosts.collectives``:
  each kind at the group's size among the other groups' compute) they cost the measured seconds
  instead of the ring formula;
* context parallelism: ring attention passes key/value blocks ``cp - 1`` times each way (backward
  also their gradients, ``cp`` hops), overlapped with the blocks' attention, so only what exceeds the
  attention's time shows, and the backward's last gradient hop; point-to-point messages, at the
  measured message cost where there is one. Where ``--profile-local`` timed the exchange itself (every
  context-parallel group at once among compute: ``ring_exchange`` in ``HostCosts.collectives``), each
  step of the ring costs what it measured beyond its compute;
* expert parallelism: two all-to-alls of the routed tokens each way per MoE layer, not overlapped;
* pipeline: one ``[s / cp (/ tp), b, h]`` message per boundary per microbatch, at the measured
  point-to-point latency and bandwidth where there are (``Cluster.host``);
* data parallelism: the gradient all-reduce (reduce-scatter plus parameter all-gather with the
  distributed optimizer) of each chunk, launched at its last backward (``--overlap-grad-reduce``),
  each bucket at the measured seconds of its collective where ``--profile-local`` measured them, and
  on CPU ranks sharing cores added to the step rather than hidden (:attr:`StageCostModel.dp_overlaps`).
  ZeRO-2/3's buckets follow the layers, so each collective pays the ring's latency once per bucket;
  at step scope they move what ZeRO-1 moves, at microbatch scope each microbatch's backward
  reduce-scatters its chunk's gradients and under ZeRO-3 each forward and backward all-gathers its
  parameters first (:mod:`planner.step_time` places them beside the compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.tensor_parallel.fp8 import SHAPE_MULTIPLE
from planner.activations import Shape, stage_activations
from planner.candidate import Candidate
from planner.hardware import BEHIND_KIND, Cluster, Interconnect
from planner.model_spec import ModelSpec

__all__ = ["CAST_READS", "ActionCosts", "LayerProfile", "MatmulRates", "StageCostModel"]

CAST_READS = 2
"""Reads of a 16-bit tensor per FP8 cast: its amax, then the scaled cast (fused once compiled)."""


@dataclass(frozen=True)
class MatmulRates:
    """The peaks (dense TFLOP/s) a candidate's matrix products are costed at, and in which precision."""

    linear: str
    """The decoder layers' linear products (forward and input gradient): "fp8" or the model's dtype."""
    linear_tflops: float
    weight_gradient: str
    """Their weight-gradient products."""
    weight_gradient_tflops: float
    other: str
    """Everything else: the attention core, the output layer (and any product kept out of FP8)."""
    other_tflops: float
    fp8_products: int = 0
    """Of a decoder layer's weight products, how many run in FP8 (of ``products``)."""
    products: int = 0
    measured: bool = False
    """A measured profile gave the seconds: the rates are in them, not used."""
    fp8_layers: int = 0
    """Of the decoder layers, how many run in FP8 (of ``layers``; ``--first-last-layers-bf16`` keeps the
    others at ``other``'s peak, with no casts)."""
    layers: int = 0

    def label(self) -> str:
        """``fp8 1979``, ``fp8 1979, W bf16 989``, ``fp8 1979 (2/4 products, 30/32 layers)``, ``bf16 989``;
        measured: ``measured (fp8)``."""
        if self.measured:
            return f"measured ({self.linear})"
        text = f"{self.linear} {self.linear_tflops:g}"
        if self.weight_gradient != self.linear:
            text += f", W {self.weight_gradient} {self.weight_gradient_tflops:g}"
        shares = [
            f"{part}/{whole} {what}"
            for part, whole, what in (
                (self.fp8_products, self.products, "products"),
                (self.fp8_layers, self.layers, "layers"),
            )
            if self.linear == "fp8" and part < whole
        ]
        return text + (f" ({', '.join(shares)})" if shares else "")


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
    decoder layer, the embedding and the loss (final norm, output layer, cross-entropy) on one rank:
    its share of a microbatch at the measured shape's tensor- and context-parallel sizes. A profile
    that measures or refits each shape gives it from :meth:`for_shape`.
    """

    layer: tuple[float, float, float]
    embedding: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loss: tuple[float, float, float] = (0.0, 0.0, 0.0)
    source: str = "measured"
    by_shape: dict = field(default_factory=dict)
    """(tp, micro_batch_size, recompute, cp) -> (layer, embedding, loss) of one rank, when measured per
    shape (``--profile-local`` measures a context-parallel rank's share: it is not ``1 / cp`` of the
    whole)."""
    collective_scales: dict = field(default_factory=dict)
    """``TP``, ``CP``, ``DP`` -> factor on that kind's collective seconds (a run's timeline refits them:
    :mod:`planner.refit_collectives`); a kind absent costs what the calibration or the ring formula says."""

    def for_shape(self, tp: int, micro_batch_size: int, recompute: str, cp: int = 1) -> tuple:
        key = (tp, micro_batch_size, recompute, cp)
        if key in self.by_shape:
            return self.by_shape[key]
        return self.layer, self.embedding, self.loss


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
            cp=cand.cp,
        )
        tp_stride, cp_stride = 1, cand.tp
        self.dp_stride, self.pp_stride = cand.tp * cand.cp, cand.tp * cand.cp * cand.dp
        self.tp_link = cluster.link(tp_stride, cand.tp)
        self.cp_link = cluster.link(cp_stride, cand.cp)
        self.ep_link = cluster.link(self.dp_stride, cand.ep)
        self.dp_link = cluster.link(self.dp_stride, cand.shard_ranks)
        self.instance_link = cluster.link(self.dp_stride * cand.shard_ranks, cand.instances)
        """HSDP: the N replicas of a shard, one per instance, an instance's DP x CP / N ranks apart."""
        self.pp_link = cluster.link(self.pp_stride, 2)
        self.rates = self._rates()
        self._layer, self._embedding, self._loss = (
            ActionCosts(
                a.forward + b.forward,
                a.backward_input + b.backward_input,
                a.backward_weight + b.backward_weight,
            )
            for a, b in zip(self.compute_costs(), self.collective_costs())
        )
        self._plain_layer = self._layer
        """A decoder layer kept out of FP8 (``--first-last-layers-bf16``): 16-bit products, no casts."""
        if spec.fp8 and spec.fp8_layers(range(spec.num_layers)) < spec.num_layers:
            self._plain_layer = StageCostModel(spec.without_fp8(), cand, cluster, profile)._layer

    # -- compute ---------------------------------------------------------------------------------
    def _flops_seconds(self, flops: float) -> float:
        return flops / (self.cand.tp * self.cluster.achievable_flops)

    def _memory_seconds(self, nbytes: float) -> float:
        return nbytes / (self.cluster.gpu.hbm_tb_s * 1e12)

    def _rates(self) -> MatmulRates:
        """Which peak each kind of product runs at (module docstring)."""
        s, c, cluster = self.spec, self.cand, self.cluster
        fp8_layers = s.fp8_layers(range(s.num_layers))
        fp8 = s.fp8_products(c.tp) if fp8_layers else []
        wgrad = bool(fp8) and s.fp8_wgrad and (s.fp8_blockwise or self.tokens % SHAPE_MULTIPLE == 0)
        peak = cluster.gpu.peak_tflops
        fp8_peak = cluster.blockwise_peak_tflops if s.fp8_blockwise else cluster.fp8_peak_tflops
        return MatmulRates(
            linear="fp8" if fp8 else s.precision,
            linear_tflops=fp8_peak if fp8 else peak,
            weight_gradient="fp8" if wgrad else s.precision,
            weight_gradient_tflops=fp8_peak if wgrad else peak,
            other=s.precision,
            other_tflops=peak,
            fp8_products=len(fp8),
            products=len(s.linear_products(c.tp)),
            measured=self.profile is not None,
            fp8_layers=fp8_layers,
            layers=s.num_layers,
        )

    def linear_seconds(self) -> tuple[float, float]:
        """(forward, weight gradient) seconds of a layer's weight products; the input gradient's
        products are the forward's. FP8 products at the FP8 rate, the rest at the 16-bit one; a routed
        expert's weight gradient at the 16-bit one (the tokens routed to it are seldom a multiple of 16)."""
        s, c = self.spec, self.cand
        fp8 = s.fp8_linear_flops(self.tokens, c.tp)
        fp8_wgrad = (
            s.fp8_linear_flops(self.tokens, c.tp, experts=False)
            if self.rates.weight_gradient == "fp8"
            else 0.0
        )
        rest = self._flops_seconds(s.layer_linear_flops(self.tokens) - fp8)
        fp8_rate = c.tp * self.rates.linear_tflops * 1e12 * self.cluster.gpu.compute_efficiency
        weight_gradient = rest + fp8_wgrad / fp8_rate + self._flops_seconds(fp8 - fp8_wgrad)
        return rest + fp8 / fp8_rate, weight_gradient

    def fp8_cast_seconds(self) -> tuple[float, float]:
        """(forward, input gradient) seconds of a layer's FP8 casts on one microbatch: the inputs
        forward, the output gradients backward (each with its transposed copy when the weight gradient
        is FP8), and the weights' once-a-step casts (with their transposes) spread over the step."""
        s, c = self.spec, self.cand
        products = s.fp8_products(c.tp)
        if not products:
            return 0.0, 0.0
        read = CAST_READS * s.bytes_per_value
        per_value = read + 1 + int(s.fp8_wgrad)
        inputs = sum(self.tokens * p.uses * p.in_features for p in products)
        grads = sum(self.tokens * p.uses * p.out_features for p in products)
        experts = s.moe.num_experts // c.ep if s.moe is not None else 0
        weights = sum(p.in_features * p.out_features * (experts if p.expert else 1) for p in products)
        per_weight = 2 if s.fp8_param_gather else read + 2  # held in FP8: only the transposed copy is made
        weight_bytes = weights * per_weight / c.num_microbatches
        return self._memory_seconds(inputs * per_value + weight_bytes), self._memory_seconds(
            grads * per_value
        )

    def _scale(self, kind: str) -> float:
        """The refitted factor on ``kind``'s collectives (``LayerProfile.collective_scales``), else 1."""
        return getattr(self.profile, "collective_scales", {}).get(kind, 1.0)

    def group_seconds(self, kind: str, size: int, nbytes: float) -> float:
        """Seconds of one ``kind`` collective (``all_gather``, ``reduce_scatter``, ``all_reduce``) of a
        whole tensor of ``nbytes`` in a tensor-parallel group of ``size``: measured where the host was (``HostCosts.collectives``, wall
        seconds with every rank busy, brought to seconds of work: divided by that load's slowdown, which
        the shared-core timing puts back), else the ring formulas over the group's link."""
        if size <= 1:
            return 0.0
        host = self.cluster.host
        measured = host.collective_seconds(kind, size, nbytes)
        if measured is not None:
            busy = host.slowdown_at(host.collectives_world, self.cluster.cores) if self.cluster.cores else 1.0
            return self._scale("TP") * measured / busy
        return self._scale("TP") * self.tp_link.ring(size, nbytes, all_reduce=kind == "all_reduce")

    def _tp_layer_seconds(self) -> float:
        """One direction's tensor-parallel traffic of a layer (forward, or the input gradient): two
        all-gathers and two reduce-scatters under sequence parallelism, else two all-reduces."""
        c, s = self.cand, self.spec
        activation = s.bytes_per_value * self.tokens * s.hidden_size
        if c.tp == 1:
            return 0.0
        if c.sequence_parallel:
            return 2 * (
                self.group_seconds("all_gather", c.tp, activation)
                + self.group_seconds("reduce_scatter", c.tp, activation)
            )
        return 2 * self.group_seconds("all_reduce", c.tp, activation)

    def _cp_layer_seconds(self, attention_seconds: float) -> tuple[float, float]:
        """Ring attention's exposed traffic of a layer (forward, input gradient). Forward: ``cp - 1``
        key/value blocks, each sent while the block in hand is attended. Backward: the same blocks and,
        each step, the blocks' key/value gradients (fp32) travelling on, hidden behind the backward's
        attention (twice the forward's), and the last gradient hop after it. Each is a point-to-point
        message (``isend``/``irecv``), at the measured message cost where the host was measured; where
        the host timed the exchange itself among every group's compute (``ring_exchange`` in
        ``HostCosts.collectives``: what it adds to the compute it hides behind), each step costs that."""
        forward, backward = self._cp_exposed(attention_seconds)
        return self._scale("CP") * forward, self._scale("CP") * backward

    def _cp_exposed(self, attention_seconds: float) -> tuple[float, float]:
        """:meth:`_cp_layer_seconds` before the refitted factor."""
        c, s = self.cand, self.spec
        if c.cp == 1:
            return 0.0, 0.0
        values = self.tokens * s.kv_size // c.tp
        kv_bytes, grad_bytes = 2 * s.bytes_per_value * values, 2 * 4 * values
        exchange = self._measured_exchange(kv_bytes)
        if exchange is not None:
            both = self._measured_exchange(kv_bytes + grad_bytes)
            return (c.cp - 1) * exchange, (c.cp - 1) * both + self._measured_exchange(grad_bytes)
        block, grads = self._message(kv_bytes), self._message(grad_bytes)
        forward = max(0.0, (c.cp - 1) * block - attention_seconds)
        backward = max(0.0, (c.cp - 1) * (block + grads) - 2 * attention_seconds) + grads
        return forward, backward

    def _measured_exchange(self, nbytes: float) -> float | None:
        """Seconds one step of ring attention's exchange of ``nbytes`` adds in this candidate's
        context-parallel group, as measured (wall seconds among every rank's compute, brought to seconds
        of work as :meth:`group_seconds` does); None where unmeasured. Under pipelining the timing with
        the other ranks computing out of step (``BEHIND_KIND``: the other stages do not exchange in step
        with this group, and keep its partner off the cores), where measured."""
        host, cp = self.cluster.host, self.cand.cp
        measured = host.collective_seconds(BEHIND_KIND, cp, nbytes) if self.cand.pp > 1 else None
        if measured is None:
            measured = host.collective_seconds("ring_exchange", cp, nbytes)
        if measured is None:
            return None
        busy = host.slowdown_at(host.collectives_world, self.cluster.cores) if self.cluster.cores else 1.0
        return measured / busy

    def _message(self, nbytes: float, link: Interconnect | None = None) -> float:
        """One point-to-point message: the host's measured latency and bandwidth where there are
        (``HostCosts.message_latency``), else ``link``'s (the context-parallel group's)."""
        host, link = self.cluster.host, link or self.cp_link
        latency = link.latency if host.message_latency is None else host.message_latency
        bandwidth = link.bandwidth if host.message_bandwidth is None else host.message_bandwidth
        return latency + nbytes / bandwidth

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
        return 2 * self.ep_link.ring(c.ep, routed)  # an all-to-all moves what a ring all-gather does

    def _measured(self, part: int) -> ActionCosts | None:
        """The profile's compute seconds of the layer (0), embedding (1) or loss (2), if measured."""
        if self.profile is None:
            return None
        c = self.cand
        return ActionCosts(*self.profile.for_shape(c.tp, c.micro_batch_size, c.recompute, c.cp)[part])

    def _collectives(self) -> tuple[ActionCosts, ActionCosts, ActionCosts]:
        """The collectives inside a layer's, the embedding's and the loss's actions (F, I, W): a layer's
        TP/CP/EP traffic each way (and its replayed forward's under full recomputation), the
        embedding's TP reduction, the loss's gather and the cross-entropy's three reductions."""
        s, c = self.spec, self.cand
        core = self._flops_seconds(s.attention_core_flops(self.tokens) / c.cp)
        cp_forward, cp_backward = self._cp_layer_seconds(core)
        comm = self._tp_layer_seconds() + self._ep_layer_seconds()
        recomputed = comm + cp_forward if c.recompute == "full" else 0.0  # the replayed forward's
        activation = s.bytes_per_value * self.tokens * s.hidden_size
        embedding = self.group_seconds(
            "reduce_scatter" if c.sequence_parallel else "all_reduce", c.tp, activation
        )
        gather = self.group_seconds("all_gather", c.tp, activation)
        reductions = 3 * self.group_seconds("all_reduce", c.tp, 4 * self.tokens)  # max, sum of exp, target
        return (
            ActionCosts(comm + cp_forward, comm + cp_backward + recomputed, 0.0),
            ActionCosts(embedding, 0.0, embedding),
            ActionCosts(gather + reductions, gather, 0.0),
        )

    def _layer_compute(self) -> ActionCosts:
        """A decoder layer's compute, measured or from FLOPs and bytes, without its collectives."""
        s, c = self.spec, self.cand
        measured = self._measured(0)
        if measured is not None:
            return measured
        core = self._flops_seconds(s.attention_core_flops(self.tokens) / c.cp)
        linear, weight_gradient = self.linear_seconds()
        cast_forward, cast_backward = self.fp8_cast_seconds()
        plain = Shape(**{**self.shape.__dict__, "recompute": "none"})
        elementwise = self._memory_seconds(
            2 * sum(stage_activations(s, plain, ("t",), first=True).terms.values())
        )
        forward = linear + core + elementwise + cast_forward
        backward_input = linear + 2 * core + elementwise + cast_backward
        if c.recompute == "full":
            backward_input += forward
        elif c.recompute == "selective":
            backward_input += core
        return ActionCosts(forward, backward_input, weight_gradient)

    def _embedding_compute(self) -> ActionCosts:
        measured = self._measured(1)
        if measured is not None:
            return measured
        lookup = self._memory_seconds(2 * self.spec.bytes_per_value * self.tokens * self.spec.hidden_size)
        return ActionCosts(lookup, 0.0, lookup)

    def _loss_compute(self) -> ActionCosts:
        s, c = self.spec, self.cand
        measured = self._measured(2)
        if measured is not None:
            return measured
        logits = self._flops_seconds(s.logits_flops(self.tokens, c.tp))
        vocab_bytes = 4 * self.tokens * s.padded_vocab(c.tp) // c.tp
        softmax = self._memory_seconds(6 * vocab_bytes)  # copy, max, shift, exp, sum, divide
        return ActionCosts(logits + softmax, logits + self._memory_seconds(3 * vocab_bytes), logits)

    def compute_costs(self) -> tuple[ActionCosts, ActionCosts, ActionCosts]:
        """(layer, embedding, loss) seconds of one microbatch without their collectives."""
        return self._layer_compute(), self._embedding_compute(), self._loss_compute()

    def collective_costs(self) -> tuple[ActionCosts, ActionCosts, ActionCosts]:
        """(layer, embedding, loss) seconds of the collectives inside their actions."""
        return self._collectives()

    def stage(self, symbols: tuple[str, ...], stage: int | None = None) -> ActionCosts:
        """Seconds of one microbatch in a stage holding ``symbols``: pipeline stage ``stage`` of the
        candidate's layout, whose layers kept out of FP8 cost what 16-bit ones do (None: layers that
        run as most do, in FP8 when the model is)."""
        layers = symbols.count("t")
        plain = 0 if stage is None else layers - self.spec.fp8_layers(self.cand.layers_of(stage))
        if not self.spec.fp8:
            plain = 0  # (every layer is the plain one)
        parts = [
            (layers - plain, self._layer),
            (plain, self._plain_layer),
            (int("E" in symbols), self._embedding),
            (int("L" in symbols), self._loss),
        ]
        return ActionCosts(
            sum(n * p.forward for n, p in parts),
            sum(n * p.backward_input for n, p in parts),
            sum(n * p.backward_weight for n, p in parts),
        )

    def decoder_layers(self) -> list[ActionCosts]:
        """Each decoder layer's seconds of one microbatch, in order: those kept out of FP8
        (``--first-last-layers-bf16``) at what a 16-bit layer costs, the others at the typical one."""
        spec = self.spec
        return [self._layer if not spec.fp8 or spec.layer_in_fp8(i) else self._plain_layer
                for i in range(spec.num_layers)]  # fmt: skip

    # -- communication between stages and at the step's end ---------------------------------------
    def p2p_seconds(self) -> float:
        """One pipeline message (an activation or its gradient)."""
        s = self.spec
        message = s.bytes_per_value * self.shape.sharded_seq * self.cand.micro_batch_size * s.hidden_size
        return self._message(message, self.pp_link)

    def dp_collective_seconds(self, nbytes: float, buckets: int = 1, kind: str = "reduce_scatter") -> float:
        """One ``kind`` collective (``reduce_scatter``, ``all_gather``, ``all_reduce``) over the
        data-parallel (x context-parallel) group of ``buckets`` buckets holding ``nbytes`` in all: where
        the host measured that collective at the group's size (``HostCosts.collectives``, every group
        at once among compute) each bucket costs the measured wall seconds of its share (the
        data-parallel channel runs in wall seconds, outside the shared-core timing: not divided by the
        load); else the ring's transfer and its ``size - 1`` steps' latency per bucket. Under HSDP the
        group is one instance's DP x CP / N ranks (:meth:`instance_seconds` adds the replicas' share)."""
        return self._scale("DP") * self._ring_seconds(
            self.dp_link, self.cand.shard_ranks, nbytes, buckets, kind
        )

    def _ring_seconds(self, link: Interconnect, size: int, nbytes: float, buckets: int, kind: str) -> float:
        if size <= 1:
            return 0.0
        measured = self.cluster.host.collective_seconds(kind, size, nbytes / buckets)
        if measured is not None:
            return buckets * measured
        ring = link.ring(size, nbytes, all_reduce=kind == "all_reduce")
        return ring + (buckets - 1) * (size - 1) * link.latency

    def instance_seconds(
        self, grad_bytes: float, param_bytes: float, buckets: int = 1
    ) -> tuple[float, float]:
        """HSDP's once-a-step traffic over the N instances (``core.distributed.grad_buffer``), as (the
        reduction, the gather): each rank's reduced gradient shard (``grad_bytes`` of whole buffers, 1 /
        (DP x CP / N) of them its shard) is all-reduced over its N replicas; with the outer ``optim`` it
        is reduce-scattered instead and the updated parameter shard (of ``param_bytes``) all-gathered
        back over them after the optimizer step, blocking. (0, 0) without instances."""
        n = self.cand.instances
        if n <= 1:
            return 0.0, 0.0
        grad_shard, param_shard = grad_bytes / self.cand.shard_ranks, param_bytes / self.cand.shard_ranks
        if not self.cand.outer_sharded:
            return self._ring_seconds(self.instance_link, n, grad_shard, buckets, "all_reduce"), 0.0
        return (
            self._ring_seconds(self.instance_link, n, grad_shard, buckets, "reduce_scatter"),
            self._ring_seconds(self.instance_link, n, param_shard, buckets, "all_gather"),
        )

    @property
    def dp_overlaps(self) -> bool:
        """Whether data-parallel traffic runs beside the compute (``--overlap-grad-reduce``,
        ``--overlap-param-gather``): on a GPU it does (its own streams). On CPU ranks sharing cores
        (``Cluster.cores``) gloo's collectives need the cores the compute holds, so each adds its seconds
        to the rank's step: ``tools/bench/dp.py`` at DP2 measured ZeRO-2's three extra reduce-scatters
        a step and ZeRO-3's eight gathers, all launched beside compute, as exposed in full."""
        return not self.cluster.cores

    def grad_sync_seconds(self, grad_bytes: float, buckets: int = 1) -> float:
        """A rank's data-parallel gradient reduction of ``grad_bytes``: an all-reduce, or with the
        distributed optimizer a reduce-scatter (per bucket under ZeRO-2/3: buckets follow the layers)."""
        kind = "reduce_scatter" if self.cand.distributed_optimizer else "all_reduce"
        return self.dp_collective_seconds(grad_bytes, buckets, kind)

    def param_gather_seconds(self, param_bytes: float, buckets: int = 1) -> float:
        """The distributed optimizer's all-gather of the updated parameters (``param_bytes``)."""
        if not self.cand.distributed_optimizer:
            return 0.0
        return self.dp_collective_seconds(param_bytes, buckets, "all_gather")

    def optimizer_seconds(self, stepped_elements: float, stepped_tensors: float = 0.0) -> float:
        """Adam over this rank's elements: measured per element and per tensor where the host was
        (``--profile-local``), else memory-bound, ~36 bytes read or written per element."""
        host = self.cluster.host
        if host.optimizer_element_seconds is not None:
            return (
                host.optimizer_element_seconds * stepped_elements
                + host.optimizer_tensor_seconds * stepped_tensors
            )
        return self._memory_seconds(36 * stepped_elements)

    def fp8_shard_cast_seconds(self, elements: float) -> float:
        """``--fp8-param-gather``: the optimizer casts its updated fp32 shard of the FP8 weights to FP8
        (read for the amax and for the cast, one byte written)."""
        return self._memory_seconds((CAST_READS * 4 + 1) * elements)

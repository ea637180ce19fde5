"""What the planner knows about a model: its sizes, and from them parameter counts and FLOPs.

A :class:`ModelSpec` is read from a validated ``TransformerConfig`` (whichever way the model was
given: Megatron flags, a preset, or a Hugging Face ``config.json``) plus the vocabulary and sequence
length, so the planner sees exactly what training would build. Counts are per tensor-parallel rank
where the layer is split, and whole where it is replicated (norms, biases after a row-parallel
layer, learned positions), because that is what one rank holds.

FLOPs follow Megatron's ``num_floating_point_operations`` (``training/reporting/throughput.py``): every matrix
multiply counts 2 FLOPs per multiply-add, attention scores count the causal half, and a backward is
twice its forward. The planner splits that backward as the zero-bubble schedules do: the input
gradient ``I`` (one pass over every weight, plus the attention core's backward) and the weight
gradient ``W`` (one pass over every weight).

Mixture of experts: a layer's MLP is ``num_experts`` expert MLPs of ``moe_ffn_hidden_size`` and a
router; each token visits ``moe_router_topk`` experts, so FLOPs count the active experts only, while
parameters count every expert (split over expert parallelism).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from core.tensor_parallel.fp8 import SHAPE_MULTIPLE, fp8_feature_multiple

__all__ = ["BYTES", "LinearProduct", "ModelSpec", "MoeSpec"]

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_CONFIG_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "add_bias_linear",
    "add_qkv_bias",
    "position_embedding_type",
    "rotary_percent",
    "attention_dropout",
    "hidden_dropout",
    "attention_softmax_in_fp32",
    "make_vocab_size_divisible_by",
)
"""The fields of :class:`ModelSpec` that hold ``TransformerConfig``'s value of the same name."""


@dataclass(frozen=True)
class MoeSpec:
    """Megatron's MoE sizes: ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``."""

    num_experts: int
    router_topk: int = 2
    ffn_hidden_size: int | None = None
    """Each expert's FFN size (default: the dense --ffn-hidden-size)."""
    aux_loss: bool = False
    """A load-balancing loss is computed (``--moe-aux-loss-coeff`` > 0): the router keeps its scores."""
    grouped_gemm: bool = False
    """``--moe-grouped-gemm``: the experts run as one grouped product (which has no FP8 form here)."""


@dataclass(frozen=True)
class LinearProduct:
    """One weight product of a decoder layer, as one rank runs it."""

    name: str
    in_features: int
    """Per rank: the product's K (a CUDA FP8 product needs a multiple of 16, a blockwise one of 128)."""
    out_features: int
    """Per rank: the product's N (likewise)."""
    whole_elements: int
    """The whole weight's elements (TP = 1): forward FLOPs are ``2 x tokens x uses x`` this."""
    uses: int = 1
    """Times a token passes through it (an MoE token visits its top-k experts)."""
    expert: bool = False
    """One routed expert's: a rank holds ``num_experts / ep`` of them."""

    def fits_fp8(self, multiple: int = SHAPE_MULTIPLE) -> bool:
        """Whether both features per rank are multiples of ``multiple``
        (``ModelSpec.fp8_feature_multiple``)."""
        return self.in_features % multiple == 0 and self.out_features % multiple == 0


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only GPT/LLaMA (optionally MoE) as the planner sees it."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    """The tokenizer's vocabulary; the model pads it to ``make_vocab_size_divisible_by`` x TP."""
    seq_length: int
    max_position_embeddings: int
    gated: bool = False
    """Gated MLP (two fc1 branches)."""
    swiglu: bool = False
    """The gated MLP is SwiGLU (SiLU gate), which Trident runs as one autograd function."""
    zero_centered_gamma: bool = False
    """Norm weights hold gamma - 1 (``--apply-layernorm-1p``): LayerNorm then works in fp32."""
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    untie_embeddings: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    attention_softmax_in_fp32: bool = False
    cross_entropy_fusion: bool = False
    """``--cross-entropy-loss-fusion``: the loss keeps the logits, not an fp32 softmax."""
    cross_entropy_linear: bool = False
    """``--cross-entropy-fusion-impl linear``: the output layer runs inside the loss; no logits kept."""
    make_vocab_size_divisible_by: int = 128
    precision: str = "fp32"
    grads_in_fp32: bool | None = None
    """Gradients accumulate and are reduced in fp32 (``DistributedDataParallelConfig.grad_reduce_in_fp32``),
    else in the model's dtype; None, the training flags' default: fp32 but for an fp16 model."""
    grad_comm_bytes: int | None = None
    """Bytes of a gradient as the reductions send it (``--megatron-fsdp-grad-comm-dtype``): each bucket is
    cast to that dtype for its reduction and the sum cast back; None, sent in the dtype it accumulates in."""
    main_params_in_model_dtype: bool = False
    """The optimizer steps the weights in the model's dtype, with its moments in that dtype and no fp32 main
    copy (``OptimizerConfig.main_params_dtype``, from ``--megatron-fsdp-main-params-dtype auto``)."""
    fp8: bool = False
    """The decoder layers' linear layers multiply in FP8 (``--fp8-format``): they save their inputs in FP8
    (with FP8 weight gradients), and hold an FP8 copy of each weight and its transpose for the step."""
    fp8_wgrad: bool = True
    """The weight-gradient products run in FP8 too (``--no-fp8-wgrad`` keeps them in the model's dtype)."""
    fp8_blockwise: bool = False
    """``--fp8-recipe blockwise``: features per rank in multiples of 128, and products dequantised block
    by block and multiplied in float32, at the FP32 rate (``core.tensor_parallel.fp8_blockwise``)."""
    fp8_param_gather: bool = False
    """``--fp8-param-gather``: the FP8 layers' weights are held in FP8 (one byte an element, no 16-bit
    copy and no cast per step; the layer still keeps the transposed copy for the step), and the
    distributed optimizer's parameter all-gather moves one byte an element for them."""
    bf16_layers_at_start: int = 0
    bf16_layers_at_end: int = 0
    """``--first-last-layers-bf16`` (``--num-layers-at-start-in-bf16``, ``--num-layers-at-end-in-bf16``):
    decoder layers at either end that training builds without FP8 (16-bit products, no casts, 16-bit
    saved inputs, and weights never held in FP8)."""
    moe: MoeSpec | None = None
    name: str = ""

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config,
        *,
        vocab_size: int,
        seq_length: int,
        max_position_embeddings: int | None = None,
        name: str = "",
    ) -> ModelSpec:
        """From a ``TransformerConfig`` (its derived defaults already filled in by ``__post_init__``)."""
        import torch

        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(config.params_dtype, "fp32")
        moe, experts = None, config.num_moe_experts
        if experts:
            balancing = config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff > 0
            grouped = getattr(config, "moe_grouped_gemm", False)
            moe = MoeSpec(experts, config.moe_router_topk, config.moe_ffn_hidden_size, balancing, grouped)
        return cls(
            **{name: getattr(config, name) for name in _CONFIG_FIELDS},
            vocab_size=vocab_size,
            seq_length=seq_length,
            max_position_embeddings=max_position_embeddings or seq_length,
            gated=config.gated_linear_unit,
            swiglu=config.gated_linear_unit and config.activation_func is torch.nn.functional.silu,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            untie_embeddings=config.untie_embeddings_and_output_weights,
            cross_entropy_fusion=config.cross_entropy_loss_fusion,
            cross_entropy_linear=config.cross_entropy_loss_fusion
            and config.cross_entropy_fusion_impl == "linear",
            precision=precision,
            fp8=config.fp8 is not None,
            fp8_wgrad=config.fp8_wgrad,
            fp8_blockwise=config.fp8 is not None and config.fp8_recipe == "blockwise",
            fp8_param_gather=config.fp8 is not None and getattr(config, "fp8_param_gather", False),
            **_bf16_layers(config),
            moe=moe,
            name=name,
        )

    def with_(self, **changes) -> ModelSpec:
        return replace(self, **changes)

    def without_fp8(self) -> ModelSpec:
        """The same model with no FP8 layer (what a layer kept out of FP8 costs)."""
        return replace(self, fp8=False, fp8_param_gather=False, bf16_layers_at_start=0, bf16_layers_at_end=0)

    def layer_in_fp8(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global, 0-based) runs its linear layers in FP8."""
        return self.fp8 and self.bf16_layers_at_start <= layer < self.num_layers - self.bf16_layers_at_end

    def fp8_layers(self, layers: Iterable[int]) -> int:
        """How many of the decoder layers ``layers`` (global numbers) run in FP8."""
        return sum(1 for layer in layers if self.layer_in_fp8(layer))

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def bytes_per_value(self) -> int:
        return BYTES[self.precision]

    @property
    def grad_bytes_per_value(self) -> int:
        """Bytes of a gradient in the data-parallel buffers (:attr:`grads_in_fp32`)."""
        in_fp32 = self.precision != "fp16" if self.grads_in_fp32 is None else self.grads_in_fp32
        return 4 if in_fp32 else self.bytes_per_value

    @property
    def grad_comm_bytes_per_value(self) -> int:
        """Bytes of a gradient on the wire in the data-parallel reductions."""
        return self.grad_comm_bytes or self.grad_bytes_per_value

    @property
    def grad_comm_copy_bytes(self) -> int:
        """Bytes per gradient of a reduction's cast copy (0: sent as it is, no copy)."""
        comm = self.grad_comm_bytes_per_value
        return 0 if comm == self.grad_bytes_per_value else comm

    @property
    def query_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def moe_ffn(self) -> int:
        return (self.moe.ffn_hidden_size or self.ffn_hidden_size) if self.moe else 0

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    # -- parameters (per tensor-parallel rank) ------------------------------------------------------
    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    def attention_params(self, tp: int) -> int:
        h, qkv = self.hidden_size, self.query_size + 2 * self.kv_size
        bias_qkv = qkv // tp if (self.add_bias_linear or self.add_qkv_bias) else 0
        bias_proj = h if self.add_bias_linear else 0
        return qkv // tp * h + bias_qkv + h * self.query_size // tp + bias_proj

    def mlp_params(self, tp: int, ffn: int | None = None) -> int:
        h, f = self.hidden_size, ffn or self.ffn_hidden_size
        branches = 2 if self.gated else 1
        bias = (branches * f // tp + h) if self.add_bias_linear else 0
        return branches * f // tp * h + h * f // tp + bias

    def fp8_weight_elements(self, tp: int, ep: int | None = None) -> int:
        """Elements of one decoder layer's FP8 linear weights on one rank: its FP8 products' (attention
        and a dense MLP's), with ``ep`` this rank's routed experts' too (``num_experts / ep`` whole
        experts: held in FP8 with ``--fp8-param-gather``, else cast); 0 without FP8."""
        experts = self.moe.num_experts // ep if self.moe is not None and ep else 0
        return sum(
            p.in_features * p.out_features * (experts if p.expert else 1) for p in self.fp8_products(tp)
        )

    def linear_products(self, tp: int) -> list[LinearProduct]:
        """One decoder layer's weight products on one rank (attention, then the MLP or one routed
        expert's; the router is left out: it stays in the model's dtype)."""
        h, q, f = self.hidden_size, self.query_size, self.ffn_hidden_size
        qkv, branches = q + 2 * self.kv_size, 2 if self.gated else 1
        products = [
            LinearProduct("qkv", h, qkv // tp, h * qkv),
            LinearProduct("proj", q // tp, h, q * h),
        ]
        if self.moe is None:
            return products + [
                LinearProduct("fc1", h, branches * f // tp, h * branches * f),
                LinearProduct("fc2", f // tp, h, f * h),
            ]
        e, k = self.moe_ffn, self.moe.router_topk  # whole experts (no expert tensor parallelism)
        return products + [
            LinearProduct("expert fc1", h, branches * e, h * branches * e, k, expert=True),
            LinearProduct("expert fc2", e, h, e * h, k, expert=True),
        ]

    def fp8_products(self, tp: int) -> list[LinearProduct]:
        """The products of :meth:`linear_products` that run in FP8: all of them with ``--fp8-format``,
        except any whose features per rank a CUDA FP8 product cannot take (not multiples of 16; 128
        under the blockwise recipe), as the layers decide (``enable_fp8``), and routed experts under
        ``--moe-grouped-gemm``. Empty without FP8."""
        if not self.fp8:
            return []
        grouped = self.moe is not None and self.moe.grouped_gemm
        multiple = self.fp8_feature_multiple
        return [p for p in self.linear_products(tp) if p.fits_fp8(multiple) and not (p.expert and grouped)]

    @property
    def fp8_feature_multiple(self) -> int:
        """The multiple a linear layer's features per rank need to run in FP8, as the layers decide."""
        return fp8_feature_multiple(self.fp8_blockwise)

    def fp8_linear_flops(self, tokens: int, tp: int = 1, *, experts: bool = True) -> float:
        """Forward FLOPs of a layer's products that run in FP8 at TP ``tp`` (counted as
        :meth:`layer_linear_flops` counts, TP = 1); the rest of that count stays in the model's dtype.
        ``experts=False`` leaves the routed experts' out."""
        products = [p for p in self.fp8_products(tp) if experts or not p.expert]
        return 2.0 * tokens * sum(p.uses * p.whole_elements for p in products)

    def layer_params(self, tp: int, ep: int = 1) -> int:
        """One decoder layer on one rank: norms, attention, and the MLP (or this rank's experts)."""
        dense = 2 * self.norm_params() + self.attention_params(tp)
        if self.moe is None:
            return dense + self.mlp_params(tp)
        experts = self.moe.num_experts // ep * self.mlp_params(tp, self.moe_ffn)
        return dense + experts + self.hidden_size * self.moe.num_experts  # + the router

    def embedding_params(self, tp: int) -> int:
        positions = self.max_position_embeddings * self.hidden_size
        learned = self.position_embedding_type == "learned_absolute"
        return self.padded_vocab(tp) // tp * self.hidden_size + (positions if learned else 0)

    def output_params(self, tp: int) -> int:
        """The output layer's own weight (a tied one on another stage holds a copy of the embedding)."""
        return self.padded_vocab(tp) // tp * self.hidden_size

    def total_params(self) -> int:
        """Every parameter of the model once (TP = 1), the output layer counted only when untied."""
        layers = self.num_layers * self.layer_params(1)
        output = self.output_params(1) if self.untie_embeddings else 0
        return layers + self.embedding_params(1) + self.norm_params() + output

    def active_params(self) -> int:
        """Parameters a token passes through: MoE counts its top-k experts only."""
        if self.moe is None:
            return self.total_params()
        inactive = (self.moe.num_experts - self.moe.router_topk) * self.mlp_params(1, self.moe_ffn)
        return self.total_params() - self.num_layers * inactive

    # -- FLOPs (per microbatch of ``tokens`` tokens, TP = 1; divide by TP for one rank) ------------
    def layer_linear_flops(self, tokens: int) -> float:
        """Forward FLOPs of a layer's weight multiplies (the MoE counts its active experts)."""
        h = self.hidden_size
        attention = h * (self.query_size + 2 * self.kv_size) + self.query_size * h
        branches = 2 if self.gated else 1
        if self.moe is None:
            mlp = (branches + 1) * h * self.ffn_hidden_size
        else:
            mlp = self.moe.router_topk * (branches + 1) * h * self.moe_ffn + h * self.moe.num_experts
        return 2.0 * tokens * (attention + mlp)

    def attention_core_flops(self, tokens: int, seq: int | None = None) -> float:
        """Forward FLOPs of ``QK^T`` and ``(QK^T) V`` over the causal half (Megatron's count)."""
        seq = seq or self.seq_length
        return 2.0 * tokens * self.query_size * seq  # 2 matmuls x 2 FLOPs x (seq / 2) keys

    def logits_flops(self, tokens: int, tp: int = 1) -> float:
        return 2.0 * tokens * self.hidden_size * self.padded_vocab(tp)

    def training_flops(self, tokens: int) -> float:
        """One forward and backward of ``tokens`` tokens through the whole model (Megatron's count)."""
        layer = self.layer_linear_flops(tokens) + self.attention_core_flops(tokens)
        return 3.0 * (self.num_layers * layer + self.logits_flops(tokens))


def _bf16_layers(config) -> dict[str, int]:
    """The ``bf16_layers_at_*`` fields of a ``TransformerConfig`` (0 without FP8 or the flag)."""
    if config.fp8 is None or not getattr(config, "first_last_layers_bf16", False):
        return {}
    return {
        "bf16_layers_at_start": config.num_layers_at_start_in_bf16,
        "bf16_layers_at_end": config.num_layers_at_end_in_bf16,
    }


def describe(spec: ModelSpec) -> str:
    """One line: the model's shape and size."""
    parts = [
        f"{spec.num_layers} layers",
        f"hidden {spec.hidden_size}",
        f"{spec.num_attention_heads} heads"
        + (f" / {spec.num_query_groups} groups" if spec.num_query_groups != spec.num_attention_heads else ""),
        f"FFN {spec.ffn_hidden_size}" + (" (SwiGLU)" if spec.gated else ""),
        f"vocabulary {spec.vocab_size}",
        f"sequence {spec.seq_length}",
        spec.precision,
    ]
    if spec.moe is not None:
        parts.append(f"{spec.moe.num_experts} experts, top-{spec.moe.router_topk}")
    if spec.fp8:
        parts.append("FP8 linear layers" + (", FP8 parameter gather" if spec.fp8_param_gather else ""))
        if spec.bf16_layers_at_start or spec.bf16_layers_at_end:
            parts.append(
                f"first {spec.bf16_layers_at_start} and last {spec.bf16_layers_at_end} layers not in FP8"
            )
    total, active = spec.total_params(), spec.active_params()
    size = f"{total / 1e9:.1f}B parameters" + (f" ({active / 1e9:.1f}B active)" if active != total else "")
    return f"{spec.name + ': ' if spec.name else ''}{', '.join(parts)}; {size}"

"""TransformerConfig: the shape and behaviour of a GPT/LLaMA decoder, on top of the parallel config.

Field names follow Megatron-LM's ``TransformerConfig`` (plus the few GPT-model options Megatron keeps
in its argument parser: position embeddings, vocabulary padding, tied output weights, seed), so a
Megatron user can read a config at a glance. Every derived default (``ffn_hidden_size``,
``kv_channels``, ``num_query_groups``) is filled in ``__post_init__``, and every invalid combination
is reported at construction, all problems in one ``ValueError`` that names the fields and numbers,
before any rank builds a layer or joins a collective. The rules live beside their subsystem
(``core.transformer.rules``, ``context_parallel.rules``, ``moe.rules``) as structured problems, which
the command line says with Megatron's flag names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from core.flags import flag, not_a_flag
from core.model_parallel_config import ModelParallelConfig
from core.problems import Problem, ProblemsError, problem
from core.tensor_parallel.fp8_config import Fp8Config, fp8_problems
from core.transformer.context_parallel.rules import context_parallel_problems
from core.transformer.cuda_graphs import CudaGraphImpl, cuda_graph_problems
from core.transformer.moe.moe_config import MoEConfig, parse_moe_layer_freq
from core.transformer.moe.rules import moe_problems
from core.transformer.rules import (  # noqa: F401 (the recompute vocabulary, public here as before)
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RecomputeGranularity,
    RecomputeMethod,
    decoder_problems,
    size_problems,
)

Normalization = Literal["LayerNorm", "RMSNorm"]
PositionEmbeddingType = Literal["learned_absolute", "rope", "none"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
CrossEntropyFusionImpl = Literal["native", "te", "linear"]
NORMALIZATIONS = get_args(Normalization)
POSITION_EMBEDDING_TYPES = get_args(PositionEmbeddingType)
RUNTIME_FIELDS = (
    "schedule_hooks",
    "no_sync_func",
    "grad_sync_func",
    "finalize_model_grads_func",
    "grad_scale_func",
    "timers",
    "compile",
    "compile_backend",
    "cuda_graph_impl",
    "cuda_graph_scope",
    "cuda_graph_warmup_steps",
    "enable_cuda_graph",
    "init_model_with_meta_device",
)
"""Hooks the training loop installs at run time, and how a run builds and executes the model (on the
meta device, compiled): not part of a model's description, never serialised (a tool rebuilding a
checkpoint's model builds it whole and runs it eagerly)."""


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation GPT-2 was trained with (Megatron's ``openai_gelu``, HF's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "openai_gelu": openai_gelu,
    "silu": F.silu,
    "relu": F.relu,
}
"""Activation functions by the name a serialised config stores (``to_dict`` / ``from_dict``)."""


@dataclass(kw_only=True)
class TransformerConfig(ModelParallelConfig, MoEConfig, Fp8Config):
    """Sizes, layer choices, regularisation, initialisation and recomputation of a decoder-only model.

    LLaMA and GPT-2 are both configurations of this one class (see ``models.gpt.presets``), and so
    are mixtures of experts (Mixtral, Qwen2-MoE): the MoE fields come from :class:`MoEConfig`, the FP8
    fields from :class:`~core.tensor_parallel.fp8_config.Fp8Config`.
    """

    num_layers: int = flag(0, cli_default=None)
    """Decoder layers in the whole model (all pipeline stages together)."""

    num_attention_heads: int = flag(0, cli_default=None)
    """Query heads per layer."""

    num_query_groups: int | None = flag(None, cli_default=1)
    """Key/value heads (GQA); None means one per query head (MHA), 1 is multi-query attention."""

    ffn_hidden_size: int | None = None
    """MLP inner size (per branch for a gated unit); None means 4 * hidden_size, as in Megatron."""

    kv_channels: int | None = None
    """Size of one attention head; None means hidden_size / num_attention_heads."""

    normalization: Normalization = "LayerNorm"
    """"LayerNorm" (GPT-2) or "RMSNorm" (LLaMA)."""

    layernorm_epsilon: float = flag(1e-5, name="--norm-epsilon")
    """Epsilon of every norm."""

    layernorm_zero_centered_gamma: bool = not_a_flag(False)
    """Norm weights hold gamma - 1 and start at zero; the norm scales by ``1 + weight`` (Megatron's
    ``--apply-layernorm-1p``: in low precision, small updates around zero are kept that would round
    away near one)."""

    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    """MLP activation; with ``gated_linear_unit`` it is applied to the gate branch (F.silu: SwiGLU)."""

    gated_linear_unit: bool = not_a_flag(False)
    """Use a gated MLP: ``act(x W_gate) * (x W_up)`` (LLaMA's SwiGLU with ``activation_func=F.silu``)."""

    add_bias_linear: bool = flag(
        True,
        name="--disable-bias-linear",
        help="No biases in the linear layers of attention and MLP (LLaMA).",
    )
    """Biases on every linear layer of attention and MLP (GPT-2 yes, LLaMA no)."""

    add_qkv_bias: bool = False
    """Bias on the QKV projection only, even without ``add_bias_linear`` (Qwen-style)."""

    position_embedding_type: PositionEmbeddingType = "learned_absolute"
    """"learned_absolute" (GPT-2), "rope" (LLaMA) or "none"."""

    rotary_base: float = 10000.0
    """RoPE theta."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (the rest pass through)."""

    rope_scaling: bool = flag(False, name="--use-rope-scaling")
    """Llama-3.1 RoPE scaling: slow frequencies divided by ``rope_scaling_factor``, fast ones kept,
    a smooth ramp between (low/high frequency factors 1 and 4, 8192 original positions, as Megatron)."""

    rope_scaling_factor: float = 8.0
    """With ``rope_scaling``: how much the slow RoPE frequencies are divided by (Llama-3.1: 8, 3.2: 32)."""

    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of reusing the word embedding (LLaMA unties)."""

    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the TP size, so every shard is equal."""

    attention_dropout: float = flag(0.1, group="regularization")
    """Dropout on attention probabilities."""

    hidden_dropout: float = flag(0.1, group="regularization")
    """Dropout on the embedding output and on each residual branch."""

    cp_comm_type: list[str] = flag(default_factory=lambda: ["p2p"], group="distributed")
    """How attention reaches across the context-parallel ranks: "p2p" (ring attention, key/value
    blocks passed round the ranks behind each block's attention), "a2a" (Ulysses all-to-all: heads
    split instead of the sequence; heads and query groups per TP rank must divide by CP) or
    "allgather" (keys and values gathered). One value for every layer, or one per layer."""

    attention_softmax_in_fp32: bool = flag(False, group="mixed precision")
    """With 16-bit activations, compute attention's masking and softmax in fp32 (Megatron's flag)."""

    compile: bool = flag(
        False,
        group="training",
        help="torch.compile each transformer layer (its linear layers stay eager) and, at TP=1, the "
        "loss. A Trident flag: Megatron has none.",
    )
    """Compile each decoder layer with ``torch.compile`` (see ``core.transformer.compile``), and at
    TP=1 the loss; graphs, graph breaks and compile time are reported after the first iteration."""

    compile_backend: CompileBackend = flag("inductor", group="training")
    """The ``torch.compile`` backend of ``--compile``: "inductor" (fused kernels), or "aot_eager" /
    "eager" (Dynamo and AOTAutograd without code generation: quick to start, for debugging)."""

    cuda_graph_impl: CudaGraphImpl = flag("none", group="training")
    """CUDA graphs (Megatron's flag): "local" captures each decoder layer's forward and backward per
    input shape and replays them (``core.transformer.cuda_graphs``); "none" runs eagerly. On a CPU it
    has no effect (the run says so once). Megatron's "transformer_engine" is refused, and
    "full_iteration" is not built yet."""

    cuda_graph_scope: list[str] = flag(
        default_factory=list, group="training", aliases=("--cuda-graph-modules",)
    )
    """What a graph holds (Megatron's flag, ``--cuda-graph-modules`` in its newest releases; its values
    "attn", "mlp", "moe", ... belong to Transformer Engine's graphs, "full_iteration" to a whole-step
    graph not built yet). Empty: whole decoder layers, the only scope "local" captures here."""

    cuda_graph_warmup_steps: int = flag(3, group="training")
    """Eager calls of each layer with an input shape before that shape is captured (Megatron's default
    3 counts iterations; here a microbatch's forward is a call, so capture comes no later)."""

    enable_cuda_graph: bool = flag(
        False,
        group="training",
        help="Megatron's older spelling of --cuda-graph-impl local.",
    )
    """Megatron's older switch: True means ``cuda_graph_impl="local"``."""

    cross_entropy_loss_fusion: bool = flag(False, group="training")
    """Compute the loss from the output layer's logits in their own dtype, a slice of tokens at a time,
    never holding an fp32 copy of them, and write the gradient over them (Megatron's flag; see
    ``core.tensor_parallel.fused_cross_entropy``). Same numbers as without."""

    cross_entropy_fusion_impl: CrossEntropyFusionImpl = flag("native", group="training")
    """How ``--cross-entropy-loss-fusion`` fuses (Megatron's flag; its "te" needs Transformer Engine
    and is refused): "native" keeps the output layer's logits and slices the loss over them; "linear"
    (Megatron's name for the output layer fused into the loss) runs the output layer inside the loss, a
    slice of tokens at a time, so the logits are never held, and recomputes each slice in backward:
    one more output-layer matmul (``core.tensor_parallel.linear_cross_entropy``). It wins over
    ``--compile``'s compiled loss."""

    init_method_std: float = flag(0.02, group="initialization")
    """Std of the normal initialisation; output projections get std / sqrt(2 * num_layers)."""

    perform_initialization: bool = not_a_flag(True)
    """Initialise parameters at construction (off when weights are about to be loaded anyway)."""

    init_model_with_meta_device: bool = flag(False, group="initialization")
    """Build the parameters on the meta device (Megatron's flag): shapes and dtypes, no memory. The
    data-parallel wrapper then gives each rank memory for what it keeps only, bucket by bucket, with
    the values construction would have given (they depend on the seed and the name alone): under
    ``optim_grads_params`` a rank never holds its whole model shard, only its 1/DP shard and the bucket
    it is laying out. Without a wrapper, ``parallelize_gpt`` gives each parameter its memory in place."""

    bf16: bool = flag(False, group="mixed precision")
    """Run in bfloat16: sets ``params_dtype`` and ``pipeline_dtype`` to bfloat16 (losses stay fp32)."""

    recompute_granularity: RecomputeGranularity | None = flag(None, group="training")
    """Activation recomputation: "full" (whole layers), "selective" (core attention) or None."""

    recompute_method: RecomputeMethod | None = flag(None, group="training")
    """With "full": "uniform" checkpoints groups of ``recompute_num_layers`` layers, "block" only the
    first ``recompute_num_layers`` layers of each stage."""

    recompute_num_layers: int | None = flag(None, group="training")
    """Layers per checkpointed group ("uniform") or checkpointed layers per stage ("block")."""

    seed: int = flag(1234, group="initialization")
    """Parameter initialisation seed: with (seed, parameter name) it fixes every full weight."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bf16:
            self.params_dtype = torch.bfloat16
            self.pipeline_dtype = torch.bfloat16
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if isinstance(self.cp_comm_type, str):
            self.cp_comm_type = [self.cp_comm_type]
        if self.enable_cuda_graph and self.cuda_graph_impl == "none":  # Megatron's older spelling
            self.cuda_graph_impl, self.enable_cuda_graph = "local", False
        problems = self.problems()
        if problems:
            raise ProblemsError("TransformerConfig", problems)
        self.moe_layer_freq = parse_moe_layer_freq(
            self.moe_layer_freq
        )  # Megatron's text form is accepted too
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    def problems(self) -> list[Problem]:
        """Every invalid setting, each naming its fields (construction refuses a config with any; the
        command line renders the same problems with its flag names)."""
        sizes = size_problems(self)
        if sizes:
            return sizes
        fp8 = [problem("{text}", text=text) for text in fp8_problems(self)]  # already worded with flags
        subsystems = context_parallel_problems(self) + moe_problems(self) + fp8 + cuda_graph_problems(self)
        return self._choice_problems() + decoder_problems(self) + subsystems

    def _choice_problems(self) -> list[Problem]:
        """Values outside a field's choices (the command line's parser refuses them itself)."""
        return [
            problem(
                f"{{{name}}} must be one of {{choices}}, got {{value!r}}", name, choices=choices, value=value
            )
            for name, choices in (
                ("normalization", NORMALIZATIONS),
                ("position_embedding_type", POSITION_EMBEDDING_TYPES),
            )
            if (value := getattr(self, name)) not in choices
        ]

    def cp_comm_type_of(self, layer_number: int) -> str:
        """The context-parallel attention form of decoder layer ``layer_number`` (0-based, global)."""
        types = self.cp_comm_type
        return types[0] if len(types) == 1 else types[layer_number]

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates."""
        return int(self.kv_channels * self.rotary_percent)

    def padded_vocab_size(self, vocab_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's rule)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-vocab_size // multiple) * multiple

    # -- serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values: dtypes and the activation by name, run-time hooks left out.

        ``TransformerConfig.from_dict(config.to_dict()) == config`` for every config whose activation
        is in ``ACTIVATIONS``; a checkpoint stores this so a model can be rebuilt with no command line.
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in RUNTIME_FIELDS:
                continue
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif f.name == "activation_func":
                names = [name for name, fn in ACTIVATIONS.items() if fn is value]
                if not names:
                    raise ValueError(
                        f"activation_func {getattr(value, '__name__', value)!r} has no name to be saved "
                        f"under; use one of {sorted(ACTIVATIONS)} or add it to ACTIVATIONS"
                    )
                value = names[0]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides: Any) -> TransformerConfig:
        """The config :meth:`to_dict` described, with ``overrides`` applied (e.g. other parallel sizes)."""
        known = {f.name: f for f in fields(cls) if f.name not in RUNTIME_FIELDS}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"TransformerConfig has no field(s) {unknown} (saved by a newer Trident?)")
        kwargs = dict(values) | overrides
        for name in ("params_dtype", "pipeline_dtype"):
            if isinstance(kwargs.get(name), str):
                dtype = getattr(torch, kwargs[name], None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"{name} {kwargs[name]!r} is not a torch dtype")  # noqa: TRY004
                kwargs[name] = dtype
        activation = kwargs.get("activation_func")
        if isinstance(activation, str):
            if activation not in ACTIVATIONS:
                raise ValueError(f"activation_func {activation!r} is not one of {sorted(ACTIVATIONS)}")
            kwargs["activation_func"] = ACTIVATIONS[activation]
        return cls(**kwargs)

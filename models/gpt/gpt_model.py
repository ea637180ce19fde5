"""GPTModel: one pipeline stage (or the whole model) of a GPT-2 or LLaMA style decoder.

A chunk builds only what its stage of the pipeline layout holds: the embedding (``pre_process``),
its decoder layers under their global numbers, and the final norm, output layer and loss
(``post_process``). Names are global (``decoder.layers.{i}...``, ``embedding.word_embeddings.weight``,
``output_layer.weight``), and initialisation depends only on (seed, name), so the same seed gives
the same full model in every TP/PP/VPP split.

Tied embeddings. With the embedding and the output layer in one chunk the output layer uses the
embedding's Parameter. In different chunks of one rank (virtual pipelining with the embedding and
the loss on one rank, as ZBV's V placement always has them) the last chunk borrows the first
chunk's Parameter without registering it, so it is optimised and reduced once. On
different ranks the last stage holds a copy, initialised from the embedding's name; both copies are
marked ``shared_embedding`` and ``finalize_model_grads`` sums their gradients over the embedding
group, so they take identical steps and stay bit-identical.
"""

from __future__ import annotations

import functools

import einops
import torch
import torch.nn.functional as F
from torch import nn

from core import parallel_state
from core.device import current_device
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.layout import EMBEDDING, LOSS, PipelineLayout, even_layout, parse_layout
from core.pipeline_parallel.schedule_rules import schedule_rule
from core.tensor_parallel import (
    ColumnParallelLinear,
    fused_vocab_parallel_cross_entropy,
    tp_rank,
    tp_world_size,
    vocab_parallel_cross_entropy,
)
from core.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from core.transformer.compile import compile_function, mark_sequence_dynamic
from core.transformer.context_parallel import positions_on_this_cp_rank
from core.transformer.inference_context import InferenceContext
from core.transformer.initialization import deferred_init, initialize_by_name, mark_init
from core.transformer.rope import RotaryEmbedding
from core.transformer.transformer_block import TransformerBlock
from core.transformer.transformer_config import TransformerConfig
from models.gpt.embedding import LanguageModelEmbedding

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"


def layout_owner(name: str) -> str | int:
    """The pipeline-layout element that holds parameter ``name``: "E", "L" or its decoder layer's number.

    Checkpoints record it for every tensor, so any other layout can place the tensor.
    """
    if name.startswith("embedding."):
        return EMBEDDING
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return LOSS
    raise ValueError(f"parameter {name!r} belongs to no pipeline-layout element (E, t or L)")


def expert_of(name: str) -> int | None:
    """The global index of the MoE expert that tensor ``name`` belongs to (None for any other).

    An expert's tensors are named ``decoder.layers.{layer}.mlp.experts.local_experts.{expert}....`` in
    every expert-parallel split (slices of the stacked parameters, ``core.transformer.initialization.
    unstacked``); checkpoints record the index to place each on its EP rank.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "local_experts" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def pipeline_layout(config: TransformerConfig) -> PipelineLayout:
    """The layout the model is split by: ``config.pipeline_model_parallel_layout`` or an even split.

    Under the ZBV schedule the stages are dealt to ranks in a V (stage ``s >= pp`` on rank
    ``2 pp - 1 - s``), which puts the first and the last stage on rank 0. A layout is a function
    of five config fields and immutable: each one is built once and shared by every chunk asking.
    """
    return _layout(
        config.num_layers,
        config.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        config.pipeline_model_parallel_layout,
        schedule_rule(config.pipeline_schedule).placement,
    )


@functools.lru_cache(maxsize=64)
def _layout(num_layers: int, pp: int, vpp: int | None, text: str | None, placement: str) -> PipelineLayout:
    if text is None:
        return even_layout(num_layers, pp, vpp, placement=placement)
    layout = parse_layout(text, pp, num_layers=num_layers, mtp_num_layers=0, placement=placement)
    if layout.vpp_size != (vpp or 1):
        raise ValueError(
            f"pipeline layout '{text}' has {layout.vpp_size} virtual stages per rank but "
            f"virtual_pipeline_model_parallel_size is {vpp}"
        )
    return layout


def pipeline_rank(config: TransformerConfig, groups: ParallelGroups | None) -> int:
    """This process's pipeline rank in ``groups`` (0 without groups), checked against the config."""
    if groups is None:
        return 0
    size = groups.size("pp")
    if size != config.pipeline_model_parallel_size:
        raise ValueError(
            f"the pipeline group has {size} ranks but config.pipeline_model_parallel_size is "
            f"{config.pipeline_model_parallel_size}"
        )
    return groups.rank_in("pp")


def _rank_of(layout: PipelineLayout, symbol: str) -> int:
    stage = next(s for s, layers in enumerate(layout.stages) if symbol in layers)
    return layout.stage_placement.rank(stage)


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of whole-vocabulary logits ``[s, b, V]`` per token, in fp32: what ``--compile`` compiles
    at TP=1, where inductor fuses the fp32 arithmetic into its kernels instead of keeping fp32 copies."""
    flat = logits.float().flatten(0, -2)
    return F.cross_entropy(flat, labels.flatten(), reduction="none").view(labels.shape)


@functools.cache
def compiled_cross_entropy(backend: str):
    """:func:`per_token_cross_entropy` compiled with ``backend`` (one compiled function per process)."""
    return compile_function(per_token_cross_entropy, backend)


class GPTModel(nn.Module):
    """Megatron's GPTModel contract: ``forward(input_ids, position_ids, attention_mask, labels)``.

    ``shared_embedding_weight`` is only for a tied output layer whose embedding lives in an earlier
    chunk of the same rank; :func:`models.gpt.parallelize.parallelize_gpt` passes it, and the process
    groups as ``pg_collection`` (Megatron's keyword; default: ``parallel_state``'s, when set up), which
    give the chunk its pipeline rank and its context- and expert-parallel groups.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        *,
        shared_embedding_weight: nn.Parameter | None = None,
        pg_collection: ParallelGroups | None = None,
    ) -> None:
        super().__init__()
        groups = parallel_state.groups_or_default(pg_collection)
        self.config = config
        self.vp_stage = vp_stage
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.padded_vocab_size = config.padded_vocab_size(vocab_size)
        self.layout = pipeline_layout(config)
        self.pp_rank = pipeline_rank(config, groups)
        self.cp_rank = groups.rank_in("cp") if groups is not None else 0
        self.tp_group = groups.tp if groups is not None else None  # None: a process of one
        self._check_stage(pre_process, post_process, vp_stage)
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.input_tensor: torch.Tensor | None = None
        self._check_tied_placement()
        self.embedding = self._build_embedding() if pre_process else None
        self.rotary_pos_emb = (
            RotaryEmbedding(
                config.rotary_dim,
                config.rotary_base,
                config.rope_scaling_factor if config.rope_scaling else None,
                device=current_device(),
            )
            if config.position_embedding_type == "rope"
            else None
        )
        self.decoder = TransformerBlock(
            config, self.layout.decoder_layers(self.pp_rank, vp_stage), post_process, groups
        )
        self._borrowed_weight: list[nn.Parameter] = []  # a list, so that nn.Module does not register it
        self.output_layer = self._build_output_layer(shared_embedding_weight) if post_process else None
        if pre_process and self.share_embeddings_and_output_weights and self._tied_across_ranks():
            self.embedding.word_embeddings.weight.shared_embedding = True  # the first stage's copy
        for layer in (self.embedding and self.embedding.word_embeddings, self.output_layer):
            if layer is not None and layer.weight is not None:  # --decoupled-lr applies to these two
                layer.weight.is_embedding_or_output_parameter = True
        if config.perform_initialization:
            initialize_by_name(self, config, self.tp_group)

    def _check_tied_placement(self) -> None:
        """Tied embeddings on two ranks stay in sync over the embedding group: first and last rank only."""
        placement = (_rank_of(self.layout, EMBEDDING), _rank_of(self.layout, LOSS))
        if (
            self.share_embeddings_and_output_weights
            and self._tied_across_ranks()
            and placement != (0, self.layout.pp_size - 1)
        ):
            raise ValueError(
                f"tied embeddings need the embedding on the first pipeline rank and the loss on the "
                f"last (the embedding group keeps them in sync), but the layout puts them on ranks "
                f"{placement}; fix the pipeline layout or set untie_embeddings_and_output_weights=True"
            )

    def _check_stage(self, pre_process: bool, post_process: bool, vp_stage: int | None) -> None:
        try:
            self.layout.stage_index(self.pp_rank, vp_stage)
        except ValueError as err:
            raise ValueError(
                f"GPTModel(vp_stage={vp_stage}) on pipeline rank {self.pp_rank}: {err}"
            ) from None
        for flag, value, expected, what in (
            ("pre_process", pre_process, self.layout.has_embedding(self.pp_rank, vp_stage), "embedding"),
            ("post_process", post_process, self.layout.has_loss(self.pp_rank, vp_stage), "loss"),
        ):
            if value != expected:
                raise ValueError(
                    f"GPTModel({flag}={value}) disagrees with the pipeline layout: stage (pp_rank {self.pp_rank}, "
                    f"vp_stage {vp_stage}) {'holds' if expected else 'does not hold'} the {what}; pass "
                    f"{flag}={expected} or use parallelize_gpt"
                )

    def _build_embedding(self) -> LanguageModelEmbedding:
        fuse = self._embedding_fuses_accumulation()
        embedding = LanguageModelEmbedding(
            self.config,
            self.vocab_size,
            self.padded_vocab_size,
            self.max_sequence_length,
            tp_group=self.tp_group,
            gradient_accumulation_fusion=fuse,
        )
        if fuse and self._tied_in_this_chunk():
            # The output layer's fused use accumulates; the embedding's, autograd's last, reports.
            embedding.word_embeddings.weight.grad_reported_by_embedding = True
        return embedding

    def _tied_in_this_chunk(self) -> bool:
        """Whether this chunk's output layer borrows this chunk's word embedding."""
        return self.share_embeddings_and_output_weights and self.pre_process and self.post_process

    def _embedding_fuses_accumulation(self) -> bool:
        """Whether the word embedding's gradient goes straight into ``main_grad``: under
        ``gradient_accumulation_fusion``, unless a later chunk of this rank borrows the weight for its
        output layer (that chunk's backward adds its gradient through autograd)."""
        lent = (
            self.share_embeddings_and_output_weights
            and not self._tied_across_ranks()
            and not self.post_process
        )
        return self.pre_process and self.config.gradient_accumulation_fusion and not lent

    def _tied_across_ranks(self) -> bool:
        """Whether the embedding and the output layer live on different pipeline ranks."""
        return _rank_of(self.layout, EMBEDDING) != _rank_of(self.layout, LOSS)

    def _build_output_layer(self, shared_weight: nn.Parameter | None) -> ColumnParallelLinear:
        config, tied = self.config, self.share_embeddings_and_output_weights
        same_rank = not self._tied_across_ranks()
        borrow = tied and same_rank and not self.pre_process
        if borrow and shared_weight is None:
            raise ValueError(
                "tied embeddings: the embedding is in an earlier chunk of this rank; pass "
                f"shared_embedding_weight=<that chunk>.{WORD_EMBEDDINGS} or use parallelize_gpt"
            )
        layer = ColumnParallelLinear(
            config.hidden_size,
            self.padded_vocab_size,
            config=config,
            init_method=deferred_init,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=tied and same_rank,
            perform_initialization=False,
            tp_group=self.tp_group,
        )
        if borrow:
            self._borrowed_weight.append(shared_weight)
        if layer.weight is not None:
            mark_init(
                layer.weight, "normal", valid_rows=self.vocab_size, name=WORD_EMBEDDINGS if tied else None
            )
            if tied:  # the last stage's copy of the first stage's embedding
                layer.weight.shared_embedding = True
        return layer

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None] | torch.Tensor | None) -> None:
        """The schedule hands a non-first stage its input (``[s, b, h]``) here before each forward."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"set_input_tensor takes a list of one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word embedding on the first stage, else the output weight (Megatron's accessor)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self._output_weight() if self.post_process else None

    def _output_weight(self) -> torch.Tensor:
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        if self._borrowed_weight:
            return self._borrowed_weight[0]
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """Hidden ``[s, b, h]`` from a non-last stage; on the last, per-token loss ``[b, s]`` (fp32) given
        ``labels``, else logits ``[b, s, padded_vocab / tp]`` (padding entries are -inf).

        ``attention_mask`` is Megatron's boolean "True = masked" mask; causality is always applied.
        ``inference_context`` (generation): the input holds only tokens after the cached ones, whose
        positions default to follow them; the caller advances the context after the last stage.
        """
        if inference_context is not None and position_ids is None:
            position_ids = self._cached_positions(input_ids, inference_context)
        learned_positions = self.pre_process and self.embedding.position_embeddings is not None
        if learned_positions and position_ids is None and self.config.context_parallel_size > 1:
            position_ids = self._context_parallel_positions(input_ids.shape[1], input_ids.device).unsqueeze(0)
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        elif self.input_tensor is None:
            raise RuntimeError(
                "GPTModel without pre_process got no input: call set_input_tensor([hidden]) first"
            )
        else:
            hidden = self.input_tensor
        hidden = self.decoder(
            hidden, self._rotary(hidden, position_ids), attention_mask, inference_context=inference_context
        )
        if not self.post_process:
            return hidden
        if (
            labels is not None
            and self.config.cross_entropy_loss_fusion
            and self.config.cross_entropy_fusion_impl == "linear"
        ):
            return self._linear_cross_entropy(hidden, labels)
        logits, _ = self.output_layer(hidden, weight=self._output_weight())
        logits = self._mask_padding(logits)
        if labels is None:
            return einops.rearrange(logits, "s b v -> b s v").contiguous()
        labels = einops.rearrange(labels, "b s -> s b")
        if self.config.compile and tp_world_size(self.tp_group) == 1:  # one rank holds the whole vocabulary
            if self.config.variable_seq_lengths:
                mark_sequence_dynamic(logits, labels)
            loss = compiled_cross_entropy(self.config.compile_backend)(logits, labels)
        elif self.config.cross_entropy_loss_fusion:
            loss = fused_vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group)
        else:
            loss = vocab_parallel_cross_entropy(logits.float(), labels, tp_group=self.tp_group)
        return einops.rearrange(loss, "s b -> b s").contiguous()

    def _cached_positions(self, input_ids: torch.Tensor | None, context: InferenceContext) -> torch.Tensor:
        """Positions ``[1, s]`` of the new tokens, which follow the ones ``context`` holds."""
        if self.config.sequence_parallel:
            raise ValueError("generation with an inference_context needs sequence_parallel=False")
        if self.pre_process:
            return context.positions(input_ids.shape[1], input_ids.device).unsqueeze(0)
        if self.input_tensor is None:
            raise RuntimeError(
                "GPTModel without pre_process got no input: call set_input_tensor([hidden]) first"
            )
        return context.positions(self.input_tensor.shape[0], self.input_tensor.device).unsqueeze(0)

    def _rotary(
        self, hidden: torch.Tensor, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.rotary_pos_emb is None:
            return None
        if position_ids is None:  # the usual case: cached tables, in the activations' dtype
            seq = hidden.shape[0] * (
                self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
            )
            cp = self.config.context_parallel_size
            cos, sin = self.rotary_pos_emb.for_length(seq * cp, hidden.dtype, hidden.device)
            if cp == 1:
                return cos, sin
            held = self._context_parallel_positions(seq, hidden.device)  # the chunks this CP rank holds
            return cos.index_select(0, held), sin.index_select(0, held)
        cos, sin = self.rotary_pos_emb(position_ids)
        return cos.to(hidden.dtype), sin.to(hidden.dtype)

    def _context_parallel_positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """Positions ``[local_length]`` of this rank's tokens: ``0..s-1`` without context parallelism,
        else those of the two chunks this CP rank holds."""
        cp = self.config.context_parallel_size
        if cp == 1:
            return torch.arange(local_length, device=device)
        return positions_on_this_cp_rank(local_length * cp, cp, self.cp_rank, device=device)

    def _linear_cross_entropy(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` with the output layer inside the loss: the logits are never held
        (``--cross-entropy-fusion-impl linear``)."""
        layer, weight = self.output_layer, self._output_weight()
        loss = linear_cross_entropy(
            layer.whole_input(hidden),
            weight,
            einops.rearrange(labels, "b s -> s b"),
            vocab_size=self.vocab_size,
            tp_group=layer.tp_group,
            accumulate_into_main_grad=layer.fuses_accumulation_of(weight),
        )
        return einops.rearrange(loss, "s b -> b s").contiguous()

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padded vocabulary entries get -inf, so they take no probability mass and no gradient."""
        local = logits.shape[-1]
        start = tp_rank(self.tp_group) * local
        if start + local <= self.vocab_size:
            return logits
        padding = torch.arange(start, start + local, device=logits.device) >= self.vocab_size
        return logits.masked_fill(padding, float("-inf"))

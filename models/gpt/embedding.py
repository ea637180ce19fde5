"""The first stage's input layer: vocabulary-parallel word embedding, optional learned positions, dropout.

Output is ``[s, b, h]`` (Megatron's activation layout), or ``[s / tp, b, h]`` under sequence
parallelism. Without learned positions the word embedding reduce-scatters straight into the
sequence-parallel layout; with them the positions must be added to whole sequences first, so the
embedding all-reduces, adds, and then keeps this rank's slice of the sequence (as Megatron does).
"""

from __future__ import annotations

import einops
import torch
from torch import nn
from torch.distributed import ProcessGroup

from core.device import param_device
from core.tensor_parallel import VocabParallelEmbedding, scatter_to_sequence_parallel_region
from core.transformer.dropout import dropout
from core.transformer.initialization import deferred_init, mark_init
from core.transformer.transformer_config import TransformerConfig


class LanguageModelEmbedding(nn.Module):
    """``word_embeddings`` (rows split over TP, ``padded_vocab_size`` rows) and ``position_embeddings``.

    Only the first ``vocab_size`` rows are real: they are initialised from the unpadded shape and
    the padding rows start at zero (see ``core.transformer.initialization``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        padded_vocab_size: int,
        max_sequence_length: int,
        *,
        tp_group: ProcessGroup | None = None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        """``tp_group``: the tensor-parallel group the rows are split over (None: ``parallel_state``'s).
        ``gradient_accumulation_fusion``: the word embedding's gradient goes straight into its
        ``main_grad`` (see :class:`~core.tensor_parallel.VocabParallelEmbedding`)."""
        super().__init__()
        self.config = config
        self.learned_positions = config.position_embedding_type == "learned_absolute"
        self.sequence_parallel = config.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size,
            config.hidden_size,
            init_method=deferred_init,
            config=config,
            reduce_scatter_embeddings=self.sequence_parallel and not self.learned_positions,
            perform_initialization=False,
            tp_group=tp_group,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
        )
        mark_init(self.word_embeddings.weight, "normal", valid_rows=vocab_size)
        if self.learned_positions:
            self.position_embeddings = nn.Embedding(
                max_sequence_length,
                config.hidden_size,
                device=param_device(config),
                dtype=config.params_dtype,
            )
            mark_init(self.position_embeddings.weight, "normal")
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[b, s]`` (and positions ``[b, s]``, default ``0..s-1``) -> ``[s, b, h]``."""
        embedded = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            embedded = embedded + self.position_embeddings(position_ids)
        if not self.word_embeddings.reduce_scatter_embeddings:
            embedded = einops.rearrange(embedded, "b s h -> s b h").contiguous()
            if self.sequence_parallel:
                embedded = scatter_to_sequence_parallel_region(embedded, self.word_embeddings.tp_group)
        # Under sequence parallelism each rank holds other tokens: independent dropout masks.
        return dropout(embedded, self.config.hidden_dropout, self.training, sharded=self.sequence_parallel)

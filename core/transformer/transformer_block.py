"""The stack of decoder layers one pipeline stage owns, with full-layer recomputation and final norm."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from core.device import current_device
from core.parallel_state import ParallelGroups
from core.pipeline_parallel.schedule_rules import schedule_rule
from core.tensor_parallel.fp8 import compile_fp8_casts
from core.transformer.attention import Rotary
from core.transformer.compile import compile_layer, mark_sequence_dynamic
from core.transformer.cuda_graphs import graph_layers
from core.transformer.inference_context import InferenceContext
from core.transformer.norms import build_norm
from core.transformer.recompute import checkpoint
from core.transformer.transformer_config import TransformerConfig
from core.transformer.transformer_layer import TransformerLayer


class TransformerBlock(nn.Module):
    """Decoder layers ``layer_numbers`` (global indices) and, on the last stage, ``final_layernorm``.

    Layers live in a ModuleDict keyed by their global index, so parameter names read
    ``layers.{global index}...`` in every split and a name always means one weight.
    ``pg_collection``: the model's process groups, handed to each layer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_numbers: Sequence[int],
        post_process: bool,
        pg_collection: ParallelGroups | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, i, pg_collection) for i in layer_numbers}
        )
        self.final_layernorm = build_norm(config.hidden_size, config) if post_process else None
        self.dynamic_sequence = config.compile and config.variable_seq_lengths
        if config.compile:
            if config.fp8 is not None:
                compile_fp8_casts(self.layers.values(), config.compile_backend)
            for layer in self.layers.values():
                compile_layer(
                    layer,
                    config.compile_backend,
                    split_backward=schedule_rule(config.pipeline_schedule).split_backward,
                    dynamic_sequence=self.dynamic_sequence,
                )
        self.cuda_graphs = graph_layers(self.layers.values(), config, current_device())

    def _segments(self) -> list[tuple[list[nn.Module], bool]]:
        """Consecutive layer runs and whether each is checkpointed as one unit (Megatron's full recompute).

        "uniform": groups of ``recompute_num_layers`` layers, only each group's input kept;
        "block": the first ``recompute_num_layers`` layers checkpointed one by one, the rest not.
        """
        layers = list(self.layers.values())
        config = self.config
        if config.recompute_granularity != "full":
            return [(layers, False)] if layers else []
        count = config.recompute_num_layers
        if config.recompute_method == "uniform":
            return [(layers[i : i + count], True) for i in range(0, len(layers), count)]
        checkpointed = [([layer], True) for layer in layers[:count]]
        rest = layers[count:]
        return checkpointed + ([(rest, False)] if rest else [])

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary = None,
        attention_mask: torch.Tensor | None = None,
        *,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """``inference_context``: generation with a key/value cache (no recomputation: no backward)."""
        if inference_context is not None:
            for layer in self.layers.values():
                hidden = layer(hidden, rotary, attention_mask, inference_context=inference_context)
            return hidden if self.final_layernorm is None else self.final_layernorm(hidden)
        for layers, recompute in self._segments():

            def run(x: torch.Tensor, rot: Rotary, mask: torch.Tensor | None, layers=layers) -> torch.Tensor:
                for layer in layers:
                    if self.dynamic_sequence:  # each layer's input is a new tensor: mark every one
                        mark_sequence_dynamic(x, *(rot or ()))
                    x = layer(x, rot, mask)
                return x

            hidden = (
                checkpoint(run, hidden, rotary, attention_mask)
                if recompute
                else run(hidden, rotary, attention_mask)
            )
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden

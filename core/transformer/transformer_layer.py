"""One pre-norm decoder layer: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``."""

from __future__ import annotations

import torch
from torch import nn

from core.parallel_state import ParallelGroups
from core.tensor_parallel.fp8 import Fp8Recipe
from core.transformer.attention import Rotary, SelfAttention
from core.transformer.dropout import dropout
from core.transformer.inference_context import InferenceContext
from core.transformer.mlp import MLP
from core.transformer.moe.groups import MoEGroups
from core.transformer.moe.moe_layer import MoELayer
from core.transformer.norms import build_norm
from core.transformer.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    """Megatron's submodule names (``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm``, ``mlp``).

    ``mlp`` is an :class:`~core.transformer.moe.moe_layer.MoELayer` on the config's MoE layers.

    ``layer_number`` is the layer's global 0-based index in the whole model, whatever stage builds it.
    """

    def __init__(
        self, config: TransformerConfig, layer_number: int, pg_collection: ParallelGroups | None = None
    ) -> None:
        """``pg_collection``: the model's process groups (tensor, context and expert parallelism talk
        over theirs; None: ``parallel_state``'s, or a process of one)."""
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config.hidden_size, config)
        cp_group, tp_group = (
            (pg_collection.cp, pg_collection.tp) if pg_collection is not None else (None, None)
        )
        self.self_attention = SelfAttention(config, layer_number, cp_group, tp_group)
        self.pre_mlp_layernorm = build_norm(config.hidden_size, config)
        self.mlp = self._mlp(config, layer_number, pg_collection)
        self.fp8_kept_out = self._enable_fp8(config, layer_number)

    @staticmethod
    def _mlp(config: TransformerConfig, layer_number: int, groups: ParallelGroups | None) -> nn.Module:
        if not config.is_moe_layer(layer_number):
            return MLP(config, tp_group=groups.tp if groups is not None else None)
        moe_groups = MoEGroups.of(groups, config.expert_model_parallel_size) if groups is not None else None
        return MoELayer(config, layer_number, moe_groups)

    def _enable_fp8(self, config: TransformerConfig, layer_number: int) -> dict[str, str]:
        """The layer's tensor-parallel linear layers in FP8 when the config asks for it for this layer;
        returns the ones left in high precision, each with why (``--fp8-format`` off: empty)."""
        if not config.layer_in_fp8(layer_number):
            return {}
        recipe = Fp8Recipe.from_config(config)
        kept_out = {}
        for name, module in self.named_modules():
            if hasattr(module, "enable_fp8"):
                why = module.enable_fp8(recipe)
                if why is not None:
                    kept_out[name] = why
        return kept_out

    def _residual_dropout(self, branch: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism each rank holds other tokens: independent masks (private stream).
        return dropout(
            branch, self.config.hidden_dropout, self.training, sharded=self.config.sequence_parallel
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary = None,
        attention_mask: torch.Tensor | None = None,
        *,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``[s / tp, b, h]`` both ways under sequence parallelism)."""
        attended = self.self_attention(
            self.input_layernorm(hidden), rotary, attention_mask, inference_context=inference_context
        )
        hidden = hidden + self._residual_dropout(attended)
        return hidden + self._residual_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))

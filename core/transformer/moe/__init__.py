"""Mixture of experts (Megatron's ``megatron.core.transformer.moe``): router, dispatchers, experts, layer."""

from core.transformer.moe.experts import ExpertMLP, Experts
from core.transformer.moe.groups import MoEGroups
from core.transformer.moe.moe_config import MoEConfig, moe_problems
from core.transformer.moe.moe_layer import MoELayer, SharedExpertMLP
from core.transformer.moe.moe_logging import moe_loss_names, reduce_moe_metrics
from core.transformer.moe.router import TopKRouter
from core.transformer.moe.token_dispatcher import (
    AllGatherTokenDispatcher,
    AllToAllTokenDispatcher,
    build_token_dispatcher,
)

__all__ = [
    "AllGatherTokenDispatcher",
    "AllToAllTokenDispatcher",
    "ExpertMLP",
    "Experts",
    "MoEConfig",
    "MoEGroups",
    "MoELayer",
    "SharedExpertMLP",
    "TopKRouter",
    "build_token_dispatcher",
    "moe_loss_names",
    "moe_problems",
    "reduce_moe_metrics",
]

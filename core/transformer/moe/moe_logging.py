"""The auxiliary losses for the log: per layer, summed over microbatches and ranks as Megatron does.

Each router accumulates its losses (without their coefficients) over the microbatches it runs
(:attr:`TopKRouter.metrics`). :func:`reduce_moe_metrics` puts them in a ``[losses, layers]`` table on
every rank (zeros for the layers another pipeline stage holds), sums it over the pipeline, sums
each sequence's shares over tensor x context parallelism (the z-loss, a mean, is averaged
instead), averages over data parallelism and divides by the microbatch count: Megatron's
``load_balancing_loss`` of each layer. The logged value is the mean over the MoE layers, as in
Megatron's ``MoEMetricsTracker``. It resets the routers' accumulators.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from core.device import current_device
from core.parallel_state import ParallelGroups
from core.transformer.moe.router import AUX_LOSS_NAMES, TopKRouter


def moe_loss_names(config) -> list[str]:
    """The losses a config's routers record (Megatron's names), in a fixed order."""
    if config.num_moe_experts is None:
        return []
    names = []
    balancing = config.moe_router_load_balancing_type
    if balancing in AUX_LOSS_NAMES and config.moe_aux_loss_coeff > 0:
        names.append(AUX_LOSS_NAMES[balancing])
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def _routers(chunks: Iterable[nn.Module]) -> list[TopKRouter]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def reduce_moe_metrics(
    chunks: Iterable[nn.Module], config, num_microbatches: int, groups: ParallelGroups | None = None
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``({name: mean over MoE layers}, {name: per-layer values})`` of this step's auxiliary losses.

    A collective over the pipeline, tensor x context and data-parallel groups: every rank calls it,
    including pipeline stages without an MoE layer. ``num_microbatches`` counts the microbatches the
    accumulated values cover; ``groups``: the model's process groups (None: one process). One read
    from the device (:func:`reduce_moe_metrics_on_device` makes none).
    """
    summary, per_layer = reduce_moe_metrics_on_device(chunks, config, num_microbatches, groups)
    if not summary:
        return {}, {}
    names = list(summary)
    values = torch.cat([torch.stack(list(summary.values())), *per_layer.values()]).tolist()
    layers = config.num_layers
    return (
        dict(zip(names, values[: len(names)])),
        {
            name: values[len(names) + i * layers : len(names) + (i + 1) * layers]
            for i, name in enumerate(names)
        },
    )


def reduce_moe_metrics_on_device(
    chunks: Iterable[nn.Module], config, num_microbatches: int, groups: ParallelGroups | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`reduce_moe_metrics` as device tensors: a 0-dim mean per name, a ``[num_layers]`` row per name."""
    names = moe_loss_names(config)
    if not names:
        return {}, {}
    table = torch.zeros((len(names), config.num_layers), dtype=torch.float32, device=current_device())
    for router in _routers(chunks):
        for row, name in enumerate(names):
            if name in router.metrics:
                value = router.metrics[name]
                table[row, router.layer_number] += (
                    value if value.device == table.device else value.to(table.device)
                )
        router.metrics.clear()
    if groups is not None:
        _reduce_over_ranks(table, names, groups)
    table /= num_microbatches
    moe_layers = sum(config.moe_layer_pattern(config.num_layers))
    summary = {name: table[row].sum() / moe_layers for row, name in enumerate(names)}
    per_layer = {name: table[row] for row, name in enumerate(names)}
    return summary, per_layer


def _reduce_over_ranks(table: torch.Tensor, names: list[str], groups: ParallelGroups) -> None:
    for group in (groups.pp, groups.tp_cp):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
    if "z_loss" in names:  # a mean over the sequence: averaged, not summed, over its shards
        table[names.index("z_loss")] /= groups.size("tp_cp")
    if groups.size("dp") > 1:
        dist.all_reduce(table, group=groups.dp)
        table /= groups.size("dp")

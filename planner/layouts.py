"""Layout strings that balance the pipeline: the embedding and the loss counted as the work they are.

With a 128K vocabulary the output layer and its cross-entropy cost as much as two or three decoder
layers, and the embedding holds a large weight, so an even split of the decoder layers leaves the
last stage the slowest. :func:`balanced_layout` cuts ``[E, t x L, L]`` into ``pp x vpp`` contiguous
stages minimising the most expensive stage (then the busiest rank), which is what sets the pace of
every schedule here; stages may be uneven or empty. Where the decoder layers do not all cost the same
(``--first-last-layers-bf16``: the 16-bit layers at either end cost more than the FP8 ones) each
layer counts at its own cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.pipeline_parallel.layout import DECODER, EMBEDDING, LOSS, PipelineLayout

__all__ = ["balanced_layout", "stage_layer_counts", "uneven_layer_counts"]


def _capacities(limit: float, stages: int, layer: float, embedding: float, loss: float) -> list[int]:
    """Most decoder layers each stage can take without costing more than ``limit`` (-1: impossible)."""
    caps = []
    for s in range(stages):
        extra = (embedding if s == 0 else 0.0) + (loss if s == stages - 1 else 0.0)
        room = limit - extra
        caps.append(-1 if room < -1e-12 else int(room / layer + 1e-9) if layer > 0 else 10**9)
    return caps


def _front_filled(costs: Sequence[float], stages: int, limit: float, embedding: float, loss: float):
    """Layers per stage, each stage taking the next layers while it costs at most ``limit``; None if
    some are left over."""
    counts, at = [], 0
    for s in range(stages):
        room = limit - (embedding if s == 0 else 0.0) - (loss if s == stages - 1 else 0.0)
        n = 0
        while at < len(costs) and costs[at] <= room + 1e-12 * max(1.0, limit):
            room, at, n = room - costs[at], at + 1, n + 1
        counts.append(n)
    return counts if at == len(costs) else None


def uneven_layer_counts(costs: Sequence[float], stages: int, embedding: float = 0.0, loss: float = 0.0):
    """Decoder layers per stage minimising the largest stage cost when layer ``i`` costs ``costs[i]``:
    the least limit (bisected to a part in 10^9) at which filling the stages front to back places
    every layer."""
    low, high = 0.0, sum(costs) + embedding + loss
    for _ in range(100):
        if high - low <= 1e-9 * high:
            break
        middle = (low + high) / 2
        low, high = (low, middle) if _front_filled(costs, stages, middle, embedding, loss) else (middle, high)
    return _front_filled(costs, stages, high, embedding, loss)


def stage_layer_counts(
    num_layers: int, stages: int, layer: float, embedding: float = 0.0, loss: float = 0.0
) -> list[int]:
    """Decoder layers per stage minimising the largest stage cost ``n * layer (+ embedding, + loss)``.

    Among the splits reaching that minimum, the layers left over are taken off the most expensive
    stages first, so the costs end up as even as whole layers allow.
    """
    if stages == 1:
        return [num_layers]
    if layer <= 0:
        base, extra = divmod(num_layers, stages)
        return [base + (s < extra) for s in range(stages)]
    limits = sorted(
        {
            k * layer + offset
            for k in range(num_layers + 1)
            for offset in (0.0, embedding, loss, embedding + loss)
        }
    )
    for limit in limits:
        caps = _capacities(limit, stages, layer, embedding, loss)
        if min(caps) >= 0 and sum(caps) >= num_layers:
            break
    counts = caps
    cost = [
        counts[s] * layer + (embedding if s == 0 else 0.0) + (loss if s == stages - 1 else 0.0)
        for s in range(stages)
    ]
    for _ in range(sum(counts) - num_layers):  # the surplus comes off the dearest (then earliest) stages
        s = max((i for i in range(stages) if counts[i] > 0), key=lambda i: (cost[i], counts[i], -i))
        counts[s] -= 1
        cost[s] -= layer
    return counts


def balanced_layout(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    *,
    layer: float,
    embedding: float = 0.0,
    loss: float = 0.0,
    placement: str = "loop",
    costs: Sequence[float] | None = None,
) -> PipelineLayout:
    """The layout of :func:`stage_layer_counts` for ``pp x vpp`` stages (costs: forward + backward);
    with ``costs`` (each decoder layer's, where they differ) that of :func:`uneven_layer_counts`."""
    if costs is not None and len(set(costs)) > 1:
        counts = uneven_layer_counts(costs, pp * vpp, embedding, loss)
    else:
        counts = stage_layer_counts(num_layers, pp * vpp, layer, embedding, loss)
    stages = [[DECODER] * n for n in counts]
    stages[0].insert(0, EMBEDDING)
    stages[-1].append(LOSS)
    return PipelineLayout(tuple(tuple(s) for s in stages), pp, placement)

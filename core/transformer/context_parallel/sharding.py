"""Which tokens each context-parallel rank holds: Megatron's causal load balancing.

Under a causal mask the last tokens of a sequence attend to everything before them and the first
tokens to almost nothing, so cutting the sequence into ``N`` consecutive pieces would give the last
CP rank ``2N - 1`` times the attention work of the first. Megatron cuts it into ``2N`` chunks instead
and gives rank ``i`` chunks ``i`` and ``2N - 1 - i``: one cheap chunk and one dear one, the same work
on every rank. Each rank's batch is cut by :func:`get_batch_on_this_cp_rank` (the one function the
data path uses), and the model places its tokens with :func:`positions_on_this_cp_rank`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from core import parallel_state as ps


def held_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the sequence's ``2 * cp_size`` chunks that CP rank ``cp_rank`` holds, in its order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def chunk_order(cp_size: int) -> list[int]:
    """The chunks of every CP rank concatenated in rank order (what an all-gather over CP yields)."""
    return [chunk for rank in range(cp_size) for chunk in held_chunks(rank, cp_size)]


def check_divisible(seq_length: int, cp_size: int) -> None:
    """The sequence must cut into ``2 * cp_size`` equal chunks."""
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_length} is not divisible by 2 x context_parallel_size "
            f"({2 * cp_size}): the causal load balancing cuts it into that many equal chunks"
        )


def positions_on_this_cp_rank(
    seq_length: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Positions ``[seq_length / cp_size]`` of the tokens CP rank ``cp_rank`` holds, in its order.

    Rotary and learned position embeddings take these, so a rank's tokens are placed where they sit
    in the whole sequence.
    """
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    return torch.cat(
        [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in held_chunks(cp_rank, cp_size)]
    )


def slice_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``seq_dim`` (a copy, contiguous)."""
    seq = tensor.shape[seq_dim]
    check_divisible(seq, cp_size)
    chunks = tensor.view(
        *tensor.shape[:seq_dim], 2 * cp_size, seq // (2 * cp_size), *tensor.shape[seq_dim + 1 :]
    )
    index = torch.tensor(held_chunks(cp_rank, cp_size), device=tensor.device)
    mine = chunks.index_select(seq_dim, index)
    return mine.reshape(*tensor.shape[:seq_dim], -1, *tensor.shape[seq_dim + 1 :])


def get_batch_on_this_cp_rank(
    batch: Mapping[str, torch.Tensor | None], *, cp_size: int | None = None, cp_rank: int | None = None
) -> dict[str, torch.Tensor | None]:
    """This CP rank's part of a batch of ``[b, s]`` tensors (Megatron's function of the same name).

    Every tensor is cut along the sequence (dimension 1; dimension 2 for an ``attention_mask``
    ``[b, 1, s, s]``, whose query rows are cut as Megatron does); None values pass through. The sizes
    default to this process's CP group; with ``cp_size == 1`` the batch is returned as it is.
    """
    if cp_size is None or cp_rank is None:
        cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if cp_size == 1:
        return dict(batch)
    return {
        key: None
        if value is None
        else slice_sequence(value, cp_size, cp_rank, seq_dim=2 if key == "attention_mask" else 1)
        for key, value in batch.items()
    }


def gather_order_index(cp_size: int, chunk: int, device: torch.device | None = None) -> torch.Tensor:
    """Index that puts a sequence gathered over CP (rank order, :func:`chunk_order`) in natural order."""
    order = torch.tensor(chunk_order(cp_size), device=device)
    inverse = torch.argsort(order)
    return (inverse[:, None] * chunk + torch.arange(chunk, device=device)).reshape(-1)

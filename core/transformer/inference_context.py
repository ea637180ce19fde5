"""The key/value cache of incremental decoding, handed to the model as an explicit argument.

Generation runs the prompt through the model once (prefill), then one new token per step. Each
attention layer keeps the keys and values of every position it has seen, so a step computes only
the new token's query, key and value and attends over the cache; nothing before it is recomputed.

The names are Megatron's (``inference_context``, ``max_batch_size``, ``max_sequence_length``,
``sequence_len_offset``). There is no global: the caller builds one context per generation and
passes it to ``GPTModel.forward(..., inference_context=ctx)``, which hands it down to every layer.
Every layer writes its keys at the same ``sequence_len_offset``; the caller moves the offset on with
:meth:`InferenceContext.advance` after the whole model has seen the new tokens.
"""

from __future__ import annotations

import torch


class InferenceContext:
    """Cached keys and values ``[batch, key/value groups, positions, head dim]`` per decoder layer.

    Keys are cached after RoPE (positions are absolute) and before grouped-query heads are repeated,
    so the cache holds ``num_query_groups / tp`` heads per layer. Buffers are allocated on a layer's
    first use, in that layer's dtype and device: a pipeline stage or TP rank holds only its own.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"InferenceContext needs max_batch_size >= 1 and max_sequence_length >= 1, got "
                f"{max_batch_size} and {max_sequence_length}"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Positions ``[length]`` of the next ``length`` tokens: they follow the cached ones."""
        return torch.arange(self.sequence_len_offset, self.sequence_len_offset + length, device=device)

    def store(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache the new tokens' ``key``/``value`` ``[b, g, s, d]`` for ``layer_number`` at the current
        offset; return the keys and values of every position so far, ``[b, g, offset + s, d]``."""
        batch, groups, length, head_dim = key.shape
        end = self.sequence_len_offset + length
        if end > self.max_sequence_length or batch > self.max_batch_size:
            raise ValueError(
                f"the inference context holds {self.max_batch_size} sequences of {self.max_sequence_length} "
                f"positions, but layer {layer_number} got {batch} sequences reaching position {end}"
            )
        buffers = self.key_value_memory.get(layer_number)
        if buffers is None:
            shape = (self.max_batch_size, groups, self.max_sequence_length, head_dim)
            buffers = tuple(torch.empty(shape, dtype=key.dtype, device=key.device) for _ in range(2))
            self.key_value_memory[layer_number] = buffers
        keys, values = buffers
        keys[:batch, :, self.sequence_len_offset : end] = key
        values[:batch, :, self.sequence_len_offset : end] = value
        return keys[:batch, :, :end], values[:batch, :, :end]

    def advance(self, length: int) -> None:
        """The model has seen ``length`` more tokens: later calls write after them."""
        self.sequence_len_offset += length

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for the next generation)."""
        self.sequence_len_offset = 0

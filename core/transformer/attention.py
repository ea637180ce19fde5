"""Causal self-attention with query heads and key/value groups split over the TP ranks.

The fused QKV projection is one ColumnParallelLinear whose full weight is laid out per query group,
as in Megatron::

    rows = [group 0: q_0 .. q_{n-1}, k, v | group 1: q_n .. q_{2n-1}, k, v | ...]   (n = heads / groups)

each block ``kv_channels`` rows tall. A TP shard is then a contiguous slice holding whole groups
with their own keys and values, so sharding never separates a query head from its key/value head
and initialising the full weight then slicing (``shard_of``) gives every rank exactly its heads.
The output projection is row-parallel: its all-reduce (or reduce-scatter under sequence
parallelism) sums the heads' contributions.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from core.tensor_parallel import tp_world_size
from core.transformer.context_parallel import context_parallel_attention
from core.transformer.dropout import sharded_rng
from core.transformer.inference_context import InferenceContext
from core.transformer.initialization import linear_pair
from core.transformer.recompute import checkpoint
from core.transformer.rope import apply_rotary
from core.transformer.transformer_config import TransformerConfig

Rotary = tuple[torch.Tensor, torch.Tensor] | None


_SDPA_HAS_GQA = torch.__version__ >= "2.5"
"""torch >= 2.5: SDPA shares key/value heads among query heads itself (``enable_gqa``)."""


def _math_sdpa_reduces_in_fp32() -> bool:
    """Whether SDPA's unfused (math) fallback computes a 16-bit softmax in fp32: torch >= 2.5 does
    unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` was called."""
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    return allowed is not None and not allowed()


def core_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout_p: float,
    softmax_in_fp32: bool = False,
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v``, causal, with dropout on the probabilities.

    ``query`` is ``[b, heads, s, d]``; ``key`` and ``value`` are ``[b, groups, s_k, d]`` with
    ``groups`` dividing ``heads`` (grouped-query attention: query head ``i`` reads group
    ``i // (heads / groups)``). Any strides with a contiguous last dimension are fine (views of the
    fused QKV projection), and the result's memory is laid out ``[b, s, heads, d]`` by the fused
    kernels, so ``[s, b, heads * d]`` is a view of it when ``b == 1``.

    ``attention_mask`` is Megatron's: boolean, True where attention is NOT allowed, broadcastable to
    ``[b, heads, s, s_k]``; it is combined with the causal mask. With fewer queries than keys (cached
    decoding) the queries are the last positions: query ``i`` sees keys up to ``i + keys - queries``.
    The probabilities are sharded by head, so their dropout draws from this TP rank's own stream.

    ``softmax_in_fp32`` (Megatron's ``--attention-softmax-in-fp32``) matters only where scores are
    written out: SDPA's fused kernels (flash, memory-efficient) and its fp32-reducing math fallback
    already compute the softmax in fp32, so the flag keeps them; only where SDPA could reduce in
    16 bits (torch < 2.5, or reduced-precision math allowed) do 16-bit inputs take
    :func:`_attention_softmax_in_fp32`, as Megatron's flag only changes its unfused kernel.
    """
    queries, keys = query.shape[-2], key.shape[-2]
    if attention_mask is None and queries == keys:
        mask, causal = None, True
    else:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
        if attention_mask is not None:
            mask = mask & ~attention_mask.bool()
        causal = False
    sixteen_bit = query.dtype in (torch.float16, torch.bfloat16)
    if softmax_in_fp32 and sixteen_bit and not _math_sdpa_reduces_in_fp32():
        return _attention_softmax_in_fp32(query, *_shared_heads(query, key, value), mask, dropout_p)
    gqa: dict = {}
    if query.shape[-3] != key.shape[-3]:
        if _SDPA_HAS_GQA:
            gqa = {"enable_gqa": True}
        else:
            key, value = _shared_heads(query, key, value)
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, **gqa)
    with sharded_rng():
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, **gqa
        )


def _shared_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with each group repeated for its query heads (for paths without ``enable_gqa``)."""
    repeats = query.shape[-3] // key.shape[-3]
    if repeats == 1:
        return key, value
    return key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)


def _attention_softmax_in_fp32(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    dropout_p: float,
) -> torch.Tensor:
    """Attention written out, as Megatron's unfused path: scores in the inputs' dtype, then masking and
    softmax in fp32 (fp16 scores can overflow, and an fp16 softmax loses small probabilities), then
    the probabilities cast back for dropout and the product with ``value``."""
    seq = query.shape[-2]
    if allowed is None:
        allowed = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
    scores = torch.matmul(query * query.shape[-1] ** -0.5, key.transpose(-2, -1))
    probs = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1)
    # A row with every key masked is NaN after the softmax; it attends to nothing, as in SDPA.
    probs = probs.masked_fill(~allowed, 0.0).to(value.dtype)
    if dropout_p > 0.0:
        with sharded_rng():
            probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, value)


class SelfAttention(nn.Module):
    """Multi-head / grouped-query / multi-query attention (``num_query_groups`` = heads / < heads / 1).

    ``[s, b, h]`` in (``[s / tp, b, h]`` under sequence parallelism), same layout out.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        cp_group: ProcessGroup | None = None,
        tp_group: ProcessGroup | None = None,
    ) -> None:
        """``cp_group``: the context-parallel group (needed when ``config.context_parallel_size`` > 1);
        ``tp_group``: the tensor-parallel one (None: ``parallel_state``'s, Megatron's default)."""
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp = tp_world_size(tp_group)
        if tp != config.tensor_model_parallel_size:
            raise ValueError(
                f"the tensor-parallel group has {tp} ranks but config.tensor_model_parallel_size "
                f"is {config.tensor_model_parallel_size}"
            )
        self.kv_channels = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.groups_per_rank = config.num_query_groups // tp
        projection_size = config.num_attention_heads * config.kv_channels
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels
        self.linear_qkv, self.linear_proj = linear_pair(
            config,
            qkv_size,
            projection_size,
            column_bias=config.add_bias_linear or config.add_qkv_bias,
            tp_group=tp_group,
        )
        self.recompute_core = config.recompute_granularity == "selective"
        self.cp_comm_type = _cp_comm_type(config, layer_number, cp_group)
        self.cp_group = cp_group

    def split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, local qkv]`` -> query ``[b, local groups, heads per group, s, d]``, key and value
        ``[b, local groups, s, d]``: all three are views of ``mixed``, nothing is copied."""
        s, b = mixed.shape[:2]
        per_group = mixed.view(s, b, self.groups_per_rank, self.heads_per_group + 2, self.kv_channels)
        per_group = per_group.permute(1, 2, 3, 0, 4)  # [b, g, m, s, d]
        n = self.heads_per_group
        return per_group[:, :, :n], per_group[:, :, n], per_group[:, :, n + 1]

    def core(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer's one call of core attention: ``[b, heads, s, d]`` queries, ``[b, groups, s, d]``
        keys and values (unrepeated), with its dropout and softmax settings, checkpointed under
        selective recomputation. With context parallelism the rank holds ``s / CP`` tokens and this
        attends over the whole sequence through the CP group (``attention_mask`` then None); that
        communicates, so ``--compile`` keeps this method eager (``core/transformer/compile.py``).
        """
        dropout_p = self.config.attention_dropout if self.training else 0.0
        fp32_softmax = self.config.attention_softmax_in_fp32

        def local(q, k, v, mask):
            return core_attention(q, k, v, mask, dropout_p, fp32_softmax)

        if self.cp_comm_type is None:
            attend, args = local, (query, key, value, attention_mask)
        else:
            attend, args = (
                partial(
                    context_parallel_attention,
                    comm_type=self.cp_comm_type,
                    group=self.cp_group,
                    local_attention=local,
                    dropout_p=dropout_p,
                ),
                (query, key, value),
            )
        return checkpoint(attend, *args) if self.recompute_core else attend(*args)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary = None,
        attention_mask: torch.Tensor | None = None,
        *,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """``inference_context`` (generation only): cache this call's keys and values and attend over
        every cached position; ``hidden`` then holds only the new tokens."""
        if self.cp_comm_type is not None and (attention_mask is not None or inference_context is not None):
            raise ValueError(
                "context parallelism runs causal attention without an attention_mask or an "
                "inference_context; generate at context_parallel_size 1"
            )
        mixed, _ = self.linear_qkv(hidden)
        query, key, value = self.split_qkv(mixed)
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        # [b, heads, s, d]: a view of RoPE's fresh output, or of ``mixed`` with one head per group;
        # only grouped-query attention without RoPE copies the queries out of the fused layout here.
        query = query.flatten(1, 2)
        if inference_context is not None:
            key, value = inference_context.store(self.layer_number, key, value)
        context = self.core(query, key, value, attention_mask)
        # [b, h, s, d] -> [s, b, h * d]: a view of the fused kernels' [b, s, h, d] output (copied by the
        # projection's matmul only when b > 1).
        output, _ = self.linear_proj(context.permute(2, 0, 1, 3).flatten(2))
        return output


def _cp_comm_type(config: TransformerConfig, layer_number: int, cp_group: ProcessGroup | None) -> str | None:
    """The layer's context-parallel attention form, or None without context parallelism."""
    cp = config.context_parallel_size
    if cp == 1:
        return None
    if cp_group is None:
        raise ValueError(
            f"config.context_parallel_size is {cp} but the attention layer was given no context-parallel "
            "group (pass pg_collection; GPTModel takes parallel_state's groups when none are given)"
        )
    group_size = dist.get_world_size(cp_group)
    if group_size != cp:
        raise ValueError(
            f"the context-parallel group has {group_size} ranks but config.context_parallel_size is {cp}"
        )
    return config.cp_comm_type_of(layer_number)

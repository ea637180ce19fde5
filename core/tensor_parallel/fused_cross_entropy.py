"""Vocabulary-parallel cross-entropy that never holds an fp32 copy of the whole logits (``--cross-entropy-loss-fusion``).

The plain :func:`~core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy` takes fp32 logits
and keeps their softmax, also in fp32, for backward: with 16-bit logits that is two fp32 copies next to
them, 4 GB each at vocabulary 128K and 8K tokens. This version reads the logits in their own dtype and
does its fp32 arithmetic a slice of tokens at a time:

* forward: the per-token maximum (one pass, exact in any dtype, one MAX all-reduce), then per token
  slice the shifted logits in fp32, their ``exp`` summed and the target's logit, all three statistics
  in one SUM all-reduce. It keeps the logits themselves (the output layer made them; nothing new) and
  two fp32 numbers per token.
* backward: per slice ``softmax - one_hot`` from the kept statistics, scaled by the incoming
  gradient and written over the logits in place: the logits' storage becomes their gradient.

The numbers are those of the plain function (same operations per token, only grouped differently),
two collectives instead of three, and the peak memory is the logits plus one slice. The price is the
in-place reuse: the logits must not be used after the loss (the model hands them to nothing else) and
the graph can be back-propagated once, which the function checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core.tensor_parallel.cross_entropy import _all_reduce, _check_loss_inputs, _first_backward, _vocab_shard
from core.tensor_parallel.utils import resolve_tp_group

SLICE_BYTES = {"cuda": 64 * 2**20, "cpu": 4 * 2**20}
"""fp32 bytes of one slice of shifted logits, by device: on a GPU few slices (each costs a handful of
kernel launches), on a CPU one that stays in cache (4 MiB slices ran the CPU loss in about 0.6x the
plain version's time, 32 MiB ones in 0.8x-1.1x)."""


def token_slices(tokens: int, vocab: int, slice_bytes: int) -> list[slice]:
    """Slices of ``tokens`` rows whose fp32 ``[rows, vocab]`` block fits in ``slice_bytes``."""
    per = max(1, slice_bytes // (4 * vocab))
    return [slice(start, min(start + per, tokens)) for start in range(0, tokens, per)]


def _shifted(buffer: torch.Tensor, logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """``logits - max`` in fp32, in the reused slice ``buffer`` (no fresh memory per slice)."""
    out = buffer[: logits.shape[0]]
    out.copy_(logits)
    return out.sub_(logits_max.unsqueeze(-1))


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from ``[tokens, V / tp]`` logits of any dtype; gradient written over the logits."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, slice_bytes):
        tokens, partition_vocab = logits.shape
        vocab_size, foreign, local_target = _vocab_shard(target, partition_vocab, group)

        logits_max = logits.amax(dim=-1).float()
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        smoothing = label_smoothing > 0
        stats = torch.empty(3 if smoothing else 2, tokens, dtype=torch.float32, device=logits.device)
        parts = token_slices(tokens, partition_vocab, slice_bytes)
        buffer = torch.empty(parts[0].stop, partition_vocab, dtype=torch.float32, device=logits.device)
        for part in parts:
            shifted = _shifted(buffer, logits[part], logits_max[part])
            stats[1, part] = shifted.gather(-1, local_target[part].unsqueeze(-1)).squeeze(-1)
            if smoothing:
                stats[2, part] = shifted.sum(dim=-1)
            stats[0, part] = shifted.exp_().sum(dim=-1)
        stats[1].masked_fill_(foreign, 0.0)
        _all_reduce(stats, group)

        log_sum_exp = stats[0].log()
        loss = log_sum_exp - stats[1]
        if smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp - stats[2] / vocab_size)
            ctx.vocab_size = vocab_size
        ctx.save_for_backward(logits, logits_max, stats[0], foreign, local_target)
        ctx.label_smoothing, ctx.slice_bytes = label_smoothing, slice_bytes
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        _first_backward(
            ctx, "the fused vocab-parallel cross-entropy", "its gradient is written over the kept logits"
        )
        logits, logits_max, sum_exp, foreign, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        own_target = (~foreign).float() * -(1.0 - eps)
        grad_loss = grad_loss.float()
        parts = token_slices(logits.shape[0], logits.shape[1], ctx.slice_bytes)
        buffer = torch.empty(parts[0].stop, logits.shape[1], dtype=torch.float32, device=logits.device)
        for part in parts:
            grad = _shifted(buffer, logits[part], logits_max[part]).exp_()
            grad.div_(sum_exp[part].unsqueeze(-1))
            grad.scatter_add_(-1, local_target[part].unsqueeze(-1), own_target[part].unsqueeze(-1))
            if eps > 0:
                grad.sub_(eps / ctx.vocab_size)
            grad.mul_(grad_loss[part].unsqueeze(-1))
            logits[part] = grad
        return logits, None, None, None, None


def fused_vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: ProcessGroup | None = None,
    *,
    slice_bytes: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like ``target``) from vocabulary-sharded logits of any dtype.

    The same contract and numbers as ``vocab_parallel_cross_entropy(logits.float(), target, ...)``
    (Megatron's ``fused_vocab_parallel_cross_entropy``), without the fp32 copies; ``slice_bytes``
    bounds the fp32 working memory (default: :data:`SLICE_BYTES` for the logits' device). The logits' storage is overwritten by their gradient during
    backward, so nothing else may read them afterwards.
    """
    _check_loss_inputs(vocab_parallel_logits, target, label_smoothing)
    vocab = vocab_parallel_logits.shape[-1]
    if slice_bytes is None:
        slice_bytes = SLICE_BYTES.get(vocab_parallel_logits.device.type, SLICE_BYTES["cuda"])
    loss = _FusedVocabParallelCrossEntropy.apply(
        vocab_parallel_logits.reshape(-1, vocab),
        target.reshape(-1),
        float(label_smoothing),
        resolve_tp_group(tp_group),
        slice_bytes,
    )
    return loss.view(target.shape)

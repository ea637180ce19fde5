"""The output layer and the vocabulary-parallel cross-entropy in one pass over token slices
(``--cross-entropy-fusion-impl linear``): the logits are never held.

The fused loss of ``fused_cross_entropy.py`` has no fp32 copy of the logits, but it keeps the logits
the output layer made, ``[tokens, V / tp]`` in the model's dtype, from forward to backward: in fp32
that is a third of what the plain loss holds, and at vocabulary 128K and 8K tokens 4 GB per rank in
bf16. Here the output matmul runs inside the loss, a slice of tokens at a time:

* forward: per slice, the slice's logits, their maximum, ``sum(exp(logit - max))`` and the target's
  logit, then the slice is dropped; one MAX and one SUM all-reduce over the tensor-parallel ranks for
  all tokens together. It keeps the hidden states (the output layer keeps them anyway) and one fp32
  number per token, the log-sum-exp.
* backward: per slice, the logits again (one more output-layer matmul: four where the unfused layer
  does three), ``softmax - one_hot`` scaled by the incoming gradient, and from it the hidden states'
  gradient and the weight's; the weight's goes straight into ``main_grad`` where the layer fuses its
  gradient accumulation (``grad_accumulation.py``). Under a zero-bubble split each pass computes only
  the gradient the engine asked for.

Padded vocabulary entries (past ``vocab_size``) take no probability mass. The numbers are the plain
loss's within rounding: same products per token, only grouped by slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core.parallel_state import group_rank
from core.tensor_parallel.cross_entropy import _all_reduce, _vocab_shard
from core.tensor_parallel.fused_cross_entropy import token_slices
from core.tensor_parallel.grad_accumulation import (
    accumulate_weight_grad,
    claim_main_grad,
    engine_will_use,
    report_accumulated,
)
from core.tensor_parallel.utils import resolve_tp_group

SLICE_BYTES = {"cuda": 256 * 2**20, "cpu": 16 * 2**20}
"""fp32 bytes of one slice of logits, by device: large enough that each slice's matmul runs near the
device's full rate, small against the logits they replace."""


def _logits(hidden: torch.Tensor, weight: torch.Tensor, valid: int) -> torch.Tensor:
    """One slice's logits in fp32, padded vocabulary columns at -inf."""
    logits = (hidden @ weight.t()).float()
    if valid < logits.shape[1]:
        logits[:, valid:] = float("-inf")
    return logits


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss from hidden states ``[tokens, h]`` and a vocabulary shard of the weight."""

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, group, slice_bytes, accumulate):
        rank = group_rank(group)
        tokens, partition_vocab = hidden.shape[0], weight.shape[0]
        vocab_start = rank * partition_vocab
        valid = min(max(vocab_size - vocab_start, 0), partition_vocab)
        _, foreign, local_target = _vocab_shard(target, partition_vocab, group)

        local_max = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        stats = torch.empty(2, tokens, dtype=torch.float32, device=hidden.device)
        for part in token_slices(tokens, partition_vocab, slice_bytes):
            logits = _logits(hidden[part], weight, valid)
            # A shard of padding alone has no finite logit: a finite floor keeps exp() at 0, not NaN.
            local_max[part] = logits.amax(dim=-1).clamp_(min=torch.finfo(torch.float32).min)
            stats[1, part] = logits.gather(-1, local_target[part].unsqueeze(-1)).squeeze(-1)
            stats[0, part] = logits.sub_(local_max[part].unsqueeze(-1)).exp_().sum(dim=-1)
        global_max = local_max.clone()
        _all_reduce(global_max, group, dist.ReduceOp.MAX)
        stats[0].mul_((local_max - global_max).exp_())
        stats[1].masked_fill_(foreign, 0.0)
        _all_reduce(stats, group)
        log_sum_exp = stats[0].log_().add_(global_max)

        ctx.save_for_backward(hidden, weight, log_sum_exp, foreign, local_target)
        ctx.valid, ctx.slice_bytes, ctx.accumulate = valid, slice_bytes, accumulate
        return log_sum_exp - stats[1]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, log_sum_exp, foreign, local_target = ctx.saved_tensors
        want_input, want_weight = engine_will_use(hidden), engine_will_use(weight)
        grad_hidden = torch.empty_like(hidden) if want_input else None
        grad_weight, overwrite = None, False  # overwrite: the step's first write into main_grad
        if want_weight and ctx.accumulate:
            grad_weight, overwrite = claim_main_grad(weight)
        elif want_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        own_target = (~foreign).float().neg_()
        grad_loss = grad_loss.float()
        for part in token_slices(hidden.shape[0], weight.shape[0], ctx.slice_bytes):
            grad = _logits(hidden[part], weight, ctx.valid).sub_(log_sum_exp[part].unsqueeze(-1)).exp_()
            grad.scatter_add_(-1, local_target[part].unsqueeze(-1), own_target[part].unsqueeze(-1))
            grad = grad.mul_(grad_loss[part].unsqueeze(-1)).to(weight.dtype)
            if want_input:
                torch.matmul(grad, weight, out=grad_hidden[part])
            if want_weight:
                accumulate_weight_grad(grad_weight, grad, hidden[part], overwrite=overwrite)
                overwrite = False
        if overwrite:  # claimed, but no token wrote it
            grad_weight.zero_()
        if want_weight and ctx.accumulate:
            report_accumulated(weight)
            grad_weight = None
        elif want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: ProcessGroup | None = None,
    accumulate_into_main_grad: bool = False,
    slice_bytes: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like ``target``) of ``hidden @ weight.T`` without the logits.

    ``hidden`` ``[..., h]`` is the output layer's whole input on this rank (already gathered under
    sequence parallelism, so its gradient is this rank's partial sum, as a column-parallel layer's),
    ``weight`` ``[V / tp, h]`` this rank's vocabulary shard, ``target`` shaped like ``hidden`` without
    its last dimension. ``vocab_size``: the real vocabulary (columns past it are padding).
    ``accumulate_into_main_grad``: the weight's gradient goes into ``weight.main_grad`` (the
    gradient-accumulation fusion's contract) instead of through autograd.
    """
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the hidden states' shape without the "
            f"hidden dimension, {tuple(hidden.shape[:-1])}"
        )
    if slice_bytes is None:
        slice_bytes = SLICE_BYTES.get(hidden.device.type, SLICE_BYTES["cuda"])
    loss = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1),
        vocab_size,
        resolve_tp_group(tp_group),
        slice_bytes,
        accumulate_into_main_grad,
    )
    return loss.view(target.shape)

"""Cross-entropy over logits whose vocabulary dimension is split across the TP ranks.

The output layer of a tensor-parallel model leaves each rank with ``[s, b, V / tp]`` logits.
Gathering them would put the largest activation of the model, whole, on every rank; instead the
loss is assembled from three small all-reduces of ``[s, b]`` tensors (Megatron's recipe):

1. the maximum logit (MAX), subtracted from the logits so that ``exp`` cannot overflow;
2. the logit of the target token, which lives on exactly one rank (SUM, zeros elsewhere);
3. the sum of ``exp`` over the vocabulary (SUM), the softmax normaliser.

``loss = log(sum_exp) - target_logit``. The backward needs only this rank's softmax slice:
``d loss / d logits = softmax - one_hot(target)``, computed on the local shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core import comm_time
from core.parallel_state import group_rank, group_size
from core.tensor_parallel.utils import resolve_tp_group


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        stamp = comm_time.start()
        dist.all_reduce(x, op=op, group=group)
        comm_time.stop("TP", stamp)


def _vocab_shard(
    target: torch.Tensor, partition_vocab: int, group: ProcessGroup | None
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(whole vocabulary size, ``foreign``: targets another rank's shard holds, ``local_target``: the
    others' index into this rank's shard, 0 where foreign)."""
    rank = group_rank(group)
    world_size = group_size(group)
    vocab_start = rank * partition_vocab
    foreign = (target < vocab_start) | (target >= vocab_start + partition_vocab)
    return partition_vocab * world_size, foreign, torch.where(foreign, 0, target - vocab_start)


def _first_backward(ctx, loss: str, reused: str) -> None:
    """Refuse a second backward through a loss whose ``reused`` storage became its gradient in place."""
    if ctx.backward_done:
        raise RuntimeError(f"{loss} cannot be back-propagated twice ({reused}); recompute the loss")
    ctx.backward_done = True


def _check_loss_inputs(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    """The contract of both vocab-parallel losses, checked before any collective."""
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits' shape without the "
            f"vocabulary dimension, {tuple(logits.shape[:-1])}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss forward; ``softmax - (1 - eps) one_hot - eps / V`` backward, on the local shard."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        vocab_size, foreign, local_target = _vocab_shard(target, logits.shape[-1], group)

        # Work in fp32 on a private copy: the caller's logits are left untouched.
        logits_max = logits.float().amax(dim=-1)
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        shifted = logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1))

        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)
        if label_smoothing > 0:
            # The smoothing term needs sum_j logit_j over the whole vocabulary: ride on the same all-reduce.
            both = torch.stack([target_logit, shifted.sum(dim=-1)])
            _all_reduce(both, group)
            target_logit, shifted_sum = both.unbind(0)
        else:
            _all_reduce(target_logit, group)

        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, group)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            mean_neg_log_prob = log_sum_exp - shifted_sum / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_prob
            ctx.vocab_size = vocab_size

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, foreign, local_target)
        ctx.label_smoothing = label_smoothing
        ctx.input_dtype = logits.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved softmax becomes the gradient in place (saves a logits-sized buffer, as Megatron
        # does), so a second backward through the same graph would be wrong: refuse it instead.
        _first_backward(ctx, "vocab_parallel_cross_entropy", "its saved softmax is reused as the gradient")
        softmax, foreign, local_target = ctx.saved_tensors
        grad = softmax
        eps = ctx.label_smoothing
        own_target = (~foreign).to(grad.dtype) * -(1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), own_target.unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like ``target``) from vocabulary-sharded logits.

    ``vocab_parallel_logits`` is ``[..., V / tp]``: rank ``r`` holds vocabulary ids
    ``[r V / tp, (r + 1) V / tp)``; ``target`` is ``[...]`` with global ids. Equals
    ``F.cross_entropy(full_logits, target, reduction="none", label_smoothing=label_smoothing)``.
    There is no ``ignore_index``: mask unwanted tokens with a loss mask, as Megatron does.
    """
    _check_loss_inputs(vocab_parallel_logits, target, label_smoothing)
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, float(label_smoothing), resolve_tp_group(tp_group)
    )

"""Linear and embedding layers whose weight gradient goes straight into ``weight.main_grad``
(``--gradient-accumulation-fusion``).

Without it, backward makes each microbatch's weight gradient as a new tensor in the weight's dtype
(bf16 for a bf16 model), autograd hands it to the parameter, and the data-parallel wrapper's hook adds
it into the fp32 ``main_grad`` buffer: a weight-sized temporary and a second pass over it. Here the
weight-gradient matmul accumulates into ``main_grad`` itself (``main_grad += grad_out^T @ input``), as
Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` does with its fused CUDA kernel:

* same dtypes (an fp32 model, or 16-bit gradients): ``addmm_`` into ``main_grad``;
* a 16-bit model with fp32 ``main_grad`` on a GPU: ``addmm`` with an fp32 output (torch's
  ``out_dtype``, cuBLAS accumulating 16-bit products into fp32); elsewhere (CPU, torch without it)
  the 16-bit product is formed first and added, the same numbers as the hook path.

The step's first gradient of a weight overwrites ``main_grad`` instead (``beta = 0``): the wrapper
does not zero its buffers between steps (:func:`claim_main_grad`).

Autograd then receives no gradient for the weight; the function tells the wrapper instead, through
``weight.grad_accumulated(weight)`` (set by ``DistributedDataParallel``), which checks the bucket
and, with overlapped reduction, counts the weight as ready, and marks
``weight.grad_added_to_main_grad`` (Megatron's name) so that the wrapper's post-accumulate hook,
which autograd may still run with no gradient, does nothing more. Under a zero-bubble split the function computes only what the engine will use:
the input gradient in ``I``, the weight gradient in ``W`` (``torch._C._will_engine_execute_node``),
so nothing is computed twice and the bucket becomes ready after the weight's ``W``.

The word embedding accumulates its gradient the same way (:func:`embedding_with_grad_accumulation`):
its rows are added into ``main_grad`` where the tokens fall, instead of a vocabulary-sized gradient
being zero-filled, scattered into and added (and, with tied embeddings, summed with the output
layer's first). A weight with fused uses in two layers of one backward, a tied embedding and its
output layer in one chunk, must be reported once, after both: the model marks it
``grad_reported_by_embedding``, the output layer's use then only accumulates, and the embedding's,
which autograd runs last (its gradient is the output layer's input gradient, carried down the
stack), reports (:func:`report_accumulated`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)


def engine_will_execute(node: torch.autograd.graph.Node) -> bool:
    """Whether the running backward executes ``node`` (True where torch cannot say).

    Torch cannot say for a leaf that ``torch.autograd.grad`` was asked for (a zero-bubble I pass asking
    for its stage's input): it raises rather than answer. That leaf's gradient is wanted.
    """
    if _will_engine_execute_node is None:
        return True
    try:
        return _will_engine_execute_node(node)
    except RuntimeError:  # "A leaf node was passed to _will_engine_execute_node ... autograd.grad()"
        return True


def engine_will_use(tensor: torch.Tensor) -> bool:
    """Whether the running backward needs ``tensor``'s gradient (always True where torch cannot say)."""
    if not tensor.requires_grad:
        return False
    return engine_will_execute(get_gradient_edge(tensor).node)


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, input_: torch.Tensor, *, overwrite: bool = False
) -> None:
    """``main_grad += grad_output^T @ input_`` over 2-D ``[tokens, out]`` and ``[tokens, in]``;
    ``overwrite``: ``main_grad = ...`` instead (the step's first gradient: the buffer holds stale values,
    which ``beta = 0`` neither reads nor propagates, NaN included)."""
    beta = 0 if overwrite else 1
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), input_, beta=beta)
    elif main_grad.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        torch.addmm(main_grad, grad_output.t(), input_, out_dtype=main_grad.dtype, beta=beta, out=main_grad)
    elif overwrite:
        main_grad.copy_(grad_output.t() @ input_)
    else:
        main_grad.add_(grad_output.t() @ input_)


class LinearWithGradAccumulation(torch.autograd.Function):
    """``F.linear(input, weight, bias)``; backward accumulates the weight's gradient into ``main_grad``."""

    @staticmethod
    def forward(ctx, input_, weight, bias):
        ctx.save_for_backward(input_, weight, bias)
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight, bias = ctx.saved_tensors
        grad_input = grad_bias = None
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        if engine_will_use(input_):
            grad_input = grad_output.matmul(weight)
        if engine_will_use(weight):
            main_grad, overwrite = claim_main_grad(weight)
            accumulate_weight_grad(
                main_grad, flat_grad, input_.reshape(-1, input_.shape[-1]), overwrite=overwrite
            )
            report_accumulated(weight)
        if bias is not None and engine_will_use(bias):
            grad_bias = flat_grad.sum(0)
        return grad_input, None, grad_bias


def linear_with_grad_accumulation(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` whose weight gradient accumulates into ``weight.main_grad`` (see the module docstring)."""
    check_main_grad(weight)
    return LinearWithGradAccumulation.apply(input_, weight, bias)


class EmbeddingWithGradAccumulation(torch.autograd.Function):
    """``F.embedding(ids, weight)``; backward adds each token's gradient into its row of ``main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # not saved: the backward reads only its main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if engine_will_use(weight):
            main_grad, overwrite = claim_main_grad(weight)
            if overwrite:  # the rows no token reaches hold last step's values
                main_grad.zero_()
            rows = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
            add_rows(main_grad, ids.reshape(-1), rows)
            report_accumulated(weight, last_use=True)
        return None, None


def add_rows(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``target[index[i]] += rows[i]`` for every i, repeated indices included, in a fixed order: on a
    CPU ``index_add_`` (one row after another); on a GPU ``index_put_`` with ``accumulate``, which sorts
    the indices first, where ``index_add_``'s atomic adds would sum a repeated token in any order."""
    if target.is_cuda:
        target.index_put_((index,), rows, accumulate=True)
    else:
        target.index_add_(0, index, rows)


def embedding_with_grad_accumulation(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding`` whose weight gradient accumulates into ``weight.main_grad`` (module docstring)."""
    check_main_grad(weight)
    return EmbeddingWithGradAccumulation.apply(ids, weight)


def report_accumulated(weight: torch.Tensor, *, last_use: bool = False) -> None:
    """Tell the wrapper that a fused layer wrote ``weight``'s gradient of this microbatch into
    ``main_grad``: it checks the bucket and counts the weight as ready, and its post-accumulate hook,
    which autograd may still run with no gradient, does nothing more. A weight marked
    ``grad_reported_by_embedding`` is reported by its ``last_use`` only (module docstring)."""
    if getattr(weight, "grad_reported_by_embedding", False) and not last_use:
        return
    weight.grad_accumulated(weight)
    weight.grad_added_to_main_grad = True


def claim_main_grad(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``weight.main_grad`` about to receive a gradient, and whether to overwrite it rather than add.

    The wrapper does not zero its buffers between steps: the first gradient a parameter receives in a
    step overwrites what the last step left (``weight.claim_main_grad`` says which write is the first,
    and ZeRO-2/3, which free the full gradient bucket between microbatches, give it zeroed memory
    first). Without a wrapper's claim (a hand-made ``main_grad``), add.
    """
    claim = getattr(weight, "claim_main_grad", None)
    overwrite = bool(claim(weight)) if claim is not None else False
    return weight.main_grad, overwrite


def check_main_grad(weight: torch.Tensor) -> None:
    """A ValueError unless ``weight`` has the ``main_grad`` buffer the fused accumulation writes into."""
    if not hasattr(weight, "main_grad") or not hasattr(weight, "grad_accumulated"):
        raise ValueError(
            "gradient_accumulation_fusion=True needs the weights' main_grad buffers, which "
            "DistributedDataParallel creates: wrap the model before its first forward"
        )

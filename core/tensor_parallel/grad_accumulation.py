"""A linear layer whose weight gradient goes straight into ``weight.main_grad`` (``--gradient-accumulation-fusion``).

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
            weight.grad_accumulated(weight)
            weight.grad_added_to_main_grad = True
        if bias is not None and engine_will_use(bias):
            grad_bias = flat_grad.sum(0)
        return grad_input, None, grad_bias


def linear_with_grad_accumulation(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` whose weight gradient accumulates into ``weight.main_grad`` (see the module docstring)."""
    check_main_grad(weight)
    return LinearWithGradAccumulation.apply(input_, weight, bias)


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

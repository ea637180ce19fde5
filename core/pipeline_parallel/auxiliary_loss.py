"""Losses computed inside the model (an MoE router's load-balancing and z-losses), backpropagated
with the step's loss.

A router's loss is not an output of the model chunk: the schedule backpropagates only the chunk's
output. :class:`MoEAuxLossAutoScaler` (Megatron's name) attaches such a loss to an activation: the
forward is the identity, and when backward reaches that activation it also starts the loss's own
backward with gradient ``scale``, so the loss joins the objective exactly as if it had been added
to it with that weight. The schedule sets ``scale`` once per step (:func:`set_auxiliary_loss_scale`),
as Megatron does: the main loss's scale (fp16 loss scaling) divided by the microbatch count, since
every microbatch's main loss is divided by it too (times the context-parallel size, whose ranks
each hold a share of a sequence's auxiliary loss that the data-parallel average divides by); with
a per-token loss only the loss scale, the router multiplying its loss by its token count instead.
"""

from __future__ import annotations

from typing import ClassVar

import torch


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``apply(activation, loss)`` returns ``activation``; backward adds ``d loss = scale``."""

    main_loss_backward_scale: ClassVar[torch.Tensor | None] = None

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        loss_grad = torch.ones_like(loss) if scale is None else torch.ones_like(loss) * scale.to(loss.device)
        return grad, loss_grad

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The gradient every auxiliary loss starts its backward from (until set again)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().reshape(())


def set_auxiliary_loss_scale(scale: torch.Tensor | float) -> None:
    """Set the weight of auxiliary losses in the objective (the schedule calls this every step)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.as_tensor(scale, dtype=torch.float32))


def attach_auxiliary_loss(activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``activation`` (unchanged); backpropagating through it also backpropagates ``loss``."""
    return MoEAuxLossAutoScaler.apply(activation, loss)

"""Losses computed inside the model (an MoE router's load-balancing and z-losses), backpropagated
with the step's loss.

A router's loss is not an output of the model chunk: the schedule backpropagates only the chunk's
output. :class:`MoEAuxLossAutoScaler` (Megatron's name) attaches such a loss to an activation: the
forward is the identity, and when backward reaches that activation it also starts the loss's own
backward with gradient ``scale``, so the loss joins the objective exactly as if it had been added
to it with that weight.

The scale is the step's, handed in like every other input of a step: each router reads its own
:class:`AuxiliaryLossScale`, and the schedule sets those of the model it runs once per training
step through a hook, ``ScheduleHooks.auxiliary_loss_scale`` (:func:`auxiliary_loss_scale_hook`
builds it from the model chunks; ``ParallelGPT.schedule_hooks`` carries it, and an entry point
called without it takes its chunks'). Two models in one process therefore never see each other's
scale; Megatron keeps it in a class-level global instead. The value is Megatron's: the main loss's
scale (fp16 loss scaling) divided by the microbatch count, since every microbatch's main loss is
divided by it too (times the context-parallel size, whose ranks each hold a share of a sequence's
auxiliary loss that the data-parallel average divides by); with a per-token loss only the loss
scale, the router multiplying its loss by its token count instead. A router no schedule has run
yet (a unit test calling it) starts its losses' backward from 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn


class AuxiliaryLossScale:
    """The gradient one router's auxiliary losses start their backward from (None: 1), read in backward."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def set(self, scale: torch.Tensor | float) -> None:
        """The losses' weight in the objective from now on (the schedule's hook calls this each step)."""
        self.value = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())

    def gradient(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient ``loss``'s backward starts from."""
        ones = torch.ones_like(loss)
        return ones if self.value is None else ones * self.value.to(loss.device)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``apply(activation, loss, scale)`` returns ``activation``; backward adds ``d loss = scale``
    (an :class:`AuxiliaryLossScale`, read when the backward runs)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor, scale: AuxiliaryLossScale) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, ctx.scale.gradient(loss), None


def attach_auxiliary_loss(
    activation: torch.Tensor, loss: torch.Tensor, scale: AuxiliaryLossScale
) -> torch.Tensor:
    """``activation`` (unchanged); backpropagating through it also backpropagates ``loss``, from ``scale``."""
    return MoEAuxLossAutoScaler.apply(activation, loss, scale)


def auxiliary_loss_scale_hook(chunks: Iterable[nn.Module]) -> Callable[[torch.Tensor | float], None] | None:
    """``set(scale)`` for every :class:`AuxiliaryLossScale` of ``chunks``' modules (their
    ``auxiliary_loss_scale``), the schedule's ``ScheduleHooks.auxiliary_loss_scale``; None when the
    chunks compute no such loss. The modules are found once, here."""
    scales = [
        module.auxiliary_loss_scale
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(getattr(module, "auxiliary_loss_scale", None), AuxiliaryLossScale)
    ]
    return functools.partial(_set_all, scales) if scales else None


def _set_all(scales: list[AuxiliaryLossScale], scale: torch.Tensor | float) -> None:
    for each in scales:
        each.set(scale)

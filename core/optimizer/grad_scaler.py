"""Loss scaling for fp16 (Megatron's ``grad_scaler.py`` semantics).

fp16 has a narrow exponent range: small gradients underflow to zero. The loss is multiplied by a
large scale before backward (``MegatronOptimizer.scale_loss``, which the schedule calls as
``config.grad_scale_func`` on the last stage) and the gradients are divided by it before the step.
If any scaled gradient overflowed to Inf or NaN, the step is skipped and the scaler told so.

:class:`DynamicGradScaler` adapts the scale: each overflow uses up one unit of ``hysteresis``;
once it is used up the scale is multiplied by ``backoff_factor`` (never below ``min_scale``).
``growth_interval`` steps in a row without overflow multiply the scale by ``growth_factor`` and
restore the hysteresis. :class:`ConstantGradScaler` (``--loss-scale``) keeps one scale but still
skips overflowing steps.
"""

from __future__ import annotations

import torch

from core.device import current_device


def _flag(found_inf: bool | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``found_inf`` as a 0-dim bool tensor on ``device``, without a host-to-device copy."""
    if isinstance(found_inf, torch.Tensor):
        return found_inf.reshape(()) > 0
    return torch.full((), bool(found_inf), dtype=torch.bool, device=device)


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``).

    The scale lives on the device (``scale_tensor``), where the loss is multiplied by it and the
    gradients divided by it; ``scale`` reads it as a number (for the log line and checkpoints).
    """

    def __init__(self, initial_scale: float, device: torch.device | None = None) -> None:
        if initial_scale <= 0:
            raise ValueError(f"the loss scale must be > 0, got {initial_scale}")
        self.device = device if device is not None else current_device()
        self._scale = torch.full((), float(initial_scale), dtype=torch.float32, device=self.device)

    @property
    def scale(self) -> float:
        """The current loss scale (a read from the device)."""
        return float(self._scale)

    @property
    def inv_scale(self) -> float:
        """What gradients are multiplied by to undo the scale (a read from the device)."""
        return float(self.inv_scale_tensor)

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The loss scale as a 0-dim float32 tensor on the device."""
        return self._scale

    @property
    def inv_scale_tensor(self) -> torch.Tensor:
        """``1 / scale`` as a 0-dim float32 tensor on the device."""
        return self._scale.reciprocal()

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """A constant scale ignores overflows (the step is still skipped by the optimizer)."""

    def device_state(self) -> list[torch.Tensor]:
        """The scale and trackers as device tensors, to copy (:meth:`restore_device_state`) without a
        host read: a step that result validation reruns starts from the scale it first had."""
        return [t for t in (self._scale, getattr(self, "_growth_tracker", None),
                            getattr(self, "_hysteresis_tracker", None)) if t is not None]  # fmt: skip

    def restore_device_state(self, saved: list[torch.Tensor]) -> None:
        for tensor, value in zip(self.device_state(), saved, strict=True):
            tensor.copy_(value)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a constant scale comes from ``--loss-scale``, not the checkpoint (Megatron)."""


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic loss scale: back off on overflow (after ``hysteresis`` of them), grow when quiet.

    Scale and trackers are device tensors and :meth:`update` takes the overflow flag as a device
    tensor, so a step never waits for the host to learn whether it overflowed.
    """

    def __init__(
        self,
        initial_scale: float,
        *,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int,
        hysteresis: int,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(initial_scale, device)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"min_scale must be in (0, initial_scale={initial_scale}], got {min_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, {backoff_factor}"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}"
            )
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = torch.zeros((), dtype=torch.int64, device=self.device)
        self._hysteresis_tracker = torch.full((), hysteresis, dtype=torch.int64, device=self.device)

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Record one step's outcome and adjust the scale, on the device.

        An overflow resets the growth count and uses up one unit of hysteresis; with none left the
        scale backs off (never below ``min_scale``). ``growth_interval`` clean steps in a row grow it
        and restore the hysteresis.
        """
        found = _flag(found_inf, self.device)
        growth = torch.where(found, 0, self._growth_tracker + 1)
        hysteresis = torch.where(found, self._hysteresis_tracker - 1, self._hysteresis_tracker)
        back_off = found & (hysteresis <= 0)
        grow = ~found & (growth == self.growth_interval)
        scale = torch.where(
            back_off, (self._scale * self.backoff_factor).clamp(min=self.min_scale), self._scale
        )
        self._scale.copy_(torch.where(grow, scale * self.growth_factor, scale))
        self._growth_tracker.copy_(torch.where(grow, 0, growth))
        self._hysteresis_tracker.copy_(torch.where(grow, self.hysteresis, hysteresis))

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": int(self._growth_tracker),
            "hysteresis_tracker": int(self._hysteresis_tracker),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saved scaler stopped; a constant scale's state (``{"scale"}``) starts
        the trackers afresh from its scale."""
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state.get("growth_tracker", 0)))
        self._hysteresis_tracker.fill_(int(state.get("hysteresis_tracker", self.hysteresis)))


def unscale_and_check(
    grads: list[torch.Tensor], inv_scale: float | torch.Tensor, found_inf: torch.Tensor
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place; set ``found_inf`` to 1 if any holds Inf or NaN."""
    grads = [g for g in grads if g.numel()]
    if grads:
        if not isinstance(inv_scale, torch.Tensor):
            inv_scale = torch.full((), inv_scale, dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.reshape(1))

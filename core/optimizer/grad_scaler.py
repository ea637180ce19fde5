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


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, initial_scale: float) -> None:
        if initial_scale <= 0:
            raise ValueError(f"the loss scale must be > 0, got {initial_scale}")
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """What gradients are multiplied by to undo the scale."""
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is still skipped by the optimizer)."""

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a constant scale comes from ``--loss-scale``, not the checkpoint (Megatron)."""


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic loss scale: back off on overflow (after ``hysteresis`` of them), grow when quiet."""

    def __init__(
        self,
        initial_scale: float,
        *,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int,
        hysteresis: int,
    ) -> None:
        super().__init__(initial_scale)
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
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saved scaler stopped; a constant scale's state (``{"scale"}``) starts
        the trackers afresh from its scale."""
        self._scale = float(state["scale"])
        self._growth_tracker = int(state.get("growth_tracker", 0))
        self._hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


def unscale_and_check(grads: list[torch.Tensor], inv_scale: float, found_inf: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place; set ``found_inf`` to 1 if any holds Inf or NaN."""
    grads = [g for g in grads if g.numel()]
    if grads:
        inv = torch.full((), inv_scale, dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)

"""Learning-rate warm-up and decay, and weight-decay ramp (Megatron's ``OptimizerParamScheduler``).

The formulas are Megatron's, so a run resumed from, or compared against, Megatron follows the
same curve. "Steps" are whatever unit the caller increments by: Megatron's training loop counts
samples (``step(global_batch_size)``), a simple loop counts iterations.

    warm-up   num_steps <= lr_warmup_steps:  init_lr + (max_lr - init_lr) * num_steps / lr_warmup_steps
    decay     ratio = (num_steps - warmup) / (lr_decay_steps - warmup)
              linear: coeff = 1 - ratio;   cosine: coeff = (cos(pi * ratio) + 1) / 2
              lr = min_lr + coeff * (max_lr - min_lr)
    after     num_steps > lr_decay_steps:    min_lr
"""

from __future__ import annotations

import math
from typing import Any

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets ``lr`` (times the group's ``lr_mult``) and, if asked, ``weight_decay`` (times ``wd_mult``)
    on every parameter group of ``optimizer`` after each ``step``.

    Weight decay is scheduled only when ``start_wd`` is given (Megatron always schedules it); left
    at None the groups keep the weight decay they were built with. A group may carry its own
    ``max_lr``/``min_lr``, as in Megatron.
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_steps: int | None = None,
        wd_incr_style: str = "constant",
        *,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = (
            lr_warmup_steps,
            lr_decay_steps,
            lr_decay_style,
        )
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = start_wd, (start_wd if end_wd is None else end_wd)
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self._validate()
        self.num_steps = 0
        self.step(0)

    def _validate(self) -> None:
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={self.min_lr}, max_lr={self.max_lr}")
        if self.init_lr > self.max_lr:
            raise ValueError(f"init_lr ({self.init_lr}) must not exceed max_lr ({self.max_lr})")
        if self.lr_decay_steps <= 0 or self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                f"need 0 <= lr_warmup_steps < lr_decay_steps, got lr_warmup_steps="
                f"{self.lr_warmup_steps}, lr_decay_steps={self.lr_decay_steps}"
            )
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_decay_style == "WSD" and (
            self.wsd_decay_steps is None or self.lr_wsd_decay_style not in WSD_DECAY_STYLES
        ):
            raise ValueError(
                "lr_decay_style='WSD' needs wsd_decay_steps and lr_wsd_decay_style in "
                f"{WSD_DECAY_STYLES}, got {self.wsd_decay_steps!r}, {self.lr_wsd_decay_style!r}"
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are exclusive"
            )
        if self.start_wd is None:
            return
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"wd_incr_style must be one of {WD_INCR_STYLES}, got {self.wd_incr_style!r}")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(
                f"wd_incr_style='constant' needs start_wd == end_wd, got {self.start_wd}, {self.end_wd}"
            )
        if self.wd_incr_style != "constant" and not self.wd_incr_steps:
            raise ValueError(f"wd_incr_style={self.wd_incr_style!r} needs wd_incr_steps > 0")

    # -- the curves ---------------------------------------------------------------------------------
    def get_wd(self) -> float | None:
        """Weight decay at the current step (None when weight decay is not scheduled)."""
        if self.start_wd is None:
            return None
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict | None = None, num_steps: int | None = None) -> float:
        """Learning rate for ``param_group`` (its own max/min lr if it has them) at the current step,
        or at ``num_steps``."""
        group = param_group or {}
        n = self.num_steps if num_steps is None else num_steps
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(min_lr, lr)
        ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(n)
        return min_lr + coeff * (max_lr - min_lr)

    def group_lrs_at(self, num_steps: int) -> list[float]:
        """Each parameter group's learning rate (times its ``lr_mult``) at ``num_steps``, as ``step``
        would set it; the scheduler does not move."""
        return [self.get_lr(g, num_steps) * g.get("lr_mult", 1.0) for g in self.optimizer.param_groups]

    @property
    def schedules_weight_decay(self) -> bool:
        """Whether the weight decay changes from step to step (a ramp, not a constant)."""
        return self.start_wd is not None and self.wd_incr_style != "constant"

    def _wsd_coeff(self, num_steps: int) -> float:
        """Warm-up, stable, decay: flat until the last ``wsd_decay_steps``, then anneal."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if num_steps <= anneal_start:
            return 1.0
        ratio = float(num_steps - anneal_start) / float(self.wsd_decay_steps)
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)

    def step(self, increment: int = 1) -> None:
        """Advance by ``increment`` steps and write the new values into the optimizer's groups."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    # -- checkpoints --------------------------------------------------------------------------------
    _SAVED = (
        "max_lr",
        "min_lr",
        "lr_warmup_steps",
        "lr_decay_steps",
        "lr_decay_style",
        "start_wd",
        "end_wd",
        "wd_incr_steps",
        "wd_incr_style",
    )

    def state_dict(self) -> dict:
        """Python scalars and strings only (JSON-ready)."""
        return {"num_steps": self.num_steps, **{name: getattr(self, name) for name in self._SAVED}}

    def mismatches(self, state_dict: dict) -> list[tuple[str, Any, Any]]:
        """``(setting, this scheduler's value, the checkpoint's)`` for every saved setting that differs.

        The weight-decay ramp's length counts only when there is a ramp (a style other than constant).
        """
        constant_wd = (
            self.wd_incr_style == "constant" and state_dict.get("wd_incr_style", "constant") == "constant"
        )
        return [
            (name, getattr(self, name), state_dict[name])
            for name in self._SAVED
            if name in state_dict
            and getattr(self, name) != state_dict[name]
            and not (name == "wd_incr_steps" and constant_wd)
        ]

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume the curve (Megatron's rules): with ``override_opt_param_scheduler`` this scheduler's
        settings win, with ``use_checkpoint_opt_param_scheduler`` the checkpoint's; with neither they
        must be equal, else ``ValueError`` lists every one that differs."""
        differ = self.mismatches(state_dict)
        if differ and not (self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler):
            listed = "; ".join(
                f"{name} is {mine!r} here but {saved!r} in the checkpoint" for name, mine, saved in differ
            )
            raise ValueError(
                f"OptimizerParamScheduler: {listed}; pass override_opt_param_scheduler=True to keep "
                "these settings or use_checkpoint_opt_param_scheduler=True to take the checkpoint's"
            )
        if not self.override_opt_param_scheduler:
            for name in self._SAVED:
                if name in state_dict:
                    setattr(self, name, state_dict[name])
        self._validate()
        self.num_steps = 0
        self.step(int(state_dict["num_steps"]))

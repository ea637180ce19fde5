"""Optimizers that step from data-parallel gradient buffers, clip by the global norm, and skip bad steps.

Three flavours, as in Megatron:

* :class:`FP32Optimizer` — an fp32 model; the inner torch optimizer steps on the model's own
  parameters, with ``param.main_grad`` (the data-parallel buffer) handed to it as the gradient.
* :class:`Float16OptimizerWithFloat16Params` — a bf16 or fp16 model. 16-bit floats have too few
  mantissa bits for small updates to register (``w + lr * u == w`` for most of training), so the
  optimizer keeps an fp32 *main* copy of each 16-bit parameter, steps on that with fp32 gradients,
  and copies the result back into the model. fp32 parameters in the same model are stepped directly.
  With ``OptimizerConfig.main_params_dtype`` set to the model's dtype (Megatron-FSDP's
  ``--megatron-fsdp-main-params-dtype auto``) there is no main copy: the inner optimizer steps the
  16-bit parameters themselves, its moments in their dtype, the gradients cast to it (4 bytes per
  parameter of Adam state instead of 12, at the cost of the updates that 16 bits cannot hold).
* :class:`~core.optimizer.distrib_optimizer.DistributedOptimizer` — either of the above, but each
  data-parallel rank keeps main parameters and optimizer state for its shard only.

All three describe what they step as :class:`ParamShard` records: the range ``[start, end)`` of a
flattened model parameter and the tensor stepped on for it (the whole parameter except in
the distributed optimizer). ``param_state_by_name`` exports the state in those terms.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``. A non-finite global norm
(a NaN or Inf anywhere in the model) skips the update on every rank (the norm is global, so they
agree) and leaves parameters and optimizer state untouched. With loss scaling (fp16, or
``loss_scale``) the gradients are unscaled first; an overflow skips the step, sets
``last_step_overflowed`` and lets the scaler back off (see :mod:`core.optimizer.grad_scaler`).

The step is decided on the device. :meth:`MegatronOptimizer.step_on_device` computes the norm, the
clipping factor and the skip flag as device tensors and never waits for the host: a fused optimizer
(torch's fused AdamW or SGD, on CUDA and on CPUs with torch >= 2.4) takes the skip flag as
``found_inf`` and the clipping factor as ``grad_scale``, exactly as torch's ``GradScaler`` drives it,
and skips or clips inside its one kernel. Without a fused kernel (torch 2.3 on a CPU) the foreach
optimizer steps after one read of the flag. ``step()`` is the same step with its results read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.device import current_device
from core.optimizer.clip_grads import (
    clip_coefficient,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    count_zeros_tensor,
    get_grad_norm_tensor,
    grad_stats_group,
    param_counts_for_norm,
)
from core.optimizer.grad_scaler import unscale_and_check
from core.optimizer.optimizer_config import OptimizerConfig, make_grad_scaler
from core.optimizer.param_state import ParamShard, export_param_state, import_param_state
from core.parallel_state import ParallelGroups
from core.tensor_parallel.utils import copy_tensor_model_parallel_attributes

_HALF = (torch.bfloat16, torch.float16)
_COPIED_ATTRIBUTES = ("shared", "shared_embedding", "sequence_parallel")


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step decided, as 0-dim device tensors (read them when logging).

    ``applied``: bool, the update was made. ``grad_norm``: float64, the global norm before clipping
    (non-finite when the step was skipped for it). ``num_zeros``: float64 zero-gradient count, only
    with ``log_num_zeros_in_grad``. ``overflow``: bool, the loss-scaled gradients overflowed (only
    with loss scaling).
    """

    applied: torch.Tensor
    grad_norm: torch.Tensor
    num_zeros: torch.Tensor | None = None
    overflow: torch.Tensor | None = None

    def read(self) -> tuple[bool, float | None, int | None]:
        """Megatron's ``step()`` result from these tensors, in one read from the device."""
        flags = [self.applied, self.overflow if self.overflow is not None else torch.zeros_like(self.applied)]
        values = [self.grad_norm, self.num_zeros if self.num_zeros is not None else self.grad_norm]
        applied, overflow = torch.stack(flags).tolist()
        norm, zeros = torch.stack(values).tolist()
        if overflow:
            return False, None, None
        if not applied:
            return False, norm, None
        return True, norm, None if self.num_zeros is None else int(zeros)


def model_named_parameters(chunks: Iterable[nn.Module]) -> dict[int, str]:
    """id(parameter) -> its name in its chunk (a data-parallel wrapper adds no prefix)."""
    names: dict[int, str] = {}
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "ddp_config") else chunk
        for name, param in module.named_parameters():
            names.setdefault(id(param), name)
    return names


def _foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i, casting dtypes, in one multi-tensor op where torch has it."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(targets, sources)
    else:
        for target, source in zip(targets, sources):
            target.copy_(source)


class MegatronOptimizer:
    """Common machinery: gradient hand-over, loss scaling, global norm, clipping, skip-on-NaN, state.

    Subclasses differ only in the :class:`ParamShard` record they build for each parameter (``_make_shard``).
    ``model_chunks`` lets ``zero_grad`` also zero the chunks' data-parallel gradient buffers, and
    names the parameters in ``param_state_by_name``. ``groups``: the model's process groups, which say
    what this rank counts in global norms and over which ranks they are summed (None: one process).
    """

    shards_data_parallel = False
    """Whether data-parallel ranks hold disjoint shards (each then counts its own in norms)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model_chunks: Iterable[nn.Module] | None = None,
        groups: ParallelGroups | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.groups = groups
        self.model_chunks = list(model_chunks or [])
        self._shards: list[ParamShard] = []
        self._counted: list[ParamShard] | None = None  # the shards that count in global norms
        self._in_buffers: set[int] | None = None
        self.grad_scaler = make_grad_scaler(config)
        self.last_step_overflowed = False
        """True when the last ``step()`` found Inf/NaN in the loss-scaled gradients and skipped."""
        self._names = model_named_parameters(self.model_chunks)
        for group in optimizer.param_groups:
            shards = [shard for shard in map(self._make_shard, group["params"]) if shard is not None]
            self._shards += shards
            group["params"] = [shard.main_param for shard in shards]

    def _make_shard(self, param: nn.Parameter) -> ParamShard | None:
        """What this flavour steps for ``param`` (None: nothing on this rank); its ``main_param``
        takes ``param``'s place in the inner optimizer's group."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it steps (_make_shard)")

    def _name(self, param: nn.Parameter) -> str:
        return self._names.get(id(param), f"param{len(self._names)}.{id(param)}")

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the scheduler writes ``lr`` and ``weight_decay`` here)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner optimizer's per-parameter state (keyed by main parameter)."""
        return self.optimizer.state

    # -- loss scaling -------------------------------------------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a device tensor (1 without loss scaling)."""
        if self.grad_scaler is None:
            return torch.ones((), dtype=torch.float32, device=current_device())
        return self.grad_scaler.scale_tensor

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: ``loss`` times the loss scale (``config.grad_scale_func``)."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale_tensor

    def _unscale_and_check_for_inf(self) -> torch.Tensor:
        """Divide the main gradients by the loss scale; a bool device tensor, True if any rank found an
        Inf or NaN."""
        grads = self._main_grads(for_norm=False)
        found_inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else current_device())
        unscale_and_check(grads, self.grad_scaler.inv_scale_tensor, found_inf)
        group = self._grad_stats_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf.reshape(()) > 0

    # -- parameters -----------------------------------------------------------------------------------
    @property
    def shards(self) -> list[ParamShard]:
        """What this optimizer steps: one :class:`ParamShard` per parameter (or, in the distributed
        optimizer, per part of a parameter this data-parallel rank owns)."""
        return list(self._shards)

    def get_parameters(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps on (main parameters), in group order."""
        return [s.main_param for s in self._shards]

    def get_main_param(self, model_param: nn.Parameter) -> torch.Tensor:
        """The tensor stepped on for ``model_param`` (itself where it is stepped in its own dtype)."""
        for s in self._shards:
            if s.model_param is model_param:
                return s.main_param
        raise KeyError("parameter is not managed by this optimizer")

    # -- gradients ----------------------------------------------------------------------------------
    def _grad_stats_group(self):
        """The group gradient statistics (norm, zeros, overflow) are summed over."""
        return grad_stats_group(self.groups)

    def prepare_grads(self) -> None:
        """Give every main parameter its gradient: the model's ``main_grad`` (data-parallel buffer,
        already reduced) if it has one, else ``.grad``; cast to fp32 for 16-bit models."""
        self._zero_unwritten_grads()
        for s in self._shards:
            grad, model = s.model_grad(), s.model_param
            if s.main_param is model:  # hand the buffer view over as the parameter's own grad
                if grad is not None and grad is not model.grad:
                    model.grad = grad if grad.dtype == model.dtype else grad.to(model.dtype)
            else:
                s.main_param.grad = None if grad is None else grad.to(s.main_param.dtype)
                model.grad = None  # a 16-bit copy is no longer needed

    def _zero_unwritten_grads(self) -> None:
        """A wrapped chunk's buffers hold last step's values where no gradient came this step until its
        buckets are reduced; a caller that steps without reducing (one process, no
        ``finish_grad_sync``) still reads zeros there."""
        for chunk in self.model_chunks:
            zero = getattr(chunk, "zero_unwritten_grads", None)
            if zero is not None:
                zero()

    def _counted_shards(self) -> list[ParamShard]:
        """The shards this rank counts in global norms (which never changes, so it is kept)."""
        if self._counted is None:
            sharded = self.shards_data_parallel
            self._counted = [
                s
                for s in self._shards
                if param_counts_for_norm(s.model_param, sharded=sharded, groups=self.groups)
            ]
        return self._counted

    def _main_grads(self, for_norm: bool) -> list[torch.Tensor]:
        shards = self._counted_shards() if for_norm else self._shards
        return [s.main_param.grad for s in shards if s.main_param.grad is not None]

    def _grads_for_norm(self) -> tuple[list[torch.Tensor], list[int]]:
        """The gradients this rank counts in global norms, and where each starts in its parameter."""
        shards = [s for s in self._counted_shards() if s.main_param.grad is not None]
        return [s.main_param.grad for s in shards], [s.start for s in shards]

    def _grad_norm_tensor(self) -> torch.Tensor:
        """Global L2 norm of the gradients as a 0-dim float64 device tensor (a collective)."""
        grads, offsets = self._grads_for_norm()
        return get_grad_norm_tensor(grads, 2.0, self._grad_stats_group(), offsets=offsets)

    def get_grad_norm(self) -> float:
        """Global L2 norm of the gradients, each weight counted once across TP, PP (and DP)."""
        return float(self._grad_norm_tensor())

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip all gradients to global norm ``clip_grad``; return the norm before clipping."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self._main_grads(for_norm=False), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        """Zero gradient elements in the whole model (a sign of dead units or underflow)."""
        return count_zeros_fp32(self._main_grads(for_norm=True), self._grad_stats_group())

    def get_params_norm(self) -> float:
        """Global L2 norm of the (main) parameters, each weight counted once (``--log-params-norm``)."""
        return float(self.get_params_norm_tensor())

    def get_params_norm_tensor(self) -> torch.Tensor:
        """:meth:`get_params_norm` as a 0-dim float64 device tensor (a collective, not read by the host)."""
        shards = self._counted_shards()
        params, offsets = [s.main_param for s in shards], [s.start for s in shards]
        return get_grad_norm_tensor(params, 2.0, self._grad_stats_group(), offsets=offsets)

    # -- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """Unscale, clip, step and copy back; skipped (False) on overflow or a non-finite grad norm.

        Megatron's API: the results as Python values, so the host waits for the step. The training
        loop calls :meth:`step_on_device` instead and reads the results only when it logs.
        """
        outcome = self.step_on_device()
        applied, grad_norm, num_zeros = outcome.read()
        self.last_step_overflowed = outcome.overflow is not None and not applied and grad_norm is None
        return applied, grad_norm, num_zeros

    @torch.no_grad()
    def step_on_device(
        self,
        skip: torch.Tensor | None = None,
        lrs: Sequence[torch.Tensor] | None = None,
        gate: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    ) -> StepOutcome:
        """One step decided on the device: unscale (with loss scaling), global norm, clip, skip, update.

        ``skip``: a bool device tensor that also skips the update (a NaN loss, found by the caller).
        ``lrs``: one 0-dim device tensor per parameter group to use as this step's learning rate
        instead of the groups' numbers (fused optimizers only; see ``training`` for why). ``gate``:
        called with the global gradient norm and the overflow flag, returns a bool device tensor that
        also skips the update (result validation holds the state still for a rerun). Every rank
        of the model-parallel group must call this: the norm and overflow checks are collectives.
        """
        self.prepare_grads()
        overflow = None
        if self.grad_scaler is not None:
            overflow = self._unscale_and_check_for_inf()
            self.grad_scaler.update(overflow)
        grad_norm = self._grad_norm_tensor()
        bad = ~torch.isfinite(grad_norm)
        held = None if gate is None else gate(grad_norm, overflow)
        for flag in (overflow, skip, held):
            if flag is not None:
                bad = bad | flag.reshape(())
        coeff = clip_coefficient(self.config.clip_grad, grad_norm) if self.config.clip_grad > 0.0 else None
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            num_zeros = count_zeros_tensor(self._main_grads(for_norm=True), self._grad_stats_group())
        if self.fused:
            self._fused_step(bad, coeff, lrs)
        else:
            self._host_decided_step(bad, coeff, lrs)
        self._copy_main_params_to_model_params()
        return StepOutcome(~bad, grad_norm, num_zeros, overflow)

    @property
    def fused(self) -> bool:
        """Whether the inner optimizer is torch's fused kernel, which skips and clips on the device."""
        return bool(self.optimizer.defaults.get("fused"))

    def _fused_step(self, bad: torch.Tensor, coeff: torch.Tensor | None, lrs) -> None:
        """The fused kernel skips on ``found_inf`` and divides gradients by ``grad_scale``: the clip."""
        inner = self.optimizer
        inner.found_inf = bad.to(torch.float32)
        inner.grad_scale = None if coeff is None else coeff.reciprocal().to(torch.float32)
        saved = [group["lr"] for group in inner.param_groups]
        try:
            if lrs is not None:
                for group, lr in zip(inner.param_groups, lrs, strict=True):
                    group["lr"] = lr
            inner.step()
        finally:
            for group, lr in zip(inner.param_groups, saved):
                group["lr"] = lr
            del inner.found_inf, inner.grad_scale

    def _host_decided_step(self, bad: torch.Tensor, coeff: torch.Tensor | None, lrs) -> None:
        """Without a fused kernel: read the skip flag and the factor (one read), clip, step."""
        if lrs is not None:
            raise ValueError("per-step learning-rate tensors need a fused optimizer")
        one = torch.ones((), dtype=torch.float64, device=bad.device)
        skipped, factor = torch.stack([bad.double(), one if coeff is None else coeff]).tolist()
        if skipped:
            return
        grads = self._main_grads(for_norm=False)
        if factor < 1.0 and grads:
            torch._foreach_mul_(grads, factor)
        self.optimizer.step()

    def _copy_main_params_to_model_params(self) -> None:
        """Updated fp32 main parameters into the 16-bit model, all tensors in one multi-tensor copy."""
        pairs = [(s.model_view(), s.main_param) for s in self._shards if s.copy and not s.held_in_fp8]
        if pairs:
            models, mains = zip(*pairs)
            _foreach_copy(list(models), list(mains))

    def reload_model_params(self) -> None:
        """Refresh the fp32 main copies from the model (after loading model weights only)."""
        pairs = [(s.main_param, s.model_view()) for s in self._shards if s.copy and not s.held_in_fp8]
        if pairs:
            with torch.no_grad():
                mains, models = zip(*pairs)
                _foreach_copy(list(mains), list(models))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all ``.grad`` tensors and start the next step of the chunks' data-parallel buffers (not
        zeroed: a step's first gradients overwrite them, :mod:`core.distributed.grad_buffer`); a
        ``main_grad`` outside them is zeroed."""
        wrapped = [chunk for chunk in self.model_chunks if hasattr(chunk, "zero_grad_buffer")]
        if self._in_buffers is None:  # parameters whose main_grad the chunks zero themselves
            self._in_buffers = {id(p) for chunk in wrapped for p in chunk.parameters()}
        covered = self._in_buffers
        for s in self._shards:
            for p in {id(s.model_param): s.model_param, id(s.main_param): s.main_param}.values():
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            main_grad = getattr(s.model_param, "main_grad", None)
            if main_grad is not None and id(s.model_param) not in covered:
                main_grad.zero_()
        for chunk in wrapped:  # last: it may point .grad at the zeroed buffer again
            chunk.zero_grad_buffer()

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Megatron's name for :meth:`param_state_by_name` (copies): the one form of the state."""
        return self.param_state_by_name()

    def load_state_dict(self, state_dict: dict) -> None:
        """Megatron's name for :meth:`load_param_state_by_name`."""
        self.load_param_state_by_name(state_dict)

    def param_state_by_name(self, *, copy: bool = True) -> dict:
        """This rank's optimizer state per parameter name, as flat ranges of each TP-local tensor.

        ``{"param_groups": [...], "params": {name: {"start", "end", "numel", "shape", "exp_avg", ...}},
        "grad_scaler": {...}}``: see :func:`core.optimizer.param_state.export_param_state`. The same
        form for every flavour, so state moves between DP sizes by cutting or joining ranges.
        ``copy=False`` gives views of the live state (no memory allocated), for checkpoints.
        """
        return export_param_state(self._shards, self.optimizer, self.grad_scaler, copy=copy)

    def load_param_state_by_name(self, state: dict) -> None:
        """Load :meth:`param_state_by_name` output; each entry may cover more than this rank's range."""
        import_param_state(
            self._shards, self.optimizer, state, grad_scaler=self.grad_scaler, fused=self.fused
        )


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the inner optimizer steps on the model's parameters directly."""

    def _make_shard(self, param: nn.Parameter) -> ParamShard:
        if param.dtype != torch.float32:
            raise TypeError(
                f"FP32Optimizer got a {param.dtype} parameter; use "
                "Float16OptimizerWithFloat16Params (OptimizerConfig.bf16 or fp16=True)"
            )
        return ParamShard(self._name(param), param, param, 0, param.numel(), False)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16/fp16 model with fp32 main parameters: the inner optimizer steps on fp32 copies.

    ``optimizer`` is built on the model's parameters; each 16-bit one is swapped, in its group, for
    an fp32 clone that carries the same tensor-parallel and tied-weight attributes (unless
    ``main_params_dtype`` is the model's dtype: then it keeps the parameter).
    """

    def _make_shard(self, param: nn.Parameter) -> ParamShard:
        name = self._name(param)
        if param.dtype in (torch.float32, self.config.main_params_dtype):  # stepped as it is
            return ParamShard(name, param, param, 0, param.numel(), False)
        if param.dtype not in _HALF:
            raise TypeError(
                f"cannot optimise a {param.dtype} parameter; expected bfloat16, float16 or float32"
            )
        main = param.detach().clone().float()
        copy_tensor_model_parallel_attributes(main, param)
        for attribute in _COPIED_ATTRIBUTES:
            if hasattr(param, attribute):
                setattr(main, attribute, getattr(param, attribute))
        if param in self.optimizer.state:
            self.optimizer.state[main] = self.optimizer.state.pop(param)
        return ParamShard(name, param, main, 0, param.numel(), True)

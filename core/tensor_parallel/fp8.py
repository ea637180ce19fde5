"""FP8 matrix products for the tensor-parallel linear layers: scaling state, casts and our own autograd.

A linear layer in FP8 multiplies three operands in FP8, each with one float32 scale per tensor (per
block of 128 under the blockwise recipe): its input ``x`` and weight ``w`` forward (E4M3), and in
backward the gradient of its output ``g`` (E4M3 with ``--fp8-format e4m3``, E5M2 with ``hybrid``)::

    y  = x  @ w^T      (x: E4M3, w: E4M3)
    dx = g  @ w        (g: E4M3 / E5M2, w: E4M3)
    dw = g^T @ x       (g and the saved x; in the model's dtype with --no-fp8-wgrad)

Every product is ``torch._scaled_mm`` (:func:`scaled_mm`), which runs on CUDA (sm89 and newer) and on
the CPU, so every numeric test of this module runs on a laptop (a blockwise product is
:func:`~core.tensor_parallel.fp8_blockwise.block_product`; :func:`fp8_product` picks). A scale maps a
tensor's absolute maximum (amax) onto the format's largest value: ``scale = fp8_max / amax /
2**margin``; the product is dequantised by the inverse scales inside the kernel. What the layer saves
for backward is the FP8 input (one byte an element instead of two), unless the weight gradient stays
in the model's dtype.

Recipes decide where the amax comes from:

* ``tensorwise`` (current scaling): the tensor's own amax, now. A tensor split over the tensor-parallel
  ranks (a weight shard, a row-parallel input, a column-parallel output gradient) takes the maximum
  over the TP group, so every TP rank uses the scale of the whole tensor and TP=2 computes what TP=1
  does. An input all-gathered under sequence parallelism is quantised after the gather.
* ``blockwise`` (DeepSeek-V3's): one scale per block of 128 values, 1 x 128 for inputs and output
  gradients, 128 x 128 for weights, from the block's own amax (:mod:`core.tensor_parallel.fp8_blockwise`).
* ``delayed``: the scale comes from an amax history (``--fp8-amax-history-len``, reduced by
  ``--fp8-amax-compute-algo``). Each use records its amax into the step's running maximum; at the end
  of a training step :func:`update_fp8_scales` reduces those maxima over the amax group (TP x DP x CP,
  as Megatron), pushes them onto the history and computes the next step's scales. So every microbatch
  of a step uses the same scales, whatever the pipeline schedule's order, and a recomputed forward
  (full or selective recompute) records the amax it already recorded: it cannot advance anything.
  One history entry is one optimizer step (Transformer Engine advances per forward call). Before the
  first update there is no history: that step uses current scaling, reduced over the amax group.

The weight is cast once per training step: its FP8 copy (and the transposed copy the input gradient's
product takes) are kept until the step ends (:func:`update_fp8_scales`) or the weight changes in place
(``weight._version``), so microbatches after the first reuse them, as Transformer Engine's
``is_first_microbatch`` does. The output gradient is cast once per backward; a zero-bubble split (I
then W) keeps the cast from I for W. CUDA's FP8 products take their second operand column-major, so
the weight gradient needs both the output gradient and the input transposed in memory: each cast
writes its transposed copy too. A cast is a handful of element-wise kernels, which
:func:`compile_fp8_casts` fuses into one (``--compile``: the linear layers themselves stay eager).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from core.device import current_device
from core.tensor_parallel.fp8_blockwise import (
    BLOCK,
    BlockCast,
    block_product,
    quantize_rows,
    quantize_tiles,
    saturated_cast,
    scale_from_amax,
)
from core.tensor_parallel.fp8_config import resolved
from core.tensor_parallel.grad_accumulation import (
    accumulate_weight_grad,
    check_main_grad,
    claim_main_grad,
    engine_will_execute,
    report_accumulated,
)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
INPUT, WEIGHT, GRAD = 0, 1, 2
SHAPE_MULTIPLE = 16
"""CUDA's FP8 products need both dimensions of the second operand and the inner dimension of the
first to be multiples of 16: a layer's input and output features, and for the weight gradient the
tokens of a microbatch on this rank."""


@dataclass(frozen=True)
class Fp8Recipe:
    """What one FP8 linear layer needs to know: formats, scaling and whether W runs in FP8."""

    format: str = "hybrid"
    """"e4m3" or "hybrid" (output gradients in E5M2)."""
    scaling: str = "tensorwise"
    """"tensorwise", "delayed" or "blockwise"."""
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True
    """The weight gradient in FP8 (False: in the model's dtype, from the saved high-precision input)."""

    @property
    def grad_dtype(self) -> torch.dtype:
        return E4M3 if self.format == "e4m3" else E5M2

    def dtype_of(self, operand: int) -> torch.dtype:
        return self.grad_dtype if operand == GRAD else E4M3

    @property
    def blockwise(self) -> bool:
        return self.scaling == "blockwise"

    @classmethod
    def from_config(cls, config) -> Fp8Recipe | None:
        """The recipe an ``Fp8Config`` asks for (None when FP8 is off)."""
        if getattr(config, "fp8", None) is None:
            return None
        return cls(
            format=config.fp8,
            scaling=resolved(config, "fp8_recipe"),
            margin=resolved(config, "fp8_margin"),
            amax_history_len=resolved(config, "fp8_amax_history_len"),
            amax_compute_algo=resolved(config, "fp8_amax_compute_algo"),
            wgrad=config.fp8_wgrad,
        )

    def describe(self) -> str:
        """One phrase for the start report: ``tensorwise, hybrid (E4M3 forward, E5M2 gradients)``."""
        grads = "E4M3" if self.format == "e4m3" else "E5M2"
        scaling = (
            "blockwise (1x128 inputs and gradients, 128x128 weights)" if self.blockwise else self.scaling
        )
        text = f"{scaling}, {self.format} (E4M3 forward, {grads} gradients"
        text += ", weight gradients in the model's dtype)" if not self.wgrad else ")"
        if self.scaling == "delayed":
            text += f", amax history {self.amax_history_len} ({self.amax_compute_algo}), margin {self.margin}"
        return text


# --------------------------------------------------------------------------------------------------
# Casts (plain functions, fused by compile_fp8_casts)
# --------------------------------------------------------------------------------------------------


Operand = "torch.Tensor | BlockCast"
"""FP8 values ``[rows, cols]`` row-major: a tensor (one scale per tensor) or a :class:`BlockCast`."""
Cast = tuple[Operand, "Operand | None", "torch.Tensor | None"]
"""A cast operand: its FP8 values, the same tensor transposed and cast (``[cols, rows]``, or None when
not asked for) and the inverse scale to dequantise the two by (None: the blocks carry their own)."""


def _cast(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Cast:
    """``tensor * scale`` saturated and rounded to ``dtype`` (a 2-D tensor), with its transposed copy
    when ``transpose``: CUDA's FP8 products take their second operand column-major, so a weight
    gradient needs both operands transposed; once compiled, one kernel writes both layouts."""
    values = saturated_cast(tensor, scale, dtype)
    return values, values.t().contiguous() if transpose else None, scale.reciprocal()


def _cast_from_amax(
    tensor: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool
) -> Cast:
    """:func:`_cast` with the scale made from ``amax`` (its arithmetic fused into the cast once compiled)."""
    return _cast(tensor, scale_from_amax(amax, FP8_MAX[dtype], margin), dtype, transpose)


class CastKernels(NamedTuple):
    """The casts a layer's :class:`Fp8State` runs: eager, or compiled with one backend."""

    cast: Callable[..., Cast]
    cast_from_amax: Callable[..., Cast]
    cast_rows: Callable[..., BlockCast]
    """The blockwise recipe's 1 x 128 cast (:func:`~core.tensor_parallel.fp8_blockwise.quantize_rows`)."""
    cast_tiles: Callable[..., BlockCast]
    """Its 128 x 128 cast of a weight."""


EAGER_CASTS = CastKernels(_cast, _cast_from_amax, quantize_rows, quantize_tiles)


@functools.cache
def compiled_casts(backend: str) -> CastKernels:
    """The casts compiled with ``backend``, once per process: shapes are dynamic, so every layer shares
    the compiled code."""
    return CastKernels(*(torch.compile(fn, backend=backend, dynamic=True) for fn in EAGER_CASTS))


def compile_fp8_casts(modules: Iterable[nn.Module], backend: str = "inductor") -> None:
    """Fuse each scaled cast of ``modules``' FP8 layers, its scale's arithmetic and its transposed copy
    into compiled kernels (``--compile``). Only these layers change: a model built later without
    ``--compile`` casts eagerly. The amax is torch's own reduction either way."""
    for _, state in fp8_states(modules):
        state.kernels = compiled_casts(backend)


def held_weight(param: torch.Tensor):
    """``param``'s :class:`~core.tensor_parallel.fp8_params.Fp8Weight` when it is held in FP8
    (``--fp8-param-gather``), else None."""
    return getattr(param, "fp8_weight", None)


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's absolute maximum, a float32 scalar on its device (one reduction kernel, no copy)."""
    return torch.linalg.vector_norm(tensor.detach(), float("inf")).float()


def quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor * scale`` saturated to ``dtype``'s range and rounded to it."""
    return _cast(tensor.detach().reshape(-1, tensor.shape[-1]), scale, dtype, False)[0].view(tensor.shape)


def dequantize(tensor: torch.Tensor, inverse_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (tensor.float() * inverse_scale).to(dtype)


def fp8_product(
    a: Operand,
    a_inverse: torch.Tensor | None,
    b: Operand,
    b_inverse: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b^T`` of two FP8 operands ``[m, K]`` and ``[n, K]`` (every product of a layer has this form:
    CUDA's FP8 kernels take the second operand column-major)."""
    if isinstance(a, BlockCast):
        return block_product(a, b, out_dtype)
    return scaled_mm(a, b.t(), a_inverse, b_inverse, out_dtype)


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm(a, b)`` with per-tensor inverse scales. On a CPU, oneDNN is off for the call:
    torch 2.13 hands a product of two operands of the same FP8 type to oneDNN on a CPU with AMX, and
    oneDNN's FP8 matmul there is its reference loop (``ref:any``: ~300 ms at 128 x 256 x 512, ~130x
    torch's own CPU kernel, which mixed E5M2 x E4M3 products already take). Both accumulate in fp32."""
    if a.device.type != "cpu":
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    onednn = torch.backends.mkldnn.set_flags(_enabled=False, _fp32_precision=None)[0]
    try:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    finally:
        torch.backends.mkldnn.set_flags(_enabled=onednn, _fp32_precision=None)


# --------------------------------------------------------------------------------------------------
# A layer's scaling state
# --------------------------------------------------------------------------------------------------


class Fp8State(nn.Module):
    """One linear layer's FP8 scales, for its three operands (input, weight, output gradient).

    ``amax_history`` ``[3, amax_history_len]`` (most recent first), ``scale`` ``[3]``, ``step_amax`` ``[3]``
    (the maximum seen in the current step) and ``seen`` ``[3]`` (an amax ever recorded) are buffers; the
    checkpoint stores the history, the scales and the count of updates (:func:`fp8_state_dict`). ``sharded[i]``: operand ``i`` is split
    over the TP group, so its tensorwise amax is reduced over it.
    """

    def __init__(
        self,
        recipe: Fp8Recipe,
        tp_group: ProcessGroup | None,
        sharded: tuple[bool, bool, bool],
        *,
        expert: bool = False,
    ) -> None:
        super().__init__()
        self.recipe = recipe
        self.tp_group = tp_group
        self.sharded = sharded
        self.expert = expert
        """A routed MoE expert's: its replicas are the expert-data-parallel ranks, and how many tokens
        reach it differs from rank to rank, so nothing is reduced while it runs."""
        self.amax_group: ProcessGroup | None = None
        """Where the step's amaxes are reduced (delayed recipe; set by :func:`set_amax_group`): TP x DP x
        CP for the dense layers, the expert-data-parallel group for an expert."""
        self.updates = 0
        """Histories pushed so far (a host integer: no device read decides the recipe's branch)."""
        self.steps = 0
        """Training steps ended (:func:`update_fp8_scales`): the optimizer may have changed the weight."""
        device = current_device()
        self.register_buffer(
            "amax_history", torch.zeros(3, recipe.amax_history_len, device=device), persistent=False
        )
        self.register_buffer("scale", torch.ones(3, device=device), persistent=False)
        self.register_buffer("step_amax", torch.zeros(3, device=device), persistent=False)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.bool, device=device), persistent=False)
        fp8_max = [FP8_MAX[recipe.dtype_of(operand)] for operand in (INPUT, WEIGHT, GRAD)]
        self.register_buffer("fp8_max", torch.tensor(fp8_max, device=device), persistent=False)
        self.kernels = EAGER_CASTS
        """The casts this layer runs (:func:`compile_fp8_casts` swaps in compiled ones)."""
        self._weight_key: tuple | None = None
        self._weight: Cast | None = None
        self._weight_amax: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return self.recipe.describe()

    def _reduced(self, amax: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        if group is not None and dist.get_world_size(group) > 1:
            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    def quantize(
        self,
        operand: int,
        tensor: torch.Tensor,
        record: bool,
        transpose: bool,
        amax: torch.Tensor | None = None,
    ) -> Cast:
        """Operand ``operand`` (2-D) cast to its FP8 format (see :data:`Cast`). ``record`` (a training
        step's forward or backward): the delayed recipe adds its amax to the step's maximum.
        ``amax``: the tensor's, when the caller has it already."""
        dtype, tensor = self.recipe.dtype_of(operand), tensor.detach()
        if self.recipe.blockwise:  # each block scales from itself: nothing recorded, nothing reduced
            transposed = self.kernels.cast_rows(tensor.t(), dtype) if transpose else None
            return self.kernels.cast_rows(tensor, dtype), transposed, None
        if self.recipe.scaling == "tensorwise":
            amax = amax_of(tensor) if amax is None else amax
            amax = self._reduced(amax, self.tp_group if self.sharded[operand] else None)
            return self.kernels.cast_from_amax(tensor, amax, dtype, 0, transpose)
        if record or self.updates == 0 or self.expert:
            amax = amax_of(tensor) if amax is None else amax
        if record:  # the step's maximum: recording the same tensor twice (recompute) changes nothing
            torch.maximum(self.step_amax[operand], amax, out=self.step_amax[operand])
        if self.updates > 0:
            scale = self.scale[operand]
            if self.expert:  # an expert no token has reached yet has no history: it scales from itself
                current = scale_from_amax(amax, FP8_MAX[dtype], self.recipe.margin)
                scale = torch.where(self.seen[operand], scale, current)
            return self.kernels.cast(tensor, scale, dtype, transpose)
        # No history yet: this step scales from the tensor itself, agreed over the amax group (an expert's
        # own: its replicas may not all run it).
        group = None if self.expert else self.amax_group if self.amax_group is not None else self.tp_group
        return self.kernels.cast_from_amax(
            tensor, self._reduced(amax, group), dtype, self.recipe.margin, transpose
        )

    def weight_fp8(self, weight: torch.Tensor, record: bool) -> Cast:
        """The weight cast to E4M3 with its transposed copy (the input gradient's product takes it
        column-major), kept until the weight changes in place (its version) or a step ends
        (:func:`update_fp8_scales`), so later microbatches reuse it. A slice of a stacked parameter (an
        MoE expert's, a new view each forward) is known by its parameter and offset."""
        base = weight if weight._base is None else weight._base
        held = held_weight(weight)
        # (no data_ptr: fake tensors have none)
        key = (id(base), weight.storage_offset(), weight._version, self.steps, held and held.casts)
        if key != self._weight_key:
            if held is not None and held.tiled:  # held in FP8 (core.tensor_parallel.fp8_params), in tiles
                tiles = BlockCast(weight.detach(), held.scale_inv, tiled=True)
                self._weight, self._weight_amax = (tiles, tiles.transposed(), None), None
            elif held is not None:  # held in FP8 with one scale: used as it is
                values = weight.detach()
                self._weight, self._weight_amax = (values, values.t().contiguous(), held.scale_inv), None
            elif self.recipe.blockwise:  # 128 x 128 tiles: the transpose has the same tiles
                tiles = self.kernels.cast_tiles(weight.detach(), E4M3)
                self._weight, self._weight_amax = (tiles, tiles.transposed(), None), None
            else:
                self._weight_amax = amax_of(weight)
                self._weight = self.quantize(WEIGHT, weight, record, transpose=True, amax=self._weight_amax)
            self._weight_key = key
        elif record and self.recipe.scaling == "delayed" and self._weight_amax is not None:
            torch.maximum(self.step_amax[WEIGHT], self._weight_amax, out=self.step_amax[WEIGHT])
        return self._weight

    def snapshot(self) -> tuple:
        """The scaling state as copies (no host read): a step run again (result validation) starts
        from it (:meth:`restore`)."""
        buffers = (self.amax_history, self.scale, self.step_amax, self.seen)
        return [b.clone() for b in buffers], self.updates, self.steps

    def restore(self, saved: tuple) -> None:
        tensors, self.updates, self.steps = saved
        for buffer, value in zip(
            (self.amax_history, self.scale, self.step_amax, self.seen), tensors, strict=True
        ):
            buffer.copy_(value)
        self._weight = self._weight_key = self._weight_amax = None  # cast afresh from the restored scale

    @torch.no_grad()
    def push_history(self, step_amax: torch.Tensor) -> None:
        """Append one step's reduced amaxes (``[3]``) to the history and compute the next scales."""
        history = self.amax_history.roll(1, dims=1)
        history[:, 0] = torch.where(torch.isfinite(step_amax), step_amax, 0.0)
        self.amax_history.copy_(history)
        self.seen |= self._scale_from_history() > 0
        self.step_amax.zero_()
        self.updates += 1

    def _scale_from_history(self) -> torch.Tensor:
        """Set the scales from the history by the recipe's algorithm and margin; returns the amaxes used.
        An operand unseen all history long keeps its scale (after the first update)."""
        history = self.amax_history
        amax = history.amax(dim=1) if self.recipe.amax_compute_algo == "max" else history[:, 0]
        new = scale_from_amax(amax, self.fp8_max, self.recipe.margin)
        keep = ~(amax > 0) & (self.updates > 0)
        self.scale.copy_(torch.where(keep, self.scale, new))
        return amax

    def load_saved(
        self, history: torch.Tensor, scale: torch.Tensor, seen: torch.Tensor, updates: int
    ) -> None:
        """Restore a checkpoint's state (:func:`fp8_state_dict`): exactly where the history has this
        recipe's length. A history of another length (``--fp8-amax-history-len`` changed on resume) keeps
        its most recent entries that fit, zeros after them, and the scales are computed from it as the
        next update would (the saved ones came from entries it may have dropped)."""
        length = self.amax_history.shape[1]
        self.amax_history.zero_()
        self.amax_history[:, : min(length, history.shape[1])].copy_(history[:, :length])
        self.scale.copy_(scale)
        self.seen.copy_(seen)
        self.updates = updates
        self.step_amax.zero_()
        if history.shape[1] != length and updates > 0:
            self._scale_from_history()
        self._weight = self._weight_key = self._weight_amax = None  # cast afresh from the loaded scale


# --------------------------------------------------------------------------------------------------
# The product and its autograd
# --------------------------------------------------------------------------------------------------


def _will_compute(ctx, index: int) -> bool:
    """Whether the running backward needs the gradient of the function's ``index``-th input."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    return node is not None and engine_will_execute(node)


class _Fp8Linear(torch.autograd.Function):
    """``F.linear`` with its three products in FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx, input_, weight, bias, state: Fp8State, accumulate: bool, record: bool):
        recipe = state.recipe
        flat = input_.reshape(-1, input_.shape[-1])
        fp8_wgrad = record and recipe.wgrad and weight.requires_grad
        x_fp8, x_t, x_inv = state.quantize(INPUT, flat, record, transpose=fp8_wgrad)
        w_fp8, _, w_inv = state.weight_fp8(weight, record)
        out = fp8_product(x_fp8, x_inv, w_fp8, w_inv, input_.dtype)
        if bias is not None:
            out = out + bias
        ctx.state, ctx.accumulate = state, accumulate
        ctx.input_shape, ctx.dtype, ctx.has_bias = input_.shape, input_.dtype, bias is not None
        ctx.grad_fp8 = None
        # Saved for the weight gradient: the FP8 input, transposed (one byte an element), or the input.
        if fp8_wgrad and recipe.blockwise:
            ctx.save_for_backward(*x_t[:2])  # the values and their block scales
        else:
            ctx.save_for_backward(x_t if fp8_wgrad else flat, x_inv)
        # The weight itself, not saved: recomputation (non-reentrant checkpoint) would hand back a
        # detached alias without the attributes a held weight carries (its scale, main_grad, claims).
        ctx.weight = weight
        return out.view(*input_.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        state = ctx.state
        (saved_input, x_inv), weight = ctx.saved_tensors, ctx.weight
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        need_input, need_weight = _will_compute(ctx, 0), _will_compute(ctx, 1)
        fp8_wgrad = state.recipe.wgrad and weight.requires_grad
        if fp8_wgrad and state.recipe.blockwise:  # saved as its values and block scales
            saved_input, x_inv = BlockCast(saved_input, x_inv), None
        if ctx.grad_fp8 is None:  # a split backward's I casts; its W reuses the transposed cast
            ctx.grad_fp8 = state.quantize(GRAD, grad, record=True, transpose=fp8_wgrad)
        g_fp8, g_t, g_inv = ctx.grad_fp8
        grad_input = grad_weight = grad_bias = None
        if need_input:
            _, w_t, w_inv = state.weight_fp8(weight, record=False)
            grad_input = fp8_product(g_fp8, g_inv, w_t, w_inv, ctx.dtype)
            grad_input = grad_input.view(ctx.input_shape)
        if need_weight:
            grad_weight = _weight_gradient(ctx, grad, g_t, g_inv, saved_input, x_inv, weight)
        # What a later W still needs: the transposed cast (an FP8 weight gradient), else nothing.
        ctx.grad_fp8 = (None, g_t, g_inv) if fp8_wgrad and not need_weight else None
        if ctx.has_bias and _will_compute(ctx, 2):
            grad_bias = grad.sum(0)
        return grad_input, grad_weight, grad_bias, None, None, None


def _weight_gradient(ctx, grad, g_t, g_inv, saved_input, x_inv, weight) -> torch.Tensor | None:
    """``g^T @ x``: in FP8 from both transposed casts when the recipe allows it and the tokens are a
    multiple of 16 (any count in blocks: the last block of tokens may be partial), else in the model's
    dtype; accumulated into ``main_grad`` under gradient-accumulation fusion (None returned)."""
    recipe, tokens = ctx.state.recipe, grad.shape[0]
    out_dtype = weight.main_grad.dtype if ctx.accumulate else weight.dtype
    if recipe.wgrad and (recipe.blockwise or tokens % SHAPE_MULTIPLE == 0):
        dw = fp8_product(g_t, g_inv, saved_input, x_inv, out_dtype)
    else:
        x = dequantize(saved_input.t(), x_inv, ctx.dtype) if recipe.wgrad else saved_input
        if ctx.accumulate:  # as the plain fused path does: into main_grad, in fp32 where the GPU can
            main_grad, overwrite = claim_main_grad(weight)
            accumulate_weight_grad(main_grad, grad, x.to(grad.dtype), overwrite=overwrite)
            report_accumulated(weight)
            return None
        dw = grad.t().matmul(x.to(grad.dtype))
    if not ctx.accumulate:
        return dw.to(weight.dtype)
    main_grad, overwrite = claim_main_grad(weight)
    if overwrite:
        main_grad.copy_(dw)
    else:
        main_grad.add_(dw)
    report_accumulated(weight)
    return None


def fp8_feature_multiple(blockwise: bool) -> int:
    """What a linear layer's features per rank must be multiples of to run in FP8: CUDA's FP8 products
    need 16, and the blockwise recipe's blocks must not straddle two tensor-parallel shards (128)."""
    return BLOCK if blockwise else SHAPE_MULTIPLE


def fp8_shape_problem(recipe: Fp8Recipe, in_features: int, out_features: int, what: str) -> str | None:
    """Why a layer with these features cannot run ``recipe``'s FP8 products (``what``: how to name the
    features in the reason), or None (:func:`fp8_feature_multiple`)."""
    multiple = fp8_feature_multiple(recipe.blockwise)
    if in_features % multiple or out_features % multiple:
        return f"{what} ({in_features} in, {out_features} out) are not multiples of {multiple}"
    return None


def fp8_linear(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: Fp8State,
    accumulate: bool = False,
) -> torch.Tensor:
    """``F.linear(input_, weight, bias)`` with FP8 products; ``accumulate``: the weight gradient goes
    into ``weight.main_grad`` (``--gradient-accumulation-fusion``, and always for a weight held in FP8)."""
    # A weight held in FP8 has no gradient of its own dtype: its gradient goes into main_grad.
    accumulate = accumulate or held_weight(weight) is not None
    if accumulate:
        check_main_grad(weight)
    # A forward with gradients is a training step's (recomputed or not): its amaxes count.
    return _Fp8Linear.apply(input_, weight, bias, state, accumulate, torch.is_grad_enabled())


# --------------------------------------------------------------------------------------------------
# A model's FP8 states: the step-end update, the amax group, checkpoints
# --------------------------------------------------------------------------------------------------


def fp8_states(modules: Iterable[nn.Module]) -> Iterator[tuple[str, Fp8State]]:
    """Every FP8 state of ``modules`` (model chunks, wrapped or not) with its module name."""
    for module in modules:
        module = getattr(module, "module", module)
        for name, child in module.named_modules():
            if isinstance(child, Fp8State):
                yield name, child


def set_amax_group(
    modules: Iterable[nn.Module],
    group: ProcessGroup | None,
    expert_group: ProcessGroup | None = None,
    tile_group: ProcessGroup | None = None,
) -> None:
    """Give every FP8 state of ``modules`` the group its amaxes are reduced over: ``group`` (TP x DP x CP)
    for the dense layers, ``expert_group`` (expert data parallel) for routed experts. Under the blockwise
    recipe only weights held in FP8 reduce (each tile's amax), and a tile lies within one tensor-parallel
    shard: its dense layers take ``tile_group`` (DP x CP), the ranks holding the same shard."""
    for _, state in fp8_states(modules):
        dense = tile_group if state.recipe.blockwise else group
        state.amax_group = expert_group if state.expert else dense


@torch.no_grad()
def update_fp8_scales(modules: Iterable[nn.Module], group: ProcessGroup | None = None) -> None:
    """End of a training step, before the optimizer step: the weights' FP8 copies are dropped, and
    under the delayed recipe the step's amaxes are reduced (MAX) over each state's amax group (or
    ``group``, when given), one collective per group, pushed onto the histories and the next step's
    scales computed. Every rank of a group holds the same layers, so the collectives line up."""
    every = [s for _, s in fp8_states(modules)]
    for state in every:
        state.steps += 1  # the weight is about to change: its FP8 copies go (and are cast afresh)
        state._weight = state._weight_key = state._weight_amax = None
    by_group: dict[int, tuple[ProcessGroup | None, list[Fp8State]]] = {}
    for state in every:
        if state.recipe.scaling == "delayed":
            reduce_over = group if group is not None else state.amax_group
            if reduce_over is None and not state.expert:
                reduce_over = state.tp_group
            by_group.setdefault(id(reduce_over), (reduce_over, []))[1].append(state)
    for reduce_over, states in by_group.values():  # dense first, then experts: the order of the modules
        amaxes = torch.stack([s.step_amax for s in states])
        if reduce_over is not None and dist.get_world_size(reduce_over) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=reduce_over)
        for state, amax in zip(states, amaxes):
            state.push_history(amax)


def fp8_state_dict(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """The delayed recipe's state by module name, for a checkpoint: ``<name>.amax_history``,
    ``<name>.scale``, ``<name>.seen`` and ``<name>.updates``."""
    out: dict[str, torch.Tensor] = {}
    for name, state in fp8_states(modules):
        if state.recipe.scaling == "delayed":
            out[f"{name}.amax_history"] = state.amax_history.detach().cpu().clone()
            out[f"{name}.scale"] = state.scale.detach().cpu().clone()
            out[f"{name}.seen"] = state.seen.detach().cpu().clone()
            out[f"{name}.updates"] = torch.tensor(state.updates, dtype=torch.int64)
    return out


def load_fp8_state_dict(
    modules: Iterable[nn.Module], saved: dict[str, torch.Tensor]
) -> Counter[tuple[int, int]]:
    """Restore what :func:`fp8_state_dict` saved, by name (:meth:`Fp8State.load_saved`; a state with no
    saved entry starts afresh). Returns how many states were restored per (saved history length, this
    recipe's length): a caller can say when the lengths differ."""
    restored: Counter[tuple[int, int]] = Counter()
    for name, state in fp8_states(modules):
        history = saved.get(f"{name}.amax_history")
        if state.recipe.scaling != "delayed" or history is None:
            continue
        seen = saved.get(f"{name}.seen", history.amax(dim=1) > 0)
        state.load_saved(history, saved[f"{name}.scale"], seen, int(saved[f"{name}.updates"]))
        restored[history.shape[1], state.amax_history.shape[1]] += 1
    return restored

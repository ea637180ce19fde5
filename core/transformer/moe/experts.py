"""A rank's routed experts: whole (never tensor-parallel) MLPs, stacked, looped or as one grouped matmul.

A rank's ``count`` experts are stored stacked, as torchtitan does: one 3-D parameter per projection,
``linear_fc1.weight`` ``[count, out, in]`` (``[W_gate; W_up]`` per expert for a gated unit, the dense
MLP's layout) and ``linear_fc2.weight`` ``[count, hidden, ffn]``, biases ``[count, out]``. Slice ``i``
is expert ``first + i``: it keeps the name the per-expert layout had,
``experts.local_experts.{global index}.linear_fc1.weight``
(:func:`~core.transformer.initialization.unstacked`), so initialisation depends only on (seed,
expert's global index), checkpoints store each expert whole under that name and reshard expert
parallelism by moving names, as pipeline parallelism moves layers, and ``state_dict()`` keeps one
entry per expert under it too (``load_state_dict`` takes either form). Expert parameters carry
Megatron's ``allreduce = False``: their gradients are reduced over the expert-data-parallel group,
not the data-parallel one.

The loop runs expert ``j``'s rows through slice ``j`` (``unbind``: views, one gradient for the stack
in backward); with ``moe_grouped_gemm`` both projections run as one ``torch._grouped_mm`` each on the
stacked weights as they are (nothing is re-stacked), where torch offers it for the device and dtype
(a probe decides once per device, dtype and shape); otherwise, and for a rank that received no
token, the loop. On CPU in fp32 both give bit-identical results. In FP8 (the loop only) each expert
keeps its own scales (``fp8_state[str(global index)]``): how many tokens reach an expert differs
from rank to rank, and is rarely a multiple of 16, so its weight gradient runs in the model's dtype
unless ``moe_router_padding_for_quantization`` pads its rows with zeros (:func:`_linear`). With
``--fp8-param-gather`` the FP8 stacks are held in E4M3 with one scale per expert
(:mod:`core.tensor_parallel.fp8_params`): the loop runs on :func:`held_slices`, each slice's weight
gradient going into its part of the stack's ``main_grad``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from core.device import current_device, param_device
from core.tensor_parallel.fp8 import (
    SHAPE_MULTIPLE,
    Fp8Recipe,
    Fp8State,
    fp8_linear,
    fp8_shape_problem,
    held_weight,
)
from core.tensor_parallel.fp8_params import held_slices
from core.transformer.initialization import mark_init, mark_stacked, unstacked
from core.transformer.mlp import activate

if TYPE_CHECKING:
    from core.transformer.transformer_config import TransformerConfig


def _param(shape: tuple[int, ...], config: TransformerConfig, rule: str, first: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, device=param_device(config), dtype=config.params_dtype))
    param.allreduce = False
    mark_init(param, rule)
    mark_stacked(param, first)
    return param


class ExpertLinear(nn.Module):
    """``y_j = x_j W_j^T (+ b_j)`` for each of experts ``first .. first + count - 1``, their weights
    stacked ``[count, out, in]`` (plain parameters: no tensor parallelism); in FP8 once
    :meth:`enable_fp8` has run (an expert that no token reaches in a microbatch multiplies nothing)."""

    def __init__(
        self,
        count: int,
        in_features: int,
        out_features: int,
        config: TransformerConfig,
        rule: str,
        *,
        first: int,
    ) -> None:
        super().__init__()
        self.first = first
        self.weight = _param((count, out_features, in_features), config, rule, first)
        self.bias = _param((count, out_features), config, "zeros", first) if config.add_bias_linear else None
        self.grouped = config.moe_grouped_gemm
        self.pad_for_fp8 = config.moe_router_padding_for_quantization
        self.fp8_state: nn.ModuleDict | None = None
        """Expert ``first + j``'s FP8 scales under key ``str(first + j)`` (None: high precision)."""

    def enable_fp8(self, recipe: Fp8Recipe) -> str | None:
        """Run these experts' products in FP8; returns why not (they then stay in high precision)."""
        if self.grouped:
            return "--moe-grouped-gemm runs the experts as one grouped product, which has no FP8 form here"
        count, out_features, in_features = self.weight.shape
        why = fp8_shape_problem(recipe, in_features, out_features, "its features")
        if why is not None:
            return why
        self.fp8_state = nn.ModuleDict(
            {
                str(self.first + j): Fp8State(recipe, None, (False, False, False), expert=True)
                for j in range(count)
            }
        )
        return None

    def forward(
        self, x: torch.Tensor | list[torch.Tensor], grouped: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """The loop: ``x`` a list, expert ``j``'s rows ``[n_j, in]`` -> their outputs ``[n_j, out]``; or
        ``grouped = (offsets, rows)``: ``x`` ``[n, in]``, row block ``j`` times expert ``j``'s weight as
        one grouped matmul on the stack -> ``[n, out]``. (Called as a module, so forward pre-hooks run:
        an overlapped parameter all-gather lands before the weights are read.)"""
        if grouped is not None:
            return self._grouped_mm(x, *grouped)
        held = held_weight(self.weight) is not None
        weights = held_slices(self.weight) if held else self.weight.unbind(0)
        biases = self.bias.unbind(0) if self.bias is not None else [None] * len(weights)
        states = list(self.fp8_state.values()) if self.fp8_state is not None else [None] * len(weights)
        pad = self.pad_for_fp8
        return [_linear(piece, w, b, st, pad) for piece, w, b, st in zip(x, weights, biases, states)]

    def _grouped_mm(self, x: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offsets)
        if out.requires_grad:  # its backward needs a contiguous incoming gradient
            out.register_hook(lambda grad: grad.contiguous())
        if self.bias is not None:
            out = out + self.bias[rows]
        return out


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8_state: Fp8State | None, pad: bool
) -> torch.Tensor:
    """One expert's product; in FP8 with ``pad`` (``--moe-router-padding-for-quantization``), its rows
    padded with zeros to a multiple of 16 and the padding dropped from the output."""
    rows = x.shape[0]
    if rows == 0 and held_weight(weight) is not None:  # no product; the slice stays in the graph
        out = _NoRows.apply(x, weight)
        return out if bias is None else out + bias
    if fp8_state is None or rows == 0:
        return F.linear(x, weight, bias)
    extra = -rows % SHAPE_MULTIPLE if pad else 0
    if extra:
        return fp8_linear(F.pad(x, (0, 0, 0, extra)), weight, bias, fp8_state)[:rows]
    return fp8_linear(x, weight, bias, fp8_state)


class _NoRows(torch.autograd.Function):
    """The empty output of an expert no row reached, held in FP8 (``F.linear`` takes no FP8 weight). It
    keeps the slice in the graph, as ``F.linear`` does for a 16-bit one: the stack's backward, which
    reports its gradient, then runs whichever experts a microbatch reaches."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.shape = x.shape
        return x.new_zeros(x.shape[0], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.shape), None


class Experts(nn.Module):
    """Experts ``first, ..., first + count - 1`` of a layer; ``forward(tokens sorted by expert, counts)``.

    ``linear_fc1`` and ``linear_fc2`` hold the stacked weights: ``fc2(act(fc1(x)))`` per expert, or
    the gated ``fc2(act(x W_gate) * (x W_up))``."""

    def __init__(self, config: TransformerConfig, first: int, count: int) -> None:
        super().__init__()
        self.grouped = config.moe_grouped_gemm
        self.activation_func, self.gated = config.activation_func, config.gated_linear_unit
        size, hidden = config.expert_ffn_hidden_size, config.hidden_size
        fc1_out = (2 if self.gated else 1) * size
        self.linear_fc1 = ExpertLinear(count, hidden, fc1_out, config, "normal", first=first)
        self.linear_fc2 = ExpertLinear(count, size, hidden, config, "scaled_normal", first=first)
        self.register_state_dict_post_hook(_unstack_state)
        self.register_load_state_dict_pre_hook(_stack_state)

    def activate(self, intermediate: torch.Tensor) -> torch.Tensor:
        return activate(intermediate, self.activation_func, self.gated)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``tokens`` ``[n, h]``, expert ``j``'s rows contiguous and in order -> ``[n, h]``."""
        if self.grouped and tokens.shape[0] > 0 and _grouped_mm_works(tokens, self):
            return self._grouped(tokens, tokens_per_expert)
        pieces = self.linear_fc1(list(torch.split(tokens, tokens_per_expert, dim=0)))
        return torch.cat(self.linear_fc2([self.activate(piece) for piece in pieces]), dim=0)

    def _grouped(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        rows = torch.repeat_interleave(
            torch.arange(len(counts), device=tokens.device), torch.tensor(counts, device=tokens.device)
        )
        hidden = self.activate(self.linear_fc1(tokens, (offsets, rows)))
        return self.linear_fc2(hidden, (offsets, rows))


def _unstack_state(module: Experts, state: dict, prefix: str, local_metadata) -> None:
    """``state_dict()`` keeps one entry per expert, under the checkpoint's names (Hugging Face mappings,
    and every state dict written before experts were stacked, read them)."""
    for name, param in module.named_parameters():
        key = prefix + name
        if key in state:
            state.update(unstacked(key, param, state.pop(key)))


def _stack_state(
    module: Experts, state: dict, prefix: str, local_metadata, strict, missing, unexpected, errors
):
    """``load_state_dict`` takes the per-expert entries :func:`_unstack_state` writes (or stacked ones)."""
    for name, param in module.named_parameters():
        key = prefix + name
        names = [slice_name for slice_name, _ in unstacked(key, param)]
        if key not in state and all(n in state for n in names):
            state[key] = torch.stack([state.pop(n) for n in names])


def _grouped_mm_works(tokens: torch.Tensor, experts: Experts) -> bool:
    """Whether torch has a grouped matmul for this device, dtype and these widths."""
    fc1 = experts.linear_fc1.weight
    return _probe(
        tokens.device.type, tokens.dtype, fc1.shape[2], fc1.shape[1], experts.linear_fc2.weight.shape[2]
    )


@functools.cache
def _probe(device_type: str, dtype: torch.dtype, hidden: int, fc1_out: int, ffn: int) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = current_device() if device_type == current_device().type else torch.device(device_type)
    offsets = torch.tensor([1, 2], dtype=torch.int32, device=device)
    try:
        for k, n in ((hidden, fc1_out), (ffn, hidden)):
            x = torch.zeros((2, k), dtype=dtype, device=device, requires_grad=True)
            w = torch.zeros((2, n, k), dtype=dtype, device=device, requires_grad=True)
            out = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
            out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True

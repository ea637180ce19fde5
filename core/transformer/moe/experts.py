"""A rank's routed experts: whole (never tensor-parallel) MLPs, run as a loop or as one grouped matmul.

Each expert is an MLP of its own, kept in a ModuleDict under its *global* index, so parameter names
read ``experts.local_experts.{global index}.linear_fc1.weight`` on whichever expert-parallel rank
holds it: a name always means one expert, initialisation depends only on (seed, name), and
checkpoints reshard expert parallelism by moving names, as pipeline parallelism moves layers.
``linear_fc1.weight`` is ``[W_gate; W_up]`` for a gated unit (the dense MLP's layout), ``linear_fc2``
maps back to the hidden size. Expert parameters carry Megatron's ``allreduce = False``: their
gradients are reduced over the expert-data-parallel group, not the data-parallel one.

With ``moe_grouped_gemm`` the experts' weights are stacked and both projections run as one
``torch._grouped_mm`` each, where torch offers it for the device and dtype (a probe decides once
per device, dtype and shape); otherwise, and for a rank that received no token, a loop over the
experts. On CPU in fp32 both give bit-identical results.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from core.device import current_device
from core.tensor_parallel.fp8 import SHAPE_MULTIPLE, Fp8Recipe, Fp8State, fp8_linear
from core.transformer.initialization import mark_init
from core.transformer.mlp import activate

if TYPE_CHECKING:
    from core.transformer.transformer_config import TransformerConfig


def _param(shape: tuple[int, ...], config: TransformerConfig, rule: str) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, device=current_device(), dtype=config.params_dtype))
    param.allreduce = False
    mark_init(param, rule)
    return param


class ExpertLinear(nn.Module):
    """``y = x W^T (+ b)`` for one expert (plain parameters: no tensor parallelism), in FP8 once
    :meth:`enable_fp8` has run (a microbatch that routes no token to the expert multiplies nothing)."""

    def __init__(self, in_features: int, out_features: int, config: TransformerConfig, rule: str) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), config, rule)
        self.bias = _param((out_features,), config, "zeros") if config.add_bias_linear else None
        self.grouped = config.moe_grouped_gemm
        self.fp8_state: Fp8State | None = None

    def enable_fp8(self, recipe: Fp8Recipe) -> str | None:
        """Run this expert's products in FP8; returns why not (it then stays in high precision)."""
        if self.grouped:
            return "--moe-grouped-gemm runs the experts as one grouped product, which has no FP8 form here"
        out_features, in_features = self.weight.shape
        if in_features % SHAPE_MULTIPLE or out_features % SHAPE_MULTIPLE:
            return (
                f"its features ({in_features} in, {out_features} out) are not multiples of {SHAPE_MULTIPLE}"
            )
        self.fp8_state = Fp8State(recipe, None, (False, False, False), expert=True)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_state is not None and x.shape[0] > 0:
            return fp8_linear(x, self.weight, self.bias, self.fp8_state)
        return F.linear(x, self.weight, self.bias)


class ExpertMLP(nn.Module):
    """One expert: ``fc2(act(fc1(x)))``, or the gated ``fc2(act(x W_gate) * (x W_up))``."""

    def __init__(self, config: TransformerConfig, ffn_hidden_size: int) -> None:
        super().__init__()
        self.activation_func, self.gated = config.activation_func, config.gated_linear_unit
        branches = 2 if self.gated else 1
        self.linear_fc1 = ExpertLinear(config.hidden_size, branches * ffn_hidden_size, config, "normal")
        self.linear_fc2 = ExpertLinear(ffn_hidden_size, config.hidden_size, config, "scaled_normal")

    def activate(self, intermediate: torch.Tensor) -> torch.Tensor:
        return activate(intermediate, self.activation_func, self.gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activate(self.linear_fc1(x)))


class Experts(nn.Module):
    """Experts ``first, ..., first + count - 1`` of a layer; ``forward(tokens sorted by expert, counts)``."""

    def __init__(self, config: TransformerConfig, first: int, count: int) -> None:
        super().__init__()
        self.grouped = config.moe_grouped_gemm
        size = config.expert_ffn_hidden_size
        self.local_experts = nn.ModuleDict({str(first + i): ExpertMLP(config, size) for i in range(count)})

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``tokens`` ``[n, h]``, expert ``j``'s rows contiguous and in order -> ``[n, h]``."""
        experts = list(self.local_experts.values())
        if self.grouped and tokens.shape[0] > 0 and _grouped_mm_works(tokens, experts[0]):
            return self._grouped(tokens, tokens_per_expert, experts)
        pieces = torch.split(tokens, tokens_per_expert, dim=0)
        return torch.cat([expert(piece) for expert, piece in zip(experts, pieces)], dim=0)

    @staticmethod
    def _grouped(tokens: torch.Tensor, counts: list[int], experts: list[ExpertMLP]) -> torch.Tensor:
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        rows = torch.repeat_interleave(
            torch.arange(len(counts), device=tokens.device), torch.tensor(counts, device=tokens.device)
        )
        hidden = _grouped_linear(tokens, [e.linear_fc1 for e in experts], offsets, rows)
        hidden = experts[0].activate(hidden)
        return _grouped_linear(hidden, [e.linear_fc2 for e in experts], offsets, rows)


def _grouped_linear(
    x: torch.Tensor, linears: list[ExpertLinear], offsets: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Row block ``j`` of ``x`` times expert ``j``'s weight, as one grouped matmul."""
    weights = torch.stack([linear.weight for linear in linears]).transpose(1, 2)  # [experts, in, out]
    out = torch._grouped_mm(x, weights, offs=offsets)
    if out.requires_grad:  # its backward needs a contiguous incoming gradient
        out.register_hook(lambda grad: grad.contiguous())
    if linears[0].bias is not None:
        out = out + torch.stack([linear.bias for linear in linears])[rows]
    return out


def _grouped_mm_works(tokens: torch.Tensor, expert: ExpertMLP) -> bool:
    """Whether torch has a grouped matmul for this device, dtype and these widths."""
    fc1 = expert.linear_fc1.weight
    return _probe(
        tokens.device.type, tokens.dtype, fc1.shape[1], fc1.shape[0], expert.linear_fc2.weight.shape[1]
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

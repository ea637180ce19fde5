"""The feed-forward block: ``fc2(act(fc1(x)))``, or the gated ``fc2(act(x W_gate) * (x W_up))``.

fc1 is column-parallel and fc2 row-parallel, so the block needs one all-reduce each way. For a
gated unit the gate and up projections are one ColumnParallelLinear of ``2 * ffn_hidden_size``
rows whose full weight is ``[W_gate; W_up]`` and whose ``partition_stride`` is 2: rank ``r`` holds
``[W_gate shard r; W_up shard r]`` (``shard_of`` cuts exactly that), so the gate and up rows that
multiply each other are always on the same rank. Megatron lays out its SwiGLU fc1 the same way.

SwiGLU runs as one autograd function (:class:`SwiGLU`), as Megatron's fused ``bias_swiglu`` does: it
keeps only fc1's output for backward (not also ``silu(gate)``) and writes the gate's and the up
branch's gradients straight into the two halves of one tensor, where autograd would compute them
apart and then concatenate them (a copy of fc1's whole output gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from core.transformer.initialization import linear_pair
from core.transformer.transformer_config import TransformerConfig


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` for ``x = [gate, up]`` along the last dimension; the same numbers as autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = torch.chunk(grad_x, 2, dim=-1)
        torch.mul(grad, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_x


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1's output ``[..., 2 * ffn]`` (gate first, then up): ``[..., ffn]``.

    Under ``torch.compile`` it is the plain expression, which the compiler fuses itself (Dynamo cannot
    trace :class:`SwiGLU`'s backward, whose ``out=`` writes would break the layer's graph in two)."""
    if torch.compiler.is_compiling():
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up
    return SwiGLU.apply(x)


class MLP(nn.Module):
    """``[s, b, h]`` -> ``[s, b, h]`` (sequence-sharded in and out under sequence parallelism).

    ``ffn_hidden_size`` overrides the config's inner size (an MoE layer's shared experts); ``tp_group``
    is the tensor-parallel group (None: ``parallel_state``'s, Megatron's default)."""

    def __init__(
        self,
        config: TransformerConfig,
        ffn_hidden_size: int | None = None,
        tp_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        ffn_hidden_size = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.activation_func = config.activation_func
        self.gated = config.gated_linear_unit
        branches = 2 if self.gated else 1
        self.linear_fc1, self.linear_fc2 = linear_pair(
            config,
            branches * ffn_hidden_size,
            ffn_hidden_size,
            column_bias=config.add_bias_linear,
            column_stride=branches,
            tp_group=tp_group,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.linear_fc1(hidden)
        output, _ = self.linear_fc2(activate(intermediate, self.activation_func, self.gated))
        return output


def activate(intermediate: torch.Tensor, activation_func, gated: bool) -> torch.Tensor:
    """fc1's output through the activation: ``act(x)``, or ``act(gate) * up`` for a gated unit (SwiGLU
    as one function). Shared by the MLP and the MoE experts."""
    if gated and activation_func is F.silu:
        return swiglu(intermediate)
    if gated:
        gate, up = torch.chunk(intermediate, 2, dim=-1)
        return activation_func(gate) * up
    return activation_func(intermediate)

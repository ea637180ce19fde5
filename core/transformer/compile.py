"""``--compile``: ``torch.compile`` on each transformer layer, with the linear layers left out.

What compiling a layer buys is fusion of the element-wise work between its matrix products (norms,
RoPE, the activation, dropout and the residual adds); the products themselves and attention are
the same library kernels either way. So a compiled layer is compiled everywhere except in its
tensor-parallel linear layers when they communicate (TP > 1), cast to FP8 or accumulate into
``main_grad`` themselves: those run eagerly, and Dynamo breaks the graph around each of them (four
breaks a layer, five compiled regions). At TP=1 a plain linear layer is one ``F.linear`` and compiles
with its layer, which is then one region (fewer guards and wrapper calls a step, and the bias and
activation fused into the product's epilogue where the compiler can). That one choice gives the rest:

* tensor and sequence parallelism: every collective lives in a linear layer (or the loss), so the
  compiled regions never communicate and need no traceable collectives;
* zero-bubble schedules: a compiled region is one autograd node whose backward cannot be split, so
  ``backward_split`` would run it in I and again in W. The weight-gradient matmuls are outside those
  nodes; the regions that hold parameters hold only norms, whose backward is all that W repeats;
* ``--gradient-accumulation-fusion`` works unchanged (the linear layers' own backward);
* recomputation: full recompute checkpoints around the compiled layer (the recomputation calls
  it again), selective recompute keeps core attention's checkpoint eager;
* context parallelism: core attention (``SelfAttention.core``, where the ring or the all-to-all
  runs) stays eager, so no compiled region communicates.

A module can ask to stay eager the same way (``keep_out_of_compile = True`` on its class), or name
some of its methods (``eager_methods``), which is what parts with data-dependent shapes or
communication want: an MoE layer's router and its dispatch, experts and combine. Variable sequence
lengths: the caller marks the sequence dimension dynamic (:func:`mark_sequence_dynamic`), so a new
length does not recompile.
"""

from __future__ import annotations

import torch
from torch import nn


def _eager(fn, sequence_dim: int | None):
    """``fn`` run outside the compiled regions; with ``sequence_dim``, the sequence dimension of its
    activation outputs is marked dynamic, so the region that takes them over needs no recompile."""

    def eager(*args, **kwargs):
        out = fn(*args, **kwargs)
        if sequence_dim is not None:
            for tensor in out if isinstance(out, tuple) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                    _mark(tensor, sequence_dim)
        return out

    return torch.compiler.disable(eager, recursive=True)


def compile_layer(
    layer: nn.Module, backend: str, *, split_backward: bool = False, dynamic_sequence: bool = False
) -> None:
    """Compile ``layer``'s call in place (its state dict keeps its names); eager parts stay eager.

    ``split_backward`` (zero-bubble schedules): every module that owns parameters stays eager, so
    that autograd computes its input and weight gradients apart in I and W; the compiled regions
    then hold no parameters and W repeats nothing of them. ``dynamic_sequence`` (variable sequence
    lengths): the eager parts mark the sequence dimension of what they return dynamic.
    """
    import torch._dynamo  # noqa: F401  (imported here: a run without --compile never loads the compiler)
    from torch._functorch import config as functorch_config

    for module in layer.modules():
        owns_parameters = any(True for _ in module.parameters(recurse=False))
        if getattr(module, "keep_out_of_compile", False) or (split_backward and owns_parameters):
            module.forward = _eager(module.forward, 0 if dynamic_sequence else None)
        for name in getattr(module, "eager_methods", ()):
            setattr(module, name, _eager(getattr(module, name), 0 if dynamic_sequence else None))
    # The zero-bubble split back-propagates through a region twice (I keeps the graph for W);
    # AOTAutograd's donated buffers would forbid that.
    functorch_config.donated_buffer = False
    attention = getattr(layer, "self_attention", None)
    # Core attention stays eager under selective recompute (its checkpoint) and under context
    # parallelism (it talks to the other CP ranks: ring or all-to-all). [b, h, s, d] out.
    if attention is not None and (
        getattr(attention, "recompute_core", False) or getattr(attention, "cp_comm_type", None) is not None
    ):
        attention.core = _eager(attention.core, 2 if dynamic_sequence else None)
    layer.compile(backend=backend)


def compile_function(fn, backend: str):
    """``torch.compile(fn)`` with the configured backend (the loss)."""
    return torch.compile(fn, backend=backend)


def mark_sequence_dynamic(*tensors: torch.Tensor | None) -> None:
    """Mark dim 0 (the sequence of ``[s, b, ...]`` activations and RoPE tables) dynamic for Dynamo."""
    for tensor in tensors:
        if tensor is not None:
            _mark(tensor, 0)


def _mark(tensor: torch.Tensor, dim: int) -> None:
    import torch._dynamo

    if tensor.shape[dim] > 1:  # Dynamo specialises sizes 0 and 1 whatever it is told
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def compile_stats() -> dict[str, float | int]:
    """What Dynamo did in this process so far: graphs compiled, graph breaks and compile seconds."""
    from torch._dynamo import utils

    counters = utils.counters
    metrics = getattr(utils, "compilation_time_metrics", {})
    seconds = sum(metrics.get("_compile.compile_inner", []))
    seconds += sum(sum(v) for k, v in metrics.items() if k.endswith("bw_compiler"))
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "compile_seconds": float(seconds),
    }

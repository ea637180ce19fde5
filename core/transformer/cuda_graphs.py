"""``--cuda-graph-impl local``: each decoder layer's forward and backward replayed from CUDA graphs.

Where the matrix products are small, a step is bound by the host: every kernel launch costs a few
microseconds of Python and dispatcher time. A CUDA graph records a layer's kernels once and replays
them with one launch. Megatron's "local" implementation captures per transformer layer; so does this
one, with ``torch.cuda.make_graphed_callables`` (a graphed forward and a graphed backward, joined in
one autograd node). What that choice gives and what it costs:

* pipeline messages stay outside the graphs: they are sent between stages, never inside a layer;
* a graph is valid for one input shape: each layer keeps graphs per (shapes, dtypes) of its inputs,
  captured on first use of a shape after ``cuda_graph_warmup_steps`` eager calls with that shape, and
  at most ``max_graphs`` per layer; past the cap the layer runs eagerly and one note says so;
* a graph's inputs, intermediates and outputs live in static buffers, so a microbatch in flight (its
  forward replayed, its backward not yet) holds its graph: a schedule with ``k`` microbatches in
  flight on a stage uses ``k`` graphs of a shape per layer, each freed when its backward has run;
* dropout from the default CUDA generator is graph-safe (torch registers that generator with each
  capture, so every replay draws new numbers); the tensor-parallel RNG tracker swaps generator states
  from Python and is not, so dropout drawn from it is refused (:func:`cuda_graph_problems`);
* ``--gradient-accumulation-fusion`` writes ``main_grad`` from Python-decided code (the step's first
  write overwrites, later ones add, and each write tells the data-parallel bucket): a graph would
  bake one decision in. Inside a graphed layer the linear layers therefore return their weight
  gradients to autograd and the data-parallel hook accumulates them outside the graph (same numbers);
* what a graph cannot hold is refused: data-dependent shapes (MoE routing), recomputation, a
  backward split into input and weight gradients (zero-bubble schedules, whose W would replay a graph
  a later forward has overwritten), FP8 layers and ``--compile`` (not built yet).

A graph hands its gradients out in its static buffers, overwritten by its next replay: the
data-parallel wrapper copies or adds them into ``main_grad`` at once (and lets ``.grad`` go, or points it
at ``main_grad``), which every model ``pretrain()`` builds has; a bare module must clear ``.grad``
between backwards. Evaluation, generation and anything without autograd run the eager layer. On a CPU nothing is
captured: CUDA graphs need CUDA, and the run says so once at start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import nn

from core.pipeline_parallel.schedule_rules import schedule_rule
from core.problems import Problem, problem

CudaGraphImpl = Literal["none", "local"]
CUDA_GRAPH_IMPLS = get_args(CudaGraphImpl)
MEGATRON_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration")
"""Megatron's ``--cuda-graph-scope`` values: ``full_iteration`` with its local implementation, the rest
with Transformer Engine's. None given: whole layers, which is what ``local`` captures here."""
MAX_GRAPHS_PER_LAYER = 16
"""Graphs a layer keeps (input shapes times microbatches in flight) before it runs new shapes eagerly."""

_cap_noted = False


def cuda_graphs_off_line(impl: str, device_type: str, backend: str) -> str:
    """The one line a run with ``--cuda-graph-impl`` prints where it computes off CUDA."""
    return (
        f"--cuda-graph-impl {impl}: CUDA graphs need CUDA; this run computes on the {device_type.upper()} "
        f"({backend}) and goes on without them"
    )


def cuda_graph_problems(config: Any, local: bool = True) -> list[Problem]:
    """The settings ``--cuda-graph-impl local`` refuses (``local``: with :func:`local_graph_problems`,
    which only a run on CUDA applies), and graph settings that are not built."""
    out = []
    if config.enable_cuda_graph and config.cuda_graph_impl != "none":
        out.append(
            problem(
                "{enable_cuda_graph} is Megatron's older spelling of {cuda_graph_impl} local: give one of them, "
                "not both",
                "enable_cuda_graph",
                "cuda_graph_impl",
            )
        )
    if config.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
        out.append(
            problem(
                "{cuda_graph_impl} must be one of {impls}, got {impl!r}",
                "cuda_graph_impl",
                impls=CUDA_GRAPH_IMPLS,
                impl=config.cuda_graph_impl,
            )
        )
    for scope in config.cuda_graph_scope:
        out.append(_scope_problem(scope))
    if config.cuda_graph_warmup_steps < 0:
        out.append(
            problem(
                "{cuda_graph_warmup_steps} must be >= 0, got {n}",
                "cuda_graph_warmup_steps",
                n=config.cuda_graph_warmup_steps,
            )
        )
    return out + (local_graph_problems(config) if local else [])


def local_graph_problems(config: Any) -> list[Problem]:
    """What ``--cuda-graph-impl local`` cannot capture in ``config`` (none for another implementation):
    the rules a run that computes on CUDA applies; a run elsewhere captures nothing."""
    return _local_problems(config) if config.cuda_graph_impl == "local" else []


def _scope_problem(scope: str) -> Problem:
    if scope == "full_iteration":
        return problem(
            "{cuda_graph_scope} full_iteration (the whole forward-backward in one graph) is not built yet; "
            "{cuda_graph_impl} local captures each decoder layer",
            "cuda_graph_scope",
            "cuda_graph_impl",
        )
    known = "a Transformer Engine scope" if scope in MEGATRON_SCOPES else "not one of Megatron's scopes"
    return problem(
        "{cuda_graph_scope} {scope!r} is {known}: {cuda_graph_impl} local captures whole decoder layers; "
        "leave {cuda_graph_scope} out",
        "cuda_graph_scope",
        "cuda_graph_impl",
        scope=scope,
        known=known,
    )


def _local_problems(config: Any) -> list[Problem]:
    refused = []
    if config.num_moe_experts:
        refused.append(("{num_moe_experts}", "MoE routing gives data-dependent shapes"))
    if config.recompute_granularity is not None:
        refused.append(("{recompute_granularity}", "recomputation runs forward again inside backward"))
    if config.compile:
        refused.append(("{compile}", "compiled layers under graphs are not built yet"))
    if config.fp8 is not None:
        refused.append(("{fp8}", "FP8 layers under graphs are not built yet"))
    if schedule_rule(config.pipeline_schedule).split_backward:
        refused.append(
            (
                "{pipeline_schedule} " + config.pipeline_schedule,
                "its W would replay a graph a later F overwrote",
            )
        )
    tracker = "draws from the RNG tracker, which is not graph-safe"
    if config.attention_dropout > 0:
        refused.append(
            ("{attention_dropout} > 0", f"attention dropout {tracker}; set {{attention_dropout}} 0")
        )
    if config.hidden_dropout > 0 and config.sequence_parallel:
        refused.append(
            (
                "{hidden_dropout} > 0 under {sequence_parallel}",
                f"that dropout {tracker}; set {{hidden_dropout}} 0",
            )
        )
    fields = (
        "cuda_graph_impl",
        "num_moe_experts",
        "recompute_granularity",
        "compile",
        "fp8",
        "pipeline_schedule",
    )
    fields += ("attention_dropout", "hidden_dropout", "sequence_parallel")
    return [
        problem("{cuda_graph_impl} local does not work with " + what + ": " + why, *fields)
        for what, why in refused
    ]


def _inputs(hidden: torch.Tensor, rotary, attention_mask) -> tuple[torch.Tensor, ...]:
    return (hidden, *(rotary or ()), *(() if attention_mask is None else (attention_mask,)))


class _Runner(nn.Module):
    """The layer's eager forward over flat tensor inputs, as a module whose parameters are the layer's
    (``make_graphed_callables`` differentiates a module's inputs and parameters)."""

    def __init__(self, layer: nn.Module, eager: Callable, has_rotary: bool, has_mask: bool) -> None:
        super().__init__()
        self.layer, self.eager, self.has_rotary, self.has_mask = layer, eager, has_rotary, has_mask

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        hidden, rest = inputs[0], list(inputs[1:])
        rotary = (rest.pop(0), rest.pop(0)) if self.has_rotary else None
        return self.eager(hidden, rotary, rest.pop(0) if self.has_mask else None)


class LayerGraphs:
    """Replaces a decoder layer's ``forward``: graphed where it can be, eager elsewhere (see the module
    docstring). ``graphs`` counts what it captured; ``seen`` the calls per input signature."""

    def __init__(
        self, layer: nn.Module, *, warmup_steps: int, max_graphs: int = MAX_GRAPHS_PER_LAYER
    ) -> None:
        self.layer, self.eager = layer, layer.forward
        self.warmup_steps, self.max_graphs = warmup_steps, max_graphs
        self.seen: dict[tuple, int] = {}
        self.free: dict[tuple, list[Callable]] = {}
        self.graphs = 0
        for module in layer.modules():  # the weight gradients go back to autograd (module docstring)
            if getattr(module, "gradient_accumulation_fusion", False):
                module.gradient_accumulation_fusion = False
        layer.forward = self

    def __call__(self, hidden, rotary=None, attention_mask=None, *, inference_context=None) -> torch.Tensor:
        if not self.graphable(hidden, inference_context):
            return self.eager(hidden, rotary, attention_mask, inference_context=inference_context)
        inputs = _inputs(hidden, rotary, attention_mask)
        key = (rotary is not None, attention_mask is not None) + tuple(
            (tuple(t.shape), t.dtype, t.requires_grad) for t in inputs
        )
        calls = self.seen[key] = self.seen.get(key, 0) + 1
        pool = self.free.setdefault(key, [])
        graphed = pool.pop() if pool else None
        if graphed is None and calls > self.warmup_steps:
            graphed = self._capture(key, inputs)
        if graphed is None:
            return self.eager(hidden, rotary, attention_mask)
        self._pre_hooks(inputs)
        out = graphed(*inputs)
        # The graph's buffers belong to this microbatch until its backward has run.
        out.grad_fn.register_hook(lambda *_: pool.append(graphed))
        return out

    def _pre_hooks(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """What the layer's modules run before their forward (the distributed optimizer's wait for its
        parameter all-gather, ``--overlap-param-gather``): a replay runs no module, so it runs them here."""
        for module in self.layer.modules():
            for hook in module._forward_pre_hooks.values():
                hook(module, inputs)

    def graphable(self, hidden: torch.Tensor, inference_context) -> bool:
        """Training with autograd on a CUDA tensor: evaluation and generation run the eager layer."""
        return (
            inference_context is None and self.layer.training and torch.is_grad_enabled() and hidden.is_cuda
        )

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> Callable | None:
        global _cap_noted
        if self.graphs >= self.max_graphs:
            if not _cap_noted:
                _cap_noted = True
                print(
                    f"--cuda-graph-impl local: layer {getattr(self.layer, 'layer_number', '?')} holds "
                    f"{self.max_graphs} CUDA graphs (input shapes x microbatches in flight); new ones run "
                    "eagerly",
                    flush=True,
                )
            return None
        self.graphs += 1
        runner = _Runner(self.layer, self.eager, has_rotary=key[0], has_mask=key[1])
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
        return torch.cuda.make_graphed_callables(runner, sample, num_warmup_iters=2, allow_unused_input=True)


def graph_layers(layers, config: Any, device: torch.device) -> list[LayerGraphs]:
    """Wrap each layer for ``--cuda-graph-impl local`` on a CUDA device; nothing elsewhere."""
    if config.cuda_graph_impl != "local" or device.type != "cuda":
        return []
    return [LayerGraphs(layer, warmup_steps=config.cuda_graph_warmup_steps) for layer in layers]

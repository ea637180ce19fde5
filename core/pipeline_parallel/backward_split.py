"""A stage's backward in two halves, for any ``nn.Module``: input gradient now, weight gradients later.

Zero-bubble schedules send the gradient of a stage's input upstream as soon as they can (``I``) and
compute the gradients of its weights whenever the rank would otherwise idle (``W``). Both halves
run on the autograd graph the forward built; nothing is recomputed:

* ``I`` runs a ``torch.autograd.grad`` from the stage's output to its input only, graph retained.
  Autograd then evaluates just the input-gradient path. Where that path meets a weight's branch
  (the matmul node of a linear layer, the node of a layer norm...) a hook keeps the gradient
  arriving at that node: the *intermediate* gradients.
* ``W`` runs a ``torch.autograd.backward`` from those nodes, with the kept gradients, into the
  parameters only. Gradients accumulate into ``.grad`` as in any backward, and every
  ``register_post_accumulate_grad_hook`` fires, so a data-parallel wrapper that moves gradients
  into its buckets from those hooks sees a bucket become ready after its W, unchanged.

This is PyTorch's ``stage_backward_input`` / ``stage_backward_weight`` idea (torch.distributed.
pipelining), with one difference: W accumulates through autograd (``backward(inputs=params)``)
instead of adding returned gradients by hand, which is what keeps the hooks firing. All three
halves call autograd's engine directly (:func:`_run_engine`).

Parameters are grouped by the intermediate nodes they reach; each group runs its own W backward so
that no node between two groups is evaluated twice. Where one intermediate of a group feeds
another, a hook pins the second's gradient to the kept value so nothing is counted twice. A stage
whose input needs no gradient (the first stage) has nothing to do in ``I``: its W is the whole
backward. Gradients are the same numbers a fused backward computes, in the same order, so the
pipeline stays bit-identical to single-device training (the equivalence tests check it).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_ACCUMULATE_GRAD = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)  # a leaf's node
_ENGINE_RUN_BACKWARD = getattr(
    torch.autograd.graph, "_engine_run_backward", torch.autograd.Variable._execution_engine.run_backward
)


def _run_engine(
    roots: list[GradientEdge],
    grads: list[torch.Tensor],
    *,
    inputs: list[torch.Tensor] = (),
    retain_graph: bool = False,
    accumulate: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """Autograd's engine from gradient edges ``roots`` with ``grads``; returns the ``inputs``' gradients
    when not ``accumulate`` (``torch.autograd.grad``), else accumulates into leaves (``backward``).

    Called directly, as Megatron's ``custom_backward`` does, without ``torch.autograd.backward``'s
    argument handling: every B, I and W calls it once per microbatch, on the critical path of the
    pipeline, and that handling cost about 0.15 ms a call on a 2-core CPU between pipeline actions
    (``tools/bench/schedules.py``). The arguments here are already what the engine takes.
    """
    return _ENGINE_RUN_BACKWARD(
        tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), True, accumulate
    )


@dataclass
class _ParamGroup:
    params: list[torch.nn.Parameter]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class WeightGradients:
    """What ``backward_weight`` needs: the parameter groups with their kept gradients, or, for a stage
    whose input needs no gradient, the whole backward (``roots`` and ``root_grads``)."""

    groups: list[_ParamGroup] = field(default_factory=list)
    roots: list[GradientEdge] = field(default_factory=list)
    root_grads: list[torch.Tensor] = field(default_factory=list)


def fused_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """The whole backward of a stage (B): from ``output`` into every parameter and the input's ``.grad``.

    Starts from the output's gradient edge, so it works after ``deallocate_output`` replaced the
    output's data with a placeholder (``torch.autograd.backward(output)`` would check its shape).
    """
    if output.grad_fn is None and not output.requires_grad:
        return
    grad = torch.ones_like(output) if grad_output is None else grad_output
    _run_engine([get_gradient_edge(output)], [grad])


def backward_input(
    output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor | None
) -> tuple[torch.Tensor | None, WeightGradients]:
    """``I``: the gradient of ``stage_input`` (None if it needs none) and what ``W`` will need.

    ``grad_output`` None means ``output`` is the loss (the last stage). The weights are every leaf
    tensor the output's graph reaches, registered in the module or not (a tied output layer borrows
    the embedding of another chunk): W computes exactly the gradients a fused backward would.
    """
    grad = torch.ones_like(output) if grad_output is None else grad_output
    needs_input = stage_input is not None and stage_input.requires_grad
    if output.grad_fn is None:  # an empty stage returned its input: the gradient passes through
        return (grad if needs_input and output is stage_input else None), WeightGradients()
    if not needs_input:
        return None, WeightGradients(roots=[get_gradient_edge(output)], root_grads=[grad])
    groups = _param_groups(output.grad_fn, _node_of(stage_input))
    if groups is None:  # the output does not depend on the input
        weights = WeightGradients(roots=[get_gradient_edge(output)], root_grads=[grad])
        return torch.zeros_like(stage_input), weights
    handles = []
    try:
        for group in groups:
            group.grads = [None] * len(group.nodes)
            for i, node in enumerate(group.nodes):
                handles.append(node.register_prehook(_keep(group.grads, i)))
        (input_grad,) = _run_engine(
            [get_gradient_edge(output)], [grad], inputs=[stage_input], retain_graph=True, accumulate=False
        )
    finally:
        for handle in handles:
            handle.remove()
    if input_grad is None:
        input_grad = torch.zeros_like(stage_input)
    return input_grad, WeightGradients(groups=groups)


def backward_weight(weights: WeightGradients) -> None:
    """``W``: accumulate the parameters' gradients, firing their post-accumulate hooks."""
    if weights.roots:
        _run_engine(weights.roots, weights.root_grads)
    for group in weights.groups:
        edges, grads = [], []
        for node, kept in zip(group.nodes, group.grads):
            for i, g in enumerate(kept or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        pins = []
        if len(group.nodes) > 1:  # a kept node fed by another kept node must not add that flow again
            pins = [node.register_prehook(_pinned(kept)) for node, kept in zip(group.nodes, group.grads)]
        try:
            _run_engine(edges, grads, inputs=group.params, retain_graph=True)
        finally:
            for pin in pins:
                pin.remove()
    weights.groups.clear()
    weights.roots.clear()
    weights.root_grads.clear()


def _keep(store: list, index: int):
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        store[index] = grad_outputs

    return hook


def _pinned(kept):
    def hook(grad_outputs):
        return kept

    return hook


def _node_of(tensor: torch.Tensor) -> Node:
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's accumulator."""
    return get_gradient_edge(tensor).node


def _param_groups(output_node: Node, input_node: Node):
    """The graph's weights (leaves other than the input) grouped by the nodes where their branch
    joins the input-gradient path.

    None if the output does not depend on the input at all. Nodes keep the order in which they
    were found from the output, so W runs the same way every time.
    """
    consumers: dict[Node, list[Node]] = defaultdict(list)  # the graph with its edges reversed
    order, queue = {output_node: 0}, deque([output_node])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                consumers[child].append(node)
                if child not in order:
                    order[child] = len(order)
                    queue.append(child)
    if input_node not in order:
        return None
    on_path, _ = _reachable(input_node, consumers, stop=set())  # every node between input and output
    groups: list[_ParamGroup] = []
    leaves = [node for node in order if node is not input_node and isinstance(node, _ACCUMULATE_GRAD)]
    for start in leaves:
        param = start.variable
        _, joins = _reachable(start, consumers, stop=on_path)
        touching = [g for g in groups if any(n in joins for n in g.nodes)]
        merged = _ParamGroup(params=[], nodes=[])
        for group in touching:
            merged.params += group.params
            merged.nodes += group.nodes
        merged.params.append(param)
        merged.nodes = sorted(set(merged.nodes) | joins, key=order.__getitem__)
        groups = [g for g in groups if all(g is not t for t in touching)] + [merged]
    return groups


def _reachable(
    start: Node, consumers: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reachable forward (towards the output) from ``start`` without entering ``stop``, and the
    ``stop`` nodes met on the way."""
    reached, met = {start}, set()
    queue = deque([start])
    while queue:
        for parent in consumers[queue.popleft()]:
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met

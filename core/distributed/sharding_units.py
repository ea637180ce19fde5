"""The units ZeRO-3 gathers parameters by, and the hooks that gather and free them.

A unit is one layer: each child of a chunk's outermost ``nn.ModuleList`` or ``nn.ModuleDict`` (the
decoder layers, keyed by their global number; MTP layers). Everything else of the chunk (embedding, final norm, output layer, a tied embedding used
by the output head without calling the embedding module) is the chunk's own unit, whose forward and
backward span the whole chunk's. A unit's parameters fill buckets of their own, so gathering a unit
is gathering its buckets.

Hooks, per unit module (see :mod:`core.distributed.sharded_bucket` for the buckets' side):

* forward pre-hook: gather the unit's buckets;
* forward hook: free them (unless a backward that needs them is pending, or at step scope, where they
  stay until the optimizer step, or for a unit kept after forward, below; an evaluation's forward, in
  eval mode, frees them at either scope) and hang a hook on every output that requires a gradient. The
  first of those to receive its gradient is the start of the unit's backward: it counts a pending
  backward on each bucket and gathers the parameters again (a no-op where they were kept);
* each bucket ends the backward itself when all its parameters' gradients are in (then frees them).

A unit *kept after forward* (``keep_after_forward``) is not freed after a training forward whose output
needs a gradient: its backward follows at once, so freeing would only gather the same bytes again.
Without a pipeline that is the chunk's own unit (whose backward starts as its forward ends, at the
loss) and the last layer (whose backward comes after only the output layer's): FSDP2 keeps its root
module the same way, and torchtitan its last block. The most parameters whole at once stay the chunk's
own and one layer (two with prefetching): the chunk's own unit is whole through every forward and
backward anyway, and the last layer is held on while only the output layer runs (with prefetching the
backward's first gather would have fetched it there anyway).

With ``overlap_param_gather`` each unit also launches the next unit's all-gather (forward order in
forward, reverse order in backward) asynchronously, so it overlaps this unit's compute.

Under activation recompute the recomputed forward runs the same hooks: it gathers (or finds the
parameters already gathered by the pending backward) and frees only when no backward is pending.

Also here: the per-parameter gradient hooks of ZeRO-2/3 (:func:`sharded_grad_hook`, and for layers
that accumulate into ``main_grad`` themselves, ``gradient_accumulation_fusion``,
:func:`sharded_grad_accumulated` and :func:`sharded_main_grad_claim`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from core.distributed.grad_buffer import IDLE
from core.distributed.sharded_bucket import ShardedBucket


def layer_units(module: nn.Module) -> list[nn.Module]:
    """The children of ``module``'s outermost ``nn.ModuleList`` s and ``nn.ModuleDict`` s that hold
    parameters, in module order."""
    units: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                layers = child.values() if isinstance(child, nn.ModuleDict) else child
                units.extend(layer for layer in layers if next(layer.parameters(), None) is not None)
            else:
                visit(child)

    visit(module)
    return units


def unit_of_params(module: nn.Module) -> dict[int, int]:
    """id(parameter) -> its unit: 1 + the index of its layer, or 0 for the chunk's own parameters."""
    units = {}
    for index, layer in enumerate(layer_units(module)):
        for param in layer.parameters():
            units.setdefault(id(param), index + 1)
    return units


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def register_unit_hooks(
    unit: nn.Module,
    buckets: list[ShardedBucket],
    *,
    next_in_forward: list[ShardedBucket] = (),
    next_in_backward: list[ShardedBucket] = (),
    keep_after_forward: bool = False,
) -> list[RemovableHandle]:
    """Gather ``buckets`` before ``unit`` runs forward and before its backward; free them after each
    (after forward, unless ``keep_after_forward`` and a backward will follow: module docstring).

    With prefetching (``overlap_param_gather``), ``next_in_forward`` (the next unit's buckets) start
    their all-gathers as this unit's forward starts, and ``next_in_backward`` (the previous unit's)
    as its backward starts, so each gather overlaps a unit's compute; the next unit's hooks wait.
    """
    refs = [weakref.ref(b) for b in buckets]  # weakly, as every hook the wrapper hangs on the model
    forward_refs = [weakref.ref(b) for b in next_in_forward]
    backward_refs = [weakref.ref(b) for b in next_in_backward]

    def live(which: list = refs) -> list[ShardedBucket]:
        return [b for b in (r() for r in which) if b is not None]

    def before_forward(module: nn.Module, args: Any) -> None:
        for bucket in live():
            bucket.gather_params()
        for bucket in live(forward_refs):
            bucket.gather_params(async_op=True)

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        needing = [t for t in _tensors(output) if t.requires_grad]
        if not (keep_after_forward and needing and module.training):
            for bucket in live():
                bucket.release_params(evaluating=not module.training)
        if not needing:
            return
        started = [False]

        def before_backward(grad: torch.Tensor) -> None:
            if started[0]:
                return
            started[0] = True
            for bucket in live():
                bucket.pending_backward += 1
                bucket.gather_params()
            for bucket in live(backward_refs):
                bucket.gather_params(async_op=True)

        for tensor in needing:
            tensor.register_hook(before_backward)

    # Never traced by torch.compile (--compile compiles each layer with its hooks): they free and
    # allocate storage, communicate and change the parameters' class (a freed one refuses reads).
    before_forward, after_forward = (
        torch.compiler.disable(before_forward),
        torch.compiler.disable(after_forward),
    )
    return [unit.register_forward_pre_hook(before_forward), unit.register_forward_hook(after_forward)]


def sharded_grad_hook(bucket: ShardedBucket):
    """The post-accumulate-grad hook of a ZeRO-2/3 parameter: its gradient of this microbatch goes into
    the bucket's transient full buffer (``param.grad`` is dropped, or at step scope becomes the buffer's
    view, into which autograd adds the later microbatches in place), and the bucket counts it."""
    bucket_ref = weakref.ref(bucket)  # weakly: see DistributedDataParallel._make_ready

    def hook(param: nn.Parameter) -> None:
        bucket = bucket_ref()
        if bucket is None:
            return
        if param.grad_added_to_main_grad:  # a fused layer accumulated and reported it already
            param.grad_added_to_main_grad = False
            return
        if bucket.state != IDLE:
            bucket.check_accumulation_allowed(param)  # raises
        grad = param.grad
        if grad is not None and grad is not param.main_grad:  # else autograd added it in place (step scope)
            param.grad = bucket.accumulate(param, grad)
        bucket.note_grad(param)

    return hook


def sharded_grad_accumulated(bucket: ShardedBucket):
    """``param.grad_accumulated`` under ZeRO-2/3: a fused layer added ``param``'s gradient of this
    microbatch into ``main_grad`` (the bucket, opened when its unit's backward began); count it."""
    bucket_ref = weakref.ref(bucket)

    def ready(param: nn.Parameter) -> None:
        bucket = bucket_ref()
        if bucket is None:
            return
        if bucket.state != IDLE:
            bucket.check_accumulation_allowed(param)  # raises
        bucket.note_grad(param)

    return ready


def sharded_main_grad_claim(bucket: ShardedBucket):
    """``param.claim_main_grad`` under ZeRO-2/3: a fused layer is about to write ``main_grad``; give the
    bucket memory first (it has none between microbatches), ``param``'s region zeroed, so the layer adds
    (False)."""
    bucket_ref = weakref.ref(bucket)

    def claim_main_grad(param: nn.Parameter) -> bool:
        bucket = bucket_ref()
        if bucket is not None:
            bucket.open_for_fused_write(param)
        return False

    return claim_main_grad

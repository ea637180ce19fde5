"""Buckets that keep only this data-parallel rank's shard of the gradients (ZeRO-2), and of the parameters
(ZeRO-3), between uses: Megatron-FSDP's ``optim_grads`` and ``optim_grads_params``.

Built on the distributed optimizer's buckets (ZeRO-1, :mod:`core.distributed.grad_buffer`): a bucket
is padded and cut into DP equal shards the same way, and the optimizer steps the same ranges. What
changes is what stays allocated.

**Gradients (optim_grads and optim_grads_params).** Each bucket owns two gradient tensors:

* ``grad_shard`` (persistent, 1/DP of the bucket): the sum of this rank's shard over every
  microbatch and every data-parallel rank so far; the optimizer steps from it;
* ``grad_data`` (the full bucket, transient): allocated when the first gradient arrives, and freed (its
  storage resized to zero; every ``main_grad`` view survives) once it is reduce-scattered and this
  rank has added its reduced shard into ``grad_shard``.

When that happens is the *scope* (``ReduceOptions.step_scope``, ``--data-parallel-sharding-scope``):

* **step** (the default under pipelining): the full bucket accumulates every microbatch of the step, as
  ZeRO-1's buffer does, and is reduce-scattered once, when every parameter of the bucket has reported
  its gradient in the last microbatch (outside ``no_sync``: the chunk's last backward, the W pass under
  zero-bubble) with ``overlap_grad_reduce``, and otherwise in ``finish_grad_sync``, as ZeRO-1's buckets.
  One reduce-scatter per bucket and step, the same additions in the same order as ZeRO-1; the full
  buckets of a chunk are held from their first gradient to the end of its last backward.
* **microbatch** (the default without pipelining): every microbatch is reduce-scattered on its own,
  once every parameter of the bucket has reported its gradient for that microbatch, so gradient
  accumulation happens in the reduced shards (M reduce-scatters per bucket and step for M
  microbatches), and between microbatches a rank holds 1/DP of the gradients plus at most the buckets
  whose backward is under way and, with ``overlap_grad_reduce``, the ``MAX_IN_FLIGHT`` buckets whose
  asynchronous reduce-scatter has not landed yet. The sum of the per-microbatch reductions is the
  reduction of the sum, up to the order of fp32 additions. A bucket whose parameters do not all get a
  gradient in a microbatch simply keeps accumulating until they do, or until the step's
  ``finish_grad_sync``. Under HSDP with ``overlap_grad_reduce`` the reduction of the last microbatch
  (outside ``no_sync``) is the step's: it launches the bucket's step reduction, as at step scope, so
  that the reduction over the instances can follow it during backward, and a gradient arriving after
  it is refused.

**Parameters (optim_grads_params).** The persistent ``param_shard`` (1/DP) is what the optimizer
updates; ``param_data`` (the full bucket, which every parameter's ``.data`` views) is gathered just
before the bucket's layer runs forward. At step scope it then stays until the optimizer step frees
them all: one gather per bucket and step. At microbatch scope it is freed after the forward, gathered
again when the gradient of that layer's output arrives (the start of its backward), and freed once all
its parameters' gradients are in (without a pipeline the chunk's own weights and the last layer skip the
free after forward, their backward following at once: :mod:`core.distributed.sharding_units`).
``pending_backward`` counts the backwards begun and not finished, so a pipeline schedule that runs other
microbatches' forwards in between (1F1B, interleaved, zero-bubble's I before W) never frees parameters
that a pending backward still needs. Freed storage is resized to zero, so the tensors that autograd
saved in forward are valid again once the parameters are gathered back into the same storage.

**Instances (HSDP).** With N distributed-optimizer instances the microbatch reductions stay inside the
instance; the accumulated shard is summed over (or, outer ``optim``, reduce-scattered across) the N
replicas once per step, after the bucket's last reduction of the step: with ``overlap_grad_reduce``
while backward goes on (:class:`~core.distributed.grad_buffer.InstanceChain`), else in
``finish_grad_sync``; under the outer sharding each instance's updated piece of the parameter shard is
all-gathered across the replicas after the step.

**Reading a freed parameter.** A view of zero-size storage crashes the process when read (a
segmentation fault, no Python error). So while its bucket is freed each parameter changes class to
a subclass of its own (:func:`freed_class`) whose ``__torch_function__`` refuses every operation but
metadata (shape, dtype, device, ``requires_grad``, ``grad``, hooks) with one error naming the
parameter; gathering gives it its class back. Torch consults ``__torch_function__`` for every
Python-level use of a tensor (methods, functions, ``print``, ``.data``), so reads raise and the
code that uses the parameters inside forward and backward pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.distributed as dist
from torch._C import DisableTorchFunctionSubclass

from core.distributed.collectives import all_gather
from core.distributed.grad_buffer import IDLE, LAUNCHED, Bucket, GradBuffer

MAX_IN_FLIGHT = 2
"""Asynchronous microbatch reductions a buffer lets run at once (``overlap_grad_reduce``): each keeps its
full bucket until it lands, so launching a third lands the oldest (``suggested_communication_unit_size``
counts elements instead)."""


_RESIZE_OBSERVERS: list[Callable[[torch.UntypedStorage], None]] = []
"""Called with a storage after :func:`resize_storage` resized it (see :func:`observe_resizes`)."""


@contextmanager
def observe_resizes(observer: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``observer(storage)`` after every resize of a bucket's storage while inside. A storage's
    ``resize_`` does not pass through torch's dispatcher, so a ``TorchDispatchMode`` counting live bytes
    (the planner's dry run) would not see ZeRO-2/3 free and re-allocate their full buckets without it."""
    _RESIZE_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _RESIZE_OBSERVERS.remove(observer)


def resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Resize ``tensor``'s storage to ``nbytes`` (unless it holds that already), and tell the observers:
    every free and re-allocation of a bucket goes through here."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == nbytes:
        return
    storage.resize_(nbytes)
    for observer in _RESIZE_OBSERVERS:
        observer(storage)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory; views of it stay valid objects (reading them waits for ``alloc_storage``)."""
    resize_storage(tensor, 0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give ``tensor`` (and every view of it) its memory back; the contents are undefined."""
    resize_storage(tensor, tensor.numel() * tensor.element_size())


def storage_bytes(tensor: torch.Tensor | None) -> int:
    """The bytes ``tensor``'s storage holds now (0 when freed)."""
    return 0 if tensor is None else tensor.untyped_storage().nbytes()


_METADATA = frozenset(
    [
        *(
            getattr(torch.Tensor, name).__get__
            for name in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout")
        ),
        *(getattr(torch.Tensor, name).__get__ for name in ("ndim", "is_cuda", "is_meta", "is_sparse")),
        *(getattr(torch.Tensor, name).__set__ for name in ("grad", "requires_grad", "data")),
        *(getattr(torch.Tensor, name) for name in ("size", "dim", "numel", "nelement", "element_size")),
        *(getattr(torch.Tensor, name) for name in ("is_floating_point", "requires_grad_", "__hash__")),
        *(getattr(torch.Tensor, name) for name in ("register_hook", "register_post_accumulate_grad_hook")),
    ]
)
"""What a freed parameter still answers: its metadata, never its values."""


def _refuse_reads(cls, func, types, args=(), kwargs=None):
    """``__torch_function__`` of a freed parameter: metadata as usual, any other use one clear error."""
    if func in _METADATA:
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    param = next((a for a in (*args, *(kwargs or {}).values(), *_flat(args)) if isinstance(a, cls)), None)
    raise RuntimeError(
        f"{getattr(param, 'sharded_name', 'a parameter')} is sharded over the data-parallel ranks "
        "(--data-parallel-sharding-strategy optim_grads_params): between uses each rank holds only its "
        "shard, and the whole parameter is gathered only inside its layer's forward and backward; read "
        "it after finish_param_sync() on the model (or through its state_dict())"
    )


def _flat(args) -> list:
    return [x for a in args if isinstance(a, (list, tuple)) for x in a]


@cache
def freed_class(cls: type) -> type:
    """The class a parameter of class ``cls`` takes while its bucket is freed: ``cls`` whose uses other
    than metadata raise (see the module docstring)."""
    return type(f"Freed{cls.__name__}", (cls,), {"__torch_function__": classmethod(_refuse_reads)})


def mark_freed(params, freed: bool) -> None:
    """Give ``params`` the class that refuses reads (``freed``), or their own back."""
    for param in params:
        param.__class__ = freed_class(param.gathered_class) if freed else param.gathered_class


class ShardedBucket(Bucket):
    """A bucket of whole parameters whose full gradient (and, with ``shard_params``, full parameter)
    tensors exist only while in use (see the module docstring). ``grad_data`` and ``param_data`` are
    this bucket's own tensors, so freeing them frees no other bucket's memory."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grad_shard = torch.zeros_like(self.grad_shard)
        self._grad_live = False
        self._in_flight: list = []  # a launched microbatch reduction: [work or None]
        self.in_flight_queue: list[ShardedBucket] = []  # shared by the buffer's buckets (ShardedGradBuffer)
        free_storage(self.grad_data)
        self.shards_params = self.options.shard_params
        self.step_scope = self.options.step_scope
        if self.shards_params:
            self.param_shard = self.param_shard.clone()
            for param, name in zip(self.params, self.names):
                param.gathered_class, param.sharded_name = type(param), name
            free_storage(self.param_data)
            mark_freed(self.params, True)
        self.params_live = not self.shards_params
        self._gather_work = None  # a prefetch in flight
        self.pending_backward = 0
        self._reported: set[int] = set()
        self.reductions = self.gathers = 0  # counted per step, for the traffic report
        self._used = max(self._start_of[id(p)] + p.numel() for p in self.params)  # then padding
        self._unwritten = {}
        for param in self.params:
            param.main_grad_shard = self.shard_views(param)[1]

    def shard_views(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """(parameter, gradient) views of the persistent shards for ``param``'s owned range (empty if none)."""
        owned = self.owned_range(param)
        if owned is None:
            return self.param_shard[:0], self.grad_shard[:0]
        lo, hi = owned
        at = self._start_of[id(param)] + lo - self.dp_rank * self.shard_size
        return self.param_shard[at : at + hi - lo], self.grad_shard[at : at + hi - lo]

    # -- gradients ------------------------------------------------------------------------------
    def open_grad_buffer(self) -> None:
        """Give the full bucket (every ``main_grad`` view) memory, if it has none: at the first gradient
        of a microbatch (the hook's, or a fused layer's through ``param.claim_main_grad``). Nothing is
        zeroed but the padding: every parameter is *unwritten* (:mod:`core.distributed.grad_buffer`), its
        first gradient copied in, and what none reaches zeroed before the reduction."""
        if self._grad_live:
            return
        self._land_reduction()
        alloc_storage(self.grad_data)
        self.grad_data[self._used :].zero_()
        self._unwritten = {id(p): p for p in self.params}
        self._grad_live = True

    def accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        """Add one microbatch's gradient of ``param`` into the full bucket (allocated on first use). What
        ``param.grad`` is to be: at step scope, where the dtypes agree, ``main_grad`` itself, so that
        autograd adds the step's later microbatches into the bucket in place (as ZeRO-1's buffers); else
        None (the bucket may be freed before the next gradient)."""
        self.open_grad_buffer()
        if self.claim(param):
            param.main_grad.copy_(grad)
        else:
            param.main_grad.add_(grad)
        return param.main_grad if self.step_scope and param.main_grad.dtype == param.dtype else None

    def open_for_fused_write(self, param: torch.nn.Parameter) -> None:
        """A fused layer is about to add ``param``'s gradient into ``main_grad``: memory for the bucket,
        and ``param``'s region zeroed if nothing was written there yet."""
        self.open_grad_buffer()
        if self.claim(param):
            param.main_grad.zero_()

    def _free_grad_data(self) -> None:
        """Free the full bucket; no ``param.grad`` is left viewing it, and no region waits to be zeroed."""
        if self.step_scope:
            for param in self.params:
                if param.grad is not None:
                    param.grad = None
        self._unwritten = {}
        free_storage(self.grad_data)

    def note_grad(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient of this microbatch is in. At microbatch scope the bucket's last reduces
        the microbatch; at step scope (and under HSDP at either), with ``overlap_grad_reduce``, the last
        of the last microbatch (outside ``no_sync``) launches the step's reduction, as ZeRO-1's overlap
        does (without it, ``finish_grad_sync`` reduces). Under ZeRO-3 the bucket's last ends the backward
        that gathered the parameters."""
        if self.step_scope and self.options.async_op and self.is_last_microbatch:
            self._ready.add(id(param))
            if len(self._ready) == len(self.params):
                self.start_grad_sync()
        self._reported.add(id(param))
        if len(self._reported) < len(self.params):
            return
        self._reported.clear()
        if not self.step_scope and self.is_last_microbatch and self.options.async_op and self.instances > 1:
            self.start_grad_sync()  # the step's last reduction: HSDP's over the instances can follow
        elif not self.step_scope:
            self._reduce_microbatch()
        if self.shards_params:
            self.pending_backward = max(0, self.pending_backward - 1)
            self.release_params()

    def _reduce_microbatch(self) -> None:
        """Reduce-scatter the full bucket (asynchronously with ``overlap_grad_reduce``); it lands in
        ``grad_shard`` and the bucket is freed when the work completes."""
        if not self._grad_live:
            return
        self._grad_live = False
        work = self._launch_reduction()
        self._in_flight = [work]
        self.reductions += 1
        if work is None:  # done already (synchronous, or nothing to communicate)
            self._land_reduction()
            return
        if self.step_scope:  # one reduction per bucket and step: every full bucket is held anyway
            return
        queue = self.in_flight_queue  # each reduction in flight holds a full bucket: land the oldest
        queue.append(self)
        while len(queue) > 1 and self._too_many_in_flight(queue):
            queue.pop(0)._land_reduction()

    def _too_many_in_flight(self, queue: list[ShardedBucket]) -> bool:
        """More than ``MAX_IN_FLIGHT`` reductions under way, or with ``in_flight_elements`` more full-bucket
        elements than that (Megatron-FSDP's ``suggested_communication_unit_size``)."""
        capacity = self.options.in_flight_elements
        if capacity is None:
            return len(queue) > MAX_IN_FLIGHT
        return sum(bucket.grad_data.numel() for bucket in queue) > capacity

    def _land_reduction(self) -> None:
        """Wait for the reduction in flight, add this rank's reduced shard into ``grad_shard``, free the bucket."""
        if not self._in_flight:
            return
        if self in self.in_flight_queue:
            self.in_flight_queue.remove(self)
        work = self._in_flight.pop()
        if work is not None:
            work.wait()
        lo = self.dp_rank * self.shard_size
        reduced = self.grad_data if self.comm is None else self.comm  # sent in another dtype: cast back here
        self.grad_shard.add_(reduced[lo : lo + self.shard_size])
        self.comm = None
        self._free_grad_data()

    def start_grad_sync(self) -> None:
        """Reduce what is still accumulating (gradients some parameter never completed); a no-op once launched."""
        if self.state != IDLE:
            return
        self._reduce_microbatch()
        self.state = LAUNCHED
        self._chain_instance_reduction()  # HSDP: once a step, on the accumulated shard

    def scale_gradients(self, factor: float) -> None:
        """Multiply this rank's reduced gradients by ``factor``."""
        self.grad_shard.mul_(factor)

    def reset(self) -> None:
        """Back to idle for the next step: no full buffers, zero reduced gradients, counters cleared."""
        if self._in_flight:
            work = self._in_flight.pop()
            if work is not None:
                work.wait()
        if self in self.in_flight_queue:
            self.in_flight_queue.remove(self)
        self._drop_instance_reduction()
        self.comm = None
        self._free_grad_data()
        self._grad_live = False
        self.grad_shard.zero_()
        self.state = IDLE
        self._reported.clear()
        self._ready.clear()
        self.is_last_microbatch = True
        self.reductions = self.gathers = 0

    # -- parameters (ZeRO-3) ------------------------------------------------------------------
    def gather_params(self, async_op: bool = False) -> None:
        """All-gather every rank's parameter shard into ``param_data``; a no-op if it is there.
        ``async_op`` (a prefetch, ``overlap_param_gather``): launch it and return; a later synchronous
        call, or freeing, waits for it."""
        if self.params_live:
            if not async_op:
                self._wait_gather()
            return
        alloc_storage(self.param_data)
        if self.communicate:
            work = all_gather(self.param_data, self.param_shard, self.group, async_op=async_op)
            self._gather_work = work if async_op else None
        else:
            self.param_data.copy_(self.param_shard)
        mark_freed(self.params, False)
        self.params_live = True
        self.gathers += 1

    def _wait_gather(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None

    def in_flight(self) -> list[dist.Work]:
        launched = [work for work in (*self._in_flight, self._gather_work) if work is not None]
        return super().in_flight() + launched

    def release_params(self, force: bool = False, *, evaluating: bool = False) -> None:
        """Free the gathered parameters, unless a backward that needs them is pending or they are held for
        the step (step scope, unless ``evaluating``: a forward in eval mode, after which no optimizer step
        frees them) (``force``: anyway, as after the optimizer step)."""
        if force:
            self.pending_backward = 0
        elif self.step_scope and not evaluating:
            return
        if not self.shards_params or not self.params_live or self.pending_backward:
            return
        self._wait_gather()  # never free memory a collective still writes
        if not self.param_data.untyped_storage().resizable():
            self._rehome_params()
        free_storage(self.param_data)
        mark_freed(self.params, True)
        self.params_live = False

    def _rehome_params(self) -> None:
        """Move the parameters into fresh storage: viewing a tensor through numpy (as a checkpoint writer
        does with whole parameters between steps) makes its storage impossible to resize."""
        fresh = torch.empty_like(self.param_data)
        for param in self.params:
            start = self._start_of[id(param)]
            param.data = fresh[start : start + param.numel()].view(param.shape)
        self.param_data = fresh

    def keep_gathered_params(self) -> None:
        """Copy this rank's range of the gathered parameters into its shard (after they were written whole,
        e.g. by a checkpoint load), then free them."""
        if not self.shards_params or not self.params_live:
            return
        self._wait_gather()
        lo = self.dp_rank * self.shard_size
        self.param_shard.copy_(self.param_data[lo : lo + self.shard_size])
        self.release_params(force=True)

    def start_param_sync(self, async_op: bool) -> None:
        """After the optimizer step: ZeRO-3 frees any gathered copy (the next forward gathers the new
        shards); otherwise all-gather as the distributed optimizer does."""
        if self.shards_params:
            self.release_params(force=True)
            self._gather_over_instances()
        elif self.param_handle is None:
            super().start_param_sync(async_op)
            self.gathers += int(self.communicate)

    def _gather_over_instances(self) -> None:
        """Outer sharding (HSDP with outer ``optim``): each instance stepped its piece of the shard; put
        the pieces together again, so that the shard the next forward gathers is whole."""
        if not (self.options.outer_shard and self.instances > 1):
            return
        lo, hi = self.owned_span()
        base = self.dp_rank * self.shard_size
        all_gather(
            self.param_shard, self.param_shard[lo - base : hi - base], self.inter_group, async_op=False
        )
        self.gathers += 1

    def finish_param_sync(self) -> None:
        """The parameters are whole after this (ZeRO-3 gathers them; freed again after the next step)."""
        if self.shards_params:
            self.gather_params()
        else:
            super().finish_param_sync()


class ShardedGradBuffer(GradBuffer):
    """A gradient buffer of :class:`ShardedBucket` s, each in tensors of its own (freed one at a time)."""

    bucket_class = ShardedBucket
    separate_storage = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        queue: list[ShardedBucket] = []
        for bucket in self.buckets:
            bucket.in_flight_queue = queue

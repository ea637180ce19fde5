"""Contiguous gradient storage for data parallelism: one flat buffer per dtype, cut into buckets.

Every parameter's ``main_grad`` is a view into one flat tensor, so a data-parallel reduction is a
few large collectives instead of one per parameter, and the optimizer and gradient clipping can
treat the whole model's gradients as one tensor. Parameters are laid out in *reverse* module
order, which is roughly the order backward produces their gradients: the first bucket fills up
first, and with ``overlap_grad_reduce`` its reduction runs while backward computes the rest.

With the distributed optimizer (``shard=True``, Megatron's design) three things change:

* each bucket is padded to a multiple of ``lcm(dp, 128)`` elements and cut into ``dp`` equal
  shards; a bucket's gradients are reduce-scattered, so data-parallel rank ``r`` ends up with the
  sum of shard ``r`` only (:mod:`core.distributed.collectives` says what each backend does);
* the parameters move into a second flat buffer with the same layout (``param.data`` becomes a
  view of it), so the updated shards can be all-gathered straight into the parameters;
* a tied word embedding (``shared_embedding``) gets a bucket of its own. Its first-stage and
  last-stage copies are then sharded identically over data parallelism, so after the
  reduce-scatter the embedding group can sum the two copies' shards element by element.

With N distributed-optimizer instances (``inter_group``; megatron-core's
``--num-distributed-optimizer-instances``, HSDP) the bucket is sharded over one instance's DP/N ranks
(its ``group``) and, once reduced there, each shard is all-reduced over its N replicas (``inter_group``):
every instance then steps the same shards, a whole optimizer per instance. With ``outer_shard``
(Megatron-FSDP's outer ``optim``) each shard is padded to a multiple of N, reduce-scattered over the
replicas instead, and each instance steps only its piece of it (:meth:`Bucket.owned_span`). With
``async_op`` the reduction over the instances overlaps backward too (:class:`InstanceChain`).

A parameter built on the meta device (``init_model_with_meta_device``) is given its memory here: its
``deferred_init`` writes its initial values straight into its place in the parameter buffer (or, unsharded
and without one, into memory of its own), so no other copy ever exists; the sharded buckets of
:mod:`core.distributed.sharded_bucket` are laid out one at a time, each keeping only this rank's shard.

A bucket moves through three states per step: idle (gradients accumulating), launched (its
reduction is under way) and done (reduced). ``reset`` returns it to idle.

Buffers are not zeroed between steps (a pass over every gradient, 71 ms a step at GPT-2 small on a
CPU, that the first accumulation then reads back). ``reset`` marks every parameter's ``main_grad``
*unwritten* instead: the step's first gradient of a parameter overwrites it (``claim`` says which
write is the first; the wrapper's hook copies, a fused layer multiplies with ``beta = 0``) and later
ones add. What no gradient reached in a step (an unused MoE expert, a parameter outside the loss) is
zeroed just before the bucket's reduction reads the whole buffer (``zero_unwritten``), so every
region is valid from then on, as if the buffer had been zeroed. Padding is never written: zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from core.device import current_device, materialize
from core.distributed.collectives import all_gather, reduce_scatter, reduce_scatter_is_native
from core.parallel_state import group_rank, group_size
from core.tensor_parallel.fp8_params import held_weight

IDLE, LAUNCHED, DONE = "idle", "launched", "done"
SHARD_ALIGNMENT = 128
"""Buckets of a sharded buffer are padded to a multiple of lcm(dp, this) elements (Megatron's value:
shards start 256-byte aligned in 16-bit precision)."""


@dataclass(frozen=True)
class ReduceOptions:
    """How a buffer's buckets are reduced over the data-parallel group.

    ``pre_scale`` multiplies the gradients before the sum (Megatron's ``gradient_scaling_factor``:
    1/dp to average, 1 for a per-token loss); ``post_scale`` multiplies after it (our stand-in for
    an averaging collective, which gloo lacks). ``shard`` selects reduce-scatter (distributed
    optimizer) over all-reduce.
    """

    pre_scale: float = 1.0
    post_scale: float = 1.0
    async_op: bool = False
    check_for_nan: bool = False
    shard: bool = False
    shard_grads: bool = False
    """Keep only the reduced shard of the gradients between microbatches (ZeRO-2; see
    :mod:`core.distributed.sharded_bucket`)."""
    shard_params: bool = False
    """Keep only the shard of the parameters between uses (ZeRO-3)."""
    comm_dtype: torch.dtype | None = None
    """The dtype a reduction sends (``megatron_fsdp_grad_comm_dtype``): the bucket is cast to it and the
    result cast back; None, or the gradients' own, sends the buffer itself."""
    step_scope: bool = False
    """ZeRO-2/3 at step scope (``data_parallel_sharding_scope``): gradients accumulate in the full bucket
    over the step and are reduce-scattered once, after the last microbatch; ZeRO-3's parameters, once
    gathered, stay until the optimizer step (one gather a step)."""
    in_flight_elements: int | None = None
    """ZeRO-2/3 at microbatch scope: the full-bucket elements the reductions under way may hold together
    (``suggested_communication_unit_size``; None: ``MAX_IN_FLIGHT`` reductions)."""
    outer_shard: bool = False
    """With distributed-optimizer instances (an ``inter_group``): split each shard's optimizer range once
    more over the instances (Megatron-FSDP's outer ``optim``) instead of replicating it."""


class InstanceChain:
    """With N distributed-optimizer instances and overlap: each bucket's reduction over the instances,
    launched once its reduction inside the instance has landed, so that it runs while backward goes on.

    A collective must be issued in the same order on every rank of its group, and a rank cannot ask
    when its peers' reductions land without making the order depend on timing. So the chain issues at
    fixed points of the program, which every replica reaches in the same order: when a bucket's
    reduction is launched, the buckets launched before it take their turn (each waits for its own
    reduction inside the instance, which by then has usually landed, and launches the one over the
    instances); the newest waits for the next launch, or for its ``finish_grad_sync``. One chain per
    model chunk serves all its buffers (dense and expert buckets, which may share one inter-instance
    group).

    Megatron issues both reductions back to back on a side CUDA stream instead; here the device's
    current stream waits for the previous bucket's reduction inside the instance (on a GPU a wait
    between streams, not the host's), as ZeRO-2/3 already do to land their microbatch reductions.
    """

    def __init__(self) -> None:
        self.waiting: list[Bucket] = []

    def launched(self, bucket: Bucket) -> None:
        """``bucket``'s reduction inside the instance was just launched: the ones before it take their turn."""
        while self.waiting:
            self.waiting.pop(0).start_instance_reduction()
        self.waiting.append(bucket)

    def drain_through(self, bucket: Bucket) -> None:
        """``bucket`` and every bucket launched before it take their turn (in launch order)."""
        while bucket in self.waiting:
            self.waiting.pop(0).start_instance_reduction()

    def drop(self, bucket: Bucket) -> None:
        """``bucket`` leaves the chain without its turn (its step was reset)."""
        if bucket in self.waiting:
            self.waiting.remove(bucket)


class Bucket:
    """Whole parameters' gradients in one contiguous slice of a buffer, reduced as one message.

    ``starts[i]`` is where ``params[i]`` begins inside the bucket. With ``options.shard`` the bucket
    (``grad_data``, and ``param_data`` holding the parameters themselves) divides into equal shards,
    one per data-parallel rank.
    """

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        names: list[str],
        starts: list[int],
        grad_data: torch.Tensor,
        param_data: torch.Tensor | None,
        group: ProcessGroup | None,
        options: ReduceOptions,
        inter_group: ProcessGroup | None = None,
    ) -> None:
        self.index = index
        self.params, self.names = params, names
        self._start_of = {id(p): s for p, s in zip(params, starts)}
        self.grad_data, self.param_data = grad_data, param_data
        self.group = group
        self.options = options
        self.dp_size, self.dp_rank = group_size(group), group_rank(group)
        self.communicate = self.dp_size > 1
        self.inter_group = inter_group  # the replicas of this shard, one per distributed-optimizer instance
        self.instances, self.instance_rank = group_size(inter_group), group_rank(inter_group)
        self.shard_size = grad_data.numel() // self.dp_size if options.shard else grad_data.numel()
        if options.shard:
            lo, hi = self.dp_rank * self.shard_size, (self.dp_rank + 1) * self.shard_size
            self.grad_shard, self.param_shard = grad_data[lo:hi], param_data[lo:hi]
            self.native_reduce_scatter = self.communicate and reduce_scatter_is_native(group)
            self.native_inter = self.instances > 1 and reduce_scatter_is_native(inter_group)
        self.is_last_microbatch = True  # False inside DistributedDataParallel.no_sync()
        self.state = IDLE
        self.handle: dist.Work | None = None
        self.param_handle: dist.Work | None = None
        self.instance_handle: dist.Work | None = None  # the reduction over the instances, in flight
        self.comm: torch.Tensor | None = None  # a reduction's copy in options.comm_dtype, until it lands
        self.instance_comm: torch.Tensor | None = None  # the same for the reduction over the instances
        self.instances_reduced = False  # this step's reduction over the instances is launched or done
        self.instance_chain = InstanceChain()  # the model chunk's wrapper gives all its buckets one
        self._ready: set[int] = set()
        self._unwritten: dict[int, torch.nn.Parameter] = {}  # the buffer starts zeroed

    def owned_range(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        """The part ``[start, end)`` of flattened ``param`` in this rank's shard (None if no part is).

        Without sharding a rank owns every parameter whole.
        """
        start, numel = self._start_of[id(param)], param.numel()
        if not self.options.shard:
            return 0, numel
        first, last = self.owned_span()
        lo, hi = max(start, first), min(start + numel, last)
        return (lo - start, hi - start) if lo < hi else None

    def owned_span(self) -> tuple[int, int]:
        """The part ``[lo, hi)`` of the bucket this rank's optimizer steps: its shard, or with the outer
        sharding (``options.outer_shard``) its instance's piece of the shard."""
        lo, size = self.dp_rank * self.shard_size, self.shard_size
        if self.options.outer_shard and self.instances > 1:
            size //= self.instances
            lo += self.instance_rank * size
        return lo, lo + size

    def _reduce_over_instances(self, async_op: bool) -> dist.Work | None:
        """With N distributed-optimizer instances: sum this rank's reduced shard over its N replicas
        (all-reduce), or with the outer sharding give each instance the sum of its own piece
        (reduce-scatter). Once a step; a no-op with one instance or without sharding."""
        if self.instances == 1 or not self.options.shard or self.instances_reduced:
            return None
        self.instances_reduced = True
        shard = self._in_comm_dtype(self.grad_shard)
        self.instance_comm = shard if shard is not self.grad_shard else None
        if not self.options.outer_shard:
            return dist.all_reduce(shard, group=self.inter_group, async_op=async_op)
        lo, hi = self._instance_span()
        return reduce_scatter(
            shard[lo:hi], shard, self.inter_group, native=self.native_inter, async_op=async_op
        )

    def _instance_span(self) -> tuple[int, int]:
        """The part of ``grad_shard`` the reduction over the instances leaves reduced for this rank: all of
        it, or with the outer sharding this instance's piece."""
        if not self.options.outer_shard:
            return 0, self.shard_size
        lo, hi = self.owned_span()
        base = self.dp_rank * self.shard_size
        return lo - base, hi - base

    def _chain_instance_reduction(self) -> None:
        """The bucket's reduction inside the instance was just launched; with overlap, join the chain
        that launches the reductions over the instances (:class:`InstanceChain`)."""
        if self.options.async_op and self.instances > 1 and self.options.shard:
            self.instance_chain.launched(self)

    def start_instance_reduction(self) -> None:
        """The chain's turn (:class:`InstanceChain`): land the reduction inside the instance, launch the
        one over the instances."""
        self._land_reduction()
        self.instance_handle = self._reduce_over_instances(async_op=True)

    def _land_reduction(self) -> None:
        """Wait for the reduction inside the instance, if one is in flight (its result cast back into the
        buffer, if it travelled in another dtype)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        lo = self.dp_rank * self.shard_size if self.options.shard else 0
        _cast_back(self.comm, self.grad_data, lo, lo + self.shard_size)
        self.comm = None

    def _drop_instance_reduction(self) -> None:
        """Out of the chain, the reduction over the instances waited for if in flight, none done (a reset)."""
        self.instance_chain.drop(self)
        if self.instance_handle is not None:
            self.instance_handle.wait()
            self.instance_handle = None
        self.instance_comm = None
        self.instances_reduced = False

    def _finish_instance_reduction(self) -> None:
        """Wait for the reduction over the instances, or run it now if it was never launched."""
        if self.instance_handle is not None:
            self.instance_handle.wait()
            self.instance_handle = None
        self._reduce_over_instances(async_op=False)
        if self.instance_comm is not None:
            _cast_back(self.instance_comm, self.grad_shard, *self._instance_span())
            self.instance_comm = None

    # -- gradients ----------------------------------------------------------------------------
    def claim(self, param: torch.nn.Parameter) -> bool:
        """``param``'s gradient is about to be written into ``main_grad``: True if this is the step's
        first write, which must overwrite the values the last step left rather than add to them."""
        return self._unwritten.pop(id(param), None) is not None

    def zero_unwritten(self) -> None:
        """Zero the ``main_grad`` of every parameter no gradient reached since ``reset``: the whole
        bucket is then this step's gradients (a reduction, or the optimizer, reads all of it)."""
        if self._unwritten:  # this bucket's own views: a parameter two chunks share has one ``main_grad``
            starts = self._start_of
            torch._foreach_zero_(
                [self.grad_data[starts[i] : starts[i] + p.numel()] for i, p in self._unwritten.items()]
            )
            self._unwritten.clear()

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Note that ``param``'s gradient is final for this step; launch the reduction when all are.

        Only the last microbatch counts (outside ``no_sync``): earlier ones keep accumulating.
        """
        if not self.is_last_microbatch:
            return
        if id(param) in self._ready:
            raise RuntimeError(
                f"gradient of {self._name(param)} became ready twice in one step: a parameter "
                "may be backpropagated through only once in the last microbatch when "
                "overlap_grad_reduce is on"
            )
        self._ready.add(id(param))
        if len(self._ready) == len(self.params):
            self.start_grad_sync()

    def start_grad_sync(self) -> None:
        """Launch the reduction (asynchronously with overlap); a no-op if already launched."""
        if self.state != IDLE:
            return
        work = self._launch_reduction()
        self.handle = work if self.options.async_op else None
        self.state = LAUNCHED
        self._chain_instance_reduction()

    def _launch_reduction(self) -> dist.Work | None:
        """Check (``check_for_nan``), pre-scale and reduce ``grad_data``: the work handle, None when done."""
        opts = self.options
        self.zero_unwritten()
        if opts.check_for_nan and not bool(torch.isfinite(self.grad_data).all()):
            rank = dist.get_rank() if dist.is_initialized() else 0
            bad = [n for p, n in zip(self.params, self.names) if not bool(torch.isfinite(p.main_grad).all())]
            raise RuntimeError(
                f"rank {rank}: NaN or Inf in the gradients of {bad} before the data-parallel "
                "reduction (check_for_nan_in_grad)"
            )
        if opts.pre_scale != 1.0:
            self.grad_data.mul_(opts.pre_scale)
        if not self.communicate:
            return None
        data = self._in_comm_dtype(self.grad_data)
        self.comm = data if data is not self.grad_data else None
        if opts.shard:
            lo = self.dp_rank * self.shard_size
            return reduce_scatter(
                data[lo : lo + self.shard_size],
                data,
                self.group,
                native=self.native_reduce_scatter,
                async_op=opts.async_op,
            )
        return dist.all_reduce(data, group=self.group, async_op=opts.async_op)

    def _in_comm_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a reduction of ``tensor`` sends: ``tensor`` itself, or a copy in ``options.comm_dtype``,
        which the landing casts back (:func:`_cast_back`)."""
        dtype = self.options.comm_dtype
        return tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype)

    def finish_grad_sync(self) -> None:
        """Wait for the reduction, launching it first if it never was (e.g. a parameter got no grad)."""
        if self.state == DONE:
            return
        self.start_grad_sync()
        self.instance_chain.drain_through(self)
        self._land_reduction()
        self._finish_instance_reduction()
        if self.options.post_scale != 1.0:
            (self.grad_shard if self.options.shard else self.grad_data).mul_(self.options.post_scale)
        self.state = DONE

    def check_accumulation_allowed(self, param: torch.nn.Parameter) -> None:
        """Refuse a gradient arriving after this bucket's reduction began: it would be silently lost
        (or half-reduced). The usual causes: a missing ``zero_grad_buffer()`` between steps, or, with
        overlap, microbatches accumulated outside ``no_sync()`` (each backward counts as a step's last)."""
        if self.state != IDLE:
            raise RuntimeError(
                f"gradient for {self._name(param)} arrived after its bucket was {self.state}; "
                "call zero_grad_buffer() (or optimizer.zero_grad()) before the next step, and with "
                "overlap_grad_reduce run every microbatch but a step's last inside no_sync()"
            )

    def reset(self) -> None:
        """Back to idle for the next step, every parameter's ``main_grad`` unwritten (see the module
        docstring: the step's first gradient overwrites it, and what none reaches is zeroed)."""
        if self.handle is not None:  # never leave a collective dangling
            self.handle.wait()
            self.handle = None
        self.comm = None
        self._drop_instance_reduction()
        self.state = IDLE
        self._ready.clear()
        self._unwritten = {id(p): p for p in self.params}
        self.is_last_microbatch = True

    # -- parameters (distributed optimizer) ---------------------------------------------------
    def start_param_sync(self, async_op: bool) -> None:
        """All-gather the updated parameter shards into ``param_data``; a no-op if one is under way."""
        if not (self.options.shard and self.communicate) or self.param_handle is not None:
            return
        work = all_gather(self.param_data, self.param_shard, self.group, async_op=async_op)
        self.param_handle = work if async_op else None

    def finish_param_sync(self) -> None:
        """Wait for this bucket's parameter all-gather, if one is in flight."""
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None

    def in_flight(self) -> list[dist.Work]:
        """The collectives this bucket launched and has not waited for yet (a reduction, a gather)."""
        return [work for work in (self.handle, self.instance_handle, self.param_handle) if work is not None]

    def _name(self, param: torch.nn.Parameter) -> str:
        for p, n in zip(self.params, self.names):
            if p is param:
                return n
        return "a parameter"


def _cast_back(comm: torch.Tensor | None, into: torch.Tensor, lo: int, hi: int) -> None:
    """Copy the reduced ``[lo, hi)`` of a reduction's communication copy ``comm`` back into ``into`` (the
    tensor it was cast from); nothing without a copy."""
    if comm is not None:
        into[lo:hi].copy_(comm[lo:hi])


def _place(param: torch.nn.Parameter, view: torch.Tensor, name: str) -> None:
    """``param`` moves into ``view`` (its place in the parameter buffer): its values are copied, or for a
    parameter built on the meta device written there for the first time (no other copy ever exists)."""
    if param.is_meta:
        materialize(param, view, name)
        return
    view.copy_(param.data)
    param.data = view


def _drop_unowned_high_precision(bucket: Bucket) -> None:
    """Weights held in FP8 keep the values they were cast from until the optimizer starts its main copy of
    this rank's range from them; a weight of which this rank steps nothing lets them go as soon as its
    bucket is laid out (under ZeRO-3 on the meta device a rank then never holds its whole model in the
    model's dtype either)."""
    for param in bucket.params:
        held = held_weight(param)
        if held is not None and held.high_precision is not None and bucket.owned_range(param) is None:
            held.high_precision = None


class GradBuffer:
    """All gradients of one (parameter dtype, gradient dtype) pair in one flat tensor, in buckets.

    ``params`` come in module order; they are laid out reversed. ``bucket_size`` None puts
    everything in one bucket (plus, when sharding, one for a tied embedding). Creating the buffer
    sets ``param.main_grad`` on each parameter, and with ``options.shard`` moves ``param.data``
    into ``param_data``.
    """

    bucket_class: type[Bucket] = Bucket
    separate_storage = False
    """Each bucket in tensors of its own (so that one bucket's memory can be freed alone), rather than
    slices of one flat buffer."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        grad_dtype: torch.dtype,
        bucket_size: int | None,
        group: ProcessGroup | None,
        *,
        first_bucket_index: int,
        options: ReduceOptions,
        units: dict[int, int] | None = None,
        inter_group: ProcessGroup | None = None,
    ) -> None:
        dp_size = group_size(group)
        pieces = dp_size * (group_size(inter_group) if options.outer_shard else 1)
        pad_to = math.lcm(pieces, SHARD_ALIGNMENT) if options.shard else 1
        layout = self._layout(list(zip(params, names))[::-1], bucket_size, pad_to, options.shard, units)
        total = layout[-1][1] if layout else 0
        device = next((p.device for p in params if not p.is_meta), None) or current_device()
        param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.grad_data = self.param_data = None
        if not self.separate_storage:
            self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
            if options.shard:
                self.param_data = torch.zeros(total, dtype=param_dtype, device=device)
        self.buckets: list[Bucket] = []
        for begin, end, members in layout:
            if self.separate_storage:
                grad_data = torch.zeros(end - begin, dtype=grad_dtype, device=device)
                param_data = torch.zeros(end - begin, dtype=param_dtype, device=device)
            else:
                grad_data = self.grad_data[begin:end]
                param_data = None if self.param_data is None else self.param_data[begin:end]
            for param, name, offset in members:
                at, numel = offset - begin, param.numel()
                param.main_grad = grad_data[at : at + numel].view(param.shape)
                if param_data is not None:
                    _place(param, param_data[at : at + numel].view(param.shape), name)
                elif param.is_meta:  # not sharded: its memory is its own, as without the meta device
                    materialize(param, torch.empty(param.shape, dtype=param.dtype, device=device), name)
            self.buckets.append(
                self.bucket_class(
                    first_bucket_index + len(self.buckets),
                    [p for p, _, _ in members],
                    [n for _, n, _ in members],
                    [o - begin for _, _, o in members],
                    grad_data,
                    param_data,
                    group,
                    options,
                    inter_group,
                )
            )
            _drop_unowned_high_precision(self.buckets[-1])

    @staticmethod
    def _layout(order, bucket_size: int | None, pad_to: int, shard: bool, units: dict[int, int] | None):
        """Buckets as (start, padded end, [(param, name, offset)]) over the flat buffer; with ``units``
        (id(param) -> unit), a bucket never holds two units' parameters."""
        buckets, members = [], []
        offset = start = 0

        def close() -> None:
            nonlocal offset, start, members
            if members:
                offset = -(-offset // pad_to) * pad_to
                buckets.append((start, offset, members))
                start, members = offset, []

        unit = None
        for param, name in order:
            alone = shard and getattr(param, "shared_embedding", False)
            if units is not None and units.get(id(param), 0) != unit:
                close()
                unit = units.get(id(param), 0)
            if alone:
                close()
            members.append((param, name, offset))
            offset += param.numel()
            if alone or (bucket_size is not None and offset - start >= bucket_size):
                close()
        close()
        return buckets

    def reset(self) -> None:
        """Return the buckets to idle for the next step: its first gradients overwrite the last step's
        (no pass zeroes the buffer; see the module docstring)."""
        for bucket in self.buckets:
            bucket.reset()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient in the buffer by ``factor``."""
        if self.grad_data is not None:
            self.grad_data.mul_(factor)
            return
        for bucket in self.buckets:
            bucket.scale_gradients(factor)

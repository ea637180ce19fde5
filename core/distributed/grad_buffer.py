"""Contiguous gradient storage for data parallelism: one flat buffer per dtype, cut into buckets.

Every parameter's ``main_grad`` is a view into one flat tensor, so a data-parallel reduction is a
few large collectives instead of one per parameter, and the optimizer and gradient clipping can
treat the whole model's gradients as one tensor. Parameters are laid out in *reverse* module
order, which is roughly the order backward produces their gradients: the first bucket fills up
first, and with ``overlap_grad_reduce`` its all-reduce runs while backward computes the rest.

A bucket moves through three states per step: idle (gradients accumulating), launched (its
all-reduce is under way) and done (reduced). ``zero_grad_buffer`` returns it to idle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

IDLE, LAUNCHED, DONE = "idle", "launched", "done"


class Bucket:
    """Whole parameters' gradients in one contiguous slice of a buffer, reduced as one message.

    ``pre_scale`` multiplies the gradients before the sum (Megatron's ``gradient_scaling_factor``:
    1/dp to average, 1 for a per-token loss); ``post_scale`` multiplies after it (our stand-in for
    an averaging collective, which gloo lacks).
    """

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        names: list[str],
        grad_data: torch.Tensor,
        group: ProcessGroup | None,
        *,
        pre_scale: float,
        post_scale: float,
        async_op: bool,
        check_for_nan: bool,
    ) -> None:
        self.index = index
        self.params = params
        self.names = names
        self.grad_data = grad_data
        self.group = group
        self.pre_scale = pre_scale
        self.post_scale = post_scale
        self.async_op = async_op
        self.check_for_nan = check_for_nan
        self.is_last_microbatch = True  # False inside DistributedDataParallel.no_sync()
        self.state = IDLE
        self.handle: dist.Work | None = None
        self._ready: set[int] = set()

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
        """Launch the all-reduce (asynchronously with overlap); a no-op if already launched."""
        if self.state != IDLE:
            return
        if self.check_for_nan and not bool(torch.isfinite(self.grad_data).all()):
            rank = dist.get_rank() if dist.is_initialized() else 0
            bad = [n for p, n in zip(self.params, self.names) if not bool(torch.isfinite(p.main_grad).all())]
            raise RuntimeError(
                f"rank {rank}: NaN or Inf in the gradients of {bad} before the data-parallel "
                "reduction (check_for_nan_in_grad)"
            )
        if self.pre_scale != 1.0:
            self.grad_data.mul_(self.pre_scale)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            work = dist.all_reduce(self.grad_data, group=self.group, async_op=self.async_op)
            self.handle = work if self.async_op else None
        self.state = LAUNCHED

    def finish_grad_sync(self) -> None:
        """Wait for the reduction, launching it first if it never was (e.g. a parameter got no grad)."""
        if self.state == DONE:
            return
        self.start_grad_sync()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.post_scale != 1.0:
            self.grad_data.mul_(self.post_scale)
        self.state = DONE

    def check_accumulation_allowed(self, param: torch.nn.Parameter) -> None:
        """Refuse a gradient arriving after this bucket's reduction began: it would be silently lost
        (or half-reduced). The usual cause is a missing ``zero_grad_buffer()`` between steps."""
        if self.state != IDLE:
            raise RuntimeError(
                f"gradient for {self._name(param)} arrived after its bucket was {self.state}; "
                "call zero_grad_buffer() (or optimizer.zero_grad()) before the next step"
            )

    def reset(self) -> None:
        """Back to idle for the next step (the buffer itself is zeroed by its owner)."""
        if self.handle is not None:  # never leave a collective dangling
            self.handle.wait()
            self.handle = None
        self.state = IDLE
        self._ready.clear()
        self.is_last_microbatch = True

    def _name(self, param: torch.nn.Parameter) -> str:
        for p, n in zip(self.params, self.names):
            if p is param:
                return n
        return "a parameter"


class GradBuffer:
    """All gradients of one (parameter dtype, gradient dtype) pair in one flat tensor, in buckets.

    ``params`` come in module order; they are laid out reversed. ``bucket_size`` None puts
    everything in one bucket. Creating the buffer sets ``param.main_grad`` on each parameter.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        grad_dtype: torch.dtype,
        bucket_size: int | None,
        group: ProcessGroup | None,
        *,
        first_bucket_index: int,
        pre_scale: float,
        post_scale: float,
        async_op: bool,
        check_for_nan: bool,
    ) -> None:
        order = list(zip(params, names))[::-1]
        total = sum(p.numel() for p, _ in order)
        self.grad_dtype = grad_dtype
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=params[0].device)
        self.buckets: list[Bucket] = []
        offset, start, members = 0, 0, []

        def close_bucket() -> None:
            nonlocal start, members
            if not members:
                return
            self.buckets.append(
                Bucket(
                    first_bucket_index + len(self.buckets),
                    [p for p, _ in members],
                    [n for _, n in members],
                    self.grad_data[start:offset],
                    group,
                    pre_scale=pre_scale,
                    post_scale=post_scale,
                    async_op=async_op,
                    check_for_nan=check_for_nan,
                )
            )
            start, members = offset, []

        for param, name in order:
            param.main_grad = self.grad_data[offset : offset + param.numel()].view(param.shape)
            offset += param.numel()
            members.append((param, name))
            if bucket_size is not None and offset - start >= bucket_size:
                close_bucket()
        close_bucket()

    def reset(self) -> None:
        """Zero every gradient and return the buckets to idle."""
        for bucket in self.buckets:
            bucket.reset()
        self.grad_data.zero_()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient in the buffer by ``factor``."""
        self.grad_data.mul_(factor)

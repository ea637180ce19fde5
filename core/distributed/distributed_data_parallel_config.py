"""Knobs of the data-parallel wrapper (Megatron's ``DistributedDataParallelConfig`` field names)."""

from __future__ import annotations

from dataclasses import dataclass

from core.flags import flag, not_a_flag


@dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """How gradients are stored and reduced over the data-parallel group.

    Difference from Megatron: ``grad_reduce_in_fp32`` defaults to True (Megatron's training
    script forces it on for bf16 anyway, and a bf16 model is what needs it).
    """

    grad_reduce_in_fp32: bool = flag(
        True,
        name="--grad-reduce-in-bf16",
        group="mixed precision",
        help="With --bf16, accumulate and reduce gradients in bfloat16 instead of fp32.",
    )
    """Accumulate and reduce gradients in fp32 even when parameters are bf16/fp16 (False: in the
    parameters' dtype). The training loop sets it as Megatron does: fp32 for bf16 unless
    ``--grad-reduce-in-bf16``; for fp16 only with ``--accumulate-allreduce-grads-in-fp32``."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction asynchronously as soon as its gradients are final, while
    backward still runs; without it every bucket is reduced, synchronously, in ``finish_grad_sync``."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1): gradients are reduce-scattered,
    parameters live in a flat buffer and are all-gathered after each optimizer step."""

    overlap_param_gather: bool = flag(False, group="distributed")
    """With the distributed optimizer: launch the parameter all-gathers asynchronously after the
    step and let each module's forward pre-hook wait for its own bucket."""

    check_for_nan_in_grad: bool = not_a_flag(False)
    """Raise, naming the parameters, if a bucket holds NaN or Inf before it is reduced."""

    bucket_size: int | None = flag(None, name="--ddp-bucket-size")
    """Elements per bucket with ``overlap_grad_reduce``; None means Megatron's default,
    ``max(40_000_000, 1_000_000 * dp_size)``. Ignored without overlap (one bucket per buffer)."""

    average_in_collective: bool = flag(False, name="--ddp-average-in-collective")
    """Average in the collective instead of pre-scaling by 1/dp. Gloo has no AVG reduction, so here
    it means "sum, then divide after the collective"; the result is the same average."""

    def __post_init__(self) -> None:
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather=True needs use_distributed_optimizer=True (only the distributed "
                "optimizer gathers parameters)"
            )
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(
                f"bucket_size must be a positive number of elements or None, got {self.bucket_size}"
            )

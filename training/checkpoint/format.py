"""The checkpoint format: file names, how each tensor is split over tensor parallelism, the manifest.

A checkpoint holds *logical tensors*, each described once in the manifest independently of any
parallel split, and stored in *pieces* inside safetensors files:

* a logical tensor is a model parameter under its global name (``decoder.layers.3.mlp.linear_fc1.weight``)
  or an optimizer state of one, ``optimizer.state.<key>.<parameter name>`` (``exp_avg``,
  ``exp_avg_sq``, ``step``, and ``main_param``, the fp32 master copy of a bf16 parameter). An
  optimizer state shaped like its parameter is split exactly like it, so resharding the optimizer is
  the same operation as resharding the weights;
* its :class:`TensorSpec` gives the full shape (the vocabulary *unpadded*), dtype, the
  :class:`Partition` over TP (dim, stride, vocabulary padding rule) and its *owner* in the pipeline
  layout (``"E"``, ``"L"`` or a decoder-layer number), which places it in any other split;
* a piece is TP shard ``tp_rank`` of the split at which the file was written, or only the flat
  range ``[start, end)`` of that shard, flattened in row-major order (a 1-D tensor); a tensor not
  split over TP has one shard, 0, whichever TP rank writes it (an MoE expert's optimizer state
  may come from any: other TP ranks hold other experts). Model weights
  and an unsharded optimizer's state are whole shards. The distributed optimizer (ZeRO-1,
  Megatron's design: each data-parallel rank owns a contiguous range of the flat gradient buffer,
  which meets each parameter in one contiguous range) writes, per DP rank ``d``, an
  ``optim_tp{t}_pp{p}_dp{d}`` file holding only its ranges, each listed with ``"flat": [start,
  end]``; readers assemble a shard, or any range of it, from whatever pieces overlap it, so loading
  at another DP size, or without the distributed optimizer, needs nothing else.

MoE experts are logical tensors under their global names too (``...mlp.experts.local_experts.5...``,
their spec recording the expert index: in the model, slice 1 of the stacked parameter
``...mlp.experts.linear_fc1.weight`` of the EP rank holding experts 4 to 7), never TP-split, and
are written by the first rank of each expert's expert-data-parallel replicas into
``model_experts_pp{p}_ep{e}``: resharding expert parallelism, like pipeline parallelism, only moves
whole tensors between files.

The manifest's ``files`` section is the index of pieces: ``{file: {"bytes": n, "checksum": h,
"pieces": {tensor name: {"tp_rank": t, "flat": [s, e] (optional), "checksum": h}}}}``. Checksums
are xxh3-64 of the file's safetensors header and of each piece's bytes: together they cover every
byte of the file, and a reader verifies exactly the pieces it reads.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TOKENIZER_DIR",
    "TRACKER",
    "CheckpointError",
    "Parallelism",
    "Partition",
    "TensorSpec",
    "canonical_order",
    "dtype_from_name",
    "dtype_name",
    "expert_file",
    "expert_optim_file",
    "iteration_dir",
    "model_file",
    "optim_file",
    "optimizer_tensor_name",
    "rng_file",
    "split_optimizer_tensor_name",
]

FORMAT = "trident-checkpoint-v2"
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
OPTIMIZER_PREFIX = "optimizer.state."


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit this run; the message names the file."""


def iteration_dir(root: str, iteration: int | str) -> str:
    """``root/iter_0000100`` (Megatron's name), or ``root/release`` for a release checkpoint."""
    return os.path.join(root, "release" if iteration == "release" else f"iter_{int(iteration):07d}")


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank}_pp{pp_rank}.safetensors"


def expert_file(pp_rank: int, ep_rank: int) -> str:
    """The MoE experts that expert-parallel rank ``ep_rank`` of pipeline rank ``pp_rank`` holds (never TP-split)."""
    return f"model_experts_pp{pp_rank}_ep{ep_rank}.safetensors"


def expert_optim_file(pp_rank: int, ep_rank: int) -> str:
    """Those experts' optimizer state, as a conversion writes it (a live save keeps it in its rank's optim file)."""
    return f"optim_experts_pp{pp_rank}_ep{ep_rank}.safetensors"


def optim_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim_tp{tp_rank}_pp{pp_rank}_dp{dp_rank}.safetensors"


def rng_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"rng_tp{tp_rank}_pp{pp_rank}_dp{dp_rank}.safetensors"


def optimizer_tensor_name(key: str, param_name: str) -> str:
    """``optimizer.state.exp_avg.<param name>``: the logical name of one optimizer state."""
    return f"{OPTIMIZER_PREFIX}{key}.{param_name}"


def split_optimizer_tensor_name(name: str) -> tuple[str, str] | None:
    """``(key, parameter name)`` of an optimizer tensor's logical name, None for a model tensor."""
    if not name.startswith(OPTIMIZER_PREFIX):
        return None
    key, _, param = name[len(OPTIMIZER_PREFIX) :].partition(".")
    return key, param


def canonical_order(names: Iterable[str], owner: Callable[[str], str | int]) -> list[str]:
    """``names`` in the order files store them: by layout element (embedding, layers, loss), then name.

    Every writer uses it, so the same tensors give the same bytes whatever wrote them.
    """

    def key(name: str) -> tuple:
        split = split_optimizer_tensor_name(name)
        param, state = (name, "") if split is None else (split[1], split[0])
        place = owner(name)
        rank = (0, 0) if place == "E" else (2, 0) if place == "L" else (1, int(place))
        return rank, param, state

    return sorted(names, key=key)


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unsupported tensor dtype {name!r} in checkpoint")
    return _DTYPES[name]


# --------------------------------------------------------------------------------------------------
# How a tensor is split over tensor parallelism
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """Megatron's ``partition_dim`` / ``partition_stride``, plus vocabulary padding.

    At TP size ``tp`` the partition dimension is first padded with zero rows to ``padded(size, tp)``
    (``pad_multiple`` x ``tp``, Megatron's vocabulary rule; no padding when ``pad_multiple`` is None),
    then cut into ``tp * stride`` equal blocks; rank ``r`` holds blocks ``r, r + tp, ...``, in order.
    A gated MLP's ``[gate; up]`` fc1 has stride 2, so each rank holds matching gate and up rows.
    """

    dim: int
    stride: int = 1
    pad_multiple: int | None = None

    def padded(self, size: int, tp: int) -> int:
        """Size of the partition dimension at TP size ``tp`` (``size`` is the unpadded size)."""
        if self.pad_multiple is None:
            return size
        multiple = self.pad_multiple * tp
        return -(-size // multiple) * multiple

    def check(self, size: int, tp: int, what: str) -> None:
        """Raise a CheckpointError naming ``what`` if the dimension cannot be cut for ``tp`` ranks."""
        padded = self.padded(size, tp)
        if padded % (tp * self.stride):
            raise CheckpointError(
                f"{what}: dimension {self.dim} ({padded}) is not divisible by tensor-parallel size "
                f"{tp} x partition stride {self.stride}"
            )

    def segments(self, size: int, tp: int, rank: int) -> list[tuple[int, int, int]]:
        """``(local offset, global offset, length)`` runs of real (unpadded) rows that ``rank`` holds."""
        block = self.padded(size, tp) // (tp * self.stride)
        runs = []
        for k in range(self.stride):
            start = (k * tp + rank) * block
            length = min(start + block, size) - start
            if length > 0:
                runs.append((k * block, start, length))
        return runs

    def to_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "stride": self.stride, "pad_multiple": self.pad_multiple}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Partition:
        return cls(int(value["dim"]), int(value.get("stride", 1)), value.get("pad_multiple"))


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor: full (unpadded) shape, dtype, TP partition (None: replicated), owner."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    partition: Partition | None
    owner: str | int
    """Layout element holding it: "E" (embedding), "L" (final norm, output layer) or a decoder layer."""
    expert: int | None = None
    """The global index of the MoE expert it belongs to: its expert-parallel rank at EP size ``ep``
    is ``expert // (experts / ep)``. Experts are never TP-split."""

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one TP shard at TP size ``tp`` (padding included)."""
        if self.partition is None:
            return self.shape
        shape = list(self.shape)
        dim = self.partition.dim
        shape[dim] = self.partition.padded(shape[dim], tp) // tp
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def to_json(self) -> dict[str, Any]:
        out = {
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "partition": None if self.partition is None else self.partition.to_json(),
            "owner": self.owner,
        }
        return out if self.expert is None else out | {"expert": self.expert}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TensorSpec:
        partition = value.get("partition")
        return cls(
            tuple(int(n) for n in value["shape"]),
            dtype_from_name(value["dtype"]),
            None if partition is None else Partition.from_json(partition),
            value["owner"],
            value.get("expert"),
        )


def shard_from_full(full: torch.Tensor, spec: TensorSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """TP shard ``tp_rank`` of ``tp`` cut from the full unpadded tensor; padding rows are zero."""
    if spec.partition is None or (tp == 1 and spec.shard_shape(1) == spec.shape):
        return full
    dim = spec.partition.dim
    shape = spec.shard_shape(tp)
    runs = spec.partition.segments(spec.shape[dim], tp, tp_rank)
    if dim == 0 and len(runs) == 1 and runs[0][2] == shape[0]:
        return full.narrow(0, runs[0][1], shape[0])  # a contiguous slice: no copy
    out = torch.zeros(shape, dtype=full.dtype)
    for local, start, length in runs:
        out.narrow(dim, local, length).copy_(full.narrow(dim, start, length))
    return out


# --------------------------------------------------------------------------------------------------
# The parallel split a checkpoint is written at
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallelism:
    """TP, PP and virtual-pipeline sizes with the pipeline layout string (always explicit), DP and EP."""

    tp: int
    pp: int
    vpp: int
    layout: str
    dp: int = 1
    """Data-parallel size of the run that wrote it: the number of RNG (and, with the distributed
    optimizer, optimizer) files per (TP, PP) rank."""
    ep: int = 1
    """Expert-parallel size: the number of expert files per pipeline rank of an MoE model."""

    def describe(self) -> str:
        return (
            f"TP={self.tp} PP={self.pp}"
            + (f" VPP={self.vpp}" if self.vpp > 1 else "")
            + f" DP={self.dp}"
            + (f" EP={self.ep}" if self.ep > 1 else "")
        )

    def to_json(self) -> dict[str, Any]:
        out = {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "dp": self.dp, "layout": self.layout}
        return out if self.ep == 1 else out | {"ep": self.ep}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Parallelism:
        return cls(
            int(value["tp"]),
            int(value["pp"]),
            int(value["vpp"]),
            value["layout"],
            int(value["dp"]),
            int(value.get("ep", 1)),
        )


def read_json(path: str, what: str) -> dict[str, Any]:
    """A JSON object from ``path``, or one CheckpointError naming the file."""
    try:
        with open(path) as fh:
            value = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{what} {path} is corrupt: {err}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} is corrupt: expected a JSON object")
    return value

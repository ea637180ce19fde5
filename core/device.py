"""The one place that decides backend and device: the device follows the process group's backend.

gloo computes on the CPU and NCCL on this process's local GPU, whatever the hardware: a gloo run on
a GPU host (the test pool, the tools, a CPU debugging run) keeps every tensor on the CPU, and an
NCCL run puts rank ``LOCAL_RANK`` on GPU ``LOCAL_RANK``, never on a GPU another rank uses.

Which backend a process group started here gets (``select_backend``, :func:`decide_backend`):

* ``TRIDENT_BACKEND`` (``nccl`` or ``gloo``) overrides everything; forced ``nccl`` where it cannot
  work is an error;
* ``--distributed-backend gloo`` is gloo; ``--distributed-backend nccl`` on a machine without CUDA
  falls back to gloo with one warning, so a GPU cluster's launch script also runs on a laptop;
* otherwise NCCL where CUDA exists, gloo elsewhere.

Once ``torch.distributed`` is initialised (by Trident or by anyone else) its backend decides.
Under NCCL each process needs a GPU of its own: more processes on a node than visible GPUs is an
error naming both numbers, raised on every rank before any collective (:class:`DeviceError`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")

_requested: str | None = None
_override: torch.device | None = None  # set by ``building_on`` (shapes-only model builds)


class DeviceError(ValueError):
    """A backend or GPU assignment that cannot work; the message is one line naming the numbers."""


def decide_backend(
    requested: str | None,
    *,
    forced: str | None,
    cuda_available: bool,
    device_count: int,
    local_rank: int,
    local_world_size: int,
) -> tuple[str, str | None]:
    """``(backend, warning or None)`` for these facts; a pure function, so it is tested without GPUs.

    ``requested`` is ``--distributed-backend`` (None: the hardware's choice), ``forced`` the value of
    ``TRIDENT_BACKEND`` (None or empty: unset). Raises :class:`DeviceError` where NCCL is chosen
    but cannot run: no CUDA when forced, or more processes on this node than visible GPUs.
    """
    if forced:
        if forced not in BACKENDS:
            raise DeviceError(
                f"TRIDENT_BACKEND={forced!r} is not a backend Trident runs on: use nccl or gloo"
            )
        if forced == "nccl" and not cuda_available:
            raise DeviceError("TRIDENT_BACKEND=nccl needs CUDA, and this machine has no usable GPU")
        backend, source = forced, f"TRIDENT_BACKEND={forced}"
    elif requested == "gloo":
        return "gloo", None
    elif not cuda_available:
        warning = None
        if requested == "nccl":
            warning = (
                "WARNING: --distributed-backend nccl needs CUDA, which this machine does not have: using gloo"
            )
        return "gloo", warning
    else:
        backend = "nccl"
        source = (
            "--distributed-backend nccl" if requested == "nccl" else "NCCL (the default where GPUs exist)"
        )
    if backend == "nccl":
        local_gpu_index(local_rank, local_world_size, device_count, source)
    return backend, None


def local_gpu_index(local_rank: int, local_world_size: int, device_count: int, source: str = "NCCL") -> int:
    """The GPU of local rank ``local_rank``: its own, or :class:`DeviceError` if the node has too few.

    Every rank of the node checks the node's process count (``LOCAL_WORLD_SIZE``), not only its own
    rank, so all of them stop with the same line instead of some waiting for the others.
    """
    processes = max(local_rank + 1, local_world_size)
    if processes > device_count:
        raise DeviceError(
            f"{source} needs one GPU per process, but this node runs {processes} processes "
            f"(LOCAL_RANK {local_rank}, LOCAL_WORLD_SIZE {local_world_size}) and sees {device_count} GPU(s): "
            f"start at most {device_count} per node (torchrun --nproc-per-node {device_count}) "
            "or use --distributed-backend gloo"
        )
    return local_rank


def _facts(env: Mapping[str, str]) -> dict:
    cuda = torch.cuda.is_available()
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return {
        "forced": env.get("TRIDENT_BACKEND") or None,
        "cuda_available": cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "local_rank": local_rank,
        "local_world_size": int(env.get("LOCAL_WORLD_SIZE", "1")),
    }


def select_backend(requested: str | None) -> str:
    """Use ``requested`` (``"nccl"``, ``"gloo"`` or None for the hardware's choice) from now on in this
    process; returns the backend a process group started here will use. Call it before creating
    process groups: a choice that cannot work raises :class:`DeviceError` on every rank, and the
    fallback warning is printed by rank 0."""
    global _requested
    if requested not in (None, *BACKENDS):
        raise DeviceError(f"--distributed-backend {requested!r}: expected nccl or gloo")
    backend, warning = decide_backend(requested, **_facts(os.environ))
    _requested = requested
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)
    return backend


def computes_on_cuda(requested: str | None) -> bool:
    """Whether a run asking for ``requested`` (``--distributed-backend``, None for the hardware's choice)
    computes on CUDA here; a choice that cannot work counts as CUDA (:func:`select_backend` refuses it)."""
    try:
        return decide_backend(requested, **_facts(os.environ))[0] == "nccl"
    except DeviceError:
        return True


def default_backend() -> str:
    """The backend a process group started now would use (``TRIDENT_BACKEND``, the request, the hardware)."""
    return decide_backend(_requested, **_facts(os.environ))[0]


def backend_in_use() -> str:
    """The default process group's backend once torch.distributed runs, else :func:`default_backend`."""
    if dist.is_initialized():
        return "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    return default_backend()


def current_device() -> torch.device:
    """The device this process computes on: its local GPU under NCCL, the CPU otherwise."""
    if _override is not None:
        return _override
    if backend_in_use() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_device(config: object) -> torch.device:
    """Where a layer creates its parameters: the meta device under ``config.init_model_with_meta_device``
    (shapes and dtypes, no memory: the data-parallel wrapper gives each rank's its memory and initial
    values, bucket by bucket), else :func:`current_device`. Buffers (rotary tables, FP8 scales) are
    made on :func:`current_device` either way."""
    if getattr(config, "init_model_with_meta_device", False):
        return torch.device("meta")
    return current_device()


def materialize(param: torch.nn.Parameter, out: torch.Tensor, name: str | None = None) -> None:
    """Give meta parameter ``param`` (called ``name``) the memory ``out`` (its shape, any device), filled
    by its ``deferred_init`` (``core.transformer.initialization.DeferredInit``); ``param.data`` becomes
    ``out``. A meta parameter without one (built outside a model that initialises by name) is refused."""
    deferred = getattr(param, "deferred_init", None)
    if deferred is None:
        raise ValueError(
            f"{name or 'a parameter'} {tuple(param.shape)} is on the meta device with nothing to initialise it: "
            "init_model_with_meta_device needs a model that initialises by name (perform_initialization=True)"
        )
    deferred(param, out)
    # ``param.data = out`` cannot move a tensor off the meta device: swap in a real tensor of no size
    # first (the object, which every module and list holds, and its attributes stay), then point its
    # data at ``out``, which keeps a version counter of its own, as a parameter moved into a buffer has.
    attributes = {k: v for k, v in param.__dict__.items() if k != "deferred_init"}
    empty = torch.empty(0, dtype=out.dtype, device=out.device)
    torch.utils.swap_tensors(param, type(param)(empty, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)
    param.data = out


def materialize_module(module: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter of ``module`` memory of its own on ``device``, one at a time, initialised
    as at construction (a model built with ``init_model_with_meta_device`` and no data-parallel wrapper)."""
    for name, param in module.named_parameters():
        if param.is_meta:
            materialize(param, torch.empty(param.shape, dtype=param.dtype, device=device), name)


def local_device() -> torch.device | None:
    """This process's own GPU under NCCL (checked against the visible GPUs), None under gloo."""
    if backend_in_use() != "nccl":
        return None
    facts = _facts(os.environ)
    index = local_gpu_index(facts["local_rank"], facts["local_world_size"], facts["device_count"])
    return torch.device("cuda", index)


def bind_local_device() -> None:
    """Make this process's own GPU the current one under NCCL; a no-op under gloo.

    Idempotent, and independent of whether a process group exists yet, so a group started by
    someone else (a launcher, a test) still gets each rank on its own GPU.
    """
    device = local_device()
    if device is not None:
        torch.cuda.set_device(device)


@contextlib.contextmanager
def building_on(device: torch.device | str) -> Iterator[None]:
    """Within this block, :func:`current_device` is ``device`` (e.g. ``"meta"``: shapes without memory)."""
    global _override
    previous, _override = _override, torch.device(device)
    try:
        yield
    finally:
        _override = previous

"""Random-number streams for tensor parallelism: one shared by the TP group, one private to each rank.

Dropout on a *replicated* activation (outside attention/MLP) must draw the same mask on every TP
rank, or the replicas drift apart; dropout on a *sharded* activation (attention probabilities,
split by head) must draw different masks on different ranks, or the shards are correlated. So
the default generator is seeded identically across the TP group, and a tracker keeps a second,
named state seeded per TP rank; code inside a TP region draws from it with::

    with get_rng_tracker().fork():
        probs = dropout(probs)

The tracker swaps the named state in and out of the default generators, so ordinary torch ops use
it without being passed a generator. It works on the CPU generator always and also on the current
CUDA device's generator when computing on a GPU (``core.device``). ``get_states``/``set_states``
let checkpoints save and restore the streams so a resumed run draws the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup

from core.device import current_device
from core.tensor_parallel.utils import tp_rank

model_parallel_rng_tracker_name = "model-parallel-rng"
"""Name of the per-TP-rank stream (Megatron's ``_MODEL_PARALLEL_RNG_TRACKER_NAME``)."""
_MODEL_PARALLEL_RNG_TRACKER_NAME = model_parallel_rng_tracker_name

TENSOR_MODEL_PARALLEL_SEED_OFFSET = 2718
"""Added to the seed (plus the TP rank) for the per-rank stream, as in Megatron."""

DeviceStates = dict[str, torch.Tensor]
"""Generator states by device kind: ``"cpu"`` always, ``"cuda"`` when computing on a GPU."""


def _on_cuda() -> bool:
    return current_device().type == "cuda"


def _get_device_states() -> DeviceStates:
    states = {"cpu": torch.get_rng_state()}
    if _on_cuda():
        states["cuda"] = torch.cuda.get_rng_state(current_device())
    return states


def _set_device_states(states: DeviceStates) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and _on_cuda():
        torch.cuda.set_rng_state(states["cuda"], current_device())


def _fresh_device_states(seed: int) -> DeviceStates:
    """The states the default generators would have after ``manual_seed(seed)``, without touching them."""
    states = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if _on_cuda():
        states["cuda"] = torch.Generator(device=current_device()).manual_seed(seed).get_state()
    return states


class RNGStatesTracker:
    """Named generator states that can be swapped in for a ``with`` block (Megatron's CudaRNGStatesTracker)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every named state (``model_parallel_seed`` starts from here)."""
        self._states: dict[str, DeviceStates] = {}
        self._seeds: set[int] = set()

    def is_initialized(self) -> bool:
        """Whether any state has been added."""
        return bool(self._states)

    def get_states(self) -> dict[str, DeviceStates]:
        """A copy of every named state, to save in a checkpoint."""
        return {
            name: {kind: s.clone() for kind, s in states.items()} for name, states in self._states.items()
        }

    def set_states(self, states: dict[str, DeviceStates]) -> None:
        """Replace the named states with ``states`` (from :meth:`get_states`, e.g. a checkpoint)."""
        self._states = {name: {kind: s.clone() for kind, s in dev.items()} for name, dev in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Start a new named stream from ``seed``; names and seeds must be unique (streams must differ)."""
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already used by another RNG tracker state")
        if name in self._states:
            raise ValueError(f"RNG tracker state {name!r} already exists")
        self._seeds.add(seed)
        self._states[name] = _fresh_device_states(seed)

    @contextlib.contextmanager
    def fork(self, name: str = model_parallel_rng_tracker_name) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the outer state is restored afterwards, untouched."""
        if name not in self._states:
            raise KeyError(f"RNG tracker state {name!r} is not set; call model_parallel_seed(seed) first")
        outer = _get_device_states()
        _set_device_states(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_states()
            _set_device_states(outer)


_RNG_STATE_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (``get_cuda_rng_tracker`` is the Megatron name)."""
    return _RNG_STATE_TRACKER


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_seed(seed: int, tp_group: ProcessGroup | None = None) -> None:
    """Seed the default generators with ``seed`` and the per-TP-rank stream with ``seed + 2718 + tp_rank``.

    Call it with the same ``seed`` on every rank of a TP group (Megatron's training loop offsets the
    seed per pipeline stage first). The default stream is then identical across the TP group, which
    also makes every TP rank build the same full weights before slicing its shard.
    """
    rank = tp_rank(tp_group)
    torch.manual_seed(seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(model_parallel_rng_tracker_name, seed + TENSOR_MODEL_PARALLEL_SEED_OFFSET + rank)


model_parallel_cuda_manual_seed = model_parallel_seed

"""Checkpoints: bit-identical round trips on real ranks, crash safety, no pickle, one clear error per problem.

The multi-rank tests run TP=1 PP=2 DP=2 on four gloo ranks. The message tests build the same
four-rank checkpoint in this process by calling ``save_checkpoint`` once per (tp, pp, dp)
coordinate (without torch.distributed the agreement steps are local; rank (0, 0, 0) goes last
because it commits), then load it as each coordinate would.
"""

from __future__ import annotations

import json
import os
import random
import signal
from argparse import Namespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from core import parallel_state
from core.tensor_parallel import get_rng_tracker
from training import checkpointing
from training.checkpointing import (
    TRACKER,
    CheckpointError,
    current_parallel,
    flatten_state,
    get_rng_state,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    set_rng_state,
    unflatten_state,
)
from training.signal_handler import SignalHandler

TP, PP, DP = 1, 2, 2


def _parallel(tp_rank=0, pp_rank=0, dp_rank=0, tp=TP, pp=PP, dp=DP, vpp=1):
    return {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "vpp": vpp,
    }


def _rank_parallel(rank: int) -> dict:
    """Megatron's rank order for TP=1: rank = dp_rank + DP * pp_rank."""
    return _parallel(0, rank // DP, rank % DP)


def _model(pp_rank: int, iteration: int = 1) -> dict[str, torch.Tensor]:
    """A stage's tensors with global names; stage 0 has the embedding, stage 1 the head."""
    g = torch.Generator().manual_seed(10 * iteration + pp_rank)
    state = {
        f"decoder.layers.{2 * pp_rank + i}.mlp.linear_fc1.weight": torch.randn(8, 4, generator=g)
        for i in range(2)
    }
    state[f"decoder.layers.{2 * pp_rank}.norm.weight"] = torch.randn(4, generator=g).to(torch.bfloat16)
    if pp_rank == 0:
        state["embedding.word_embeddings.weight"] = torch.randn(16, 4, generator=g)
    else:
        state["output_layer.weight"] = torch.randn(16, 4, generator=g)
        state["decoder.final_layernorm.weight"] = state["output_layer.weight"][0]  # a view: must be copied
    return state


def _shapes(pp_rank: int) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in _model(pp_rank).items()}


def _optimizer(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    first = {
        "exp_avg": torch.randn(8, 4, generator=g),
        "exp_avg_sq": torch.rand(8, 4, generator=g),
        "step": torch.tensor(3.0),
    }
    return {
        "state": {0: first, 1: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "decoupled": None}],
        "grad_scaler": {"scale": 65536.0, "growth_tracker": 2},
        "rank": rank,
    }


def _equal(a, b) -> bool:
    """Exact equality of nested states: same types, same dtypes, same bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_rng_tracker().reset()
    get_rng_tracker().add("model-parallel-rng", seed + 2718)


def _draws() -> list:
    with get_rng_tracker().fork():
        tracked = torch.rand(3)
    return [random.random(), float(np.random.rand()), torch.rand(4), tracked]


def _save(root, iteration, parallel, rank, rng_state=None, optimizer_state=None):
    return save_checkpoint(
        str(root),
        iteration,
        model_state=_model(parallel["pp_rank"], iteration),
        optimizer_state=optimizer_state or _optimizer(rank),
        scheduler_state={"num_steps": iteration * 16},
        rng_state=rng_state,
        args=Namespace(lr=1e-3, params_dtype=torch.float32, fn=print),
        consumed_samples=iteration * 16,
        parallel=parallel,
        extra={"wandb_id": "abc123"},
    )


def _save_all_in_process(root, iteration=1) -> None:
    """Every coordinate's share of one TP=1 PP=2 DP=2 checkpoint; rank 0 last, since it commits."""
    for rank in reversed(range(TP * PP * DP)):
        _save(root, iteration, _rank_parallel(rank), rank)


def _load(root, pp_rank=1, dp_rank=1, shapes=None, parallel=None, **kw):
    return load_checkpoint(
        str(root),
        parallel=parallel or _parallel(0, pp_rank, dp_rank),
        expected_model_shapes=_shapes(pp_rank) if shapes is None else shapes,
        **kw,
    )


def _error_of(fn, *args, **kw) -> str | None:
    try:
        fn(*args, **kw)
    except CheckpointError as err:
        return str(err)
    return None


# --------------------------------------------------------------------------------------------------
# Four real ranks: TP=1 PP=2 DP=2
# --------------------------------------------------------------------------------------------------


def _round_trip(rank, world_size, root):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    p = current_parallel()
    assert p == _rank_parallel(rank)
    _seed_everything(1000 + rank)
    saved_rng = get_rng_state()
    expected = _draws()
    _save(root, 3, p, rank, rng_state=saved_rng)
    _seed_everything(7)  # scramble every stream
    ckpt = load_checkpoint(root, parallel=p, expected_model_shapes=_shapes(p["pp_rank"]))
    set_rng_state(ckpt.rng_state)
    assert _equal(_draws(), expected), "RNG streams differ after set_rng_state"
    assert _equal(ckpt.model_state, _model(p["pp_rank"], 3))
    assert _equal(ckpt.optimizer_state, _optimizer(rank))
    assert (ckpt.iteration, ckpt.consumed_samples, ckpt.scheduler_state) == (3, 48, {"num_steps": 48})
    assert ckpt.manifest["extra"] == {"wandb_id": "abc123"}
    assert ckpt.manifest["args"] == {"lr": 1e-3, "params_dtype": "torch.float32"}  # the JSON subset
    return sorted(os.listdir(os.path.join(root, "iter_0000003")))


def test_round_trip_is_bit_identical_on_four_ranks(ranks, tmp_path):
    files = ranks(4).run(_round_trip, str(tmp_path), timeout=120)
    per_rank = [
        f"{kind}_tp0_pp{q}_dp{d}.safetensors" for kind in ("optim", "rng") for q in (0, 1) for d in (0, 1)
    ]
    assert files[0] == sorted(
        ["manifest.json", "model_tp0_pp0.safetensors", "model_tp0_pp1.safetensors", *per_rank]
    )
    assert read_tracker(str(tmp_path)) == 3


def _crash_then_load(rank, world_size, root):
    p = _rank_parallel(rank)
    _save(root, 1, p, rank)
    real_write_text = checkpointing.write_text

    def dies_before_commit(path: str, text: str) -> None:
        if not path.endswith(TRACKER):
            real_write_text(path, text)  # the manifest is written; the process "dies" before the tracker

    checkpointing.write_text = dies_before_commit
    try:
        _save(root, 2, p, rank)
    finally:
        checkpointing.write_text = real_write_text
    ckpt = load_checkpoint(root, parallel=p, expected_model_shapes=_shapes(p["pp_rank"]))
    assert _equal(ckpt.model_state, _model(p["pp_rank"], 1))
    return ckpt.iteration


def test_crash_before_the_tracker_update_loads_the_previous_checkpoint(ranks, tmp_path):
    assert ranks(4).run(_crash_then_load, str(tmp_path), timeout=120) == [1, 1, 1, 1]
    assert os.path.isfile(tmp_path / "iter_0000002" / "manifest.json")  # complete but never committed


def _failed_save(rank, world_size, root):
    p = _rank_parallel(rank)
    _save(root, 1, p, rank)
    message = _error_of(_save, root, 2, p, rank, optimizer_state={"bad": object()} if rank == 2 else None)
    return message, load_checkpoint(root, parallel=p, expected_model_shapes=_shapes(p["pp_rank"])).iteration


def test_a_save_failing_on_one_rank_fails_on_all_and_keeps_the_previous_checkpoint(ranks, tmp_path):
    results = ranks(4).run(_failed_save, str(tmp_path), timeout=120)
    own = (
        f"saving checkpoint {tmp_path}/iter_0000002 failed: TypeError: cannot store object at 'bad' "
        "without pickle; use tensors, numbers, strings, lists and dicts"
    )
    assert results == [(f"rank 2: {own}", 1)] * 2 + [(own, 1)] + [(f"rank 2: {own}", 1)]


def _truncate_then_load(rank, world_size, root):
    p = _rank_parallel(rank)
    _save(root, 1, p, rank)
    if rank == 0:  # truncate rank 3's optimizer file
        path = os.path.join(root, "iter_0000001", "optim_tp0_pp1_dp1.safetensors")
        os.truncate(path, os.path.getsize(path) - 10)
    dist.barrier()
    return _error_of(load_checkpoint, root, parallel=p, expected_model_shapes=_shapes(p["pp_rank"]))


def test_truncated_file_fails_on_every_rank_with_the_same_message(ranks, tmp_path):
    messages = ranks(4).run(_truncate_then_load, str(tmp_path), timeout=120)
    path = tmp_path / "iter_0000001" / "optim_tp0_pp1_dp1.safetensors"
    size = os.path.getsize(path)
    assert (
        messages
        == [
            (
                f"checkpoint file {path} is truncated or corrupt: its header describes "
                f"{size + 10} bytes but the file has {size}"
            )
        ]
        * 4
    )


def _shape_mismatch_on_rank_3(rank, world_size, root):
    p = _rank_parallel(rank)
    _save(root, 1, p, rank)
    shapes = _shapes(p["pp_rank"])
    if rank == 3:
        shapes["output_layer.weight"] = (32, 4)
    return _error_of(load_checkpoint, root, parallel=p, expected_model_shapes=shapes)


def test_a_shape_mismatch_on_one_rank_is_raised_on_all_ranks(ranks, tmp_path):
    messages = ranks(4).run(_shape_mismatch_on_rank_3, str(tmp_path), timeout=120)
    own = (
        f"checkpoint file {tmp_path}/iter_0000001/model_tp0_pp1.safetensors does not match the model: "
        "tensor 'output_layer.weight' has shape (16, 4) in the checkpoint but (32, 4) in the model"
    )
    assert messages == [f"rank 3: {own}"] * 3 + [own]


def _signals(rank, world_size):
    with SignalHandler() as handler:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return handler.signals_received()


def test_signal_handler_tells_every_rank(ranks):
    assert ranks(4).run(_signals, timeout=60) == [[False, True, False, False]] * 4


# --------------------------------------------------------------------------------------------------
# In-process: exact messages, no pickle, finetune
# --------------------------------------------------------------------------------------------------


def test_no_pickle_anywhere(tmp_path):
    _save_all_in_process(tmp_path)
    for dirpath, _, files in os.walk(tmp_path):
        for name in files:
            assert name.endswith((".safetensors", ".json", ".txt")), name
            with open(os.path.join(dirpath, name), "rb") as fh:
                head = fh.read(2)
            assert head[:1] != b"\x80" and head != b"PK", f"{name} looks like a pickle or torch.save zip"
    assert (tmp_path / TRACKER).read_text() == "1"
    manifest = json.loads((tmp_path / "iter_0000001" / "manifest.json").read_text())
    assert (manifest["iteration"], manifest["parallel"]) == (1, {"tp": 1, "pp": 2, "dp": 2, "vpp": 1})


def test_finetune_loads_weights_only_at_iteration_zero(tmp_path):
    _save_all_in_process(tmp_path)
    ckpt = _load(tmp_path, finetune=True)
    assert (ckpt.iteration, ckpt.consumed_samples) == (0, 0)
    assert (ckpt.optimizer_state, ckpt.scheduler_state, ckpt.rng_state) == (None, None, None)
    assert _equal(ckpt.model_state, _model(1))
    # Weights only, so a different data-parallel size is fine.
    assert _load(tmp_path, parallel=_parallel(0, 1, 0, dp=1), finetune=True).iteration == 0


def test_no_load_optim_and_no_load_rng(tmp_path):
    _save_all_in_process(tmp_path)
    ckpt = _load(tmp_path, load_optim=False, load_rng=False)
    assert ckpt.iteration == 1
    assert (ckpt.optimizer_state, ckpt.scheduler_state, ckpt.rng_state) == (None, None, None)
    ckpt = _load(tmp_path, load_rng=False)
    assert _equal(ckpt.optimizer_state, _optimizer(3)) and ckpt.scheduler_state == {"num_steps": 16}


def test_missing_checkpoint(tmp_path):
    assert _load(tmp_path, missing_ok=True) is None
    assert _error_of(_load, tmp_path) == f"no checkpoint in {tmp_path}: {tmp_path}/{TRACKER} is missing"
    (tmp_path / TRACKER).write_text("12abc")
    assert _error_of(_load, tmp_path) == (
        f"checkpoint tracker {tmp_path}/{TRACKER} is corrupt: expected an iteration number, got '12abc'"
    )


def _overwrite(data: bytes, mode: str = "r+b"):
    def damage(path: str) -> None:
        with open(path, mode) as fh:
            fh.write(data)

    return damage


@pytest.mark.parametrize(
    "victim, damage, message",
    [
        (
            "model_tp0_pp0.safetensors",
            _overwrite(b"\x05", "wb"),
            "is truncated or corrupt: 1 bytes, too short for a safetensors header",
        ),
        (
            "rng_tp0_pp1_dp0.safetensors",
            _overwrite(b"\xff" * 8),
            "is truncated or corrupt: its header claims 18446744073709551615 bytes but the file has",
        ),
        (
            "optim_tp0_pp0_dp1.safetensors",
            _overwrite(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json"),
            "is truncated or corrupt: its safetensors header cannot be parsed",
        ),
        ("model_tp0_pp1.safetensors", os.remove, "is missing"),
    ],
)
def test_corrupt_files_are_named_on_every_rank(tmp_path, victim, damage, message):
    _save_all_in_process(tmp_path)
    path = tmp_path / "iter_0000001" / victim
    damage(str(path))
    for pp_rank, dp_rank in [(0, 0), (1, 1)]:  # the owner and a rank that never reads the file
        assert _error_of(_load, tmp_path, pp_rank, dp_rank).startswith(f"checkpoint file {path} {message}")


def test_corrupt_manifest_is_named(tmp_path):
    _save_all_in_process(tmp_path)
    manifest = tmp_path / "iter_0000001" / "manifest.json"
    manifest.write_text("{")
    assert _error_of(_load, tmp_path) == f"checkpoint manifest {manifest} is corrupt"


def test_shape_missing_and_extra_tensors_are_named(tmp_path):
    _save_all_in_process(tmp_path)
    shapes = _shapes(1)
    shapes["decoder.layers.2.mlp.linear_fc1.weight"] = (4, 8)
    shapes["decoder.layers.9.mlp.linear_fc1.weight"] = (8, 4)
    del shapes["output_layer.weight"]
    path = tmp_path / "iter_0000001" / "model_tp0_pp1.safetensors"
    assert _error_of(_load, tmp_path, shapes=shapes) == (
        f"checkpoint file {path} does not match the model: "
        "tensor 'decoder.layers.2.mlp.linear_fc1.weight' has shape (8, 4) in the checkpoint but (4, 8) "
        "in the model; tensor 'decoder.layers.9.mlp.linear_fc1.weight' (8, 4) is missing from the "
        "checkpoint; the checkpoint has tensor 'output_layer.weight' (16, 4) that the model does not"
    )


CONVERT = "convert it with tools/convert_checkpoint.py (coming)"


@pytest.mark.parametrize(
    "ours, kw, hint",
    [
        (_parallel(tp=1, pp=2, dp=1, vpp=2), {}, f"TP=1 PP=2 VPP=2 DP=1; {CONVERT}"),
        (_parallel(tp=2, pp=1, dp=2), {"finetune": True}, f"TP=2 PP=1 DP=2; {CONVERT}"),
        (
            _parallel(tp=1, pp=2, dp=1),
            {"load_optim": False},
            (
                "TP=1 PP=2 DP=1; optimizer and RNG states are per data-parallel rank: pass --no-load-optim "
                "--no-load-rng (or --finetune) to load only the weights"
            ),
        ),
    ],
)
def test_parallel_size_mismatch(tmp_path, ours, kw, hint):
    _save_all_in_process(tmp_path)
    assert _error_of(_load, tmp_path, 0, 0, parallel=ours, **kw) == (
        f"checkpoint {tmp_path}/iter_0000001 was saved with TP=1 PP=2 DP=2, this run has {hint}"
    )


def test_stray_temporary_files_and_uncommitted_iterations_are_ignored(tmp_path):
    _save_all_in_process(tmp_path, iteration=1)
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "iter_0000001"))
    os.makedirs(tmp_path / "iter_0000002")
    (tmp_path / "iter_0000002" / ".model_tp0_pp0.safetensors.x.tmp").write_bytes(b"half a file")
    assert _load(tmp_path).iteration == 1


def test_flatten_state_round_trips_nested_python_values():
    state = {
        "a": [1, 2.5, None, "x", (True, torch.ones(2))],
        3: {"__odd": torch.zeros(1, dtype=torch.int64)},
        None: np.float32(1.5),
    }
    tensors, skeleton = flatten_state(state)
    assert sorted(tensors) == ["3/__odd", "a/4/1"]
    assert _equal(unflatten_state(tensors, skeleton), {**state, None: 1.5})
    with pytest.raises(TypeError, match="cannot store object at 'x' without pickle"):
        flatten_state({"x": object()})


def test_signal_handler_records_sigterm_and_restores_the_old_handler():
    before = signal.getsignal(signal.SIGTERM)
    with SignalHandler() as handler:
        assert handler.signals_received() == [False]
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.signals_received() == [True]
    assert signal.getsignal(signal.SIGTERM) is before

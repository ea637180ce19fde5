"""Checkpoints on four real gloo ranks: resharding on load, bit-identical conversions, crash safety.

One pool of ranks serves the whole module. A tiny LLaMA-style model (GQA, gated MLP with stride 2,
biases, embeddings tied across pipeline ranks, a padded vocabulary) is saved at TP=2 x PP=2 and
loaded at other splits. Parameters are initialised by name, so the same seed gives the same full
weights in every split: a model built at the target split with the saving seed is the reference,
independent of the checkpoint code. Optimizer states are filled the same way (by name, sliced with
``core.tensor_parallel.shard_of``). The last test runs the real ``pretrain()`` on the ranks and
resumes a TP2xPP2 checkpoint at TP1xPP4, directly and after ``tools/convert_checkpoint.py``. The
format's single-process tests are in ``test_checkpoint_format.py``. Bad checkpoints through real
torchrun (one line, printed once, every rank exits) are slow: ``pytest -m slow tests/e2e/test_checkpointing.py``.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import resource
import signal
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core import parallel_state
from core.optimizer import OptimizerConfig, get_megatron_optimizer
from core.tensor_parallel import get_rng_tracker, shard_of
from core.transformer.transformer_config import TransformerConfig
from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
from training.checkpoint import (
    CheckpointError,
    convert_checkpoint,
    open_checkpoint,
    target_split,
)
from training.checkpoint import load as checkpointing
from training.checkpoint import save as save_module
from training.checkpoint.async_save import CheckpointSaver
from training.checkpoint.files import read_header
from training.checkpoint.load import get_rng_state, load_checkpoint, save_checkpoint, set_rng_state
from training.data.indexed_dataset import IndexedDatasetBuilder
from training.faults.signal_handler import SignalHandler

VOCAB, SEQ, SEED = 50, 16, 11  # VOCAB pads to 56 at TP=1 and 64 at TP=2 and 4
STATES = ("exp_avg", "exp_avg_sq")


def make_config(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = SEED) -> TransformerConfig:
    return TransformerConfig(
        num_layers=8,
        hidden_size=16,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=32,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        position_embedding_type="rope",
        make_vocab_size_divisible_by=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        seed=seed,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )


def _padded_full(name: str, param: torch.Tensor, tp: int, salt: str) -> torch.Tensor:
    """A full tensor determined by (salt, name) alone, vocabulary padding rows zero, as ``shard_of`` wants."""
    key = "embedding.word_embeddings.weight" if getattr(param, "init_name", None) else name
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim % param.dim()] *= tp
    rows = getattr(param, "init_valid_rows", shape[0])
    full = torch.zeros(shape)
    full[:rows] = torch.randn(
        [rows, *shape[1:]], generator=torch.Generator().manual_seed(zlib.crc32(f"{salt}{key}".encode()))
    )
    return full


def _expected_adam(name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    tp, rank = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    out = {s: shard_of(_padded_full(name, param, tp, s), param, rank, tp) for s in STATES}
    return out | {"step": torch.tensor(3.0)}


def _build(tp: int, pp: int, vpp: int | None, seed: int):
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, vpp)
    config = make_config(tp, pp, vpp, seed)
    chunks = parallelize_gpt(gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config)).modules
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), chunks)
    return chunks, optimizer, checkpointing.model_parameters(chunks)


def _coordinate_seed() -> int:
    p = checkpointing.RankSplit.of(None)
    return 1000 + 100 * p.pp_rank + 10 * p.tp_rank + p.dp_rank


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


def _save_tp2_pp2(rank, world_size, root):
    chunks, optimizer, params = _build(2, 2, None, SEED)
    for name, param in params.items():
        optimizer.optimizer.state[optimizer.get_main_param(param)] = _expected_adam(name, param)
    _seed_everything(_coordinate_seed())
    save_checkpoint(
        root,
        3,
        model_chunks=chunks,
        optimizer=optimizer,
        scheduler_state={"num_steps": 48},
        consumed_samples=48,
        extra={"wandb_run_id": "abc123"},
    )
    return sorted(os.listdir(os.path.join(root, "iter_0000003")))


def _load_at(rank, world_size, root, tp, pp, vpp):
    _, _, reference = _build(tp, pp, vpp, SEED)
    chunks, optimizer, params = _build(tp, pp, vpp, seed=99)
    p = checkpointing.RankSplit.of(None)
    existed = p.tp_rank < 2 and p.pp_rank < 2 and p.dp_rank < 1
    _seed_everything(7)
    fresh = get_rng_state()
    loaded = load_checkpoint(root, model_chunks=chunks, optimizer=optimizer)
    assert (loaded.iteration, loaded.consumed_samples, loaded.scheduler_state) == (3, 48, {"num_steps": 48})
    for name, param in params.items():
        assert torch.equal(param, reference[name]), name
        state = optimizer.optimizer.state[optimizer.get_main_param(param)]
        for key, value in _expected_adam(name, param).items():
            assert torch.equal(state[key], value), (name, key)
    draws = _draws()
    if existed:
        _seed_everything(_coordinate_seed())
    else:
        set_rng_state(fresh)
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(draws, _draws()))
    return loaded.resharded, loaded.rng_restored


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("tp2pp2"))
    files = ranks(4).run(_save_tp2_pp2, root, timeout=120)
    assert files[0] == sorted(
        ["manifest.json"]
        + [
            f"{k}_tp{t}_pp{p}{d}.safetensors"
            for k, d in (("model", ""), ("optim", "_dp0"), ("rng", "_dp0"))
            for t in (0, 1)
            for p in (0, 1)
        ]
    )
    return root


@pytest.mark.parametrize(
    "split, restored",
    [((2, 2, None), 4), ((1, 2, None), 2), ((4, 1, None), 2), ((1, 4, 2), 2)],
    ids=["same", "TP1PP2DP2", "TP4", "TP1PP4VPP2"],
)
def test_load_at_any_split_gives_each_rank_its_slices(ranks, saved, split, restored):
    results = ranks(4).run(_load_at, saved, *split, timeout=120)
    assert results == [(split != (2, 2, None), restored)] * 4


def test_reshard_round_trip_is_bit_identical(saved, tmp_path):
    """TP2xPP2 -> TP1xPP1 -> TP1xPP4 (VPP 2) -> TP2xPP2: the same bytes in every model and optimizer file."""
    source = saved
    for step, (tp, pp, vpp) in enumerate([(1, 1, None), (1, 4, 2), (2, 2, None)]):
        ckpt = open_checkpoint(source)
        target, config = target_split(ckpt, tensor_parallel=tp, pipeline_parallel=pp, virtual_stages=vpp)
        convert_checkpoint(ckpt, str(tmp_path / str(step)), target, config)
        source = str(tmp_path / str(step))
    before, after = open_checkpoint(saved), open_checkpoint(source)
    for name in [f for f in os.listdir(before.path) if f.startswith(("model", "optim"))]:
        a = safetensors.torch.load_file(os.path.join(before.path, name))
        b = safetensors.torch.load_file(os.path.join(after.path, name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert before.manifest["files"][name] == after.manifest["files"][name]  # same checksums too
    rng = sorted(f for f in os.listdir(after.path) if f.startswith("rng"))
    assert rng == ["rng_tp0_pp0_dp0.safetensors"]  # the one rank that exists in every split kept its states
    assert after.manifest["model"] == before.manifest["model"]


def _crash_then_load(rank, world_size, root):
    chunks, optimizer, _ = _build(1, 2, None, SEED)
    save_checkpoint(root, 1, model_chunks=chunks, optimizer=optimizer)
    real = save_module.write_manifest

    def dies_before_the_tracker(root_, iteration, manifest, commit=True):
        return real(root_, iteration, manifest, commit=False)

    save_module.write_manifest = dies_before_the_tracker
    try:
        save_checkpoint(root, 2, model_chunks=chunks, optimizer=optimizer)
    finally:
        save_module.write_manifest = real
    return load_checkpoint(root, model_chunks=chunks, optimizer=optimizer).iteration


def test_crash_before_the_tracker_update_loads_the_previous_checkpoint(ranks, tmp_path):
    assert ranks(4).run(_crash_then_load, str(tmp_path), timeout=120) == [1, 1, 1, 1]
    assert os.path.isfile(tmp_path / "iter_0000002" / "manifest.json")  # complete but never committed


def _failed_save(rank, world_size, root):
    chunks, optimizer, _ = _build(1, 2, None, SEED)
    save_checkpoint(root, 1, model_chunks=chunks, optimizer=optimizer)
    try:
        save_checkpoint(
            root,
            2,
            model_chunks=chunks,
            optimizer=optimizer,
            rng_state={"bad": object()} if rank == 2 else None,
        )
    except CheckpointError as err:
        message = str(err)
    return message, load_checkpoint(root, model_chunks=chunks, optimizer=optimizer).iteration


def test_a_save_failing_on_one_rank_fails_on_all_and_keeps_the_previous_checkpoint(ranks, tmp_path):
    results = ranks(4).run(_failed_save, str(tmp_path), timeout=120)
    own = (
        f"saving checkpoint {tmp_path}/iter_0000002 failed: TypeError: cannot store object at 'bad' "
        "without pickle; use tensors, numbers, strings, lists and dicts"
    )
    assert results == [(f"rank 2: {own}", 1)] * 2 + [(own, 1)] + [(f"rank 2: {own}", 1)]


def _async_save_whose_disk_fills_on_rank_2(rank, world_size, root):
    """Iteration 1 saved in the background and committed; then rank 2's writes fail (a file size limit,
    as a full disk) while the others' succeed. Every writer has ended when the ranks first poll."""
    chunks, optimizer, _ = _build(1, 2, None, SEED)
    saver = CheckpointSaver(async_save=True)
    saver.save(root, 1, model_chunks=chunks, optimizer=optimizer)
    assert saver.wait() == os.path.join(root, "iter_0000001")
    polls, message, limits = 0, None, resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 2:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        saver.save(root, 2, model_chunks=chunks, optimizer=optimizer)
        for thread in threading.enumerate():  # each rank's write ends before the next "iteration"
            if thread.name.startswith("checkpoint-writer"):
                thread.join()
        while polls < 3:
            polls += 1
            saver.poll()
    except CheckpointError as err:
        message = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    temporary = [f for f in os.listdir(os.path.join(root, "iter_0000002")) if f.endswith(".tmp")]
    iteration = load_checkpoint(root, model_chunks=chunks, optimizer=optimizer).iteration
    return message, polls, temporary, iteration


def test_an_async_save_failing_on_one_rank_stops_every_rank_at_the_same_poll(ranks, tmp_path):
    """The background write fails on rank 2 only: every rank raises at the first poll after the
    failure, naming the path; no temporary file is left; the previous checkpoint loads."""
    results = ranks(4).run(_async_save_whose_disk_fills_on_rank_2, str(tmp_path), timeout=120)
    own = f"saving checkpoint {tmp_path}/iter_0000002 failed: OSError: [Errno 27] File too large"
    assert [r[0] for r in results] == [f"rank 2: {own}"] * 2 + [own] + [f"rank 2: {own}"]
    assert [r[1:] for r in results] == [(1, [], 1)] * 4  # the first check raised, on every rank


def _corrupt_then_load(rank, world_size, root, victim):
    chunks, optimizer, _ = _build(1, 2, None, SEED)
    save_checkpoint(root, 1, model_chunks=chunks, optimizer=optimizer)
    if rank == 0:
        path = os.path.join(root, "iter_0000001", victim)
        header = read_header(path)
        start = header["decoder.layers.5.mlp.linear_fc1.weight"]["start"]
        with open(path, "r+b") as fh:
            fh.seek(start + 8)
            fh.write(b"\xff" * 4096)
    dist.barrier()
    try:
        load_checkpoint(root, model_chunks=chunks, optimizer=optimizer)
    except CheckpointError as err:
        return str(err)


def test_a_corrupt_tensor_read_by_one_rank_is_refused_on_every_rank(ranks, tmp_path):
    messages = ranks(4).run(_corrupt_then_load, str(tmp_path), "model_tp0_pp1.safetensors", timeout=120)
    own = (
        f"checkpoint file {tmp_path}/iter_0000001/model_tp0_pp1.safetensors: the bytes of tensor "
        "'decoder.layers.5.mlp.linear_fc1.weight' do not match their checksum (the file is corrupt; "
        "--no-verify-checkpoint skips this check)"
    )
    assert messages == [f"rank 2: {own}"] * 2 + [own] * 2  # ranks 2 and 3 (pipeline rank 1) read it


def _signals(rank, world_size):
    with SignalHandler() as handler:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return handler.signals_received()


def test_signal_handler_tells_every_rank(ranks):
    assert ranks(4).run(_signals, timeout=60) == [[False, True, False, False]] * 4


def test_converter_keeps_rng_where_the_rank_exists_and_says_so(saved, tmp_path, capsys):
    from tools import convert_checkpoint

    out = str(tmp_path / "tp1pp4")
    flags = ["--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "4", "--quiet"]
    assert convert_checkpoint.main(["--load-dir", saved, "--save-dir", out, *flags]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("converted TP=2 PP=2 DP=1 -> TP=1 PP=4 DP=1: 328 tensors"), line
    assert line.endswith(
        "RNG states kept for 2 of 4 ranks, the other 2 will be seeded afresh as new ranks when training resumes"
    )
    for name in ("rng_tp0_pp0_dp0.safetensors", "rng_tp0_pp1_dp0.safetensors"):
        kept = Path(out, "iter_0000003", name).read_bytes()
        assert kept == Path(saved, "iter_0000003", name).read_bytes()
    assert not os.path.exists(os.path.join(out, "iter_0000003", "rng_tp0_pp2_dp0.safetensors"))
    assert convert_checkpoint.main(["--load", saved, "--save", out, *flags]) == 1  # never overwrites
    assert (
        capsys.readouterr().err
        == f"error: {out}/iter_0000003 already holds a checkpoint; choose another --save or remove it\n"
    )


# --------------------------------------------------------------------------------------------------
# pretrain() resumes a TP2xPP2 checkpoint at another split
# --------------------------------------------------------------------------------------------------

DATA_VOCAB = 300  # pads to 384 at TP=1 and 512 at TP=2: the resharded vocabulary changes its padding
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
RUN = [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(DATA_VOCAB), "--split", "100,0,0", "--num-workers", "0",
]  # fmt: skip
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TP1PP4 = ["--pipeline-model-parallel-size", "4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("reshard-data")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(root / "docs.bin", dtype=np.uint16)
    for _ in range(200):
        tokens = rng.integers(0, DATA_VOCAB - 1, size=int(rng.integers(5, 60)))
        builder.add_document(np.append(tokens, DATA_VOCAB - 1), [tokens.size + 1])
    builder.finalize(root / "docs.idx")
    return str(root / "docs")


def _pretrain(rank, world_size, argv):
    from tests.support.pretrain_run import pretrain_gpt_in_process

    with contextlib.redirect_stdout(io.StringIO()) as out:
        # a daemonic pool worker cannot start DataLoader workers
        state = pretrain_gpt_in_process(argv=[*argv, "--num-workers", "0"])
    return state.losses, out.getvalue()


def _losses(pool, *argv: str) -> tuple[list[float], str]:
    """The logging rank's "lm loss" per iteration and rank 0's output."""
    per_rank = pool.run(_pretrain, list(argv), timeout=180)
    losses = next(losses for losses, _ in per_rank if losses)
    return [step["lm loss"] for step in losses], per_rank[0][1]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_the_next_steps_after_a_reshard_match(ranks, data, tmp_path):
    """(i) TP2xPP2 resumed from its iteration-2 checkpoint (``--ckpt-step 2``) repeats the uninterrupted
    run bit for bit; (ii) TP1xPP4 from a converted copy and (iii) TP1xPP4 loading it directly, with
    ``--use-checkpoint-args`` and no model flags, agree with (i) within 1e-5 (fp32, dropout 0)."""
    from tools import convert_checkpoint

    pool, ckpt = ranks(4), str(tmp_path / "tp2pp2")
    common = RUN + ["--data-path", data]
    straight, _ = _losses(pool, *MODEL, *common, *TP2PP2, "--save", ckpt, "--save-interval", "2")
    assert len(straight) == 5
    resumed, _ = _losses(pool, *MODEL, *common, *TP2PP2, "--load", ckpt, "--ckpt-step", "2")  # (i)
    assert resumed == straight[2:]
    converted = str(tmp_path / "tp1pp4")
    flags = ["--iteration", "2", "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "4"]
    assert convert_checkpoint.main(["--load", ckpt, "--save", converted, "--quiet", *flags]) == 0
    after_convert, _ = _losses(pool, *MODEL, *common, *TP1PP4, "--load", converted)  # (ii)
    direct, out = _losses(
        pool, *common, *TP1PP4, "--load", ckpt, "--ckpt-step", "2", "--use-checkpoint-args"
    )  # (iii)
    print(
        f"relative differences to (i): converted {_rel(after_convert, resumed):.2e}, direct {_rel(direct, resumed):.2e}"
    )
    assert _rel(after_convert, resumed) <= 1e-5 and _rel(direct, resumed) <= 1e-5, (
        resumed,
        after_convert,
        direct,
    )
    assert f"resharded checkpoint {ckpt}/iter_0000002 from TP=2 PP=2 VPP=1 DP=1 (layout 'E,t*2|t*2,L')" in out
    assert (
        "RNG states restored on 2 of 4 ranks; the other ranks did not exist in the checkpoint's split" in out
    )


# --------------------------------------------------------------------------------------------------
# Bad checkpoints through real torchrun (slow: pytest -m slow tests/e2e/test_checkpointing.py)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_checkpoints_through_torchrun_print_one_line_and_end_every_rank(data, tmp_path):
    """A --save that is a regular file, a corrupt tensor read by one pipeline rank, and a --num-layers
    that contradicts the checkpoint: each is one line naming the file (and tensor) or both values,
    printed once, and every rank exits 1."""
    from tests.support.torchrun_jobs import TINY, job_env, run, worker_tracebacks

    prog, ckpt = "pretrain_gpt.py", tmp_path / "ckpt"
    base = [
        *TINY,
        "--pipeline-model-parallel-size",
        "2",
        "--vocab-size",
        str(DATA_VOCAB),
        "--data-path",
        data,
    ]

    def fails_once(flags: list[str], line: str, found_by: str = "") -> None:
        """``found_by``: the "rank N: " that a rank which did not see the problem itself puts first."""
        code, output = run(2, [*base, *flags], env=job_env())
        printed = [x for x in output.splitlines() if "error:" in x]
        assert code == 1 and printed in ([f"{prog}: error: {line}"], [f"{prog}: error: {found_by}{line}"]), (
            output[-4000:]
        )
        assert worker_tracebacks(output) == [], output[-4000:]

    (tmp_path / "file").write_text("x")
    fails_once(
        ["--train-iters", "2", "--save", str(tmp_path / "file")],
        f"--save {tmp_path}/file is not a directory: it is a regular file",
    )
    code, output = run(2, [*base, "--train-iters", "2", "--save", str(ckpt)], env=job_env())
    assert code == 0, output[-3000:]
    victim = ckpt / "iter_0000002" / "model_tp0_pp1.safetensors"
    start = read_header(str(victim))["decoder.layers.3.mlp.linear_fc1.weight"]["start"]
    with open(victim, "r+b") as fh:
        fh.seek(start + 64)
        fh.write(b"\xff" * 4096)
    line = (
        f"checkpoint file {victim}: the bytes of tensor 'decoder.layers.3.mlp.linear_fc1.weight' do not match "
        "their checksum (the file is corrupt; --no-verify-checkpoint skips this check)"
    )
    fails_once(["--train-iters", "3", "--load", str(ckpt)], line, found_by="rank 1: ")  # pipeline rank 1
    flags = ["--train-iters", "3", "--load", str(ckpt), "--num-layers", "6"]
    fails_once(
        flags,
        f"--load {ckpt}/iter_0000002 holds another model: --num-layers 6 but the checkpoint has 4; pass the "
        "checkpoint's values, or --use-checkpoint-args to take every model flag from it",
    )


def test_a_restart_whose_latest_checkpoint_is_corrupt_falls_back_to_the_previous_one(
    tmp_path, monkeypatch, capsys
):
    """Iteration 4's model file is cut short: a manual resume stops with one error naming the file; a
    torchrun restart (TORCHELASTIC_RESTART_COUNT > 0, no one to ask) says so and resumes from iteration
    2, the previous complete checkpoint. A corrupt tracker then: the restart loads the latest complete
    checkpoint (before the model flags are checked against the checkpoint, which skips a corrupt tracker)."""
    from tests.support.pretrain_run import pretrain_gpt_in_process
    from tests.support.torchrun_jobs import TINY, write_tiny_dataset

    ckpt = tmp_path / "ckpt"
    data = write_tiny_dataset(tmp_path / "tiny")
    argv = [
        *TINY,
        "--data-path",
        str(data),
        "--save",
        str(ckpt),
        "--save-interval",
        "2",
        "--train-iters",
        "6",
    ]
    pretrain_gpt_in_process(argv=[*argv, "--exit-interval", "4"])
    model = ckpt / "iter_0000004" / "model_tp0_pp0.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(CheckpointError) as manual:
        pretrain_gpt_in_process(argv=[*argv, "--load", str(ckpt)])
    assert str(model) in str(manual.value)
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    state = pretrain_gpt_in_process(argv=argv)
    out = capsys.readouterr().out
    assert f"{manual.value}; falling back to {ckpt / 'iter_0000002'}, the previous complete checkpoint" in out
    assert state.iteration == 6 and " iteration        3/       6 |" in out
    tracker = ckpt / "latest_checkpointed_iteration.txt"  # now 6; a corrupt tracker falls back the same way
    tracker.write_text("6x")
    state = pretrain_gpt_in_process(argv=argv)
    said = f"checkpoint tracker {tracker} is corrupt: expected an iteration number, got '6x'"
    assert f"{said}; falling back to {ckpt / 'iter_0000006'}, the previous complete checkpoint" in (
        capsys.readouterr().out
    )
    assert state.iteration == 6

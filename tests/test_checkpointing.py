"""Checkpoints: resharding on real ranks, bit-identical conversions, crash safety, one clear error per problem.

The multi-rank tests save a tiny LLaMA-style model (GQA, gated MLP with stride 2, biases, tied
embeddings across pipeline ranks, a padded vocabulary) at TP=2 x PP=2 from four gloo ranks and load
it at other splits. Parameters are initialised by name, so the same seed gives the same full
weights in every split: a model built at the target split with the saving seed is the reference,
independent of the checkpoint code. Optimizer states are filled the same way (by name, sliced
with ``core.tensor_parallel.shard_of``). The in-process tests write checkpoints with the offline
writer and damage them.
"""

from __future__ import annotations

import json
import os
import random
import signal
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
from models.gpt import build_model_chunks
from models.gpt.presets import gpt2_config
from training import checkpointing
from training.checkpoint import (
    TRACKER,
    CheckpointError,
    Parallelism,
    Partition,
    TensorSpec,
    convert_checkpoint,
    flatten_state,
    gpt_tensor_specs,
    open_checkpoint,
    remove_stale_temp_files,
    target_split,
    unflatten_state,
    write_checkpoint,
)
from training.checkpoint.files import TensorFileWriter, read_header
from training.checkpoint.format import optimizer_tensor_name, shard_from_full
from training.checkpointing import get_rng_state, load_checkpoint, save_checkpoint, set_rng_state
from training.signal_handler import SignalHandler

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
    chunks = build_model_chunks(make_config(tp, pp, vpp, seed), VOCAB, SEQ)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), chunks)
    return chunks, optimizer, checkpointing.model_parameters(chunks)


def _coordinate_seed() -> int:
    p = checkpointing.current_parallel()
    return 1000 + 100 * p["pp_rank"] + 10 * p["tp_rank"] + p["dp_rank"]


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
    p = checkpointing.current_parallel()
    existed = p["tp_rank"] < 2 and p["pp_rank"] < 2 and p["dp_rank"] < 1
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
    real = checkpointing.write_manifest

    def dies_before_the_tracker(root_, iteration, manifest, commit=True):
        return real(root_, iteration, manifest, commit=False)

    checkpointing.write_manifest = dies_before_the_tracker
    try:
        save_checkpoint(root, 2, model_chunks=chunks, optimizer=optimizer)
    finally:
        checkpointing.write_manifest = real
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
    assert messages == [f"rank 2: {own}"] * 2 + [
        own,
        f"rank 2: {own}",
    ]  # ranks 2 and 3 (pipeline rank 1) read it


def _signals(rank, world_size):
    with SignalHandler() as handler:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return handler.signals_received()


def test_signal_handler_tells_every_rank(ranks):
    assert ranks(4).run(_signals, timeout=60) == [[False, True, False, False]] * 4


# --------------------------------------------------------------------------------------------------
# In-process: the format, the converter's checks, damaged files
# --------------------------------------------------------------------------------------------------


def _write(root, tp=2, pp=2, config=None, vocab=VOCAB, **kw) -> str:
    """A checkpoint of a GPT-2-style tiny model (tied embeddings) with Adam states, written offline."""
    config = config or gpt2_config(
        num_layers=4, hidden_size=32, num_attention_heads=4, make_vocab_size_divisible_by=8
    )
    specs, tied = gpt_tensor_specs(config, vocab, SEQ)
    for name, spec in list(specs.items()):
        specs[optimizer_tensor_name("exp_avg", name)] = spec
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(spec.shape, generator=gen) for name, spec in specs.items()}
    layout = f"E,t*{4 // pp}" + f"|t*{4 // pp}" * (pp - 2) + (f"|t*{4 // pp},L" if pp > 1 else ",L")
    write_checkpoint(
        str(root),
        tensors.items(),
        specs=specs,
        tied=tied,
        parallelism=Parallelism(tp, pp, 1, layout),
        config=config.to_dict(),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        optimizer={"param_groups": []},
        **kw,
    )
    return tensors


def test_files_are_plain_safetensors_with_no_pickle_and_group_readable(tmp_path):
    old = os.umask(0o002)
    try:
        tensors = _write(tmp_path)
    finally:
        os.umask(old)
    path = tmp_path / "iter_0000000"
    for name in os.listdir(path):
        assert name.endswith((".safetensors", ".json")), name
        assert os.stat(path / name).st_mode & 0o777 == 0o664, name  # the umask, not mkstemp's 0600
    shard = safetensors.torch.load_file(path / "model_tp1_pp0.safetensors")[
        "decoder.layers.0.mlp.linear_fc1.weight"
    ]
    assert torch.equal(shard, tensors["decoder.layers.0.mlp.linear_fc1.weight"][64:])
    assert (tmp_path / TRACKER).read_text() == "0"
    ckpt = open_checkpoint(str(tmp_path))
    assert ckpt.config == gpt2_config(
        num_layers=4, hidden_size=32, num_attention_heads=4, make_vocab_size_divisible_by=8
    )
    assert (ckpt.vocab_size, ckpt.padded_vocab_size) == (VOCAB, 64)
    assert all(torch.equal(t, tensors[n]) for n, t in ckpt.iter_full_tensors("all"))


def test_config_round_trips_through_json():
    for config in (
        make_config(2, 2, seed=3),
        gpt2_config(num_layers=2, hidden_size=8, num_attention_heads=2, bf16=True),
    ):
        assert TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"activation_func 'tanh' has no name to be saved under"):
        make_config().__class__(
            num_layers=1, hidden_size=4, num_attention_heads=1, activation_func=torch.tanh
        ).to_dict()


@pytest.mark.parametrize("dim, stride", [(0, 1), (1, 1), (0, 2)])
def test_partition_cuts_what_shard_of_cuts(dim, stride):
    full = torch.randn(24, 12)
    param = torch.empty(24, 12)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride
    spec = TensorSpec((24, 12), torch.float32, Partition(dim, stride), 0)
    for tp in (1, 2, 3):
        for rank in range(tp):
            assert torch.equal(shard_from_full(full, spec, rank, tp), shard_of(full, param, rank, tp))


def _flip(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def test_damaged_files_name_the_file_and_the_tensor(tmp_path):
    _write(tmp_path)
    path = tmp_path / "iter_0000000" / "model_tp0_pp1.safetensors"
    key = "decoder.layers.3.mlp.linear_fc1.weight"
    start = read_header(str(path))[key]["start"]
    original = path.read_bytes()
    _flip(str(path), start + 100, bytes([original[start + 100] ^ 1]))
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(str(tmp_path)).full_tensor(key)
    assert str(err.value) == (
        f"checkpoint file {path}: the bytes of tensor '{key}' do not match their checksum (the file is "
        "corrupt; --no-verify-checkpoint skips this check)"
    )
    open_checkpoint(str(tmp_path), verify=False).full_tensor(key)  # the impatient may skip the check
    _flip(str(path), 20, b"X")  # inside the header
    with pytest.raises(
        CheckpointError, match=r"model_tp0_pp1.safetensors is corrupt: its header does not match its checksum"
    ):
        open_checkpoint(str(tmp_path)).full_tensor(key)
    path.write_bytes(original[:-10])
    with pytest.raises(
        CheckpointError, match=r"model_tp0_pp1.safetensors is truncated or corrupt: the manifest records"
    ):
        open_checkpoint(str(tmp_path)).full_tensor(key)
    os.remove(path)
    with pytest.raises(CheckpointError, match=f"^checkpoint file {path} is missing$"):
        open_checkpoint(str(tmp_path)).full_tensor(key)


def _convert_error(tmp_path, *flags: str) -> str:
    from tools import convert_checkpoint

    out = str(tmp_path / "out")
    try:
        assert convert_checkpoint.main(["--load", str(tmp_path), "--save", out, "--quiet", *flags]) == 1
    finally:
        assert not os.path.exists(os.path.join(out, TRACKER))  # nothing was committed
    return out


TARGET = "error: --target-tensor-parallel-size {} --target-pipeline-model-parallel-size {}{}: the target split does not fit the checkpoint's model: {}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--target-tensor-parallel-size", "3", "--target-pipeline-model-parallel-size", "1"],
            TARGET.format(
                3,
                1,
                "",
                "invalid TransformerConfig: num_attention_heads (4) must be divisible by tensor_model_parallel_size "
                "(3); num_query_groups (4) must be divisible by tensor_model_parallel_size (3); ffn_hidden_size (128) "
                "must be divisible by tensor_model_parallel_size (3)",
            ),
        ),
        (
            [
                "--target-tensor-parallel-size",
                "1",
                "--target-pipeline-parallel-size",
                "2",
                "--target-pipeline-model-parallel-layout",
                "Et|tL",
            ],
            TARGET.format(
                1,
                2,
                " --target-pipeline-model-parallel-layout 'Et|tL'",
                "pipeline layout 'Et|tL': the layout has 2 decoder layers ('t') but num_layers is 4",
            ),
        ),
    ],
    ids=["heads", "layers"],
)
def test_a_target_split_that_does_not_fit_is_refused(tmp_path, capsys, flags, message):
    _write(tmp_path)
    _convert_error(tmp_path, *flags)
    assert capsys.readouterr().err == message + "\n"


def test_a_vocabulary_without_padding_must_divide(tmp_path):
    specs = {"embedding.word_embeddings.weight": TensorSpec((50, 4), torch.float32, Partition(0), "E")}
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'embedding.word_embeddings.weight': dimension 0 \(50\) is not divisible by tensor-parallel size 4",
    ):
        write_checkpoint(
            str(tmp_path),
            [],
            specs=specs,
            tied={},
            parallelism=Parallelism(4, 1, 1, "E,L"),
            config={},
            vocab_size=50,
            max_sequence_length=SEQ,
        )


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


def test_flat_pieces_from_a_sharded_optimizer_are_assembled(tmp_path):
    """The ZeRO extension point: a TP shard stored as flat ranges in two DP ranks' files reads back whole."""
    tensors = _write(tmp_path, tp=2, pp=1)
    path = tmp_path / "iter_0000000"
    manifest = json.loads((path / "manifest.json").read_text())
    name = optimizer_tensor_name("exp_avg", "decoder.layers.1.mlp.linear_fc2.weight")
    shard = safetensors.torch.load_file(path / "optim_tp1_pp0_dp0.safetensors")[name].reshape(-1)
    records = {}
    for d, (start, end) in enumerate([(0, 100), (100, shard.numel())]):
        file = f"optim_tp1_pp0_dp{d + 5}.safetensors"
        with TensorFileWriter(str(path / file), [(name, torch.float32, (end - start,))]) as writer:
            writer.write(name, shard[start:end].clone())
            records[file] = writer.close()
        records[file]["pieces"][name] |= {"tp_rank": 1, "flat": [start, end]}
    del manifest["files"]["optim_tp1_pp0_dp0.safetensors"]["pieces"][name]
    manifest["files"].update(records)
    (path / "manifest.json").write_text(json.dumps(manifest))
    ckpt = open_checkpoint(str(tmp_path))
    assert torch.equal(ckpt.full_tensor(name), tensors[name])
    assert torch.equal(ckpt.read_shard(name, 1, 4), tensors[name][:, 32:64])


def test_missing_empty_and_broken_load_directories(tmp_path):
    chunks = build_model_chunks(make_config(), VOCAB, SEQ)
    for where in (tmp_path / "missing", tmp_path):  # Megatron starts from scratch; so do we
        assert load_checkpoint(str(where), model_chunks=chunks) is None
    with pytest.raises(
        CheckpointError, match=r"no checkpoint in .* to load \(--exit-on-missing-checkpoint\)"
    ):
        load_checkpoint(str(tmp_path), model_chunks=chunks, exit_on_missing=True)
    (tmp_path / TRACKER).write_text("12abc")
    with pytest.raises(CheckpointError, match="is corrupt: expected an iteration number, got '12abc'"):
        load_checkpoint(str(tmp_path), model_chunks=chunks)
    (tmp_path / TRACKER).write_text("5")
    with pytest.raises(CheckpointError, match=r"checkpoint manifest .*iter_0000005/manifest.json is missing"):
        load_checkpoint(str(tmp_path), model_chunks=chunks)
    os.makedirs(tmp_path / "iter_0000005")
    (tmp_path / "iter_0000005" / "manifest.json").write_text(json.dumps({"format": "trident-checkpoint-v1"}))
    with pytest.raises(CheckpointError, match="is in the old trident-checkpoint-v1 format"):
        load_checkpoint(str(tmp_path), model_chunks=chunks)
    with pytest.raises(
        CheckpointError, match=r"^no checkpoint for iteration 7 in .*iter_0000007 does not exist$"
    ):
        load_checkpoint(str(tmp_path), model_chunks=chunks, iteration=7)


def test_save_dir_probe_and_stale_temporary_files(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"^--save .*/file is not a directory: it is a regular file$"):
        checkpointing.prepare_save_dir(str(tmp_path / "file"))
    with pytest.raises(CheckpointError, match=r"^--save .*/file/sub is not writable: Not a directory$"):
        checkpointing.prepare_save_dir(str(tmp_path / "file" / "sub"))
    root = tmp_path / "ck"
    _write(root)
    kept = sorted(os.listdir(root / "iter_0000000"))
    stale = [
        root / ".latest_checkpointed_iteration.txt.0a1b2c3d.tmp",
        root / "iter_0000000" / ".model_tp0_pp0.safetensors.deadbeef.tmp",
    ]
    for path in stale:
        path.write_bytes(b"half a file")
    (root / "iter_0000000" / ".notes.tmp").write_text("not ours")
    assert sorted(checkpointing.prepare_save_dir(str(root))) == sorted(map(str, stale))
    assert sorted(os.listdir(root / "iter_0000000")) == sorted(kept + [".notes.tmp"])
    assert remove_stale_temp_files(str(root)) == []


def test_checkpoint_args_take_or_check_the_model_flags(tmp_path):
    from training.argument_checks import validate_args
    from training.arguments import parse_args
    from training.checkpoint_args import check_checkpoint_args, load_checkpoint_args

    _write(tmp_path, tokenizer_type="NullTokenizer")
    base = ["--load", str(tmp_path), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
    base += ["--train-iters", "20", "--seq-length", str(SEQ)]
    args = parse_args(base + ["--use-checkpoint-args"])
    load_checkpoint_args(args)
    check_checkpoint_args(validate_args(args, 1))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (
        4,
        32,
        4,
        128,
    )
    args = parse_args(base + ["--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4"])
    with pytest.raises(ValueError) as err:
        check_checkpoint_args(validate_args(args, 1))
    assert str(err.value) == (
        f"--load {tmp_path}/iter_0000000 holds another model: --num-layers 6 but the checkpoint has 4; "
        "pass the checkpoint's values, or --use-checkpoint-args to take every model flag from it"
    )


def test_ckpt_format_accepts_megatrons_names_only():
    from training.argument_checks import validate_args
    from training.arguments import parse_args

    for fmt in ("torch", "torch_dist"):
        validate_args(parse_args(["--ckpt-format", fmt]), 1)
    with pytest.raises(
        ValueError, match=r"^--ckpt-format zarr is not supported: Trident writes one checkpoint format"
    ):
        validate_args(parse_args(["--ckpt-format", "zarr"]), 1)


def test_flatten_state_round_trips_nested_python_values():
    state = {
        "a": [1, 2.5, None, "x", (True, torch.ones(2))],
        3: {"__odd": torch.zeros(1, dtype=torch.int64)},
        None: np.float32(1.5),
    }
    tensors, skeleton = flatten_state(state)
    assert sorted(tensors) == ["3/__odd", "a/4/1"]
    restored = unflatten_state(tensors, skeleton)
    assert restored["a"][:4] == [1, 2.5, None, "x"] and restored[None] == 1.5
    assert torch.equal(restored["a"][4][1], torch.ones(2)) and torch.equal(
        restored[3]["__odd"], torch.zeros(1, dtype=torch.int64)
    )
    with pytest.raises(TypeError, match="cannot store object at 'x' without pickle"):
        flatten_state({"x": object()})


def test_signal_handler_records_sigterm_and_restores_the_old_handler():
    before = signal.getsignal(signal.SIGTERM)
    with SignalHandler() as handler:
        assert handler.signals_received() == [False]
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.signals_received() == [True]
    assert signal.getsignal(signal.SIGTERM) is before

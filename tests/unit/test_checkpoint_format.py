"""The checkpoint format in one process: files, checksums, the converter's checks, bad directories, flags.

Checkpoints here are written by the offline writer (``write_checkpoint``) from random full tensors of
a tiny GPT-2-style model (tied embeddings, vocabulary 50 padded to 64 at TP=2), then read, converted
or damaged. The multi-rank save and load paths are in ``test_checkpointing.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from core.tensor_parallel import shard_of
from core.transformer.transformer_config import TransformerConfig
from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
from models.gpt.presets import gpt2_config
from training.checkpoint import (
    TRACKER,
    CheckpointError,
    Parallelism,
    Partition,
    TensorSpec,
    flatten_state,
    gpt_tensor_specs,
    open_checkpoint,
    read_tracker,
    remove_stale_temp_files,
    staging,
    unflatten_state,
    write_checkpoint,
)
from training.checkpoint import load as checkpointing
from training.checkpoint.async_save import CheckpointSaver
from training.checkpoint.files import TensorFileWriter, read_header
from training.checkpoint.format import optimizer_tensor_name, shard_from_full
from training.checkpoint.load import load_checkpoint
from training.faults.signal_handler import SignalHandler

VOCAB, SEQ = 50, 16


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


def test_tokenizer_files_are_copied_in_and_travel_with_the_checkpoint(tmp_path):
    model = tmp_path / "spm.model"
    model.write_bytes(b"\x00sentencepiece bytes\xff")
    files = {"tokenizer_model": str(model)}
    _write(tmp_path / "run", tokenizer_type="GPTSentencePieceTokenizer", tokenizer_files=files)
    os.remove(model)
    os.rename(tmp_path / "run", tmp_path / "moved")  # no path outside the checkpoint is needed
    from tools import convert_checkpoint

    flags = ["--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "1", "--quiet"]
    assert (
        convert_checkpoint.main(["--load", str(tmp_path / "moved"), "--save", str(tmp_path / "tp1"), *flags])
        == 0
    )
    for root in ("moved", "tp1"):
        tokenizer = open_checkpoint(str(tmp_path / root)).tokenizer
        assert tokenizer["type"] == "GPTSentencePieceTokenizer"
        copied = tokenizer["files"]["tokenizer_model"]
        assert copied == str(tmp_path / root / "iter_0000000" / "tokenizer" / "spm.model")
        assert Path(copied).read_bytes() == b"\x00sentencepiece bytes\xff"


def test_config_round_trips_through_json():
    llama = TransformerConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        position_embedding_type="rope",
        tensor_model_parallel_size=2,
    )
    for config in (llama, gpt2_config(num_layers=2, hidden_size=8, num_attention_heads=2, bf16=True)):
        assert TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"activation_func 'tanh' has no name to be saved under"):
        TransformerConfig(
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
    weight = "decoder.layers.1.mlp.linear_fc2.weight"  # a whole piece: rows 1-3 hold the range
    for verify in (True, False):  # unverified reads take only the rows (or elements) the range needs
        ckpt = open_checkpoint(str(tmp_path), verify=verify)
        flat = tensors[name][:, 64:].reshape(-1)
        assert torch.equal(ckpt.read_flat_range(name, 1, 2, 90, 130), flat[90:130])
        assert torch.equal(ckpt.read_flat_range(name, 1, 2, 100, 100), flat[100:100])
        assert torch.equal(
            ckpt.read_flat_range(weight, 1, 2, 40, 130), tensors[weight][:, 64:].reshape(-1)[40:130]
        )
        assert torch.equal(
            ckpt.read_flat_range(name, 1, 4, 10, 50), tensors[name][:, 32:64].reshape(-1)[10:50]
        )
    os.remove(path / "optim_tp1_pp0_dp5.safetensors")
    with pytest.raises(CheckpointError, match=r"checkpoint file .*/optim_tp1_pp0_dp5.safetensors is missing"):
        open_checkpoint(str(tmp_path)).read_flat_range(name, 1, 2, 90, 130)
    del manifest["files"]["optim_tp1_pp0_dp5.safetensors"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=rf"pieces of tensor '{name}' for TP rank 1 cover 30 of the 40 "
    ):
        open_checkpoint(str(tmp_path)).read_flat_range(name, 1, 2, 90, 130)


def test_missing_empty_and_broken_load_directories(tmp_path):
    config = gpt2_config(num_layers=2, hidden_size=8, num_attention_heads=2)
    chunks = parallelize_gpt(gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config)).modules
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


def _tiny_run(bf16: bool):
    from core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = gpt2_config(num_layers=2, hidden_size=8, num_attention_heads=2, bf16=bf16, seed=5)
    chunks = parallelize_gpt(gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config)).modules
    return chunks, get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=bf16), chunks)


def test_fp32_master_weights_survive_a_change_of_precision(tmp_path):
    """A bf16 run's fp32 master copies become an fp32 run's weights, and an fp32 run's weights a bf16
    run's master copies: neither direction rounds through bf16."""
    chunks, optimizer = _tiny_run(bf16=True)
    masters = {}
    for name, param in checkpointing.model_parameters(chunks).items():
        main = optimizer.get_main_param(param)
        with torch.no_grad():
            main.add_(1e-3 * torch.randn_like(main))  # fp32 values bf16 cannot hold
            param.copy_(main)
        masters[name] = main.clone()
    checkpointing.save_checkpoint(str(tmp_path / "bf16"), 1, model_chunks=chunks, optimizer=optimizer)
    chunks, optimizer = _tiny_run(bf16=False)
    load_checkpoint(str(tmp_path / "bf16"), model_chunks=chunks, optimizer=optimizer)
    for name, param in checkpointing.model_parameters(chunks).items():
        assert torch.equal(param, masters[name]), name
    checkpointing.save_checkpoint(str(tmp_path / "fp32"), 1, model_chunks=chunks, optimizer=optimizer)
    chunks, optimizer = _tiny_run(bf16=True)
    load_checkpoint(str(tmp_path / "fp32"), model_chunks=chunks, optimizer=optimizer)
    for name, param in checkpointing.model_parameters(chunks).items():
        assert torch.equal(optimizer.get_main_param(param), masters[name]), name


def _state_of(optimizer, params) -> dict[str, list[torch.Tensor]]:
    """Each parameter's weight, fp32 main copy and Adam moment (the live tensors)."""
    out = {}
    for name, param in params.items():
        main = optimizer.get_main_param(param)
        out[name] = [param, main, optimizer.optimizer.state[main]["exp_avg"]]
    return out


def test_saving_copies_nothing_synchronously_and_stages_once_asynchronously(tmp_path, monkeypatch):
    """bf16 on the CPU. The optimizer state is exported as views; a synchronous save writes the live
    tensors (no host memory held); an asynchronous save of the same state writes the same bytes and
    checksums from images of its files, made at its first save and reused by the next; an optimizer
    step right after save() returns waits for the writer's copy (slowed here, so the step would
    otherwise win), so it does not reach the file, which commits only when asked. Loading into a
    trained optimizer overwrites its state in place."""
    chunks, optimizer = _tiny_run(bf16=True)
    params = checkpointing.model_parameters(chunks)
    for param in params.values():
        main = optimizer.get_main_param(param)
        main.grad = torch.randn_like(main)
        optimizer.optimizer.state[main] = {
            "exp_avg": torch.randn_like(main), "exp_avg_sq": torch.rand_like(main), "step": torch.tensor(2.0)
        }  # fmt: skip
    live = _state_of(optimizer, params)
    exported = optimizer.param_state_by_name(copy=False)["params"]
    for name, (_, main, exp_avg) in live.items():
        assert exported[name]["main_param"].data_ptr() == main.data_ptr()
        assert exported[name]["exp_avg"].data_ptr() == exp_avg.data_ptr()
    root, rng = str(tmp_path), checkpointing.get_rng_state()
    synchronous = CheckpointSaver()
    assert synchronous.save(root, 1, model_chunks=chunks, optimizer=optimizer, rng_state=rng).endswith("1")
    assert synchronous.staging.nbytes == 0 and read_tracker(root) == 1
    saver = CheckpointSaver(async_save=True)
    expected = {name: [t.detach().clone() for t in tensors] for name, tensors in live.items()}
    copy_in = staging.HostStaging.copy_in
    monkeypatch.setattr(staging.HostStaging, "copy_in", lambda self: (time.sleep(0.3), copy_in(self)))
    saver.save(root, 2, model_chunks=chunks, optimizer=optimizer, rng_state=rng)
    optimizer.optimizer.step()  # training goes on while the copy is written
    optimizer._copy_main_params_to_model_params()
    changed = {name: [not torch.equal(a, b) for a, b in zip(live[name], expected[name])] for name in live}
    assert all(main and moment for _, main, moment in changed.values())  # bf16 weights: most of them
    assert sum(weight for weight, _, _ in changed.values()) > len(changed) // 2
    assert read_tracker(root) == 1  # written in the background, committed only by poll() or wait()
    assert saver.wait() == os.path.join(root, "iter_0000002") and read_tracker(root) == 2
    one, two = open_checkpoint(root, iteration=1), open_checkpoint(root, iteration=2)
    assert one.manifest["files"] == two.manifest["files"]  # the same sizes and checksums
    for name in one.manifest["files"]:
        assert (tmp_path / "iter_0000001" / name).read_bytes() == (
            tmp_path / "iter_0000002" / name
        ).read_bytes()
    images = [image.buffer.data_ptr() for image in saver.staging._images.values()]
    saver.save(root, 3, model_chunks=chunks, optimizer=optimizer)
    saver.wait()
    assert [image.buffer.data_ptr() for image in saver.staging._images.values()] == images
    load_checkpoint(root, model_chunks=chunks, optimizer=optimizer, iteration=2)
    for name, tensors in _state_of(optimizer, params).items():
        assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in live[name]], name
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected[name])), name


def test_async_save_refuses_a_copy_the_host_cannot_hold(tmp_path, monkeypatch):
    """The staging buffers would not fit in the memory left for the node's ranks: the next check
    stops the run with one line giving the numbers; nothing is written."""
    chunks, optimizer = _tiny_run(bf16=False)
    monkeypatch.setattr(staging, "available_host_memory", lambda: 1000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    saver = CheckpointSaver(async_save=True)
    path = saver.save(str(tmp_path), 1, model_chunks=chunks, optimizer=optimizer)
    with pytest.raises(CheckpointError) as raised:
        saver.poll()
    assert re.fullmatch(
        rf"--async-save: staging checkpoint {path} in host memory needs [0-9.]+ kB on this rank \(x 8 "
        r"ranks on this node\), but only 1.0 kB is available; save without --async-save \(it writes the "
        r"live tensors and needs no copy\), or split the state over more ranks \(TP, PP, "
        r"--use-distributed-optimizer\)",
        str(raised.value),
    ), str(raised.value)
    assert not saver.in_flight and os.listdir(tmp_path) == []


def test_finetune_loads_the_weights_only_and_starts_at_iteration_zero(tmp_path):
    chunks, optimizer = _tiny_run(bf16=False)
    params = checkpointing.model_parameters(chunks)
    for param in params.values():
        optimizer.optimizer.state[optimizer.get_main_param(param)] = {"exp_avg": torch.ones_like(param)}
    saved = {name: param.detach().clone() for name, param in params.items()}
    checkpointing.save_checkpoint(
        str(tmp_path), 7, model_chunks=chunks, optimizer=optimizer, scheduler_state={"num_steps": 7},
        consumed_samples=56,
    )  # fmt: skip
    chunks, optimizer = _tiny_run(bf16=False)
    for param in checkpointing.model_parameters(chunks).values():
        with torch.no_grad():
            param.zero_()
    loaded = load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=optimizer, finetune=True)
    assert (loaded.iteration, loaded.consumed_samples, loaded.scheduler_state) == (0, 0, None)
    assert loaded.rng_restored == 0 and len(optimizer.optimizer.state) == 0
    for name, param in checkpointing.model_parameters(chunks).items():
        assert torch.equal(param, saved[name]), name
        assert torch.equal(optimizer.get_main_param(param), saved[name]), (
            name
        )  # the optimizer steps from them


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


def _no_model(*args, **kwargs):
    raise AssertionError("the model was built before --save was checked")


def test_pretrain_checks_save_before_building_anything(tmp_path):
    from tests.support.pretrain_run import pretrain_gpt_in_process

    (tmp_path / "file").write_text("x")
    argv = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--save", str(tmp_path / "file")]
    with pytest.raises(CheckpointError, match=r"^--save .*/file is not a directory: it is a regular file$"):
        pretrain_gpt_in_process(model_provider=_no_model, argv=argv)


def test_checkpoint_args_take_or_check_the_model_flags(tmp_path):
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args
    from training.checkpoint.model_args import check_checkpoint_args, load_checkpoint_args

    _write(tmp_path, tokenizer_type="NullTokenizer")
    # VOCAB ids: NullTokenizer's N + 1 convention (ids 0..N-1 and the end-of-document id N)
    base = ["--load", str(tmp_path), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
    base += ["--train-iters", "20", "--micro-batch-size", "2", "--lr", "1e-3"]
    args = parse_args(base + ["--use-checkpoint-args"])
    load_checkpoint_args(args)
    check_checkpoint_args(validate_args(args, 1))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (
        4,
        32,
        4,
        128,
    )
    args = parse_args(
        base + f"--num-layers 6 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ}".split()
    )
    with pytest.raises(ValueError) as err:
        check_checkpoint_args(validate_args(args, 1))
    assert str(err.value) == (
        f"--load {tmp_path}/iter_0000000 holds another model: --num-layers 6 but the checkpoint has 4; "
        "--openai-gelu False (default) but the checkpoint has True; "  # the GPT-2 preset's tanh GELU
        "pass the checkpoint's values, or --use-checkpoint-args to take every model flag from it"
    )
    model = f"--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} --openai-gelu"
    check_checkpoint_args(validate_args(parse_args(base + model.split()), 1))


def test_use_checkpoint_args_takes_the_vocabulary_and_the_dropout_and_says_so(tmp_path):
    """An imported model (dropout 0, a Hugging Face tokenizer) fine-tuned on token ids: the NullTokenizer's
    --vocab-size comes from the checkpoint's VOCAB ids, the dropout from its config, unless given."""
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args, startup_report
    from training.checkpoint.model_args import check_checkpoint_args, load_checkpoint_args

    (tmp_path / "hf_tokenizer").mkdir()
    (tmp_path / "hf_tokenizer" / "tokenizer.json").write_text("{}")
    config = gpt2_config(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0
    )
    files = {"tokenizer_model": str(tmp_path / "hf_tokenizer")}
    _write(tmp_path / "ck", config=config, tokenizer_type="HuggingFaceTokenizer", tokenizer_files=files)
    base = f"--load {tmp_path / 'ck'} --use-checkpoint-args --tokenizer-type NullTokenizer --train-iters 2 "
    base += "--micro-batch-size 2 --lr 1e-3"

    def taken(extra: str):
        args = parse_args([*base.split(), *extra.split()])
        load_checkpoint_args(args)
        check_checkpoint_args(validate_args(args, 1))
        reported = [line for line in startup_report(args) if line.startswith("--use-checkpoint-args")]
        return args, reported

    args, reported = taken("")
    assert (args.vocab_size, args.tokenizer_model) == (VOCAB - 1, None)  # not the Hugging Face folder
    assert (args.hidden_dropout, args.attention_dropout) == (0.0, 0.0)
    assert reported == [
        (
            f"--use-checkpoint-args: the model flags not given come from {tmp_path}/ck/iter_0000000: "
            f"--num-layers 2 --hidden-size 32 --ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 8 "
            f"--openai-gelu --max-position-embeddings {SEQ} --seq-length {SEQ} --hidden-dropout 0.0 "
            f"--attention-dropout 0.0 --vocab-size {VOCAB - 1} (the others equal their defaults); give a "
            "flag to override the checkpoint's value"
        )
    ]
    args, reported = taken("--hidden-dropout 0.2")  # a dropout flag given wins
    assert (args.hidden_dropout, args.attention_dropout) == (0.2, 0.0)
    assert "--hidden-dropout" not in reported[0] and "--attention-dropout 0.0" in reported[0]


def test_ckpt_format_accepts_megatrons_names_only():
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args

    for fmt in ("torch", "torch_dist", "fsdp_dtensor"):
        validate_args(parse_args(["--ckpt-format", fmt]), 1)
    with pytest.raises(
        ValueError,
        match=r"^Trident does not support --ckpt-format zarr: Trident writes one checkpoint format",
    ):
        parse_args(["--ckpt-format", "zarr"])
    with pytest.raises(SystemExit):
        parse_args(["--ckpt-format", "npz"])


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


def test_a_stacked_expert_parameter_is_stored_and_its_optimizer_range_cut_per_expert():
    """A rank holding experts 4..6 stacked stores three tensors under the experts' own names (views of
    the parameter), and a distributed optimizer's range across them is cut at the experts' borders."""
    from core.transformer.moe.experts import Experts
    from tests.support.moe_reference import moe_config
    from training.checkpoint.live import checkpoint_tensors, slice_ranges, unstacked_entries

    fc1 = Experts(moe_config(num_moe_experts=8), first=4, count=3).linear_fc1.weight
    name, size = "decoder.layers.1.mlp.experts.linear_fc1.weight", fc1[0].numel()
    names = [f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in (4, 5, 6)]
    tensors = checkpoint_tensors({name: fc1})
    assert list(tensors) == names and tensors[names[1]].data_ptr() == fc1[1].data_ptr()
    start, end = size // 2, 2 * size + 3
    exp_avg = torch.arange(end - start, dtype=torch.float32)
    entry = {"start": start, "end": end, "numel": 3 * size, "shape": list(fc1.shape), "exp_avg": exp_avg}
    pieces = unstacked_entries(name, entry | {"step": torch.tensor(7.0)}, fc1)
    assert [(n, e["start"], e["end"], e["shape"]) for n, e in pieces] == [
        (names[0], size // 2, size, list(fc1.shape[1:])),
        (names[1], 0, size, list(fc1.shape[1:])),
        (names[2], 0, 3, list(fc1.shape[1:])),
    ]
    assert torch.equal(torch.cat([e["exp_avg"] for _, e in pieces]), exp_avg)
    assert all(float(e["step"]) == 7.0 for _, e in pieces)
    assert slice_ranges(name, fc1, start, end) == [
        (names[0], size // 2, size, 0),
        (names[1], 0, size, size - size // 2),
        (names[2], 0, 3, 2 * size - size // 2),
    ]


def test_fp8_states_of_experts_saved_before_stacking_load_under_todays_names():
    from training.checkpoint.load import fp8_state_name

    old = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.fp8_state.amax_history"
    assert fp8_state_name(old) == "decoder.layers.3.mlp.experts.linear_fc2.fp8_state.5.amax_history"
    dense = "decoder.layers.3.self_attention.linear_qkv.fp8_state.scale"
    assert fp8_state_name(dense) == dense

"""Bad input: one line naming the problem, the right exit code, printed once, and every rank exits.

Most cases run in this process through the real parser, validators and data readers, then through
the real entry point (``training.faults.run_main``) as each of four ranks would: rank 0 prints the
one line, ranks 1-3 print nothing, all exit with the same code. A handful run through real torchrun,
where an error seen by one rank only must still be printed once, and no rank may hang or print a
traceback. The torchrun figures for the slow ones: ``pytest -m slow tests/e2e/test_bad_input.py``.
"""

from __future__ import annotations

import io
import re
import shutil
import struct
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.torchrun_jobs import TINY, VOCAB, job_env, run, worker_tracebacks, write_tiny_dataset
from training.data.builder import build_train_valid_test_datasets
from training.data.gpt_dataset import GPTDataset
from training.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from training.faults import run_main

PROG = "pretrain_gpt.py"
REBUILD = "rerun tools/preprocess_data.py to rebuild the pair"
SPLIT_HINT = "expected up to three comma-separated weights, e.g. 969,30,1"


@dataclass(frozen=True)
class Case:
    """Bad input that fails ``act(tmp_path)`` with ``message`` (``{p}``: the dataset prefix) and ``code``."""

    name: str
    act: object
    message: str
    code: int = 1


def _flags(argv: str, world: int = 4):
    def act(tmp_path: Path, monkeypatch) -> None:
        from training.run import parse_run

        monkeypatch.setenv("WORLD_SIZE", str(world))
        parse_run(argv.split(), world)

    return act


# A full command line (the tiny demo is off), for checks that need the model flags given.
FULL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--train-iters 3 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 1000 "
)

USAGE = [
    Case("unknown flag", _flags("--bogus 3"), "unrecognized arguments: --bogus 3 (see --help)", 2),
    Case(
        "int flag", _flags("--num-layers x"), "argument --num-layers: invalid int value: 'x' (see --help)", 2
    ),
    Case("float flag", _flags("--lr abc"), "argument --lr: invalid float value: 'abc' (see --help)", 2),
    Case("missing value", _flags("--lr"), "argument --lr: expected one argument (see --help)", 2),
]

CONFIG = [
    Case("split letter", _flags("--split 1,2,x"), f"--split '1,2,x': 'x' is not a number; {SPLIT_HINT}"),
    Case(
        "split negative",
        _flags("--split 90,-10,20"),
        f"--split '90,-10,20': weight -10 is negative; {SPLIT_HINT}",
    ),
    Case("split four", _flags("--split 1,2,3,4"), f"--split '1,2,3,4': {SPLIT_HINT}"),
    Case(
        "split zero",
        _flags("--split 0,0,0"),
        f"--split '0,0,0': the weights sum to 0, so no split gets any data; {SPLIT_HINT}",
    ),
    Case("split nan", _flags("--split nan,1"), f"--split 'nan,1': weight nan is not finite; {SPLIT_HINT}"),
    Case("split empty weight", _flags("--split 1,,2"), f"--split '1,,2': '' is not a number; {SPLIT_HINT}"),
    Case(
        "blend weights",
        _flags(FULL + "--data-path -1 A 1 B"),
        "--data-path: blend weights must be finite numbers >= 0 with a positive sum, got ['-1', '1']",
    ),
    Case(
        "both scheduler overrides",
        _flags("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler"),
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive: "
        "give at most one",
    ),
    Case(
        "timeout",
        _flags("--distributed-timeout-minutes 0"),
        "--distributed-timeout-minutes must be >= 1, got 0",
    ),
    Case(
        "world size",
        _flags("--tensor-model-parallel-size 3"),
        "world size (4) must be divisible by --tensor-model-parallel-size (3) x --pipeline-model-parallel-size "
        "(1) = 3",
    ),
    Case(
        "world size over CP",
        _flags("--context-parallel-size 3"),
        "world size (4) must be divisible by --tensor-model-parallel-size (1) x --pipeline-model-parallel-size "
        "(1) x --context-parallel-size (3) = 3",
    ),
    Case(
        "sequence over CP",
        _flags(FULL + "--context-parallel-size 2 --seq-length 18 --max-position-embeddings 18"),
        "--seq-length (18) must be divisible by 2 x --context-parallel-size (2) = 4: each sequence is cut "
        "into that many equal chunks",
    ),
    Case(
        "sequence over CP x TP",
        _flags(
            FULL
            + "--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel --seq-length 20 "
            "--max-position-embeddings 20",
            world=8,
        ),
        "--seq-length (20) must be divisible by --context-parallel-size (2) x --tensor-model-parallel-size (4) "
        "= 8 with --sequence-parallel",
    ),
    Case(
        "a2a heads over CP",
        _flags(FULL + "--context-parallel-size 4 --cp-comm-type a2a --num-attention-heads 2"),
        "--cp-comm-type a2a splits heads over the context-parallel ranks: --num-attention-heads (2) and the "
        "query groups (2) per --tensor-model-parallel-size (1) rank must be divisible by "
        "--context-parallel-size (4)",
    ),
    Case(
        "a2a query groups over CP",
        _flags(
            FULL + "--context-parallel-size 2 --cp-comm-type a2a --group-query-attention --num-query-groups 1"
        ),
        "--cp-comm-type a2a splits heads over the context-parallel ranks: --num-attention-heads (4) and the "
        "query groups (1) per --tensor-model-parallel-size (1) rank must be divisible by "
        "--context-parallel-size (2)",
    ),
    Case(
        "cp comm type",
        _flags("--context-parallel-size 2 --cp-comm-type ring"),
        "--cp-comm-type ring: must be one of p2p, a2a, allgather",
    ),
    Case(
        "hierarchical cp",
        _flags("--context-parallel-size 2 --cp-comm-type a2a+p2p"),
        "--cp-comm-type a2a+p2p: Trident does not support hierarchical context parallelism (all-to-all "
        "inside a node, ring across nodes); use p2p, a2a or allgather",
    ),
    Case(
        "heads over TP",
        _flags(FULL + "--tensor-model-parallel-size 2 --num-attention-heads 3"),
        "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)",
    ),
    Case(
        "global batch",
        _flags("--global-batch-size 7 --micro-batch-size 2"),
        "--global-batch-size (7) must be divisible by --micro-batch-size (2) x data-parallel size (4) = 8",
    ),
    Case(
        "warm-up",
        _flags(FULL + "--lr-warmup-iters 10"),
        "--lr-warmup-iters (10) must be < the decay iterations (3, from --lr-decay-iters or else --train-iters)",
    ),
    Case("min lr", _flags("--min-lr 1 --lr 0.1"), "--min-lr (1.0) must be <= --lr (0.1)"),
    Case("dropout", _flags("--hidden-dropout 1.5"), "--hidden-dropout must be in [0, 1), got 1.5"),
    Case(
        "layout stages",
        _flags("--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout Et|tL"),
        "--pipeline-model-parallel-layout: pipeline layout 'Et|tL': 2 stages are not a multiple of "
        "pipeline-model-parallel size 4 (stage s runs on pp_rank s % 4)",
    ),
    Case(
        "layout symbol",
        _flags("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tXL"),
        "--pipeline-model-parallel-layout: pipeline layout 'Et|tXL': unknown symbol 'X' at position 4 "
        "(expected E, t, m, L, '|', '(', ')', '*', digits or ',')",
    ),
    Case(
        "null tokenizer",
        _flags("--tokenizer-type NullTokenizer"),
        "--tokenizer-type NullTokenizer needs --vocab-size",
    ),
    Case(
        "positions",
        _flags(FULL + "--seq-length 256 --max-position-embeddings 128"),
        "--seq-length (256) must be <= --max-position-embeddings (128) with --position-embedding-type "
        "learned_absolute",
    ),
    Case(
        "config file",
        _flags("--config /nonexistent/run.yaml"),
        "config file /nonexistent/run.yaml: cannot read it (No such file or directory)",
        2,
    ),
    Case(
        "warm-up twice",
        _flags("--lr-warmup-fraction 0.1 --lr-warmup-iters 3"),
        "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive: give at most one",
    ),
    Case(
        "recompute",
        _flags("--recompute-granularity full"),
        "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers",
    ),
    Case(
        "gpipe and virtual stages",
        _flags(
            "--pipeline-model-parallel-size 2 --pipeline-schedule gpipe --num-virtual-stages-per-pipeline-rank 2"
        ),
        "--pipeline-schedule gpipe cannot run virtual pipeline stages (2 per rank); the 1f1b schedule interleaves them",
    ),
    Case("micro batch", _flags("--micro-batch-size 0"), "--micro-batch-size must be >= 1, got 0"),
    Case(
        "async save without save",
        _flags("--async-save"),
        "--async-save writes the --save checkpoints in the background, but no --save directory is given",
    ),
    Case("adam eps", _flags("--adam-eps 0"), "--adam-eps must be > 0, got 0.0"),
    Case(
        "sequence parallel",
        _flags(
            FULL + "--sequence-parallel --tensor-model-parallel-size 2 --seq-length 127 "
            "--max-position-embeddings 128"
        ),
        "--seq-length (127) must be divisible by --tensor-model-parallel-size (2) with --sequence-parallel",
    ),
    Case(
        "query groups",
        _flags("--group-query-attention --num-query-groups 3"),
        "--num-attention-heads (4) must be divisible by --num-query-groups (3)",
    ),
    Case(
        "meta device without sharding",
        _flags(
            "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --init-model-with-meta-device"
        ),
        "--init-model-with-meta-device is not supported or necessary with --use-megatron-fsdp "
        "--data-parallel-sharding-strategy no_shard (as in Megatron-FSDP): every rank holds the whole model "
        "anyway; drop the flag or pick a sharding strategy",
    ),
]


# --------------------------------------------------------------------------------------------------
# Data files: a good pair is written, then damaged one way per case
# --------------------------------------------------------------------------------------------------

DOCS, LENGTH = 200, 60
IDX_BYTES = 34 + DOCS * 12 + (DOCS + 1) * 8  # header, lengths, pointers, document index
BIN_BYTES = DOCS * LENGTH * 2


def _damaged(damage):
    """An ``act`` that writes a good pair at ``tmp_path/d``, damages it, and opens it."""

    def act(tmp_path: Path, monkeypatch) -> None:
        prefix = write_tiny_dataset(tmp_path / "d", documents=DOCS, length=LENGTH)
        damage(Path(f"{prefix}.idx"), Path(f"{prefix}.bin"))
        IndexedDataset(prefix)

    return act


def _truncate(size: int, suffix: str):
    def damage(idx: Path, bin_: Path) -> None:
        path = idx if suffix == "idx" else bin_
        path.write_bytes(path.read_bytes()[:size])

    return damage


def _append(extra: bytes, suffix: str):
    def damage(idx: Path, bin_: Path) -> None:
        path = idx if suffix == "idx" else bin_
        path.write_bytes(path.read_bytes() + extra)

    return damage


def _patch_idx(offset: int, data: bytes):
    def damage(idx: Path, bin_: Path) -> None:
        raw = bytearray(idx.read_bytes())
        raw[offset : offset + len(data)] = data
        idx.write_bytes(bytes(raw))

    return damage


def _as_int32(idx: Path, bin_: Path) -> None:
    np.fromfile(bin_, dtype=np.uint16).astype(np.int32).tofile(bin_)


def _missing(suffix: str):
    def damage(idx: Path, bin_: Path) -> None:
        (idx if suffix == "idx" else bin_).unlink()

    return damage


def _one_document_dataset(tmp_path: Path, tokens: list[int], dtype) -> Path:
    prefix = tmp_path / "one"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    builder.add_document(tokens, [len(tokens)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def _out_of_vocabulary(token: int, dtype):
    def act(tmp_path: Path, monkeypatch) -> None:
        prefix = _one_document_dataset(tmp_path, [3] * 40 + [token] + [3] * 59, dtype)
        dataset = GPTDataset(
            IndexedDataset(prefix), np.arange(1), None, seq_length=50, seed=1, vocab_size=VOCAB
        )
        for k in range(len(dataset)):
            dataset[k]

    return act


def _out_of_vocabulary_in_a_worker(token: int):
    """The same bad id, found by a DataLoader worker process (``--num-workers``) instead."""

    def act(tmp_path: Path, monkeypatch) -> None:
        from core import parallel_state as ps
        from training.data.batches import BatchStream

        prefix = _one_document_dataset(tmp_path, [3] * 40 + [token] + [3] * 59, np.uint16)
        dataset = GPTDataset(
            IndexedDataset(prefix), np.arange(1), None, seq_length=50, seed=1, vocab_size=VOCAB
        )
        ps.initialize_distributed()  # a world of one, as pretrain() makes without torchrun
        try:
            ps.initialize_model_parallel(1, 1)
            BatchStream(dataset, micro_batch_size=1, seq_length=50, num_workers=1).step(0, 1)
        finally:
            ps.destroy_distributed()

    return act


def _tokenizer_model(content: bytes | None):
    """A SentencePiece ``--tokenizer-model`` that is missing (None) or holds ``content``."""

    def act(tmp_path: Path, monkeypatch) -> None:
        from training.tokenizer import build_tokenizer

        model = tmp_path / "d" / ("missing.model" if content is None else "bad.model")
        model.parent.mkdir(exist_ok=True)
        if content is not None:
            model.write_bytes(content)
        build_tokenizer("GPTSentencePieceTokenizer", model)  # as pretrain_gpt.tokenizer_provider calls it

    return act


def _null_tokenizer_on_a_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A 64-id model imported with its Hugging Face tokenizer, fine-tuned on token ids: --vocab-size 64."""
    from tests.unit.test_checkpoint_format import _write
    from training.run import parse_run

    if not (tmp_path / "ck").exists():  # written once, for the first of the four ranks
        (tmp_path / "hf_tokenizer").mkdir()
        files = {"tokenizer_model": str(tmp_path / "hf_tokenizer")}
        _write(tmp_path / "ck", vocab=64, tokenizer_type="HuggingFaceTokenizer", tokenizer_files=files)
    model = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --openai-gelu"
    flags = f"{model} --micro-batch-size 2 --train-iters 3 --lr 1e-3 --tokenizer-type NullTokenizer"
    parse_run(f"{flags} --vocab-size 64 --load {tmp_path / 'ck'}".split(), 1)


def _empty_test_split(tmp_path: Path, monkeypatch) -> None:
    prefix = write_tiny_dataset(tmp_path / "d", documents=DOCS, length=LENGTH)
    build_train_valid_test_datasets([str(prefix)], "969,30,1", 16, 1, (8, 8, 8))


DATA = [
    Case(
        "no .idx",
        _damaged(_missing("idx")),
        "indexed dataset file {p}.idx not found (--data-path prefix '{p}'; a prefix names both P.bin and P.idx, "
        "without the suffix)",
    ),
    Case(
        "no .bin",
        _damaged(_missing("bin")),
        "indexed dataset file {p}.bin not found (--data-path prefix '{p}'; a prefix names both P.bin and P.idx, "
        "without the suffix)",
    ),
    Case("empty .idx", _damaged(_truncate(0, "idx")), f"index file {{p}}.idx is empty: {REBUILD}"),
    Case(
        "short .idx",
        _damaged(_truncate(20, "idx")),
        f"index file {{p}}.idx has 20 bytes, fewer than its 34-byte header: {REBUILD}",
    ),
    Case(
        "truncated .idx",
        _damaged(_truncate(3000, "idx")),
        f"index file {{p}}.idx is truncated: it has 3000 bytes but its header describes {DOCS} sequences and "
        f"{DOCS} documents ({IDX_BYTES} bytes); {REBUILD}",
    ),
    Case(
        "long .idx",
        _damaged(_append(b"\0" * 8, "idx")),
        f"index file {{p}}.idx is corrupt: it has {IDX_BYTES + 8} bytes but its header describes {DOCS} "
        f"sequences and {DOCS} documents ({IDX_BYTES} bytes); {REBUILD}",
    ),
    Case(
        "bad magic",
        _damaged(_patch_idx(0, b"NOTMEGAT")),
        "{p}.idx is not a Megatron indexed-dataset index (bad magic)",
    ),
    Case(
        "index version",
        _damaged(_patch_idx(9, struct.pack("<Q", 2))),
        "{p}.idx: unsupported index version 2 (expected 1)",
    ),
    Case(
        "dtype code",
        _damaged(_patch_idx(17, bytes([9]))),
        "{p}.idx: unknown indexed-dataset dtype code 9; known: [1, 2, 3, 4, 5, 6, 7, 8]",
    ),
    Case(
        "document index",
        _damaged(_patch_idx(IDX_BYTES - 8, struct.pack("<q", DOCS - 1))),
        f"{{p}}.idx: document index does not end at the sequence count {DOCS}",
    ),
    Case(
        "empty .bin",
        _damaged(_truncate(0, "bin")),
        f"data file {{p}}.bin has 0 bytes but {{p}}.idx describes {DOCS * LENGTH} uint16 tokens ({BIN_BYTES} "
        f"bytes): the .bin is truncated; {REBUILD}",
    ),
    Case(
        "truncated .bin",
        _damaged(_truncate(BIN_BYTES - 1000, "bin")),
        f"data file {{p}}.bin has {BIN_BYTES - 1000} bytes but {{p}}.idx describes {DOCS * LENGTH} uint16 tokens "
        f"({BIN_BYTES} bytes): the .bin is truncated; {REBUILD}",
    ),
    Case(
        "int32 .bin under a uint16 .idx",
        _damaged(_as_int32),
        f"data file {{p}}.bin has {2 * BIN_BYTES} bytes but {{p}}.idx describes {DOCS * LENGTH} uint16 tokens "
        f"({BIN_BYTES} bytes): the .bin holds 4-byte token ids where the .idx says 2-byte uint16: the two "
        "files were not written together",
    ),
    Case(
        "stray bytes after the .bin",
        _damaged(_append(b"\0" * 3, "bin")),
        f"data file {{p}}.bin has {BIN_BYTES + 3} bytes but {{p}}.idx describes {DOCS * LENGTH} uint16 tokens "
        f"({BIN_BYTES} bytes): the .bin and .idx were not written together; {REBUILD}",
    ),
    Case(
        "id beyond the vocabulary",
        _out_of_vocabulary(VOCAB + 50, np.uint16),
        f"token id {VOCAB + 50} in {{t}}/one.bin (sequence 0, train sample 0) is outside the tokenizer's {VOCAB} ids: "
        "the data was preprocessed with another tokenizer; rerun tools/preprocess_data.py with this run's "
        "--tokenizer-model (or --vocab-size)",
    ),
    Case(
        "negative id",
        _out_of_vocabulary(-5, np.int32),
        f"token id -5 in {{t}}/one.bin (sequence 0, train sample 0) is outside the tokenizer's {VOCAB} ids: the "
        "data was preprocessed with another tokenizer; rerun tools/preprocess_data.py with this run's "
        "--tokenizer-model (or --vocab-size)",
    ),
    Case(
        "id beyond the vocabulary, in a DataLoader worker",
        _out_of_vocabulary_in_a_worker(VOCAB + 60),
        f"token id {VOCAB + 60} in {{t}}/one.bin (sequence 0, train sample 0) is outside the tokenizer's {VOCAB} "
        "ids: the data was preprocessed with another tokenizer; rerun tools/preprocess_data.py with this run's "
        "--tokenizer-model (or --vocab-size)",
    ),
    Case(
        "tokenizer model missing",
        _tokenizer_model(None),
        "--tokenizer-model {p}/missing.model: no such file; give a SentencePiece model (.model)",
    ),
    Case(
        "tokenizer model not SentencePiece",
        _tokenizer_model(b"not a model\n"),
        "--tokenizer-model {p}/bad.model is not a SentencePiece model: sentencepiece cannot parse it (give the "
        ".model file written by tools/train_tokenizer.py or spm_train)",
    ),
    Case(
        "NullTokenizer vocabulary of a checkpoint",
        _null_tokenizer_on_a_checkpoint,
        "--load {t}/ck/iter_0000000 holds a model with 64 token ids, but --tokenizer-type NullTokenizer "
        "--vocab-size 64 has 65 (ids 0-63 and the end-of-document id 64): pass --vocab-size 63, or the "
        "checkpoint's tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
        "{t}/ck/iter_0000000/tokenizer/hf_tokenizer)",
    ),
    Case(
        "blend with a prefix missing",
        _flags(FULL + "--data-path 0.5 PREFIX 0.5"),
        "--data-path: 0.5 PREFIX 0.5 looks like 'weight prefix' pairs with weights 0.5, 0.5, but one is missing "
        "(3 items); give a prefix after every weight (e.g. 0.3 A 0.7 B), or prefixes only",
    ),
    Case(
        "split with no documents",
        _empty_test_split,
        "the test split of {p} has 0 documents and 0 tokens: too few to draw samples from (adjust --split)",
    ),
]


def _scheduler_case(flags: str, message: str) -> Case:
    """Resume a 4-iteration schedule (lr 1e-3, linear decay, batch 8) with other flags."""

    def act(tmp_path: Path, monkeypatch) -> None:
        import torch

        from core.optimizer.lr_scheduler import OptimizerParamScheduler
        from training.arguments.config import LearningRateArgs
        from training.arguments.parser import config_from_args, parse_args
        from training.checkpoint.resume import check_scheduler
        from training.lr_schedule import build_scheduler, scheduler_kwargs

        def schedule(argv: str):
            args = parse_args(argv.split())
            args.global_batch_size = 8
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            return args, build_scheduler(optimizer, scheduler_kwargs(args))

        _, saved = schedule("--train-iters 4 --lr 1e-3 --lr-warmup-iters 0 --lr-decay-style linear")
        args, scheduler = schedule(flags)
        assert isinstance(scheduler, OptimizerParamScheduler)
        lr = config_from_args(LearningRateArgs, args)
        check_scheduler(
            scheduler, saved.state_dict(), {"global_batch_size": 8}, lr=lr, global_batch_size=8, load="ck"
        )

    return Case(f"scheduler: {flags}", act, message)


SCHEDULER = [
    _scheduler_case(
        "--train-iters 8 --lr 0.01 --lr-warmup-iters 0 --lr-decay-style linear",
        "--load ck: the learning-rate schedule differs from the checkpoint's: --lr 0.01 here, 0.001 in the "
        "checkpoint; decay iterations (--lr-decay-iters, else --train-iters) 8 here, 4 in the checkpoint. Pass "
        "--override-opt_param-scheduler to follow the flags, or --use-checkpoint-opt_param-scheduler to keep "
        "the checkpoint's schedule",
    ),
    _scheduler_case(
        "--train-iters 4 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-style cosine",
        "--load ck: the learning-rate schedule differs from the checkpoint's: warm-up iterations "
        "(--lr-warmup-iters or --lr-warmup-fraction) 1 here, 0 in the checkpoint; --lr-decay-style cosine here, "
        "linear in the checkpoint. Pass --override-opt_param-scheduler to follow the flags, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule",
    ),
]


def _backend(forced: str):
    def act(tmp_path: Path, monkeypatch) -> None:
        from training.training import pretrain

        monkeypatch.setenv("TRIDENT_BACKEND", forced)
        pretrain(None, None, None, argv=f"{FULL} --mock-data".split())

    return act


# Where NCCL cannot work (CUDA hosts meet the GPU-count case instead: tests/unit/test_device.py).
DEVICE = (
    []
    if torch.cuda.is_available()
    else [
        Case(
            "TRIDENT_BACKEND=nccl without CUDA",
            _backend("nccl"),
            "TRIDENT_BACKEND=nccl needs CUDA, and this machine has no usable GPU",
        )
    ]
)

MOE_FLAGS = FULL + "--num-experts 6 --moe-aux-loss-coeff 1e-2 "
MOE = [
    Case(
        "experts over EP",
        _flags(MOE_FLAGS + "--expert-model-parallel-size 4"),
        "--num-experts (6) must be divisible by --expert-model-parallel-size (4)",
    ),
    Case(
        "EP x PP over the world",
        _flags(MOE_FLAGS + "--expert-model-parallel-size 3 --moe-token-dispatcher-type alltoall", world=4),
        "--expert-model-parallel-size (3) x --pipeline-model-parallel-size (1) = 3 does not divide the world "
        "size (4): the alltoall dispatcher's expert-parallel groups cannot be formed",
    ),
    Case(
        "alltoall EP beyond the world",
        _flags(MOE_FLAGS + "--expert-model-parallel-size 6 --moe-token-dispatcher-type alltoall", world=4),
        "--expert-model-parallel-size (6) x --pipeline-model-parallel-size (1) = 6 does not divide the world "
        "size (4): the alltoall dispatcher's expert-parallel groups cannot be formed",
    ),
    Case(
        "EP x TP x PP over the world",
        _flags(
            FULL + "--num-experts 8 --expert-model-parallel-size 4 --tensor-model-parallel-size 2 "
            "--sequence-parallel --pipeline-model-parallel-size 2",
            world=4,
        ),
        "--expert-model-parallel-size (4) x --pipeline-model-parallel-size (2) = 8 does not divide the world "
        "size (4): the allgather dispatcher's expert-parallel groups cannot be formed",
    ),
    Case(
        "top-k over experts",
        _flags(MOE_FLAGS + "--moe-router-topk 7"),
        "--moe-router-topk (7) must be between 1 and --num-experts (6)",
    ),
    Case(
        "MoE TP without SP",
        _flags(MOE_FLAGS + "--tensor-model-parallel-size 2"),
        "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel: each tensor-parallel "
        "rank routes its own sequence shard (as in Megatron)",
    ),
    Case(
        "expert TP",
        _flags(MOE_FLAGS + "--expert-tensor-parallel-size 2"),
        "--expert-tensor-parallel-size 2: Trident supports only 1 (experts are never split over tensor "
        "parallelism; Megatron's default, the tensor-parallel size, also means 1 here)",
    ),
    Case(
        "EP without experts",
        _flags("--expert-model-parallel-size 2"),
        "--expert-model-parallel-size 2 needs --num-experts (a model with experts)",
    ),
    Case(
        "layer pattern",
        _flags(MOE_FLAGS + "--moe-layer-freq ([1]*3)"),
        "--moe-layer-freq ([1]*3) must be an integer >= 1 or list 0 or 1 for each of the 2 layers (--num-layers)",
    ),
]

RAMP = [  # FULL on 4 ranks: micro batch 2 x DP 4 = 8 samples a round
    Case(
        "ramp and step schedule",
        _flags(FULL + "--global-batch-size 16 --rampup-batch-size 8 8 64 --step-batch-size-schedule 0:16"),
        "--rampup-batch-size and --step-batch-size-schedule are mutually exclusive: give one",
    ),
    Case(
        "ramp values",
        _flags(FULL + "--rampup-batch-size 8 8"),
        "--rampup-batch-size takes three values, START INCR SAMPLES (the start batch size, the increment and "
        "the samples to ramp over, e.g. --rampup-batch-size 16 16 5859375), got 2",
    ),
    Case(
        "ramp increments",
        _flags(FULL + "--global-batch-size 32 --rampup-batch-size 8 16 64"),
        "--rampup-batch-size 8 16 64 with --global-batch-size 32: the ramp from 8 to the global batch size 32 "
        "is not a whole number of increments: 32 - 8 = 24 is not divisible by 16",
    ),
    Case(
        "ramp batch",
        _flags(FULL + "--global-batch-size 32 --rampup-batch-size 8 4 64"),
        "--rampup-batch-size 8 4 64: the global batch size 12 of iteration 3 (from 16 consumed samples on) is "
        "not divisible by --micro-batch-size (2) x data-parallel size (4) = 8",
    ),
    Case(
        "ramp interleaved",
        _flags(
            FULL + "--global-batch-size 16 --rampup-batch-size 4 4 64 --pipeline-model-parallel-size 2 "
            "--num-virtual-stages-per-pipeline-rank 2"
        ),
        "--rampup-batch-size 4 4 64: the global batch size 4 of iteration 1 (from 0 consumed samples on) makes 1 "
        "microbatch: interleaved pipeline schedule needs at least pipeline_model_parallel_size (2) microbatches, "
        "got 1; raise the global batch size or lower --pipeline-model-parallel-size (interleaved schedule, 2 "
        "virtual stages per rank)",
    ),
    Case(
        "step schedule entry",
        _flags(FULL + "--step-batch-size-schedule 0:8,16"),
        "--step-batch-size-schedule '0:8,16': entry '16' is not THRESHOLD:BATCH_SIZE",
    ),
    Case(
        "step schedule start",
        _flags(FULL + "--step-batch-size-schedule 1K:8"),
        "--step-batch-size-schedule '1K:8': the first threshold must be 0, got '1K:8' (62 samples of 16 tokens)",
    ),
    Case(
        "step schedule and global batch",
        _flags(FULL + "--global-batch-size 16 --step-batch-size-schedule 0:8,48:32"),
        "--global-batch-size (16) differs from the last batch size of --step-batch-size-schedule '0:8,48:32' "
        "(32); leave --global-batch-size out, or make them equal",
    ),
]

FP8 = [
    Case(
        "an FP8 format that does not exist",
        _flags(FULL + "--bf16 --fp8-format e5m2"),
        "argument --fp8-format: invalid choice: 'e5m2' (choose from 'e4m3', 'hybrid') (see --help)",
        2,
    ),
    Case(
        "a recipe flag with no FP8 format",
        _flags(FULL + "--bf16 --fp8-recipe tensorwise --fp8-amax-history-len 16"),
        "--fp8-recipe, --fp8-amax-history-len need --fp8-format (e4m3 or hybrid)",
    ),
    Case(
        "mxfp8 off Blackwell",
        _flags(FULL + "--bf16 --fp8-format hybrid --fp8-recipe mxfp8"),
        "the 'mxfp8' recipe needs Blackwell GPUs (sm100) and is not built in Trident; use --fp8-recipe "
        "tensorwise, delayed or blockwise",
    ),
    Case(
        "FP8 parameters gathered without the distributed optimizer",
        _flags(FULL + "--bf16 --fp8-format hybrid --fp8-param-gather"),
        "--fp8-param-gather only supported with distributed optimizer",
    ),
    Case(
        "FP8 parameters gathered without FP8",
        _flags(FULL + "--bf16 --fp8-param-gather --use-distributed-optimizer"),
        "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)",
    ),
    Case(
        "more bf16 layers than a pipeline stage has",
        _flags(
            FULL + "--bf16 --fp8-format e4m3 --first-last-layers-bf16 --num-layers-at-end-in-bf16 2 "
            "--pipeline-model-parallel-size 2"
        ),
        "--num-layers-at-end-in-bf16 must be in [0, 1], the layers per pipeline stage (--num-layers 2 // "
        "--pipeline-model-parallel-size 2), got 2",
    ),
]

SHARDING_AND_GRAPHS = [  # FULL on 4 ranks: DP 4
    Case(
        "a sharding strategy that does not exist",
        _flags(FULL + "--use-megatron-fsdp --data-parallel-sharding-strategy zero3"),
        "argument --data-parallel-sharding-strategy: invalid choice: 'zero3' (choose from 'no_shard', 'optim', "
        "'optim_grads', 'optim_grads_params') (see --help)",
        2,
    ),
    Case(
        "an outer optim without an inner ZeRO-3",
        _flags(
            FULL + "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
            "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim"
        ),
        "--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params (as in "
        "Megatron-FSDP), got optim_grads",
    ),
    Case(
        "optimizer instances that do not divide DP",
        _flags(FULL + "--use-megatron-fsdp --num-distributed-optimizer-instances 3"),
        "--num-distributed-optimizer-instances 3 must divide the data-parallel size x context-parallel size "
        "(4 x 1 = 4)",
    ),
    Case(
        "Megatron-FSDP's second version",
        _flags(FULL + "--use-megatron-fsdp --megatron-fsdp-version 2"),
        "Trident does not support --megatron-fsdp-version 2: Trident's Megatron-FSDP is version 1, Megatron's "
        "default; use --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params (Trident's "
        "ZeRO-3 on its own buckets, which composes with tensor and pipeline parallelism)",
        2,
    ),
    Case(
        "a custom FP8 recipe",
        _flags(FULL + "--bf16 --fp8-format hybrid --fp8-recipe custom"),
        "the 'custom' recipe loads a Transformer Engine recipe factory, which Trident does not use; use "
        "--fp8-recipe tensorwise, delayed or blockwise",
    ),
    Case(
        "both spellings of CUDA graphs",
        _flags(FULL + "--enable-cuda-graph --cuda-graph-impl local"),
        "--enable-cuda-graph is Megatron's older spelling of --cuda-graph-impl local: give one of them, not both",
    ),
]

VALIDATION = [  # result validation (training/faults/validation.py)
    Case(
        "a rerun mode that does not exist",
        _flags(FULL + "--rerun-mode validate"),
        "argument --rerun-mode: invalid choice: 'validate' (choose from 'disabled', 'validate_results', "
        "'report_stats') (see --help)",
        2,
    ),
    Case(
        "an injection type that does not exist",
        _flags(FULL + "--error-injection-type bitflip"),
        "argument --error-injection-type: invalid choice: 'bitflip' (choose from 'correct_result', "
        "'transient_error', 'persistent_error') (see --help)",
        2,
    ),
    Case(
        "a negative injection rate",
        _flags(FULL + "--error-injection-rate -1"),
        "--error-injection-rate must be >= 0 (0: no injection), got -1",
    ),
    Case(
        "spiky-loss check without validation",
        _flags(FULL + "--rerun-mode disabled --check-for-spiky-loss"),
        "--check-for-spiky-loss acts only with --rerun-mode validate_results (here: disabled)",
    ),
    Case(
        "injection while reporting statistics",
        _flags(FULL + "--rerun-mode report_stats --error-injection-rate 5"),
        "--error-injection-rate 5 injects into validated results: it needs --rerun-mode validate_results "
        "(here: report_stats)",
    ),
    Case(
        "injection with no check on",
        _flags(FULL + "--error-injection-rate 5"),
        "--error-injection-rate 5 injects into a validated result, but no check is on: add "
        "--check-for-nan-in-loss-and-grad, --check-for-spiky-loss or --check-for-large-grads",
    ),
]

CASES = USAGE + CONFIG + DATA + SCHEDULER + DEVICE + MOE + RAMP + FP8 + SHARDING_AND_GRAPHS + VALIDATION


def test_there_are_at_least_forty_distinct_cases():
    assert len({c.name for c in CASES}) == len(CASES) >= 40
    assert len({c.message for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_printed_once_with_its_exit_code(case, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [PROG])
    expected = case.message.replace("{p}", str(tmp_path / "d")).replace("{t}", str(tmp_path))
    printed, codes = {}, {}
    for rank in range(4):  # what each of four ranks does with the same error
        monkeypatch.setenv("RANK", str(rank))
        err, out = io.StringIO(), io.StringIO()
        with redirect_stderr(err), redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            run_main(lambda: case.act(tmp_path, monkeypatch))
        printed[rank], codes[rank] = err.getvalue() + out.getvalue(), exit_.value.code
        shutil.rmtree(tmp_path / "d", ignore_errors=True)
    assert printed[0] == f"{PROG}: error: {expected}\n"
    assert printed[1] == printed[2] == printed[3] == ""
    assert codes == dict.fromkeys(range(4), case.code)


def test_an_unexpected_error_keeps_its_traceback_printed_once(monkeypatch):
    monkeypatch.setattr(sys, "argv", [PROG])

    def boom():
        raise KeyError("a bug, not bad input")

    printed = {}
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        err = io.StringIO()
        with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            run_main(boom)
        printed[rank] = err.getvalue()
        assert exit_.value.code == 1
    assert printed[0].startswith("Traceback (most recent call last):")
    assert printed[0].rstrip().endswith("KeyError: 'a bug, not bad input'")
    assert printed[1] == ""


# --------------------------------------------------------------------------------------------------
# Through torchrun
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny")


def _exit_codes(output: str) -> dict[int, int]:
    """Global rank -> exit code, from torchrun's failure summary."""
    found = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", output)
    return {int(rank): int(code) for rank, code in found}


def _check_once(output: str, line: str, code: int, nproc: int) -> None:
    """``line`` printed exactly once, no worker traceback, every rank ended (on its own or by torchrun)."""
    assert output.count(line) == 1, output[-4000:]
    assert [x for x in output.splitlines() if "error:" in x] == [line], output[-4000:]
    assert worker_tracebacks(output) == [] and "Connection closed by peer" not in output, output[-4000:]
    codes = _exit_codes(output)
    assert sorted(codes) == list(range(nproc)), output[-3000:]
    assert code in codes.values() and set(codes.values()) <= {code, -15}, codes  # -15: torchrun's SIGTERM


def test_a_usage_error_through_torchrun(data):
    """Before any process group: rank 0 prints, each rank exits 2."""
    code, output = run(2, TINY + ["--pipeline-model-parallel-size", "2", "--bogus", "3"], env=job_env())
    assert code == 1  # torchrun's own exit code for a failed worker
    _check_once(output, f"{PROG}: error: unrecognized arguments: --bogus 3 (see --help)", 2, 2)


def test_a_data_file_only_rank_0_reads_through_torchrun(data, tmp_path):
    """Rank 0 builds the datasets first and finds the .bin/.idx mismatch; the other rank, waiting for it,
    ends quietly instead of hanging or printing 'Connection closed by peer'."""
    bad = tmp_path / "wide"
    shutil.copy(f"{data}.idx", f"{bad}.idx")
    np.fromfile(f"{data}.bin", dtype=np.uint16).astype(np.int32).tofile(f"{bad}.bin")
    flags = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "3", "--data-path", str(bad)]
    code, output = run(2, flags, env=job_env())
    assert code == 1
    line = (
        f"{PROG}: error: data file {bad}.bin has {2 * BIN_BYTES} bytes but {bad}.idx describes {DOCS * LENGTH} "
        f"uint16 tokens ({BIN_BYTES} bytes): the .bin holds 4-byte token ids where the .idx says 2-byte "
        "uint16: the two files were not written together"
    )
    _check_once(output, line, 1, 2)


@pytest.mark.slow
def test_a_validation_error_on_four_ranks_through_torchrun(data):
    flags = TINY + ["--train-iters", "2", "--pipeline-model-parallel-size", "4", "--split", "1,2,x"]
    code, output = run(4, flags, env=job_env())
    assert code == 1
    _check_once(output, f"{PROG}: error: --split '1,2,x': 'x' is not a number; {SPLIT_HINT}", 1, 4)


@pytest.mark.slow
def test_ids_beyond_the_vocabulary_stop_training_with_one_line(data):
    """Found while training, by the two stages that read data: still one line, every rank ends."""
    flags = TINY + ["--pipeline-model-parallel-size", "4", "--train-iters", "3", "--data-path", str(data)]
    flags[flags.index("--vocab-size") + 1] = "100"  # the data holds ids up to 599
    code, output = run(4, flags, env=job_env())
    assert code == 1
    lines = [x for x in output.splitlines() if "error:" in x]
    assert len(lines) == 1 and re.fullmatch(
        rf"{PROG}: error: token id \d+ in {data}\.bin \(sequence \d+, train sample \d+\) is outside the "
        r"tokenizer's 101 ids: the data was preprocessed with another tokenizer; rerun "
        r"tools/preprocess_data.py with this run's --tokenizer-model \(or --vocab-size\)",
        lines[0],
    ), output[-3000:]
    _check_once(output, lines[0], 1, 4)


@pytest.mark.slow
def test_resuming_with_new_scheduler_flags_needs_an_override(data, tmp_path):
    """Megatron's rule, through torchrun: an error naming the flags, then either override works."""
    ckpt = tmp_path / "ck"
    base = TINY + [
        "--pipeline-model-parallel-size",
        "2",
        "--data-path",
        str(data),
        "--lr-decay-style",
        "linear",
    ]
    code, output = run(2, base + ["--train-iters", "4", "--save", str(ckpt)], env=job_env())
    assert code == 0, output[-3000:]
    more = base + ["--train-iters", "8", "--lr", "0.01", "--load", str(ckpt), "--save", str(tmp_path / "ck2")]
    code, output = run(2, more, env=job_env())
    line = (
        f"{PROG}: error: --load {ckpt}: the learning-rate schedule differs from the checkpoint's: --lr 0.01 here, "
        "0.001 in the checkpoint; decay iterations (--lr-decay-iters, else --train-iters) 8 here, 4 in the "
        "checkpoint. Pass --override-opt_param-scheduler to follow the flags, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule"
    )
    assert code == 1
    _check_once(output, line, 1, 2)
    rates = {}
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        code, output = run(2, [*more, flag], env=job_env())
        assert code == 0, output[-3000:]
        rates[flag] = [float(r) for r in re.findall(r"learning rate: ([0-9.E+-]+)", output)]
    # iterations 5..8 of a linear decay from 0.01 over 8 iterations; the checkpoint's ended at 4: lr 0
    assert rates["--override-opt_param-scheduler"] == pytest.approx([0.00375, 0.0025, 0.00125, 0.0])
    assert rates["--use-checkpoint-opt_param-scheduler"] == [0.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------------------
# Wrong tensor sizes between pipeline stages (fixed shapes): refused by the sender, before gloo sees it
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent, dtype, expected",
    [
        ((16, 2, 64), "float32", "shape (16, 2, 64) and dtype float32"),  # shorter than the schedule's
        ((64, 2, 64), "float32", "shape (64, 2, 64) and dtype float32"),  # longer
        ((32, 2, 64), "bfloat16", "shape (32, 2, 64) and dtype bfloat16"),  # another dtype
    ],
)
def test_a_stage_sending_another_shape_than_the_schedule_expects_is_named(sent, dtype, expected):
    import torch

    from core.pipeline_parallel.actions import Action, ActionKind
    from core.pipeline_parallel.hooks import ScheduleSettings
    from core.pipeline_parallel.mailbox import Mailbox, PipelineShapeError
    from core.pipeline_parallel.schedule_rules import placement_for

    settings = ScheduleSettings(hidden_size=64, pipeline_dtype=torch.float32)
    mailbox = Mailbox(
        pp_rank=0,
        placement=placement_for("1f1b", 2),
        links=None,  # the check comes before anything is posted
        shape=settings.tensor_shape(32, 2),
        dtype=torch.float32,
        variable_shapes=False,
        record=None,
        shape_origin=settings.describe_tensor_shape(32, 2),
    )
    mailbox.output_of(Action(ActionKind.F, 3), torch.zeros(sent, dtype=getattr(torch, dtype)))
    message = (
        f"pipeline stage 0 sends the activation of microbatch 3 to stage 1 with {expected}, but the "
        "schedule expects shape (32, 2, 64) and dtype float32 ([seq_length 32, micro_batch_size 2, "
        "hidden_size 64]): give the seq_length and micro_batch_size the model really uses (or "
        "variable_seq_lengths=True)"
    )
    with pytest.raises(PipelineShapeError, match=f"^{re.escape(message)}$"):
        mailbox.send(Action(ActionKind.SEND_F, 3))

"""Data pipeline: corpus, tokenizer, Megatron .bin/.idx format, GPT samples, blending, DP sampling.

Everything is real: a SentencePiece model trained here, files written by the real preprocess
tool, memory-mapped reads. The corpus is a few hundred short generated documents.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.corpus import make_docs, prepared_corpus, preprocess, write_jsonl
from training.data import (
    IndexedDataset,
    IndexedDatasetBuilder,
    MegatronPretrainingSampler,
    build_default_corpus,
    dp_microbatch_indices,
    optimal_dtype,
)
from training.data.blended_dataset import build_blending_indices
from training.data.builder import build_train_valid_test_datasets, parse_data_path, split_document_indices
from training.data.gpt_dataset import build_document_index, build_sample_index
from training.tokenizer import GPTSentencePieceTokenizer, NullTokenizer, build_tokenizer


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny corpus, a tiny tokenizer trained by the real tool, and the corpus preprocessed."""
    return prepared_corpus(tmp_path_factory.mktemp("data"))


# --- 1. byte format ------------------------------------------------------------------------


def spec_files(token_lists: list[list[int]], dtype_code: int, np_dtype: str) -> tuple[bytes, bytes]:
    """.bin/.idx written from the format's description alone (one sequence per non-empty doc)."""
    itemsize = np.dtype(np_dtype).itemsize
    lengths = [len(t) for t in token_lists if t]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * itemsize
    doc_idx, count = [0], 0
    for t in token_lists:
        count += 1 if t else 0
        doc_idx.append(count)
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    tokens = [x for t in token_lists for x in t]
    return np.array(tokens, dtype=np.dtype(np_dtype).newbyteorder("<")).tobytes(), idx


def test_preprocessed_files_match_the_megatron_format_byte_for_byte(env):
    tok = GPTSentencePieceTokenizer(env["model"])
    expected = [tok.tokenize(d) + [tok.eod] if d else [] for d in env["docs"]]
    exp_bin, exp_idx = spec_files(expected, dtype_code=8, np_dtype="uint16")  # vocab 400 -> uint16
    assert Path(env["prefix"] + ".bin").read_bytes() == exp_bin
    assert Path(env["prefix"] + ".idx").read_bytes() == exp_idx
    ds = IndexedDataset(env["prefix"])
    assert ds.dtype is np.uint16 and ds.num_documents == len(env["docs"])
    assert [ds[i].tolist() for i in range(len(ds))] == [t for t in expected if t]
    assert ds.get(3, offset=2, length=3).tolist() == expected[3][2:5]


def test_builder_uses_int32_for_large_vocabularies(tmp_path):
    assert (
        optimal_dtype(65499) is np.uint16
        and optimal_dtype(65500) is np.int32
        and optimal_dtype(None) is np.int32
    )
    docs = [[70000, 1, 2], [], [5], [65535, 0]]
    builder = IndexedDatasetBuilder(tmp_path / "big.bin", dtype=optimal_dtype(80000))
    for d in docs:
        builder.add_document(d, [len(d)] if d else [])
    builder.finalize(tmp_path / "big.idx")
    exp_bin, exp_idx = spec_files(docs, dtype_code=4, np_dtype="int32")
    assert (tmp_path / "big.bin").read_bytes() == exp_bin and (tmp_path / "big.idx").read_bytes() == exp_idx
    assert [IndexedDataset(tmp_path / "big")[i].tolist() for i in range(3)] == [d for d in docs if d]
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx"]  # no temporary files left


# --- 2. tokenizers -------------------------------------------------------------------------


def test_gpt_sentencepiece_semantics_and_round_trip(env):
    tok = build_tokenizer("GPTSentencePieceTokenizer", env["model"])
    assert (tok.vocab_size, tok.eod, tok.eos, tok.bos, tok.pad) == (400, 2, 2, 1, 3)
    for text in [
        "Hello world.",
        "  two  spaces\n\nand lines\tand tabs ",
        "x = f(a, b) ** 2  # ~^`|{}",
        "Zq9 0.125!",
    ]:
        ids = tok.tokenize(text)
        assert tok.bos not in ids and tok.eos not in ids and 0 not in ids  # no bos/eos added, no <unk>
        assert tok.detokenize(ids) == text


def test_sentencepiece_tokenizer_adds_megatron_special_tokens(env):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", env["model"])
    tok = build_tokenizer("SentencePieceTokenizer", env["model"], vocab_extra_ids=2)
    assert (tok.cls, tok.sep, tok.eod, tok.mask) == (400, 401, 402, 403)
    assert (tok.pad, tok.bos, tok.eos) == (3, 1, 2)  # already pieces of the model: not added again
    assert tok.additional_special_tokens_ids == [404, 405] and tok.vocab_size == 406
    ids = tok.tokenize("one two<EOD>three</s>")
    assert ids == gpt.tokenize("one two") + [402] + gpt.tokenize("three") + [2]
    assert tok.detokenize(ids) == "one two <EOD> three </s> "
    assert tok.tokenize("plain text") == gpt.tokenize("plain text")


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.tokenize("5 7 99") == [5, 7, 99] and (tok.eod, tok.vocab_size) == (100, 101)


# --- 4. GPT dataset ------------------------------------------------------------------------


def reference_sample_index(sizes, document_index, seq_length, num_samples):
    """Megatron's sample-index walk, written plainly: consume seq_length + 1 tokens per sample."""
    out = [(0, 0)]
    doc, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while True:
            available = int(sizes[document_index[doc]]) - offset
            if available >= remaining:
                offset += remaining - 1  # the last token is also the next sample's first
                break
            remaining -= available
            doc, offset = doc + 1, 0
        out.append((doc, offset))
    return np.array(out)


def test_sample_index_matches_megatrons_walk_with_empty_sequences_and_epochs():
    rng = np.random.RandomState(0)
    sizes = rng.randint(0, 9, size=40).astype(np.int32)
    sizes[0] = 0
    docs = np.arange(40, dtype=np.int32)
    for epochs in (1, 3):
        doc_index = build_document_index(docs, epochs, np.random.RandomState(epochs), epochs == 3)
        first = int(np.flatnonzero(doc_index == 0)[0])
        doc_index[[0, first]] = doc_index[[first, 0]]  # empty first document: first sample still at (0, 0)
        tokens = int(sizes.sum())
        got = build_sample_index(sizes, doc_index, 5, epochs, tokens)
        want = reference_sample_index(sizes, doc_index, 5, (epochs * tokens - 1) // 5)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32


def datasets(env, tmp_path, seed=1234, seq_length=16, num_samples=(1500, 20, 5), split="90,8,2", **kw):
    kw.setdefault("eod_token", 2)
    return build_train_valid_test_datasets(
        [env["prefix"]], split, seq_length, seed, num_samples, cache_dir=tmp_path / "cache", **kw
    )


def test_samples_are_windows_of_the_shuffled_document_stream(env, tmp_path):
    train = datasets(env, tmp_path)[0]
    indexed = IndexedDataset(env["prefix"])
    n_docs = len(train.indices)
    epochs = len(train.document_index) // n_docs
    assert epochs > 1 and len(train) >= 1500  # 1500 samples need several passes over this tiny corpus
    counts = np.bincount(np.asarray(train.document_index) - train.indices[0], minlength=n_docs)
    assert (counts == epochs).all()  # every document once per epoch
    expected = reference_sample_index(indexed.sequence_lengths, train.document_index, 16, len(train))
    np.testing.assert_array_equal(train.sample_index, expected)

    stream = np.concatenate([indexed[int(d)] for d in train.document_index])
    order = np.asarray(train.shuffle_index)
    assert sorted(order.tolist()) == list(range(len(train)))
    for i in range(0, len(train), 7):
        k = int(order[i])
        item = train[i]
        window = stream[k * 16 : k * 16 + 17]
        assert len(window) == 17
        assert (
            item["tokens"].tolist() == window[:-1].tolist() and item["labels"].tolist() == window[1:].tolist()
        )
        assert item["tokens"].dtype == torch.int64 and item["position_ids"].tolist() == list(range(16))


def test_same_seed_same_samples_other_seed_other_order(env, tmp_path):
    a, b = datasets(env, tmp_path / "a")[0], datasets(env, tmp_path / "b")[0]
    c = datasets(env, tmp_path / "c", seed=99)[0]
    first = [a[i]["tokens"].tolist() for i in range(50)]
    assert first == [b[i]["tokens"].tolist() for i in range(50)]
    assert first != [c[i]["tokens"].tolist() for i in range(50)]


def test_index_caches_are_reused(env, tmp_path):
    first = datasets(env, tmp_path)
    assert all(d.built_anew_on_cache_miss for d in first)
    stamps = {p: p.stat().st_mtime_ns for d in first for p in d.cache_files}
    second = datasets(env, tmp_path)
    assert not any(d.built_anew_on_cache_miss for d in second)
    assert {p: p.stat().st_mtime_ns for d in second for p in d.cache_files} == stamps
    np.testing.assert_array_equal(first[0].shuffle_index, second[0].shuffle_index)
    assert datasets(env, tmp_path, seq_length=8)[0].built_anew_on_cache_miss  # other parameters: rebuilt
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith(".tmp")]


def test_split_ranges_are_disjoint_megatron_rounding(env, tmp_path):
    n = len(IndexedDataset(env["prefix"]))
    ranges = split_document_indices(n, "90,8,2")
    assert [(int(r[0]), int(r[-1]) + 1) for r in ranges] == [
        (0, round(0.9 * n)),
        (round(0.9 * n), round(0.98 * n)),
        (round(0.98 * n), n),
    ]
    train, valid, test = datasets(env, tmp_path)
    seen = [set(np.asarray(d.document_index).tolist()) for d in (train, valid, test)]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert set().union(*seen) == set(range(n))
    assert split_document_indices(n, "100,0,0")[1:] == [None, None]


def test_blend_takes_samples_in_proportion_to_weights(env, tmp_path):
    other = preprocess(
        write_jsonl(tmp_path / "b.jsonl", make_docs(120, seed=1)),
        tmp_path / "b",
        env["model"],
        "--append-eod",
    )
    assert parse_data_path(["0.3", env["prefix"], "0.7", other]) == ([env["prefix"], other], [0.3, 0.7])
    train, valid, _ = build_train_valid_test_datasets(
        ["0.3", env["prefix"], "0.7", other], "90,8,2", 16, 1234, (100, 20, 5), 2, False, tmp_path / "cache"
    )
    assert len(train) == 100 and np.bincount(train.dataset_index).tolist() == [30, 70]
    assert len(valid) == 20 and np.bincount(valid.dataset_index).tolist() == [6, 14]
    taken = np.zeros(2)
    for m, d in enumerate(np.asarray(train.dataset_index), start=1):
        taken[d] += 1
        assert np.all(np.abs(taken - np.array([0.3, 0.7]) * m) <= 1.0)
    for i in (0, 1, 2, 57, 99):
        d, s = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        assert train[i]["tokens"].tolist() == train.datasets[d][s]["tokens"].tolist()
    assert build_blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]
    assert build_blending_indices([0.3, 0.7], 4)[0].tolist() == [1, 0, 1, 1]
    again = build_train_valid_test_datasets(
        ["0.3", env["prefix"], "0.7", other], "90,8,2", 16, 1234, (100, 20, 5), 2, False, tmp_path / "cache"
    )
    assert not again[0].built_anew_on_cache_miss


def test_eod_mask_loss_masks_input_eod_positions(env, tmp_path):
    masked = datasets(env, tmp_path, eod_mask_loss=True)[0]
    unmasked = datasets(env, tmp_path, eod_mask_loss=False)[0]
    hits = 0
    for i in range(len(masked)):
        item = masked[i]
        assert item["loss_mask"].dtype == torch.float32
        assert torch.equal(item["loss_mask"], (item["tokens"] != 2).float())
        assert torch.equal(unmasked[i]["loss_mask"], torch.ones(16))
        hits += int((item["tokens"] == 2).sum())
    assert hits > 0


# --- 5. data-parallel sampling -------------------------------------------------------------


def test_dp_ranks_split_each_global_batch_and_resume():
    mbs, dp = 2, 4
    batches = [dp_microbatch_indices(24, mbs, r, dp) for r in range(dp)]
    assert sorted(itertools.chain(*batches)) == list(range(24, 32)) and batches[1] == [26, 27]
    full = list(MegatronPretrainingSampler(100, 0, mbs, 1, dp))
    resumed = list(MegatronPretrainingSampler(100, 40, mbs, 1, dp))
    assert len(full) == 12 and full[5:] == resumed
    with pytest.raises(ValueError, match="dp_rank"):
        dp_microbatch_indices(0, 2, 4, 4)


# --- default corpus ------------------------------------------------------------------------


def test_default_corpus_reads_docstrings_statically_and_caches(tmp_path, capsys):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "test").mkdir()
    (lib / "pydoc_data").mkdir()
    (lib / "pkg" / "__init__.py").write_text('"""Package doc."""\nraise SystemExit("never imported")\n')
    (lib / "alpha.py").write_text(
        '"""Alpha module."""\nclass A(object):\n    """Class doc."""\n    def m(self, x=1):\n        """Method doc."""\n'
    )
    (lib / "broken.py").write_text("def (:\n")
    (lib / "test" / "test_alpha.py").write_text('"""Test doc: skipped."""\n')
    (lib / "pydoc_data" / "topics.py").write_text("topics = {'b': 'Topic B.', 'a': 'Topic A.'}\n")
    path = build_default_corpus(tmp_path / "cache", stdlib_dir=lib)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert texts == [
        "Module alpha\n\nAlpha module.\n\nclass A(object):\nClass doc.\n\ndef A.m(self, x=1):\nMethod doc.",
        "Module pkg\n\nPackage doc.",
        "Topic A.",
        "Topic B.",
    ]
    assert "4 documents" in capsys.readouterr().out
    stamp = path.stat().st_mtime_ns
    assert (
        build_default_corpus(tmp_path / "cache", stdlib_dir=lib) == path and path.stat().st_mtime_ns == stamp
    )
    assert "cached" in capsys.readouterr().out


@pytest.mark.slow
def test_default_corpus_and_tokenizer_from_this_python(tmp_path):
    from training.data import default_tokenizer

    model = default_tokenizer(tmp_path)
    tok = GPTSentencePieceTokenizer(model)
    corpus = next(tmp_path.glob("stdlib-docs-*.jsonl"))
    first = json.loads(corpus.read_text(encoding="utf-8").splitlines()[0])["text"]
    assert tok.vocab_size == 4096 and tok.detokenize(tok.tokenize(first)) == first
    assert default_tokenizer(tmp_path) == model

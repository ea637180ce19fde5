"""Megatron's tokenizers, mock data, per-split data, the data-loader stream and its samplers.

The GPT-2 BPE files and the Hugging Face tokenizer folder are built here with the ``tokenizers``
library (a tiny byte-level BPE trained on generated text); nothing is downloaded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.support.bpe import TRICKY_TEXTS, train_byte_level_bpe
from tests.support.corpus import make_docs, write_jsonl
from tools import preprocess_data
from training.data.builder import build_per_split_datasets, build_train_valid_test_datasets
from training.data.indexed_dataset import IndexedDataset
from training.data.mock_dataset import MockIndexedDataset
from training.data.samplers import (
    EndlessSequentialSampler,
    MegatronPretrainingRandomSampler,
    dp_microbatch_indices,
)
from training.errors import DataError
from training.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer, Llama2Tokenizer, build_tokenizer

TEXTS = [*TRICKY_TEXTS, "numbers 1234567 and symbols #$%&*()"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """vocab.json/merges.txt of a byte-level BPE trained here, and the same tokenizer as an HF folder."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("bpe")
    docs = make_docs(200, seed=3) + TEXTS
    trainer = train_byte_level_bpe(docs, 500, save_to=root)
    hf = PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, eos_token="<|endoftext|>")
    hf.save_pretrained(str(root / "hf"))
    return {"root": root, "vocab": str(root / "vocab.json"), "merges": str(root / "merges.txt"), "docs": docs}


def test_gpt2_bpe_gives_the_ids_of_gpt2s_reference_implementation(bpe):
    """transformers' slow GPT2Tokenizer is a port of OpenAI's encoder.py, which Megatron's GPT2BPETokenizer is."""
    from transformers import GPT2Tokenizer

    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe["vocab"], merge_file=bpe["merges"])
    reference = GPT2Tokenizer(bpe["vocab"], bpe["merges"])
    assert isinstance(ours, GPT2BPETokenizer)
    for text in TEXTS + bpe["docs"][:50]:
        ids = ours.tokenize(text)
        assert ids == reference.encode(text), text
        assert ours.detokenize(ids) == text
    assert ours.vocab_size == len(json.loads((bpe["root"] / "vocab.json").read_text()))
    assert ours.eod == ours.vocab["<|endoftext|>"] == 0


def test_hugging_face_tokenizer_reads_a_local_folder_only(bpe, tmp_path):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(bpe["root"] / "hf"))
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    gpt2 = GPT2BPETokenizer(bpe["vocab"], bpe["merges"])
    assert [tokenizer.tokenize(t) for t in TEXTS] == [gpt2.tokenize(t) for t in TEXTS]
    assert (tokenizer.vocab_size, tokenizer.eod) == (gpt2.vocab_size, gpt2.eod)
    with pytest.raises(
        DataError, match="^--tokenizer-model gpt2: no such Hugging Face .* never downloads one$"
    ):
        build_tokenizer("HuggingFaceTokenizer", "gpt2")  # a hub name, not a folder


def test_llama2_tokenizer_puts_bos_first(tmp_path):
    from tools import train_tokenizer

    jsonl = write_jsonl(tmp_path / "c.jsonl", make_docs(100, seed=1))
    model = str(
        train_tokenizer.main(["--input", jsonl, "--model-prefix", str(tmp_path / "m"), "--vocab-size", "400"])
    )
    llama = build_tokenizer("Llama2Tokenizer", model)
    plain = build_tokenizer("GPTSentencePieceTokenizer", model)
    assert isinstance(llama, Llama2Tokenizer)
    assert llama.tokenize("the pipeline stage") == [llama.bos, *plain.tokenize("the pipeline stage")]
    assert (llama.eod, llama.vocab_size) == (plain.eos, plain.vocab_size)


def test_preprocess_takes_the_gpt2_files_and_infers_the_tokenizer(bpe, tmp_path):
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", bpe["docs"][:40])
    argv = ["--input", jsonl, "--output-prefix", str(tmp_path / "out"), "--append-eod", "--quiet"]
    prefix = preprocess_data.main([*argv, "--vocab-file", bpe["vocab"], "--merge-file", bpe["merges"]])[0]
    gpt2 = GPT2BPETokenizer(bpe["vocab"], bpe["merges"])
    data = IndexedDataset(prefix)
    expected = [gpt2.tokenize(d) + [gpt2.eod] for d in bpe["docs"][:40] if d]
    assert [data[i].tolist() for i in range(len(data))] == expected
    unmapped = IndexedDataset(prefix, mmap=False)  # --no-mmap-bin-files reads the same tokens
    assert all(np.array_equal(unmapped.get(i, 1, 3), data.get(i, 1, 3)) for i in range(len(data)))


def test_mock_documents_are_megatrons():
    mock = MockIndexedDataset(vocab_size=1000, eod=999)
    lengths = np.random.default_rng(0).integers(1, 4096, size=100_000, dtype=np.int32)
    np.testing.assert_array_equal(mock.sequence_lengths, lengths)
    for i in (0, 1, 77):
        n = int(lengths[i])
        expected = np.concatenate([(np.arange(n - 1) + 1) % 1000, [999]])
        np.testing.assert_array_equal(mock[i], expected)
        np.testing.assert_array_equal(mock.get(i, 5, 20), expected[5:25])


def test_mock_and_per_split_datasets_split_like_files(tmp_path, bpe):
    mock = lambda _: MockIndexedDataset(1000, 999)
    train, valid, test = build_train_valid_test_datasets(
        ["mock"], "98,2,0", 64, 5, (100, 10, 0), open_dataset=mock
    )
    assert test is None and len(train) >= 100 and len(valid) >= 10
    assert train.indices[-1] + 1 == valid.indices[0] == 98_000  # the documents split 98:2
    assert not list(tmp_path.iterdir())  # mock indices live in memory only
    jsonl = write_jsonl(tmp_path / "c.jsonl", bpe["docs"])
    prefix = preprocess_data.main(
        ["--input", jsonl, "--output-prefix", str(tmp_path / "d"), "--append-eod", "--quiet"]
        + ["--vocab-file", bpe["vocab"], "--merge-file", bpe["merges"]]
    )[0]
    train, valid, test = build_per_split_datasets([prefix, None, [prefix]], 16, 5, (50, 0, 5))
    assert valid is None and len(train.indices) == len(test.indices) == len(IndexedDataset(prefix))


def test_cyclic_sampler_is_megatrons_random_order_and_resumes_exactly():
    total, mbs, dp = 103, 2, 4
    per_rank = [EndlessSequentialSampler, MegatronPretrainingRandomSampler]
    for sampler in per_rank:
        full = [sampler(total, 0, mbs, r, dp).__iter__() for r in range(dp)]
        reads = [[next(it) for _ in range(40)] for it in full]  # 40 microbatches: past one epoch
        resumed = [sampler(total, 8 * mbs * dp, mbs, r, dp).__iter__() for r in range(dp)]
        assert [[next(it) for _ in range(32)] for it in resumed] == [r[8:] for r in reads], sampler
    bucket = (total // (mbs * dp)) * mbs  # 24 samples per rank, 96 per epoch
    first_epoch = [
        i
        for r in range(dp)
        for batch in reads_of(MegatronPretrainingRandomSampler, total, mbs, r, dp, 12)
        for i in batch
    ]
    order = torch.randperm(bucket, generator=torch.Generator().manual_seed(0)).tolist()
    assert first_epoch[:bucket] == order and sorted(first_epoch) == list(range(96))
    assert [next(iter(EndlessSequentialSampler(total, 0, mbs, 1, dp)))] == [
        dp_microbatch_indices(0, mbs, 1, dp)
    ]


def reads_of(sampler, total, mbs, rank, dp, count):
    it = iter(sampler(total, 0, mbs, rank, dp))
    return [next(it) for _ in range(count)]

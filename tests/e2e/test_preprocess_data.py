"""``tools/preprocess_data.py`` with worker processes: the same bytes as one worker, and the end of
document appended exactly when asked (the data pipeline in one process: tests/unit/test_data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.corpus import prepared_corpus, preprocess
from training.data import IndexedDataset
from training.tokenizer import GPTSentencePieceTokenizer


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny corpus, a tiny tokenizer trained by the real tool, and the corpus preprocessed."""
    return prepared_corpus(tmp_path_factory.mktemp("data"))


def test_workers_do_not_change_the_output_and_eod_is_appended(env):
    root = env["root"]
    two = preprocess(
        env["jsonl"], root / "w2", env["model"], "--append-eod", "--workers", "2", "--chunk-size", "7"
    )
    for suffix in (".bin", ".idx"):
        assert Path(two + suffix).read_bytes() == Path(env["prefix"] + suffix).read_bytes()

    tok = GPTSentencePieceTokenizer(env["model"])
    with_eod, plain = (
        IndexedDataset(env["prefix"]),
        IndexedDataset(preprocess(env["jsonl"], root / "noeod", env["model"])),
    )
    assert len(with_eod) == len(plain) == len(env["docs"]) - 1
    for i in range(len(plain)):
        assert with_eod[i].tolist() == plain[i].tolist() + [tok.eod]
        assert tok.eod not in plain[i].tolist()

    sp_prefix = preprocess(
        env["jsonl"], root / "sp", env["model"], "--tokenizer-type", "SentencePieceTokenizer", "--append-eod"
    )
    assert {int(IndexedDataset(sp_prefix)[i][-1]) for i in range(len(plain))} == {402}

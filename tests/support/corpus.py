"""A tiny generated corpus for the data tests: documents of pipeline words, written as JSONL and
preprocessed by the real ``tools/preprocess_data.py`` (in this process) into Megatron's .bin/.idx."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools import preprocess_data, train_tokenizer

WORDS = [
    "the", "a", "pipeline", "stage", "tensor", "model", "parallel", "data", "gradient", "loss", "token",
    "layer", "attention", "batch", "micro", "rank", "group", "schedule", "forward", "backward", "weight",
    "optimizer", "embedding", "sequence", "value", "of", "to", "and", "is", "in", "for", "with", "each",
]  # fmt: skip


def make_docs(n: int, seed: int) -> list[str]:
    """``n`` short documents (one empty) from ``seed``: sentences, numbers and punctuation."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."
            for _ in range(rng.randint(1, 4))
        ]
        docs.append(
            ("\n" if i % 7 == 0 else " ").join(sentences) + (f" Step {i}, loss 0.{i % 97}!" if i % 3 else "")
        )
    docs[5] = ""  # an empty document: it owns no sequence in the index
    return docs


def write_jsonl(path, docs: list[str]) -> str:
    """``docs`` as a JSONL file at ``path`` (``text`` and ``id``); its path."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "id": len(d)}) + "\n" for d in docs)
    return str(path)


def preprocess(jsonl: str, prefix, model: str, *extra: str) -> str:
    """``tools/preprocess_data.py`` of ``jsonl`` with the SentencePiece ``model`` (``extra``: more flags); the prefix."""
    args = ["--input", jsonl, "--output-prefix", str(prefix), "--tokenizer-model", model, "--quiet"]
    if "--tokenizer-type" not in extra:
        args += ["--tokenizer-type", "GPTSentencePieceTokenizer"]
    return preprocess_data.main(args + list(extra))[0]


def prepared_corpus(root: Path) -> dict:
    """A tiny corpus, a tiny tokenizer trained by the real tool, and the corpus preprocessed, under ``root``."""
    docs = make_docs(300, seed=0)
    jsonl = write_jsonl(root / "corpus.jsonl", docs)
    model = str(
        train_tokenizer.main(["--input", jsonl, "--model-prefix", str(root / "spm"), "--vocab-size", "400"])
    )
    prefix = preprocess(jsonl, root / "corpus", model, "--append-eod", "--workers", "1")
    return {"root": root, "docs": docs, "jsonl": jsonl, "model": model, "prefix": prefix}

"""Training SentencePiece models, and the default tokenizer of the out-of-the-box run.

The trained models are byte-level-safe BPE models (``byte_fallback``: any byte that is not a
piece is encoded as one of the 256 ``<0xNN>`` pieces, so nothing maps to ``<unk>``) with fixed
special ids: unk=0 ``<unk>``, bos=1 ``<s>``, eos=2 ``</s>`` (Megatron's ``eod`` for
``GPTSentencePieceTokenizer``), pad=3 ``<pad>``. Text is not normalised (``identity`` rule, no
whitespace folding), so decoding a tokenisation gives the original text back.

Training is deterministic: SentencePiece's sampling of ``input_sentence_size`` sentences is
seeded, and the model is written atomically.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from training.data.corpus import atomic_write_bytes, build_default_corpus, default_cache_dir
from training.reporting.logging_utils import print_line

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_INPUT_SENTENCE_SIZE = 200_000
DEFAULT_SEED = 1234


def iter_jsonl_texts(path: str | os.PathLike, json_key: str = "text") -> Iterator[str]:
    """The ``json_key`` field of each line of a JSON-lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if json_key not in record:
                    raise KeyError(f"{path}:{line_no}: no key {json_key!r} (choose one with --json-key)")
                yield record[json_key]


def iter_input_texts(path: str | os.PathLike, json_key: str = "text") -> Iterator[str]:
    """Documents of ``path``: JSON lines if it ends in ``.json``/``.jsonl``, else the whole plain text."""
    if str(path).endswith((".jsonl", ".json")):
        yield from iter_jsonl_texts(path, json_key)
    else:
        yield Path(path).read_text(encoding="utf-8")


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    """SentencePiece trains on lines; a document's newlines are not part of any piece."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(
    texts: Iterable[str],
    model_path: str | os.PathLike,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
    seed: int = DEFAULT_SEED,
    num_threads: int = 2,
    character_coverage: float = 0.9995,
) -> Path:
    """Train a BPE SentencePiece model on ``texts`` and write it (atomically) to ``model_path``.

    ``input_sentence_size`` bounds the training time: at most that many lines, sampled with
    ``seed``, are used.
    """
    import sentencepiece as spm

    required = 256 + 4  # byte pieces + special pieces
    if vocab_size <= required:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: byte_fallback alone needs > {required} ids"
        )
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_sentences(texts),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        pad_piece="<pad>",
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        num_threads=num_threads,
        minloglevel=2,
    )
    path = Path(model_path)
    atomic_write_bytes(path, model.getvalue())
    return path


def default_tokenizer(cache_dir: str | os.PathLike | None = None, *, verbose: bool = True) -> Path:
    """Path of the default SentencePiece model, trained on the default corpus on first use.

    The model is cached next to the corpus it was trained on (``$TRIDENT_CACHE`` or
    ``~/.cache/trident``) and is specific to the Python version that produced the corpus.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = build_default_corpus(cache, verbose=verbose)
    path = cache / f"{corpus.stem}-spm-bpe{DEFAULT_VOCAB_SIZE}.model"
    if path.is_file():
        if verbose:
            print_line(f"default tokenizer: {path} (cached)")
        return path
    start = time.perf_counter()
    train_sentencepiece(iter_jsonl_texts(corpus), path)
    if verbose:
        print_line(
            f"default tokenizer: trained {path} (BPE, vocab {DEFAULT_VOCAB_SIZE}, "
            f"{time.perf_counter() - start:.1f} s)"
        )
    return path

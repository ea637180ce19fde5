"""Train a SentencePiece BPE tokenizer for Trident (and Megatron-LM).

With no ``--input`` it trains the default tokenizer on the default corpus (the Python standard
library's documentation, see ``training/data/corpus.py``) and caches it under ``$TRIDENT_CACHE``
(or ``~/.cache/trident``); the training loop gets the same file from ``default_tokenizer()``::

    python tools/train_tokenizer.py
    python tools/train_tokenizer.py --input docs.jsonl --json-key text --vocab-size 8192 --model-prefix my_spm

Special ids: unk=0 ``<unk>``, bos=1 ``<s>``, eos=2 ``</s>`` (the ``eod`` of
``GPTSentencePieceTokenizer``), pad=3 ``<pad>``; ``byte_fallback`` keeps any byte off ``<unk>``.
Use the model with ``--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model my_spm.model``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.data.tokenizer_training import (
    DEFAULT_INPUT_SENTENCE_SIZE,
    DEFAULT_SEED,
    DEFAULT_VOCAB_SIZE,
    default_tokenizer,
    iter_input_texts,
    train_sentencepiece,
)

__all__ = ["default_tokenizer", "main"]


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", help="JSON-lines (.jsonl/.json) or plain-text file; default: the default corpus"
    )
    p.add_argument("--json-key", default="text", help="key of the text in each JSON line")
    p.add_argument("--model-prefix", help="write MODEL_PREFIX.model (required with --input)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument(
        "--input-sentence-size",
        type=int,
        default=DEFAULT_INPUT_SENTENCE_SIZE,
        help="train on at most this many lines, sampled with --seed (bounds the training time)",
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--cache-dir", help="cache of the default corpus/tokenizer (default $TRIDENT_CACHE)")
    args = p.parse_args(argv)
    if args.input is not None and args.model_prefix is None:
        p.error("--input needs --model-prefix")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Train (or fetch the cached default) tokenizer; return the ``.model`` path."""
    args = get_args(argv)
    if args.input is None and args.model_prefix is None:
        settings = (args.vocab_size, args.input_sentence_size, args.seed)
        if settings != (DEFAULT_VOCAB_SIZE, DEFAULT_INPUT_SENTENCE_SIZE, DEFAULT_SEED):
            raise SystemExit(
                "the cached default tokenizer has fixed settings; pass --model-prefix to change them"
            )
        return default_tokenizer(args.cache_dir)
    texts = (
        iter_input_texts(args.input, args.json_key)
        if args.input is not None
        else iter_input_texts(default_corpus_path(args.cache_dir))
    )
    start = time.perf_counter()
    path = train_sentencepiece(
        texts,
        f"{args.model_prefix}.model",
        vocab_size=args.vocab_size,
        input_sentence_size=args.input_sentence_size,
        seed=args.seed,
        num_threads=args.num_threads,
    )
    print(f"trained {path} (BPE, vocab {args.vocab_size}) in {time.perf_counter() - start:.1f} s")
    return path


def default_corpus_path(cache_dir: str | None) -> Path:
    from training.data.corpus import build_default_corpus

    return build_default_corpus(cache_dir)


if __name__ == "__main__":
    main()

"""Tokenize a JSON-lines corpus into Megatron-LM's memory-mapped indexed dataset.

Same flags and same output as Megatron-LM's ``tools/preprocess_data.py`` (whole documents, no
sentence splitting), byte for byte::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model spm.model \\
        --workers 2 --append-eod

writes ``data/corpus_text_document.bin`` and ``.idx`` (one pair per ``--json-keys`` key), for
``--data-path data/corpus_text_document``. Each JSON line is one document; a key holding a list
of strings is written as one sequence per string. ``--append-eod`` ends every non-empty
document with the tokenizer's ``eod`` id. Workers encode in parallel; results are written in
input order, so the output does not depend on ``--workers``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from training.data.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from training.tokenizer import TOKENIZER_TYPES, build_tokenizer

# Per-process encoder state, set by _init_worker (in each pool worker, or in-process).
_STATE: dict = {}

Encoded = tuple[dict[str, np.ndarray], dict[str, list[int]], int]


def _init_worker(tokenizer_kwargs: dict, json_keys: list[str], append_eod: bool) -> None:
    _STATE["tokenizer"] = build_tokenizer(**tokenizer_kwargs)
    _STATE["json_keys"] = json_keys
    _STATE["append_eod"] = append_eod


def _encode(line: bytes) -> Encoded:
    """Token ids and sequence lengths per key of one JSON line, and the line's size in bytes."""
    tokenizer = _STATE["tokenizer"]
    record = json.loads(line)
    ids, lengths = {}, {}
    for key in _STATE["json_keys"]:
        if key not in record:
            raise KeyError(f"input line has no key {key!r} (keys: {sorted(record)}); see --json-keys")
        text = record[key]
        doc: list[int] = []
        lens: list[int] = []
        for sentence in text if isinstance(text, list) else [text]:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                doc.extend(sentence_ids)
                lens.append(len(sentence_ids))
        if doc and _STATE["append_eod"]:
            doc.append(tokenizer.eod)
            lens[-1] += 1
        ids[key] = np.asarray(doc, dtype=np.int64)
        lengths[key] = lens
    return ids, lengths, len(line)


def _lines(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield line


def output_prefix_for(output_prefix: str, key: str) -> str:
    """The dataset prefix written for one JSON key: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line")
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        help="as for training (default with --vocab-file and --merge-file: GPT2BPETokenizer)",
    )
    g.add_argument(
        "--tokenizer-model", help="SentencePiece model file, or a local Hugging Face tokenizer folder"
    )
    g.add_argument("--vocab-file", help="GPT-2 BPE vocab.json (GPT2BPETokenizer)")
    g.add_argument("--merge-file", help="GPT-2 BPE merges.txt (GPT2BPETokenizer)")
    g.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer only)")
    g.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="<extra_id_N> tokens (SentencePieceTokenizer)"
    )
    g.add_argument("--append-eod", action="store_true", help="append the eod token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix of the output, without suffix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunk-size", type=int, default=32, help="documents sent to a worker at a time")
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    args = p.parse_args(argv)
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"
    if args.tokenizer_type is None:
        p.error("--tokenizer-type is required (or --vocab-file and --merge-file for GPT2BPETokenizer)")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    """Preprocess ``--input``; return the written dataset prefixes (one per JSON key)."""
    from tqdm import tqdm

    args = get_args(argv)
    tokenizer_kwargs = {
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
        "vocab_extra_ids": args.vocab_extra_ids,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
    }
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    dtype = optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(args.output_prefix, key) for key in args.json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builders = {key: IndexedDatasetBuilder(data_file_path(prefix), dtype) for key, prefix in prefixes.items()}

    init_args = (tokenizer_kwargs, list(args.json_keys), args.append_eod)
    pool = None
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init_args)
        encoded = pool.imap(_encode, _lines(args.input), args.chunk_size)
    else:
        _init_worker(*init_args)
        encoded = map(_encode, _lines(args.input))

    start = time.perf_counter()
    num_docs = num_tokens = num_bytes = 0
    bar = tqdm(
        total=os.path.getsize(args.input),
        unit="B",
        unit_scale=True,
        desc="preprocess",
        disable=True if args.quiet else None,
        file=sys.stderr,
    )
    try:
        for ids, lengths, nbytes in encoded:
            for key in args.json_keys:
                builders[key].add_document(ids[key], lengths[key])
                num_tokens += len(ids[key])
            num_docs += 1
            num_bytes += nbytes
            bar.update(nbytes)
            if num_docs % 256 == 0:
                bar.set_postfix_str(f"{num_docs / (time.perf_counter() - start):.0f} docs/s", refresh=False)
    except BaseException:
        if pool is not None:
            pool.terminate()  # a bad line in one worker must not leave the others running
        raise
    finally:
        bar.close()
    if pool is not None:
        pool.close()
        pool.join()
    for key, prefix in prefixes.items():
        builders[key].finalize(index_file_path(prefix))

    elapsed = max(time.perf_counter() - start, 1e-9)
    if not args.quiet:
        print(
            f"preprocessed {num_docs} documents, {num_tokens} tokens ({np.dtype(dtype).name}) in {elapsed:.1f} s "
            f"({num_docs / elapsed:.0f} docs/s, {num_bytes / elapsed / 1e6:.2f} MB/s) -> "
            + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()),
            file=sys.stderr,
        )
    return list(prefixes.values())


if __name__ == "__main__":
    main()

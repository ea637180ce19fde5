"""The default run's data: the default corpus, tokenized once with the default tokenizer and cached."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from training.data.corpus import build_default_corpus, default_cache_dir
from training.data.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from training.data.tokenizer_training import iter_jsonl_texts
from training.reporting.logging_utils import print_line
from training.tokenizer import tokenizer_files


def default_data_prefix(
    tokenizer,
    cache_dir: str | os.PathLike | None = None,
    *,
    verbose: bool = True,
) -> str:
    """Prefix of the default corpus as a Megatron indexed dataset (EOD after every document).

    The cache key includes the bytes of the tokenizer's files, so another tokenizer never reads stale ids.
    Both files are written under temporary names and moved into place, the index last.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = build_default_corpus(cache, verbose=verbose)
    hasher = hashlib.sha256(type(tokenizer).__name__.encode())
    for path in tokenizer_files(tokenizer):
        hasher.update(Path(path).read_bytes())
    digest = hasher.hexdigest()[:12]
    prefix = str(cache / f"{corpus.stem}-{type(tokenizer).__name__}-{digest}_text_document")
    if os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix)):
        if verbose:
            print_line(f"default data: {prefix}.bin/.idx (cached)")
        return prefix
    start = time.perf_counter()
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(data_file_path(tmp), optimal_dtype(tokenizer.vocab_size))
    tokens = 0
    for text in iter_jsonl_texts(corpus):
        ids = tokenizer.tokenize(text)
        if ids:
            builder.add_item(ids + [tokenizer.eod])
            tokens += len(ids) + 1
        builder.end_document()
    builder.finalize(index_file_path(tmp))
    os.replace(data_file_path(tmp), data_file_path(prefix))
    os.replace(index_file_path(tmp), index_file_path(prefix))
    if verbose:
        print_line(
            f"default data: tokenized {corpus.name} into {tokens:,} tokens in {time.perf_counter() - start:.1f} s "
            f"-> {prefix}.bin/.idx"
        )
    return prefix

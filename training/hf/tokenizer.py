"""Tokenizers to and from Hugging Face folders, so that ``AutoTokenizer`` gives the ids Trident trained on.

Export, by the checkpoint's tokenizer type:

* SentencePiece BPE models (``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``): a ``tokenizer.json``
  built with the ``tokenizers`` library that runs the model as SentencePiece does, plus the
  ``tokenizer.model`` itself. Hugging Face's own LLaMA conversion is not used: it adds the
  leading "▁" only when the text does not already start with a space, where SentencePiece always
  adds it, so ids differ on text with leading spaces. Here the normalizer always prepends it; the
  pre-tokenizer cuts words where SentencePiece does (each run of spaces starts a word, or each
  space when whitespace-only pieces are not allowed); the merges come from the piece scores,
  highest first, which is the order SentencePiece's BPE applies them in. Special tokens are
  never parsed out of the text (``split_special_tokens``), as SentencePiece does not.
  ``Llama2Tokenizer`` adds BOS; ``GPTSentencePieceTokenizer`` adds nothing.
* ``GPT2BPETokenizer``: ``vocab.json`` and ``merges.txt`` for ``GPT2Tokenizer``.
* ``HuggingFaceTokenizer``: its folder's files, copied.

Import copies the tokenizer files of a Hugging Face model folder (never its weights) and records
them as a ``HuggingFaceTokenizer``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from training.tokenizer import HuggingFaceTokenizer

__all__ = ["TOKENIZER_FILES", "export_tokenizer", "hf_tokenizer_files"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
"""Files of a Hugging Face model folder that make up its tokenizer."""

SPACE = "\u2581"
SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer")


def hf_tokenizer_files(folder: str) -> list[str]:
    """The tokenizer files present in a Hugging Face model folder."""
    return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))]


def export_tokenizer(
    record: Mapping[str, Any] | None, out: str, *, max_length: int, vocab_size: int
) -> dict[str, Any]:
    """Write the checkpoint's tokenizer (``Checkpoint.tokenizer``) into ``out`` for ``AutoTokenizer``.

    Returns ``{"type": ..., "bos_token_id": ..., "eos_token_id": ...}`` (None ids where there are
    none); a checkpoint without a tokenizer, or with a ``NullTokenizer``, exports no files. A
    NullTokenizer model reads token ids and has no text tokenizer, but its end-of-document id is
    known: the last of its ``vocab_size`` ids (N + 1 ids for ``--vocab-size N``), written as ``eos_token_id``.
    """
    kind = None if record is None else record["type"]
    files = {} if record is None else record["files"]
    if kind in SENTENCEPIECE_TYPES:
        ids = _export_sentencepiece(
            files["tokenizer_model"], out, bos=kind == "Llama2Tokenizer", max_length=max_length
        )
    elif kind == "GPT2BPETokenizer":
        ids = _export_gpt2(files["vocab_file"], files["merge_file"], out, max_length=max_length)
    elif kind == "HuggingFaceTokenizer":
        ids = _copy_hf_folder(files["tokenizer_model"], out)
    elif kind == "NullTokenizer":
        return {"type": kind, "bos_token_id": None, "eos_token_id": vocab_size - 1}
    elif kind is None:
        return {"type": kind, "bos_token_id": None, "eos_token_id": None}
    else:
        raise ValueError(f"tokenizer type {kind!r} cannot be exported to a Hugging Face folder")
    return {"type": kind, **ids}


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=1, ensure_ascii=False)
        fh.write("\n")


# --------------------------------------------------------------------------------------------------
# SentencePiece
# --------------------------------------------------------------------------------------------------


def _sentencepiece_proto(model_file: str):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as err:  # protobuf missing
        raise ImportError(f"exporting a SentencePiece tokenizer needs protobuf ({err})") from None
    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as fh:
        proto.ParseFromString(fh.read())
    return proto


def _bpe_merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` pair whose concatenation is a piece, by that piece's score, highest first."""
    ids = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    normal = {piece for piece, _, kind in pieces if kind == 1}  # NORMAL pieces take part in BPE
    merges = []
    for piece, score, kind in pieces:
        if kind != 1 or len(piece) < 2:
            continue
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if {piece[:k], piece[k:]} <= normal]
        merges += [(-score, ids[left], ids[right], left, right) for left, right in local]
    merges.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in merges]


def _sentencepiece_tokenizer(proto, *, bos_first: bool):
    """A ``tokenizers.Tokenizer`` that encodes and decodes exactly as the SentencePiece BPE model."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != trainer.BPE:
        raise ValueError("only SentencePiece BPE models can be exported (this one is not BPE)")
    if trainer.treat_whitespace_as_suffix or norm.remove_extra_whitespaces or norm.precompiled_charsmap:
        raise ValueError(
            "this SentencePiece model normalises its text (treat_whitespace_as_suffix, "
            "remove_extra_whitespaces or a normalisation rule), which the export does not reproduce"
        )
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    unk = pieces[trainer.unk_id][0]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=_bpe_merges(pieces), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Replace(" ", SPACE)]
    if norm.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    words = (
        f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+"
        if trainer.allow_whitespace_only_pieces
        else f"{SPACE}[^{SPACE}]*|[^{SPACE}]+"
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(words), behavior="isolated")
    decoding = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        decoding.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(decoding)
    special = [piece for piece, _, kind in pieces if kind in (2, 3)]  # UNKNOWN and CONTROL pieces
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
    if bos_first and trainer.bos_id >= 0:
        bos = pieces[trainer.bos_id][0]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, trainer.bos_id)]
        )
    return tokenizer, pieces


def _export_sentencepiece(model_file: str, out: str, *, bos: bool, max_length: int) -> dict[str, Any]:
    proto = _sentencepiece_proto(model_file)
    tokenizer, pieces = _sentencepiece_tokenizer(proto, bos_first=bos)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    shutil.copyfile(model_file, os.path.join(out, "tokenizer.model"))
    trainer = proto.trainer_spec

    def piece(i: int) -> str | None:
        return pieces[i][0] if 0 <= i < len(pieces) else None

    _write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": piece(trainer.bos_id),
            "eos_token": piece(trainer.eos_id),
            "unk_token": piece(trainer.unk_id),
            "pad_token": piece(trainer.pad_id),
            "add_bos_token": bos,
            "add_eos_token": False,
            "split_special_tokens": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_length,
        },
    )
    return {
        "bos_token_id": trainer.bos_id if trainer.bos_id >= 0 else None,
        "eos_token_id": trainer.eos_id if trainer.eos_id >= 0 else None,
    }


# --------------------------------------------------------------------------------------------------
# GPT-2 BPE and Hugging Face folders
# --------------------------------------------------------------------------------------------------


def _export_gpt2(vocab_file: str, merge_file: str, out: str, *, max_length: int) -> dict[str, Any]:
    shutil.copyfile(vocab_file, os.path.join(out, "vocab.json"))
    shutil.copyfile(merge_file, os.path.join(out, "merges.txt"))
    with open(vocab_file, encoding="utf-8") as fh:
        eod = json.load(fh)["<|endoftext|>"]
    token = "<|endoftext|>"
    _write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": token,
            "eos_token": token,
            "unk_token": token,
            "add_prefix_space": False,
            "add_bos_token": False,
            "split_special_tokens": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_length,
        },
    )
    return {"bos_token_id": eod, "eos_token_id": eod}


def _copy_hf_folder(folder: str, out: str) -> dict[str, Any]:
    names = hf_tokenizer_files(folder)
    if not names:
        raise ValueError(f"the checkpoint's Hugging Face tokenizer folder {folder} holds no tokenizer files")
    for name in names:
        shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
    tokenizer = HuggingFaceTokenizer(folder)
    return {
        "bos_token_id": None if tokenizer.bos < 0 else tokenizer.bos,
        "eos_token_id": tokenizer.eos,
    }

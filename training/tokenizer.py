"""Tokenizers with Megatron-LM's names and token-id semantics.

``build_tokenizer("GPTSentencePieceTokenizer", "m.model")`` behaves like Megatron's
``--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model m.model``, so token ids, ``eod``
and ``vocab_size`` agree and preprocessed data are interchangeable:

* ``GPTSentencePieceTokenizer`` — the plain SentencePiece model. ``tokenize`` adds no BOS/EOS;
  ``eod == eos`` is the model's ``</s>``; ``vocab_size`` is the model's piece count; ``pad`` is
  the model's pad id (-1 if it has none).
* ``SentencePieceTokenizer`` — the BERT/T5-style wrapper. It appends ``<CLS> <SEP> <EOD> <MASK>``
  (and ``<PAD>``/``<BOS>``/``<EOS>`` when the model lacks those) after the model's pieces unless
  they already are pieces, so ``eod`` is the new ``<EOD>`` id, not ``eos``; ``vocab_size``
  counts the additions; ``tokenize`` cuts the text at the literal special-token strings and
  encodes them as single ids, and ``detokenize`` writes them back surrounded by spaces.
* ``Llama2Tokenizer`` — the SentencePiece model as LLaMA-2 uses it: ``tokenize`` puts BOS first;
  ``eod`` is ``eos``; ``vocab_size`` is the model's piece count.
* ``GPT2BPETokenizer`` — GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and
  ``--merge-file`` (merges.txt), run by the ``tokenizers`` library with GPT-2's split pattern; no
  special tokens are parsed in the text; ``eod`` is ``<|endoftext|>``.
* ``HuggingFaceTokenizer`` — ``transformers.AutoTokenizer`` on a local folder (never a download);
  ``tokenize`` is ``tokenizer(text).input_ids`` (with the special tokens the tokenizer adds, e.g. BOS);
  ``eod`` is its ``eos_token_id``; ``vocab_size`` is ``len(tokenizer)`` (added tokens included).
* ``NullTokenizer`` — text is space-separated ids; ``eod`` is ``vocab_size - 1``.

Models trained by ``tools/train_tokenizer.py`` use unk=0 ``<unk>``, bos=1 ``<s>``, eos=2
``</s>``, pad=3 ``<pad>``.
"""

from __future__ import annotations

import math
import os
import typing

from training.arguments.config import TokenizerType
from training.errors import DataError


def _require_file(path: str | os.PathLike, flag: str, what: str) -> None:
    """One line naming ``flag`` for a tokenizer file that is missing or is a folder."""
    if os.path.isdir(path):
        raise DataError(f"{flag} {path} is a folder; give {what}")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file; give {what}")


class _VocabTable:
    """Megatron's ``vocab``, ``inv_vocab`` and ``vocab_size`` over a piece-to-id table."""

    def _set_vocab(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab
        self._inv_vocab = {i: piece for piece, i in vocab.items()}

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's pieces, plus any special tokens a subclass adds)."""
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab


class GPTSentencePieceTokenizer(_VocabTable):
    """SentencePiece as Megatron's ``_GPTSentencePieceTokenizer``: raw ids, ``eod`` is ``eos``."""

    def __init__(self, model_file: str | os.PathLike) -> None:
        import sentencepiece

        _require_file(model_file, "--tokenizer-model", "a SentencePiece model (.model)")
        self.model_file = os.fspath(model_file)
        try:
            self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=self.model_file)
        except (RuntimeError, OSError):  # sentencepiece's "could not parse ModelProto from ..."
            raise DataError(
                f"--tokenizer-model {model_file} is not a SentencePiece model: sentencepiece cannot parse it "
                "(give the .model file written by tools/train_tokenizer.py or spm_train)"
            ) from None
        self._set_vocab({self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))})
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()
        self._eod_id = self._eos_id
        self._cls_id = self._sep_id = self._mask_id = -1  # no such tokens (SentencePieceTokenizer adds them)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS or EOS."""
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode_ids(list(map(int, ids)))

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def eod(self) -> int:
        """End-of-document id appended by ``--append-eod``: the model's ``</s>`` (SentencePieceTokenizer's
        own ``<EOD>``, distinct from ``eos``)."""
        return self._eod_id

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def mask(self) -> int:
        return self._mask_id


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """SentencePiece as Megatron's ``_SentencePieceTokenizer``, with its extra special tokens."""

    def __init__(self, model_file: str | os.PathLike, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file)
        self._special_tokens: dict[str, int] = {}  # insertion order matters for tie-breaking
        self._inv_special_tokens: dict[int, str] = {}
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._piece_or(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._piece_or(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._piece_or(self.tokenizer.eos_id(), "<EOS>"))
        self._extra_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._extra_tokens:
            self._add_special_token(token)

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        try:
            return self.tokenizer.id_to_piece(piece_id)
        except IndexError:  # the model has no such piece (id -1)
            return fallback

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special_tokens[token] = self._vocab[token]
        self._inv_special_tokens[self._vocab[token]] = token
        return self._vocab[token]

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text``; every occurrence of a special-token string becomes its single id."""
        ids: list[int] = []
        pos = 0
        while True:
            best_token, best_at = None, -1
            for token in self._special_tokens:  # earliest occurrence; ties go to the first added
                at = text.find(token, pos)
                if at >= 0 and (best_token is None or at < best_at):
                    best_token, best_at = token, at
            if best_token is None:
                break
            ids.extend(self.tokenizer.encode_as_ids(text[pos:best_at]))
            ids.append(self._special_tokens[best_token])
            pos = best_at + len(best_token)
        ids.extend(self.tokenizer.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids: list[int]) -> str:
        """Decode ``ids``; special tokens come back as `` <TOKEN> `` with surrounding spaces."""
        ids = list(map(int, ids))
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(ids[last:i]) + " "
                text += self._inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[t] for t in self._extra_tokens]


class NullTokenizer:
    """Megatron's ``NullTokenizer``: text is space-separated integer ids; ``eod`` is one past them."""

    def __init__(self, vocab_size: int) -> None:
        self._eod_id = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod_id + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id

    bos = pad = cls = sep = mask = property(lambda self: -1)


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """SentencePiece as Megatron's ``_Llama2Tokenizer``: BOS before every text, ``eod`` is ``eos``."""

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``, after BOS (and before EOS if asked), as LLaMA-2 was trained."""
        ids = self.tokenizer.encode_as_ids(text)
        return [self._bos_id] * bos + ids + [self._eos_id] * eos


class GPT2BPETokenizer(_VocabTable):
    """GPT-2's byte-level BPE, as Megatron's ``_GPT2BPETokenizer``, from vocab.json and merges.txt."""

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> None:
        import json

        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        _require_file(vocab_file, "--vocab-file", "GPT-2's vocab.json")
        _require_file(merge_file, "--merge-file", "GPT-2's merges.txt")
        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab: dict[str, int] = json.load(f)
        except (UnicodeDecodeError, ValueError):
            raise DataError(f"--vocab-file {vocab_file} is not GPT-2's vocab.json: it is not JSON") from None
        if not isinstance(vocab, dict) or "<|endoftext|>" not in vocab:
            raise DataError(
                f"--vocab-file {vocab_file} has no '<|endoftext|>' token, GPT-2's end of document"
            )
        try:
            self.tokenizer = Tokenizer(models.BPE.from_file(self.vocab_file, self.merge_file))
        except Exception as err:  # noqa: BLE001 -- the tokenizers library raises plain Exception
            raise DataError(
                f"--vocab-file {vocab_file} and --merge-file {merge_file} do not make a BPE model: {err}"
            ) from None
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self.tokenizer.decoder = decoders.ByteLevel()
        self._set_vocab(vocab)
        self._eod_id = vocab["<|endoftext|>"]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self._eod_id

    eos = eod
    bos = pad = cls = sep = mask = property(lambda self: -1)


class HuggingFaceTokenizer(_VocabTable):
    """``transformers.AutoTokenizer`` from a local folder, as Megatron's ``_HuggingFaceTokenizer``."""

    def __init__(self, folder: str | os.PathLike) -> None:
        if not os.path.isdir(folder):
            raise DataError(
                f"--tokenizer-model {folder}: no such Hugging Face tokenizer folder: give a local folder "
                "written by tokenizer.save_pretrained(); Trident never downloads one"
            )
        try:
            import transformers
        except ImportError:
            raise ImportError(
                "--tokenizer-type HuggingFaceTokenizer needs transformers: pip install transformers"
            ) from None
        self.folder = os.fspath(folder)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer in {folder} has no eos token, which Megatron uses as end of document"
            )
        self._set_vocab(self.tokenizer.get_vocab())

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)  # with added tokens, which get_vocab() may not list

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(map(int, ids)))

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def bos(self) -> int:
        return -1 if self.tokenizer.bos_token_id is None else self.tokenizer.bos_token_id

    @property
    def pad(self) -> int:
        return -1 if self.tokenizer.pad_token_id is None else self.tokenizer.pad_token_id

    cls = sep = mask = property(lambda self: -1)


Tokenizer = (
    GPTSentencePieceTokenizer
    | SentencePieceTokenizer
    | Llama2Tokenizer
    | GPT2BPETokenizer
    | HuggingFaceTokenizer
    | NullTokenizer
)
TOKENIZER_TYPES = typing.get_args(TokenizerType)
SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer")
"""The --tokenizer-type values read from a SentencePiece model (Trident's own, given no --tokenizer-model)."""


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | os.PathLike | None = None,
    *,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
) -> Tokenizer:
    """Build a tokenizer by its Megatron ``--tokenizer-type`` name."""
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if tokenizer_model is None:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        if tokenizer_type == "SentencePieceTokenizer":
            return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
        cls = Llama2Tokenizer if tokenizer_type == "Llama2Tokenizer" else GPTSentencePieceTokenizer
        return cls(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local folder)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"unsupported --tokenizer-type {tokenizer_type!r}; use one of {', '.join(TOKENIZER_TYPES)}"
    )


def tokenizer_files(tokenizer: Tokenizer) -> list[str]:
    """The files that define ``tokenizer`` (for cache keys and checkpoints); [] for NullTokenizer."""
    if isinstance(tokenizer, GPTSentencePieceTokenizer):
        return [tokenizer.model_file]
    if isinstance(tokenizer, GPT2BPETokenizer):
        return [tokenizer.vocab_file, tokenizer.merge_file]
    if isinstance(tokenizer, HuggingFaceTokenizer):
        paths = (os.path.join(tokenizer.folder, f) for f in sorted(os.listdir(tokenizer.folder)))
        return [p for p in paths if os.path.isfile(p)]
    return []


def vocab_size_with_padding(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tp_size: int = 1
) -> int:
    """Megatron's padded vocabulary: rounded up to a multiple of ``divisible_by * tp_size``."""
    multiple = make_vocab_size_divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)

"""A Trident checkpoint (any split) -> a Hugging Face model folder, one layer at a time.

Writes ``config.json`` and ``generation_config.json`` (the BOS and EOS ids), the weights as ``model.safetensors`` (or, above ``max_shard_size``, as
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, as ``save_pretrained``
does) and the tokenizer (:mod:`training.hf.tokenizer`). The shard plan is made first from the
tensors' shapes alone (the mapping run on meta tensors, no data read); every shard file is then
opened with its header written and each tensor goes to its place as soon as it is converted, so
memory stays near one layer, never one shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from models.gpt.hf_mapping import hf_architecture, iter_to_hf
from training.checkpoint.files import TensorFileWriter, fsync_dir
from training.checkpoint.format import CheckpointError
from training.checkpoint.reader import Checkpoint
from training.hf.config import hf_config_json
from training.hf.tokenizer import export_tokenizer

__all__ = ["ExportSummary", "export_to_hf", "parse_size"]

DEFAULT_MAX_SHARD_SIZE = "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"10KiB"`` or a byte count -> bytes (Hugging Face's units: GB = 10**9)."""
    if isinstance(text, int):
        return text
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 1000000")


@dataclasses.dataclass
class ExportSummary:
    """What :func:`export_to_hf` wrote, for its one-line report."""

    path: str
    architecture: str
    tensors: int
    bytes: int
    shards: int
    tokenizer: str | None
    seconds: float
    eos_token_id: int | None = None

    def line(self) -> str:
        files = SINGLE_FILE if self.shards == 1 else f"{self.shards} shards + {INDEX_FILE}"
        tokenizer = f"tokenizer from {self.tokenizer}" if self.tokenizer else "no tokenizer"
        if self.tokenizer == "NullTokenizer":
            tokenizer = (
                "no tokenizer files (a NullTokenizer model reads token ids: it has no text tokenizer; "
                f"its end-of-document id {self.eos_token_id} is eos_token_id)"
            )
        return (
            f"exported to Hugging Face {self.architecture}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB "
            f"({files}), config.json, generation_config.json, {tokenizer}, in {self.seconds:.1f} s into "
            f"{self.path}"
        )


class _CheckpointTensors(Mapping):
    """Full tensors of a checkpoint by name, read on each lookup (``meta=True``: shapes only, no read)."""

    def __init__(self, ckpt: Checkpoint, *, meta: bool = False) -> None:
        self.ckpt, self.meta = ckpt, meta

    def __getitem__(self, name: str) -> torch.Tensor:
        if not self.ckpt.has_tensor(name):
            raise KeyError(name)
        if self.meta:
            spec = self.ckpt.spec(name)
            return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        return self.ckpt.full_tensor(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.ckpt.has_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ckpt.tensor_names("model"))

    def __len__(self) -> int:
        return len(self.ckpt.tensor_names("model"))


def _plan_shards(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int
) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Tensors in order, a new shard whenever the next would take this one past the limit."""
    shards: list[list] = [[]]
    size = 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, shape))
        size += nbytes
    return shards


def _check_empty(out: str) -> None:
    if not os.path.isdir(out):
        os.makedirs(out)
        return
    taken = [
        n
        for n in os.listdir(out)
        if n == "config.json" or (n.startswith("model") and n.endswith((".safetensors", ".json")))
    ]
    if taken:
        raise CheckpointError(
            f"--to-hf {out} already holds a model ({', '.join(sorted(taken))}); choose an empty folder or remove it"
        )


def export_to_hf(
    ckpt: Checkpoint,
    out: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[int], None] | None = None,
) -> ExportSummary:
    """Write ``ckpt`` as a Hugging Face model folder ``out`` (refusing one that already holds a model)."""
    started = time.perf_counter()
    config = ckpt.config
    try:
        architecture = hf_architecture(config)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {ckpt.path} cannot be exported to Hugging Face: {err}") from None
    limit = parse_size(max_shard_size)
    vocab = ckpt.vocab_size
    planned = [
        (name, t.dtype, tuple(t.shape))
        for name, t in iter_to_hf(_CheckpointTensors(ckpt, meta=True), config, vocab, tied_head=False)
    ]
    shards = _plan_shards(planned, limit)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    _check_empty(out)
    file_of = {name: file for file, shard in zip(files, shards) for name, _, _ in shard}
    total = _write_shards(ckpt, out, files, shards, file_of, progress)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        _write(os.path.join(out, INDEX_FILE), index)
    tokenizer = export_tokenizer(ckpt.tokenizer, out, max_length=ckpt.max_sequence_length, vocab_size=vocab)
    imported = ckpt.manifest.get("extra", {}).get("imported_from", {})  # ids when no tokenizer says them
    for key in ("bos_token_id", "eos_token_id"):
        if tokenizer[key] is None:
            tokenizer[key] = imported.get(key)
    dtype = ckpt.spec("embedding.word_embeddings.weight").dtype
    hf_config = hf_config_json(
        config,
        vocab,
        ckpt.max_sequence_length,
        dtype=dtype,
        bos_token_id=tokenizer["bos_token_id"],
        eos_token_id=tokenizer["eos_token_id"],
    )
    _write(os.path.join(out, "config.json"), hf_config)
    _write(os.path.join(out, GENERATION_CONFIG), generation_config(tokenizer))
    fsync_dir(out)
    return ExportSummary(
        path=out,
        architecture=architecture,
        tensors=len(planned),
        bytes=total,
        shards=len(files),
        tokenizer=tokenizer["type"],
        seconds=time.perf_counter() - started,
        eos_token_id=tokenizer["eos_token_id"],
    )


def _write_shards(
    ckpt: Checkpoint,
    out: str,
    files: list[str],
    shards: list[list],
    file_of: dict[str, str],
    progress: Callable[[int], None] | None,
) -> int:
    """Stream every tensor, in Hugging Face's names, into its shard file; the bytes written.

    A failure leaves no partial file behind."""
    writers, total = {}, 0
    try:
        for file, shard in zip(files, shards):
            writers[file] = TensorFileWriter(os.path.join(out, file), shard, {"format": "pt"})
        for name, tensor in iter_to_hf(
            _CheckpointTensors(ckpt), ckpt.config, ckpt.vocab_size, tied_head=False
        ):
            writers[file_of[name]].write(name, tensor)
            total += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress(tensor.numel() * tensor.element_size())
        for writer in writers.values():
            writer.close(sync_dir=False)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return total


def generation_config(tokenizer: Mapping[str, int | None]) -> dict:
    """``generation_config.json``: the ids ``generate()`` starts and stops at, as ``save_pretrained`` writes
    them (null ids left out)."""
    ids = {key: tokenizer[key] for key in ("bos_token_id", "eos_token_id") if tokenizer[key] is not None}
    return {"_from_model_config": True, **ids}


def _write(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2)
        fh.write("\n")

"""A Hugging Face model folder -> a Trident checkpoint at any split, one layer at a time.

The ``TransformerConfig`` comes from ``config.json`` (:mod:`training.hf.config`, which refuses what
Trident cannot represent); the weights are read lazily from ``model.safetensors`` or the shards an
``model.safetensors.index.json`` lists, each tensor when its layer is converted, and go straight
through :class:`~training.checkpoint.writer.CheckpointWriter` into the target split's files. Every
shard is opened and its header checked before anything is written, so a missing or truncated file
is one error naming it, with no partial checkpoint left behind. The tokenizer files are copied in
and recorded as a ``HuggingFaceTokenizer``; ``pretrain_gpt.py --load OUT --finetune
--use-checkpoint-args`` then needs no model or tokenizer flag.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from models.gpt.hf_mapping import hf_architecture, iter_from_hf
from training.checkpoint.convert import parallelism_of, split_fields
from training.checkpoint.files import read_header, read_piece
from training.checkpoint.format import MANIFEST, CheckpointError, iteration_dir
from training.checkpoint.specs import gpt_tensor_specs
from training.checkpoint.writer import write_checkpoint
from training.hf.config import transformer_config_from_hf
from training.hf.tokenizer import hf_tokenizer_files

__all__ = ["ImportSummary", "SafetensorsFolder", "import_from_hf"]

SKIPPED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers older GPT-2 and LLaMA checkpoints saved besides the weights (causal masks, RoPE tables)."""


@dataclasses.dataclass
class ImportSummary:
    """What :func:`import_from_hf` wrote, for its one-line report."""

    path: str
    architecture: str
    split: str
    tensors: int
    bytes: int
    tokenizer: bool
    seconds: float

    def line(self) -> str:
        tokenizer = "tokenizer copied in" if self.tokenizer else "no tokenizer files found"
        return (
            f"imported Hugging Face {self.architecture} as {self.split}: {self.tensors} tensors, "
            f"{self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s into {self.path}; {tokenizer}"
        )


class SafetensorsFolder(Mapping):
    """The weights of a Hugging Face folder by name, each read from its shard when looked up.

    Names are normalised to the ``transformers`` module names (old GPT-2 files lack the
    ``transformer.`` prefix). Opening checks that every shard exists and that its header and
    size agree, so a damaged folder fails before a byte is written. Tensors are read with plain
    file reads, not memory maps, so pages already converted do not stay in the process.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise CheckpointError(f"{index} is not a safetensors index: {err}") from None
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise CheckpointError(
                f"{folder} holds no model.safetensors or model.safetensors.index.json (only safetensors "
                "weights are read; convert a pytorch_model.bin with transformers first)"
            )
        self.read: set[str] = set()
        """Names looked up so far (the importer checks that none was left out)."""
        self._headers: dict[str, dict[str, Any]] = {}
        self._where: dict[str, tuple[str, str]] = {}
        for file in files:
            path = os.path.join(folder, file)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing (listed in {index})")
            self._headers[path] = read_header(path)  # checks the size against the header
            for key in self._headers[path]:
                if key == "__metadata__" or key.endswith(SKIPPED_SUFFIXES):
                    continue
                name = key if key.startswith(("model.", "transformer.", "lm_head.")) else "transformer." + key
                self._where[name] = (path, key)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"the Hugging Face weights in {self.folder} have no tensor '{name}'")
        path, key = self._where[name]
        self.read.add(name)
        return read_piece(path, self._headers[path], key)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def import_from_hf(
    folder: str,
    save: str,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_stages: int | None = None,
    layout: str | None = None,
    expert_parallel: int = 1,
    progress: Callable[[int], None] | None = None,
) -> ImportSummary:
    """Write the Hugging Face model in ``folder`` as a Trident checkpoint (iteration 0) under ``save``."""
    started = time.perf_counter()
    hf_config, config, vocab_size, max_positions = _read_config(
        folder, split_fields(tensor_parallel, pipeline_parallel, virtual_stages, layout, expert_parallel)
    )
    weights = SafetensorsFolder(folder)
    dtype = weights[
        "model.embed_tokens.weight" if "model.embed_tokens.weight" in weights else "transformer.wte.weight"
    ].dtype
    if dtype != config.params_dtype:
        config = dataclasses.replace(config, params_dtype=dtype)
    if os.path.isfile(os.path.join(iteration_dir(save, 0), MANIFEST)):
        raise CheckpointError(
            f"{iteration_dir(save, 0)} already holds a checkpoint; choose another --save or remove it"
        )
    try:
        parallelism = parallelism_of(config)
    except ValueError as err:
        raise CheckpointError(f"the target split does not fit the model: {err}") from None
    specs, tied = gpt_tensor_specs(config, vocab_size, max_positions)
    total = [0]  # bytes read, counted as the writer pulls the tensors
    names = hf_tokenizer_files(folder)
    with tempfile.TemporaryDirectory() as staging:
        tokenizer_dir = os.path.join(staging, "hf_tokenizer")
        os.makedirs(tokenizer_dir)
        for name in names:
            shutil.copyfile(os.path.join(folder, name), os.path.join(tokenizer_dir, name))
        path = write_checkpoint(
            save,
            _checked_tensors(folder, weights, config, specs, tied, total, progress),
            specs=specs,
            tied=tied,
            parallelism=parallelism,
            config=config.to_dict(),
            vocab_size=vocab_size,
            max_sequence_length=max_positions,
            tokenizer_type="HuggingFaceTokenizer" if names else None,
            tokenizer_files={"tokenizer_model": tokenizer_dir} if names else None,
            extra={"imported_from": _origin(folder, hf_config)},
        )
    return ImportSummary(
        path=path,
        architecture=hf_architecture(config),
        split=parallelism.describe(),
        tensors=len(specs),
        bytes=total[0],
        tokenizer=bool(names),
        seconds=time.perf_counter() - started,
    )


def _read_config(folder: str, split: dict[str, Any]) -> tuple[dict, Any, int, int]:
    """``config.json`` and the Trident config, vocabulary and positions it describes at ``split``."""
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path, encoding="utf-8") as fh:
            hf_config = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {config_path}: {err}") from None
    config, vocab_size, max_positions = transformer_config_from_hf(hf_config, where=config_path, **split)
    return hf_config, config, vocab_size, max_positions


def _checked_tensors(
    folder: str,
    weights: SafetensorsFolder,
    config,
    specs: Mapping,
    tied: bool,
    total: list[int],
    progress: Callable[[int], None] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its Trident name, its shape checked; at the end, none left unread."""
    for name, tensor in iter_from_hf(weights, config):
        if tuple(tensor.shape) != specs[name].shape:
            raise CheckpointError(
                f"{folder}: tensor for '{name}' has shape {tuple(tensor.shape)}, but config.json "
                f"describes {specs[name].shape}"
            )
        total[0] += tensor.numel() * tensor.element_size()
        if progress is not None:
            progress(tensor.numel() * tensor.element_size())
        yield name, tensor
    unused = sorted(set(weights) - weights.read - ({"lm_head.weight"} if tied else set()))
    if unused:
        raise CheckpointError(
            f"{folder}: {len(unused)} tensors would be dropped, e.g. {unused[:3]}: config.json describes "
            "a model without them"
        )


def _origin(folder: str, hf_config: dict) -> dict[str, Any]:
    """Where an imported checkpoint came from, for its manifest."""
    return {
        "hugging_face": os.path.abspath(folder),
        "model_type": hf_config["model_type"],
        **{k: hf_config.get(k) for k in ("bos_token_id", "eos_token_id")},
    }

"""Writing a checkpoint at a chosen split from full tensors, one tensor at a time.

:func:`plan_files` decides which file holds which TP shard of every tensor at a target
:class:`Parallelism` (the pipeline layout places each tensor by its owner; replicated tensors go to
TP rank 0 only; optimizer state goes to the DP-rank-0 optimizer files; MoE experts go whole to the
file of the expert-parallel rank that holds them). :class:`CheckpointWriter`
then opens every target file at once, with its header already written, and takes full tensors in
any order, writing each shard at its place in its file, so memory stays near one full tensor however
large the model. :func:`write_manifest` commits: the manifest, then the tracker, last.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from core.pipeline_parallel.layout import DECODER, EMBEDDING, LOSS, parse_layout
from training.checkpoint.files import TensorFileWriter, atomic_write, fsync_dir, write_text
from training.checkpoint.format import (
    FORMAT,
    MANIFEST,
    TOKENIZER_DIR,
    TRACKER,
    CheckpointError,
    Parallelism,
    TensorSpec,
    canonical_order,
    expert_file,
    expert_optim_file,
    iteration_dir,
    model_file,
    optim_file,
    shard_from_full,
    split_optimizer_tensor_name,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CheckpointWriter", "copy_tokenizer", "owner_ranks", "plan_files", "write_manifest"]


def owner_ranks(parallelism: Parallelism) -> dict[str | int, int]:
    """Pipeline rank of every layout element: ``"E"``, ``"L"`` and each decoder layer's number."""
    try:
        layout = parse_layout(parallelism.layout, parallelism.pp)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    ranks: dict[str | int, int] = {}
    layer = 0
    for stage, symbols in enumerate(layout.stages):
        for symbol in symbols:
            if symbol == DECODER:
                ranks[layer] = stage % layout.pp_size
                layer += 1
            elif symbol in (EMBEDDING, LOSS):
                ranks[symbol] = stage % layout.pp_size
    return ranks


def tied_copies(name: str, tied: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str | int]]:
    """``(copy name, copy owner)`` for every tied copy of ``name`` (e.g. the output layer of a tied embedding)."""
    split = split_optimizer_tensor_name(name)
    param = name if split is None else split[1]
    prefix = name[: len(name) - len(param)]
    return [(prefix + copy, t["owner"]) for copy, t in tied.items() if t["source"] == param]


def plan_files(
    specs: Mapping[str, TensorSpec], tied: Mapping[str, Mapping[str, Any]], parallelism: Parallelism
) -> dict[str, list[tuple[str, str, int]]]:
    """``file -> [(tensor name, key in the file, tp rank)]`` in file order (:func:`canonical_order`).

    A tied copy is written where its owner lands on another pipeline rank than its source; on the
    same rank the model shares one Parameter, so there is nothing to write.
    """
    ranks = owner_ranks(parallelism)
    tp = parallelism.tp
    entries: list[tuple[str, str, int, str | int]] = []  # name, key, pp rank, owner of the key
    for name, spec in specs.items():
        copies = tied_copies(name, tied)
        for owner in (spec.owner, *[owner for _, owner in copies]):
            if owner not in ranks:
                raise CheckpointError(
                    f"tensor '{name}' belongs to layout element {owner!r}, which pipeline layout "
                    f"'{parallelism.layout}' does not have"
                )
        if spec.partition is not None:
            spec.partition.check(spec.shape[spec.partition.dim], tp, f"tensor '{name}'")
        pp_rank = ranks[spec.owner]
        entries.append((name, name, pp_rank, spec.owner))
        entries += [(name, copy, ranks[owner], owner) for copy, owner in copies if ranks[owner] != pp_rank]
    owner_of = {key: owner for _, key, _, owner in entries}
    order = {key: i for i, key in enumerate(canonical_order(owner_of, owner_of.__getitem__))}
    experts = 1 + max((s.expert for s in specs.values() if s.expert is not None), default=-1)
    if experts % parallelism.ep:
        raise CheckpointError(
            f"{experts} experts per layer cannot be split over {parallelism.ep} expert-parallel ranks"
        )
    files: dict[str, list[tuple[str, str, int]]] = {}
    for name, key, pp_rank, _ in sorted(entries, key=lambda e: order[e[1]]):
        optimizer = split_optimizer_tensor_name(name) is not None
        expert = specs[name].expert
        for t in range(tp) if specs[name].partition is not None else [0]:
            if expert is not None:  # whole experts, in the file of the EP rank holding them
                ep_rank = expert // (experts // parallelism.ep)
                file = expert_optim_file(pp_rank, ep_rank) if optimizer else expert_file(pp_rank, ep_rank)
            else:
                file = optim_file(t, pp_rank, 0) if optimizer else model_file(t, pp_rank)
            files.setdefault(file, []).append((name, key, t))
    return files


class CheckpointWriter:
    """Writes the model and optimizer files of one iteration directory at ``parallelism``.

    Give it the spec of every tensor, then call :meth:`write` with each full (unpadded) tensor, in
    any order, and :meth:`close` for the files' manifest records. Every target file is open at
    once with its header written, and each shard goes straight to its place, so memory stays near
    one full tensor. Leaving a ``with`` block by an exception removes every unfinished file.
    """

    def __init__(
        self,
        path: str,
        parallelism: Parallelism,
        specs: Mapping[str, TensorSpec],
        tied: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.path, self.parallelism = path, parallelism
        self.specs = dict(specs)
        self.tied = dict(tied or {})
        plan = plan_files(self.specs, self.tied, parallelism)
        self.placements: dict[str, list[tuple[str, str, int]]] = {name: [] for name in self.specs}
        for file, entries in plan.items():
            for name, key, t in entries:
                self.placements[name].append((file, key, t))
        self._written: set[str] = set()
        os.makedirs(path, exist_ok=True)
        self._files: dict[str, TensorFileWriter] = {}
        try:
            for file, entries in plan.items():
                layout = [
                    (key, self.specs[n].dtype, self.specs[n].shard_shape(parallelism.tp))
                    for n, key, _ in entries
                ]
                self._files[file] = TensorFileWriter(os.path.join(path, file), layout, {"format": FORMAT})
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, full: torch.Tensor) -> None:
        """Cut tensor ``name`` into its shards and write each into its file."""
        if name not in self.specs or name in self._written:
            raise CheckpointError(
                f"tensor '{name}' " + ("was written twice" if name in self._written else "has no spec")
            )
        spec = self.specs[name]
        if tuple(full.shape) != spec.shape:
            raise CheckpointError(
                f"tensor '{name}' has shape {tuple(full.shape)}, its spec says {spec.shape}"
            )
        full = full.to(spec.dtype)
        for file, key, t in self.placements[name]:
            self._files[file].write(key, shard_from_full(full, spec, t, self.parallelism.tp))
        self._written.add(name)

    def close(self) -> dict[str, dict[str, Any]]:
        """Finish every file; ``{file: record}`` for the manifest, pieces tagged with their TP rank."""
        missing = [name for name in self.specs if name not in self._written]
        if missing:
            raise CheckpointError(f"tensors {missing[:3]} were never written ({len(missing)} in all)")
        records = {file: writer.close(sync_dir=False) for file, writer in self._files.items()}
        fsync_dir(self.path)
        for places in self.placements.values():
            for file, key, t in places:
                records[file]["pieces"][key]["tp_rank"] = t
        return records

    def abort(self) -> None:
        for writer in self._files.values():
            writer.abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


def copy_tokenizer(files: Mapping[str, str], path: str, tokenizer_type: str, **extra: Any) -> dict[str, Any]:
    """Copy the tokenizer's files into ``path/tokenizer/`` and return the manifest's ``tokenizer`` record.

    ``files`` maps a role (``"tokenizer_model"``, ``"vocab_file"``, ...) to a file or, for a Hugging
    Face tokenizer, a directory. The record stores paths relative to the iteration directory, so a
    checkpoint can be moved.
    """
    target = os.path.join(path, TOKENIZER_DIR)
    os.makedirs(target, exist_ok=True)
    copied = {}
    for role, source in files.items():
        if source is None:
            continue
        name = os.path.basename(os.path.normpath(source))
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(target, name), dirs_exist_ok=True)
        else:

            def copy(fh, source=source) -> None:
                with open(source, "rb") as src:
                    shutil.copyfileobj(src, fh)

            try:
                atomic_write(os.path.join(target, name), copy)
            except OSError as err:
                raise CheckpointError(f"cannot copy tokenizer file {source} into {target}: {err}") from None
        copied[role] = f"{TOKENIZER_DIR}/{name}"
    return {"type": tokenizer_type, "files": copied, **extra}


def padded_vocab_size(specs: Mapping[str, TensorSpec], vocab_size: int, tp: int) -> int:
    """The vocabulary padded as the specs' padding rule says for TP size ``tp`` (unpadded without one)."""
    for spec in specs.values():
        if spec.partition is not None and spec.partition.pad_multiple is not None:
            return spec.partition.padded(vocab_size, tp)
    return vocab_size


def write_manifest(
    root: str, iteration: int | str, manifest: Mapping[str, Any], *, commit: bool = True
) -> str:
    """Write ``iter_*/manifest.json``, then (``commit``) the tracker: the checkpoint exists from then on."""
    import json

    path = iteration_dir(root, iteration)
    write_text(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))
    if commit:
        write_text(os.path.join(root, TRACKER), str(iteration))
    return path


def manifest_header(
    *,
    iteration: int,
    consumed_samples: int,
    parallelism: Parallelism,
    config: Mapping[str, Any],
    vocab_size: int,
    padded_vocab_size: int,
    max_sequence_length: int,
    tokenizer: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The manifest's description of the run and the model (tensors and files are added by the writer)."""
    return {
        "format": FORMAT,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "parallel": parallelism.to_json(),
        "model": {
            "config": dict(config),
            "vocab_size": vocab_size,
            "padded_vocab_size": padded_vocab_size,
            "max_sequence_length": max_sequence_length,
        },
        "tokenizer": None if tokenizer is None else dict(tokenizer),
    }


def write_checkpoint(
    root: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    specs: Mapping[str, TensorSpec],
    tied: Mapping[str, Mapping[str, Any]] | None,
    parallelism: Parallelism,
    config: Mapping[str, Any],
    vocab_size: int,
    max_sequence_length: int,
    tokenizer_files: Mapping[str, str] | None = None,
    tokenizer_type: str | None = None,
    iteration: int = 0,
    consumed_samples: int = 0,
    optimizer: Mapping[str, Any] | None = None,
    scheduler: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Write a complete, committed checkpoint from a stream of full tensors (any order, each once).

    The building block for importers (Hugging Face) and tests: ``config`` is
    ``TransformerConfig.to_dict()`` at the target split, ``specs`` as from
    :func:`training.checkpoint.specs.gpt_tensor_specs`. Returns the iteration directory.
    """
    path = iteration_dir(root, iteration)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"{path} already holds a checkpoint; choose another directory or remove it")
    with CheckpointWriter(path, parallelism, specs, tied) as writer:
        for name, tensor in tensors:
            writer.write(name, tensor)
        files = writer.close()
    tokenizer = None
    if tokenizer_type is not None:
        tokenizer = copy_tokenizer(tokenizer_files or {}, path, tokenizer_type)
    padded = padded_vocab_size(specs, vocab_size, parallelism.tp)
    manifest = manifest_header(
        iteration=iteration,
        consumed_samples=consumed_samples,
        parallelism=parallelism,
        config=config,
        vocab_size=vocab_size,
        padded_vocab_size=padded,
        max_sequence_length=max_sequence_length,
        tokenizer=tokenizer,
    )
    manifest.update(
        tensors={name: spec.to_json() for name, spec in specs.items()},
        tied=dict(tied or {}),
        optimizer=None if optimizer is None else dict(optimizer),
        scheduler=None if scheduler is None else dict(scheduler),
        files=files,
        args={},
        extra=dict(extra or {}),
    )
    return write_manifest(root, iteration, manifest)

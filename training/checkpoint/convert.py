"""Offline resharding: one checkpoint to another split (TP, PP, VPP, layout, EP), tensor by tensor,
with no process group.

:func:`target_split` checks the target against the model (heads, query groups, FFN size, the layout
and its layer count) before anything is written;
:func:`convert_checkpoint` then streams every tensor (model and optimizer state alike) through
:class:`~training.checkpoint.writer.CheckpointWriter`. RNG states are per rank: a target rank that
also existed in the source split keeps its file; any other rank is seeded afresh when training
resumes, as Megatron seeds a new rank.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from core.pipeline_parallel.layout import parse_layout
from core.transformer.transformer_config import TransformerConfig
from models.gpt.gpt_model import pipeline_layout
from training.checkpoint.files import atomic_write
from training.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    Parallelism,
    TensorSpec,
    canonical_order,
    iteration_dir,
    rng_file,
)
from training.checkpoint.reader import Checkpoint
from training.checkpoint.writer import CheckpointWriter, copy_tokenizer, padded_vocab_size, write_manifest

__all__ = ["ConversionSummary", "convert_checkpoint", "parallelism_of", "target_split"]


@dataclasses.dataclass
class ConversionSummary:
    """What :func:`convert_checkpoint` did, for its one-line report."""

    path: str
    source: Parallelism
    target: Parallelism
    tensors: int
    bytes: int
    seconds: float
    rng_kept: int
    rng_total: int

    def line(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 1e6
        fresh = self.rng_total - self.rng_kept
        return (
            f"converted {self.source.describe()} -> {self.target.describe()}: {self.tensors} tensors, "
            f"{self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s ({rate:.0f} MB/s) into {self.path}; "
            f"RNG states kept for {self.rng_kept} of {self.rng_total} ranks"
            + (
                f", the other {fresh} will be seeded afresh as new ranks when training resumes"
                if fresh
                else ""
            )
        )


def parallelism_of(config, dp: int = 1) -> Parallelism:
    """The :class:`Parallelism` a ``TransformerConfig`` describes (its layout made explicit)."""
    layout = pipeline_layout(config)
    return Parallelism(
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        layout.vpp_size,
        layout.to_string(),
        dp,
        config.expert_model_parallel_size,
    )


def split_fields(
    tensor_parallel: int,
    pipeline_parallel: int,
    virtual_stages: int | None,
    layout: str | None,
    expert_parallel: int = 1,
) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a target split (one virtual stage per rank means none)."""
    return {
        "tensor_model_parallel_size": tensor_parallel,
        "pipeline_model_parallel_size": pipeline_parallel,
        "virtual_pipeline_model_parallel_size": virtual_stages
        if virtual_stages and virtual_stages > 1
        else None,
        "pipeline_model_parallel_layout": layout,
        "expert_model_parallel_size": expert_parallel,
    }


def target_split(
    ckpt: Checkpoint,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    virtual_stages: int | None = None,
    layout: str | None = None,
    expert_parallel: int = 1,
) -> tuple[Parallelism, dict[str, Any]]:
    """The target :class:`Parallelism` and model config, or a CheckpointError saying what does not fit."""
    try:
        config = TransformerConfig.from_dict(
            ckpt.manifest["model"]["config"],
            **split_fields(tensor_parallel, pipeline_parallel, virtual_stages, layout, expert_parallel),
        )
        if layout is not None and virtual_stages is None:
            vpp = parse_layout(layout, pipeline_parallel).vpp_size
            config = dataclasses.replace(
                config, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
            )
        target = parallelism_of(config, ckpt.parallel.dp)
    except ValueError as err:
        raise CheckpointError(f"the target split does not fit the checkpoint's model: {err}") from None
    return target, config.to_dict()


def convert_checkpoint(
    ckpt: Checkpoint,
    root: str,
    target: Parallelism,
    config: dict[str, Any],
    *,
    progress: Callable[[int], None] | None = None,
) -> ConversionSummary:
    """Write ``ckpt`` at split ``target`` into ``root`` (a ``--save`` directory) and commit it.

    ``progress(nbytes)`` is called after each tensor. Refuses to overwrite an existing checkpoint of
    the same iteration, so nothing already saved is lost.
    """
    started = time.perf_counter()
    iteration = "release" if os.path.basename(ckpt.path) == "release" else ckpt.iteration
    path = iteration_dir(root, iteration)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"{path} already holds a checkpoint; choose another --save or remove it")
    names = canonical_order(ckpt.tensor_names("all"), lambda name: ckpt.spec(name).owner)
    specs = {name: ckpt.spec(name) for name in names}
    files = _write_tensors(ckpt, path, target, specs, progress)
    kept = _copy_rng_files(ckpt, path, target, files)
    write_manifest(root, iteration, _target_manifest(ckpt, path, target, config, specs, files))
    return ConversionSummary(
        path=path,
        source=ckpt.parallel,
        target=target,
        tensors=len(names),
        bytes=sum(spec.nbytes for spec in specs.values()),
        seconds=time.perf_counter() - started,
        rng_kept=kept,
        rng_total=target.tp * target.pp * target.dp,
    )


def _write_tensors(
    ckpt: Checkpoint,
    path: str,
    target: Parallelism,
    specs: dict[str, TensorSpec],
    progress: Callable[[int], None] | None,
) -> dict[str, Any]:
    """Stream every tensor of ``ckpt``, in ``specs``' order, into ``path`` at ``target``; the file records."""
    with CheckpointWriter(path, target, specs, ckpt.tied) as writer:
        for name, spec in specs.items():
            writer.write(name, ckpt.full_tensor(name))
            if progress is not None:
                progress(spec.nbytes)
        return writer.close()


def _copy_rng_files(ckpt: Checkpoint, path: str, target: Parallelism, files: dict[str, Any]) -> int:
    """Copy the RNG file of every target rank the source also had (recorded in ``files``); their count."""
    kept = 0
    for t in range(target.tp):
        for p in range(target.pp):
            for d in range(target.dp):
                name = rng_file(t, p, d)
                record = ckpt.manifest["files"].get(name)
                if record is None:
                    continue
                ckpt.verify_headers([name])
                with open(os.path.join(ckpt.path, name), "rb") as src:
                    atomic_write(os.path.join(path, name), lambda fh, src=src: shutil.copyfileobj(src, fh))
                files[name] = record
                kept += 1
    return kept


def _target_manifest(
    ckpt: Checkpoint, path: str, target: Parallelism, config, specs, files
) -> dict[str, Any]:
    """The source's manifest at ``target`` (tokenizer copied into ``path``), naming the source split."""
    tokenizer = ckpt.tokenizer
    if tokenizer is not None:
        tokenizer = copy_tokenizer(
            tokenizer["files"],
            path,
            tokenizer["type"],
            **{k: v for k, v in tokenizer.items() if k not in ("type", "files")},
        )
    return {
        **ckpt.manifest,
        "parallel": target.to_json(),
        "model": {
            **ckpt.manifest["model"],
            "config": config,
            "padded_vocab_size": padded_vocab_size(specs, ckpt.vocab_size, target.tp),
        },
        "tokenizer": tokenizer,
        "files": files,
        "extra": {**ckpt.manifest.get("extra", {}), "converted_from": ckpt.parallel.to_json()},
    }

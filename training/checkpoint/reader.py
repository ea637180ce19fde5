"""Reading a checkpoint at any split: :func:`open_checkpoint` and :class:`Checkpoint`.

A reader asks for a tensor by name and names the split it wants (``tp_rank`` of ``tp_size``); the
reader works out which saved pieces overlap that shard, reads only those (only the rows it needs,
along dimension 0, when checksums are not verified) and copies the overlaps into place. The same
call serves a training rank resharding on ``--load``, the offline converter, and tools that want
whole tensors (``full_tensor``, ``iter_full_tensors``). No process group is involved.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from core.transformer.transformer_config import TransformerConfig
from training.checkpoint.files import (
    SAFETENSORS_DTYPES,
    read_header,
    read_piece,
    read_rows_into,
    unflatten_state,
)
from training.checkpoint.format import (
    FORMAT,
    MANIFEST,
    TRACKER,
    CheckpointError,
    Parallelism,
    TensorSpec,
    iteration_dir,
    read_json,
    rng_file,
    split_optimizer_tensor_name,
)

__all__ = ["Checkpoint", "find_checkpoint", "open_checkpoint", "read_tracker"]

V1_FORMAT = "trident-checkpoint-v1"


def read_tracker(root: str) -> int | str | None:
    """The iteration the tracker names (``"release"`` for a release checkpoint), None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise CheckpointError(
            f"checkpoint tracker {path} is corrupt: expected an iteration number, got {text!r}"
        )
    return int(text)


def find_checkpoint(root: str, iteration: int | None = None) -> str | None:
    """The iteration directory to load from ``root``: ``iteration``'s, else the tracker's.

    None when ``root`` holds no checkpoint (missing or empty directory, no tracker); a given
    ``iteration`` that does not exist, or a corrupt tracker, raises :class:`CheckpointError`.
    """
    if iteration is not None:
        path = iteration_dir(root, iteration)
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint for iteration {iteration} in {root}: {path} does not exist")
        return path
    if not os.path.isdir(root):
        return None
    marker = read_tracker(root)
    return None if marker is None else iteration_dir(root, marker)


def complete_checkpoints(root: str, before: int | None = None) -> list[str]:
    """The complete iteration directories of ``root`` (a manifest is written only once every rank's
    files are), newest first; only those before iteration ``before`` when given."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        digits = name.removeprefix("iter_")
        if not (name.startswith("iter_") and digits.isdigit()) or (
            before is not None and int(digits) >= before
        ):
            continue
        if os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(digits), os.path.join(root, name)))
    return [path for _, path in sorted(found, reverse=True)]


def open_checkpoint(path: str, iteration: int | None = None, *, verify: bool = True) -> Checkpoint:
    """Open a checkpoint: ``path`` is a ``--save`` directory (latest, or ``iteration``) or an ``iter_*`` one."""
    if iteration is None and os.path.isfile(os.path.join(path, MANIFEST)):
        return Checkpoint(path, verify=verify)
    found = find_checkpoint(path, iteration)
    if found is None:
        raise CheckpointError(f"no checkpoint in {path}: {os.path.join(path, TRACKER)} is missing")
    return Checkpoint(found, verify=verify)


def load_manifest(path: str) -> dict[str, Any]:
    """The manifest of iteration directory ``path``, checked to be in this format."""
    manifest_path = os.path.join(path, MANIFEST)
    manifest = read_json(manifest_path, "checkpoint manifest")
    version = manifest.get("format")
    if version == V1_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is in the old {V1_FORMAT} format, which records neither the model "
            "config nor how tensors are split, so this version cannot load it; resume it with the "
            "Trident release that wrote it, or start a new run"
        )
    if version != FORMAT:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path} has format {version!r}, expected {FORMAT!r}"
        )
    missing = [k for k in ("iteration", "parallel", "model", "tensors", "files") if k not in manifest]
    if missing:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt: it lacks {missing}")
    return manifest


class Checkpoint:
    """One iteration directory opened for reading; everything it holds, by name, at any split.

    ``verify=False`` skips checksums (``--no-verify-checkpoint``): a reader then reads only the rows it
    needs, where otherwise it reads and verifies every saved piece it needs part of.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = path
        self.verify = verify
        self.manifest = load_manifest(path)
        m = self.manifest
        try:
            self.iteration: int = int(m["iteration"])
            self.parallel = Parallelism.from_json(m["parallel"])
            self.specs: dict[str, TensorSpec] = {k: TensorSpec.from_json(v) for k, v in m["tensors"].items()}
            self.tied: dict[str, dict[str, Any]] = dict(m.get("tied") or {})
            self._pieces: dict[str, dict[int, list[tuple[str, list[int] | None, str | None]]]] = {}
            for file, record in m["files"].items():
                for key, piece in record["pieces"].items():
                    where = (file, piece.get("flat"), piece.get("checksum"))
                    self._pieces.setdefault(key, {}).setdefault(self._tp_rank_of(key, piece), []).append(
                        where
                    )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint manifest {os.path.join(path, MANIFEST)} is corrupt: {err!r}"
            ) from None
        self._headers: dict[str, dict[str, Any]] = {}

    def _tp_rank_of(self, key: str, piece: dict[str, Any]) -> int:
        """The TP shard a piece belongs to: its tag, or 0 for a tensor not split over TP (which a live
        save made before this was fixed tagged with the writing rank's TP rank: an MoE expert's
        optimizer state on TP rank 1)."""
        spec = self.specs.get(key)
        return 0 if spec is not None and spec.partition is None else int(piece.get("tp_rank", 0))

    # -- what the checkpoint describes ----------------------------------------------------------------
    @property
    def config(self):
        """The model's ``TransformerConfig``, at the split this checkpoint was written at."""
        return TransformerConfig.from_dict(self.manifest["model"]["config"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["model"]["vocab_size"])

    @property
    def padded_vocab_size(self) -> int:
        return int(self.manifest["model"]["padded_vocab_size"])

    @property
    def max_sequence_length(self) -> int:
        return int(self.manifest["model"]["max_sequence_length"])

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        """``{"type": ..., "files": {role: absolute path}, ...}`` of the tokenizer copied in, or None."""
        record = self.manifest.get("tokenizer")
        if not record:
            return None
        files = {role: os.path.join(self.path, rel) for role, rel in record.get("files", {}).items()}
        return {**record, "files": files}

    def tensor_names(self, kind: str = "model") -> list[str]:
        """Logical tensors, tied copies left out: ``"model"``, ``"optimizer"`` or ``"all"``."""
        names = [n for n in self.specs if self._tied_source(n) is None]
        if kind == "all":
            return names
        want_optimizer = kind == "optimizer"
        return [n for n in names if (split_optimizer_tensor_name(n) is not None) == want_optimizer]

    def has_tensor(self, name: str) -> bool:
        return name in self.specs or self._tied_source(name) in self.specs

    def spec(self, name: str) -> TensorSpec:
        """How ``name`` is shaped and split (a tied copy is described by its source, owned by its own stage)."""
        if name in self.specs:
            return self.specs[name]
        source = self._tied_source(name)
        if source is None or source not in self.specs:
            raise CheckpointError(f"checkpoint {self.path} has no tensor '{name}'")
        owner = self.tied[self._tied_key(name)]["owner"]
        spec = self.specs[source]
        return TensorSpec(spec.shape, spec.dtype, spec.partition, owner)

    def _tied_key(self, name: str) -> str | None:
        if name in self.tied:
            return name
        split = split_optimizer_tensor_name(name)
        return split[1] if split is not None and split[1] in self.tied else None

    def _tied_source(self, name: str) -> str | None:
        """The tensor a tied copy repeats (``output_layer.weight`` -> the word embedding), else None."""
        key = self._tied_key(name)
        if key is None:
            return None
        return name[: len(name) - len(key)] + self.tied[key]["source"]

    # -- reading ----------------------------------------------------------------------------------------
    def read_shard(self, name: str, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
        """Tensor ``name`` as TP rank ``tp_rank`` of ``tp_size`` holds it (vocabulary padded for that size)."""
        spec = self.spec(name)
        stored = name if name in self._pieces else self._tied_source(name)
        if stored not in self._pieces:
            raise CheckpointError(f"checkpoint {self.path} lists tensor '{name}' but no file holds it")
        if spec.partition is None:
            return self._saved_shard(stored, 0)
        part, saved_tp = spec.partition, self.parallel.tp
        size = spec.shape[part.dim]
        part.check(size, tp_size, f"tensor '{name}'")
        if tp_size == saved_tp:
            return self._saved_shard(stored, tp_rank)
        shape = spec.shard_shape(tp_size)
        wanted = part.segments(size, tp_size, tp_rank)
        padded = sum(length for _, _, length in wanted) < shape[part.dim]
        out = torch.zeros(shape, dtype=spec.dtype) if padded else torch.empty(shape, dtype=spec.dtype)
        saved_rows = spec.shard_shape(saved_tp)[part.dim]
        for rank in range(saved_tp):
            overlaps = []  # (offset in out, offset in the saved shard, length)
            for out_at, start, length in wanted:
                for src_at, src_start, src_length in part.segments(size, saved_tp, rank):
                    lo, hi = max(start, src_start), min(start + length, src_start + src_length)
                    if lo < hi:
                        overlaps.append((out_at + lo - start, src_at + lo - src_start, hi - lo))
            if not overlaps:
                continue
            whole = sum(n for _, _, n in overlaps) == saved_rows
            if part.dim == 0 and self._single_piece(stored, rank) and (whole or not self.verify):
                # rows land straight in place: no buffer, no copy
                runs = sorted(
                    ((src_at, out.narrow(0, out_at, n)) for out_at, src_at, n in overlaps), key=lambda r: r[0]
                )
                self._read_rows_into(stored, rank, runs, verify=whole)
                continue
            first = min(s for _, s, _ in overlaps)
            last = max(s + n for _, s, n in overlaps)
            rows = (first, last) if part.dim == 0 else None
            piece = self._saved_shard(stored, rank, rows)
            base = first if rows else 0
            for out_at, src_at, length in overlaps:
                out.narrow(part.dim, out_at, length).copy_(piece.narrow(part.dim, src_at - base, length))
        return out

    def read_flat_range(self, name: str, tp_rank: int, tp_size: int, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of TP shard ``tp_rank`` of ``tp_size``, flattened row-major: the
        range a distributed-optimizer rank owns (see :mod:`training.checkpoint.live`).

        At the saved TP size only the saved pieces that overlap the range are read (whole pieces
        when checksums are verified, else just their rows that hold the range); at another TP size
        the shard is resharded first.
        """
        spec = self.spec(name)
        numel = math.prod(spec.shard_shape(tp_size))
        if not 0 <= start <= end <= numel:
            raise CheckpointError(
                f"checkpoint {self.path}: range [{start}, {end}) is outside tensor '{name}' "
                f"({numel} elements in TP shard {tp_rank} of {tp_size})"
            )
        if spec.partition is not None and tp_size != self.parallel.tp:
            return self.read_shard(name, tp_rank, tp_size).reshape(-1)[start:end].clone()
        stored = name if name in self._pieces else self._tied_source(name)
        rank = tp_rank if spec.partition is not None else 0
        pieces = self._pieces.get(stored, {}).get(rank)
        if not pieces:
            raise CheckpointError(
                f"checkpoint {self.path} has no piece of tensor '{name}' for TP rank {rank}"
            )
        out = torch.empty(end - start, dtype=spec.dtype)
        covered = 0
        for file, span, digest in pieces:
            lo, hi = span if span is not None else (0, numel)
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            shape = (hi - lo,) if span is not None else spec.shard_shape(self.parallel.tp)
            header = self._header(file)
            self._check_piece(file, header, stored, shape, spec.dtype)
            row = math.prod(shape[1:])
            first, last = (a - lo) // row, -(-(b - lo) // row)
            piece = read_piece(
                os.path.join(self.path, file),
                header,
                stored,
                expected_checksum=digest if self.verify else None,
                rows=(first, last) if shape else None,
            ).reshape(-1)
            out[a - start : b - start] = piece[a - lo - first * row : b - lo - first * row]
            covered += b - a
        if covered != end - start:
            raise CheckpointError(
                f"checkpoint {self.path}: the pieces of tensor '{name}' for TP rank {rank} cover "
                f"{covered} of the {end - start} elements in [{start}, {end})"
            )
        return out

    def full_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, vocabulary unpadded."""
        shard = self.read_shard(name, 0, 1)
        spec = self.spec(name)
        if spec.partition is not None and shard.shape[spec.partition.dim] != spec.shape[spec.partition.dim]:
            shard = shard.narrow(spec.partition.dim, 0, spec.shape[spec.partition.dim]).contiguous()
        return shard

    def iter_full_tensors(self, kind: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` one at a time, so memory stays near one tensor."""
        for name in self.tensor_names(kind):
            yield name, self.full_tensor(name)

    def read_rng_state(self, tp_rank: int, pp_rank: int, dp_rank: int) -> Any | None:
        """The RNG states rank (tp, pp, dp) saved, or None when that rank did not exist in this split."""
        name = rng_file(tp_rank, pp_rank, dp_rank)
        record = self.manifest["files"].get(name)
        if record is None:
            return None
        path = os.path.join(self.path, name)
        header = self._header(name)
        tensors = {
            key: read_piece(
                path, header, key, expected_checksum=piece.get("checksum") if self.verify else None
            )
            for key, piece in record["pieces"].items()
        }
        try:
            return unflatten_state(tensors, header["__metadata__"]["skeleton"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint file {path} is corrupt: bad RNG skeleton ({err!r})") from None

    def verify_headers(self, names: list[str] | None = None) -> None:
        """Check the files are whole and their headers match the manifest (all files, or ``names``)."""
        for name in self.manifest["files"] if names is None else names:
            self._header(name)

    # -- internals ---------------------------------------------------------------------------------------
    def _header(self, file: str) -> dict[str, Any]:
        if file not in self._headers:
            record = self.manifest["files"].get(file) if self.verify else {"bytes": None}
            self._headers[file] = read_header(os.path.join(self.path, file), record)
        return self._headers[file]

    def _single_piece(self, name: str, tp_rank: int) -> bool:
        pieces = self._pieces[name].get(tp_rank) or []
        return len(pieces) == 1 and pieces[0][1] is None

    def _read_rows_into(self, name: str, tp_rank: int, runs, *, verify: bool) -> None:
        file, _, digest = self._pieces[name][tp_rank][0]
        spec = self.spec(name)
        header = self._header(file)
        self._check_piece(file, header, name, spec.shard_shape(self.parallel.tp), spec.dtype)
        checked = digest if (verify and self.verify) else None
        read_rows_into(os.path.join(self.path, file), header, name, runs, expected_checksum=checked)

    def _saved_shard(self, name: str, tp_rank: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """TP shard ``tp_rank`` as saved (or its rows ``[a, b)``), assembled from flat pieces if need be."""
        pieces = self._pieces[name].get(tp_rank)
        if not pieces:
            raise CheckpointError(
                f"checkpoint {self.path} has no piece of tensor '{name}' for TP rank {tp_rank}"
            )
        spec = self.spec(name)
        shape = spec.shard_shape(self.parallel.tp)
        if len(pieces) == 1 and pieces[0][1] is None:
            file, _, digest = pieces[0]
            header = self._header(file)
            self._check_piece(file, header, name, shape, spec.dtype)
            return read_piece(
                os.path.join(self.path, file),
                header,
                name,
                expected_checksum=digest if self.verify else None,
                rows=rows,
            )
        flat = torch.empty(math.prod(shape), dtype=spec.dtype)
        covered = 0
        for file, span, digest in sorted(pieces, key=lambda p: (p[1] or [0])[0]):
            start, end = span if span is not None else (0, flat.numel())
            header = self._header(file)
            self._check_piece(file, header, name, (end - start,), spec.dtype)
            if start != covered:
                break
            checked = digest if self.verify else None
            read_rows_into(
                os.path.join(self.path, file), header, name, [(0, flat[start:end])], expected_checksum=checked
            )
            covered = end
        if covered != flat.numel():
            raise CheckpointError(
                f"checkpoint {self.path}: the pieces of tensor '{name}' for TP rank {tp_rank} cover "
                f"elements [0, {covered}) of {flat.numel()}"
            )
        full = flat.reshape(shape)
        return full if rows is None else full[rows[0] : rows[1]]

    def _check_piece(self, file: str, header: dict, name: str, shape: tuple, dtype: torch.dtype) -> None:
        info = header.get(name)
        path = os.path.join(self.path, file)
        if info is None:
            raise CheckpointError(f"checkpoint file {path} has no tensor '{name}'")
        if tuple(info["shape"]) != tuple(shape) or info["dtype"] != SAFETENSORS_DTYPES.get(dtype):
            raise CheckpointError(
                f"checkpoint file {path}: tensor '{name}' is {info['dtype']} {tuple(info['shape'])}, "
                f"but the manifest describes {dtype} {tuple(shape)}"
            )

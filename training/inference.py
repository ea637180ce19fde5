"""A checkpoint made ready for generation: its model in eval mode and its own tokenizer.

The checkpoint may have been saved at any TP/PP/VPP split. The model is rebuilt from the config the
checkpoint records, at TP = the current tensor-parallel group's size (1 without a process group)
and PP = 1, and every parameter is read through :meth:`Checkpoint.read_shard`, which reshards in
memory: the files are never rewritten. Training-only settings are switched off for inference
(dropout, recomputation, sequence parallelism).

    loaded = load_for_generation("runs/ckpt")
    ids = loaded.tokenizer.tokenize("Hello")
    result = generate(loaded.model, ids, max_new_tokens=32, vocab_size=loaded.vocab_size, eos_id=loaded.eos_id)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.pipeline_parallel.schedule_rules import DEFAULT_SCHEDULE
from core.tensor_parallel import tp_rank, tp_world_size
from core.transformer.initialization import logical_tensors
from core.transformer.transformer_config import TransformerConfig
from models.gpt.gpt_model import GPTModel
from training.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from training.tokenizer import Tokenizer, build_tokenizer

__all__ = ["LoadedModel", "checkpoint_tokenizer", "inference_config", "load_for_generation"]

INFERENCE_OVERRIDES: dict[str, Any] = {
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,  # every rank holds every expert (MoE)
    "virtual_pipeline_model_parallel_size": None,
    "pipeline_model_parallel_layout": None,
    "pipeline_schedule": DEFAULT_SCHEDULE,
    "sequence_parallel": False,
    "perform_initialization": False,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}


@dataclass
class LoadedModel:
    """The model (eval mode, no gradients), its tokenizer, and the sizes generation needs."""

    model: GPTModel
    tokenizer: Tokenizer
    checkpoint: Checkpoint

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.checkpoint.max_sequence_length

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's end-of-sequence id (its end-of-document id when it has no EOS); None if neither."""
        for attribute in ("eos", "eod"):
            value = getattr(self.tokenizer, attribute, None)
            if value is not None and value >= 0:
                return int(value)
        return None


def inference_config(ckpt: Checkpoint, tensor_model_parallel_size: int = 1) -> TransformerConfig:
    """The checkpoint's config at TP = ``tensor_model_parallel_size``, PP = 1, for inference."""
    try:
        return TransformerConfig.from_dict(
            ckpt.manifest["model"]["config"],
            tensor_model_parallel_size=tensor_model_parallel_size,
            **INFERENCE_OVERRIDES,
        )
    except ValueError as err:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: its model cannot run at tensor-parallel size "
            f"{tensor_model_parallel_size}: {err}"
        ) from None


def checkpoint_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The tokenizer copied into the checkpoint (``iter_*/tokenizer/``), built as training built it."""
    record = ckpt.tokenizer
    if record is None:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds no tokenizer (its manifest has no 'tokenizer' record)"
        )
    files = record.get("files", {})
    vocab_size = record.get("vocab_size")
    if record["type"] == "NullTokenizer" and vocab_size is None:
        vocab_size = ckpt.vocab_size - 1  # NullTokenizer's vocabulary is its ids plus the EOD after them
    try:
        return build_tokenizer(
            record["type"],
            files.get("tokenizer_model"),
            vocab_size=vocab_size,
            vocab_file=files.get("vocab_file"),
            merge_file=files.get("merge_file"),
        )
    except (ValueError, OSError) as err:
        raise CheckpointError(f"checkpoint {ckpt.path}: cannot build its tokenizer: {err}") from None


def load_for_generation(path: str, iteration: int | None = None, *, verify: bool = True) -> LoadedModel:
    """Open checkpoint ``path`` (latest iteration, or ``iteration``) and load it for generation.

    Under an initialised tensor-parallel group each rank loads its shard; otherwise TP = 1.
    """
    ckpt = open_checkpoint(path, iteration, verify=verify)
    tokenizer = checkpoint_tokenizer(ckpt)
    tp = tp_world_size()
    config = inference_config(ckpt, tp)
    model = GPTModel(config, ckpt.vocab_size, ckpt.max_sequence_length)
    rank = tp_rank()
    with torch.no_grad():
        for name, param in logical_tensors(model.named_parameters()):  # an expert slice by slice
            if not ckpt.has_tensor(name):
                raise CheckpointError(f"checkpoint {ckpt.path} has no tensor '{name}'")
            param.copy_(ckpt.read_shard(name, rank, tp))
    model.eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, ckpt)

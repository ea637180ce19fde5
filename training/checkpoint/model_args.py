"""Model flags and the ``--load`` checkpoint: take them from it, or check they agree with it.

Megatron's ``--use-checkpoint-args`` builds the model from the checkpoint's own description: every
model flag the user did not give is taken from the checkpoint, and one they gave that contradicts
it is an error naming both values. Without it, any model flag (given or defaulted) that contradicts
the checkpoint is the same error, before a process group or a model exists, rather than a shape
mismatch later. Both run on every rank and read only the manifest.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from core.transformer.moe.moe_config import parse_moe_layer_freq
from training.arguments.schema import BY_DEST, flag_name
from training.checkpoint import CheckpointError, find_checkpoint
from training.checkpoint.reader import load_manifest

__all__ = ["check_checkpoint_args", "checkpoint_model_args", "load_checkpoint_args"]


def _manifest(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    path = find_checkpoint(args.load, args.ckpt_step) if args.load else None
    return None if path is None else (path, load_manifest(path))


def checkpoint_model_args(manifest: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The model (and tokenizer) flags, by dest, that describe the checkpoint's model.

    Only dests this command line has are returned, so flags added later join in by being declared.
    """
    config = manifest["model"]["config"]
    heads, groups = config["num_attention_heads"], config["num_query_groups"]
    activation = config["activation_func"]
    values: dict[str, Any] = {
        "num_layers": config["num_layers"],
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["ffn_hidden_size"],
        "num_attention_heads": heads,
        "kv_channels": config["kv_channels"],
        "group_query_attention": groups != heads,
        "normalization": config["normalization"],
        "add_bias_linear": config["add_bias_linear"],
        "add_qkv_bias": config["add_qkv_bias"],
        "position_embedding_type": config["position_embedding_type"],
        "untie_embeddings_and_output_weights": config["untie_embeddings_and_output_weights"],
        "swiglu": config["gated_linear_unit"] and activation == "silu",
        "openai_gelu": activation == "openai_gelu",
        "rotary_base": config["rotary_base"],
        "rotary_percent": config["rotary_percent"],
        "layernorm_epsilon": config["layernorm_epsilon"],
        "apply_layernorm_1p": config.get("layernorm_zero_centered_gamma", False),
        "rope_scaling": config.get("rope_scaling", False),
        "rope_scaling_factor": config.get("rope_scaling_factor", 8.0),
        "max_position_embeddings": manifest["model"]["max_sequence_length"],
    }
    if groups != heads:
        values["num_query_groups"] = groups
    values |= _moe_args(config)
    saved_args = manifest.get("args") or {}  # a run's flags; a converted or imported model has none
    values["seq_length"] = saved_args.get("seq_length") or manifest["model"]["max_sequence_length"]
    return {dest: value for dest, value in values.items() if hasattr(args, dest)}


def _moe_args(config: dict[str, Any]) -> dict[str, Any]:
    """The MoE model flags of a checkpoint's config (a dense model: no experts)."""
    freq = config.get("moe_layer_freq", 1)
    return {
        "num_moe_experts": config.get("num_moe_experts"),
        "moe_ffn_hidden_size": config.get("moe_ffn_hidden_size")
        or (config["ffn_hidden_size"] if config.get("num_moe_experts") else None),  # the expert's width
        "moe_layer_pattern": str(freq) if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]",
        "moe_router_topk": config.get("moe_router_topk", 2),
        "moe_router_pre_softmax": config.get("moe_router_pre_softmax", False),
        "moe_router_topk_scaling_factor": config.get("moe_router_topk_scaling_factor"),
        "moe_shared_expert_intermediate_size": config.get("moe_shared_expert_intermediate_size"),
        "moe_shared_expert_gate": config.get("moe_shared_expert_gate", False),
    }


def _same_layer_pattern(ours: str, saved: str, num_layers: int) -> bool:
    """``--moe-layer-freq`` values that pick the same layers ("2" and "[1,0,1,0]" for 4 layers)."""

    def layers(text: str) -> list[bool]:
        freq = parse_moe_layer_freq(text)
        return (
            [i % freq == 0 for i in range(num_layers)] if isinstance(freq, int) else [bool(v) for v in freq]
        )

    return layers(ours) == layers(saved)


def _tokenizer_args(manifest: dict[str, Any], path: str, given: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tokenizer flags; a ``--tokenizer-type`` given takes none of another type's files.

    A NullTokenizer has N + 1 ids (the end-of-document id is N), so a checkpoint of V ids means
    ``--vocab-size V - 1``, whatever tokenizer it was trained with.
    """
    record = manifest.get("tokenizer") or {}
    kind = given.get("tokenizer_type", record.get("type"))
    values: dict[str, Any] = {}
    if record.get("type") and kind == record["type"]:
        values["tokenizer_type"] = record["type"]
        values |= {role: os.path.join(path, rel) for role, rel in record.get("files", {}).items()}
    if kind == "NullTokenizer":
        values["vocab_size"] = manifest["model"]["vocab_size"] - 1
    return values


_DROPOUT = ("hidden_dropout", "attention_dropout")
"""Taken from the checkpoint too: an imported LLaMA records 0, which the flags' 0.1 would change."""


def load_checkpoint_args(args: argparse.Namespace) -> None:
    """With ``--use-checkpoint-args``: set every model, dropout and tokenizer flag not given from the checkpoint.

    The checkpoint then stands for the model-size flags, so the tiny demo is off, as it would be had
    the user typed them: the values it filled in go back to Megatron's defaults, and the flags Megatron
    requires (``--micro-batch-size``, ``--train-iters``, ``--lr``) must be given. Call before
    ``validate_args``, so that derived values come from the checkpoint's sizes. What was taken (the
    dropout always, the rest where it differs from the flag's default) is left in
    ``args.checkpoint_args_taken`` for the startup report's one line.
    """
    if not getattr(args, "use_checkpoint_args", False):
        return
    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load: the checkpoint to take the model flags from")
    found = _manifest(args)
    if found is None:
        raise CheckpointError(
            f"--use-checkpoint-args: no checkpoint in {args.load} to take the model flags from"
        )
    path, manifest = found
    given = set(getattr(args, "explicit_args", ()))
    if getattr(args, "using_default_model", False):
        for dest in args.tiny_demo_filled:
            setattr(args, dest, BY_DEST[dest].default)
        args.using_default_model, args.tiny_demo_filled = False, {}
        args.tiny_demo_off_by = [flag_name("use_checkpoint_args")]
    values = checkpoint_model_args(manifest, args)
    values |= {d: manifest["model"]["config"][d] for d in _DROPOUT if d in manifest["model"]["config"]}
    values |= _tokenizer_args(manifest, path, {d: getattr(args, d) for d in given})
    taken = {dest: value for dest, value in values.items() if dest not in given and hasattr(args, dest)}
    for dest, value in taken.items():
        setattr(args, dest, value)
    shown = {d: v for d, v in taken.items() if d in _DROPOUT or v != BY_DEST[d].default}
    args.checkpoint_args_taken = {"path": path, "values": shown}


def check_checkpoint_args(args: argparse.Namespace) -> argparse.Namespace:
    """Raise one ValueError naming every model flag that contradicts the ``--load`` checkpoint.

    Call after ``validate_args`` (derived sizes filled in). A missing checkpoint passes: the run then
    starts from scratch.
    """
    if not args.load:
        return args
    try:
        found = _manifest(args)
    except CheckpointError:  # a corrupt tracker: the load says so, or a restart falls back
        return args
    if found is None:
        return args
    path, manifest = found
    given = set(getattr(args, "explicit_args", ()))
    conflicts = []
    learned = args.position_embedding_type == "learned_absolute"
    for dest, saved in checkpoint_model_args(manifest, args).items():
        ours = getattr(args, dest)
        if dest == "seq_length" or (dest == "max_position_embeddings" and not learned):
            continue  # free to change: they shape no tensor
        if dest == "num_query_groups" and not args.group_query_attention:
            continue
        if dest == "moe_layer_pattern" and _same_layer_pattern(ours, saved, args.num_layers):
            continue
        if dest == "moe_ffn_hidden_size" and ours is None and args.num_moe_experts:
            ours = args.ffn_hidden_size  # the expert's width defaults to the MLP's
        if ours != saved:
            how = "" if dest in given else " (default)"
            conflicts.append(f"{flag_name(dest)} {ours}{how} but the checkpoint has {saved}")
    vocabulary = _vocabulary_conflict(args, manifest, path)
    if conflicts:
        hint = (
            "drop the flag(s) to use the checkpoint's values"
            if args.use_checkpoint_args
            else "pass the checkpoint's values, or --use-checkpoint-args to take every model flag from it"
        )
        raise ValueError(f"--load {path} holds another model: " + "; ".join(conflicts) + f"; {hint}")
    if vocabulary:
        raise ValueError(vocabulary)
    return args


def _vocabulary_conflict(args: argparse.Namespace, manifest: dict[str, Any], path: str) -> str | None:
    """A NullTokenizer whose N + 1 ids are not the checkpoint's vocabulary, said with the fix."""
    if args.tokenizer_type != "NullTokenizer" or args.vocab_size is None:
        return None
    saved, size = manifest["model"]["vocab_size"], args.vocab_size
    if size + 1 == saved:
        return None
    fixes = [f"pass --vocab-size {saved - 1}"]
    record = manifest.get("tokenizer") or {}
    if record.get("type") not in (None, "NullTokenizer"):
        files = " ".join(
            f"{flag_name(r)} {os.path.join(path, f)}" for r, f in record.get("files", {}).items()
        )
        fixes.append(
            f"the checkpoint's tokenizer ({flag_name('tokenizer_type')} {record['type']} {files})".strip()
        )
    if args.use_checkpoint_args:
        fixes.append("leave --vocab-size out to take it from the checkpoint")
    return (
        f"--load {path} holds a model with {saved} token ids, but --tokenizer-type NullTokenizer --vocab-size "
        f"{size} has {size + 1} (ids 0-{size - 1} and the end-of-document id {size}): " + ", or ".join(fixes)
    )

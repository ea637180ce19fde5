"""Self-describing, resharding checkpoints: the library behind ``--save``/``--load`` and the tools.

Layout on disk (Megatron's outer layout)::

    DIR/latest_checkpointed_iteration.txt            the bare iteration number; written last
    DIR/iter_0000100/manifest.json                   config, vocabulary, tensor specs, piece index, checksums
    DIR/iter_0000100/model_tp{t}_pp{p}.safetensors   weights: TP shard t of the tensors pipeline rank p holds
    DIR/iter_0000100/optim_tp{t}_pp{p}_dp{d}.safetensors   optimizer state by parameter name: DP rank 0's,
                                                     or each DP rank's own flat ranges (distributed optimizer)
    DIR/iter_0000100/rng_tp{t}_pp{p}_dp{d}.safetensors     RNG states of every rank
    DIR/iter_0000100/tokenizer/                      the tokenizer's files, copied in

Reading (any split, no process group)::

    from training.checkpoint import open_checkpoint
    ckpt = open_checkpoint("runs/ckpt")                  # latest iteration; iteration=N for another
    ckpt.config, ckpt.vocab_size, ckpt.tokenizer         # TransformerConfig, sizes, copied tokenizer files
    for name, tensor in ckpt.iter_full_tensors():        # whole tensors, vocabulary unpadded
        ...
    shard = ckpt.read_shard("output_layer.weight", tp_rank=1, tp_size=4)

Writing from full tensors at a chosen split::

    config = llama_config(..., tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    specs, tied = gpt_tensor_specs(config, vocab_size, max_sequence_length)   # every tensor, any order
    write_checkpoint(out, ((n, full[n]) for n in specs), specs=specs, tied=tied,
                     parallelism=parallelism_of(config), config=config.to_dict(),
                     vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                     tokenizer_type="GPTSentencePieceTokenizer", tokenizer_files={"tokenizer_model": path})

See :mod:`training.checkpoint.format` for what the manifest holds. A live run saves through
:class:`training.checkpoint.async_save.CheckpointSaver` (synchronously, or written in the background
with ``--async-save``; :mod:`training.checkpoint.save` and :mod:`training.checkpoint.staging`).
"""

from training.checkpoint.convert import ConversionSummary, convert_checkpoint, parallelism_of, target_split
from training.checkpoint.files import flatten_state, remove_stale_temp_files, unflatten_state
from training.checkpoint.format import (
    FORMAT,
    MANIFEST,
    TRACKER,
    CheckpointError,
    Parallelism,
    Partition,
    TensorSpec,
    iteration_dir,
)
from training.checkpoint.reader import Checkpoint, find_checkpoint, open_checkpoint, read_tracker
from training.checkpoint.specs import gpt_tensor_specs, tied_tensors
from training.checkpoint.writer import CheckpointWriter, copy_tokenizer, write_checkpoint

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TRACKER",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriter",
    "ConversionSummary",
    "Parallelism",
    "Partition",
    "TensorSpec",
    "convert_checkpoint",
    "copy_tokenizer",
    "find_checkpoint",
    "flatten_state",
    "gpt_tensor_specs",
    "iteration_dir",
    "open_checkpoint",
    "parallelism_of",
    "read_tracker",
    "remove_stale_temp_files",
    "target_split",
    "tied_tensors",
    "unflatten_state",
    "write_checkpoint",
]

"""A rank function for RankPool: logits of saved checkpoints run at TP2 x PP2 through the real schedule.

Kept apart from the Hugging Face tests so that the spawned ranks, which import the function's
module, do not import ``transformers``.
"""

from __future__ import annotations

import torch


def checkpoint_logits(rank: int, world_size: int, roots, tokens: torch.Tensor, positions: torch.Tensor):
    """Each ``(checkpoint, uses RoPE)`` of ``roots`` loaded at TP2 x PP2 and run forward through the
    pipeline schedule on ``tokens`` (at ``positions`` with RoPE); the last stage's first TP rank
    returns the logits (TP shards gathered, vocabulary unpadded), every other rank None."""
    import torch.distributed as dist

    from core import parallel_state as ps
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from core.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_seed
    from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
    from training.checkpoint import open_checkpoint
    from training.checkpoint.load import load_checkpoint

    ps.initialize_model_parallel(2, 2)
    model_parallel_seed(1234)
    out = []
    for root, rope in roots:
        ckpt = open_checkpoint(root)
        config = type(ckpt.config).from_dict(
            ckpt.manifest["model"]["config"],
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            perform_initialization=False,
        )
        chunks = parallelize_gpt(
            gpt_provider(config, ckpt.vocab_size, ckpt.max_sequence_length), layout=pipeline_layout(config)
        ).modules
        load_checkpoint(root, model_chunks=chunks, finetune=True)
        chunks[0].eval()
        logits = []

        def forward_step(data_iterator, model, rope=rope, logits=logits):
            ids = next(data_iterator)
            output = model(ids, positions if rope else None)

            def keep(output_tensor, logits=logits):
                logits.append(gather_from_tensor_model_parallel_region(output_tensor))
                return output_tensor.sum() * 0, {}

            return output, keep

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([tokens]),
                model=chunks[0],
                num_microbatches=1,
                seq_length=tokens.shape[1],
                micro_batch_size=tokens.shape[0],
                forward_only=True,
            )
        last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        out.append(logits[0][..., : ckpt.vocab_size] if last else None)
    dist.barrier()
    return out

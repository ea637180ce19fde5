"""Pretrain a GPT (or, with the LLaMA flags, a LLaMA) with Trident.

    torchrun --nproc-per-node 4 pretrain_gpt.py --pipeline-model-parallel-size 4
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --data-path my_text_document --tokenizer-model my.model --num-layers 8 --hidden-size 256 ...

With no model or data flags it trains a tiny GPT on the default corpus (the standard library's
docstrings) with Trident's own SentencePiece tokenizer, built and cached on first use. This file is
Megatron's contract: a model provider, a forward step with its loss function, a datasets provider.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from core.parallel_state import ParallelGroups
from core.transformer import TransformerConfig
from models.gpt import GPTModel
from training import get_args, get_tokenizer, pretrain
from training.arguments.config import DEFAULT_SPLIT
from training.arguments.parser import transformer_config_from_args
from training.data import IndexedDataset, build_train_valid_test_datasets, default_tokenizer
from training.data.builder import build_per_split_datasets
from training.data.defaults import default_data_prefix
from training.data.mock_dataset import MockIndexedDataset
from training.faults import ending_the_process, run_main
from training.tokenizer import SENTENCEPIECE_TYPES, build_tokenizer


def _verbose() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def tokenizer_provider(args):
    """The tokenizer the flags name; SentencePiece without a model file is Trident's own (built once)."""
    model = args.tokenizer_model
    if model is None and args.tokenizer_type in SENTENCEPIECE_TYPES:
        model = str(default_tokenizer(verbose=_verbose()))
    return build_tokenizer(
        args.tokenizer_type,
        model,
        vocab_size=args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
    )


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    shared_embedding_weight: torch.nn.Parameter | None = None,
    pg_collection: ParallelGroups | None = None,
) -> GPTModel:
    """One model chunk. ``shared_embedding_weight``: the embedding of an earlier chunk of this rank,
    which the loss chunk's tied output layer uses (ZBV places the first and the last stage together);
    ``pg_collection``: the run's process groups."""
    args = get_args()
    config = TransformerConfig(**transformer_config_from_args(args))
    return GPTModel(
        config,
        get_tokenizer().vocab_size,
        args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        shared_embedding_weight=shared_embedding_weight,
        pg_collection=pg_collection,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token loss as (loss sum, token count, log), Megatron's form.

    The schedule normalises it as ``config.calculate_per_token_loss`` says (per token over the whole
    step, or per microbatch), so this function does not need to know; the log holds (sum, count).
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    return loss_sum, num_tokens.to(torch.int64), {"lm loss": torch.stack([loss_sum, num_tokens]).detach()}


def forward_step(data_iterator, model):
    """Megatron's forward step: stages that hold neither embedding nor loss read no data."""
    tokens = labels = loss_mask = position_ids = None
    if model.pre_process or model.post_process:
        batch = next(data_iterator)
        tokens, labels = batch["tokens"], batch["labels"]
        loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
    output = model(tokens, position_ids, labels=labels)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(args):
    tokenizer = get_tokenizer()
    gbs = args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    train_samples = args.train_samples or args.train_iters * gbs
    num_samples = (train_samples, evaluations * args.eval_iters * gbs, 0)  # no test evaluation
    common = {
        "eod_token": tokenizer.eod,
        "eod_mask_loss": args.eod_mask_loss,
        "cache_dir": args.data_cache_path,
        "vocab_size": tokenizer.vocab_size,
        "open_dataset": partial(IndexedDataset, mmap=args.mmap_bin_files),
    }
    if args.train_data_path is not None:
        paths = (args.train_data_path, args.valid_data_path, args.test_data_path)
        return build_per_split_datasets(paths, args.seq_length, args.seed, num_samples, **common)
    if args.mock_data:
        prefixes = ["mock"]
        common["open_dataset"] = lambda _: MockIndexedDataset(tokenizer.vocab_size, tokenizer.eod)
    else:
        prefixes = args.data_path or [default_data_prefix(tokenizer, verbose=_verbose())]
    return build_train_valid_test_datasets(
        prefixes, args.split or DEFAULT_SPLIT, args.seq_length, args.seed, num_samples, **common
    )


def main(**options):
    """``pretrain()`` with this file's providers, as ``python pretrain_gpt.py`` runs it. ``options`` are
    pretrain's keywords: the tools that train in process pass ``argv=`` and ``iteration_hook=``."""
    return pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        forward_step,
        tokenizer_provider=tokenizer_provider,
        **options,
    )


if __name__ == "__main__":
    # One clear error, printed once for the whole job, with exit code 1 (2 for usage errors); the
    # process ends without the interpreter's finalization (training.faults.end_process says why).
    with ending_the_process():
        run_main(main)

"""A tiny FP8 LLaMA trained by ``pretrain()`` in this process: its losses and final FP8 states, for
the FP8 tests that compare runs (resume and recompute in tests/unit, ``--compile`` in tests/e2e)."""

from __future__ import annotations

import torch

from core.tensor_parallel.fp8 import fp8_state_dict
from tests.support.pretrain_run import pretrain_keeping_models

TINY = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 127 --seed 7 --hidden-dropout 0 --attention-dropout 0 "
    "--num-workers 0 --eval-iters 0 --eval-interval 1000 --log-interval 1 --bf16 --swiglu --lr-decay-iters 6 "
    "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max"
)


IN_BLOCKS = "--hidden-size 128 --ffn-hidden-size 128 --fp8-format e4m3 --fp8-recipe blockwise"
"""The blockwise recipe on :data:`TINY` widened so that every linear layer's features are multiples of 128."""


def fp8_run(flags: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run's losses and, at its end, its FP8 states by name."""
    state, built, _ = pretrain_keeping_models(f"{TINY} {flags}".split())
    return [float(step["lm loss"]) for step in state.losses], fp8_state_dict(built)

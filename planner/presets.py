"""Named models as the Megatron flags that describe them (``--preset``); flags given after override.

The sizes are the published ones; the flag sets follow Megatron-LM's example scripts where one
exists (``examples/gpt3/train_gpt3_175b_distributed.sh``, ``examples/llama/train_llama3_8b_h100_fp8.sh``,
``examples/mixtral/train_mixtral_8x7b_distributed.sh``), including their precision and global batch
size. The LLaMA-3 vocabulary is 128256 tokens, GPT-3's GPT-2 BPE 50257, Mixtral's 32000. As in
Megatron, ``--vocab-size`` is the size *before* the end-of-document token that ``NullTokenizer`` adds,
so the presets give one less; a plan's printed flags then train the same vocabulary with mock data.
"""

from __future__ import annotations

__all__ = ["PRESETS", "preset_flags"]

_LLAMA = (
    "--group-query-attention --num-query-groups 8 --kv-channels 128 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights "
    "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --vocab-size 128255 "
    "--seq-length 8192 --max-position-embeddings 8192"
)

PRESETS: dict[str, str] = {
    "gpt3-175b": (
        "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
        "--max-position-embeddings 2048 --fp16 --vocab-size 50256 --global-batch-size 1536"
    ),
    "llama3-8b": (
        f"{_LLAMA} --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--global-batch-size 128"
    ),
    "llama3-70b": (
        f"{_LLAMA} --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
        "--global-batch-size 512"
    ),
    "llama3-405b": (
        f"{_LLAMA} --num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 "
        "--global-batch-size 2048"
    ),
    "mixtral-8x7b": (
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768 "
        "--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000 "
        "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 "
        "--hidden-dropout 0.0 --bf16 --vocab-size 31999 --global-batch-size 256 "
        "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
        "--moe-token-dispatcher-type alltoall"
    ),
}
"""Preset name -> Megatron flags."""


def preset_flags(name: str) -> list[str]:
    """The flags of a preset; a ValueError naming the known ones otherwise."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is not known; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].split()

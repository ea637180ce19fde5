"""Five of Megatron-LM's example scripts, transcribed: every flag name kept, sizes scaled to 4 CPU ranks.

Sources (Megatron-LM ``examples/``): ``gpt3/train_gpt3_175b_distributed.sh`` (twice: with the
``--rampup-batch-size`` it had before Megatron-LM#4411 and the ``--step-batch-size-schedule`` it has now),
``llama/train_llama3_8b_h100_fp8.sh`` (its mock-data branch), its Megatron-FSDP twin
``megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh`` (the same), ``mixtral/train_mixtral_8x7b_distributed.sh``
and the classic ``pretrain_gpt_distributed_with_mp.sh``. Paths are placeholders filled by the test:
``{data}`` (a corpus preprocessed with the GPT-2 BPE files the test builds), ``{vocab}``, ``{merges}``,
``{spm}`` (a SentencePiece model trained by the test), ``{ckpt}``, ``{tb}``, ``{cache}``.

What Trident does with each flag comes from the coverage table (``training/arguments/schema.py``), never from
this file: ``rejected`` lists the flags a script's run is refused for, ``in_scope`` is the script
without them. ``python -m tools.megatron_examples`` prints the table of the report.
"""

from __future__ import annotations

import shlex

from training.arguments.schema import BY_OPTION, COVERAGE, NO_EFFECT, REJECTED_PREFIXES, coverage_of

# 175B: TP 8 x PP 16, 96 layers of 12288 -> TP 2 x PP 2, 4 layers of 64; 500000 iterations -> 3. The
# batch ramp (the script before Megatron-LM#4411: 16 16 5859375 up to 1536) -> 2, 4 and 8 in 3 iterations.
_GPT3_175B = """
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
        --attention-backend auto
        --micro-batch-size 1 --global-batch-size 8 --rampup-batch-size 2 2 6 --train-iters 3
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
        --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 3
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
        --data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
        --log-interval 1 --save-interval 3 --eval-interval 3 --save {ckpt} --load {ckpt} --eval-iters 1
        --tensorboard-dir {tb}
    """
_LLAMA3_8B_MODEL = """
        --use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4
        --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
        --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
        --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
        --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
        --micro-batch-size 1 --global-batch-size 8 --train-samples 24 --lr-decay-samples 24 --lr-warmup-samples 8
        --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine
"""
"""The model, batch and learning rate the LLaMA-3 8B scripts share (the FP8 one and its Megatron-FSDP twin)."""
SCRIPTS: dict[str, str] = {
    "gpt3_175b": _GPT3_175B,
    # The same script as Megatron-LM has it now; transcribed, it differs only in the batch ramp: the step
    # schedule ("0:16 2.4B:320 ... 12B:1536" tokens at 2048 a sample, with --global-batch-size 1536) -> 2, 4
    # and 8 from 0, 2 and 6 samples of 32 tokens.
    "gpt3_175b_step": _GPT3_175B.replace(
        "--rampup-batch-size 2 2 6", '--step-batch-size-schedule "0:2 64:4 192:8"'
    ),
    # LLaMA-3 8B, FP8, mock data: 32 layers of 4096, 8192 tokens, 1.95e9 samples -> 2 layers of 64, 32 tokens,
    # 24 samples (3 iterations of 8); vocabulary 128256 -> 512.
    "llama3_8b": _LLAMA3_8B_MODEL
    + """
        --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
        --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
        --exit-duration-in-mins 235
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
        --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
        --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {cache}
        --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
        --num-workers 1
        --log-interval 1 --eval-iters 1 --eval-interval 3 --save-interval 3 --log-throughput --profile
        --profile-step-start 1 --profile-step-end 2 --ckpt-format torch_dist --distributed-timeout-minutes 60
        --save {ckpt} --load {ckpt} --tensorboard-dir {tb}
    """,
    # Mixtral 8x7B (the script is already small): 2 experts over EP 2 -> 4 ranks; 256 tokens -> 32.
    "mixtral_8x7b": """
        --use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 64 --num-layers 2
        --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 2 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope
        --swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2
        --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
        --num-experts 2 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
        --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer --tokenizer-model {spm} --mock-data --split 99990,8,2
        --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 3 --min-lr 1.0e-5 --weight-decay 0.1
        --clip-grad 1.0 --bf16
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
        --use-distributed-optimizer --sequence-parallel
        --eval-iters 1 --no-load-optim --no-load-rng
    """,
    # LLaMA-3 8B under Megatron-FSDP (ZeRO-3), FP8, mock data: the same scaling as llama3_8b; nsys's own
    # options (its profile command line) are not Megatron's flags and stay out.
    "llama3_8b_fsdp": _LLAMA3_8B_MODEL
    + """
        --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion
        --no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
        --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
        --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor --use-nccl-ub
        --fsdp-double-buffer --fsdp-manual-registration
        --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
        --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {cache}
        --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
        --num-workers 1
        --log-interval 1 --eval-iters 1 --eval-interval 3 --save-interval 3 --log-throughput --logging-level 20
        --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}
        --profile --profile-step-start 1 --profile-step-end 2 --profile-ranks 0 --record-memory-history
    """,
    # The classic 345M with TP 2 x PP 2 on 8 GPUs -> 4 ranks; 24 layers of 1024 -> 4 of 64.
    "gpt_345m_mp": """
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64
        --num-attention-heads 4 --micro-batch-size 2 --global-batch-size 4 --seq-length 32
        --max-position-embeddings 32 --train-iters 3 --lr-decay-iters 3 --save {ckpt} --load {ckpt}
        --data-path {data} --vocab-file {vocab} --merge-file {merges} --data-impl mmap --split 949,50,1
        --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
        --clip-grad 1.0 --lr-warmup-fraction .01 --checkpoint-activations --log-interval 1 --save-interval 3
        --eval-interval 3 --eval-iters 1 --fp16
    """,
}
SOURCES = {
    "gpt3_175b": "examples/gpt3/train_gpt3_175b_distributed.sh (before Megatron-LM#4411)",
    "gpt3_175b_step": "examples/gpt3/train_gpt3_175b_distributed.sh",
    "llama3_8b": "examples/llama/train_llama3_8b_h100_fp8.sh",
    "mixtral_8x7b": "examples/mixtral/train_mixtral_8x7b_distributed.sh",
    "llama3_8b_fsdp": "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    "gpt_345m_mp": "examples/pretrain_gpt_distributed_with_mp.sh",
}
NPROC = 4


def tokens(name: str, **paths: str) -> list[str]:
    """The script's command line, placeholders filled (``x`` where a path is not given)."""
    fill = {k: paths.get(k, "x") for k in ("data", "vocab", "merges", "spm", "ckpt", "tb", "cache")}
    return shlex.split(SCRIPTS[name].format(**fill))


def _flags_with_values(argv: list[str]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            out.append((token, []))
        else:
            out[-1][1].append(token)
    return out


def _refusal(option: str, values: list[str]):
    """The coverage entry that refuses this flag (or this value of it), or None if it is accepted."""
    entry = coverage_of(option)
    if entry.rejected:
        return entry
    if values and coverage_of(f"{option} {values[0]}").rejected:
        return coverage_of(f"{option} {values[0]}")
    if entry.only and values and BY_OPTION[option].kind(values[0]) not in entry.only:
        return entry
    return None


def rejected(argv: list[str]) -> list[str]:
    """The flags (``--flag`` or ``--flag value``) of ``argv`` that Trident refuses, in order."""
    out = []
    for option, values in _flags_with_values(argv):
        entry = _refusal(option, values)
        if entry is not None:
            value_specific = option in BY_OPTION and not coverage_of(option).rejected and not entry.only
            out.append(f"{option} {values[0]}" if value_specific else option)
    return out


def in_scope(argv: list[str]) -> list[str]:
    """``argv`` without the flags Trident refuses (and their values)."""
    kept: list[str] = []
    for option, values in _flags_with_values(argv):
        if _refusal(option, values) is None:
            kept += [option, *values]
    return kept


def table() -> list[tuple[str, int, int, str]]:
    """(script, flags, accepted, rejected with reason) per script, as the report shows it."""
    rows = []
    for name in SCRIPTS:
        pairs = _flags_with_values(tokens(name))
        refused: dict[str, list[str]] = {}
        for option, values in pairs:
            entry = _refusal(option, values)
            if entry is not None:
                label = option if not entry.only else f"{option} {values[0]}"
                status = "not supported" if entry.only else entry.status  # a value outside works_only
                refused.setdefault(f"{status}: {entry.reason}", []).append(label)
        no_effect = [o for o, _ in pairs if coverage_of(o).status == NO_EFFECT]
        reasons = "; ".join(f"{', '.join(opts)} ({why})" for why, opts in refused.items())
        rows.append((name, len(pairs), len(pairs) - sum(map(len, refused.values())), reasons, no_effect))
    return rows


if __name__ == "__main__":
    for name, count, accepted, reasons, no_effect in table():
        print(
            f"{SOURCES[name]}: {count} flags, {accepted} accepted ({len(no_effect)} of them with no effect: "
            f"{' '.join(no_effect)}); rejected: {reasons or 'none'}"
        )
    print(f"{len(COVERAGE)} coverage entries, families rejected by prefix: {' '.join(REJECTED_PREFIXES)}")

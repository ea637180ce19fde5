"""The training side of the configuration: every flag that no core config owns, declared once.

Each dataclass is one ``--help`` section (``training/arguments/schema.py`` lists them in Megatron's order);
each field is one flag, named after the field, with its type, Megatron's default and its docstring
as help. After validation each section is an instance holding the run's resolved values
(``run.training``, ``run.checkpointing``, ... of :class:`training.run.Run`), which the loop reads.
Whether a Megatron flag works, has no effect here or is rejected is decided in the coverage table
of ``training/arguments/schema.py``, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.flags import flag

CkptFormat = Literal["torch", "torch_dist", "fsdp_dtensor"]
TokenizerType = Literal[
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
]
LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WsdDecayStyle = Literal["exponential", "linear", "cosine", "minus_sqrt"]
IncrStyle = Literal["constant", "linear", "cosine"]
AttentionBackend = Literal["flash", "fused", "unfused", "local", "auto"]


@dataclass(kw_only=True)
class ModelArgs:
    """Model flags that a ``GPTModel`` or the config builder reads, besides ``TransformerConfig``'s."""

    seq_length: int | None = None
    """Tokens per sample."""
    max_position_embeddings: int | None = None
    """Positions of the learned position embedding (default: --seq-length)."""
    group_query_attention: bool = False
    """Grouped-query attention: --num-query-groups key/value heads shared by the query heads."""
    swiglu: bool = False
    """SwiGLU MLP: a gated linear unit with SiLU (FFN size int(8*hidden/3/64)*64 by default)."""
    openai_gelu: bool = False
    """GELU with the tanh approximation GPT-2 was trained with (Hugging Face's gelu_new), instead
    of the exact erf GELU."""
    apply_layernorm_1p: bool = False
    """Norm weights hold gamma - 1, start at zero and scale by 1 + weight (a zero-centred gamma)."""
    add_position_embedding: bool = flag(
        True,
        name="--no-position-embedding",
        help="No learned position embedding (as Megatron: only with --position-embedding-type rope or none, "
        "which have none anyway).",
    )
    """Add a learned absolute position embedding to the word embedding (with learned_absolute)."""
    attention_backend: AttentionBackend = "auto"
    """Megatron's attention kernel choice (flash, fused, unfused, local, auto)."""
    moe_layer_pattern: str = flag("1", name="--moe-layer-freq", group="mixture of experts")
    """Which layers are MoE layers: N is every N-th (layers 0, N, 2N, ...); a Python-style list
    expression of 0/1 per layer gives the pattern, e.g. "([0]+[1]*23)" or "([1]*3+[0]*1)*3". The
    parsed value is ``args.moe_layer_freq`` (an int or a list, as in Megatron) and the config's field."""


@dataclass(kw_only=True)
class TrainingArgs:
    """Batch sizes, run length, stopping and the switches Megatron keeps with them."""

    micro_batch_size: int | None = None
    """Samples per microbatch per data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per step over all data-parallel ranks (default: --micro-batch-size x data-parallel size,
    or the last batch of --step-batch-size-schedule); with a ramp, the full batch it grows to."""
    rampup_batch_size: list[int] | None = None
    """Megatron's batch-size ramp, START INCR SAMPLES: the global batch starts at START and grows by INCR
    up to --global-batch-size, one increment every SAMPLES / ((global - START) / INCR) samples, then
    stays there (e.g. 16 16 5859375 with --global-batch-size 1536)."""
    step_batch_size_schedule: str | None = None
    """The global batch by tokens consumed, as Megatron: THRESHOLD:BATCH pairs such as "0:768 250B:1536
    500B:3072" (K/M/B/T suffixes; a threshold in tokens is divided by --seq-length into samples; the
    first is 0). Not with --rampup-batch-size."""
    train_iters: int | None = None
    """Training iterations."""
    train_samples: int | None = None
    """Training samples, instead of --train-iters (iterations = samples / --global-batch-size, or as
    Megatron counts them along a batch ramp); the learning-rate schedule is then given in samples too."""
    log_interval: int = 100
    """Iterations between log lines."""
    exit_interval: int | None = None
    """Save and exit after an iteration divisible by this."""
    exit_duration_in_mins: int | None = None
    """Save and exit once the run has lasted this many minutes (all ranks agree on when)."""
    exit_signal_handler: bool = False
    """On SIGTERM, save a checkpoint and exit."""
    check_for_nan_in_loss_and_grad: bool = flag(False, negation="--no-check-for-nan-in-loss-and-grad")
    """Raise on a NaN/inf loss or gradient, as Megatron does; without it Trident counts and skips the step."""
    max_consecutive_skipped_iterations: int = 10
    """Stop the run after this many consecutive skipped (NaN/inf) steps."""
    rerun_mode: Literal["disabled", "validate_results", "report_stats"] = "validate_results"
    """Megatron's result validation (training/faults/validation.py): validate_results reruns a step whose
    checked results look wrong (the checks below) on the same inputs and RNG to tell a transient fault
    from a reproducible one; report_stats reruns every step and reports how reproducible it is;
    disabled checks without rerunning."""
    check_for_spiky_loss: bool = False
    """With --rerun-mode validate_results: a loss at least 10x the largest of the first 100 is suspect
    (rerun, then training goes on)."""
    check_for_large_grads: bool = False
    """With --rerun-mode validate_results: a gradient norm at least 10x the largest of the first 100 is
    suspect (rerun, then training goes on)."""
    error_injection_rate: int = 0
    """With --rerun-mode validate_results: inject a --error-injection-type result into every N-th
    validated step (0: never), for drills and tests."""
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """What --error-injection-rate injects: a result that reruns reproduce everywhere, one that a rerun does
    not reproduce, or one reproduced on the same devices only."""
    result_rejected_tracker_filename: str | None = None
    """Append one line per rejected result and per rerun verdict to this file (checked writable at start)."""
    accumulate_allreduce_grads_in_fp32: bool = flag(False, group="mixed precision")
    """Accumulate and reduce gradients in fp32 (with --fp16; --bf16 does so unless --grad-reduce-in-bf16)."""
    megatron_fsdp_main_params_dtype: Literal["fp32", "bf16", "fp16", "auto"] = flag(
        "fp32", group="mixed precision"
    )
    """With --use-megatron-fsdp, the dtype of the weights the optimizer steps: fp32 main copies, or for a
    bf16 model bf16 (``auto``, or bf16 named), which steps the bf16 weights themselves with no main copy and
    keeps Adam's moments in bf16 (4 bytes a parameter of optimizer state instead of 12). fp16 is not built."""
    megatron_fsdp_main_grads_dtype: Literal["fp32", "bf16", "fp16", "auto"] = flag(
        "auto", group="mixed precision"
    )
    """With --use-megatron-fsdp, the dtype gradients accumulate in: fp32, or the model's own (as
    --grad-reduce-in-bf16 for a bf16 model). ``auto`` leaves it to --grad-reduce-in-bf16 and
    --accumulate-allreduce-grads-in-fp32: fp32 for a bf16 model, Megatron's rule for its buckets (Megatron-FSDP's
    own ``auto`` keeps the model's dtype: give bf16 for that)."""
    manual_gc: bool = False
    """Disable Python's automatic garbage collector and collect at fixed points instead, the same
    on every rank (at the start, around evaluations and every --manual-gc-interval steps)."""
    manual_gc_interval: int = 0
    """With --manual-gc, collect garbage every this many steps (0: never between steps)."""
    manual_gc_eval: bool = flag(
        True, name="--no-manual-gc-eval", help="With --manual-gc, do not collect garbage around evaluations."
    )
    """With --manual-gc, collect garbage before and after each evaluation."""
    use_mcore_models: bool = False
    """Megatron: use the Megatron Core model implementation."""
    masked_softmax_fusion: bool = flag(
        True, name="--no-masked-softmax-fusion", help="Megatron: do not fuse scaling, masking and softmax."
    )
    """Megatron: fuse attention-score scaling, masking and softmax in one kernel."""
    moe_router_dtype: Literal["fp32"] | None = flag(None, group="mixture of experts")
    """Megatron: the dtype the router's gate is computed in (Trident's always computes in fp32)."""
    moe_router_score_function: Literal["softmax"] = flag("softmax", group="mixture of experts")
    """Megatron: the router's score function (Trident's is the softmax)."""
    moe_permute_fusion: bool = flag(False, group="mixture of experts")
    """Megatron: fused token permutation kernels (Transformer Engine)."""
    moe_router_fusion: bool = flag(False, group="mixture of experts")
    """Megatron: fused router top-k and loss kernels (Transformer Engine)."""
    moe_shared_expert_overlap: bool = flag(False, group="mixture of experts")
    """Megatron: run the shared experts on a side stream, overlapped with the token dispatch."""
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Megatron: call torch.cuda.empty_cache() every iteration (0 off, 1 moderate, 2 aggressive)."""
    checkpoint_activations: bool = False
    """Megatron's old spelling of full activation recomputation: --recompute-granularity full
    --recompute-method uniform --recompute-num-layers 1."""
    recompute_activations: bool = False
    """Recompute the attention core in the backward pass (--recompute-granularity selective)."""
    profile: bool = False
    """Profile steps --profile-step-start to --profile-step-end with torch.profiler, writing one
    Chrome/TensorBoard trace per rank of --profile-ranks (into --tensorboard-dir, or ./profile)."""
    profile_step_start: int = 10
    """With --profile: the iteration after which profiling starts (iterations start+1 .. end)."""
    profile_step_end: int = 12
    """With --profile: the iteration after which profiling stops."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """With --profile: the global ranks that write a trace."""
    use_pytorch_profiler: bool = False
    """Megatron: use torch.profiler rather than nsys for --profile (Trident always does)."""
    record_memory_history: bool = False
    """Megatron: on CUDA, record the caching allocator's history from before the model is built on the
    ranks of --profile-ranks, and dump it at every log step to --memory-snapshot-path with the rank
    before the extension (``snapshot_0.pickle``; read it with pytorch.org/memory_viz). Off CUDA the run
    says once that it needs CUDA."""
    memory_snapshot_path: str = "snapshot.pickle"
    """Megatron: where --record-memory-history dumps its snapshots (the rank goes before the extension)."""


@dataclass(kw_only=True)
class LearningRateArgs:
    """The learning-rate schedule (the peak and floor are ``OptimizerConfig.lr`` and ``min_lr``)."""

    lr_decay_style: LrDecayStyle = "linear"
    """Decay after warm-up."""
    lr_decay_iters: int | None = None
    """Iterations to decay over (default: --train-iters)."""
    lr_warmup_iters: int = 0
    """Iterations of linear warm-up."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)."""
    override_opt_param_scheduler: bool = flag(False, name="--override-opt_param-scheduler")
    """On --load, follow the learning-rate flags, not the checkpoint's schedule."""
    use_checkpoint_opt_param_scheduler: bool = flag(False, name="--use-checkpoint-opt_param-scheduler")
    """On --load, keep the checkpoint's learning-rate schedule, whatever the flags say."""
    lr_decay_samples: int | None = None
    """With --train-samples: samples to decay over (default: --train-samples)."""
    lr_warmup_samples: int = 0
    """With --train-samples: samples of linear warm-up."""
    lr_wsd_decay_style: WsdDecayStyle = "exponential"
    """With --lr-decay-style WSD: the shape of the final anneal."""
    lr_wsd_decay_iters: int | None = None
    """With --lr-decay-style WSD: iterations of the final anneal (the end of the decay iterations)."""
    lr_wsd_decay_samples: int | None = None
    """With --lr-decay-style WSD and --train-samples: samples of the final anneal."""
    decoupled_lr: float | None = None
    """A separate peak learning rate for the input embedding and the output layer."""
    decoupled_min_lr: float | None = None
    """With --decoupled-lr: their floor (default: --min-lr)."""
    start_weight_decay: float | None = flag(None, group="regularization")
    """Weight decay at the start of a --weight-decay-incr-style ramp (default: --weight-decay)."""
    end_weight_decay: float | None = flag(None, group="regularization")
    """Weight decay at the end of the run after a --weight-decay-incr-style ramp (default: --weight-decay)."""
    weight_decay_incr_style: IncrStyle = flag("constant", group="regularization")
    """Weight decay from --start-weight-decay to --end-weight-decay over the run."""


@dataclass(kw_only=True)
class CheckpointingArgs:
    """Where checkpoints go, how often, and what is restored from them."""

    save: str | None = None
    """Checkpoint directory to save to."""
    load: str | None = None
    """Checkpoint directory to resume from."""
    save_interval: int | None = flag(None, aliases=("--persistent-save-interval",))
    """Iterations between checkpoints (default: --train-iters, i.e. once at the end)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on: the state is copied into host
    memory (allocated at the first save, reused) and a thread writes it. One save is in flight at a
    time; the next save and the end of training wait for it; the tracker is written last, once every
    rank's files are whole. A failed background write stops training at the next iteration."""
    no_load_optim: bool | None = None
    """Do not load the optimizer and scheduler state."""
    no_load_rng: bool | None = None
    """Do not load the random number generator states."""
    finetune: bool = False
    """Load the weights only and start at iteration 0."""
    ckpt_step: int | None = None
    """Load this iteration of --load instead of the one its tracker file names."""
    ckpt_format: CkptFormat = "torch_dist"
    """Megatron's checkpoint format; every value means Trident's one format (safetensors and JSON,
    resharded on load to any split and any data-parallel sharding strategy)."""
    use_checkpoint_args: bool = False
    """Take the model and tokenizer flags from the --load checkpoint; a flag given that contradicts
    it is an error naming both values."""
    exit_on_missing_checkpoint: bool = False
    """Stop with an error, instead of starting from scratch, when --load holds no checkpoint."""
    verify_checkpoint: bool = flag(
        True,
        name="--no-verify-checkpoint",
        help="Trident: load without verifying the checksum of every tensor read.",
    )
    """Verify the checksum of every tensor read from a checkpoint."""


@dataclass(kw_only=True)
class ValidationArgs:
    """How often and how long to evaluate on the validation split."""

    eval_interval: int = 1000
    """Iterations between evaluations."""
    eval_iters: int = 100
    """Global batches per evaluation (0: no evaluation)."""


DATA_SOURCE_FLAGS = ("--data-path", "--mock-data", "--train-data-path")
"""The flags that each give the training data; at most one, and any of them turns the tiny demo off."""
DEFAULT_SPLIT = "969,30,1"
"""Megatron's legacy --split when a --data-path (or the built-in corpus) has none."""


@dataclass(kw_only=True)
class DataArgs:
    """The training data: indexed datasets, their split and the loss mask."""

    data_path: list[str] | None = None
    """Dataset prefixes, or 'weight prefix weight prefix ...' (default: the built-in corpus)."""
    split: str | None = None
    """Train,valid,test weights, e.g. 969,30,1 (default with --data-path or --mock-data: 969,30,1)."""
    eod_mask_loss: bool = False
    """Mask the loss on end-of-document tokens."""
    train_data_path: list[str] | None = None
    """Training data only, as --data-path (no --split): prefixes, or 'weight prefix ...'."""
    valid_data_path: list[str] | None = None
    """Validation data only, as --data-path (no --split)."""
    test_data_path: list[str] | None = None
    """Test data only, as --data-path (no --split)."""
    mock_data: bool = False
    """Train on generated token sequences (Megatron's mock dataset) instead of files."""
    data_cache_path: str | None = None
    """Directory for the dataset index caches (default: a cache directory beside each dataset)."""
    mmap_bin_files: bool = flag(
        True, name="--no-mmap-bin-files", help="Read the .bin data files with plain reads, not memory maps."
    )
    """Memory-map the .bin data files (else read each sample with a file read)."""
    num_workers: int = 2
    """Data-loader worker processes per rank (0: read in the training process)."""
    dataloader_type: Literal["single", "cyclic"] = "single"
    """single: Megatron's sequential sampler; cyclic: a random order per epoch, sharded by data-parallel rank."""
    data_impl: Literal["mmap"] = "mmap"
    """Megatron's old choice of indexed-dataset implementation (memory-mapped is the only one left)."""
    create_attention_mask_in_dataloader: bool = flag(
        True,
        name="--no-create-attention-mask-in-dataloader",
        help="Megatron: do not build attention masks in the data loader.",
    )
    """Megatron: build an attention mask for every sample in the data loader."""


@dataclass(kw_only=True)
class TokenizerArgs:
    """The tokenizer the data was preprocessed with."""

    tokenizer_type: TokenizerType | None = None
    """Tokenizer (default without a data source: Trident's own SentencePiece model)."""
    tokenizer_model: str | None = None
    """SentencePiece model file, or a local Hugging Face tokenizer folder for HuggingFaceTokenizer
    (default: Trident's own SentencePiece model, built for the default corpus)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary (vocab.json); with --merge-file and no --tokenizer-type: GPT2BPETokenizer."""
    merge_file: str | None = None
    """GPT-2 BPE merges (merges.txt)."""
    tiktoken_pattern: str | None = None
    """Megatron: the TikTokenizer split pattern (v1 or v2)."""
    vocab_size: int | None = None
    """Vocabulary size, for NullTokenizer."""


@dataclass(kw_only=True)
class LoggingArgs:
    """Experiment tracking."""

    wandb_project: str = ""
    """W&B project ('' = no W&B)."""
    wandb_exp_name: str = ""
    """W&B run name."""
    wandb_save_dir: str = ""
    """Local directory of the W&B run."""
    log_throughput: bool = False
    """Megatron: log throughput per GPU."""
    logging_level: int | None = None
    """Megatron: the level of Python's root logger (10 debug, 20 info, 30 warning); the environment's
    MEGATRON_LOGGING_LEVEL when not given. Trident's own lines are printed, not logged: this sets what
    the libraries (torch, transformers) log."""
    timeline_dir: str | None = None
    """Trident: record what every rank does in the pipeline schedule (forward, backward, weight
    gradient, each send and receive) for the --timeline-iters iterations, and write a Chrome trace
    (timeline.json) and a picture (timeline.png, with matplotlib) into this directory; the log then
    gives the measured bubble next to the simulator's."""
    timeline_iters: list[int] = field(default_factory=list)
    """Trident: iterations the timeline records (default: the last one of the run)."""
    peak_tflops: float | None = None
    """Trident: peak TFLOP/s of one device, for MFU in the log line (default: a table of known GPUs;
    none on CPU)."""
    log_params_norm: bool = False
    """Compute the parameters' global L2 norm every iteration and log it (a collective per step)."""
    log_memory_to_tensorboard: bool = False
    """Write the memory statistics (mem-* keys) to W&B every iteration."""
    tensorboard_dir: str | None = None
    """Write the logged scalars as TensorBoard events here (beside W&B, if on)."""
    log_straggler: bool = False
    """Megatron: at each log step, gather every rank's compute time per iteration and name the slowest
    and fastest ranks, with their throughput against the median rank's."""
    disable_straggler_on_startup: bool = False
    """Megatron: start with straggler detection off (turn it on through --straggler-ctrlr-port)."""
    straggler_ctrlr_port: int = 65535
    """Megatron: rank 0's switch for straggler detection, on 127.0.0.1 only (an HTTP GET of / turns it
    on or off; /on and /off set it)."""
    straggler_minmax_count: int = 1
    """Megatron: how many of the slowest and of the fastest ranks the straggler report names."""


@dataclass(kw_only=True)
class DistributedArgs:
    """Process-group options besides the parallel sizes (those are ``ModelParallelConfig``'s)."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Decoder layers per virtual pipeline stage (interleaved 1F1B)."""
    num_virtual_stages_per_pipeline_rank: int | None = None
    """Virtual stages (model chunks) per pipeline rank (interleaved 1F1B)."""
    distributed_backend: Literal["nccl", "gloo"] | None = None
    """Process-group backend (default: nccl with GPUs, gloo without; nccl without CUDA falls back to gloo)."""
    distributed_timeout_minutes: int = 10
    """Timeout of every collective; a rank silent this long ends the job, named in the error."""
    nccl_ub: bool = flag(False, name="--use-nccl-ub")
    """Megatron-FSDP: register the gather buffers with NCCL (user buffers; no effect here)."""
    fsdp_double_buffer: bool = False
    """Megatron-FSDP: double-buffer the gather memory, for --use-nccl-ub (no effect here)."""
    fsdp_manual_registration: bool = False
    """Megatron-FSDP: register the NCCL user buffers by hand (no effect here)."""
    megatron_fsdp_version: Literal[1] = 1
    """Megatron-FSDP's implementation: Trident's sharding is the first (Megatron's default), built on its
    own buckets; Megatron's second is refused."""


@dataclass(kw_only=True)
class ConfigFileArgs:
    """Trident: flags from a file."""

    config: str | None = None
    """YAML or TOML file of flags (keys with dashes or underscores); the command line overrides it."""

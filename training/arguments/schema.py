"""The configuration schema: every flag, derived from the typed config dataclasses, plus its coverage.

The dataclasses in ``SECTIONS`` are the single source. Each field is one flag: its name gives the
flag (``num_layers`` -> ``--num-layers``) and the attribute on ``args``, its annotation the type
(``Literal[...]`` gives the choices, ``list[str]`` takes several values), its default Megatron's
default, its docstring the ``--help`` text and its class the ``--help`` section. Core configs
(``TransformerConfig``, ``OptimizerConfig``, ...) own the fields they use; ``training/arguments/config.py``
owns the rest. ``COVERAGE`` says, for the Megatron flags that are not simply "declared and read",
whether they work, are accepted with no effect here, or are rejected, and why.

How to
======

Declare a new flag: add a field, with a docstring, to the dataclass that uses it::

    @dataclass(kw_only=True)
    class TrainingArgs:
        log_timers_to_tensorboard: bool = False
        \"\"\"Write the step timers to TensorBoard.\"\"\"

That is all: ``--log-timers-to-tensorboard`` exists, ``--help`` lists it under the class's section,
``--config`` files accept it, the validated run holds it (``run.training.log_timers_to_tensorboard``
of :class:`training.run.Run`, and ``get_args().log_timers_to_tensorboard`` for Megatron-style code),
and a core config with a field of that name receives it. Code must read it: the test
``test_every_accepted_flag_is_read`` (tests/e2e/test_flag_coverage.py) records every field read, on the
namespace and on the typed configs, during a short real run and fails on a flag nobody read; if
yours is read only on a path that run does not take, add the flag to that test's command line. Megatron's odd spellings and other
exceptions go in the field's metadata, through ``core.flags``::

    add_bias_linear: bool = flag(True, name="--disable-bias-linear", help="No biases ...")
    save_interval: int | None = flag(None, aliases=("--persistent-save-interval",))
    hidden_size: int = flag(0, group="network size")                   # another --help section
    num_query_groups: int | None = flag(None, cli_default=1)           # the flag's default differs
    deallocate_pipeline_outputs: bool = not_a_flag(True)               # set by code only

A bool field whose default is True gives a flag that stores False (``--no-<name>`` unless named
otherwise); its ``help=`` says what the flag does, since the docstring says what the field does.
Fields whose type a command line cannot spell (callables, dtypes, hook objects) are never flags.

Mark a Megatron flag "accepted, no effect here": declare its field as above, then add it to
``COVERAGE`` with ``no_effect("why")``. ``--help`` says so and the run reports it once at start.

Reject a Megatron flag: add it to ``COVERAGE`` with ``unsupported("why")`` (Trident will not build
it) or ``not_yet("what is being built")``; no field is needed (a whole family can be rejected by
prefix in ``REJECTED_PREFIXES``). ``"--flag value"`` rejects one value of a working flag
(``"--tokenizer-type TikTokenizer"``), and ``works_only((1,), "why")`` accepts only those values.

Flip a "not supported yet" flag to working: declare its field (if it has none), read it, and change
its ``not_yet(...)`` entry to ``works()`` (for a value: delete the entry and add the value to the
field's ``Literal``). Nothing else changes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.flags import FLAG_METADATA_KEY, flag_default, flag_spec, option_name
from core.model_parallel_config import ModelParallelConfig
from core.optimizer.optimizer import OptimizerConfig
from core.transformer.transformer_config import TransformerConfig
from training.arguments import config as training_config

__all__ = [
    "BY_DEST",
    "BY_OPTION",
    "COVERAGE",
    "FLAGS",
    "GROUPS",
    "REJECTED_PREFIXES",
    "SECTIONS",
    "Coverage",
    "Flag",
    "coverage_of",
    "flag_name",
]

GROUPS = (
    "network size",
    "mixture of experts",
    "regularization",
    "training",
    "initialization",
    "learning rate",
    "checkpointing",
    "mixed precision",
    "distributed",
    "validation",
    "data and dataloader",
    "tokenizer",
    "logging",
    "config file",
)
"""``--help`` sections, in Megatron's order."""

SECTIONS: tuple[tuple[type, str], ...] = (
    (ModelParallelConfig, "distributed"),
    (TransformerConfig, "network size"),
    (training_config.ModelArgs, "network size"),
    (OptimizerConfig, "regularization"),
    (DistributedDataParallelConfig, "distributed"),
    (training_config.TrainingArgs, "training"),
    (training_config.LearningRateArgs, "learning rate"),
    (training_config.CheckpointingArgs, "checkpointing"),
    (training_config.ValidationArgs, "validation"),
    (training_config.DataArgs, "data and dataloader"),
    (training_config.TokenizerArgs, "tokenizer"),
    (training_config.LoggingArgs, "logging"),
    (training_config.DistributedArgs, "distributed"),
    (training_config.ConfigFileArgs, "config file"),
)
"""The config classes that declare flags, each with its default ``--help`` section. A field name
that several classes share (``bf16``, ``lr``, ``seed``) is one flag, declared by the first."""


@dataclass(frozen=True)
class Flag:
    """One flag as the parser, config files and ``args`` see it."""

    dest: str
    """Attribute on ``args`` and field name in the owning config."""
    options: tuple[str, ...]
    """Its spellings, canonical first."""
    kind: type
    """bool, int, float or str (of each value, for a list)."""
    default: Any
    choices: tuple | None
    nargs: str | None
    """"*" for a list of values."""
    help: str
    group: str
    owner: type
    negation: str | None = None
    """A second option that stores the opposite bool."""

    @property
    def name(self) -> str:
        return self.options[0]

    def stores(self, option: str) -> bool:
        """The value a bool option stores when given."""
        stores_true = self.default is not True
        return stores_true if option != self.negation else not stores_true


# --------------------------------------------------------------------------------------------------
# Flags from fields
# --------------------------------------------------------------------------------------------------


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` and its dataclass bases, whitespace collapsed."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _annotation(cls: type, name: str, annotation: Any) -> Any:
    """The field's type, evaluated in the module of the class that declares it (None if it cannot be)."""
    if not isinstance(annotation, str):
        return annotation
    owner = next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))
    try:
        return eval(annotation, vars(sys.modules[owner.__module__]))
    except (NameError, AttributeError, SyntaxError, TypeError):
        return None


def _command_line_type(tp: Any) -> tuple[type, tuple | None, str | None] | None:
    """(kind, choices, nargs) of a type a command line can spell, else None."""
    origin, params = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [p for p in params if p is not type(None)]
        return _command_line_type(rest[0]) if len(rest) == 1 else None
    if origin is Literal:
        kinds = {type(p) for p in params}
        return (kinds.pop(), params, None) if len(kinds) == 1 else None
    if origin is list and len(params) == 1 and params[0] in (str, int, float):
        return params[0], None, "*"
    if tp in (bool, int, float, str):
        return tp, None, None
    return None


def _flag(cls: type, group: str, field: dataclasses.Field, doc: str | None) -> Flag | None:
    spec = flag_spec(field)
    if not spec.is_flag or not field.init:
        return None
    where = f"{cls.__name__}.{field.name}"
    cli_type = _command_line_type(_annotation(cls, field.name, field.type))
    if cli_type is None:
        if field.metadata.get(FLAG_METADATA_KEY) is not None:
            raise TypeError(f"{where}: its type {field.type!r} cannot be given on a command line")
        return None
    kind, choices, nargs = cli_type
    default = flag_default(field)
    # A flag that stores False needs help= saying what the flag does (the docstring says what the
    # field does); test_every_shown_flag_has_help_text holds both to account.
    help_text = spec.help if spec.help or (kind is bool and default is True) else doc
    return Flag(
        dest=field.name,
        options=(option_name(field), *spec.aliases),
        kind=kind,
        default=default,
        choices=choices,
        nargs=nargs,
        help=(help_text or "").replace("``", ""),
        group=spec.group or group,
        owner=cls,
        negation=spec.negation,
    )


def _collect() -> tuple[Flag, ...]:
    flags: dict[str, Flag] = {}
    options: dict[str, str] = {}
    for cls, group in SECTIONS:
        docs = _field_docs(cls)
        for field in dataclasses.fields(cls):
            if field.name in flags:
                continue  # declared by an earlier class (bf16, lr, seed, ...)
            made = _flag(cls, group, field, docs.get(field.name))
            if made is None:
                continue
            for option in (*made.options, *filter(None, [made.negation])):
                if option in options:
                    raise ValueError(f"{option} is declared twice: by {options[option]} and {made.dest}")
                options[option] = made.dest
            flags[made.dest] = made
    return tuple(flags.values())


FLAGS: tuple[Flag, ...] = _collect()
BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
BY_OPTION: dict[str, Flag] = {o: f for f in FLAGS for o in (*f.options, *filter(None, [f.negation]))}


def flag_name(dest: str) -> str:
    """The canonical flag (e.g. ``--num-layers``) of the attribute ``dest``."""
    return BY_DEST[dest].name


# --------------------------------------------------------------------------------------------------
# Coverage of Megatron's flags
# --------------------------------------------------------------------------------------------------

WORKS, NO_EFFECT, NOT_YET, UNSUPPORTED = "works", "no effect", "not supported yet", "not supported"


@dataclass(frozen=True)
class Coverage:
    """What Trident does with one Megatron flag."""

    status: str
    """WORKS, NO_EFFECT, NOT_YET or UNSUPPORTED."""
    reason: str = ""
    only: tuple = ()
    """With WORKS: the only values accepted (others are rejected with ``reason``)."""

    @property
    def rejected(self) -> bool:
        return self.status in (NOT_YET, UNSUPPORTED)


def works() -> Coverage:
    return Coverage(WORKS)


def works_only(values: tuple, reason: str) -> Coverage:
    return Coverage(WORKS, reason, values)


def no_effect(reason: str) -> Coverage:
    return Coverage(NO_EFFECT, reason)


def not_yet(reason: str) -> Coverage:
    return Coverage(NOT_YET, reason)


def unsupported(reason: str) -> Coverage:
    return Coverage(UNSUPPORTED, reason)


_MOE = (
    "this MoE option is not implemented (Trident's MoE: top-k softmax routing, aux_loss/seq_aux_loss "
    "and z-loss balancing, capacity with dropping or padding, shared experts, alltoall or allgather "
    "dispatch, experts whole on each expert-parallel rank)"
)
_ONE_FORMAT = (
    "Trident writes one checkpoint format (safetensors and JSON, resharded on load to any split); "
    "--ckpt-format torch and torch_dist both mean it"
)
_FSDP_NOT_YET = (
    "Trident shards over data parallelism with --use-megatron-fsdp --data-parallel-sharding-strategy "
    "{optim,optim_grads,optim_grads_params}, --num-distributed-optimizer-instances and "
    "--outer-dp-sharding-strategy; this knob of it is not built"
)
_NVIDIA_RESILIENCY = (
    "it needs NVIDIA's resiliency package and NCCL; Trident restarts under torchrun --max-restarts, at any "
    "world size, resuming from the latest complete checkpoint"
)
_FSDP_INSTEAD = (
    "use --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params (Trident's ZeRO-3 on its "
    "own buckets, which composes with tensor and pipeline parallelism)"
)
_TIKTOKEN = (
    "Trident has no tiktoken tokenizer; save the tokenizer as a Hugging Face tokenizer folder and use "
    "--tokenizer-type HuggingFaceTokenizer"
)

COVERAGE: dict[str, Coverage] = {
    # (a) read and working: keys of Megatron's run-control and parallel flags that need a note here.
    "--distributed-backend": works(),
    "--manual-gc": works(),
    "--manual-gc-interval": works(),
    "--no-manual-gc-eval": works(),
    "--exit-duration-in-mins": works(),
    "--distributed-timeout-minutes": works(),
    "--ckpt-step": works(),
    "--use-checkpoint-args": works(),
    "--exit-on-missing-checkpoint": works(),
    "--async-save": works(),
    **dict.fromkeys(
        (
            "--fp16",
            "--loss-scale",
            "--initial-loss-scale",
            "--min-loss-scale",
            "--loss-scale-window",
            "--hysteresis",
            "--use-distributed-optimizer",
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy",
            "--num-distributed-optimizer-instances",
            "--outer-dp-sharding-strategy",
            "--overlap-param-gather",
            "--grad-reduce-in-bf16",
            "--ddp-bucket-size",
            "--log-num-zeros-in-grad",
        ),
        works(),
    ),
    "--profile": works(),
    "--checkpoint-activations": works(),
    "--context-parallel-size": works(),
    "--cp-comm-type": works(),
    "--expert-model-parallel-size": works(),
    "--rampup-batch-size": works(),
    "--step-batch-size-schedule": works(),
    "--moe-router-load-balancing-type sinkhorn": unsupported(_MOE),
    "--moe-router-load-balancing-type global_aux_loss": unsupported(_MOE),
    "--moe-router-load-balancing-type quantile_balancing": unsupported(_MOE),
    "--moe-token-dispatcher-type flex": unsupported(_MOE),
    "--moe-router-dtype fp64": unsupported(_MOE),
    "--moe-router-score-function sigmoid": unsupported(_MOE),
    "--moe-router-score-function sqrtsoftplus": unsupported(_MOE),
    # (b) accepted, no effect on Trident's code paths
    "--fp8-interval": no_effect("Megatron ignores it too: scales follow the recipe every step"),
    "--use-mcore-models": no_effect("Trident has one model implementation, built like Megatron Core's"),
    "--no-masked-softmax-fusion": no_effect("softmax is one PyTorch call, never a fused kernel"),
    "--attention-backend": no_effect("attention is PyTorch's scaled_dot_product_attention"),
    "--empty-unused-memory-level": no_effect("the CUDA cache is left to PyTorch"),
    "--no-create-attention-mask-in-dataloader": no_effect("attention is causal without a mask tensor"),
    "--log-throughput": no_effect("TFLOP/s per GPU and tokens/s are always in the log line"),
    "--use-pytorch-profiler": no_effect("--profile always uses torch.profiler"),
    "--tiktoken-pattern": no_effect("only a TikTokenizer reads it, and Trident has none"),
    "--data-impl": no_effect("indexed datasets are always memory-mapped (Megatron-LM has dropped the flag)"),
    "--ckpt-format": no_effect(
        "torch, torch_dist and fsdp_dtensor all write Trident's own format, which any sharding strategy "
        "and any split can load"
    ),
    "--moe-router-dtype": no_effect("the router's gate is always computed in fp32"),
    "--moe-router-score-function": no_effect("the router's score function is the softmax"),
    "--moe-permute-fusion": no_effect("tokens are permuted with index operations, never a fused kernel"),
    "--moe-router-fusion": no_effect("routing and its losses are plain PyTorch, never a fused kernel"),
    "--moe-shared-expert-overlap": no_effect("the shared experts run before the router, on the same stream"),
    # (c) not supported: out of scope
    "--tokenizer-type TikTokenizer": unsupported(_TIKTOKEN),
    "--cross-entropy-fusion-impl te": unsupported(
        "Trident uses no Transformer Engine: --cross-entropy-fusion-impl native (the default) or linear "
        "(the output layer fused in, logits never held)"
    ),
    **dict.fromkeys(
        ("--ckpt-format zarr", "--ckpt-format torch_dcp"),
        unsupported(_ONE_FORMAT),
    ),
    **dict.fromkeys(
        (
            "--cuda-graph-impl transformer_engine",
            "--external-cuda-graph",
        ),  # the second: Megatron's older name
        unsupported(
            "Trident uses no Transformer Engine: use --cuda-graph-impl local (each decoder layer's forward and "
            "backward captured per input shape)"
        ),
    ),
    "--cuda-graph-impl full_iteration": not_yet(
        "the whole forward-backward in one CUDA graph is not built; --cuda-graph-impl local captures each "
        "decoder layer"
    ),
    "--use-torch-fsdp2": unsupported(_FSDP_INSTEAD),
    "--torch-fsdp2-no-reshard-after-forward": unsupported(_FSDP_INSTEAD),
    "--megatron-fsdp-version": no_effect("Trident's sharding is Megatron-FSDP's first version, its default"),
    "--megatron-fsdp-version 2": unsupported(
        "Trident's Megatron-FSDP is version 1, Megatron's default; " + _FSDP_INSTEAD
    ),
    **dict.fromkeys(
        ("--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration"),
        no_effect(
            "NCCL user buffers, a speed option of Megatron-FSDP's communication; the numbers are the same"
        ),
    ),
    "--inprocess-restart": unsupported(_NVIDIA_RESILIENCY),
    "--enable-ft-package": unsupported(_NVIDIA_RESILIENCY),
}
"""Megatron flags beyond "declared and read": (a) works, (b) accepted with no effect, (c) rejected.
A key "--flag value" rejects one value of a flag that otherwise works."""

REJECTED_PREFIXES: dict[str, Coverage] = {
    "--moe-": unsupported(_MOE),
    "--megatron-fsdp-": not_yet(_FSDP_NOT_YET),
}
"""Whole flag families Trident rejects, by prefix."""


def rejected_values(option: str) -> tuple:
    """Values of ``option`` that the table rejects ("--tokenizer-type TikTokenizer"), of the flag's type."""
    kind = BY_OPTION[option].kind if option in BY_OPTION else str
    return tuple(
        kind(k.split(" ", 1)[1]) for k, c in COVERAGE.items() if k.startswith(option + " ") and c.rejected
    )


def coverage_of(option: str) -> Coverage:
    """The coverage of a flag (or of "--flag value"); a declared flag not in the table simply works,
    whatever family it belongs to (``--moe-router-topk`` works, an undeclared ``--moe-*`` does not)."""
    if option in COVERAGE:
        return COVERAGE[option]
    if option.split(" ")[0] in BY_OPTION:  # a declared flag, or a value of it the table does not reject
        return works()
    for prefix, entry in REJECTED_PREFIXES.items():
        if option.startswith(prefix):
            return entry
    return works()

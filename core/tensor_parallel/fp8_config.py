"""The FP8 fields of a transformer config (Megatron's ``TransformerConfig`` names and flags).

``fp8`` (``--fp8-format``) turns FP8 on for the matrix products of the decoder layers' tensor-parallel
linear layers (``core.tensor_parallel.fp8``); everything else stays in the model's dtype. The recipe
fields follow Megatron's flags one for one. :func:`fp8_problems` checks every combination at
construction, before any rank builds a layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from core.flags import flag, flag_spec, option_name

Fp8Format = Literal["e4m3", "hybrid"]
Fp8RecipeName = Literal["tensorwise", "delayed", "blockwise", "mxfp8", "custom"]
AmaxComputeAlgo = Literal["most_recent", "max"]
FP8_FORMATS = get_args(Fp8Format)
FP8_RECIPES_BUILT = ("tensorwise", "delayed", "blockwise")
AMAX_COMPUTE_ALGOS = get_args(AmaxComputeAlgo)
_GROUP = "mixed precision"

_NOT_BUILT = {
    "mxfp8": "the 'mxfp8' recipe needs Blackwell GPUs (sm100) and is not built in Trident; use --fp8-recipe "
    "tensorwise, delayed or blockwise",
    "custom": "the 'custom' recipe loads a Transformer Engine recipe factory, which Trident does not use; use "
    "--fp8-recipe tensorwise, delayed or blockwise",
}


@dataclass(kw_only=True)
class Fp8Config:
    """FP8 matrix products in the decoder layers' linear layers (all off when ``fp8`` is None)."""

    fp8: Fp8Format | None = flag(
        None,
        name="--fp8-format",
        group=_GROUP,
        help="FP8 matrix products in the decoder layers' linear layers: 'e4m3' (everything in E4M3) or "
        "'hybrid' (E4M3 forward, gradients in E5M2). The embedding, output layer, norms, attention core, "
        "router and loss stay in the model's dtype.",
    )
    """FP8 format: "e4m3" (inputs, weights and gradients in E4M3) or "hybrid" (E4M3 forward, the
    output gradients in E5M2); None keeps every product in the model's dtype."""

    fp8_recipe: Fp8RecipeName | None = flag(None, group=_GROUP)
    """How scales are chosen: "tensorwise" (each tensor's own amax, current scaling), "delayed" (from
    an amax history of earlier steps; the default, as in Megatron) or "blockwise" (DeepSeek-V3's: one
    scale per 1x128 block of inputs and gradients and per 128x128 tile of weights). "mxfp8" and
    "custom" are refused with a line each."""

    fp8_margin: int | None = flag(None, group=_GROUP)
    """Scales are divided by ``2 ** fp8_margin`` (delayed recipe): headroom for growing values (default 0)."""

    fp8_interval: int = flag(1, group=_GROUP, help="Megatron's interval between FP8 scale updates.")
    """Accepted for Megatron's scripts; it changes nothing (Megatron ignores it too)."""

    fp8_amax_history_len: int | None = flag(None, group=_GROUP)
    """Steps of amax history each tensor keeps (delayed recipe; default 1, as in Megatron)."""

    fp8_amax_compute_algo: AmaxComputeAlgo | None = flag(None, group=_GROUP)
    """The amax a delayed scale is computed from: the history's "max", or its "most_recent" entry (the
    default, as in Megatron)."""

    fp8_wgrad: bool = flag(
        True,
        name="--no-fp8-wgrad",
        aliases=("--disable-fp8-wgrad",),
        group=_GROUP,
        help="Keep the weight-gradient products in the model's dtype (honoured with every recipe; "
        "Megatron honours it only with the delayed one).",
    )
    """Compute the weight gradients in FP8 too; False keeps them in the model's dtype."""

    fp8_param_gather: bool = flag(
        False,
        group=_GROUP,
        help="Hold the weights of the FP8 linear layers in FP8 (no 16-bit copy): the distributed optimizer "
        "casts its updated fp32 shards to FP8 and all-gathers FP8 bytes. Needs --use-distributed-optimizer.",
    )
    """The FP8 layers' weights held in E4M3 only (``core.tensor_parallel.fp8_params``), routed MoE
    experts' stacks with one scale per expert."""

    first_last_layers_bf16: bool = flag(False, group=_GROUP)
    """Keep the first ``num_layers_at_start_in_bf16`` and the last ``num_layers_at_end_in_bf16``
    decoder layers out of FP8."""

    num_layers_at_start_in_bf16: int = flag(1, group=_GROUP)
    """With ``first_last_layers_bf16``: decoder layers at the start kept out of FP8."""

    num_layers_at_end_in_bf16: int = flag(1, group=_GROUP)
    """With ``first_last_layers_bf16``: decoder layers at the end kept out of FP8."""

    def layer_in_fp8(self, layer_number: int) -> bool:
        """Whether decoder layer ``layer_number`` (global, 0-based) runs its linear layers in FP8."""
        if self.fp8 is None:
            return False
        if not self.first_last_layers_bf16:
            return True
        num_layers = getattr(self, "num_layers", 0)
        return self.num_layers_at_start_in_bf16 <= layer_number < num_layers - self.num_layers_at_end_in_bf16


MEGATRON_DEFAULTS = {
    "fp8_recipe": "delayed",
    "fp8_margin": 0,
    "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent",
}
"""What a recipe field left None means (Megatron's defaults); None lets a recipe flag given without
--fp8-format be told apart from one left alone."""
_NEED_A_FORMAT = (
    "fp8_recipe",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "first_last_layers_bf16",
    "fp8_param_gather",
)
"""The fields that mean nothing without ``fp8``: set away from their defaults, they are refused."""


def resolved(config: Fp8Config, name: str):
    """Field ``name`` of ``config`` with None read as Megatron's default."""
    value = getattr(config, name)
    return MEGATRON_DEFAULTS[name] if value is None else value


def fp8_problems(config: Fp8Config) -> list[str]:
    """Every invalid FP8 setting of ``config``, each one line naming the flags and values."""
    if config.fp8 is None:
        fields = {field.name: field for field in dataclasses.fields(Fp8Config)}
        given = [
            " or ".join((option_name(fields[name]), *flag_spec(fields[name]).aliases))
            for name in _NEED_A_FORMAT
            if getattr(config, name) != fields[name].default
        ]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            return [f"{', '.join(given)} {verb} --fp8-format (e4m3 or hybrid)"]
        return []
    if config.fp8 not in FP8_FORMATS:
        return [f"--fp8-format {config.fp8!r} is not supported: use e4m3 or hybrid"]
    recipe = resolved(config, "fp8_recipe")
    if recipe in _NOT_BUILT:
        return [_NOT_BUILT[recipe]]
    if recipe not in FP8_RECIPES_BUILT:
        return [f"--fp8-recipe {recipe!r} does not exist: use tensorwise, delayed or blockwise"]
    out = []
    history = resolved(config, "fp8_amax_history_len")
    algo, margin = resolved(config, "fp8_amax_compute_algo"), resolved(config, "fp8_margin")
    if history < 1:
        out.append(f"--fp8-amax-history-len must be >= 1, got {history}")
    if algo not in AMAX_COMPUTE_ALGOS:
        out.append(f"--fp8-amax-compute-algo must be most_recent or max, got {algo!r}")
    if margin < 0:
        out.append(f"--fp8-margin must be >= 0, got {margin}")
    if config.first_last_layers_bf16:
        out += _bf16_layer_problems(config)
    return out


def _bf16_layer_problems(config: Fp8Config) -> list[str]:
    """Megatron's range checks on ``--first-last-layers-bf16``: each count is at most the layers of one
    pipeline stage (the two ranges may overlap: every layer is then kept out of FP8)."""
    num_layers, pp = getattr(config, "num_layers", 0), getattr(config, "pipeline_model_parallel_size", 1)
    limit, out = num_layers // pp, []
    fields = {field.name: field for field in dataclasses.fields(Fp8Config)}
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        value = getattr(config, name)
        if not 0 <= value <= limit:
            out.append(
                f"{option_name(fields[name])} must be in [0, {limit}], the layers per pipeline stage "
                f"(--num-layers {num_layers} // --pipeline-model-parallel-size {pp}), got {value}"
            )
    return out

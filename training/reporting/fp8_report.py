"""What the start of an FP8 run says: the recipe, which decoder layers' linear layers run in FP8 on each
pipeline stage, and why any does not (``--first-last-layers-bf16``, a shape CUDA's FP8 products cannot
take, a microbatch whose tokens are not a multiple of 16).

The facts come from the built model (each layer's ``fp8_kept_out``, each linear layer's ``fp8_state``),
so the report cannot disagree with what runs. The first tensor-, data- and context-parallel rank of
each pipeline stage prints its stage's lines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from core.tensor_parallel.fp8 import SHAPE_MULTIPLE, Fp8Recipe, fp8_states
from core.tensor_parallel.fp8_blockwise import BLOCK
from core.tensor_parallel.fp8_params import held_fp8_weights, held_weight, is_stack
from core.transformer.transformer_config import TransformerConfig

ROUTED_EXPERTS = "mlp.experts."
"""Where a decoder layer's routed experts are (stacked: one linear layer per projection for all of them)."""


def _run_lines(config: TransformerConfig, recipe: Fp8Recipe, tokens_per_microbatch: int) -> list[str]:
    """What the first stage says of the whole run: the recipe, and what keeps products out of FP8."""
    lines = [f"FP8: {recipe.describe()}"]
    if config.params_dtype == torch.float32:  # --fp16 runs the rest in fp16
        lines.append(
            "FP8 without --bf16: the parts that are not FP8 products (embedding, norms, attention, output "
            "layer) run in fp32, which is slow (Megatron-LM#883); add --bf16"
        )
    if recipe.blockwise:
        lines.append(
            "FP8 blockwise: each product is dequantised and multiplied in float32, the recipe's numerics "
            "but not FP8 speed (torch's blockwise kernel is not wired in yet; on an H100 float32 runs at "
            "a fifteenth of the bf16 peak)"
        )
    if getattr(config, "num_moe_experts", None) and not config.moe_grouped_gemm and recipe.wgrad:
        lines.append(
            "FP8: routed experts' tokens are padded with zero rows to multiples of 16 "
            "(--moe-router-padding-for-quantization): their weight gradients run in FP8"
            if config.moe_router_padding_for_quantization
            else "FP8: a routed expert whose tokens are not a multiple of 16 takes its weight gradient in "
            "the model's dtype (--moe-router-padding-for-quantization pads them)"
        )
    if tokens_per_microbatch % SHAPE_MULTIPLE and recipe.wgrad:
        lines.append(
            f"FP8: a microbatch holds {tokens_per_microbatch} tokens per rank, not a multiple of "
            f"{SHAPE_MULTIPLE}: the weight gradients run in the model's dtype"
        )
    return lines


def fp8_report(
    config: TransformerConfig, modules: Sequence[nn.Module], stage: int, tokens_per_microbatch: int
) -> list[str]:
    """The lines of pipeline stage ``stage`` (``modules``: its model chunks); none without FP8.
    ``tokens_per_microbatch``: tokens of one microbatch on one rank (micro batch x sequence / CP)."""
    if config.fp8 is None:
        return []
    recipe = Fp8Recipe.from_config(config)
    lines = _run_lines(config, recipe, tokens_per_microbatch) if stage == 0 else []
    in_fp8, kept_out = [], []
    for chunk in modules:
        for name, module in getattr(chunk, "module", chunk).named_modules():
            number = getattr(module, "layer_number", None)
            if number is None or not hasattr(module, "fp8_kept_out"):
                continue
            if not config.layer_in_fp8(number):
                kept_out.append(f"layer {number} (--first-last-layers-bf16)")
                continue
            in_fp8.append(number)
            experts = sorted({why for n, why in module.fp8_kept_out.items() if n.startswith(ROUTED_EXPERTS)})
            kept_out += [f"layer {number} routed experts: {why}" for why in experts]
            kept_out += [
                f"layer {number} {n}: {why}"
                for n, why in module.fp8_kept_out.items()
                if not n.startswith(ROUTED_EXPERTS)
            ]
    products = sum(1 for _ in fp8_states(modules))
    if in_fp8 or kept_out:
        layers = ", ".join(map(str, in_fp8)) or "none"
        line = f"FP8 on pipeline stage {stage}: {products} linear layers in FP8 in decoder layers {layers}"
        lines.append(line + (f"; in the model's dtype: {'; '.join(kept_out)}" if kept_out else ""))
    if config.fp8_param_gather:
        held = held_fp8_weights(modules)
        stacks = sum(1 for _, param in held if is_stack(param))
        tiled = any(held_weight(param).tiled for _, param in held)
        line = f"FP8 on pipeline stage {stage}: {len(held)} weights held in FP8 (--fp8-param-gather)"
        line += f", one scale per {BLOCK}x{BLOCK} tile" if tiled else ""
        each = "one grid of tiles per expert" if tiled else "one scale per expert"
        lines.append(line + (f"; {stacks} of them routed-expert stacks, {each}" if stacks else ""))
    return lines

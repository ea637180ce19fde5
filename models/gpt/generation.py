"""Autoregressive generation from a GPTModel with a key/value cache, as Hugging Face's ``generate()`` does it.

The prompt goes through the model once (prefill) and fills the cache; each later step feeds only the
token just chosen. The next token is chosen from the last position's logits:

* greedy: the arg-max (the first one on a tie, as ``torch.argmax`` and ``transformers`` pick);
* sampling: the logits are divided by the temperature, then cut to the ``top_k`` largest, then to the
  smallest set whose probability reaches ``top_p`` (the order and the tie rules of ``transformers``'
  ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``), and one token is
  drawn from their softmax with the caller's ``torch.Generator``, so a seed repeats a run.

Generation stops when the end-of-sequence token is chosen (it is kept in the output) or after
``max_new_tokens`` tokens, whichever comes first: ``generate()``'s rule for one sequence.

The model is called as ``model(tokens, inference_context=ctx)`` and must return logits
``[b, s, vocab]``; :func:`generate` takes a ``gather_logits`` hook for a vocabulary split over
tensor-parallel ranks. Padded vocabulary entries beyond ``vocab_size`` are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from core.transformer.inference_context import InferenceContext


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen. ``greedy`` ignores the rest; ``top_k=0`` and ``top_p=1`` are off."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    """``tokens``: the prompt's ids then the generated ones; ``top_logits``: one list per generated
    token of its step's highest raw logits as ``(token id, logit)``, highest first."""

    tokens: list[int]
    prompt_length: int
    top_logits: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p on fp32 logits ``[b, vocab]``; removed entries become -inf."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth_largest = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1.0 - params.top_p
        remove[..., -1] = False  # the most likely token always stays
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scores


def choose_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids ``[b]`` from the last position's logits ``[b, vocab]``."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(warp_logits(logits, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(
    model: Callable[..., torch.Tensor],
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    vocab_size: int,
    eos_id: int | None,
    sampling: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    num_top_logits: int = 0,
    device: torch.device | str | None = None,
    gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> GenerationResult:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (fewer when ``eos_id`` is chosen).

    ``num_top_logits`` > 0 records that many of each step's highest logits (before any warping).
    """
    if not prompt:
        raise ValueError("the prompt has no tokens: generation needs at least one")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    tokens = list(map(int, prompt))
    result = GenerationResult(tokens, len(tokens))
    context = InferenceContext(1, len(tokens) + max_new_tokens)
    step_input = torch.tensor([tokens], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(step_input, inference_context=context)
        context.advance(step_input.shape[1])
        last = logits[:, -1]
        if gather_logits is not None:
            last = gather_logits(last)
        last = last[:, :vocab_size].float()
        if num_top_logits > 0:
            top = torch.topk(last[0], min(num_top_logits, vocab_size))
            result.top_logits.append(list(zip(top.indices.tolist(), top.values.tolist())))
        next_id = choose_next(last, sampling, generator)
        tokens.append(int(next_id[0]))
        if eos_id is not None and tokens[-1] == eos_id:
            break
        step_input = next_id.view(1, 1)
    return result

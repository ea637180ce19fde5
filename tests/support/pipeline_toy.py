"""A small language model built from layout symbols, for schedule tests and benchmarks.

``E`` embedding, ``t`` a residual tanh block, ``L`` final linear head with per-token
cross-entropy. Every parameter is initialised from (seed, name) only, so a stage holds exactly
the weights the whole model holds under the same names, whatever the split.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from core.model_parallel_config import ModelParallelConfig

VOCAB, HIDDEN = 11, 8


def _seeded(name: str, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * 0.5


class ToyStage(nn.Module):
    """One pipeline stage (or, with every symbol, the whole model)."""

    def __init__(
        self,
        config: ModelParallelConfig,
        symbols: list[str],
        decoder_ids: list[int],
        seed: int = 0,
        vp_stage: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.vp_stage = vp_stage
        self.pre_process = "E" in symbols
        self.post_process = "L" in symbols
        self.embedding = nn.Embedding(VOCAB, HIDDEN) if self.pre_process else None
        self.layers = nn.ModuleDict({str(i): nn.Linear(HIDDEN, HIDDEN) for i in decoder_ids})
        self.head = nn.Linear(HIDDEN, VOCAB) if self.post_process else None
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(_seeded(name, seed, tuple(p.shape)))
        self.input_tensor = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, tokens=None, labels=None):
        x = self.embedding(tokens).transpose(0, 1).contiguous() if self.pre_process else self.input_tensor
        for layer in self.layers.values():
            x = x + torch.tanh(layer(x))
        if not self.post_process:
            return x
        logits = self.head(x).transpose(0, 1)  # [b, s, vocab]
        return nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
        ).view_as(labels)


def make_microbatches(
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    variable: bool,
    seed: int = 1,
    vocab: int = VOCAB,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, labels, loss_mask) per microbatch, ids below ``vocab``; the masks drop a quarter of the
    tokens; with ``variable`` the sequence length varies."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(num_microbatches):
        s = seq_length - (i % 3) if variable else seq_length
        tokens = torch.randint(0, vocab, (micro_batch_size, s), generator=gen)
        labels = torch.randint(0, vocab, (micro_batch_size, s), generator=gen)
        mask = (torch.rand(micro_batch_size, s, generator=gen) > 0.25).float()
        mask[0, 0] = 1.0
        batches.append((tokens, labels, mask))
    return batches


def loss_mean(loss_mask, per_token_loss):
    """The 2-tuple contract: a microbatch's mean token loss."""
    loss = (per_token_loss * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def loss_sum(loss_mask, per_token_loss):
    """The 3-tuple contract: summed loss and token count (per-token normalisation)."""
    total = (per_token_loss * loss_mask).sum()
    tokens = loss_mask.sum().to(torch.int64)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.to(total.dtype)])}


def make_forward_step(per_token: bool):
    loss_func = loss_sum if per_token else loss_mean

    def forward_step(data_iterator, model):
        tokens = labels = mask = None
        if model.pre_process or model.post_process:
            tokens, labels, mask = next(data_iterator)
        output = model(tokens, labels=labels)
        return output, functools.partial(loss_func, mask)

    return forward_step


def run_schedule(
    schedule: Callable[..., list[dict]],
    model: nn.Module | list[nn.Module],
    batches: list,
    *,
    seq_length: int,
    micro_batch_size: int = 2,
    per_token: bool = False,
    **options: Any,
) -> list[dict]:
    """``schedule`` (a Megatron ``forward_backward_*`` function) over all of ``batches`` with the forward
    step above; where ``model`` is a list of chunks, each chunk reads its own iterator of the batches."""
    return schedule(
        forward_step_func=make_forward_step(per_token),
        data_iterator=[iter(batches) for _ in model] if isinstance(model, list) else iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        **options,
    )


def reference_loss_and_grads(model: ToyStage, batches, per_token: bool):
    """The plain single-process computation the pipeline must reproduce, in one backward."""
    losses, tokens = [], []
    for t, lab, mask in batches:
        per_tok = model(t, labels=lab)
        losses.append((per_tok * mask).sum())
        tokens.append(mask.sum())
    if per_token:
        total = torch.stack(losses).sum() / torch.stack(tokens).sum()
    else:
        total = torch.stack([l / n for l, n in zip(losses, tokens)]).mean()
    model.zero_grad()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

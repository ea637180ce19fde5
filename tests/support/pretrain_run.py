"""``pretrain()`` in this process with ``pretrain_gpt.py``'s providers, as ``python pretrain_gpt.py`` runs it.

The tests that train in process (one rank, or each rank of a spawned pool) call this instead of
naming the four providers each time.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

from torch import nn

import pretrain_gpt
from training.training import TrainState, pretrain

__all__ = ["pretrain_gpt_in_process", "pretrain_keeping_models"]


def pretrain_gpt_in_process(*, model_provider: Callable | None = None, **options) -> TrainState:
    """``pretrain()`` with pretrain_gpt's datasets, model, forward step and tokenizer.

    ``options`` are pretrain's keywords (``argv=`` or ``args=``, ``iteration_hook=``);
    ``model_provider`` replaces the script's model.
    """
    return pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        model_provider or pretrain_gpt.model_provider,
        pretrain_gpt.forward_step,
        tokenizer_provider=pretrain_gpt.tokenizer_provider,
        **options,
    )


def pretrain_keeping_models(argv: list[str]) -> tuple[TrainState, list[nn.Module], str]:
    """:func:`pretrain_gpt_in_process` with the script's own model: (its state, every model chunk the
    provider built, what it printed)."""
    built: list[nn.Module] = []

    def model_provider(*args, **kwargs):
        built.append(pretrain_gpt.model_provider(*args, **kwargs))
        return built[-1]

    with contextlib.redirect_stdout(io.StringIO()) as out:
        state = pretrain_gpt_in_process(argv=argv, model_provider=model_provider)
    return state, built, out.getvalue()

"""``pretrain()`` in this process with ``pretrain_gpt.py``'s providers, as ``python pretrain_gpt.py`` runs it.

The tests that train in process (one rank, or each rank of a spawned pool) call this instead of
naming the four providers each time.
"""

from __future__ import annotations

from collections.abc import Callable

import pretrain_gpt
from training.training import TrainState, pretrain

__all__ = ["pretrain_gpt_in_process"]


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

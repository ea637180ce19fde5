"""Training: Megatron's flags, the training loop, checkpoints, data and tokenizers over Trident's engine."""

from training.global_vars import get_args, get_tokenizer


def pretrain(*args, **kwargs):
    """See :func:`training.training.pretrain` (imported lazily: data tools need no torch.distributed)."""
    from training.training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)


__all__ = ["get_args", "get_tokenizer", "pretrain"]

"""Megatron's loss contract, typed: what ``loss_func`` may return, and how its logs are reduced.

``loss_func(output)`` returns one of two forms, told apart by their length and checked:

* ``(loss, log)``: the microbatch's mean loss. The schedule backpropagates ``loss / microbatches``;
  every value in ``log`` is one number per microbatch, reported as the mean over microbatches
  (and data-parallel ranks).
* ``(loss_sum, num_tokens, log)``: the summed loss and its token count. With
  ``calculate_per_token_loss`` the schedule backpropagates ``loss_sum`` and gradients are divided by
  the step's total token count at the end; otherwise ``loss_sum / num_tokens / microbatches``.
  Every value in ``log`` is a ``(sum, count)`` pair, reported as ``sum(sums) / sum(counts)``.

With context parallelism each CP rank's ``loss_func`` sees its part of the sequence, and data-parallel
gradient averaging runs over DP x CP. So that the step is still the mean over whole sequences, as
Megatron does: a 2-tuple loss (which Megatron's contract makes the whole sequence's mean, reduced over
CP by ``loss_func``) is multiplied by the CP size, and a 3-tuple's ``loss_sum`` is divided by the
token count of the whole sequence (summed over the CP group) and multiplied by the CP size. With
``calculate_per_token_loss`` nothing changes: gradients are summed over DP x CP and divided by the
token count over DP x CP (``finalize_model_grads``).

``log`` may hold any keys ("lm loss" is only a convention). The schedules return the microbatches'
logs as :class:`LossLogs`, a list that also says which form produced them, and
:func:`reduce_loss_logs` turns them into one number per key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from core.device import current_device
from core.parallel_state import group_size


class MicrobatchLoss(NamedTuple):
    """One microbatch's ``loss_func`` result, checked: what to backpropagate, its tokens and its log."""

    loss: torch.Tensor
    num_tokens: torch.Tensor | None  # only from the 3-tuple form
    log: Mapping


class LossLogs(list):
    """The per-microbatch log dicts a schedule returns (Megatron's return value, still a list).

    ``summed`` is True when they came from the 3-tuple form, whose values are ``(sum, count)`` pairs.
    """

    summed: bool | None = None


def parse_loss(
    result: object,
    *,
    num_microbatches: int,
    per_token: bool,
    context_parallel_group: dist.ProcessGroup | None = None,
) -> MicrobatchLoss:
    """Check ``loss_func``'s result and scale the loss as the contract above says.

    ``context_parallel_group``: the CP group when its size is above 1 (the 3-tuple form's token
    count is then summed over it, one small all-reduce per microbatch).
    """
    cp = group_size(context_parallel_group)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError(
            "loss_func must return (loss, log_dict) or (loss_sum, num_tokens, log_dict), got "
            + (f"a {len(result)}-tuple" if isinstance(result, tuple) else type(result).__name__)
        )
    log = result[-1]
    if not isinstance(log, Mapping):
        raise TypeError(
            f"the last item loss_func returns must be a dict of logged values, got {type(log).__name__}"
        )
    if len(result) == 2:
        if per_token:
            raise ValueError(
                "config.calculate_per_token_loss needs loss_func to return "
                "(loss_sum, num_tokens, log_dict), got a 2-tuple"
            )
        return MicrobatchLoss(
            result[0] * cp / num_microbatches if cp > 1 else result[0] / num_microbatches, None, log
        )
    loss, num_tokens = result[0], result[1]
    if not per_token:  # never in place: the caller may share this tensor with its logs
        loss = loss / _sequence_tokens(num_tokens, loss, context_parallel_group) * cp / num_microbatches
    return MicrobatchLoss(loss, torch.as_tensor(num_tokens), log)


def _sequence_tokens(num_tokens, loss: torch.Tensor, group: dist.ProcessGroup | None):
    """The microbatch's token count over its whole sequences: summed over the CP group, if any."""
    if group is None:
        return num_tokens
    total = torch.as_tensor(num_tokens, device=loss.device).detach().to(torch.float64).clone().reshape(())
    dist.all_reduce(total, group=group)
    return total.to(loss.dtype)


def reduce_loss_logs(
    logs: list[Mapping], group: dist.ProcessGroup | None = None, *, summed: bool | None = None
) -> dict[str, float]:
    """One number per logged key over the step's microbatches and the ranks of ``group`` (data parallel).

    ``summed`` says whether values are ``(sum, count)`` pairs; it defaults to what a
    :class:`LossLogs` knows. Ranks holding no logs (not the last stage) return ``{}``. The numbers
    are read from the device once (:func:`reduce_loss_logs_on_device` keeps them there).
    """
    reduced = reduce_loss_logs_on_device(logs, group, summed=summed)
    if not reduced:
        return {}
    return dict(zip(reduced, torch.stack(list(reduced.values())).tolist()))


def reduce_loss_logs_on_device(
    logs: list[Mapping], group: dist.ProcessGroup | None = None, *, summed: bool | None = None
) -> dict[str, torch.Tensor]:
    """:func:`reduce_loss_logs` as 0-dim float64 tensors on the backend's device, never read by the host.

    Logged values may be tensors (wherever they are) or Python numbers; all are gathered on the
    device the process group communicates on (a Python number is written there, not copied).
    """
    if not logs:
        return {}
    summed = getattr(logs, "summed", None) if summed is None else summed
    if summed is None:
        raise ValueError("say whether the logged values are (sum, count) pairs: pass summed=")
    device = current_device()
    totals = []
    for key in logs[0]:
        values = [_logged(log[key], device) for log in logs]
        for v in values:
            if v.numel() != (2 if summed else 1):
                form = "(loss_sum, num_tokens, log)" if summed else "(loss, log)"
                expected = "a (sum, count) pair" if summed else "one number"
                raise ValueError(
                    f"logged value {key!r} has {v.numel()} elements; with the {form} form it must be {expected}"
                )
        pairs = [v if summed else torch.cat([v, v.new_ones(1)]) for v in values]
        totals.append(torch.stack(pairs).sum(0))
    total = torch.stack(totals)  # [keys, 2]: (sum, count) per key
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    means = total[:, 0] / total[:, 1]
    return {key: means[i] for i, key in enumerate(logs[0])}


def _logged(value, device: torch.device) -> torch.Tensor:
    """A logged value as a flat float64 tensor on ``device``: tensors moved only if elsewhere, numbers
    written in place (``torch.full``: no copy from host memory, which would wait for the device)."""
    if isinstance(value, (tuple, list)):
        return torch.cat([_logged(v, device) for v in value]) if value else torch.zeros(0, device=device)
    if isinstance(value, torch.Tensor):
        value = value.detach().reshape(-1).to(torch.float64)
        return value if value.device == device else value.to(device)
    return torch.full((1,), float(value), dtype=torch.float64, device=device)

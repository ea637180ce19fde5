"""Seconds this rank spends in tensor-parallel collectives and waiting for ring attention's blocks.

Counted only between :func:`begin` and :func:`end` (a timeline's recorded iteration on CPU ranks), on
the host clock: on a GPU the host only queues the collectives, so the timeline does not count there.
Off, each collective pays one module-global test; on, two ``perf_counter`` reads (~0.1 µs each).
"""

from __future__ import annotations

import time

__all__ = ["KINDS", "begin", "end", "start", "stop"]

KINDS = ("TP", "CP")
"""``TP``: the tensor-parallel mappings' and the vocabulary-parallel cross-entropy's collectives;
``CP``: ring attention's waits for a key/value block or its gradient (what the ring did not hide)."""

_totals: dict[str, float] | None = None


def begin() -> None:
    """Start counting from zero."""
    global _totals
    _totals = dict.fromkeys(KINDS, 0.0)


def end() -> dict[str, float]:
    """Stop counting; the seconds of each kind since :func:`begin` (zeros when it was not called)."""
    global _totals
    totals, _totals = _totals or dict.fromkeys(KINDS, 0.0), None
    return totals


def start() -> float | None:
    """A stamp to hand to :func:`stop`, or None while not counting."""
    return None if _totals is None else time.perf_counter()


def stop(kind: str, stamp: float | None) -> None:
    """Add the seconds since ``stamp`` (from :func:`start`) to ``kind``."""
    if stamp is not None and _totals is not None:
        _totals[kind] += time.perf_counter() - stamp

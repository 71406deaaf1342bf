"""How many times the custom ops ran in this process: a hook for tools (how many of a model's
attention calls reached the low-bit ops rather than a fallback), counted inside the ops, so calls
from compiled graphs count too."""

from __future__ import annotations

import collections
import threading

FAMILIES = ("attention", "trainable", "video_sparse")

_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()


def count_call(family: str) -> None:
    """One run of an op of ``family`` (called by the ops)."""
    with _lock:
        _counts[family] += 1


def kernel_calls(family: str = "attention") -> int:
    """Runs so far in this process of ``family``'s custom ops, on either backend and inside
    compiled graphs. Tools take the difference around the code they watch (how many of a model's
    attention calls reached the low-bit ops rather than a fallback).

    Args:
        family: ``"attention"`` (dense and packed inference forwards), ``"trainable"``
            (trainable forwards) or ``"video_sparse"`` (fine stages).

    Returns:
        The count, an int.

    Raises:
        ValueError: an unknown ``family``.

    Examples:
        >>> import torch, lowbit_attn
        >>> from lowbit_attn.core.counters import kernel_calls
        >>> before = kernel_calls("attention")
        >>> q = k = v = torch.randn(1, 2, 64, 32)
        >>> _ = lowbit_attn.attention(q, k, v)
        >>> kernel_calls("attention") - before
        1
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    with _lock:
        return _counts[family]

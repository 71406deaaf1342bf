"""What the FlashAttention drop-ins (:mod:`lowbit_attn.compat.flash_attn` for FlashAttention 2,
:mod:`lowbit_attn.compat.flash_attn_interface` for FlashAttention 3) share once each has read its
arguments: one call to the 8-bit forward or, where autograd needs gradients, to the trainable
attention, and the views of packed tensors."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from lowbit_attn.core import checks
from lowbit_attn.inference import attention, attention_varlen
from lowbit_attn.training import trainable_attention


def integer(name: str, value) -> int:
    """An int argument as FlashAttention's bindings take one: an int, a NumPy integer or a
    one-element integer tensor (not a bool, not a float)."""
    try:
        if isinstance(value, bool) or checks.is_numpy_bool(value) or (
                isinstance(value, torch.Tensor) and value.dtype == torch.bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {checks.shown(value)}") from None


def window_sides(window_size) -> tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)`` (two ints, or a two-element integer
    tensor), a negative side (``-1`` or any other) returned as ``-1``, unbounded, as
    FlashAttention's kernels test ``< 0``."""
    try:
        if isinstance(window_size, (str, bytes)) or len(window_size) != 2:
            raise TypeError
        left, right = (integer("window_size", x) for x in window_size)
    except TypeError:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got "
                        f"{checks.shown(window_size)}") from None
    return max(left, -1), max(right, -1)


def softcap_of(softcap) -> float | None:
    """FlashAttention's ``softcap``: on above 0, off (None) at 0 or below; a NaN or a value that is
    not a real number is refused (FlashAttention reads NaN as off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0.0: off), got {checks.shown(softcap)}")
    if math.isnan(softcap):
        raise ValueError("softcap must be a number (0.0: off), got NaN")
    return float(softcap) if softcap > 0 else None


def _no_lse_with_grad(return_lse: bool) -> None:
    if return_lse:
        raise ValueError("return_attn_probs=True is not supported where gradients are needed (the "
                         "trainable attention returns no LSE); call it under torch.no_grad() or "
                         "with inputs that need no gradient")


def dense(q, k, v, *, scale, variant: dict, recipe, train_recipe, return_lse: bool):
    """``[B, N, H, D]`` q, k, v: :func:`lowbit_attn.attention` (with ``return_lse``, its
    ``(out, lse)``), or :func:`lowbit_attn.trainable_attention` where gradients are needed.
    ``variant``: ``is_causal``, ``window``, ``softcap``, ``chunk`` keywords."""
    if checks.needs_grad(q, k, v):
        _no_lse_with_grad(return_lse)
        return trainable_attention(q, k, v, scale=scale, layout="NHD", recipe=train_recipe,
                                   **variant)
    return attention(q, k, v, scale=scale, layout="NHD", recipe=recipe, return_lse=return_lse,
                     **variant)


def packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
           variant: dict, recipe, train_recipe, return_lse: bool):
    """``[total, H, D]`` sequences: :func:`lowbit_attn.attention_varlen`, or where gradients are
    needed one :func:`lowbit_attn.trainable_attention` call per sequence, outputs concatenated
    (a sequence without queries or keys gives rows of 0)."""
    if not checks.needs_grad(q, k, v):
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=scale, recipe=recipe, return_lse=return_lse, **variant)
    _no_lse_with_grad(return_lse)
    rows = checks.sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dtypes=checks.FLOAT_DTYPES + (torch.float64,))
    outs, read = [], False  # read: whether any sequence's queries saw its keys
    for q0, q1, k0, k1 in rows:
        if q1 == q0 or k1 == k0:  # no query, or queries that see no key: rows of 0 (gradient 0)
            outs.append(q[q0:q1].masked_fill(torch.ones((), dtype=torch.bool, device=q.device),
                                             0.0))
            continue
        read = True
        outs.append(trainable_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                        scale=scale, layout="NHD", recipe=train_recipe,
                                        **variant)[0])
    out = torch.cat(outs)
    if not read:  # k and v in the graph even so: zero gradients, as the dense call gives them
        out = out + (k[:0].sum() + v[:0].sum()).to(q.dtype)  # an empty slice's sum: 0
    return out


def unpack(name: str, stacked, parts: int, *, dims: int) -> tuple[torch.Tensor, ...]:
    """The views stacked along dim ``-3`` of a ``[..., parts, H, D]`` tensor of ``dims``
    dimensions."""
    if not isinstance(stacked, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(stacked).__name__}")
    if stacked.dim() != dims or stacked.shape[-3] != parts:
        shape = "[B, N, " if dims == 5 else "[total, "
        raise ValueError(f"{name} must have shape {shape}{parts}, H, D], got {tuple(stacked.shape)}")
    return stacked.unbind(-3)

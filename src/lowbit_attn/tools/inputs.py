"""Named families of attention inputs that look like real attention, for accuracy studies and tests.

Each family is a function ``(generator, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype)`` →
``(q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, D])`` in HND layout and ``dtype``, drawn on
``generator.device`` in fp32 and then rounded to ``dtype``. The same generator state gives the same
tensors. Families, with the real-attention feature each one stands for:

``normal``
    q, k, v ~ N(0, 1): scores of standard deviation 1 with the default scale, fairly flat rows.
``channel_bias_k``
    q, k, v ~ N(0, 1) and ``k += 4·N(0, 1)`` with one bias per (batch, head, channel), the same for
    every token: the large per-channel offset of K seen in LLMs and diffusion models that motivates K
    smoothing (SageAttention's benchmark input).
``outliers``
    ``channel_bias_k`` plus two channels of Q and two other channels of K scaled by 15 (massive
    activations): one channel dominates the INT8 scale of its operand.
``outliers_shared``
    as ``outliers`` with the same two channels scaled in Q and in K (RoPE dimensions carrying large
    values in both), which makes the scores large and the rows peaked.
``peaked``
    q and k scaled by ``2√2``: scores of standard deviation 8, so each row is dominated by a few keys
    (sharp retrieval heads).
``flat``
    q scaled by 0.05: nearly uniform rows, the output is close to the mean of V.
``qk_bias``
    a per-channel bias ``2·N(0, 1)`` on Q (per (batch, head, channel)) and ``4·N(0, 1)`` on K: Q's INT8
    scale is set by the bias (what Q smoothing removes), and the bias turns into a per-key score
    offset shared by all queries (attention sinks).
``v_bias``
    ``channel_bias_k`` with a per-channel bias ``4·N(0, 1)`` on V too (what V smoothing removes).
``heavy_tail``
    ``channel_bias_k`` with Student-t (3 degrees of freedom, unit variance) noise in Q, K and V:
    rare large entries set the INT8 and FP8 scales.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

Family = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=g.device, dtype=torch.float32)


def _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim):
    q = _randn(g, batch, heads_q, n_q, head_dim)
    k = _randn(g, batch, heads_kv, n_k, head_dim)
    v = _randn(g, batch, heads_kv, n_k, head_dim)
    return q, k, v


def _channel_bias(g, batch, heads, head_dim, std: float) -> torch.Tensor:
    """One bias per (batch, head, channel), broadcast over tokens: ``[B, H, 1, D]``."""
    return std * _randn(g, batch, heads, 1, head_dim)


def _distinct_channels(g: torch.Generator, head_dim: int, count: int) -> torch.Tensor:
    return torch.randperm(head_dim, generator=g, device=g.device)[: min(count, head_dim)]


def _cast(dtype, *xs):
    return tuple(x.to(dtype) for x in xs)


def normal(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """q, k, v ~ N(0, 1)."""
    return _cast(dtype, *_base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim))


def channel_bias_k(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """q, k, v ~ N(0, 1), ``k += 4·N(0, 1)`` per (batch, head, channel)."""
    q, k, v = _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim)
    k = k + _channel_bias(g, batch, heads_kv, head_dim, 4.0)
    return _cast(dtype, q, k, v)


def _outliers(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype, shared: bool):
    q, k, v = _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim)
    k = k + _channel_bias(g, batch, heads_kv, head_dim, 4.0)
    chans = _distinct_channels(g, head_dim, 2 if shared else 4)
    q_chans = chans[:2]
    k_chans = chans[:2] if shared else chans[2:4]
    q[..., q_chans] *= 15.0
    k[..., k_chans] *= 15.0
    return _cast(dtype, q, k, v)


def outliers(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """``channel_bias_k`` with two channels of Q and two other channels of K scaled by 15."""
    return _outliers(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype, shared=False)


def outliers_shared(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """``channel_bias_k`` with the same two channels of Q and of K scaled by 15."""
    return _outliers(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype, shared=True)


def peaked(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """q and k ~ 2√2·N(0, 1): scores of standard deviation 8, rows dominated by a few keys."""
    q, k, v = _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim)
    s = math.sqrt(8.0)
    return _cast(dtype, q * s, k * s, v)


def flat(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """q ~ 0.05·N(0, 1): nearly uniform softmax rows."""
    q, k, v = _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim)
    return _cast(dtype, q * 0.05, k, v)


def qk_bias(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """Per-channel biases ``2·N(0, 1)`` on Q and ``4·N(0, 1)`` on K."""
    q, k, v = _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim)
    q = q + _channel_bias(g, batch, heads_q, head_dim, 2.0)
    k = k + _channel_bias(g, batch, heads_kv, head_dim, 4.0)
    return _cast(dtype, q, k, v)


def v_bias(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """``channel_bias_k`` with a per-channel bias ``4·N(0, 1)`` on V as well."""
    q, k, v = _base(g, batch, heads_q, heads_kv, n_q, n_k, head_dim)
    k = k + _channel_bias(g, batch, heads_kv, head_dim, 4.0)
    v = v + _channel_bias(g, batch, heads_kv, head_dim, 4.0)
    return _cast(dtype, q, k, v)


def _student_t3(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Student-t with 3 degrees of freedom scaled to unit variance (t3 has variance 3)."""
    z = _randn(g, *shape)
    chi2 = _randn(g, 3, *shape).square().sum(dim=0)
    return z / torch.sqrt(chi2 / 3.0) / math.sqrt(3.0)


def heavy_tail(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype):
    """``channel_bias_k`` with unit-variance Student-t (3 d.o.f.) noise in place of N(0, 1)."""
    q = _student_t3(g, batch, heads_q, n_q, head_dim)
    k = _student_t3(g, batch, heads_kv, n_k, head_dim)
    v = _student_t3(g, batch, heads_kv, n_k, head_dim)
    k = k + _channel_bias(g, batch, heads_kv, head_dim, 4.0)
    return _cast(dtype, q, k, v)


FAMILIES: dict[str, Family] = {
    "normal": normal,
    "channel_bias_k": channel_bias_k,
    "outliers": outliers,
    "outliers_shared": outliers_shared,
    "peaked": peaked,
    "flat": flat,
    "qk_bias": qk_bias,
    "v_bias": v_bias,
    "heavy_tail": heavy_tail,
}


def make(
    family: str,
    *,
    seed: int,
    batch: int,
    heads_q: int,
    heads_kv: int,
    n_q: int,
    n_k: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The family's tensors for ``seed``, drawn on the CPU (so every device sees the same numbers)
    and moved to ``device``."""
    try:
        fn = FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown input family {family!r}; expected one of {sorted(FAMILIES)}"
        ) from None
    if heads_q % heads_kv != 0:
        raise ValueError(f"heads_q must be a multiple of heads_kv, got {heads_q} and {heads_kv}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = fn(g, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype)
    return q.to(device), k.to(device), v.to(device)


__all__ = ["FAMILIES", "Family", "make"] + list(FAMILIES)

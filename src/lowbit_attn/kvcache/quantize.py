"""What the cache stores, in the numerics of the INT8 and FP8 quantizers (``quant/int8_naive.py``,
whose helpers do every step here).

- **K smoothing**: ``μ`` = the per-channel mean of K, in fp32, per (sequence, KV head), over the
  valid tokens of the sequence's first append that stores any (its prompt; a first append of one
  token gives ``μ`` = that token), then frozen: every token is stored as ``K - μ``. Softmax
  ignores a vector subtracted from every key (each score of a query row moves by ``q·μ``); the
  LSE adds ``scale·q·μ`` back.
- **Q/K balancing**, frozen with ``μ`` from the same tokens: per (sequence, KV head, channel),
  ``α = sqrt(max|K - μ| / max|Q|)``, Q's maximum over the queries of the first append
  (``append(..., q=)``) and over the query heads of the KV head's group (``α = 1`` where either
  side is 0, and everywhere when no queries were given). K is stored as ``(K - μ)/α`` and every
  query is multiplied by ``α`` before its quantization: ``(Qα)·((K - μ)/α)ᵀ = Q·(K - μ)ᵀ``
  exactly, while a channel in which K (or Q) carries outliers no longer sets the INT8 step of
  every token (or query row); ``quant.int8_naive.balance_factors``, as in the dense recipes, whose
  statistics come from the whole call instead of the prompt.
- **K**: INT8 per token, ``s = max|(K - μ)/α| / 127`` over the head dim, ``round_half_even``,
  clamped to ±127 (a zero row gets the scale 1; a non-finite row a NaN scale). Done at append
  time: every stored K token is INT8.
- **V**: one scale per (page, head, channel) over the page's tokens, ``amax/448`` to E4M3 or
  ``amax/127`` to INT8, computed once, when the page fills. Until then the sequence's open page
  keeps V as it came (the cache's dtype).
"""

from __future__ import annotations

import torch

from lowbit_attn.kvcache.recipes import KVRecipe
from lowbit_attn.quant.int8_naive import channel_stats, convert_v, quantize_int8


def frozen_stats(k: torch.Tensor, q: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics a sequence's first append freezes, from its tokens ``k [B, Hkv, n, D]``
    (``n ≥ 1``) and their queries ``q [B, Hq, n, D]`` or ``None``: ``(μ, max|Q|, max|K - μ|)``,
    each fp32 ``[B, Hkv, D]``; ``max|Q|`` is over the tokens and the query heads of each KV head's
    group, 0 without queries. With queries, ``max|K - μ|`` is what ``α`` is frozen from, for
    tokens not seen yet, so two guards: a channel whose keys are all equal has 0, not the
    rounding of μ (which froze an ``α`` of ~1e-4 and lost the channel from Q for every later
    token); and none is below a quarter of its median over the channels (a channel that barely
    varied in a short prompt froze an ``α`` that dropped it likewise: a read 158 tokens after a
    2-token prompt, worst of 4 seeds, cosine 0.9437 → 0.9929 on ``peaked`` inputs, 0.9797 →
    0.9989 on ``qk_bias``; from 8 tokens on, the same to 4 digits on every input family;
    ``benchmarks/NOTES.md`` §21)."""
    mean, k_amax = channel_stats(k, center="mean")
    if q is None:
        return mean, torch.zeros_like(k_amax), k_amax
    constant = k.amax(dim=2) == k.amin(dim=2)  # NaN compares unequal: kept, never hidden
    k_amax = torch.where(constant, torch.zeros_like(k_amax), k_amax)
    k_amax = torch.maximum(k_amax, k_amax.median(dim=-1, keepdim=True).values / 4)
    _, q_amax = channel_stats(q, center="none")
    b, hq, d = q_amax.shape
    return mean, q_amax.view(b, k.shape[1], hq // k.shape[1], d).amax(dim=2), k_amax


def quantize_keys(k: torch.Tensor, mean: torch.Tensor, q_amax: torch.Tensor,
                  k_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k [B, H, n, D] - mean [B, H, D])/α`` → ``(int8 [B, H, n, D], scales fp32 [B, H, n])``,
    one scale per token, ``α`` from the frozen ``q_amax``, ``k_amax [B, H, D]``. Each token's row
    is quantized on its own: the same row gives the same bits whatever else is in the batch."""
    return quantize_int8(k, granularity="per_token", block=1, center=mean,
                         balance=(q_amax, k_amax), role="k")


def quantize_queries(q: torch.Tensor, q_amax: torch.Tensor, k_amax: torch.Tensor,
                     multiplier: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, n, D]`` times ``α`` (from the frozen ``[B, Hkv, D]`` statistics) → ``(int8,
    scales fp32 [B, Hq, n])``, per token (row), the scales times ``multiplier``."""
    return quantize_int8(q, granularity="per_token", block=1, balance=(q_amax, k_amax),
                         role="q", scale_multiplier=multiplier)


def quantize_v_page(v: torch.Tensor, recipe: KVRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """A full page ``v [B, H, page_size, D]`` → ``(values [B, H, page_size, D] in recipe.v_dtype,
    scales fp32 [B, H, D])``: V ≈ ``values·scales`` per channel."""
    if recipe.v_dtype == torch.int8:
        # INT8 per channel is INT8 "per token" of the transposed page: one row per channel.
        values, scales = quantize_int8(v.transpose(-1, -2), granularity="per_token", block=1)
        return values.transpose(-1, -2).contiguous(), scales
    _, amax = channel_stats(v, center="none")
    return convert_v(v, pv="fp8", amax=amax)

"""What the cache stores, in the numerics of the INT8 and FP8 quantizers (``quant/int8_naive.py``,
whose helpers do every step here).

- **K smoothing**: ``μ`` = the per-channel mean of K, in fp32, per (sequence, KV head), over the
  valid tokens of the sequence's first append that stores any (its prompt; a first append of one
  token gives ``μ`` = that token), then frozen: every token is stored as ``K - μ``. Softmax
  ignores a vector subtracted from every key (each score of a query row moves by ``q·μ``); the
  LSE adds ``scale·q·μ`` back.
- **K**: INT8 per token, ``s = max|K - μ| / 127`` over the head dim, ``round_half_even``, clamped
  to ±127 (a zero row gets the scale 1; a non-finite row a NaN scale). Done at append time: every
  stored K token is INT8.
- **V**: one scale per (page, head, channel) over the page's tokens, ``amax/448`` to E4M3 or
  ``amax/127`` to INT8, computed once, when the page fills. Until then the sequence's open page
  keeps V as it came (the cache's dtype).
"""

from __future__ import annotations

import torch

from lowbit_attn.kvcache.recipes import KVRecipe
from lowbit_attn.quant.int8_naive import channel_stats, convert_v, quantize_int8


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """``μ`` fp32 ``[B, H, D]``: the mean of ``k [B, H, n, D]`` over its tokens (``n ≥ 1``)."""
    mean, _ = channel_stats(k, center="mean")
    return mean


def quantize_keys(k: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [B, H, n, D]`` less ``mean [B, H, D]`` → ``(int8 [B, H, n, D], scales fp32 [B, H, n])``,
    one scale per token. Each token's row is quantized on its own: the same row gives the same bits
    whatever else is in the batch."""
    return quantize_int8(k, granularity="per_token", block=1, center=mean)


def quantize_v_page(v: torch.Tensor, recipe: KVRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """A full page ``v [B, H, page_size, D]`` → ``(values [B, H, page_size, D] in recipe.v_dtype,
    scales fp32 [B, H, D])``: V ≈ ``values·scales`` per channel."""
    if recipe.v_dtype == torch.int8:
        # INT8 per channel is INT8 "per token" of the transposed page: one row per channel.
        values, scales = quantize_int8(v.transpose(-1, -2), granularity="per_token", block=1)
        return values.transpose(-1, -2).contiguous(), scales
    _, amax = channel_stats(v, center="none")
    return convert_v(v, pv="fp8", amax=amax)

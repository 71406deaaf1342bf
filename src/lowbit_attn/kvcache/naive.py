"""The PyTorch twin of attention against the quantized KV cache: the numerics a split-KV decode
kernel must reproduce (to the rounding of its own order of sums).

For queries ``q [B, Hq, n, D]`` (``Hq`` a multiple of ``Hkv``) and sequence ``b`` holding ``L``
tokens, query row ``i`` sees the first ``L - n + i + 1`` stored tokens (causal, aligned
bottom-right: the queries are the last ``n`` tokens appended); ``scale`` defaults to ``D**-0.5``.

1. Q: times the sequence's frozen balancing factors ``α`` (fp32; ``α = 1`` without them), then
   INT8 per token (row), ``s_q = max|qα|/127`` times ``scale·log2 e`` (the scale folded into Q's
   scales, as the ``qk_int8_pv_*`` recipes do; ``kvcache.quantize.quantize_queries``).
2. Scores in base 2: ``S = ((Q̂·K̂ᵀ) · s_k) · s_q`` in fp32, the key scale first, then the query
   row's (the per-token order of ``inference.naive.quantized_attention``); the integer products
   summed in fp32 are exact (``127²·D < 2^24``). K is stored as ``(K - μ)/α``: S lacks
   ``q·μ``, the same for every key of a row, which softmax ignores.
3. ``m`` = the row maximum of S over every visible key (no online softmax: one maximum per row).
4. ``P̃ = exp2(S - m + o)`` with ``o = log2 448`` for ``kv_int8_fp8`` (P̃ in [0, 448], rounded
   to E4M3) and ``o = 0`` for ``kv_int8_int8`` (P̃ in [0, 1], rounded to fp16), as
   ``inference.naive.softmax_step``. ``l`` = the row sum of P̃ *before* rounding, as there.
5. ``acc = Σ_pages (P̃_page · V̂_page) · v_scale_page`` over the full pages in order (each page's
   product in fp32, then its per-channel scale), then ``+ P̃_open · V_open`` for the open page,
   whose V is exact (P̃ rounded as everywhere, as fp32).
6. ``out = acc / l`` in fp32, then q's dtype; ``LSE = ((m + log2 l - o)·ln 2) + scale·(q·μ)``,
   the natural log of the true scores' sum (``inference.naive.finish`` and ``lse_shift``). Rows
   that see no key (``L = 0``, or ``L < n`` for the first rows) give 0 and LSE ``-inf``.

Local layers (``PagedLayer.window``, ``chunk``): the row at position ``p`` sees keys from
``PagedLayer.first_key(p)`` to ``p`` only (the pages before a sequence's window are gone).
Options of the call, each leaving the above unchanged when off:

- ``softcap = c``: the scores become ``c·tanh(S/c)`` on the true scaled logits, so the shift that
  K's smoothing took off comes back inside the tanh and leaves after it: in base 2
  ``S ← c₂·tanh((S + σ)/c₂) - σ`` with ``σ = scale·log2 e·(q·μ)``, ``c₂ = c·log2 e``
  (``core.variants.softcap_base2``, as the prefill kernels), the LSE's shift as before.
- ``sinks [Hq]``: one more logit per row in the softmax's denominator, with no value (gpt-oss):
  in base 2 ``z = sink·log2 e - σ`` (the scores' frame), ``m = max(m, z)``,
  ``l += 2^(z - m + o)``. The LSE counts it; a row that sees no key gives 0
  and LSE ``sink``.
"""

from __future__ import annotations

import torch

from lowbit_attn.core.operands import LOG2_FP8_MAX, LOG2E
from lowbit_attn.core.variants import softcap_base2
from lowbit_attn.inference.naive import add_sink, expand_heads, finish, lse_shift
from lowbit_attn.kvcache.pages import PagedLayer, stored_sequence
from lowbit_attn.kvcache.quantize import quantize_queries
from lowbit_attn.kvcache.recipes import KVRecipe
from lowbit_attn.quant.int8_naive import to_e4m3


def attention_with_kv_cache_naive(
    q: torch.Tensor, layer: PagedLayer, recipe: KVRecipe, *, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, n, D]`` against one layer of the cache (module docstring);
    ``softcap`` a positive float or None, ``sinks`` fp32 ``[Hq]`` or None.

    Returns:
        ``(out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n])``.
    """
    q8, q_scale = quantize_queries(q, layer.q_amax, layer.k_amax, scale * LOG2E)
    outs, lses = [], []
    for b in range(q.shape[0]):
        out, lse = _one_sequence(q[b : b + 1], q8[b : b + 1], q_scale[b : b + 1],
                                 layer, b, recipe, scale, softcap, sinks)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def visible_keys(layer: PagedLayer, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Bool ``[rows, keys]``: key position ``cols[j]`` seen from query position ``positions[i]``
    (causal, and in a local layer from ``layer.first_key`` on)."""
    seen = cols[None, :] <= positions[:, None]
    first = torch.zeros_like(positions)
    if layer.window is not None:
        first = torch.maximum(first, positions - layer.window)
    if layer.chunk is not None:
        first = torch.maximum(first, positions - positions % layer.chunk)
    return seen & (cols[None, :] >= first[:, None])


def _one_sequence(q, q8, q_scale, layer: PagedLayer, b: int, recipe: KVRecipe, scale: float,
                  softcap: float | None, sinks: torch.Tensor | None):
    """One sequence: ``q``, ``q8 [1, Hq, n, D]``, ``q_scale [1, Hq, n]``."""
    seq = stored_sequence(layer, b)
    _, hq, n, d = q.shape
    length = seq.k.shape[1]  # tokens from the first held page on
    size = layer.page_size
    start = layer.host_first[b] * size
    dev = q.device
    offset = LOG2_FP8_MAX if recipe.pv == "fp8" else 0.0

    k = expand_heads(seq.k[None], hq).float()
    k_scale = expand_heads(seq.k_scale[None], hq)
    s = (torch.matmul(q8.float(), k.transpose(-1, -2)) * k_scale[:, :, None, :]) * q_scale[..., None]
    shift = lse_shift(q, seq.k_mean[None], scale) if start + length else None
    if softcap is not None and shift is not None:  # on the true logits, back in the frame
        s = softcap_base2(s, softcap, (shift * LOG2E).unsqueeze(-1))
    positions = start + length - n + torch.arange(n, device=dev)
    seen = visible_keys(layer, positions, start + torch.arange(length, device=dev))
    s = s.masked_fill(~seen, float("-inf"))
    if length == 0:
        m = torch.full((1, hq, n), float("-inf"), device=dev)
    else:
        m = s.amax(dim=-1)
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    p = torch.exp2(s - (m_safe - offset).unsqueeze(-1))
    l_sum = p.sum(dim=-1)
    p_q = (to_e4m3(p) if recipe.pv == "fp8" else p.to(torch.float16)).float()

    acc = torch.zeros((1, hq, n, d), device=dev)
    v = expand_heads(seq.v[None], hq)
    v_scale = expand_heads(seq.v_scale[None], hq)
    for page in range(seq.v_scale.shape[1]):
        cols = slice(page * size, (page + 1) * size)
        acc = acc + torch.matmul(p_q[..., cols], v[:, :, cols].float()) * v_scale[:, :, page, None, :]
    full = seq.v.shape[1]
    if full < length:
        v_open = expand_heads(seq.v_open[None], hq).float()
        acc = acc + torch.matmul(p_q[..., full:], v_open)
    if sinks is not None:  # after P·V, as the merge kernel adds it: P̃ is rounded on the keys' max
        z = (sinks.float() * LOG2E)[None, :, None].expand(1, hq, n)
        if shift is not None:  # in the smoothed frame; a row without keys: LSE = its sink
            shift = torch.where(torch.isneginf(m), 0.0, shift)
            z = z - shift * LOG2E
        acc, m, l_sum, _ = add_sink(acc, m, l_sum, z, offset)
    return finish(acc, l_sum, m, offset, None, None, shift)

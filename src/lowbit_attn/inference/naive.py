"""Attention in plain PyTorch: exact attention (the oracle) and the quantized recipes' numerics.

The quantized forward walks the key blocks in the kernel's order with the same online softmax in
base 2, so it matches the Triton kernel to rounding, and it runs anywhere PyTorch does.
"""

from __future__ import annotations


import torch

from lowbit_attn.core.operands import LN2, LOG2_FP8_MAX, QuantizedFP4, QuantizedQKV
from lowbit_attn.core.variants import LOG2E, PLAIN, Variant, sink_logits, softcap_base2
from lowbit_attn.quant.int8_naive import thread_groups, to_e4m3, unpermute_keys
from lowbit_attn.quant.fp4_qkv_naive import dequantize_fp4, quantize_p, two_level_p


def visible(nq: int, nk: int, causal_offset: int | None, device, rows=None, cols=None):
    """Boolean ``[nq, nk]`` mask: key ``j`` is visible to query ``i`` iff ``j <= i + causal_offset``
    (everything when ``causal_offset`` is None)."""
    i = torch.arange(nq, device=device) if rows is None else rows
    j = torch.arange(nk, device=device) if cols is None else cols
    if causal_offset is None:
        return torch.ones(len(i), len(j), dtype=torch.bool, device=device)
    return j[None, :] <= i[:, None] + causal_offset


def visible_for(variant: Variant, nq: int, nk: int, causal_offset: int | None, device, rows=None,
                cols=None):
    """:func:`visible`, or with a window or chunk the variant's rule (aligned bottom-right)."""
    if not variant.windowed:
        return visible(nq, nk, causal_offset, device, rows=rows, cols=cols)
    i = torch.arange(nq, device=device) if rows is None else rows
    j = torch.arange(nk, device=device) if cols is None else cols
    return variant.visible(i, j, nk - nq)


def row_shift(lse_shift: torch.Tensor | None):
    """K smoothing's per-row shift in base 2 as the kernels load it (``LSH·log2 e``), ``[..., 1]``;
    0.0 without one."""
    return 0.0 if lse_shift is None else (lse_shift * LOG2E).unsqueeze(-1)


def add_sink(acc, m, l_sum, sink, offset):
    """The sink term joins each row after the key blocks (``triton_helpers.add_sink``): the
    running max raised to the sink's logit ``sink`` (base 2, in the scores' frame) when above,
    ``2^(sink - m + offset)`` added to the row sum. Returns ``(acc, m, l_sum, w)`` with ``w`` the
    keys' share of the sum (what V's mean is weighted by)."""
    m_new = torch.maximum(m, sink)
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    alpha = torch.exp2(m - m_safe)
    l_keys = l_sum * alpha
    l_sum = l_keys + torch.exp2(sink - (m_safe - offset))
    return acc * alpha.unsqueeze(-1), m_new, l_sum, l_keys / l_sum


def _sink_rows(sinks, lse_shift, b, nq):
    """The sinks ``[Hq]`` as per-row base-2 logits in the smoothed scores' frame ``[B, Hq, Nq]``."""
    sink = sink_logits(sinks)[None, :, None].expand(b, -1, nq)
    if lse_shift is not None:
        sink = sink - lse_shift * LOG2E
    return sink


def expand_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """``[B, Hkv, ...]`` → ``[B, Hq, ...]`` (query head h reads KV head ``h // (Hq/Hkv)``)."""
    group = hq // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
    dtype: torch.dtype = torch.float64,
    chunk: int = 1024,
    max_chunk_bytes: int = 1 << 28,
    variant: Variant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention in ``dtype``, query rows in chunks whose score matrix stays under
    ``max_chunk_bytes`` (so that long sequences do not allocate an N×N matrix). ``variant``:
    window/chunk masks (a dense mask per row chunk, every visible term kept) and
    ``softcap·tanh(S/softcap)``; ``sinks`` ``[Hq]``: one more logit per row in the softmax.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` (HND).
    Returns:
        ``(out [B, Hq, Nq, D] in dtype, lse [B, Hq, Nq] natural log in dtype)``, the LSE with the
        sink term. Rows that see no key give 0 and LSE ``-inf`` (the sink's logit with sinks).
    """
    hq = q.shape[1]
    k = expand_heads(k, hq).to(dtype)
    v = expand_heads(v, hq).to(dtype)
    nq, nk = q.shape[2], k.shape[2]
    row_bytes = q.shape[0] * hq * nk * torch.finfo(dtype).bits // 8
    chunk = max(1, min(chunk, max_chunk_bytes // max(row_bytes, 1)))
    outs, lses = [], []
    for start in range(0, nq, chunk):
        qc = q[:, :, start : start + chunk].to(dtype)
        s = torch.matmul(qc, k.transpose(-1, -2)) * scale
        if variant.softcap:
            s = variant.softcap * torch.tanh(s / variant.softcap)
        rows = torch.arange(start, start + qc.shape[2], device=q.device)
        mask = visible_for(variant, nq, nk, causal_offset, q.device, rows=rows)
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is None:
            lse = torch.logsumexp(s, dim=-1)
        else:
            column = sinks.to(dtype)[None, :, None, None].expand(*s.shape[:3], 1)
            lse = torch.logsumexp(torch.cat([s, column], dim=-1), dim=-1)
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
        p = torch.where(mask, p, torch.zeros((), dtype=dtype, device=q.device))
        # an infinite logit (a score, or a sink of +inf) leaves its row undefined: NaN, as in
        # the kernels (exp(inf - inf)), not the 0 its finite terms would give; so does a NaN
        # sink on a row that sees no key (no visible term carries it into P·V)
        undefined = torch.isposinf(lse) | torch.isnan(lse)
        o = torch.matmul(p, v).masked_fill(undefined.unsqueeze(-1), float("nan"))
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def quantized_attention(
    qz: QuantizedQKV,
    *,
    pv: str,
    granularity: str,
    block_q: int,
    block_k: int,
    causal_offset: int | None,
    poly_share: int = 0,
    variant: Variant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The INT8-Q·Kᵀ attention forward of the recipes, dense HND tensors. ``variant``/``sinks``:
    window and chunk masks, soft-capping of the scores (:func:`softcap_base2` of the full scores,
    K smoothing's shift ``qz.lse_shift`` added back inside the tanh) and the sinks' term after the
    key blocks (:func:`add_sink`). ``poly_share``: one
    group of 8 key columns in that many takes :func:`poly_exp2` (:func:`softmax_step`; the sm90
    kernel's ``poly_exp2`` option), key blocks starting at multiples of 128.

    Returns:
        ``(out fp32 [B, Hq, Nq, D], lse fp32 [B, Hq, Nq])`` with the LSE in natural log of the
        unsmoothed scores when ``qz.lse_shift`` is given (of the smoothed scores otherwise).
    """
    b, hq, nq, d = qz.q.shape
    nk = qz.k.shape[2]
    dev = qz.q.device
    qf = qz.q.float()
    kf = expand_heads(qz.k, hq).float()
    vf = expand_heads(unpermute_keys(qz.v, nk) if qz.v_permuted else qz.v, hq).float()
    if granularity == "per_block":
        q_scale = qz.q_scale.repeat_interleave(block_q, dim=-1)[..., :nq]
        k_scale = expand_heads(qz.k_scale, hq).repeat_interleave(block_k, dim=-1)[..., :nk]
    elif granularity == "per_thread":
        q_scale = qz.q_scale[..., thread_groups(nq, "q", dev)]
        k_scale = expand_heads(qz.k_scale, hq)[..., thread_groups(nk, "k", dev)]
    else:
        q_scale = qz.q_scale
        k_scale = expand_heads(qz.k_scale, hq)
    delta = None
    if qz.delta_s is not None:
        delta = qz.delta_s.repeat_interleave(block_q, dim=2)[:, :, :nq]

    m = torch.full((b, hq, nq), float("-inf"), device=dev)
    l_sum = torch.zeros((b, hq, nq), device=dev)
    acc = torch.zeros((b, hq, nq, d), device=dev)
    rows = torch.arange(nq, device=dev)
    offset = LOG2_FP8_MAX if pv == "fp8" else 0.0
    shift = row_shift(qz.lse_shift)
    for start in range(0, nk, block_k):
        stop = min(start + block_k, nk)
        # int8 products summed in fp32 are exact: |sum| <= 127² · D < 2^24.
        s_int = torch.matmul(qf, kf[:, :, start:stop].transpose(-1, -2))
        ks = k_scale[:, :, None, start:stop]
        mask = visible_for(variant, nq, nk, causal_offset, dev, rows=rows,
                           cols=torch.arange(start, stop, device=dev))
        if granularity != "per_token":  # one product of the two scales, as the kernels fold it
            c = q_scale.unsqueeze(-1) * ks
            s = s_int * c
        else:  # the kernels' order: the key scale first, then the query row's (see there)
            s = (s_int * ks) * q_scale.unsqueeze(-1)
        if delta is not None:
            s = s + delta[..., start:stop]
        if variant.softcap:
            s = softcap_base2(s, variant.softcap, shift)
        s = s.masked_fill(~mask, float("-inf"))
        acc, m, l_sum = softmax_step(s, vf[:, :, start:stop], acc, m, l_sum, pv=pv,
                                     poly_share=poly_share)
    v_scale = None if qz.v_scale is None else expand_heads(qz.v_scale, hq).unsqueeze(-2)
    w = None
    if sinks is not None:
        acc, m, l_sum, w = add_sink(acc, m, l_sum, _sink_rows(sinks, qz.lse_shift, b, nq), offset)
    return finish(acc, l_sum, m, offset, v_scale, qz.v_mean, qz.lse_shift, w)


def softmax_step(s, v_block, acc, m, l_sum, *, pv: str, poly_share: int = 0):
    """One key block of the quantized recipes' online softmax in base 2: scores ``s`` (``-inf``
    where masked) against ``v_block`` (dequantized to fp32 up to its scale); P̃ rounded to E4M3
    with the static offset ``log2 448`` (``pv="fp8"``) or to fp16. ``poly_share``: the key
    columns of one group of 8 in every ``poly_share`` (:func:`poly_columns`) take
    :func:`poly_exp2`, the rest ``exp2``. Returns ``(acc, m, l_sum)``."""
    offset = LOG2_FP8_MAX if pv == "fp8" else 0.0
    m_new = torch.maximum(m, s.amax(dim=-1))
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    alpha = torch.exp2(m - m_safe)
    bias = -(m_safe - offset).unsqueeze(-1)
    x = s + bias
    p = torch.exp2(x)
    if poly_share:
        cols = poly_columns(s.shape[-1], poly_share, s.device)
        p[..., cols] = poly_exp2(x[..., cols])
    l_sum = l_sum * alpha + p.sum(dim=-1)
    p_q = to_e4m3(p) if pv == "fp8" else p.to(torch.float16)
    acc = acc * alpha.unsqueeze(-1) + torch.matmul(p_q.float(), v_block)
    return acc, m_new, l_sum



# 2^f for f in [-1/2, 1/2]: a cubic fitted to equal relative ripple (7.5e-5 at most, evaluated
# as below; E4M3 P̃ keeps 3 bits), its coefficients rounded to fp32, constant term first.
POLY_EXP2 = (0.9999280571937561, 0.6932609677314758, 0.24261096119880676, 0.05517150089144707)
# x + EXP2_ROUND (fp32, round to nearest) is EXP2_ROUND + round(x) for |x| < 2^22: its bits' low
# byte holds round(x) + 127, the biased exponent of 2^round(x).
EXP2_ROUND = 1.5 * 2**23 + 127
POLY_SHARES = (2, 4, 8, 16)  # one group of 8 key columns in 2, 4, 8 or 16 (see poly_columns)


def poly_exp2(x: torch.Tensor) -> torch.Tensor:
    """``2^x`` of fp32 ``x`` in fp32 arithmetic alone (FlashAttention-4's exponential on the FMA
    pipe; ``gluon_blocks.poly_exp2``, bit for bit): ``x`` raised to at least -127 (NaN kept),
    ``n = round(x)`` by adding and subtracting :data:`EXP2_ROUND`, ``f = x - n`` (exact), the
    cubic :data:`POLY_EXP2` at ``f`` by Horner, times ``2^n`` made from the rounded sum's bits
    shifted into the exponent field. 0 for ``x ≤ -126.5`` (``2^n``'s bits are 0: no subnormal
    results, as the MUFU's ``ex2.approx.ftz``) and for ``-inf``; NaN for NaN. Relative error at
    most 7.5e-5 elsewhere up to 2^127. Each Horner step rounds its product and its sum apart, as
    the CPU model's ``fma`` does (the GPU's FFMA rounds once)."""
    x = torch.maximum(x.float(), torch.tensor(-127.0, device=x.device))
    r = x + EXP2_ROUND
    f = x - (r - EXP2_ROUND)
    c0, c1, c2, c3 = POLY_EXP2
    p = (f * c3 + c2) * f + c1
    p = p * f + c0
    return p * (r.view(torch.int32) << 23).view(torch.float32)


def poly_columns(n: int, share: int, device=None) -> torch.Tensor:
    """Which of a key block's ``n`` columns take :func:`poly_exp2` when one group in ``share``
    does: the columns ``8g .. 8g + 7`` with ``g ≡ share - 1 (mod share)`` (the sm90 kernel's
    ``_mixed_exp2`` halves the groups ``g`` and keeps the odd half, ``log2 share`` times)."""
    if share not in POLY_SHARES:
        raise ValueError(f"poly_share must be one of {POLY_SHARES}, got {share!r}")
    cols = torch.arange(n, device=device)
    return cols[(cols // 8) % share == share - 1]


def finish(acc, l_sum, m, offset, v_scale, v_mean, lse_shift, v_mean_weight=None):
    """Normalise the accumulator, undo V's scale and smoothing, zero rows that saw no key; the LSE
    in natural log (``offset``: what the exp2 added to every score, in base 2).
    ``v_mean_weight``: the keys' share of each row's sum when a sink took the rest (V's mean is
    added in that proportion)."""
    hq = acc.shape[1]
    empty = l_sum == 0
    out = acc / torch.where(empty, 1.0, l_sum).unsqueeze(-1)
    if v_scale is not None:
        out = out * v_scale
    if v_mean is not None:
        vm = expand_heads(v_mean, hq).unsqueeze(-2)
        out = out + (vm if v_mean_weight is None else vm * v_mean_weight.unsqueeze(-1))
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    lse = (m + torch.log2(l_sum) - offset) * LN2
    if lse_shift is not None:
        lse = lse + lse_shift
    return out, lse


def fp4_attention(
    qz: QuantizedFP4,
    *,
    head_dim: int,
    block_q: int,
    block_k: int,
    causal_offset: int | None,
    two_level: bool,
    variant: Variant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP4 attention forward (SageAttention3 numerics), dense HND tensors, in the kernel's
    block order; ``variant``/``sinks`` as :func:`quantized_attention`.

    Scores: the exact product of the dequantized operands (what a block-scaled FP4 MMA computes)
    times ``qk_multiplier`` and the NVFP4 tensor scales, plus ΔS. P̃ is quantized per key block in
    groups of keys: with ``two_level`` each row is first scaled so its block maximum sits at the
    format's target (:func:`two_level_p`) and the factor ``s1`` is applied after P·V.

    Returns:
        ``(out fp32 [B, Hq, Nq, head_dim], lse fp32 [B, Hq, Nq])`` as :func:`quantized_attention`.
    """
    fmt = qz.fmt
    b, hq, nq, _ = qz.q.shape
    nk = qz.k.shape[2]
    dev = qz.q.device
    qf = dequantize_fp4(qz.q, qz.q_scale, fmt)
    vf = expand_heads(dequantize_fp4(qz.v, qz.v_scale, fmt), hq).transpose(-1, -2)
    kf = dequantize_fp4(qz.k, qz.k_scale, fmt)  # padded to V's whole key blocks, as V is
    kf = expand_heads(torch.nn.functional.pad(kf, (0, 0, 0, vf.shape[-2] - nk)), hq)
    mult = torch.full((b, hq), qz.qk_multiplier, device=dev)
    if fmt == "nvfp4":
        mult = mult * (qz.q_global * expand_heads(qz.k_global, hq))
    mult = mult[:, :, None, None]
    delta = None
    if qz.delta_s is not None:
        delta = qz.delta_s.repeat_interleave(block_q, dim=2)[:, :, :nq]

    m = torch.full((b, hq, nq), float("-inf"), device=dev)
    l_sum = torch.zeros((b, hq, nq), device=dev)
    acc = torch.zeros((b, hq, nq, vf.shape[-1]), device=dev)
    rows = torch.arange(nq, device=dev)
    shift = row_shift(qz.lse_shift)
    for start in range(0, nk, block_k):
        stop = start + block_k  # V is padded to whole blocks; masked keys give P̃ = 0
        s = torch.matmul(qf, kf[:, :, start:stop].transpose(-1, -2)) * mult
        if delta is not None:
            s = s + torch.nn.functional.pad(delta[..., start:stop], (0, stop - min(stop, nk)))
        cols = torch.arange(start, stop, device=dev)
        mask = visible_for(variant, nq, nk, causal_offset, dev, rows=rows, cols=cols) & (cols < nk)
        if variant.softcap:
            s = softcap_base2(s, variant.softcap, shift)
        s = s.masked_fill(~mask, float("-inf"))
        block_max = s.amax(dim=-1)
        m_new = torch.maximum(m, block_max)
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha = torch.exp2(m - m_safe)
        if two_level:
            p, s1 = two_level_p(s, block_max, m_safe, fmt)
        else:
            p = torch.exp2(s - m_safe.unsqueeze(-1))
            s1 = torch.ones_like(m_safe)
        l_sum = l_sum * alpha + p.sum(dim=-1) * s1
        pv = torch.matmul(quantize_p(p, fmt), vf[:, :, start:stop])
        acc = acc * alpha.unsqueeze(-1) + pv * s1.unsqueeze(-1)
        m = m_new
    v_scale = None
    if fmt == "nvfp4":
        v_scale = expand_heads(qz.v_global, hq)[:, :, None, None]
    w = None
    if sinks is not None:
        acc, m, l_sum, w = add_sink(acc, m, l_sum, _sink_rows(sinks, qz.lse_shift, b, nq), 0.0)
    out, lse = finish(acc[..., :head_dim], l_sum, m, 0.0, v_scale, qz.v_mean, qz.lse_shift, w)
    return out, lse


def delta_s(qm: torch.Tensor, k: torch.Tensor, k_mean: torch.Tensor | None, scale_multiplier: float):
    """Q-smoothing correction ``ΔS = mean(Q_block)·(K - mean(K))ᵀ``, fp32 (fp64 for fp64 inputs),
    times ``scale_multiplier``.

    Args:
        qm: ``[B, Hq, nbq, D]`` fp32 block means of Q; k: ``[B, Hkv, Nk, D]``; k_mean: ``[B, Hkv, D]``.
    Returns:
        ``[B, Hq, nbq, Nk]``.
    """
    wide = torch.promote_types(k.dtype, torch.float32)
    kf = k.to(wide).contiguous()  # the matmul's summation order must not follow k's strides
    if k_mean is not None:
        kf = kf - k_mean.to(wide).unsqueeze(-2)
    kf = expand_heads(kf, qm.shape[1])
    return torch.matmul(qm.to(wide), kf.transpose(-1, -2)) * scale_multiplier


def lse_shift(q: torch.Tensor, k_mean: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``softmax_scale·(q·mean(K))`` per query row ``[B, Hq, Nq]``, fp32 (float64 for float64
    q): what K smoothing took off each row of scores, so the LSE can be reported for the
    unsmoothed scores (and a softcap's tanh take them whole)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    km = expand_heads(k_mean, q.shape[1]).to(wide)
    return torch.matmul(q.to(wide).contiguous(), km.unsqueeze(-1)).squeeze(-1) * softmax_scale


"""One tile of Q or K smoothed, balanced and quantized to INT8, as Triton functions.

The quantization pass (``lowbit_attn.quant.int8``) stores such tiles; the attention kernel builds
its Q tile with the same functions when it quantizes Q itself, so both give the same bits. Twin:
``lowbit_attn.quant.int8_naive.quantize_int8``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowbit_attn.core.triton_helpers import to_int8
from lowbit_attn.quant import int8_naive

_ALPHA_MIN = tl.constexpr(int8_naive.ALPHA_MIN)
_ALPHA_MAX = tl.constexpr(int8_naive.ALPHA_MAX)
# Scales whose quotients ``divided(RESIDUAL=True)`` takes from the reciprocal. From 2^-90 the
# residual of a quotient ≥ 2^-11 is a multiple of 2^-149, so exact, and the quotient is div_rn's:
# every code's boundary is there (INT8's from 0.5, E4M3's from 2^-10); a smaller quotient keeps
# its sign and stays below 2^-10, its code ±0 either way. To 2^90 the reciprocal is normal.
_RESIDUAL_MIN = tl.constexpr(2.0**-90)
_RESIDUAL_MAX = tl.constexpr(2.0**90)


@triton.jit
def balance_multiplier(AQ, AK, b, h, offs_d, D, aq_strides, ak_strides, GROUP,
                       ROLE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per-channel balancing factor: ``α = sqrt(amax_k / max over the group's amax_q)`` for Q
    (``ROLE`` 1, head ``h`` of Q) or ``1/α`` for K (``ROLE`` 2, head ``h`` of K), within
    ``int8_naive``'s ``[ALPHA_MIN, ALPHA_MAX]``; 1 where a side is all zero; NaN statistics give
    NaN. ``*_strides``: (batch, head) of the ``[B, H, D]`` amax vectors. Twin:
    ``lowbit_attn.quant.int8_naive.balance_factors``."""
    saqb, saqh = aq_strides
    sakb, sakh = ak_strides
    dmask = offs_d < D
    if ROLE == 1:
        hk = h // GROUP
    else:
        hk = h
    ak = tl.load(AK + b * sakb + hk * sakh + offs_d, mask=dmask, other=1.0)
    aq = tl.zeros([BLOCK_D], dtype=tl.float32)
    poison = tl.zeros([BLOCK_D], dtype=tl.float32)
    for g in range(0, GROUP):
        a = tl.load(AQ + b * saqb + (hk * GROUP + g) * saqh + offs_d, mask=dmask, other=1.0)
        aq = tl.maximum(aq, a)
        poison += a * 0.0  # a GPU max drops NaN; the sum keeps it
    aq = aq + poison
    alpha = tl.sqrt_rn(tl.div_rn(ak, aq))
    alpha = tl.where(alpha > _ALPHA_MAX, _ALPHA_MAX,
                     tl.where(alpha < _ALPHA_MIN, _ALPHA_MIN, alpha))  # NaN stays NaN
    alpha = tl.where((aq == 0.0) | (ak == 0.0), 1.0, alpha)
    if ROLE == 2:
        alpha = tl.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), alpha)
    return alpha


@triton.jit
def line_amax(x, AXIS: tl.constexpr):
    """``max|x|`` of each row (``AXIS`` 1) or column (``AXIS`` 0) of a tile, NaN where the line
    holds a NaN or an Inf (``+ Σ x·0``: a GPU max drops NaN). Twin: ``amax + nonfinite_guard``
    in ``quant/int8_naive.py``."""
    return tl.max(tl.abs(x), axis=AXIS) + tl.sum(x * 0.0, axis=AXIS)


@triton.jit
def divided(x, scale, RESIDUAL: tl.constexpr = False, GIVEN: tl.constexpr = False):
    """``x / scale`` rounded to nearest (``div_rn``, the twins' division); ``scale`` broadcast to
    ``x`` (a ``[n, 1]`` or ``[1, d]`` tile). ``RESIDUAL``: the same quotient from the scale's
    reciprocal ``r`` and one correction, ``q = x·r``, ``q + (x − q·scale)·r`` (two ``fma``; the
    residual is exact and the correction rounds to ``div_rn``'s bits, Markstein's theorem; below
    2^-11 the same code), so one division per scale rather than per value, while every scale of
    the tile lies in ``[2^-90, 2^90]`` (or is NaN): below it the residual can underflow, above it
    the reciprocal; a tile with such a scale divides. ``GIVEN``: the scale was not measured from
    ``x`` (V's, from a given amax), so an infinite ``x`` may meet a finite one: it keeps its
    ±inf quotient (the residual is NaN there); a scale measured from the tile is infinite with
    it, and its tile divides. (What the quantizing launch, ``quant.int8.quantize``, runs.)"""
    if RESIDUAL:
        inside = ((scale >= _RESIDUAL_MIN) & (scale <= _RESIDUAL_MAX)) | (scale != scale)
        if tl.min(inside.to(tl.int32)) == 1:
            r = tl.broadcast_to(tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), x.shape)
            s = tl.broadcast_to(scale, x.shape)
            q = x * r
            # q·s − x exact; times −r, not negated (Triton's −e is 0 − e: −0 would turn +0)
            out = tl.fma(tl.fma(q, s, -x), -r, q)
            if GIVEN:  # an infinite x keeps q, ±inf, as the division does: its residual is NaN
                out = tl.where(tl.abs(q) == float("inf"), q, out)
        else:
            out = tl.div_rn(x, scale)
    else:
        out = tl.div_rn(x, scale)
    return out


@triton.jit
def int8_lines(x, AXIS: tl.constexpr, RESIDUAL: tl.constexpr = False):
    """An fp32 tile → ``(int8 values, fp32 scales)`` with one scale per row (``AXIS`` 1) or per
    column (``AXIS`` 0): ``amax/127`` (1 for an all-zero line, NaN for a non-finite one),
    ``div_rn``, round half to even. Twin: ``quantize_int8(granularity="per_token")`` (of the
    transposed tile for ``AXIS`` 0)."""
    scale = line_amax(x, AXIS) * (1.0 / 127.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    return to_int8(divided(x, tl.expand_dims(scale, AXIS), RESIDUAL)), scale


@triton.jit
def e4m3_scale(amax):
    """V's per-channel scale for E4M3: ``amax/448`` (1 for an all-zero channel). Twin:
    ``quant.int8_naive.convert_v(pv="fp8")``."""
    s = amax * (1.0 / 448.0)
    return tl.where(s == 0.0, 1.0, s)


@triton.jit
def load_centered(
    X, CENTER_PTR, b, h, start, pid_n, n, x_strides, c_strides, D,
    CENTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rows ``pid_n·BLOCK_N …`` of one (batch, head) in fp32, minus the channel mean (``CENTER``
    1) or the block's mean (``CENTER`` 2); 0 outside the sequence and past ``D``. Strides:
    ``x_strides`` (batch, head, token, dim), ``c_strides`` (batch, head, block, dim)."""
    sxb, sxh, sxn, sxd = x_strides
    scb, sch, sck, scd = c_strides
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < n)[:, None] & (offs_d < D)[None, :]
    x = tl.load(
        X + b * sxb + h * sxh + (start + rows)[:, None] * sxn + offs_d[None, :] * sxd,
        mask=mask, other=0.0,
    ).to(tl.float32)
    if CENTER == 1:
        c = tl.load(CENTER_PTR + b * scb + h * sch + offs_d * scd, mask=offs_d < D, other=0.0)
        x = x - c[None, :]
    elif CENTER == 2:
        c = tl.load(
            CENTER_PTR + b * scb + h * sch + pid_n * sck + offs_d * scd, mask=offs_d < D, other=0.0
        )
        x = x - c[None, :]
    x = tl.where(mask, x, 0.0)
    return x, rows, offs_d, mask


@triton.jit
def thread_group(rows, GRAN: tl.constexpr):
    """The per-thread scale group of each row index (``GRAN`` 2: of Q, 3: of K). Twin:
    ``quant.int8_naive.thread_groups``."""
    if GRAN == 2:
        return (rows // 16) * 8 + rows % 8
    else:
        return (rows // 128) * 4 + (rows % 8) // 2


@triton.jit
def thread_group_scales(x, GRAN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each row's per-thread INT8 scale, ``[BLOCK_N]`` (``GRAN`` 2: Q, rows ``r`` and ``r + 8``
    of each 16-row slice share one; 3: K in a 128-key tile, keys ``2c, 2c + 1`` (mod 8) share
    one), NaN where its group holds a NaN or an Inf. Twin: ``quant.int8_naive.thread_group_amax``."""
    rows = line_amax(x, 1)
    if GRAN == 2:  # row 16·s + 8·half + r: the maximum over the halves
        g = tl.reshape(rows, [BLOCK_N // 16, 2, 8])
        amax = tl.expand_dims(tl.max(g, axis=1) + tl.sum(g * 0.0, axis=1), 1)
    else:  # key 8·g + 2·c + p: the maximum over g and p
        g = tl.reshape(rows, [BLOCK_N // 8, 4, 2])
        amax = tl.max(tl.max(g, axis=2), axis=0) + tl.sum(tl.sum(g * 0.0, axis=2), axis=0)
        amax = tl.expand_dims(tl.expand_dims(amax, 0), 2)
    scale = amax * (1.0 / 127.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    return tl.reshape(tl.broadcast_to(scale, g.shape), [BLOCK_N])


@triton.jit
def quantize_int8_tile(
    X, CENTER_PTR, AQ, AK, b, h, start, pid_n, n, x_strides, c_strides, aq_strides, ak_strides,
    D, GROUP, GRAN: tl.constexpr, CENTER: tl.constexpr, BALANCE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RESIDUAL: tl.constexpr = False,
):
    """``(q, scale, rows, offs_d, mask)``: the tile's INT8 values and its dequantization scale:
    ``GRAN`` 0, one for the tile; 1, one per row; 2 and 3, each row's per-thread group scale of
    Q or K (:func:`thread_group_scales`). NaN/Inf in a group poison its scale.
    ``BALANCE``: 0 none, 1 Q's factors, 2 K's. ``RESIDUAL``: see :func:`divided`."""
    x, rows, offs_d, mask = load_centered(
        X, CENTER_PTR, b, h, start, pid_n, n, x_strides, c_strides, D, CENTER, BLOCK_N, BLOCK_D,
    )
    if BALANCE != 0:
        mult = balance_multiplier(AQ, AK, b, h, offs_d, D, aq_strides, ak_strides, GROUP,
                                  BALANCE, BLOCK_D)
        x = x * mult[None, :]
    if GRAN == 1:
        q, scale = int8_lines(x, 1, RESIDUAL)
    elif GRAN >= 2:
        scale = thread_group_scales(x, GRAN, BLOCK_N)
        q = to_int8(divided(x, scale[:, None], RESIDUAL))
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0) + tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
        scale = amax * (1.0 / 127.0)
        scale = tl.where(scale == 0.0, 1.0, scale)
        q = to_int8(divided(x, tl.broadcast_to(scale, (1, 1)), RESIDUAL))
    return q, scale, rows, offs_d, mask

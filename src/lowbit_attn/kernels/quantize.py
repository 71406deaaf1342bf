"""Triton kernels that prepare Q, K and V: per-channel statistics, then smoothing, balancing and
quantization fused in one pass per tensor. Twins: ``lowbit_attn.reference.quant``.

Every launcher takes a logical ``[B, H, N, D]`` tensor (any strides) or, with ``seqs`` packed, a
``[total, H, D]`` tensor whose sequences ``cu_seqlens`` delimits; statistics are per sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantized import Seqs, dense_seqs
from .common import (
    batch_head, bhnd_strides, exact_fp8, next_pow2, row_strides, seq_span, to_e4m3, to_int8,
)

CENTERS = {"none": 0, "mean": 1, "block_mean": 2}


@triton.jit
def _channel_stats_kernel(
    X, MEAN, AMAX, CU,
    sxb, sxh, sxn, sxd,
    smb, smh, smk, smd,
    sab, sah, sad,
    N, H, D,
    CENTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_d = tl.program_id(1)
    b, h = batch_head(pid_bh, H)
    start, n = seq_span(CU, b, N, VARLEN)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    base = X + b * sxb + h * sxh + start * sxn
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    amax = tl.zeros([BLOCK_D], dtype=tl.float32)
    poison = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, n, BLOCK_N):
        rows = i + tl.arange(0, BLOCK_N)
        rmask = rows < n
        mask = rmask[:, None] & dmask[None, :]
        x = tl.load(base + rows[:, None] * sxn + offs_d[None, :] * sxd, mask=mask, other=0.0)
        x = x.to(tl.float32)
        poison += tl.sum(x * 0.0, axis=0)
        if CENTER == 2:
            count = tl.minimum(n - i, BLOCK_N).to(tl.float32)
            bmean = tl.sum(x, axis=0) / count
            bhi = tl.max(tl.where(mask, x, float("-inf")), axis=0)
            blo = tl.min(tl.where(mask, x, float("inf")), axis=0)
            amax = tl.maximum(amax, tl.maximum(bhi - bmean, bmean - blo))
            tl.store(
                MEAN + b * smb + h * smh + (i // BLOCK_N) * smk + offs_d * smd, bmean, mask=dmask
            )
        else:
            total += tl.sum(x, axis=0)
            hi = tl.maximum(hi, tl.max(tl.where(mask, x, float("-inf")), axis=0))
            lo = tl.minimum(lo, tl.min(tl.where(mask, x, float("inf")), axis=0))
    if CENTER == 1:
        mean = total / n
        amax = tl.maximum(hi - mean, mean - lo)
        tl.store(MEAN + b * smb + h * smh + offs_d * smd, mean, mask=dmask)
    elif CENTER == 0:
        amax = tl.maximum(hi, -lo)
    tl.store(AMAX + b * sab + h * sah + offs_d * sad, amax + poison, mask=dmask)


def channel_stats(
    x: torch.Tensor, *, center: str, block: int = 0, seqs: Seqs | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Triton twin of :func:`lowbit_attn.reference.quant.channel_stats` (equal to rounding: the
    sums are taken in another order)."""
    seqs = seqs or dense_seqs(x)
    h, d = x.shape[1], x.shape[-1]
    mode = CENTERS[center]
    block_n = block if mode == 2 else 64
    amax = torch.empty((seqs.batch, h, d), device=x.device, dtype=torch.float32)
    if mode == 2:
        nb = triton.cdiv(seqs.max_len, block)
        mean = torch.zeros((seqs.batch, h, nb, d), device=x.device, dtype=torch.float32)
        mstrides = mean.stride()
    elif mode == 1:
        mean = torch.empty((seqs.batch, h, d), device=x.device, dtype=torch.float32)
        mstrides = (mean.stride(0), mean.stride(1), 0, mean.stride(2))
    else:
        mean = None
        mstrides = (0, 0, 0, 0)
    block_d = min(32, next_pow2(d))
    grid = (seqs.batch * h, triton.cdiv(d, block_d))
    _channel_stats_kernel[grid](
        x, mean, amax, seqs.cu_seqlens,
        *bhnd_strides(x, seqs.packed), *mstrides, *amax.stride(),
        seqs.max_len, h, d,
        CENTER=mode, BLOCK_N=block_n, BLOCK_D=block_d, VARLEN=seqs.packed,
    )
    return mean, amax


@triton.jit
def _balance_multiplier(AQ, AK, b, h, offs_d, D, saqb, saqh, sakb, sakh, GROUP,
                        ROLE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per-channel balancing factor: ``α = sqrt(amax_k / max over the group's amax_q)`` for Q
    (``ROLE`` 1, head ``h`` of Q) or ``1/α`` for K (``ROLE`` 2, head ``h`` of K); 1 where a side is
    all zero; NaN statistics give NaN. Twin: ``reference.quant.balance_factors``."""
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
    alpha = tl.where((aq == 0.0) | (ak == 0.0), 1.0, alpha)
    if ROLE == 2:
        alpha = tl.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), alpha)
    return alpha


@triton.jit
def _load_centered(
    X, CENTER_PTR, b, h, start, pid_n, n,
    sxb, sxh, sxn, sxd, scb, sch, sck, scd, D,
    CENTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
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
def _quantize_int8_kernel(
    X, OUT, SCALE, CENTER_PTR, AQ, AK, CU,
    sxb, sxh, sxn, sxd,
    sob, soh, son, sod,
    ssb, ssh, ssn,
    scb, sch, sck, scd,
    saqb, saqh, sakb, sakh,
    N, H, D, GROUP, scale_multiplier,
    PER_TOKEN: tl.constexpr, CENTER: tl.constexpr, BALANCE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = batch_head(pid_bh, H)
    start, n = seq_span(CU, b, N, VARLEN)
    if pid_n * BLOCK_N >= n:
        return
    x, rows, offs_d, mask = _load_centered(
        X, CENTER_PTR, b, h, start, pid_n, n,
        sxb, sxh, sxn, sxd, scb, sch, sck, scd, D,
        CENTER, BLOCK_N, BLOCK_D,
    )
    if BALANCE != 0:
        mult = _balance_multiplier(AQ, AK, b, h, offs_d, D, saqb, saqh, sakb, sakh, GROUP,
                                   BALANCE, BLOCK_D)
        x = x * mult[None, :]
    if PER_TOKEN:
        amax = tl.max(tl.abs(x), axis=1) + tl.sum(x * 0.0, axis=1)
        scale = amax * (1.0 / 127.0)
        scale = tl.where(scale == 0.0, 1.0, scale)
        q = to_int8(tl.div_rn(x, scale[:, None]))
        tl.store(SCALE + b * ssb + h * ssh + (start + rows) * ssn, scale * scale_multiplier,
                 mask=rows < n)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0) + tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
        scale = amax * (1.0 / 127.0)
        scale = tl.where(scale == 0.0, 1.0, scale)
        q = to_int8(tl.div_rn(x, scale))
        tl.store(SCALE + b * ssb + h * ssh + pid_n * ssn, scale * scale_multiplier)
    tl.store(OUT + b * sob + h * soh + (start + rows)[:, None] * son + offs_d[None, :] * sod, q,
             mask=mask)


def _warps(rows: int, d: int) -> int:
    """A tile of ``rows × d`` fp32 values: 8 warps from 8k elements on, to keep it in registers."""
    return 8 if rows * d >= 8192 else 4


def _new_like_layout(x: torch.Tensor, seqs: Seqs, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous buffer for ``x``'s logical shape (``[B, H, N, D]`` or packed ``[total, H, D]``)."""
    return torch.empty(x.shape, device=x.device, dtype=dtype)


def _per_token_vector(x: torch.Tensor, seqs: Seqs) -> torch.Tensor:
    if seqs.packed:
        return torch.empty((x.shape[1], x.shape[0]), device=x.device, dtype=torch.float32)
    return torch.empty(x.shape[:3], device=x.device, dtype=torch.float32)


def _center_strides(center, center_per_block):
    if center is None:
        return (0, 0, 0, 0)
    if center_per_block:
        return tuple(center.stride())
    return (center.stride(0), center.stride(1), 0, center.stride(2))


def quantize_int8(
    x: torch.Tensor,
    *,
    granularity: str,
    block: int,
    center: torch.Tensor | None = None,
    center_per_block: bool = False,
    balance: tuple[torch.Tensor, torch.Tensor] | None = None,
    balance_role: str = "q",
    scale_multiplier: float = 1.0,
    seqs: Seqs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`lowbit_attn.reference.quant.quantize_int8` (bit-identical)."""
    seqs = seqs or dense_seqs(x)
    h, d = x.shape[1], x.shape[-1]
    out = _new_like_layout(x, seqs, torch.int8)
    per_token = granularity == "per_token"
    if per_token:
        scale = _per_token_vector(x, seqs)
    else:  # blocks past a short sequence's end stay unwritten; the attention never reads them
        scale = torch.empty((seqs.batch, h, triton.cdiv(seqs.max_len, block)), device=x.device)
    mode = 0 if center is None else (2 if center_per_block else 1)
    amax_q, amax_k = balance if balance is not None else (None, None)
    group = amax_q.shape[1] // amax_k.shape[1] if balance is not None else 1
    grid = (triton.cdiv(seqs.max_len, block), seqs.batch * h)
    _quantize_int8_kernel[grid](
        x, out, scale, center, amax_q, amax_k, seqs.cu_seqlens,
        *bhnd_strides(x, seqs.packed), *bhnd_strides(out, seqs.packed),
        *row_strides(scale, seqs.packed and per_token),
        *_center_strides(center, center_per_block),
        *_channel_vector_strides(amax_q), *_channel_vector_strides(amax_k),
        seqs.max_len, h, d, group, float(scale_multiplier),
        PER_TOKEN=per_token, CENTER=mode,
        BALANCE=0 if balance is None else (1 if balance_role == "q" else 2),
        BLOCK_N=block, BLOCK_D=next_pow2(d), VARLEN=seqs.packed, num_warps=_warps(block, d),
    )
    return out, scale


def _channel_vector_strides(vec: torch.Tensor | None) -> tuple[int, int]:
    """(batch, head) strides of a contiguous ``[B, H, D]`` statistics vector."""
    if vec is None:
        return (0, 0)
    assert vec.is_contiguous()
    return (vec.stride(0), vec.stride(1))


@triton.jit
def _convert_v_kernel(
    X, OUT, CENTER_PTR, AMAX, SCALE, CU,
    sxb, sxh, sxn, sxd,
    sob, soh, son, sod,
    scb, sch, scd,
    N, H, D,
    FP8: tl.constexpr, CENTER: tl.constexpr, EXACT_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = batch_head(pid_bh, H)
    start, n = seq_span(CU, b, N, VARLEN)
    if pid_n * BLOCK_N >= n:
        return
    x, rows, offs_d, mask = _load_centered(
        X, CENTER_PTR, b, h, start, pid_n, n,
        sxb, sxh, sxn, sxd, scb, sch, 0, scd, D,
        CENTER, BLOCK_N, BLOCK_D,
    )
    if FP8:
        amax = tl.load(AMAX + b * scb + h * sch + offs_d * scd, mask=offs_d < D, other=0.0)
        s = amax * (1.0 / 448.0)
        s = tl.where(s == 0.0, 1.0, s)
        if pid_n == 0:
            tl.store(SCALE + b * scb + h * sch + offs_d * scd, s, mask=offs_d < D)
        y = to_e4m3(tl.div_rn(x, s[None, :]), EXACT_FP8)
    else:
        y = x.to(tl.float16)
    tl.store(OUT + b * sob + h * soh + (start + rows)[:, None] * son + offs_d[None, :] * sod, y,
             mask=mask)


def convert_v(
    x: torch.Tensor,
    *,
    pv: str,
    center: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    seqs: Seqs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of :func:`lowbit_attn.reference.quant.convert_v` (bit-identical). The E4M3
    values are stored token-contiguous (``[B, H, D, N']``, returned as a transposed view), the
    operand order FP8 tensor cores need."""
    seqs = seqs or dense_seqs(x)
    h, d = x.shape[1], x.shape[-1]
    if pv == "fp8":
        if seqs.packed:
            total = x.shape[0]
            buf = torch.empty((h, d, triton.cdiv(total, 16) * 16), device=x.device,
                              dtype=torch.float8_e4m3fn)
            out = buf[:, :, :total].permute(2, 0, 1)
        else:
            buf = torch.empty((x.shape[0], h, d, triton.cdiv(x.shape[2], 16) * 16),
                              device=x.device, dtype=torch.float8_e4m3fn)
            out = buf[..., : x.shape[2]].transpose(-1, -2)
        scale = torch.empty((seqs.batch, h, d), device=x.device, dtype=torch.float32)
    else:
        out = _new_like_layout(x, seqs, torch.float16)
        scale = None
    block_n = 64
    grid = (triton.cdiv(seqs.max_len, block_n), seqs.batch * h)
    # center, amax and scale are contiguous [B, H, D] channel vectors: one set of strides.
    cstr = (h * d, d, 1)
    for vec in (center, amax):
        assert vec is None or (vec.is_contiguous() and vec.shape == (seqs.batch, h, d))
    _convert_v_kernel[grid](
        x, out, center, amax, scale, seqs.cu_seqlens,
        *bhnd_strides(x, seqs.packed), *bhnd_strides(out, seqs.packed), *cstr,
        seqs.max_len, h, d,
        FP8=pv == "fp8", CENTER=0 if center is None else 1, EXACT_FP8=exact_fp8(),
        BLOCK_N=block_n, BLOCK_D=next_pow2(d), VARLEN=seqs.packed, num_warps=_warps(block_n, d),
    )
    return out, scale


@triton.heuristics({"HAS_KMEAN": lambda args: args["KMEAN"] is not None})
@triton.jit
def _delta_s_kernel(
    QM, K, KMEAN, DS, CUQ, CUK,
    sqb, sqh, sqk, sqd,
    skb, skh, skn, skd,
    smb, smh, smd,
    sdb, sdh, sdq, sdn,
    NQ, NK, HQ, GROUP, D, scale_multiplier,
    HAS_KMEAN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = batch_head(pid_bh, HQ)
    hk = h // GROUP
    k_start, nk = seq_span(CUK, b, NK, VARLEN)
    q_start, nq = seq_span(CUQ, b, NQ, VARLEN)
    if pid_n * BLOCK_N >= nk:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kmask = (cols < nk)[:, None] & dmask[None, :]
    k = tl.load(K + b * skb + hk * skh + (k_start + cols)[:, None] * skn + offs_d[None, :] * skd,
                mask=kmask, other=0.0).to(tl.float32)
    if HAS_KMEAN:
        km = tl.load(KMEAN + b * smb + hk * smh + offs_d * smd, mask=dmask, other=0.0)
        k = tl.where(kmask, k - km[None, :], 0.0)
    for qb in range(0, tl.cdiv(nq, BLOCK_Q)):
        qm = tl.load(QM + b * sqb + h * sqh + qb * sqk + offs_d * sqd, mask=dmask, other=0.0)
        ds = tl.sum(k * qm[None, :], axis=1) * scale_multiplier
        tl.store(DS + b * sdb + h * sdh + qb * sdq + cols * sdn, ds, mask=cols < nk)


def delta_s(
    qm: torch.Tensor,
    k: torch.Tensor,
    k_mean: torch.Tensor | None,
    scale_multiplier: float,
    *,
    block_q: int,
    seqs_q: Seqs | None = None,
    seqs: Seqs | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`lowbit_attn.reference.attention.delta_s` (to rounding)."""
    seqs = seqs or dense_seqs(k)
    seqs_q = seqs_q or Seqs(batch=qm.shape[0], max_len=qm.shape[2] * block_q)
    b, hq, nbq, d = qm.shape
    hkv = k.shape[1]
    out = torch.zeros((b, hq, nbq, seqs.max_len), device=k.device, dtype=torch.float32)
    block_n = 64
    grid = (triton.cdiv(seqs.max_len, block_n), b * hq)
    _delta_s_kernel[grid](
        qm, k, k_mean, out, seqs_q.cu_seqlens, seqs.cu_seqlens,
        *qm.stride(), *bhnd_strides(k, seqs.packed),
        *(k_mean.stride() if k_mean is not None else (0, 0, 0)), *out.stride(),
        seqs_q.max_len, seqs.max_len, hq, hq // hkv, d, float(scale_multiplier),
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=next_pow2(d), VARLEN=seqs.packed,
    )
    return out


@triton.jit
def _lse_shift_kernel(
    Q, KMEAN, OUT, CU,
    sqb, sqh, sqn, sqd, smb, smh, smd, sob, soh, son,
    N, HQ, GROUP, D, softmax_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = batch_head(pid_bh, HQ)
    start, n = seq_span(CU, b, N, VARLEN)
    if pid_n * BLOCK_N >= n:
        return
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < n)[:, None] & (offs_d < D)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + (start + rows)[:, None] * sqn + offs_d[None, :] * sqd,
                mask=mask, other=0.0).to(tl.float32)
    km = tl.load(KMEAN + b * smb + (h // GROUP) * smh + offs_d * smd, mask=offs_d < D, other=0.0)
    shift = tl.sum(q * km[None, :], axis=1) * softmax_scale
    tl.store(OUT + b * sob + h * soh + (start + rows) * son, shift, mask=rows < n)


def lse_shift(
    q: torch.Tensor, k_mean: torch.Tensor, softmax_scale: float, *, seqs: Seqs | None = None
) -> torch.Tensor:
    """Triton twin of :func:`lowbit_attn.reference.attention.lse_shift` (to rounding)."""
    seqs = seqs or dense_seqs(q)
    hq, d = q.shape[1], q.shape[-1]
    out = _per_token_vector(q, seqs)
    block_n = 64
    grid = (triton.cdiv(seqs.max_len, block_n), seqs.batch * hq)
    _lse_shift_kernel[grid](
        q, k_mean, out, seqs.cu_seqlens,
        *bhnd_strides(q, seqs.packed), *k_mean.stride(), *row_strides(out, seqs.packed),
        seqs.max_len, hq, hq // k_mean.shape[1], d, float(softmax_scale),
        BLOCK_N=block_n, BLOCK_D=next_pow2(d), VARLEN=seqs.packed,
    )
    return out


__all__ = [
    "Seqs", "channel_stats", "quantize_int8", "convert_v", "delta_s", "lse_shift",
]

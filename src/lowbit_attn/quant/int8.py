"""Triton kernels that prepare Q, K and V: per-channel statistics, then smoothing, balancing and
quantization fused in one pass per tensor. Twins: ``lowbit_attn.quant.int8_naive``.

Every launcher takes a logical ``[B, H, N, D]`` tensor (any strides) or, with ``seqs`` packed, a
``[total, H, D]`` tensor whose sequences ``cu_seqlens`` delimits; statistics are per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lowbit_attn.core.operands import (
    FP16_V_KEEP_HI, FP16_V_KEEP_LO, THREAD_K_BLOCK, THREAD_Q_SLICE, V_PERMUTED_MIN_KEYS, Seqs,
    dense_seqs, packed_v_tokens, permuted_v_keys,
)
from lowbit_attn.core.triton_helpers import (
    batch_head, bhnd_strides, channel_vector_strides, exact_fp8, key_position, next_pow2,
    packed_v_start, program_heads, row_strides, seq_span, strides, to_e4m3,
)
from lowbit_attn.quant.tile import (
    divided, e4m3_scale, load_centered, quantize_int8_tile, thread_group,
)

CENTERS = {"none": 0, "mean": 1, "block_mean": 2}
# Globals read inside @triton.jit functions must be constexpr.
_KEEP_LO = tl.constexpr(FP16_V_KEEP_LO)
_KEEP_HI = tl.constexpr(FP16_V_KEEP_HI)
_V_MIN_KEYS = tl.constexpr(V_PERMUTED_MIN_KEYS)


# The statistics launch's tiling (H200, 2026-11-30, `decide`'s `prep` step: 3.4-4.6x faster than
# the previous one, 32 channels with four reductions across warps per step, at every shape timed;
# NOTES §27): each program sums, maxima and minima element by element in a tile of 64 rows × 64
# channels, reduced across rows once after its loop; 4 warps.
STATS_BLOCK_D = 64
STATS_BLOCK_N = 64
STATS_WARPS = 4


@triton.jit
def _stats_program(
    X, MEAN, AMAX, CU, b, h, pid_d, x_strides, mean_strides, amax_strides, N, D,
    CENTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    """Channel statistics of ``BLOCK_D`` channels of one (batch, head): the amax about the
    ``CENTER`` (0 none, 1 the mean, 2 each block's mean), and the mean(s) when centering.
    Strides: (batch, head, token, dim) of ``X``, (batch, head, block, dim) of ``MEAN``, (batch,
    head, dim) of ``AMAX``. Centers 0 and 1 keep sums, maxima, minima and the NaN probe element
    by element (``_tile_sums``); a block mean reduces each block of rows as it goes."""
    sxb, sxh, sxn, sxd = x_strides
    smb, smh, smk, smd = mean_strides
    sab, sah, sad = amax_strides
    start, n = seq_span(CU, b, N, VARLEN)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    base = X + b * sxb + h * sxh
    if CENTER == 2:
        amax = tl.zeros([BLOCK_D], dtype=tl.float32)
        poison = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(0, n, BLOCK_N):
            x, mask = _rows(base, start, i, n, offs_d, dmask, sxn, sxd, BLOCK_N)
            poison += tl.sum(x * 0.0, axis=0)
            count = tl.minimum(n - i, BLOCK_N).to(tl.float32)
            bmean = tl.sum(x, axis=0) / count
            bhi = tl.max(tl.where(mask, x, float("-inf")), axis=0)
            blo = tl.min(tl.where(mask, x, float("inf")), axis=0)
            amax = tl.maximum(amax, tl.maximum(bhi - bmean, bmean - blo))
            tl.store(MEAN + b * smb + h * smh + (i // BLOCK_N) * smk + offs_d * smd, bmean,
                     mask=dmask)
    else:
        total, hi, lo, poison = _tile_sums(base, start, n, offs_d, dmask, sxn, sxd, BLOCK_N,
                                           BLOCK_D)
        if CENTER == 1:
            mean = total / tl.maximum(n, 1)  # an empty sequence's mean is 0, as its amax
            amax = tl.maximum(hi - mean, mean - lo)
            tl.store(MEAN + b * smb + h * smh + offs_d * smd, mean, mask=dmask)
        else:
            amax = tl.maximum(hi, -lo)
    amax = tl.where(n > 0, amax, 0.0)  # not -inf: no token, no magnitude
    tl.store(AMAX + b * sab + h * sah + offs_d * sad, amax + poison, mask=dmask)


@triton.jit
def _rows(base, start, i, n, offs_d, dmask, sxn, sxd, BLOCK_N: tl.constexpr):
    """Rows ``i`` to ``i + BLOCK_N`` of one (batch, head) in fp32 (0 past ``n`` and ``dmask``),
    and that mask."""
    rows = i + tl.arange(0, BLOCK_N)
    mask = (rows < n)[:, None] & dmask[None, :]
    # int64 token offsets (start is int64): one head's rows may span 2^31 elements
    x = tl.load(base + (start + rows)[:, None] * sxn + offs_d[None, :] * sxd, mask=mask,
                other=0.0)
    return x.to(tl.float32), mask


@triton.jit
def _tile_sums(base, start, n, offs_d, dmask, sxn, sxd, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """``(sum, max, min, 0·sum)`` of rows 0 to ``n``, each column's, from tiles accumulated
    element by element (masked rows: 0, -inf, +inf, 0) and reduced across rows once."""
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    top = tl.full([BLOCK_N, BLOCK_D], float("-inf"), tl.float32)
    bottom = tl.full([BLOCK_N, BLOCK_D], float("inf"), tl.float32)
    probe = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for i in range(0, n, BLOCK_N):
        x, mask = _rows(base, start, i, n, offs_d, dmask, sxn, sxd, BLOCK_N)
        acc += x
        probe += x * 0.0
        top = tl.maximum(top, tl.where(mask, x, float("-inf")))
        bottom = tl.minimum(bottom, tl.where(mask, x, float("inf")))
    return (tl.sum(acc, axis=0), tl.max(top, axis=0), tl.min(bottom, axis=0),
            tl.sum(probe, axis=0))


@triton.jit
def _channel_stats_kernel(
    X0, MEAN0, AMAX0, CU0, x_strides0, mean_strides0, amax_strides0, N0, H0,
    X1, MEAN1, AMAX1, CU1, x_strides1, mean_strides1, amax_strides1, N1, H1,
    X2, MEAN2, AMAX2, CU2, x_strides2, mean_strides2, amax_strides2, N2, H2,
    NB, D,
    CENTER0: tl.constexpr, CENTER1: tl.constexpr, CENTER2: tl.constexpr,
    BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr,
    BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    """Statistics of up to three tensors in one launch (``CENTERi`` -1: no tensor ``i``); program
    ``pid`` of axis 0 runs (batch, head) ``pid`` of the first tensor, then of the second, ...;
    axis 1 the channels."""
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    n0 = NB * H0
    n1 = NB * H1
    if CENTER0 >= 0 and pid < n0:
        b, h = batch_head(pid, H0)
        _stats_program(X0, MEAN0, AMAX0, CU0, b, h, pid_d, x_strides0, mean_strides0,
                       amax_strides0, N0, D, CENTER0, BLOCK_N0, BLOCK_D, VARLEN)
    elif CENTER1 >= 0 and pid < n0 + n1:
        b, h = batch_head(pid - n0, H1)
        _stats_program(X1, MEAN1, AMAX1, CU1, b, h, pid_d, x_strides1, mean_strides1,
                       amax_strides1, N1, D, CENTER1, BLOCK_N1, BLOCK_D, VARLEN)
    elif CENTER2 >= 0:
        b, h = batch_head(pid - n0 - n1, H2)
        _stats_program(X2, MEAN2, AMAX2, CU2, b, h, pid_d, x_strides2, mean_strides2,
                       amax_strides2, N2, D, CENTER2, BLOCK_N2, BLOCK_D, VARLEN)


class StatsRequest(NamedTuple):
    """One tensor whose channel statistics a launch computes (see :func:`channel_stats`)."""

    x: torch.Tensor
    center: str
    block: int = 0
    seqs: Seqs | None = None


def _stats_args(req: StatsRequest | None, part: int):
    """Buffers, keyword arguments and constexprs of part ``part`` (0, 1, 2) of
    ``_channel_stats_kernel``."""
    if req is None:
        args = dict(X=None, MEAN=None, AMAX=None, CU=None, x_strides=(0,) * 4,
                    mean_strides=(0,) * 4, amax_strides=(0,) * 3, N=1, H=0)
        return None, {f"{name}{part}": value for name, value in args.items()}, -1, STATS_BLOCK_N
    seqs = req.seqs or dense_seqs(req.x)
    x, h, d = req.x, req.x.shape[1], req.x.shape[-1]
    mode = CENTERS[req.center]
    amax = torch.empty((seqs.batch, h, d), device=x.device, dtype=torch.float32)
    if mode == 2:
        nb = triton.cdiv(seqs.max_len, req.block)
        mean = torch.zeros((seqs.batch, h, nb, d), device=x.device, dtype=torch.float32)
        mstrides = mean.stride()
    elif mode == 1:
        mean = torch.empty((seqs.batch, h, d), device=x.device, dtype=torch.float32)
        mstrides = (mean.stride(0), mean.stride(1), 0, mean.stride(2))
    else:
        mean = None
        mstrides = (0, 0, 0, 0)
    args = dict(X=x, MEAN=mean, AMAX=amax, CU=seqs.cu_seqlens,
                x_strides=bhnd_strides(x, seqs.packed), mean_strides=mstrides,
                amax_strides=amax.stride(), N=seqs.max_len, H=h)
    return ((mean, amax), {f"{name}{part}": value for name, value in args.items()}, mode,
            req.block if mode == 2 else STATS_BLOCK_N)


def channel_stats_many(*requests: StatsRequest) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """``(mean, amax)`` of one to three tensors (same batch, head dim and layout) in one launch."""
    if not 1 <= len(requests) <= 3:
        raise ValueError(f"channel_stats_many: 1 to 3 tensors, got {len(requests)}")
    first = requests[0]
    seqs = first.seqs or dense_seqs(first.x)
    parts = [_stats_args(requests[i] if i < len(requests) else None, i) for i in range(3)]
    d = first.x.shape[-1]
    assert all((r.seqs is not None and r.seqs.packed) == seqs.packed for r in requests[1:])
    block_d = min(STATS_BLOCK_D, next_pow2(d))
    grid = (sum(r.x.shape[1] for r in requests) * seqs.batch, triton.cdiv(d, block_d))
    _channel_stats_kernel[grid](
        **parts[0][1], **parts[1][1], **parts[2][1], NB=seqs.batch, D=d,
        CENTER0=parts[0][2], CENTER1=parts[1][2], CENTER2=parts[2][2],
        BLOCK_N0=parts[0][3], BLOCK_N1=parts[1][3], BLOCK_N2=parts[2][3],
        BLOCK_D=block_d, VARLEN=seqs.packed, num_warps=STATS_WARPS,
    )
    return [p[0] for p in parts[: len(requests)]]


def channel_stats(
    x: torch.Tensor, *, center: str, block: int = 0, seqs: Seqs | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Triton twin of :func:`lowbit_attn.quant.int8_naive.channel_stats` (equal to rounding: the
    sums are taken in another order)."""
    return channel_stats_many(StatsRequest(x, center, block, seqs))[0]


@triton.jit
def _int8_program(
    X, OUT, SCALE, CENTER_PTR, AQ, AK, CU, pid_n, b, h,
    x_strides, out_strides, scale_strides, c_strides, aq_strides, ak_strides,
    N, D, GROUP, scale_multiplier,
    GRAN: tl.constexpr, CENTER: tl.constexpr, BALANCE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """Token block ``pid_n`` of one (batch, head) quantized, its scales stored (``GRAN``,
    ``RESIDUAL``: see ``quant.tile.quantize_int8_tile``)."""
    sob, soh, son, sod = out_strides
    ssb, ssh, ssn = scale_strides
    start, n = seq_span(CU, b, N, VARLEN)
    if pid_n * BLOCK_N < n:
        q, scale, rows, offs_d, mask = quantize_int8_tile(
            X, CENTER_PTR, AQ, AK, b, h, start, pid_n, n, x_strides, c_strides, aq_strides,
            ak_strides, D, GROUP, GRAN, CENTER, BALANCE, BLOCK_N, BLOCK_D, RESIDUAL,
        )
        if GRAN == 1:
            tl.store(SCALE + b * ssb + h * ssh + (start + rows) * ssn, scale * scale_multiplier,
                     mask=rows < n)
        elif GRAN >= 2:
            # Each row stores its group's scale (a group's rows store alike), up to the end of
            # the last 16-row slice or 128-key block, so that every group has one.
            span = 16 if GRAN == 2 else 128
            tl.store(SCALE + b * ssb + h * ssh + thread_group(rows, GRAN) * ssn,
                     scale * scale_multiplier, mask=rows < tl.cdiv(n, span) * span)
        else:
            tl.store(SCALE + b * ssb + h * ssh + pid_n * ssn, scale * scale_multiplier)
        tl.store(OUT + b * sob + h * soh + (start + rows)[:, None] * son + offs_d[None, :] * sod,
                 q, mask=mask)


@triton.jit
def _fp16_v_scale(amax):
    """``(2^e, 2^-e)`` of each channel's amax, from its bits. Twin:
    ``reference.quant.fp16_v_scale``."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exp = biased - 127
    keep = (biased == 255) | (amax == 0.0) | ((exp >= _KEEP_LO) & (exp <= _KEEP_HI))
    e = tl.where(keep, 0, tl.maximum(exp - _KEEP_HI, -126))
    return ((e + 127) << 23).to(tl.float32, bitcast=True), \
        ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _convert_v_program(
    X, OUT, CENTER_PTR, AMAX, SCALE, CU, pid_n, b, h, x_strides, out_strides, c_strides, N, D,
    FP8: tl.constexpr, SCALED: tl.constexpr, CENTER: tl.constexpr, EXACT_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
    PERMUTED: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
):
    """``c_strides``: (batch, head, dim) of the ``[B, H, D]`` channel vectors (center, amax,
    scale). ``PERMUTED`` (E4M3, dense): key ``k`` stored at ``key_position(k)``, and the keys up to
    ``permuted_v_keys(n)`` written too, as zeros. Packed E4M3: the sequence from
    ``packed_v_start`` on, zeros up to the next multiple of 16 (``QuantizedQKV``)."""
    sob, soh, son, sod = out_strides
    scb, sch, scd = c_strides
    start, n = seq_span(CU, b, N, VARLEN)
    end = n  # the last stored key + 1 (permuted: the zeros too)
    if PERMUTED:
        end = tl.maximum(tl.cdiv(n, 16) * 16, _V_MIN_KEYS)
    if SCALED:  # FP8 always, fp16 when asked
        offs_c = tl.arange(0, BLOCK_D)
        amax = tl.load(AMAX + b * scb + h * sch + offs_c * scd, mask=offs_c < D, other=0.0)
        if FP8:
            s = e4m3_scale(amax)
        else:
            s, inverse = _fp16_v_scale(amax)
        if pid_n == 0:  # an empty sequence's too: the attention's epilogue reads it
            tl.store(SCALE + b * scb + h * sch + offs_c * scd, s, mask=offs_c < D)
    if pid_n * BLOCK_N < end:
        x, rows, offs_d, mask = load_centered(
            X, CENTER_PTR, b, h, start, pid_n, n, x_strides, (scb, sch, 0, scd), D,
            CENTER, BLOCK_N, BLOCK_D,
        )
        if FP8:
            y = to_e4m3(divided(x, s[None, :], RESIDUAL, GIVEN=True), EXACT_FP8)
        elif SCALED:
            y = (x * inverse[None, :]).to(tl.float16)
        else:
            y = x.to(tl.float16)
        if PERMUTED:  # load_centered gave 0 past the end
            dest = key_position(rows)
            mask = (rows < end)[:, None] & (offs_d < D)[None, :]
        elif VARLEN and FP8:
            dest = packed_v_start(start, b) + rows
            mask = (rows < tl.cdiv(n, 16) * 16)[:, None] & (offs_d < D)[None, :]
        else:
            dest = start + rows
        tl.store(OUT + b * sob + h * soh + dest[:, None] * son + offs_d[None, :] * sod, y,
                 mask=mask)


@triton.heuristics({
    "HAS_INT8": lambda args: args["X"] is not None,
    "HAS_Q": lambda args: args["QX"] is not None,
    "HAS_V": lambda args: args["VX"] is not None,
})
@triton.jit
def _quantize_kernel(
    X, OUT, SCALE, CENTER_PTR, AQ, AK,
    x_strides, out_strides, scale_strides, c_strides, aq_strides, ak_strides,
    H, GROUP, scale_multiplier,
    QX, QOUT, QSCALE, QCENTER, QAQ, QAK,
    qx_strides, qout_strides, qscale_strides, qc_strides, qaq_strides, qak_strides,
    HQ, QGROUP, q_scale_multiplier, CU_Q, N_Q,
    VX, VOUT, VCENTER, VAMAX, VSCALE, vx_strides, vout_strides, vc_strides, HV,
    CU, N, D,
    HAS_INT8: tl.constexpr, GRAN: tl.constexpr, CENTER: tl.constexpr,
    BALANCE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_Q: tl.constexpr, Q_GRAN: tl.constexpr, Q_CENTER: tl.constexpr,
    Q_BALANCE: tl.constexpr, Q_BLOCK_N: tl.constexpr,
    HAS_V: tl.constexpr, FP8: tl.constexpr, V_SCALED: tl.constexpr, V_CENTER: tl.constexpr,
    EXACT_FP8: tl.constexpr,
    V_BLOCK_N: tl.constexpr, V_PERMUTED: tl.constexpr,
    BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, RESIDUAL: tl.constexpr = False,
):
    """INT8 quantization of K (the first INT8 part) and/or Q (the second, ``Q…`` arguments, its
    own sequences ``CU_Q``/``N_Q``) and/or V's conversion, in one launch: program ``(pid_n, pid)``
    runs token block ``pid_n`` of (batch, head) ``pid`` of the first INT8 tensor, then of Q, then
    of V. Strides: (batch, head, token, dim) of ``X``/``OUT``/``VX``/``VOUT``, (batch, head, row)
    of ``SCALE``, (batch, head, block, dim) of ``CENTER_PTR``, (batch, head) of ``AQ``/``AK``,
    (batch, head, dim) of V's channel vectors; Q's likewise."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    batch = tl.num_programs(1) // (H + HQ + HV)
    n_int8 = 0
    n_q = 0
    if HAS_INT8:
        n_int8 = H * batch
    if HAS_Q:
        n_q = HQ * batch
    if HAS_INT8 and pid < n_int8:
        b, h = batch_head(pid, H)
        _int8_program(
            X, OUT, SCALE, CENTER_PTR, AQ, AK, CU, pid_n, b, h, x_strides, out_strides,
            scale_strides, c_strides, aq_strides, ak_strides, N, D, GROUP, scale_multiplier,
            GRAN, CENTER, BALANCE, BLOCK_N, BLOCK_D, VARLEN, RESIDUAL,
        )
    elif HAS_Q and pid < n_int8 + n_q:
        b, h = batch_head(pid - n_int8, HQ)
        _int8_program(
            QX, QOUT, QSCALE, QCENTER, QAQ, QAK, CU_Q, pid_n, b, h, qx_strides, qout_strides,
            qscale_strides, qc_strides, qaq_strides, qak_strides, N_Q, D, QGROUP,
            q_scale_multiplier, Q_GRAN, Q_CENTER, Q_BALANCE, Q_BLOCK_N, BLOCK_D, VARLEN,
            RESIDUAL,
        )
    elif HAS_V:
        b, h = batch_head(pid - n_int8 - n_q, HV)
        _convert_v_program(
            VX, VOUT, VCENTER, VAMAX, VSCALE, CU, pid_n, b, h, vx_strides, vout_strides,
            vc_strides, N, D, FP8, V_SCALED, V_CENTER, EXACT_FP8, V_BLOCK_N, BLOCK_D, VARLEN,
            V_PERMUTED, RESIDUAL,
        )


# The quantizing launch's tiling (H200, 2026-11-30, `decide`'s `prep` step: 1.9-3.7x faster than
# the previous one, 64 or 128 rows on 4 or 8 warps with a division per value, at every shape
# timed; NOTES §27): at D ≤ 128, the parts whose scales leave the tile free (per-token INT8
# without block means, and V) take 32 rows per program; a launch whose parts all do (a call of
# the default recipe) runs 2 warps and takes each quotient from its scale's reciprocal and one
# correction (``quant.tile.divided``: the division's bits). Launches with larger tiles
# (per-block and per-thread scales: their blocks fix them) keep a division per value and
# :func:`_warps`.
QUANT_ROWS = 32


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


def center_strides(center, center_per_block):
    """Strides ``(batch, head, block, dim)`` of a centering vector: ``[B, H, blocks, D]`` per block,
    ``[B, H, D]`` (block stride 0) per sequence; zeros when there is none."""
    if center is None:
        return (0, 0, 0, 0)
    if center_per_block:
        return tuple(center.stride())
    return (center.stride(0), center.stride(1), 0, center.stride(2))


class Int8Request(NamedTuple):
    """Q or K to quantize to INT8 (see :func:`quantize_int8`)."""

    x: torch.Tensor
    granularity: str
    block: int
    center: torch.Tensor | None = None
    center_per_block: bool = False
    balance: tuple[torch.Tensor, torch.Tensor] | None = None
    role: str = "q"
    scale_multiplier: float = 1.0


class VRequest(NamedTuple):
    """V to convert for P·V (see :func:`convert_v`): E4M3 with a scale per channel from
    ``amax``, or fp16 with a power-of-two one where ``amax`` is given. ``permuted`` (E4M3,
    dense): the keys in the stored order of ``QuantizedQKV.v_permuted``."""

    x: torch.Tensor
    pv: str
    center: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    permuted: bool = False


def granularity_code(granularity: str, role: str, block: int) -> int:
    """The quantization kernels' ``GRAN`` for a request: 0 per block, 1 per token, 2 and 3 per
    thread for Q and K (``ValueError`` for a tile those groups do not divide: Q's tiles hold
    whole 16-row slices, K's are one 128-key block)."""
    if granularity == "per_thread":
        if role == "k" and block != THREAD_K_BLOCK:
            raise ValueError(f"per-thread K scales are quantized in tiles of {THREAD_K_BLOCK} "
                             f"keys, got block={block}")
        if role == "q" and block % THREAD_Q_SLICE:
            raise ValueError(f"per-thread Q scales need tiles of whole {THREAD_Q_SLICE}-row "
                             f"slices, got block={block}")
        return 2 if role == "q" else 3
    if granularity not in ("per_block", "per_token"):
        raise ValueError(f"granularity must be 'per_block', 'per_token' or 'per_thread', got "
                         f"{granularity!r}")
    return int(granularity == "per_token")


def _int8_part(req: Int8Request | None, seqs: Seqs):
    """Outputs, keyword arguments and constexprs of the INT8 part of ``_quantize_kernel``."""
    if req is None:
        absent = dict(X=None, OUT=None, SCALE=None, CENTER_PTR=None, AQ=None, AK=None,
                      x_strides=(0,) * 4, out_strides=(0,) * 4, scale_strides=(0,) * 3,
                      c_strides=(0,) * 4, aq_strides=(0,) * 2, ak_strides=(0,) * 2,
                      H=0, GROUP=1, scale_multiplier=1.0)
        return None, absent, dict(GRAN=0, CENTER=0, BALANCE=0, BLOCK_N=64)
    x, h = req.x, req.x.shape[1]
    out = _new_like_layout(x, seqs, torch.int8)
    gran = granularity_code(req.granularity, req.role, req.block)
    per_token = gran == 1
    if per_token:
        scale = _per_token_vector(x, seqs)
    else:  # groups past a short sequence's end stay unwritten; the attention never reads them
        groups = {0: (req.block, 1), 2: (THREAD_Q_SLICE, 8), 3: (THREAD_K_BLOCK, 4)}[gran]
        scale = torch.empty((seqs.batch, h, triton.cdiv(seqs.max_len, groups[0]) * groups[1]),
                            device=x.device)
    mode = 0 if req.center is None else (2 if req.center_per_block else 1)
    amax_q, amax_k = req.balance if req.balance is not None else (None, None)
    group = amax_q.shape[1] // amax_k.shape[1] if req.balance is not None else 1
    args = dict(
        X=x, OUT=out, SCALE=scale, CENTER_PTR=req.center, AQ=amax_q, AK=amax_k,
        x_strides=bhnd_strides(x, seqs.packed), out_strides=bhnd_strides(out, seqs.packed),
        scale_strides=row_strides(scale, seqs.packed and per_token),
        c_strides=center_strides(req.center, req.center_per_block),
        aq_strides=channel_vector_strides(amax_q), ak_strides=channel_vector_strides(amax_k),
        H=h, GROUP=group, scale_multiplier=float(req.scale_multiplier),
    )
    constexprs = dict(
        GRAN=gran, CENTER=mode,
        BALANCE=0 if req.balance is None else (1 if req.role == "q" else 2),
        BLOCK_N=req.block,
    )
    return (out, scale), args, constexprs


def _v_part(req: VRequest | None, seqs: Seqs):
    """Outputs, keyword arguments and constexprs of the V part of ``_quantize_kernel``."""
    if req is None:
        absent = dict(VX=None, VOUT=None, VCENTER=None, VAMAX=None, VSCALE=None,
                      vx_strides=(0,) * 4, vout_strides=(0,) * 4, vc_strides=(0,) * 3, HV=0)
        return None, absent, dict(FP8=False, V_SCALED=False, V_CENTER=0, V_BLOCK_N=64,
                                  V_PERMUTED=False)
    x, h, d = req.x, req.x.shape[1], req.x.shape[-1]
    scaled = req.amax is not None
    if req.pv == "fp8" and not scaled:
        raise ValueError("an E4M3 V needs its amax")
    if req.permuted and (req.pv != "fp8" or seqs.packed):
        raise ValueError("permuted V is E4M3 and dense only")
    if req.pv == "fp8":
        if req.permuted:  # every stored key, the padding too (zeros)
            n_pad = permuted_v_keys(x.shape[2])
            buf = torch.empty((x.shape[0], h, d, n_pad), device=x.device,
                              dtype=torch.float8_e4m3fn)
            out = buf.transpose(-1, -2)
        elif seqs.packed:  # each sequence from a multiple of 16 tokens (QuantizedQKV)
            buf = torch.empty((h, d, packed_v_tokens(x.shape[0], seqs.batch)), device=x.device,
                              dtype=torch.float8_e4m3fn)
            out = buf.permute(2, 0, 1)
        else:
            buf = torch.empty((x.shape[0], h, d, triton.cdiv(x.shape[2], 16) * 16),
                              device=x.device, dtype=torch.float8_e4m3fn)
            out = buf[..., : x.shape[2]].transpose(-1, -2)
    else:
        out = _new_like_layout(x, seqs, torch.float16)
    scale = None
    if scaled:
        scale = torch.empty((seqs.batch, h, d), device=x.device, dtype=torch.float32)
    # center, amax and scale are contiguous [B, H, D] channel vectors: one set of strides.
    for vec in (req.center, req.amax):
        assert vec is None or (vec.is_contiguous() and vec.shape == (seqs.batch, h, d))
    args = dict(VX=x, VOUT=out, VCENTER=req.center, VAMAX=req.amax, VSCALE=scale,
                vx_strides=bhnd_strides(x, seqs.packed),
                vout_strides=bhnd_strides(out, seqs.packed),
                vc_strides=(h * d, d, 1), HV=h)
    constexprs = dict(FP8=req.pv == "fp8", V_SCALED=scaled,
                      V_CENTER=0 if req.center is None else 1, V_BLOCK_N=64,
                      V_PERMUTED=req.permuted)
    return (out, scale), args, constexprs


# The names of the Q part's arguments in ``_quantize_kernel``, by the INT8 part's names.
_Q_NAMES = {
    "X": "QX", "OUT": "QOUT", "SCALE": "QSCALE", "CENTER_PTR": "QCENTER", "AQ": "QAQ", "AK": "QAK",
    "x_strides": "qx_strides", "out_strides": "qout_strides", "scale_strides": "qscale_strides",
    "c_strides": "qc_strides", "aq_strides": "qaq_strides", "ak_strides": "qak_strides",
    "H": "HQ", "GROUP": "QGROUP", "scale_multiplier": "q_scale_multiplier",
    "GRAN": "Q_GRAN", "CENTER": "Q_CENTER", "BALANCE": "Q_BALANCE",
    "BLOCK_N": "Q_BLOCK_N",
}


def _q_part(req: Int8Request | None, seqs: Seqs):
    """Outputs, keyword arguments and constexprs of the Q part of ``_quantize_kernel``."""
    outs, args, const = _int8_part(req, seqs)
    args = {_Q_NAMES[k]: v for k, v in args.items()}
    args.update(CU_Q=seqs.cu_seqlens, N_Q=seqs.max_len)
    return outs, args, {_Q_NAMES[k]: v for k, v in const.items()}


def quantize(
    int8: Int8Request | None = None, v: VRequest | None = None, *, seqs: Seqs | None = None,
    q: Int8Request | None = None, seqs_q: Seqs | None = None,
) -> tuple:
    """Quantize a tensor to INT8 (K) and/or Q to INT8 and/or convert V, in one launch (``seqs``:
    K's and V's sequences, ``seqs_q`` Q's). Returns
    ``(values, scale)`` for ``int8`` and ``v`` (``None`` when not asked), and with ``q`` also
    ``(values, scale)`` for it."""
    present = [r for r in (int8, q, v) if r is not None]
    first = present[0].x
    seqs = seqs or dense_seqs(int8.x if int8 is not None else first)
    seqs_q = seqs_q or (dense_seqs(q.x) if q is not None else seqs)
    outs_i, args_i, const_i = _int8_part(int8, seqs)
    outs_q, args_q, const_q = _q_part(q, seqs_q)
    outs_v, args_v, const_v = _v_part(v, seqs)
    d = first.shape[-1]
    if next_pow2(d) <= 128:  # the head dims measured; one scale per row, whatever the tile
        for const, key in ((const_i, ""), (const_q, "Q_")):
            if const[f"{key}GRAN"] == 1 and const[f"{key}CENTER"] != 2:
                const[f"{key}BLOCK_N"] = QUANT_ROWS
        const_v["V_BLOCK_N"] = QUANT_ROWS
    heads = sum(r.x.shape[1] for r in present)
    block_rows = [c for c, given in ((const_i["BLOCK_N"], int8), (const_q["Q_BLOCK_N"], q),
                                     (const_v["V_BLOCK_N"], v)) if given is not None]
    narrow = max(block_rows) <= QUANT_ROWS
    # axis 0 covers the smaller blocks (and permuted V's zeros); programs past a part's own blocks
    # do nothing
    rows = max(seqs.max_len, seqs_q.max_len,
               V_PERMUTED_MIN_KEYS if v is not None and v.permuted else 0)
    blocks = triton.cdiv(rows, min(block_rows))
    _quantize_kernel[(blocks, seqs.batch * heads)](
        **args_i, **args_q, **args_v, CU=seqs.cu_seqlens, N=seqs.max_len, D=d,
        **const_i, **const_q, **const_v, EXACT_FP8=exact_fp8(),
        BLOCK_D=next_pow2(d), VARLEN=seqs.packed, RESIDUAL=narrow,
        num_warps=2 if narrow else _warps(max(block_rows), d),
    )
    return (outs_i, outs_v) if q is None else (outs_i, outs_v, outs_q)


def quantize_int8(
    x: torch.Tensor,
    *,
    granularity: str,
    block: int,
    center: torch.Tensor | None = None,
    center_per_block: bool = False,
    balance: tuple[torch.Tensor, torch.Tensor] | None = None,
    role: str = "q",
    scale_multiplier: float = 1.0,
    seqs: Seqs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`lowbit_attn.quant.int8_naive.quantize_int8` (bit-identical)."""
    req = Int8Request(x, granularity, block, center, center_per_block, balance, role,
                      scale_multiplier)
    return quantize(req, seqs=seqs)[0]


def convert_v(
    x: torch.Tensor,
    *,
    pv: str,
    center: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    seqs: Seqs | None = None,
    permuted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of :func:`lowbit_attn.quant.int8_naive.convert_v` (bit-identical). The E4M3
    values are stored token-contiguous (``[B, H, D, N']``, returned as a transposed view), the
    operand order FP8 tensor cores need; packed (``seqs``), each sequence from a multiple of 16
    tokens (``[T', H, D]``, see ``QuantizedQKV.v``)."""
    request = VRequest(x, pv, center, amax, permuted=permuted)
    return quantize(v=request, seqs=seqs)[1]


@triton.heuristics({"HAS_KMEAN": lambda args: args["KMEAN"] is not None})
@triton.jit
def _delta_s_kernel(
    QM, K, KMEAN, DS, CUQ, CUK, qm_strides, k_strides, kmean_strides, ds_strides,
    NQ, NK, HQ, GROUP, D, scale_multiplier,
    HAS_KMEAN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    """ΔS of one key block for every query block of one (batch, query head). Strides: (batch,
    head, query block, dim) of ``QM``, (batch, head, token, dim) of ``K``, (batch, head, dim) of
    ``KMEAN``, (batch, head, query block, key) of ``DS``."""
    sqb, sqh, sqk, sqd = qm_strides
    skb, skh, skn, skd = k_strides
    smb, smh, smd = kmean_strides
    sdb, sdh, sdq, sdn = ds_strides
    pid_n, b, h, hk = program_heads(HQ, GROUP)
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
    """Triton twin of :func:`lowbit_attn.inference.naive.delta_s` (to rounding)."""
    seqs = seqs or dense_seqs(k)
    seqs_q = seqs_q or Seqs(batch=qm.shape[0], max_len=qm.shape[2] * block_q)
    b, hq, nbq, d = qm.shape
    hkv = k.shape[1]
    out = torch.zeros((b, hq, nbq, seqs.max_len), device=k.device, dtype=torch.float32)
    block_n = 64
    grid = (triton.cdiv(seqs.max_len, block_n), b * hq)
    _delta_s_kernel[grid](
        QM=qm, K=k, KMEAN=k_mean, DS=out, CUQ=seqs_q.cu_seqlens, CUK=seqs.cu_seqlens,
        qm_strides=qm.stride(), k_strides=bhnd_strides(k, seqs.packed),
        kmean_strides=strides(k_mean, 3), ds_strides=out.stride(),
        NQ=seqs_q.max_len, NK=seqs.max_len, HQ=hq, GROUP=hq // hkv, D=d,
        scale_multiplier=float(scale_multiplier), BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=next_pow2(d), VARLEN=seqs.packed,
    )
    return out


@triton.jit
def _lse_shift_kernel(
    Q, KMEAN, OUT, CU, q_strides, kmean_strides, out_strides, N, HQ, GROUP, D, softmax_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
):
    """Strides: (batch, head, token, dim) of ``Q``, (batch, head, dim) of ``KMEAN``, (batch,
    head, token) of ``OUT``."""
    sqb, sqh, sqn, sqd = q_strides
    smb, smh, smd = kmean_strides
    sob, soh, son = out_strides
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
    """Triton twin of :func:`lowbit_attn.inference.naive.lse_shift` (to rounding)."""
    seqs = seqs or dense_seqs(q)
    hq, d = q.shape[1], q.shape[-1]
    out = _per_token_vector(q, seqs)
    block_n = 64
    grid = (triton.cdiv(seqs.max_len, block_n), seqs.batch * hq)
    _lse_shift_kernel[grid](
        Q=q, KMEAN=k_mean, OUT=out, CU=seqs.cu_seqlens, q_strides=bhnd_strides(q, seqs.packed),
        kmean_strides=k_mean.stride(), out_strides=row_strides(out, seqs.packed), N=seqs.max_len,
        HQ=hq, GROUP=hq // k_mean.shape[1], D=d, softmax_scale=float(softmax_scale),
        BLOCK_N=block_n, BLOCK_D=next_pow2(d), VARLEN=seqs.packed,
    )
    return out


__all__ = [
    "Seqs", "StatsRequest", "Int8Request", "VRequest", "channel_stats", "channel_stats_many",
    "quantize", "quantize_int8", "convert_v", "delta_s", "lse_shift",
]

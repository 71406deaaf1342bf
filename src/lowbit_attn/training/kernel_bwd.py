"""Trainable attention backward (SageBwd numerics), FlashAttention-2 style: S and P recomputed from
the saved base-2 LSE in 64×64 tiles; ``dP = dO·Vᵀ`` (16-bit by default); ``dS = P ∘ (dP - Δ)``;
P and dS quantized per tile (or per row of the product's output) for ``dV = Pᵀ·dO``,
``dK = dSᵀ·Q`` (one program per key block, looping over the query heads of its K/V head and their query blocks; it computes the tile transposed,
``Sᵀ = K·Qᵀ``, so that Pᵀ and dSᵀ are the products' A operands in registers) and ``dQ = dS·K``
(one program per query block). The 8-bit B operands of products over tokens (dO and Q for dV and
dK, K for dQ) come token-contiguous (``token_major``), as an 8-bit wgmma reads them.
``Δ_i = Σ_j P_ij·dP_ij`` comes from a first pass of the dQ kernel over the same
tiles, so that each row of dS sums to zero up to fp32 rounding (``rowsum(dO ∘ O)`` would take the
forward's INT8 P̃·V, not the P and dP that dS uses). No N×N tensor is written.
Twin: ``lowbit_attn.training.naive.backward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core import triton_support
from lowbit_attn.core.arch import get_capability, interpreter_enabled, tensor_memory
from lowbit_attn.core.operands import TRAIN_BLOCK, GradOperands, TrainOperands
from lowbit_attn.core.triton_helpers import (
    LaunchConfig, autotuned, batch_head, mm, next_pow2, next_power_of_2, operand, program_heads,
    quantize_tile, softcap_scores, strides, token_major, window_block_bounds, window_limits,
    window_query_bounds,
)
from lowbit_attn.core.variants import PLAIN, Variant, variant_args

# The dK/dV kernel at D = 128. It holds two 64×D fp32 accumulators and the int32 result of each
# INT8 product before its scales: at 4 warps that spills 408 bytes (ptxas -v, sm_90a, Triton
# 3.6), at 8 warps 8 bytes, but two warpgroups then split the 64×64 score tile along its keys
# (S and dP on wgmma m64n32). 8 warps first.
CONFIGS = {
    "interpreter": [LaunchConfig(4, 1)],
    "sm_80": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_89": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_90": [LaunchConfig(8, 2), LaunchConfig(4, 2), LaunchConfig(8, 3)],
}
# The dQ kernel, and the dK/dV kernel at D <= 64: one warpgroup holds a 64-row tile whole, so
# every product is a wgmma of N >= 64, with no spills (sm_90a: dQ 226 registers at D = 128,
# dK/dV 255 at D = 64); 4 warps first on Hopper.
ONE_WARPGROUP = {
    **CONFIGS,
    "sm_90": [LaunchConfig(4, 2), LaunchConfig(8, 2), LaunchConfig(4, 3)],
}


@triton.jit
def _operand(op, b, h, blk, rows, offs_d, mask, TRANS: tl.constexpr):
    """One block of 64 tokens of an operand, ``[64, D]`` (``[D, 64]`` with ``TRANS``), and the
    block's scale (``blk``: its index). ``op``: ``(values [B, H, N, D], scales [B, H, N/64],
    values' strides, scales' strides)``."""
    X, XS, x_strides, s_strides = op
    sxb, sxh, sxn, sxd = x_strides
    ssb, ssh, ssn = s_strides
    if TRANS:
        x = tl.load(X + b * sxb + h * sxh + rows[None, :] * sxn + offs_d[:, None] * sxd,
                    mask=tl.trans(mask), other=0)
    else:
        x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + offs_d[None, :] * sxd,
                    mask=mask, other=0)
    return x, tl.load(XS + b * ssb + h * ssh + blk * ssn)


@triton.jit
def _operand_pair(x, y, b, h, blk, tokens, offs_d, dmask, N, TRANS: tl.constexpr):
    """Block ``blk`` (``tokens``: its 64 token indices) of two operands of one (batch, head), each
    as :func:`_operand` loads it (tokens from ``N`` on read 0): ``(mask [64, D], x, x's scale,
    y, y's scale)``."""
    mask = (tokens < N)[:, None] & dmask[None, :]
    x_blk, xs = _operand(x, b, h, blk, tokens, offs_d, mask, TRANS)
    y_blk, ys = _operand(y, b, h, blk, tokens, offs_d, mask, TRANS)
    return mask, x_blk, xs, y_blk, ys


@triton.jit
def _row_shift(RS, rs_strides, b, h, rows, NQ, HAS_RS: tl.constexpr, BLOCK: tl.constexpr):
    """The query rows' K-smoothing shift (base 2) from ``RS`` with ``HAS_RS``, else zeros."""
    if HAS_RS:
        srb, srh, srn = rs_strides
        return tl.load(RS + b * srb + h * srh + rows * srn, mask=rows < NQ, other=0.0)
    return tl.zeros([BLOCK], dtype=tl.float32)


@triton.jit
def _tile_p_dp(
    a_s, qs, b_s, ks, a_dp, dos, b_dp, vdps, lse, rows, cols, NQ, NK, causal_offset,
    ds_ptrs, IS_CAUSAL: tl.constexpr, HAS_DS: tl.constexpr, QK_INT8: tl.constexpr,
    DP_INT8: tl.constexpr, EMU_FP32: tl.constexpr, TRANS: tl.constexpr, window=None,
    WINDOWED: tl.constexpr = False, cap=None, SOFTCAP: tl.constexpr = False, shift=None,
):
    """P and dP of one 64×64 tile, S recomputed as the forward computed it (dS is
    ``P ∘ (dP - Δ)``): queries × keys from ``S = Q·Kᵀ`` (``a_s = Q``, ``b_s = Kᵀ``) and ``dP =
    dO·Vᵀ`` (``a_dp = dO``, ``b_dp = Vᵀ``), or with ``TRANS`` keys × queries, Pᵀ and dPᵀ from
    ``K·Qᵀ`` and ``V·dOᵀ``. ``ds_ptrs``: ΔS's pointers in the tile's orientation. ``window``:
    ``(left, right, chunk)`` with ``WINDOWED``; ``SOFTCAP``: the scores soft-capped
    (``cap = (c·log2 e, 2/c, 1/(c·log2 e))``; of the true scores, each query row's K-smoothing
    ``shift`` added back, zeros where K is not smoothed) and the third result ``1 - tanh²``, what
    dS is multiplied by (1.0 without)."""
    s = mm(a_s, b_s, QK_INT8, EMU_FP32) * (qs * ks)
    if TRANS:
        r, c, bias_mask = rows[None, :], cols[:, None], cols[:, None] < NK
    else:
        r, c, bias_mask = rows[:, None], cols[None, :], cols[None, :] < NK
    if HAS_DS:
        s = s + tl.load(ds_ptrs, mask=bias_mask, other=0.0)
    slope = 1.0
    if SOFTCAP:  # the query rows' shift on either axis
        if TRANS:
            sh = shift[None, :]
        else:
            sh = shift[:, None]
        s = softcap_scores(s, cap[0], cap[1], sh)
        t = (s + sh) * cap[2]
        slope = 1.0 - t * t
    if WINDOWED:  # each row's first and last key (the end included): two compares per score
        first, last = window_limits(rows, causal_offset, window[0], window[1], window[2], NK)
        if TRANS:
            first, last = first[None, :], last[None, :]
        else:
            first, last = first[:, None], last[:, None]
        valid = (r < NQ) & (c >= first) & (c <= last)
    else:
        valid = (r < NQ) & (c < NK)
    if IS_CAUSAL:
        valid = valid & (c <= r + causal_offset)
    s = tl.where(valid, s, float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    if TRANS:
        p = tl.exp2(s - lse[None, :])
    else:
        p = tl.exp2(s - lse[:, None])
    dp = mm(a_dp, b_dp, DP_INT8, EMU_FP32) * (dos * vdps)
    return p, dp, slope


@triton.jit
def _train_dkdv_kernel(
    q, k, do_dp, v_dp, do_dv, q_dk, k_dq,
    QM, DS, LSE, DELTA, dk_out, dv_out, BAL, DQ_ACC, RS,
    qm_strides, ds_strides, lse_strides, bal_strides, acc_strides, rs_strides,
    NQ, NK, HKV, GROUP, D, causal_offset, softmax_scale, N_BUCKET,
    left, right, chunk, cap2, two_over, inv_cap2,
    IS_CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, DP_INT8: tl.constexpr,
    DV_INT8: tl.constexpr, DK_INT8: tl.constexpr, DQ_INT8: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_BAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, EMU_FP32: tl.constexpr, TMEM: tl.constexpr,
    PER_ROW: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_RS: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dK and dV of one key block (with ``WINDOWED``, the query blocks of
    ``window_query_bounds``, masked; ``SOFTCAP``: see :func:`_tile_p_dp`, with ``HAS_RS`` the
    rows' K-smoothing shift ``RS``, batch/head/token strides ``rs_strides``). Operands (see
    :func:`_operand`): Q and K for the scores, dO and
    V for dP, dO for dV, Q for dK, K for dQ (``ATOMIC_DQ``). Strides: (batch, head, query block,
    dim) of Q's block means ``QM``; (batch, head, query block, key) of ``DS``; (batch, head, token)
    of ``LSE`` and ``DELTA``; (batch, head, token, dim) of ``DQ_ACC``; (batch, head,
    dim) of the balancing factors ``BAL``."""
    sqmb, sqmh, sqmk, sqmd = qm_strides
    sdsb, sdsh, sdsq, sdsn = ds_strides
    slb, slh, sln = lse_strides
    DK, dk_strides = dk_out  # the outputs with their (batch, head, token, dim) strides
    DV, dv_strides = dv_out
    sdkb, sdkh, sdkn, sdkd = dk_strides
    sdvob, sdvoh, sdvon, sdvod = dv_strides
    sbb, sbh, sbd = bal_strides
    sab, sah, san, sad = acc_strides
    pid_n = tl.program_id(0)
    b, hk = batch_head(tl.program_id(1), HKV)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    nd_mask, k_blk, ks, v_blk, vdps = _operand_pair(k, v_dp, b, hk, pid_n, cols, offs_d, dmask,
                                                    NK, False)
    if ATOMIC_DQ:  # this key block's share of dQ = dS·K, added into an fp32 buffer
        k_dq_blk, kdqs = _operand(k_dq, b, hk, pid_n, cols, offs_d, nd_mask, False)
    dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = NQ
    if WINDOWED:  # the query blocks with a row that sees a key of this block
        lo, hi = window_query_bounds(NQ, pid_n, causal_offset, left, right, chunk, BLOCK, BLOCK)
    elif IS_CAUSAL:  # the first query row that sees this block's first key
        lo = tl.maximum(pid_n * BLOCK - causal_offset, 0) // BLOCK * BLOCK
    offs_m = tl.arange(0, BLOCK)  # the query blocks' rows, from start_m
    for g in range(0, GROUP):
        h = hk * GROUP + g
        for start_m in range(lo, hi, BLOCK):
            rows = start_m + offs_m
            qb = start_m // BLOCK
            # the tile transposed (keys × queries): Pᵀ and dSᵀ are then the products' A operands
            # as they are, in registers; dO and Q (for dV, dK) come token-contiguous
            md_mask, q_t, qs, do_t, dos = _operand_pair(q, do_dp, b, h, qb, rows, offs_d, dmask,
                                                        NQ, True)
            lse = tl.load(LSE + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
            delta = tl.load(DELTA + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
            ds_ptrs = DS
            if HAS_DS:
                ds_ptrs = DS + b * sdsb + h * sdsh + qb * sdsq + cols[:, None] * sdsn
            pt, dpt, slope = _tile_p_dp(
                k_blk, qs, q_t, ks, v_blk, dos, do_t, vdps, lse, rows, cols, NQ, NK,
                causal_offset, ds_ptrs, IS_CAUSAL, HAS_DS, QK_INT8, DP_INT8, EMU_FP32, True,
                (left, right, chunk), WINDOWED, (cap2, two_over, inv_cap2), SOFTCAP,
                _row_shift(RS, rs_strides, b, h, rows, NQ, HAS_RS, BLOCK),
            )
            dst = pt * (dpt - delta[None, :])
            if SOFTCAP:
                dst = dst * slope
            do_dv_blk, dovs = _operand(do_dv, b, h, qb, rows, offs_d, md_mask, False)
            # per row: the scales of keys (Pᵀ's and dSᵀ's rows), and of queries for dQ = dS·K
            pq, ps = quantize_tile(pt, DV_INT8, do_dv[0], PER_ROW=PER_ROW)
            dv += mm(pq, do_dv_blk, DV_INT8, EMU_FP32) * (ps * dovs)
            q_dk_blk, qdks = _operand(q_dk, b, h, qb, rows, offs_d, md_mask, False)
            dsq, dss = quantize_tile(dst, DK_INT8, q_dk[0], TMEM, PER_ROW)
            dk += mm(dsq, q_dk_blk, DK_INT8, EMU_FP32) * (dss * qdks)
            if ATOMIC_DQ:
                if DQ_INT8 != DK_INT8 or PER_ROW:
                    dsq, dss = quantize_tile(dst, DQ_INT8, k_dq[0], TMEM, PER_ROW, AXIS=0)
                tl.atomic_add(DQ_ACC + b * sab + h * sah + rows[:, None] * san + offs_d[None, :] * sad,
                              mm(tl.trans(dsq), k_dq_blk, DQ_INT8, EMU_FP32) * (dss * kdqs),
                              mask=md_mask, sem="relaxed")
            if HAS_DS:  # Q smoothing: dK also gets Σ_i dS_ij·mean(Q_block)
                qm = tl.load(QM + b * sqmb + h * sqmh + qb * sqmk + offs_d * sqmd, mask=dmask,
                             other=0.0)
                dk += tl.sum(dst, axis=1)[:, None] * qm[None, :]
    dk = dk * softmax_scale
    if HAS_BAL:  # K entered as K/α
        dk = dk / tl.load(BAL + b * sbb + hk * sbh + offs_d * sbd, mask=dmask, other=1.0)[None, :]
    wide = cols.to(tl.int64)  # the gradients' rows may span 2^31 elements (NHD, N·H·D)
    tl.store(DK + b * sdkb + hk * sdkh + wide[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=nd_mask)
    tl.store(DV + b * sdvob + hk * sdvoh + wide[:, None] * sdvon + offs_d[None, :] * sdvod,
             dv.to(DV.dtype.element_ty), mask=nd_mask)


@triton.jit
def _train_dq_kernel(
    q, k, do_dp, v_dp, k_dq, DS, LSE, DELTA, DQ, BAL, RS, KM,
    ds_strides, lse_strides, dq_strides, bal_strides, rs_strides, km_strides,
    NQ, NK, HQ, GROUP, D, causal_offset, softmax_scale, N_BUCKET,
    left, right, chunk, cap2, two_over, inv_cap2,
    IS_CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, DP_INT8: tl.constexpr,
    DQ_INT8: tl.constexpr, HAS_DS: tl.constexpr, HAS_BAL: tl.constexpr, EMU_FP32: tl.constexpr,
    TMEM: tl.constexpr, DELTA_PASS: tl.constexpr, PER_ROW: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_RS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query block's dQ, for the Δ in DELTA; with ``DELTA_PASS``, instead, the block's
    ``Δ_i = Σ_j P_ij·dP_ij`` into DELTA (the first launch of the backward). Operands and strides
    as in :func:`_train_dkdv_kernel` (``DQ``: batch, head, token, dim); with ``HAS_RS`` (K
    smoothed under a softcap) dQ also gets ``Σ_j dS_ij·mean K`` (``KM``: batch, head, dim)."""
    sdsb, sdsh, sdsq, sdsn = ds_strides
    slb, slh, sln = lse_strides
    sdqb, sdqh, sdqn, sdqd = dq_strides
    sbb, sbh, sbd = bal_strides
    pid_m, b, h, hk = program_heads(HQ, GROUP)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    md_mask, q_blk, qs, do_dp_blk, dos = _operand_pair(q, do_dp, b, h, pid_m, rows, offs_d, dmask,
                                                       NQ, False)
    lse = tl.load(LSE + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
    if DELTA_PASS:
        delta = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        delta = tl.load(DELTA + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
    dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    ds_rows = tl.zeros([BLOCK], dtype=tl.float32)  # Σ_j dS_ij, with HAS_RS
    shift = _row_shift(RS, rs_strides, b, h, rows, NQ, HAS_RS, BLOCK)
    lo = 0
    hi = NK
    if WINDOWED:
        lo, _, _, hi = window_block_bounds(NK, pid_m, causal_offset, left, right, chunk, BLOCK,
                                           BLOCK)
    elif IS_CAUSAL:
        hi = tl.minimum(NK, (pid_m + 1) * BLOCK + causal_offset)
    offs_n = tl.arange(0, BLOCK)  # the key blocks' keys, from start_n
    for start_n in range(lo, hi, BLOCK):
        cols = start_n + offs_n
        kb = start_n // BLOCK
        nd_mask, kt, ks, v_dpt, vdps = _operand_pair(k, v_dp, b, hk, kb, cols, offs_d, dmask, NK,
                                                     True)
        ds_ptrs = DS
        if HAS_DS:
            ds_ptrs = DS + b * sdsb + h * sdsh + pid_m * sdsq + cols[None, :] * sdsn
        p, dp, slope = _tile_p_dp(
            q_blk, qs, kt, ks, do_dp_blk, dos, v_dpt, vdps, lse, rows, cols, NQ, NK,
            causal_offset, ds_ptrs, IS_CAUSAL, HAS_DS, QK_INT8, DP_INT8, EMU_FP32, False,
            (left, right, chunk), WINDOWED, (cap2, two_over, inv_cap2), SOFTCAP, shift,
        )
        if DELTA_PASS:
            delta += tl.sum(p * dp, axis=1)
        else:
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * slope
            if HAS_RS:
                ds_rows += tl.sum(ds, axis=1)
            k_dq_blk, kdqs = _operand(k_dq, b, hk, kb, cols, offs_d, nd_mask, False)
            dsq, dss = quantize_tile(ds, DQ_INT8, k_dq[0], TMEM, PER_ROW)
            dq += mm(dsq, k_dq_blk, DQ_INT8, EMU_FP32) * (dss * kdqs)
    if DELTA_PASS:
        tl.store(DELTA + b * slb + h * slh + rows * sln, delta, mask=rows < NQ)
    else:
        dq = dq * softmax_scale
        if HAS_BAL:  # Q entered as Q∘α
            dq *= tl.load(BAL + b * sbb + hk * sbh + offs_d * sbd, mask=dmask, other=1.0)[None, :]
        if HAS_RS:  # K entered as K - mean K, and these dS rows do not sum to zero
            skmb, skmh, skmd = km_strides
            km = tl.load(KM + b * skmb + hk * skmh + offs_d * skmd, mask=dmask, other=0.0)
            dq += (ds_rows * softmax_scale)[:, None] * km[None, :]
        tl.store(  # int64 rows: dQ's may span 2^31 elements (NHD, N·H·D)
            DQ + b * sdqb + h * sdqh + rows.to(tl.int64)[:, None] * sdqn + offs_d[None, :] * sdqd,
            dq.to(DQ.dtype.element_ty), mask=md_mask)


@triton.jit
def _dq_finish_kernel(ACC, DQ, BAL, acc_strides, dq_strides, bal_strides,
                      NQ, HQ, GROUP, D, softmax_scale, HAS_BAL: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ from the fp32 buffer the dK/dV kernel added into: times the softmax scale (and α)."""
    sab, sah, san, sad = acc_strides
    sdqb, sdqh, sdqn, sdqd = dq_strides
    sbb, sbh, sbd = bal_strides
    b, h = batch_head(tl.program_id(1), HQ)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    mask = (rows < NQ)[:, None] & dmask[None, :]
    dq = tl.load(ACC + b * sab + h * sah + rows[:, None] * san + offs_d[None, :] * sad, mask=mask,
                 other=0.0) * softmax_scale
    if HAS_BAL:
        dq = dq * tl.load(BAL + b * sbb + (h // GROUP) * sbh + offs_d * sbd, mask=dmask,
                          other=1.0)[None, :]
    tl.store(DQ + b * sdqb + h * sdqh + rows.to(tl.int64)[:, None] * sdqn + offs_d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=mask)


_KEY = ["N_BUCKET", "BLOCK_D", "IS_CAUSAL", "QK_INT8", "DP_INT8", "HAS_DS", "HAS_BAL", "PER_ROW",
        "WINDOWED", "SOFTCAP", "HAS_RS"]
_DKDV_KEY = _KEY + ["DV_INT8", "DK_INT8", "DQ_INT8", "ATOMIC_DQ"]
_dkdv = autotuned(CONFIGS, key=_DKDV_KEY, reset_to_zero=["DQ_ACC"])(_train_dkdv_kernel)
_dkdv_small_d = autotuned(ONE_WARPGROUP, key=_DKDV_KEY,  # D <= 64
                          reset_to_zero=["DQ_ACC"])(_train_dkdv_kernel)
_dq = autotuned(ONE_WARPGROUP, key=_KEY + ["DQ_INT8", "DELTA_PASS"])(_train_dq_kernel)


def launch_args(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, dq, dk, dv, *,
                causal_offset, softmax_scale, mode: str, variant: Variant = PLAIN):
    """``[(kernel, grid, kwargs), ...]`` in launch order for dQ ``mode``: ``"recompute"`` (a dQ
    kernel recomputes S and dP per query block) or ``"atomic"`` (the dK/dV kernel adds dS·K into
    an fp32 buffer); see :mod:`lowbit_attn.core.options`."""
    b, hq, nq, d = ops.q.shape
    hkv, nk = ops.k.shape[1], ops.k.shape[2]
    lse = lse.contiguous()
    delta = torch.empty_like(lse)  # Δ [B, Hq, Nq] fp32, written by the first launch; LSE's strides
    # dQ's K-mean correction (K smoothed under a softcap) is the dQ kernel's: recomputed there
    atomic = mode == "atomic" and ops.row_shift is None
    common = dict(
        q=operand(ops.q, ops.q_scale * ops.qk_multiplier), k=operand(ops.k, ops.k_scale),
        do_dp=operand(grad.do_dp, grad.do_dp_scale), v_dp=operand(ops.v_dp, ops.v_dp_scale),
        k_dq=operand(token_major(ops.k_dq), ops.k_dq_scale), DS=ops.delta_s, LSE=lse,
        DELTA=delta,
        BAL=ops.balance, RS=ops.row_shift, ds_strides=strides(ops.delta_s, 4),
        lse_strides=lse.stride(), rs_strides=strides(ops.row_shift, 3),
        bal_strides=strides(ops.balance, 3), NQ=nq, NK=nk, GROUP=hq // hkv, D=d,
        causal_offset=nk - nq if variant.windowed else (
            0 if causal_offset is None else int(causal_offset)),
        softmax_scale=float(softmax_scale),
        N_BUCKET=min(next_power_of_2(max(nq, nk)), 32768), **variant_args(variant),
        inv_cap2=1.0 / variant_args(variant)["cap2"] if variant.softcap else 0.0,
        IS_CAUSAL=causal_offset is not None and not variant.windowed, QK_INT8="qk" in ops.int8,
        DP_INT8="dp" in ops.int8,
        DQ_INT8="dq" in ops.int8, HAS_DS=ops.delta_s is not None, HAS_BAL=ops.balance is not None,
        HAS_RS=ops.row_shift is not None, EMU_FP32=interpreter_enabled(), TMEM=tensor_memory(get_capability()),
        PER_ROW=ops.backward_granularity == "per_row", BLOCK=TRAIN_BLOCK,
        BLOCK_D=next_pow2(d, minimum=32),
    )
    # the autotuner zeroes DQ_ACC before each timed run, so it must be a tensor in both modes
    acc = torch.zeros((b, hq, nq, d) if atomic else (1, 1, 1, 1), device=dq.device,
                      dtype=torch.float32)
    rows_grid = (triton.cdiv(nq, TRAIN_BLOCK), b * hq)
    rows_pass = dict(common, DQ=dq, dq_strides=dq.stride(), HQ=hq, KM=ops.k_mean,
                     km_strides=strides(ops.k_mean, 3))
    dkdv = _dkdv_small_d if common["BLOCK_D"] <= 64 else _dkdv
    launches = [(_dq, rows_grid, dict(rows_pass, DELTA_PASS=True)), (
        dkdv, (triton.cdiv(nk, TRAIN_BLOCK), b * hkv),
        dict(common, do_dv=operand(grad.do_dv, grad.do_dv_scale),  # token-major: prepare_grad
             q_dk=operand(token_major(ops.q_dk), ops.q_dk_scale), QM=ops.q_mean,
             dk_out=(dk, dk.stride()),
             dv_out=(dv, dv.stride()), DQ_ACC=acc, qm_strides=strides(ops.q_mean, 4),
             acc_strides=acc.stride(), HKV=hkv, DV_INT8="dv" in ops.int8,
             DK_INT8="dk" in ops.int8, ATOMIC_DQ=atomic),
    )]
    if atomic:
        launches.append((_dq_finish_kernel, rows_grid, dict(
            ACC=acc, DQ=dq, BAL=ops.balance, acc_strides=acc.stride(), dq_strides=dq.stride(),
            bal_strides=strides(ops.balance, 3), NQ=nq, HQ=hq, GROUP=hq // hkv, D=d,
            softmax_scale=float(softmax_scale), HAS_BAL=ops.balance is not None,
            BLOCK=TRAIN_BLOCK, BLOCK_D=next_pow2(d, minimum=32),
        )))
    else:
        launches.append((_dq, rows_grid, dict(rows_pass, DELTA_PASS=False)))
    return launches


def backward(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, dq: torch.Tensor,
             dk: torch.Tensor, dv: torch.Tensor, *, causal_offset: int | None,
             softmax_scale: float, mode: str, kernel: str = "triton",
             variant: Variant = PLAIN) -> None:
    """Writes ``dq [B, Hq, Nq, D]``, ``dk, dv [B, Hkv, Nk, D]`` (views in any layout); with
    ``kernel="sm90"`` on the Gluon loops of :mod:`~lowbit_attn.training.kernel_bwd_sm90` where
    they apply (:func:`~lowbit_attn.training.kernel_bwd_sm90.refusal`), else on these. A
    ``variant`` (window, chunk, softcap) runs on these: the sm90 loops do not take it."""
    if kernel == "sm90" and variant.plain and triton_support.gluon_available("hopper"):
        from lowbit_attn.training import kernel_bwd_sm90

        if kernel_bwd_sm90.refusal(ops, grad, mode) is None:
            kernel_bwd_sm90.backward(ops, grad, lse, dq, dk, dv, causal_offset=causal_offset,
                                     softmax_scale=softmax_scale)
            return
    for kernel, grid, kwargs in launch_args(
        ops, grad, lse, dq, dk, dv, causal_offset=causal_offset, softmax_scale=softmax_scale,
        mode=mode, variant=variant,
    ):
        kernel[grid](**kwargs)

"""Trainable attention backward (SageBwd numerics), FlashAttention-2 style: S and P recomputed from
the saved base-2 LSE in 64×64 tiles; ``dP = dO·Vᵀ`` (16-bit by default); ``dS = P ∘ (dP - Δ)``;
P and dS quantized per tile for ``dV = Pᵀ·dO``, ``dK = dSᵀ·Q`` (one program per key block, looping
over the query heads of its K/V head and their query blocks) and ``dQ = dS·K`` (one program per
query block). ``Δ_i = Σ_j P_ij·dP_ij`` comes from a first pass of the dQ kernel over the same
tiles, so that each row of dS sums to zero up to fp32 rounding (``rowsum(dO ∘ O)`` would take the
forward's INT8 P̃·V, not the P and dP that dS uses). No N×N tensor is written.
Twin: ``lowbit_attn.training.naive.backward``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit_attn.core.arch import get_capability, interpreter_enabled
from lowbit_attn.core.operands import TRAIN_BLOCK, GradOperands, TrainOperands
from lowbit_attn.core.triton_helpers import (
    LaunchConfig, batch_head, mm, next_pow2, quantize_tile, triton_configs,
)

CONFIGS = {
    "interpreter": [LaunchConfig(4, 1)],
    # The dK/dV kernel holds two 64×D fp32 accumulators: with D=128 it spills 440 bytes at 4 warps
    # and 32 at 8 (ptxas -v, sm_90a); 8 warps first.
    "sm_80": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_89": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_90": [LaunchConfig(8, 2), LaunchConfig(4, 2), LaunchConfig(8, 3)],
}


@triton.jit
def _operand(X, XS, b, h, blk, rows, offs_d, mask, sxb, sxh, sxn, sxd, ssb, ssh, ssn,
             TRANS: tl.constexpr):
    """One block of 64 tokens of an operand, ``[64, D]`` (``[D, 64]`` with ``TRANS``), and the
    block's scale (``blk``: its index)."""
    if TRANS:
        x = tl.load(X + b * sxb + h * sxh + rows[None, :] * sxn + offs_d[:, None] * sxd,
                    mask=tl.trans(mask), other=0)
    else:
        x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + offs_d[None, :] * sxd,
                    mask=mask, other=0)
    return x, tl.load(XS + b * ssb + h * ssh + blk * ssn)


@triton.jit
def _tile_p_dp(
    q, qs, kt, ks, do_dp, dos, v_dpt, vdps, lse, rows, cols, NQ, NK, causal_offset,
    ds_ptrs, IS_CAUSAL: tl.constexpr, HAS_DS: tl.constexpr, QK_INT8: tl.constexpr,
    DP_INT8: tl.constexpr, EMU_FP32: tl.constexpr,
):
    """P and dP of one 64×64 tile, S recomputed as the forward computed it (dS is
    ``P ∘ (dP - Δ)``)."""
    s = mm(q, kt, QK_INT8, EMU_FP32) * (qs * ks)
    if HAS_DS:
        s = s + tl.load(ds_ptrs, mask=cols[None, :] < NK, other=0.0)
    valid = (rows[:, None] < NQ) & (cols[None, :] < NK)
    if IS_CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None] + causal_offset)
    s = tl.where(valid, s, float("-inf"))
    p = tl.exp2(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None])
    dp = mm(do_dp, v_dpt, DP_INT8, EMU_FP32) * (dos * vdps)
    return p, dp


@triton.jit
def _train_dkdv_kernel(
    Q, K, QS, KS, DO_DP, DOS_DP, V_DP, VS_DP, DO_DV, DOS_DV, Q_DK, QS_DK, QM, DS, LSE, DELTA,
    DK, DV, BAL, K_DQ, KS_DQ, DQ_ACC,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, sqsb, sqsh, sqsn, sksb, sksh, sksn,
    sdpb, sdph, sdpn, sdpd, sdpsb, sdpsh, sdpsn, svb, svh, svn, svd, svsb, svsh, svsn,
    sdvb, sdvh, sdvn, sdvd, sdvsb, sdvsh, sdvsn, sqkb, sqkh, sqkn, sqkd, sqksb, sqksh, sqksn,
    sqmb, sqmh, sqmk, sqmd, sdsb, sdsh, sdsq, sdsn, slb, slh, sln,
    sdkb, sdkh, sdkn, sdkd, sdvob, sdvoh, sdvon, sdvod, sbb, sbh, sbd,
    skqb, skqh, skqn, skqd, skqsb, skqsh, skqsn, sab, sah, san, sad,
    NQ, NK, HKV, GROUP, D, causal_offset, softmax_scale, N_BUCKET,
    IS_CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, DP_INT8: tl.constexpr,
    DV_INT8: tl.constexpr, DK_INT8: tl.constexpr, DQ_INT8: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_BAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, EMU_FP32: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b, hk = batch_head(tl.program_id(1), HKV)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_m = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    nd_mask = (cols < NK)[:, None] & dmask[None, :]
    kt, ks = _operand(K, KS, b, hk, pid_n, cols, offs_d, nd_mask, skb, skh, skn, skd,
                      sksb, sksh, sksn, True)
    v_dpt, vdps = _operand(V_DP, VS_DP, b, hk, pid_n, cols, offs_d, nd_mask, svb, svh, svn, svd,
                           svsb, svsh, svsn, True)
    if ATOMIC_DQ:  # this key block's share of dQ = dS·K, added into an fp32 buffer
        k_dq, kdqs = _operand(K_DQ, KS_DQ, b, hk, pid_n, cols, offs_d, nd_mask, skqb, skqh, skqn,
                              skqd, skqsb, skqsh, skqsn, False)
    dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    lo = 0
    if IS_CAUSAL:  # the first query row that sees this block's first key
        lo = tl.maximum(pid_n * BLOCK - causal_offset, 0) // BLOCK * BLOCK
    for g in range(0, GROUP):
        h = hk * GROUP + g
        for start_m in range(lo, NQ, BLOCK):
            rows = start_m + offs_m
            md_mask = (rows < NQ)[:, None] & dmask[None, :]
            qb = start_m // BLOCK
            q, qs = _operand(Q, QS, b, h, qb, rows, offs_d, md_mask, sqb, sqh, sqn, sqd,
                             sqsb, sqsh, sqsn, False)
            do_dp, dos = _operand(DO_DP, DOS_DP, b, h, qb, rows, offs_d, md_mask, sdpb, sdph,
                                  sdpn, sdpd, sdpsb, sdpsh, sdpsn, False)
            lse = tl.load(LSE + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
            delta = tl.load(DELTA + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
            ds_ptrs = DS
            if HAS_DS:
                ds_ptrs = DS + b * sdsb + h * sdsh + qb * sdsq + cols[None, :] * sdsn
            p, dp = _tile_p_dp(q, qs, kt, ks, do_dp, dos, v_dpt, vdps, lse, rows, cols, NQ, NK,
                               causal_offset, ds_ptrs, IS_CAUSAL, HAS_DS, QK_INT8, DP_INT8,
                               EMU_FP32)
            ds = p * (dp - delta[:, None])
            do_dv, dovs = _operand(DO_DV, DOS_DV, b, h, qb, rows, offs_d, md_mask, sdvb, sdvh,
                                   sdvn, sdvd, sdvsb, sdvsh, sdvsn, False)
            pq, ps = quantize_tile(p, DV_INT8, DO_DV)
            dv += mm(tl.trans(pq), do_dv, DV_INT8, EMU_FP32) * (ps * dovs)
            q_dk, qdks = _operand(Q_DK, QS_DK, b, h, qb, rows, offs_d, md_mask, sqkb, sqkh, sqkn,
                                  sqkd, sqksb, sqksh, sqksn, False)
            dsq, dss = quantize_tile(ds, DK_INT8, Q_DK)
            dk += mm(tl.trans(dsq), q_dk, DK_INT8, EMU_FP32) * (dss * qdks)
            if ATOMIC_DQ:
                if DQ_INT8 != DK_INT8:
                    dsq, dss = quantize_tile(ds, DQ_INT8, K_DQ)
                tl.atomic_add(DQ_ACC + b * sab + h * sah + rows[:, None] * san + offs_d[None, :] * sad,
                              mm(dsq, k_dq, DQ_INT8, EMU_FP32) * (dss * kdqs), mask=md_mask,
                              sem="relaxed")
            if HAS_DS:  # Q smoothing: dK also gets Σ_i dS_ij·mean(Q_block)
                qm = tl.load(QM + b * sqmb + h * sqmh + qb * sqmk + offs_d * sqmd, mask=dmask,
                             other=0.0)
                dk += tl.sum(ds, axis=0)[:, None] * qm[None, :]
    dk = dk * softmax_scale
    if HAS_BAL:  # K entered as K/α
        dk = dk / tl.load(BAL + b * sbb + hk * sbh + offs_d * sbd, mask=dmask, other=1.0)[None, :]
    tl.store(DK + b * sdkb + hk * sdkh + cols[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=nd_mask)
    tl.store(DV + b * sdvob + hk * sdvoh + cols[:, None] * sdvon + offs_d[None, :] * sdvod,
             dv.to(DV.dtype.element_ty), mask=nd_mask)


@triton.jit
def _train_dq_kernel(
    Q, K, QS, KS, DO_DP, DOS_DP, V_DP, VS_DP, K_DQ, KS_DQ, DS, LSE, DELTA, DQ, BAL,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, sqsb, sqsh, sqsn, sksb, sksh, sksn,
    sdpb, sdph, sdpn, sdpd, sdpsb, sdpsh, sdpsn, svb, svh, svn, svd, svsb, svsh, svsn,
    skqb, skqh, skqn, skqd, skqsb, skqsh, skqsn, sdsb, sdsh, sdsq, sdsn, slb, slh, sln,
    sdqb, sdqh, sdqn, sdqd, sbb, sbh, sbd,
    NQ, NK, HQ, GROUP, D, causal_offset, softmax_scale, N_BUCKET,
    IS_CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, DP_INT8: tl.constexpr,
    DQ_INT8: tl.constexpr, HAS_DS: tl.constexpr, HAS_BAL: tl.constexpr, EMU_FP32: tl.constexpr,
    DELTA_PASS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query block's dQ, for the Δ in DELTA; with ``DELTA_PASS``, instead, the block's
    ``Δ_i = Σ_j P_ij·dP_ij`` into DELTA (the first launch of the backward)."""
    pid_m = tl.program_id(0)
    b, h = batch_head(tl.program_id(1), HQ)
    hk = h // GROUP
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    md_mask = (rows < NQ)[:, None] & dmask[None, :]
    q, qs = _operand(Q, QS, b, h, pid_m, rows, offs_d, md_mask, sqb, sqh, sqn, sqd, sqsb, sqsh,
                     sqsn, False)
    do_dp, dos = _operand(DO_DP, DOS_DP, b, h, pid_m, rows, offs_d, md_mask, sdpb, sdph, sdpn,
                          sdpd, sdpsb, sdpsh, sdpsn, False)
    lse = tl.load(LSE + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
    if DELTA_PASS:
        delta = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        delta = tl.load(DELTA + b * slb + h * slh + rows * sln, mask=rows < NQ, other=0.0)
    dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    hi = NK
    if IS_CAUSAL:
        hi = tl.minimum(NK, (pid_m + 1) * BLOCK + causal_offset)
    for start_n in range(0, hi, BLOCK):
        cols = start_n + offs_n
        nd_mask = (cols < NK)[:, None] & dmask[None, :]
        kb = start_n // BLOCK
        kt, ks = _operand(K, KS, b, hk, kb, cols, offs_d, nd_mask, skb, skh, skn, skd,
                          sksb, sksh, sksn, True)
        v_dpt, vdps = _operand(V_DP, VS_DP, b, hk, kb, cols, offs_d, nd_mask, svb, svh, svn, svd,
                               svsb, svsh, svsn, True)
        ds_ptrs = DS
        if HAS_DS:
            ds_ptrs = DS + b * sdsb + h * sdsh + pid_m * sdsq + cols[None, :] * sdsn
        p, dp = _tile_p_dp(q, qs, kt, ks, do_dp, dos, v_dpt, vdps, lse, rows, cols, NQ, NK,
                           causal_offset, ds_ptrs, IS_CAUSAL, HAS_DS, QK_INT8, DP_INT8, EMU_FP32)
        if DELTA_PASS:
            delta += tl.sum(p * dp, axis=1)
        else:
            ds = p * (dp - delta[:, None])
            k_dq, kdqs = _operand(K_DQ, KS_DQ, b, hk, kb, cols, offs_d, nd_mask, skqb, skqh, skqn,
                                  skqd, skqsb, skqsh, skqsn, False)
            dsq, dss = quantize_tile(ds, DQ_INT8, K_DQ)
            dq += mm(dsq, k_dq, DQ_INT8, EMU_FP32) * (dss * kdqs)
    if DELTA_PASS:
        tl.store(DELTA + b * slb + h * slh + rows * sln, delta, mask=rows < NQ)
    else:
        dq = dq * softmax_scale
        if HAS_BAL:  # Q entered as Q∘α
            dq *= tl.load(BAL + b * sbb + hk * sbh + offs_d * sbd, mask=dmask, other=1.0)[None, :]
        tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqn + offs_d[None, :] * sdqd,
                 dq.to(DQ.dtype.element_ty), mask=md_mask)


@triton.jit
def _dq_finish_kernel(ACC, DQ, BAL, sab, sah, san, sad, sdqb, sdqh, sdqn, sdqd, sbb, sbh, sbd,
                      NQ, HQ, GROUP, D, softmax_scale, HAS_BAL: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ from the fp32 buffer the dK/dV kernel added into: times the softmax scale (and α)."""
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
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqn + offs_d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=mask)


_KEY = ["N_BUCKET", "BLOCK_D", "IS_CAUSAL", "QK_INT8", "DP_INT8", "HAS_DS", "HAS_BAL"]
_dkdv = triton.autotune(configs=triton_configs(CONFIGS, get_capability()),
                        key=_KEY + ["DV_INT8", "DK_INT8", "DQ_INT8", "ATOMIC_DQ"],
                        reset_to_zero=["DQ_ACC"])(_train_dkdv_kernel)
_dq = triton.autotune(configs=triton_configs(CONFIGS, get_capability()),
                      key=_KEY + ["DQ_INT8", "DELTA_PASS"])(_train_dq_kernel)


def _strides(x: torch.Tensor | None, n: int) -> tuple:
    return tuple(x.stride()) if x is not None else (0,) * n


DQ_MODES = ("recompute", "atomic")


def dq_mode() -> str:
    """How dQ is computed: ``"recompute"`` (default: a dQ kernel that recomputes S and dP per
    query block; deterministic) or ``"atomic"`` (the dK/dV kernel adds each tile's dS·K into an
    fp32 buffer: two fewer matmuls per tile, summation order not fixed). ``LOWBIT_ATTN_TRAIN_DQ``
    chooses, until a GPU measurement decides the default."""
    mode = os.environ.get("LOWBIT_ATTN_TRAIN_DQ", "recompute")
    if mode not in DQ_MODES:
        raise ValueError(f"LOWBIT_ATTN_TRAIN_DQ must be one of {DQ_MODES}, got {mode!r}")
    return mode


def launch_args(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, dq, dk, dv, *,
                causal_offset, softmax_scale, mode: str = "recompute"):
    """``[(kernel, grid, args, constexprs), ...]`` in launch order for ``mode`` (see
    :func:`dq_mode`)."""
    b, hq, nq, d = ops.q.shape
    hkv, nk = ops.k.shape[1], ops.k.shape[2]
    lse = lse.contiguous()
    delta = torch.empty_like(lse)  # Δ [B, Hq, Nq] fp32, written by the first launch; LSE's strides
    atomic = mode == "atomic"
    qs = ops.q_scale * ops.qk_multiplier
    common = dict(
        IS_CAUSAL=causal_offset is not None, QK_INT8="qk" in ops.int8, DP_INT8="dp" in ops.int8,
        DQ_INT8="dq" in ops.int8, HAS_DS=ops.delta_s is not None, HAS_BAL=ops.balance is not None,
        EMU_FP32=interpreter_enabled(), BLOCK=TRAIN_BLOCK, BLOCK_D=next_pow2(d, minimum=32),
    )
    offset = 0 if causal_offset is None else int(causal_offset)
    bucket = min(triton.next_power_of_2(max(nq, nk)), 32768)
    qk = (ops.q, ops.k, qs, ops.k_scale)
    qk_strides = (*ops.q.stride(), *ops.k.stride(), *qs.stride(), *ops.k_scale.stride())
    dp = (grad.do_dp, grad.do_dp_scale, ops.v_dp, ops.v_dp_scale)
    dp_strides = (*grad.do_dp.stride(), *grad.do_dp_scale.stride(), *ops.v_dp.stride(),
                  *ops.v_dp_scale.stride())
    k_dq = (ops.k_dq, ops.k_dq_scale)
    k_dq_strides = (*ops.k_dq.stride(), *ops.k_dq_scale.stride())
    # the autotuner zeroes DQ_ACC before each timed run, so it must be a tensor in both modes
    acc = torch.zeros((b, hq, nq, d) if atomic else (1, 1, 1, 1), device=dq.device,
                      dtype=torch.float32)
    rows_pass = (
        _dq, (triton.cdiv(nq, TRAIN_BLOCK), b * hq),
        (*qk, *dp, *k_dq, ops.delta_s, lse, delta, dq, ops.balance,
         *qk_strides, *dp_strides, *k_dq_strides,
         *_strides(ops.delta_s, 4), *lse.stride(), *dq.stride(), *_strides(ops.balance, 3),
         nq, nk, hq, hq // hkv, d, offset, float(softmax_scale), bucket),
    )
    launches = [(*rows_pass, dict(common, DELTA_PASS=True)), (
        _dkdv, (triton.cdiv(nk, TRAIN_BLOCK), b * hkv),
        (*qk, *dp, grad.do_dv, grad.do_dv_scale, ops.q_dk, ops.q_dk_scale, ops.q_mean,
         ops.delta_s, lse, delta, dk, dv, ops.balance, *k_dq, acc,
         *qk_strides, *dp_strides, *grad.do_dv.stride(), *grad.do_dv_scale.stride(),
         *ops.q_dk.stride(), *ops.q_dk_scale.stride(), *_strides(ops.q_mean, 4),
         *_strides(ops.delta_s, 4), *lse.stride(), *dk.stride(), *dv.stride(),
         *_strides(ops.balance, 3), *k_dq_strides, *_strides(acc, 4),
         nq, nk, hkv, hq // hkv, d, offset, float(softmax_scale), bucket),
        dict(common, DV_INT8="dv" in ops.int8, DK_INT8="dk" in ops.int8, ATOMIC_DQ=atomic),
    )]
    if atomic:
        launches.append((
            _dq_finish_kernel, (triton.cdiv(nq, TRAIN_BLOCK), b * hq),
            (acc, dq, ops.balance, *acc.stride(), *dq.stride(), *_strides(ops.balance, 3),
             nq, hq, hq // hkv, d, float(softmax_scale)),
            dict(HAS_BAL=ops.balance is not None, BLOCK=TRAIN_BLOCK,
                 BLOCK_D=next_pow2(d, minimum=32)),
        ))
    else:
        launches.append((*rows_pass, dict(common, DELTA_PASS=False)))
    return launches


def backward(ops: TrainOperands, grad: GradOperands, lse: torch.Tensor, dq: torch.Tensor,
             dk: torch.Tensor, dv: torch.Tensor, *, causal_offset: int | None,
             softmax_scale: float, mode: str | None = None) -> None:
    """Writes ``dq [B, Hq, Nq, D]``, ``dk, dv [B, Hkv, Nk, D]`` (views in any layout)."""
    for kernel, grid, args, constexprs in launch_args(
        ops, grad, lse, dq, dk, dv, causal_offset=causal_offset, softmax_scale=softmax_scale,
        mode=mode or dq_mode(),
    ):
        kernel[grid](*args, **constexprs)

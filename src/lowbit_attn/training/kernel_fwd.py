"""Trainable attention forward (SageBwd numerics): INT8 (or 16-bit) Q·Kᵀ, an online softmax in base
2 over key blocks of 64, P̃ quantized per query row as ``round(127·exp2(S - rowmax_block))`` with the
row's scale ``exp2(rowmax_block - m)/127`` folded into the accumulation, INT8 (or 16-bit) P̃·V against
V's per-block scale; writes O and the base-2 LSE for the backward.
Twin: ``lowbit_attn.training.naive.forward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.operands import TRAIN_BLOCK, TrainOperands
from lowbit_attn.core.triton_helpers import (
    LaunchConfig, finish_scores, key_block_bounds, mm, next_pow2, next_power_of_2, online_max,
    normalize_rows, operand, program_heads, round_half_even, strides, token_major,
    autotuned, window_block_bounds, window_limits,
)
from lowbit_attn.core.variants import PLAIN, Variant, variant_args

CONFIGS = {
    "interpreter": [LaunchConfig(4, 1)],
    "sm_80": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_89": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    # 4 warps spill at 128-row tiles with D=128 (ptxas -v, sm_90a): 8 warps only.
    "sm_90": [LaunchConfig(8, 2), LaunchConfig(8, 3)],
}


@triton.jit
def _fwd_block(
    acc, m_i, l_i, q, qs, start_n, rows, keys, ds_base, window, cap,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, PV_INT8: tl.constexpr,
    HAS_DS: tl.constexpr, EMU_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One key block: scores, online softmax, P̃ (INT8 per row, or 16-bit), P̃·V (``MASKED``:
    keys past the end, the causal diagonal, a window's edges). ``rows``: ``(offs_m, offs_n, offs_d, dmask,
    nk, causal_offset)``; ``keys``: ``(k_base, v_base, ks_base, vs_base, V, skn, skd, svn, svd,
    sksn, svsn, sdn)``; ``window``, ``cap``: see ``finish_scores``."""
    offs_m, offs_n, offs_d, dmask, nk, causal_offset = rows
    k_base, v_base, ks_base, vs_base, V, skn, skd, svn, svd, sksn, svsn, sdn = keys
    cols = start_n + offs_n
    nmask = cols < nk
    if MASKED:
        kmask = nmask[None, :] & dmask[:, None]
        vmask = nmask[:, None] & dmask[None, :]
    else:
        kmask = dmask[:, None]
        vmask = dmask[None, :]
    kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd, mask=kmask, other=0)
    ks = tl.load(ks_base + (start_n // BLOCK_N) * sksn)
    s = mm(q, kt, QK_INT8, EMU_FP32) * (qs[:, None] * ks)
    s = finish_scores(s, cols, nmask, offs_m, causal_offset, ds_base, sdn, HAS_DS, MASKED,
                      IS_CAUSAL, window, WINDOWED, cap, SOFTCAP)
    block_max = tl.max(s, axis=1)
    m_new, m_safe, alpha = online_max(m_i, block_max)
    row_scale = tl.exp2(block_max - m_safe)
    p = tl.exp2(s - tl.where(block_max == float("-inf"), 0.0, block_max)[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1) * row_scale
    v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=vmask, other=0)
    vs = tl.load(vs_base + (start_n // BLOCK_N) * svsn)
    if PV_INT8:
        pq = round_half_even(p * 127.0).to(tl.int8)
        unit = 1.0 / 127.0
    else:
        pq = p.to(V.dtype.element_ty)
        unit = 1.0
    pv = mm(pq, v, PV_INT8, EMU_FP32)
    acc = acc * alpha[:, None] + pv * (row_scale * (vs * unit))[:, None]
    return acc, m_new, l_i


@triton.jit
def _train_fwd_kernel(
    q, k, v, DS, O, LSE, RS, ds_strides, o_strides, lse_strides, rs_strides,
    NQ, NK, HQ, GROUP, D, causal_offset, N_BUCKET, left, right, chunk, cap2, two_over,
    IS_CAUSAL: tl.constexpr, QK_INT8: tl.constexpr, PV_INT8: tl.constexpr,
    HAS_DS: tl.constexpr, EMU_FP32: tl.constexpr, QUANT_BLOCK: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_RS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """With ``WINDOWED`` the key blocks of ``window_block_bounds`` (``left``, ``right``,
    ``chunk``; ``causal_offset`` is ``Nk - Nq``), each masked; ``SOFTCAP``: the scores
    soft-capped (``cap2``, ``two_over``; with ``HAS_RS`` of the true scores, each row's K-smoothing
    shift ``RS`` added back, batch/head/token strides ``rs_strides``). Operands ``q``, ``k``, ``v``:
    ``(values [B, H, N, D], scales [B, H, N/QUANT_BLOCK], values'
    strides, scales' strides)``. Strides: (batch, head, query block, key) of ``DS``; (batch, head,
    token, dim) of ``O``; (batch, head, token) of ``LSE``."""
    Q, QS, q_strides, qs_strides = q
    K, KS, k_strides, ks_strides = k
    V, VS, v_strides, vs_strides = v
    sqb, sqh, sqn, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides
    sqsb, sqsh, sqsn = qs_strides
    sksb, sksh, sksn = ks_strides
    svsb, svsh, svsn = vs_strides
    sdb, sdh, sdq, sdn = ds_strides
    sob, soh, son, sod = o_strides
    slb, slh, sln = lse_strides
    pid_m, b, h, hk = program_heads(HQ, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < NQ
    dmask = offs_d < D
    q_blk = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :] * sqd,
                mask=mmask[:, None] & dmask[None, :], other=0)
    # One scale per QUANT_BLOCK rows (two per tile of 128 rows); QS holds s_q·softmax_scale·log2 e.
    qs = tl.load(QS + b * sqsb + h * sqsh + (offs_m // QUANT_BLOCK) * sqsn, mask=mmask, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    ks_base = KS + b * sksb + hk * sksh
    vs_base = VS + b * svsb + hk * svsh
    ds_base = DS
    if HAS_DS:  # BLOCK_M == QUANT_BLOCK: one ΔS row per program
        ds_base = DS + b * sdb + h * sdh + pid_m * sdq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    window = window_limits(offs_m, causal_offset, left, right, chunk, NK)
    if HAS_RS:
        srb, srh, srn = rs_strides
        shift = tl.load(RS + b * srb + h * srh + offs_m * srn, mask=mmask, other=0.0)
    else:
        shift = tl.zeros([BLOCK_M], dtype=tl.float32)
    cap = (cap2, two_over, shift)
    if WINDOWED:  # every block of the window's range masked
        full_lo, _, _, hi = window_block_bounds(NK, pid_m, causal_offset, left, right, chunk,
                                                BLOCK_M, BLOCK_N)
        full_hi = full_lo
    else:
        full_lo = 0
        full_hi, hi = key_block_bounds(NK, pid_m, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    rows = (offs_m, offs_n, offs_d, dmask, NK, causal_offset)
    keys = (k_base, v_base, ks_base, vs_base, V, skn, skd, svn, svd, sksn, svsn, sdn)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q_blk, qs, start_n, rows, keys, ds_base, window,
                                   cap, False, IS_CAUSAL, QK_INT8, PV_INT8, HAS_DS, EMU_FP32,
                                   BLOCK_N, WINDOWED, SOFTCAP)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q_blk, qs, start_n, rows, keys, ds_base, window,
                                   cap, True, IS_CAUSAL, QK_INT8, PV_INT8, HAS_DS, EMU_FP32,
                                   BLOCK_N, WINDOWED, SOFTCAP)
    out, empty = normalize_rows(acc, l_i)
    out = tl.where(empty[:, None], 0.0, out)
    # int64 rows: an NHD output's rows span H·D each, 2^31 elements at N·H·D
    tl.store(O + b * sob + h * soh + offs_m.to(tl.int64)[:, None] * son + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
    tl.store(LSE + b * slb + h * slh + offs_m * sln, m_i + tl.log2(l_i), mask=mmask)


_train_fwd = autotuned(
    CONFIGS,
    key=["N_BUCKET", "BLOCK_D", "IS_CAUSAL", "QK_INT8", "PV_INT8", "HAS_DS", "BLOCK_M",
         "WINDOWED", "SOFTCAP", "HAS_RS"],
)(triton.heuristics({"HAS_DS": lambda a: a["DS"] is not None,
                     "HAS_RS": lambda a: a["RS"] is not None})(_train_fwd_kernel))


def launch_args(ops: TrainOperands, out: torch.Tensor, lse: torch.Tensor, causal_offset,
                variant: Variant = PLAIN):
    """``(grid, kwargs)`` of the kernel's launch (also what ``lowbit-attn inspect`` compiles ahead
    of time)."""
    b, hq, nq, d = ops.q.shape
    hkv, nk = ops.k.shape[1], ops.k.shape[2]
    block_m = TRAIN_BLOCK if ops.delta_s is not None else 2 * TRAIN_BLOCK
    kwargs = dict(
        q=operand(ops.q, ops.q_scale * ops.qk_multiplier), k=operand(ops.k, ops.k_scale),
        v=operand(token_major(ops.v) if "pv" in ops.int8 else ops.v, ops.v_scale),
        DS=ops.delta_s, O=out, LSE=lse, RS=ops.row_shift,
        ds_strides=strides(ops.delta_s, 4), o_strides=out.stride(), lse_strides=lse.stride(),
        rs_strides=strides(ops.row_shift, 3),
        NQ=nq, NK=nk, HQ=hq, GROUP=hq // hkv, D=d,
        causal_offset=nk - nq if variant.windowed else (
            0 if causal_offset is None else int(causal_offset)),
        N_BUCKET=min(next_power_of_2(nk), 32768), **variant_args(variant),
        IS_CAUSAL=causal_offset is not None and not variant.windowed, QK_INT8="qk" in ops.int8,
        PV_INT8="pv" in ops.int8,
        EMU_FP32=interpreter_enabled(), QUANT_BLOCK=TRAIN_BLOCK, BLOCK_M=block_m,
        BLOCK_N=TRAIN_BLOCK, BLOCK_D=next_pow2(d, minimum=32),
    )
    grid = (triton.cdiv(nq, block_m), b * hq)
    return grid, kwargs


def forward(ops: TrainOperands, *, out: torch.Tensor, causal_offset: int | None,
            variant: Variant = PLAIN) -> torch.Tensor:
    """Writes ``out`` (a ``[B, Hq, Nq, D]`` view) and returns the base-2 LSE ``[B, Hq, Nq]`` fp32."""
    lse = torch.empty(ops.q.shape[:3], device=out.device, dtype=torch.float32)
    grid, kwargs = launch_args(ops, out, lse, causal_offset, variant)
    _train_fwd[grid](**kwargs)
    return lse

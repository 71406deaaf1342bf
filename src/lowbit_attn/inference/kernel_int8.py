"""Attention forward with INT8 Q·Kᵀ and fp16 or FP8 P·V (SageAttention / SageAttention2 numerics).

One program computes ``BLOCK_M`` query rows of one (batch, query head) with an online softmax in base
2 over key blocks of ``BLOCK_N``. Scores are ``int32(Q̂·K̂ᵀ)·s_q·s_k`` (+ the Q-smoothing correction);
P̃ goes to fp16, or to E4M3 as ``exp2(S - m + log2 448)``; each key block's P·V is a fresh tensor-core
product added into the fp32 accumulator (two-level accumulation). Twin:
``lowbit_attn.inference.naive.quantized_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core.arch import get_capability
from lowbit_attn.core.operands import QuantizedQKV, Seqs, dense_seqs
from lowbit_attn.core.variants import PLAIN, Variant
from lowbit_attn.core.triton_helpers import (
    LOG2E, LaunchConfig, add_sink, autotune_mode, bhnd_strides, exact_fp8,
    finish_rows, finish_scores, choose, key_block_bounds, key_position, next_pow2,
    next_power_of_2, online_max, p_offset, packed_v_start, program_heads, row_strides, seq_span,
    store_lse, strides, to_e4m3, triton_configs, tuned, window_block_bounds, window_limits,
)
from lowbit_attn.core.variants import cap_args, sink_logits
from lowbit_attn.quant.tile import thread_group

# The kernel's ``GRAN`` of each granularity (the quantization kernels' codes for Q).
GRANULARITY_CODES = {"per_block": 0, "per_token": 1, "per_thread": 2}


# Named per architecture; BLOCK_N comes from the recipe (it is also the per-block quantization
# group of K), and so does BLOCK_Q, Q's group: a program takes BLOCK_M = BLOCK_Q / M_SPLIT of its
# rows. Warps, pipeline depth and M_SPLIT are tuned; ``fits`` (the prune filter, keyed by head dim)
# says which candidates the autotuner tries for a launch.
# ``PIPELINE`` (see the kernel) is a candidate only on Hopper, where Q·Kᵀ is an asynchronous wgmma;
# the autotuner keeps it where it pays. ``M_SPLIT`` 2 is for D = 256 (BLOCK_D 256), and for
# :data:`TRIALS`.
_PLAIN = (("PIPELINE", False),)
_PIPELINED = (("PIPELINE", True),)
_PLAIN_HALVES = (("PIPELINE", False), ("M_SPLIT", 2))
_PIPELINED_HALVES = (("PIPELINE", True), ("M_SPLIT", 2))
CONFIGS = {
    "interpreter": [LaunchConfig(4, 1, _PLAIN)],
    # 4 warps spill at 128-row tiles with D=128 on sm_80/sm_89 (ptxas -v): 8 warps first.
    "sm_80": [LaunchConfig(8, 2, _PLAIN), LaunchConfig(8, 3, _PLAIN), LaunchConfig(4, 2, _PLAIN),
              LaunchConfig(8, 2, _PLAIN_HALVES), LaunchConfig(8, 3, _PLAIN_HALVES)],
    "sm_89": [LaunchConfig(8, 2, _PLAIN), LaunchConfig(8, 3, _PLAIN), LaunchConfig(4, 2, _PLAIN),
              LaunchConfig(8, 2, _PLAIN_HALVES), LaunchConfig(8, 3, _PLAIN_HALVES)],
    # 4 warps (one warpgroup for 128 rows) spill on sm_90a at D=64 too (ptxas -v: 8 to 44 bytes,
    # causal or per-block scales): two warpgroups only.
    "sm_90": [LaunchConfig(8, 2, _PLAIN), LaunchConfig(8, 2, _PIPELINED),
              LaunchConfig(8, 3, _PLAIN), LaunchConfig(8, 3, _PIPELINED),
              LaunchConfig(8, 4, _PLAIN),
              LaunchConfig(8, 2, _PLAIN_HALVES), LaunchConfig(8, 2, _PIPELINED_HALVES),
              LaunchConfig(8, 3, _PLAIN_HALVES), LaunchConfig(8, 3, _PIPELINED_HALVES)],
}
# Candidates no GPU has timed (NOTES §30): 64-row programs on one warpgroup at D ≤ 128, so that
# two programs share an SM (sm_90a: 255 registers or fewer at D = 128, 230 at D = 64, none
# spilled) and one's prologue, pipeline fills and epilogue run under the other's loop (a
# 512-token window's program is half fixed cost, §29). Only ``LOWBIT_ATTN_AUTOTUNE=all`` (the
# benchmarks' tuned and forced rows) tries them; a GPU run's rows make one a measured default or
# delete them.
TRIALS = (LaunchConfig(4, 3, _PIPELINED_HALVES), LaunchConfig(4, 3, _PLAIN_HALVES))
CONFIGS["sm_90"] += TRIALS


@triton.jit
def _scores(q, start_n, offs_n, offs_d, dmask, nk, k_base, skn, skd, MASKED: tl.constexpr):
    """``int32(Q̂·K̂ᵀ)`` of one key block (keys past ``nk`` read as 0 in ``MASKED`` blocks)."""
    cols = start_n + offs_n
    if MASKED:
        kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=(cols < nk)[None, :] & dmask[:, None], other=0)
    else:
        kt = tl.load(k_base + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=dmask[:, None], other=0)
    return tl.dot(q, kt, out_dtype=tl.int32)


@triton.jit
def _key_scales(ks_base, start_n, offs_n, nk, sksn, GRAN: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """K's scales for one key block: one per key (``GRAN`` 1: its own; 2: its per-thread
    group's), or the block's one (0)."""
    cols = start_n + offs_n
    if GRAN == 1:
        return tl.load(ks_base + cols * sksn, mask=cols < nk, other=0.0)
    elif GRAN == 2:  # 1 past the end: the scores there are -inf, and -inf·1 stays -inf
        return tl.load(ks_base + thread_group(cols, 3) * sksn, mask=cols < nk, other=1.0)
    else:
        return tl.load(ks_base + (start_n // BLOCK_N) * sksn)


@triton.jit
def _softmax_pv(
    acc, m_i, l_i, s_int, ks, qs, start_n, offs_m, offs_n, offs_d, dmask, nk, causal_offset,
    v_base, ds_base, svn, svd, sdn, offset,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, GRAN: tl.constexpr, PV_FP8: tl.constexpr,
    HAS_DS: tl.constexpr, EXACT_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
    V_PERMUTED: tl.constexpr, window, WINDOWED: tl.constexpr, cap, SOFTCAP: tl.constexpr,
):
    """The online-softmax step of one key block's integer scores, then its P̃·V.

    Without ΔS the scale is folded into the exp2's argument: ``t = s_int·s_k`` (per token) or
    ``s_int`` (per block, ``c = s_q·s_k``), the row max taken on ``t`` and scaled once per row
    (``max(t)·c = max(t·c)``: scales are positive and rounding is monotone), and
    ``exp2(fma(t, c, -(m - offset)))``: one multiply per score fewer than scaling every score
    first. Per thread (``GRAN`` 2), ``c = s_q·s_k`` of each score's groups, one value per thread
    in a wgmma's fragments: ``max(t·c)`` and ``exp2(fma(t, c, -(m - offset)))``. With
    ``SOFTCAP`` the scores are scaled first, as with ΔS (the tanh needs them whole); ``window``,
    ``cap``: see ``finish_scores``. Twin: ``inference.naive.quantized_attention`` (same
    products, same row max)."""
    cols = start_n + offs_n
    nmask = cols < nk
    if HAS_DS or SOFTCAP:
        if GRAN == 1:
            s = (s_int.to(tl.float32) * ks[None, :]) * qs[:, None]
        elif GRAN == 2:
            s = s_int.to(tl.float32) * (qs[:, None] * ks[None, :])
        else:
            s = s_int.to(tl.float32) * (qs * ks)
        s = finish_scores(s, cols, nmask, offs_m, causal_offset, ds_base, sdn, HAS_DS, MASKED,
                          IS_CAUSAL, window, WINDOWED, cap, SOFTCAP)
        m_new, m_safe, alpha = online_max(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - (m_safe - offset)[:, None])
    elif GRAN == 2:
        t = finish_scores(s_int.to(tl.float32), cols, nmask, offs_m, causal_offset, ds_base, sdn,
                          HAS_DS, MASKED, IS_CAUSAL, window, WINDOWED)
        c = qs[:, None] * ks[None, :]
        m_new, m_safe, alpha = online_max(m_i, tl.max(t * c, axis=1))
        p = tl.exp2(tl.fma(t, c, -(m_safe - offset)[:, None]))
    else:
        if GRAN == 1:
            t = s_int.to(tl.float32) * ks[None, :]
            c = qs
        else:
            t = s_int.to(tl.float32)
            c = tl.zeros_like(m_i) + qs * ks
        t = finish_scores(t, cols, nmask, offs_m, causal_offset, ds_base, sdn, HAS_DS, MASKED,
                          IS_CAUSAL, window, WINDOWED)
        m_new, m_safe, alpha = online_max(m_i, tl.max(t, axis=1) * c)
        p = tl.exp2(tl.fma(t, c[:, None], -(m_safe - offset)[:, None]))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_PERMUTED:
        v_rows = key_position(cols)
    else:
        v_rows = cols
    if MASKED:
        v = tl.load(v_base + v_rows[:, None] * svn + offs_d[None, :] * svd,
                    mask=nmask[:, None] & dmask[None, :], other=0.0)
    else:
        v = tl.load(v_base + v_rows[:, None] * svn + offs_d[None, :] * svd,
                    mask=dmask[None, :], other=0.0)
    if PV_FP8:
        pv = tl.dot(to_e4m3(p, EXACT_FP8), v, out_dtype=tl.float32)
    else:
        pv = tl.dot(p.to(tl.float16), v, out_dtype=tl.float32)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _masked_block(acc, m_i, l_i, q_blk, qs, start_n, rows, keys, ds_base, window, cap,
                  IS_CAUSAL: tl.constexpr, GRAN: tl.constexpr, PV_FP8: tl.constexpr,
                  HAS_DS: tl.constexpr, EXACT_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                  V_PERMUTED: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key block that some rows see in part (the sequence's end, the causal diagonal, a
    window's or chunk's edge): scores, key scales and :func:`_softmax_pv` with masks.
    ``rows``: ``(offs_m, offs_n, offs_d, dmask, nk, causal_offset, sdn, offset)``;
    ``keys``: ``(k_base, skn, skd, ks_base, sksn, v_base, svn, svd)``."""
    offs_m, offs_n, offs_d, dmask, nk, causal_offset, sdn, offset = rows
    k_base, skn, skd, ks_base, sksn, v_base, svn, svd = keys
    s_int = _scores(q_blk, start_n, offs_n, offs_d, dmask, nk, k_base, skn, skd, True)
    ks = _key_scales(ks_base, start_n, offs_n, nk, sksn, GRAN, BLOCK_N)
    return _softmax_pv(
        acc, m_i, l_i, s_int, ks, qs, start_n, offs_m, offs_n, offs_d, dmask, nk, causal_offset,
        v_base, ds_base, svn, svd, sdn, offset, True, IS_CAUSAL, GRAN, PV_FP8, HAS_DS, EXACT_FP8,
        BLOCK_N, V_PERMUTED, window, WINDOWED, cap, SOFTCAP,
    )


@triton.jit
def _attn_fwd_int8_kernel(
    q, k, V, VS, VM, DS, LSH, O, LSE, CUQ, CUK, SINK,
    v_strides, vs_strides, ds_strides, lsh_strides, o_strides, lse_strides,
    NQ, NK, HQ, GROUP, D, causal_offset, N_BUCKET, left, right, chunk, cap2, two_over,
    IS_CAUSAL: tl.constexpr, GRAN: tl.constexpr, PV_FP8: tl.constexpr,
    HAS_VSCALE: tl.constexpr, HAS_VMEAN: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_LSH: tl.constexpr, WRITE_LSE: tl.constexpr,
    EXACT_FP8: tl.constexpr, VARLEN: tl.constexpr, PIPELINE: tl.constexpr,
    V_PERMUTED: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    M_SPLIT: tl.constexpr = 1,
):
    """The LLM variants (``core.variants``): with ``WINDOWED`` the key blocks visited are those
    of ``window_block_bounds`` (``left``/``right``/``chunk``; ``causal_offset`` then is
    ``Nk - Nq``), masked at both ends; ``SOFTCAP`` soft-caps the scores (``cap2``,
    ``two_over``); ``SINK``: ``[Hq]`` fp32 sink logits in base 2, one epilogue term. Operands
    ``q`` and ``k``: ``(INT8 values, scales, values' strides, scales' strides)``. Strides:
    (batch, head, token, dim) of Q, K, ``V``, ``O``; (batch, head, row) of the scales (a row is a
    token or a block), of ``LSH`` and ``LSE``; (batch, head, dim) of V's channel vectors
    ``VS``/``VM``; (batch, head, query block, key) of ``DS``. A program computes
    ``BLOCK_M`` rows, ``1 / M_SPLIT`` of a query block of ``BLOCK_Q`` (per-block scales, ΔS)."""
    Q, QS, q_strides, qs_strides = q
    K, KS, k_strides, ks_strides = k
    sqb, sqh, sqn, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides
    sqsb, sqsh, sqsn = qs_strides
    sksb, sksh, sksn = ks_strides
    svsb, svsh, svsd = vs_strides
    sdb, sdh, sdq, sdn = ds_strides
    slb, slh, sln = lsh_strides
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides
    # int64 batch/head/token bases: offsets of large tensors may pass 2^31 elements
    pid_m, b, h, hk = program_heads(HQ, GROUP)
    q_start, nq = seq_span(CUQ, b, NQ, VARLEN)
    k_start, nk = seq_span(CUK, b, NK, VARLEN)
    if VARLEN:
        causal_offset = nk - nq  # packed sequences align causal masks bottom-right, each its own
    if pid_m * BLOCK_M >= nq:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < nq
    dmask = offs_d < D

    q_blk = tl.load(
        Q + b * sqb + h * sqh + (q_start + offs_m)[:, None] * sqn + offs_d[None, :] * sqd,
        mask=mmask[:, None] & dmask[None, :], other=0,
    )
    if GRAN == 1:
        qs = tl.load(QS + b * sqsb + h * sqsh + (q_start + offs_m) * sqsn, mask=mmask, other=1.0)
    elif GRAN == 2:
        qs = tl.load(QS + b * sqsb + h * sqsh + thread_group(offs_m, 2) * sqsn, mask=mmask,
                     other=1.0)
    else:
        qs = tl.load(QS + b * sqsb + h * sqsh + (pid_m // M_SPLIT) * sqsn)

    # Loop-invariant bases (int64 arithmetic once; the loop adds int32 offsets within a head).
    k_base = K + b * skb + hk * skh + k_start * skn
    if VARLEN and PV_FP8:  # aligned per sequence (QuantizedQKV): V's tile copies asynchronously
        v_base = V + b * svb + hk * svh + packed_v_start(k_start, b) * svn
    else:
        v_base = V + b * svb + hk * svh + k_start * svn
    if GRAN == 1:
        ks_base = KS + b * sksb + hk * sksh + k_start * sksn
    else:
        ks_base = KS + b * sksb + hk * sksh
    ds_base = DS
    if HAS_DS:
        ds_base = DS + b * sdb + h * sdh + (pid_m // M_SPLIT) * sdq
    offset = p_offset(PV_FP8)
    window = window_limits(offs_m, causal_offset, left, right, chunk, nk)
    shift = tl.zeros([BLOCK_M], dtype=tl.float32)  # K smoothing's row shift, base 2
    if (SOFTCAP or HAS_SINK) and HAS_LSH:
        shift = tl.load(LSH + b * slb + h * slh + (q_start + offs_m) * sln, mask=mmask,
                        other=0.0) * LOG2E
    cap = (cap2, two_over, shift)
    rows = (offs_m, offs_n, offs_d, dmask, nk, causal_offset, sdn, offset)
    keys = (k_base, skn, skd, ks_base, sksn, v_base, svn, svd)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if WINDOWED:  # masked blocks at both ends of the window's range, whole ones between
        lo, full_lo, full_hi, hi = window_block_bounds(nk, pid_m, causal_offset, left, right,
                                                       chunk, BLOCK_M, BLOCK_N)
        for start_n in range(lo, full_lo, BLOCK_N):
            acc, m_i, l_i = _masked_block(
                acc, m_i, l_i, q_blk, qs, start_n, rows, keys, ds_base, window, cap, IS_CAUSAL,
                GRAN, PV_FP8, HAS_DS, EXACT_FP8, BLOCK_N, V_PERMUTED, WINDOWED, SOFTCAP,
            )
    else:
        full_lo = 0
        full_hi, hi = key_block_bounds(nk, pid_m, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    if PIPELINE:
        # Q·Kᵀ of the next block (and its key scales, carried in registers) is issued before the
        # softmax of this one, so that the softmax can run under it: Triton waits for the wgmma at
        # once, and ptxas moves the independent work above the wait. Costs a second score tile in
        # registers.
        if full_hi > full_lo:
            s_cur = _scores(q_blk, full_lo, offs_n, offs_d, dmask, nk, k_base, skn, skd, False)
            ks_cur = _key_scales(ks_base, full_lo, offs_n, nk, sksn, GRAN, BLOCK_N)
            for start_n in range(full_lo, full_hi - BLOCK_N, BLOCK_N):
                s_next = _scores(q_blk, start_n + BLOCK_N, offs_n, offs_d, dmask, nk, k_base, skn,
                                 skd, False)
                ks_next = _key_scales(ks_base, start_n + BLOCK_N, offs_n, nk, sksn, GRAN,
                                      BLOCK_N)
                acc, m_i, l_i = _softmax_pv(
                    acc, m_i, l_i, s_cur, ks_cur, qs, start_n, offs_m, offs_n, offs_d, dmask, nk,
                    causal_offset, v_base, ds_base, svn, svd, sdn, offset,
                    False, IS_CAUSAL, GRAN, PV_FP8, HAS_DS, EXACT_FP8, BLOCK_N, V_PERMUTED,
                    window, WINDOWED, cap, SOFTCAP,
                )
                s_cur = s_next
                ks_cur = ks_next
            acc, m_i, l_i = _softmax_pv(
                acc, m_i, l_i, s_cur, ks_cur, qs, full_hi - BLOCK_N, offs_m, offs_n, offs_d, dmask,
                nk, causal_offset, v_base, ds_base, svn, svd, sdn, offset,
                False, IS_CAUSAL, GRAN, PV_FP8, HAS_DS, EXACT_FP8, BLOCK_N, V_PERMUTED,
                window, WINDOWED, cap, SOFTCAP,
            )
    else:
        for start_n in range(full_lo, full_hi, BLOCK_N):
            s_int = _scores(q_blk, start_n, offs_n, offs_d, dmask, nk, k_base, skn, skd, False)
            ks = _key_scales(ks_base, start_n, offs_n, nk, sksn, GRAN, BLOCK_N)
            acc, m_i, l_i = _softmax_pv(
                acc, m_i, l_i, s_int, ks, qs, start_n, offs_m, offs_n, offs_d, dmask, nk,
                causal_offset, v_base, ds_base, svn, svd, sdn, offset,
                False, IS_CAUSAL, GRAN, PV_FP8, HAS_DS, EXACT_FP8, BLOCK_N, V_PERMUTED,
                window, WINDOWED, cap, SOFTCAP,
            )
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _masked_block(acc, m_i, l_i, q_blk, qs, start_n, rows, keys, ds_base,
                                      window, cap, IS_CAUSAL, GRAN, PV_FP8, HAS_DS, EXACT_FP8,
                                      BLOCK_N, V_PERMUTED, WINDOWED, SOFTCAP)

    if VARLEN:  # read again: not kept live through the loops (registers at D = 256)
        q_start, nq = seq_span(CUQ, b, NQ, VARLEN)
        mmask = offs_m < nq
    w = l_i
    if HAS_SINK:  # one term after the loop (m raised to the sink's logit when above)
        sink = tl.load(SINK + h + offs_m * 0) - shift
        acc, m_i, l_i, w = add_sink(acc, m_i, l_i, sink, offset)
    out = finish_rows(acc, l_i, VS, VM, b * svsb + hk * svsh, offs_d, dmask, svsd, HAS_VSCALE,
                      HAS_VMEAN, w, HAS_SINK)
    tl.store(
        O + b * sob + h * soh + (q_start + offs_m)[:, None] * son + offs_d[None, :] * sod,
        out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :],
    )
    if WRITE_LSE:
        rows = q_start + offs_m
        store_lse(LSE, b * seb + h * seh + rows * sen, LSH, b * slb + h * slh + rows * sln,
                  m_i, l_i, offset, mmask, HAS_LSH)


def fits(num_warps: int, block_d: int, block_n: int = 64, pipeline: bool = False,
         m_split: int = 1, block_q: int = 128, num_stages: int = 2, varlen: bool = False) -> bool:
    """Whether a candidate keeps its tiles in registers (ptxas -v, sm_80 to sm_90a). Up to
    D = 128, whole query blocks (``m_split`` 1; their code is unchanged since measured): 4 warps
    at D > 64 spill about 1 KB per thread, and the pipelined loop's second score tile spills
    from 128×128 keys × channels (304 bytes at D=128, block_k=128). At D = 256 (``block_d``
    256) a 128-row program spills on 8 warps and on 16 (708 and 880 B stored, sm_90a; 360 B on
    sm_89): programs of at most 64 rows (``block_q / m_split``) on 8 warps, whose 256
    accumulator columns the two warpgroups share, the pipelined one with 64-key blocks at most,
    and at 2 stages for packed sequences (``varlen``: 3 spill 8 B with FP8 P·V on sm_90a).
    :data:`TRIALS`' 64-row programs on 4 warps at D ≤ 128: 3 stages, 64-key blocks at D = 128,
    not packed (at 2 stages, or packed, 8 to 24 B spill at D = 128 on sm_90a).
    The autotuner does not try the others."""
    if block_d > 128:
        return (num_warps >= 8 and block_q // m_split <= 64
                and not (pipeline and block_n * block_d > 16384)
                and not (pipeline and varlen and num_stages > 2))
    if m_split > 1:
        return (num_warps == 4 and block_q // m_split == 64 and num_stages >= 3 and not varlen
                and block_n * block_d <= 8192)
    return ((num_warps >= 8 or block_d <= 64)
            and not (pipeline and block_n * block_d > 8192))


def can_split(block_q: int, m_split: int) -> bool:
    """Whether a program may take ``1 / m_split`` of a query block of ``block_q`` rows and give
    the same bits: 64 rows at least (two warpgroups' wgmma rows)."""
    return m_split == 1 or (block_q % m_split == 0 and block_q // m_split >= 64)


def _trial(config) -> bool:
    """Whether a ``triton.Config`` is one of :data:`TRIALS`."""
    return LaunchConfig(config.num_warps, config.num_stages,
                        tuple(config.kwargs.items())) in TRIALS


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    block_d, block_n, block_q = args["BLOCK_D"], args["BLOCK_N"], args["BLOCK_Q"]
    valid = [c for c in configs if can_split(block_q, c.kwargs.get("M_SPLIT", 1))
             and (autotune_mode() == "all" or not _trial(c))]
    kept = [c for c in valid
            if fits(c.num_warps, block_d, block_n, bool(c.kwargs.get("PIPELINE")),
                    c.kwargs.get("M_SPLIT", 1), block_q, c.num_stages, args["VARLEN"])]
    return choose(kept or valid, "_attn_fwd_int8_kernel", args)


_attn_fwd_int8 = tuned(triton.autotune(
    configs=triton_configs(CONFIGS, get_capability(), pruned=True),
    prune_configs_by={"early_config_prune": _prune},
    # N_BUCKET (a power of two of the key length, unused by the kernel): tune per length range.
    key=["N_BUCKET", "BLOCK_D", "IS_CAUSAL", "GRAN", "PV_FP8", "VARLEN", "BLOCK_Q", "BLOCK_N",
         "V_PERMUTED", "WINDOWED", "SOFTCAP"],
)(
    triton.heuristics(
        {
            "HAS_VSCALE": lambda a: a["VS"] is not None,
            "HAS_VMEAN": lambda a: a["VM"] is not None,
            "HAS_DS": lambda a: a["DS"] is not None,
            "HAS_LSH": lambda a: a["LSH"] is not None,
            "WRITE_LSE": lambda a: a["LSE"] is not None,
            "BLOCK_M": lambda a: a["BLOCK_Q"] // a.get("M_SPLIT", 1),
            "HAS_SINK": lambda a: a["SINK"] is not None,
        }
    )(_attn_fwd_int8_kernel)
))


def attention(
    qz: QuantizedQKV,
    *,
    out: torch.Tensor,
    pv: str,
    granularity: str,
    block_q: int,
    block_k: int,
    causal_offset: int | None,
    return_lse: bool,
    seqs_q: Seqs | None = None,
    seqs_k: Seqs | None = None,
    variant: Variant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run the kernel; writes ``out`` (logical ``[B, Hq, Nq, D]`` view or packed ``[total, Hq, D]``)
    and returns the LSE (``[B, Hq, Nq]`` or ``[Hq, total]`` fp32) when asked. ``variant``,
    ``sinks``: :class:`~lowbit_attn.core.variants.Variant` and the ``[Hq]`` sink logits (with
    softcap or sinks ``qz`` must hold K smoothing's ``lse_shift`` when K was smoothed)."""
    seqs_q = seqs_q or dense_seqs(qz.q)
    seqs_k = seqs_k or dense_seqs(qz.k)
    packed = seqs_q.packed
    hq, d = qz.q.shape[1], qz.q.shape[-1]
    hkv = qz.k.shape[1]
    per_token = granularity == "per_token"
    lse = None
    if return_lse:
        if packed:
            lse = torch.empty((hq, qz.q.shape[0]), device=out.device, dtype=torch.float32)
        else:
            lse = torch.empty(qz.q.shape[:3], device=out.device, dtype=torch.float32)
    vec = qz.v_scale if qz.v_scale is not None else qz.v_mean
    grid = lambda meta: (triton.cdiv(seqs_q.max_len, meta["BLOCK_M"]), seqs_q.batch * hq)
    if variant.windowed:  # positions aligned bottom-right (packed: per sequence, in the kernel)
        offset = seqs_k.max_len - seqs_q.max_len if not packed else 0
    else:
        offset = 0 if causal_offset is None else int(causal_offset)
    cap2, two_over = cap_args(variant.softcap)
    _attn_fwd_int8[grid](
        q=(qz.q, qz.q_scale, bhnd_strides(qz.q, packed),
           row_strides(qz.q_scale, packed and per_token)),
        k=(qz.k, qz.k_scale, bhnd_strides(qz.k, packed),
           row_strides(qz.k_scale, packed and per_token)),
        V=qz.v, VS=qz.v_scale, VM=qz.v_mean, DS=qz.delta_s, LSH=qz.lse_shift, O=out, LSE=lse,
        CUQ=seqs_q.cu_seqlens, CUK=seqs_k.cu_seqlens, SINK=sink_logits(sinks),
        v_strides=bhnd_strides(qz.v, packed), vs_strides=strides(vec, 3),
        ds_strides=strides(qz.delta_s, 4), lsh_strides=row_strides(qz.lse_shift, packed),
        o_strides=bhnd_strides(out, packed), lse_strides=row_strides(lse, packed),
        NQ=seqs_q.max_len, NK=seqs_k.max_len, HQ=hq, GROUP=hq // hkv, D=d,
        causal_offset=offset, N_BUCKET=min(next_power_of_2(seqs_k.max_len), 32768),
        left=variant.left, right=variant.right, chunk=variant.chunk, cap2=cap2,
        two_over=two_over, WINDOWED=variant.windowed, SOFTCAP=variant.softcap > 0,
        IS_CAUSAL=causal_offset is not None and not variant.windowed,
        GRAN=GRANULARITY_CODES[granularity],
        PV_FP8=pv == "fp8",
        EXACT_FP8=exact_fp8(), VARLEN=packed, V_PERMUTED=qz.v_permuted,
        BLOCK_Q=block_q, BLOCK_N=block_k, BLOCK_D=next_pow2(d, minimum=32),  # int8 MMA: k ≥ 32
    )
    return lse

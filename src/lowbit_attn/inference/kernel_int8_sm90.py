"""Attention forward with INT8 Q·Kᵀ and FP8 or fp16 P·V for Hopper (sm_90a), one warpgroup per
program and several programs per SM (SageAttention2-sm90's design), written in Gluon.

The same numerics as :mod:`lowbit_attn.inference.kernel_int8` on the same operands
(:class:`~lowbit_attn.core.operands.QuantizedQKV`), through the shared softmax step
(``gluon_blocks.softmax_block``): per-token or per-thread scales folded into the exp2's argument,
P̃ to E4M3 as ``exp2(S - m + log2 448)`` or to fp16, each key block's P̃·V a fresh tensor-core
product added into the fp32 accumulator.

One program (4 warps: one warpgroup) computes ``BLOCK_M`` = 64 query rows of one (batch, query
head) over key blocks of ``BLOCK_N`` = 128. Key block ``j``:

1. wait for K(j); Q·K(j)ᵀ, an INT8 wgmma (Q and K in shared memory); wait for it;
2. the softmax of the block in registers (per-thread scales: one FFMA per score for the exp2's
   argument, the q·k scale one value per thread; per-token: a multiply more);
3. P̃ in registers as the A operand of the P̃·V wgmma. E4M3 V's keys are stored permuted in
   groups of 16 (``QuantizedQKV.v_permuted``), so that the columns the Q·Kᵀ accumulator gives a
   thread are, reordered within the thread, those its FP8 A fragment holds: a register relabelling,
   no shuffle and no shared memory. fp16's A fragment is the accumulator's as it is;
4. wait for V(j); P̃·V(j) into a fresh accumulator; wait for it; request K(j+2) and V(j+1) into
   the buffers just read (together: the CTA barriers Triton puts before a TMA request serve
   both); ``acc·α + pv``.

K has two buffers (block ``j`` in ``j % 2``, its load completing phase ``(j // 2) & 1``), V one
(phase ``j & 1``). Nothing overlaps inside a program but the loads: the SM overlaps one program's
softmax with another's products. Registers (≤ 168 per thread for 3 programs per SM, ≤ 255 for 2)
and shared memory (Q, two K tiles and one V tile: 56 KB at D = 128) allow several programs per
SM; NOTES §17 says how many each variant gets.

Scope: dense inputs, per-token or per-thread scales, FP8 P·V (E4M3 V permuted) or fp16 P·V,
``block_k`` 128 (the twin walks the keys in the same blocks), D = 64 or 128, causal or not, GQA,
LSE (with the K-smoothing shift), a sliding window or chunk (only the key blocks of
``window_block_bounds``, masked at both ends) and sinks (one term after the loop). Refused before
launch (the Triton kernel runs): packed sequences, per-block scales, ΔS (``smooth_q``), softcap
(a tanh per score). Twin:
``lowbit_attn.inference.naive.quantized_attention``. Written for the Gluon Hopper API of the
Triton series ``core.triton_support.GLUON_SERIES["hopper"]`` names. Opt-in
(``LOWBIT_ATTN_KERNEL=sm90``, admitted per device by :mod:`~lowbit_attn.inference.gluon_check`):
no GPU has run it yet.
"""

from __future__ import annotations

import contextvars

import torch
import triton

from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("hopper", "lowbit_attn.inference.kernel_int8_sm90")

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from lowbit_attn.core.operands import V_PERMUTED_MIN_KEYS, QuantizedQKV, Seqs, permuted_v_keys
from lowbit_attn.core.triton_helpers import (
    LOG2E, add_sink, bhnd_strides, key_block_bounds, p_offset, program_heads, row_strides,
    strides, window_block_bounds,
)
from lowbit_attn.core.variants import PLAIN, Variant, sink_logits
from lowbit_attn.inference.gluon_blocks import (
    check_tma_operands, descriptors, key_scales, register_operand, scales_of_rows, softmax_block,
    thread_view, tile_offsets, tma_load, tma_scratch, v_box, v_operand, write_rows,
)
from lowbit_attn.inference.naive import POLY_SHARES
from lowbit_attn.quant.tile import thread_group

NUM_WARPS = 4  # one warpgroup
BLOCK_M = 64
BLOCK_N = 128
HEAD_DIMS = (64, 128)
GRANULARITIES = ("per_token", "per_thread")
K_STAGES = 1  # K's buffers by default (see attention)
assert BLOCK_N <= V_PERMUTED_MIN_KEYS  # V's descriptor never spans more keys than are stored
# The K scales' load layout (per token): one key per thread.
_KEYS = gl.constexpr(gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))



# NK and NQ are never specialized: a launch with one key (NK == 1, a constant to Triton) compiled
# a variant whose masked key columns all hold one P̃ value, and ptxas 12.8 (Triton 3.6's) packs
# those E4M3 bytes from a register it never wrote (F2FP ... MERGE_C over a stale register: a
# Q scale's low bits), NaN rows on an H200 (NOTES, the one-key failure).
@gluon.jit(do_not_specialize=["NQ", "NK"])
def _attn_fwd_sm90_kernel(
    q, k, V, VS, VM, LSH, O, LSE, SINK,
    v_strides, vs_strides, lsh_strides, o_strides, lse_strides,
    NQ, NK, HQ, GROUP, D, causal_offset, left, right, chunk,
    IS_CAUSAL: gl.constexpr, HAS_VSCALE: gl.constexpr, HAS_VMEAN: gl.constexpr,
    HAS_LSH: gl.constexpr, WRITE_LSE: gl.constexpr, PER_THREAD: gl.constexpr,
    PV_FP8: gl.constexpr, BLOCK_D: gl.constexpr, K_STAGES: gl.constexpr, POLY: gl.constexpr,
    WINDOWED: gl.constexpr, HAS_SINK: gl.constexpr,
):
    """Operands ``q`` and ``k``: ``(INT8 values, scales, values' strides, scales' strides)`` as
    in ``kernel_int8`` (scales per token ``[B, H, N]`` or per thread ``[B, H, groups]``).
    Strides: (batch, head, token, dim) of Q, K, ``V`` (E4M3 V: its stored ``[B, H, N', D]``
    view, token stride 1), ``O``; (batch, head, row) of the scales, ``LSH`` and ``LSE``; (batch,
    head, dim) of V's channel vectors ``VS``/``VM``.

    The LLM variants as in ``kernel_int8``: with ``WINDOWED`` (not with ``IS_CAUSAL``) the key
    blocks visited are ``window_block_bounds``'s (``left``/``right``/``chunk``, ``causal_offset``
    then ``Nk - Nq``), masked at both ends, whole between; ``HAS_SINK``: ``SINK`` ``[Hq]`` fp32
    sink logits in base 2, one term after the loop (``add_sink``)."""
    Q, QS, q_strides, qs_strides = q
    K, KS, k_strides, ks_strides = k
    sqb, sqh, sqn, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides
    sqsb, sqsh, sqsn = qs_strides
    sksb, sksh, sksn = ks_strides
    svsb, svsh, svsd = vs_strides
    slb, slh, sln = lsh_strides
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides
    BM: gl.constexpr = 64
    BN: gl.constexpr = 128

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_D, 32 if PV_FP8 else 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(
        operand_index=0, parent=o_layout, k_width=4 if PV_FP8 else 2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BLOCK_D], gl.int8)
    k_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BLOCK_D], gl.int8)
    PV_TYPE: gl.constexpr = gl.float8e4nv if PV_FP8 else gl.float16
    V_TILE: gl.constexpr = [BLOCK_D, BN] if PV_FP8 else [BN, BLOCK_D]
    v_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(V_TILE, PV_TYPE)

    pid_m, b, h, hk = program_heads(HQ, GROUP)
    nq = NQ
    nk = NK
    if pid_m * BM >= nq:
        return

    offs_m, offs_n, offs_d, mmask, dmask = tile_offsets(pid_m, nq, D, BM, BN, BLOCK_D, rows_s,
                                                        cols_s, cols_o)

    q_desc, k_desc, v_desc = descriptors(
        Q, K, V, b, h, hk, nq, nk, D, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, svd, BM, BN,
        BLOCK_D, q_smem_layout, k_smem_layout, v_smem_layout, PV_FP8, PV_FP8)
    q_smem = gl.allocate_shared_memory(gl.int8, [BM, BLOCK_D], q_smem_layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [K_STAGES, BN, BLOCK_D], k_smem_layout)
    v_smem = gl.allocate_shared_memory(PV_TYPE, V_TILE, v_smem_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
    mbarrier.init(v_bar, count=1)

    if PER_THREAD:
        # The rows' and each key block's four scales in the slices of the score tile's
        # [64, 16, 4, 2] view (gluon_blocks.thread_view): one q and one k scale per thread.
        view: gl.constexpr = thread_view(
            gl.zeros([BM, BN], gl.float32, layout=s_layout)).type.layout
        pair: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, view))
        rows_t = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, pair))
        qs = gl.load(QS + b * sqsb + h * sqsh + thread_group(rows_t, 2).to(gl.int64) * sqsn,
                     mask=rows_t < nq, other=1.0)
        ks_ptr = KS + b * sksb + hk * sksh + gl.arange(0, 4, layout=gl.SliceLayout(0, pair)) * sksn
        ks_step = 4 * sksn
    else:
        qs, ks_ptr = scales_of_rows(QS, KS, b, h, hk, pid_m, offs_m, mmask, sqsb, sqsh, sqsn,
                                    sksb, sksh, sksn, BN, _KEYS, True)
        ks_step = BN * sksn

    m_i = gl.full([BM], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.full([BM], 0.0, gl.float32, layout=rows_s)
    acc = gl.zeros([BM, BLOCK_D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BM, BN], gl.int32, layout=s_layout)
    zero_o = gl.zeros([BM, BLOCK_D], gl.float32, layout=o_layout)

    # Key blocks first + j for j in [0, n_blocks): masked below n_lo, whole below n_full, masked
    # from there (j, counted from 0, picks K's buffer and the barriers' phases).
    if WINDOWED:
        lo, full_lo, full_hi, hi = window_block_bounds(nk, pid_m, causal_offset, left, right,
                                                       chunk, BM, BN)
        first = lo // BN
        n_blocks = gl.cdiv(hi - lo, BN)
        n_lo = (full_lo - lo) // BN
        n_full = (full_hi - lo) // BN
        ks_ptr += first * ks_step
    else:
        first = 0
        full_hi, hi = key_block_bounds(nk, pid_m, causal_offset, IS_CAUSAL, BM, BN)
        n_blocks = gl.cdiv(hi, BN)
        n_lo = 0
        n_full = full_hi // BN
    window = (left, right, chunk)
    k_bytes: gl.constexpr = BN * BLOCK_D
    v_bytes: gl.constexpr = BLOCK_D * BN if PV_FP8 else 2 * BLOCK_D * BN
    if n_blocks > 0:
        mbarrier.expect(q_bar, BM * BLOCK_D)
        tma_load(q_desc, [pid_m * BM, 0], q_bar, q_smem)
        for i in gl.static_range(K_STAGES):
            more = i < n_blocks
            mbarrier.expect(k_bars.index(i), k_bytes, pred=more)
            tma_load(k_desc, [(first + i) * BN, 0], k_bars.index(i), k_smem.index(i), pred=more)
        mbarrier.expect(v_bar, v_bytes)
        v0, v1 = v_box(first, BN, PV_FP8)
        tma_load(v_desc, [v0, v1], v_bar, v_smem)
        mbarrier.wait(q_bar, 0)
        if WINDOWED:  # the window's first edge
            for j in range(0, n_lo):
                acc, m_i, l_i, ks_ptr = _step(
                    j, first, acc, m_i, l_i, qs, ks_ptr, ks_step, offs_m, offs_n, nk,
                    causal_offset, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bar, k_desc,
                    v_desc, zero_s, zero_o, a_layout, True, IS_CAUSAL, PER_THREAD, PV_FP8,
                    BN, BLOCK_D, cols_s, K_STAGES, POLY, window, WINDOWED)
        for j in range(n_lo, n_full):
            acc, m_i, l_i, ks_ptr = _step(
                j, first, acc, m_i, l_i, qs, ks_ptr, ks_step, offs_m, offs_n, nk, causal_offset,
                n_blocks, q_smem, k_smem, v_smem, k_bars, v_bar, k_desc, v_desc, zero_s,
                zero_o, a_layout, False, IS_CAUSAL, PER_THREAD, PV_FP8, BN, BLOCK_D, cols_s,
                K_STAGES, POLY, window, WINDOWED)
        for j in range(n_full, n_blocks):
            acc, m_i, l_i, ks_ptr = _step(
                j, first, acc, m_i, l_i, qs, ks_ptr, ks_step, offs_m, offs_n, nk, causal_offset,
                n_blocks, q_smem, k_smem, v_smem, k_bars, v_bar, k_desc, v_desc, zero_s,
                zero_o, a_layout, True, IS_CAUSAL, PER_THREAD, PV_FP8, BN, BLOCK_D, cols_s,
                K_STAGES, POLY, window, WINDOWED)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bars.index(i))
    mbarrier.invalidate(v_bar)

    offs_mo = pid_m * BM + gl.arange(0, BM, layout=rows_o)
    w = l_i
    if HAS_SINK:  # one term after the loop, in the output's row layout (acc's rows)
        sink = gl.load(SINK + h + offs_mo * 0)
        if HAS_LSH:  # in the smoothed scores' frame
            sink = sink - gl.load(LSH + b * slb + h * slh + offs_mo.to(gl.int64) * sln,
                                  mask=offs_mo < nq, other=0.0) * LOG2E
        acc, m_o, l_o, w = add_sink(acc, gl.convert_layout(m_i, rows_o),
                                    gl.convert_layout(l_i, rows_o), sink, p_offset(PV_FP8))
        m_i = gl.convert_layout(m_o, rows_s)
        l_i = gl.convert_layout(l_o, rows_s)
    write_rows(acc, m_i, l_i, O, LSE, LSH, VS, VM, b, h, hk, nq, offs_m, offs_mo, offs_d, dmask,
               svsb, svsh, svsd, sob, soh, son, sod, seb, seh, sen, slb, slh, sln, rows_o,
               WRITE_LSE, HAS_VSCALE, HAS_VMEAN, HAS_LSH, PV_FP8, w, HAS_SINK)


@gluon.jit
def _step(j, first, acc, m_i, l_i, qs, ks_ptr, ks_step, offs_m, offs_n, nk, causal_offset,
          n_blocks, q_smem, k_smem, v_smem, k_bars, v_bar, k_desc, v_desc, zero_s, zero_o,
          a_layout: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
          PER_THREAD: gl.constexpr, PV_FP8: gl.constexpr, BN: gl.constexpr,
          BLOCK_D: gl.constexpr, cols_s: gl.constexpr, K_STAGES: gl.constexpr,
          POLY: gl.constexpr, window, WINDOWED: gl.constexpr):
    """The ``j``-th key block visited, key block ``first + j`` (``first``: 0 without a window):
    Q·Kᵀ, the softmax, P̃·V(j) from registers, K(j+2) and V(j+1) requested, ``acc·α + pv``.
    Returns ``(acc, m, l)`` and ``ks_ptr`` moved to the next block's K scales."""
    blk = first + j
    if K_STAGES == 1:
        stage = 0
        k_phase = j & 1
    else:
        stage = j & 1  # j ≥ 0: bit operations, not a signed division's fix-ups
        k_phase = (j >> 1) & 1
    if PER_THREAD:
        ks = gl.load(ks_ptr)
    else:
        ks = key_scales(ks_ptr, blk * BN, offs_n, nk, _KEYS, MASKED, True, cols_s)
    k_bar = k_bars.index(stage)
    mbarrier.wait(k_bar, k_phase)
    s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    s_int = warpgroup_mma_wait(0, deps=[s_tok])
    if K_STAGES == 1:  # K(j+1) into the buffer Q·K(j)ᵀ has read
        more_k = j + 1 < n_blocks
        mbarrier.expect(k_bar, BN * BLOCK_D, pred=more_k)
        tma_load(k_desc, [(blk + 1) * BN, 0], k_bar, k_smem.index(0), pred=more_k)
    p, m_i, l_i, alpha = softmax_block(s_int, ks, qs, m_i, l_i, blk * BN, offs_m, offs_n, nk,
                                       causal_offset, MASKED, IS_CAUSAL, not PER_THREAD, PV_FP8,
                                       PER_THREAD, True, POLY, window, WINDOWED)
    a = register_operand(p, a_layout, PV_FP8)
    mbarrier.wait(v_bar, j & 1)
    pv_tok = warpgroup_mma(a, v_operand(v_smem, PV_FP8), zero_o, use_acc=False, is_async=True)
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    more_v = j + 1 < n_blocks
    if K_STAGES == 2:  # K(j+2) with V(j+1): the barriers before the requests serve both
        more_k = j + 2 < n_blocks
        mbarrier.expect(k_bar, BN * BLOCK_D, pred=more_k)
    mbarrier.expect(v_bar, BLOCK_D * BN if PV_FP8 else 2 * BLOCK_D * BN, pred=more_v)
    if K_STAGES == 2:
        tma_load(k_desc, [(blk + 2) * BN, 0], k_bar, k_smem.index(stage), pred=more_k)
    v0, v1 = v_box(blk + 1, BN, PV_FP8)
    tma_load(v_desc, [v0, v1], v_bar, v_smem, pred=more_v)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, zero_o.type.layout))[:, None] + pv
    return acc, m_i, l_i, ks_ptr + ks_step


def check_version(version: str | None = None) -> None:
    """:class:`~lowbit_attn.core.triton_support.GluonUnavailable` (a ``RuntimeError`` and an
    ``ImportError``) unless ``version`` (default: the installed Triton's) is of a series whose
    Gluon Hopper API this module compiles against."""
    triton_support.require_gluon("hopper", "the one-warpgroup Gluon attention kernel for sm_90a",
                                 version)


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
    k_stages: int = K_STAGES,
    maxnreg: int | None = None,
    poly_exp2: int = 0,
    variant: Variant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run the kernel, as ``kernel_int8.attention`` (same arguments; ``block_q`` is not used:
    the kernel's tiles are 64 rows, which changes no value); writes ``out`` (a logical
    ``[B, Hq, Nq, D]`` view) and returns the LSE (``[B, Hq, Nq]`` fp32) when asked.
    ``k_stages``: K's buffers (1: K(j+1) requested as soon as Q·K(j)ᵀ retires; 2: K(j+2) with
    V(j+1)); ``maxnreg``: a cap on registers per thread (168 lets 3 programs share an SM);
    ``poly_exp2``: per-thread scales only, one group of 8 key columns in 2, 4, 8 or 16 takes its
    exp2 on the FMA pipe (``gluon_blocks.poly_exp2``; twin: ``quantized_attention(poly_share=)``),
    0 (the default) none.
    ``variant``, ``sinks``: a window, a chunk and sinks as ``kernel_int8.attention`` takes them
    (positions aligned bottom-right; twin: ``quantized_attention(variant=, sinks=)``), not
    softcap (a tanh per score: the Triton kernel runs it).
    Raises ``RuntimeError`` on a Triton whose Gluon it was not written for,
    ``ValueError`` for what it does not cover (before launching anything)."""
    check_version()
    if k_stages not in (1, 2):
        raise ValueError(f"k_stages must be 1 or 2, got {k_stages!r}")
    if poly_exp2 not in (0, *POLY_SHARES):
        raise ValueError(f"poly_exp2 must be 0 or one of {POLY_SHARES}, got {poly_exp2!r}")
    if poly_exp2 and granularity != "per_thread":
        raise ValueError(f"poly_exp2 needs granularity 'per_thread', got {granularity!r}")
    if variant.softcap:
        raise ValueError("softcap is not supported by the sm90 kernel (a tanh per score in its "
                         "loop): the Triton kernel runs it")
    if variant.sinks != (sinks is not None):
        raise ValueError(f"variant.sinks is {variant.sinks} but sinks is "
                         f"{'given' if sinks is not None else 'None'}")
    _check_scope(qz, pv=pv, granularity=granularity, block_k=block_k, seqs_q=seqs_q,
                 seqs_k=seqs_k)
    b, hq, nq, d = qz.q.shape
    hkv, nk = qz.k.shape[1], qz.k.shape[2]
    lse = None
    if return_lse:
        lse = torch.empty((b, hq, nq), device=out.device, dtype=torch.float32)
    vec = qz.v_scale if qz.v_scale is not None else qz.v_mean
    grid = (triton.cdiv(nq, BLOCK_M), b * hq)
    options = {} if maxnreg is None else {"maxnreg": int(maxnreg)}
    if variant.windowed:  # positions aligned bottom-right
        causal_offset, offset = None, nk - nq
    else:
        offset = 0 if causal_offset is None else int(causal_offset)

    def launch():
        triton.set_allocator(tma_scratch)  # in a copy of the caller's context: theirs is kept
        _attn_fwd_sm90_kernel[grid](
            q=(qz.q, qz.q_scale, bhnd_strides(qz.q, False), row_strides(qz.q_scale, False)),
            k=(qz.k, qz.k_scale, bhnd_strides(qz.k, False), row_strides(qz.k_scale, False)),
            V=qz.v, VS=qz.v_scale, VM=qz.v_mean, LSH=qz.lse_shift, O=out, LSE=lse,
            SINK=sink_logits(sinks),
            v_strides=bhnd_strides(qz.v, False), vs_strides=strides(vec, 3),
            lsh_strides=row_strides(qz.lse_shift, False), o_strides=bhnd_strides(out, False),
            lse_strides=row_strides(lse, False),
            NQ=nq, NK=nk, HQ=hq, GROUP=hq // hkv, D=d,
            causal_offset=offset, left=variant.left, right=variant.right, chunk=variant.chunk,
            IS_CAUSAL=causal_offset is not None, HAS_VSCALE=qz.v_scale is not None,
            HAS_VMEAN=qz.v_mean is not None, HAS_LSH=qz.lse_shift is not None,
            WRITE_LSE=lse is not None, PER_THREAD=granularity == "per_thread",
            PV_FP8=pv == "fp8", BLOCK_D=d, K_STAGES=k_stages, POLY=int(poly_exp2),
            WINDOWED=variant.windowed, HAS_SINK=sinks is not None,
            num_warps=NUM_WARPS, **options,
        )

    contextvars.copy_context().run(launch)
    return lse


def _check_scope(qz: QuantizedQKV, *, pv, granularity, block_k, seqs_q, seqs_k) -> None:
    """``ValueError`` naming what this kernel does not cover."""
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16' for the sm90 kernel, got {pv!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES} for the sm90 kernel, got "
                         f"{granularity!r}")
    if block_k != BLOCK_N:
        raise ValueError(f"block_k must be {BLOCK_N} for the sm90 kernel, got {block_k}")
    if any(s is not None and s.packed for s in (seqs_q, seqs_k)):
        raise ValueError("packed (varlen) sequences are not supported by the sm90 kernel")
    if qz.delta_s is not None:
        raise ValueError("smooth_q (ΔS) is not supported by the sm90 kernel")
    d = qz.q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} for the sm90 kernel, got {d}")
    if pv == "fp8" and (qz.v.dtype != torch.float8_e4m3fn or not qz.v_permuted
                        or qz.v.stride(2) != 1
                        or qz.v.shape[2] != permuted_v_keys(qz.k.shape[2])):
        raise ValueError("v must be E4M3 with its keys permuted (quantize_qkv(permute_v=True)), "
                         f"stored token-contiguous, {permuted_v_keys(qz.k.shape[2])} keys; got "
                         f"dtype {qz.v.dtype}, permuted {qz.v_permuted}, strides "
                         f"{tuple(qz.v.stride())}, {qz.v.shape[2]} keys")
    if pv == "fp16" and qz.v.dtype != torch.float16:
        raise ValueError(f"v must be float16 for fp16 P·V, got dtype {qz.v.dtype}")
    check_tma_operands(("q", qz.q, 3), ("k", qz.k, 3), ("v", qz.v, 2 if pv == "fp8" else 3))


__all__ = ["BLOCK_M", "BLOCK_N", "attention", "check_version"]

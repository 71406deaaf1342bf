"""FP4 attention forward for Blackwell (sm_100a) in Gluon: block-scaled ``tcgen05`` products with
the accumulators in tensor memory, warp-specialized. First version, opt-in, **compiled, never
run on a GPU**: no GPU able to run sm_100a code was available and Gluon has no interpreter. The
FP4 recipes reach it under ``LOWBIT_ATTN_KERNEL=gluon`` on capability 10.x devices only after a
first-use check against ``kernel_fp4`` there (``inference/gluon_fp4_check.py``). Its own code runs on the CPU under the project's model of Gluon (``tools/gluon_cpu.py``: tensor
memory, ``tcgen05_mma_scaled``/``tcgen05_copy``, TMA, mbarriers, the three partitions under three
interleavings), bit-equal to the twin ``naive.fp4_attention`` with the model's FMA rounding twice
(``tests/inference/test_gluon_fp4_schedule.py``, which also breaks its protocol in known ways):
the barrier protocol and the numerics are checked; the layouts (scale atoms, swizzles) are not.

The numerics are ``kernel_fp4``'s (NVFP4 ``qk_fp4_pv_fp4`` or MXFP4 ``qk_mxfp4_pv_mxfp4``, with or
without the two-level P̃): scores = block-scaled Q̂·K̂ᵀ × ``qk_multiplier`` (× the NVFP4 tensor
scales of Q and K), online softmax in base 2, ``p = exp2(s − block_max + log2 peak)``, P̃
quantized per row in groups of keys (E4M3 ``amax/6`` or E8M0 scales, ``quant.fp4`` helpers), then
E2M1 by the hardware conversion (``quant.fp4.E2M1X2_PTX``), P̃·V block-scaled with V's group scales
along keys, ``acc = acc·α + pv·s1``, keys past the end and past the causal diagonal masked as
there; ΔS (``smooth_q``, ``DS [B, Hq, query block, key]``: the softmax partition loads its query
tile's 64 values of each key block) added to the scores and K's LSE shift (``smooth_k`` with
LSE, ``LSH [B, Hq, token]``) added to the LSE, in ``kernel_fp4``'s order (``finish_scores``,
``store_lse``). Differences are fp32 roundings: without ΔS the exp2's argument is one FMA
(``s·mult − shift``, as ``gluon_blocks.softmax_block`` folds it) where ``kernel_fp4`` rounds
``s·mult`` first (with ΔS the scores are ``s·mult + ΔS`` as there, and the argument
``s − shift``), and the MMA's order of additions.

One program computes ``BLOCK_M`` = 128 query rows of one (batch, query head); partitions:

- **loader** (1 warp): Q and its scales once; K, V and (NVFP4) V's scales per key block into two
  stages (``kv_ready``/``kv_empty``). Packed operands by TMA; the group scales by plain loads into
  shared memory in the layout ``tcgen05.cp`` reads (the 32×4×4 atom: TMA cannot write it from
  the project's row-major scales). ``tcgen05.cp`` has no layout for a 64-row tile (K's scales)
  nor for 2 scale columns (MXFP4 V's, 64 keys / 32): those the softmax partition loads and
  stores to tensor memory from registers (K's one block ahead, ``ks_ready``).
- **MMA** (1 warp): copies Q's (and NVFP4 V's) scales to tensor memory (``tcgen05_copy``), issues
  S(j) = Q·K(j)ᵀ into ``S[j % 2]`` and then P̃(j−1)·V(j−1) into ``PV``, each signalling an
  mbarrier when done; it never waits for its own products.
- **softmax** (default partition, 4 warps, one query row per thread): S(j) from tensor memory,
  online max, exp2, two-level P̃, group scales, E2M1; P̃ bytes to shared memory and their scales
  to tensor memory; then the correction ``O = O·α(j−1) + PV·s1(j−1)`` (O in tensor memory, in
  column slices) while S(j+1) and P̃(j)·V(j) run; the epilogue ``O / l``.

S is double-buffered: Q·K(j+1)ᵀ is issued as soon as S(j) has been read, so the softmax of block
j+1 starts on scores that are already there. P̃·V goes to its own buffer (not accumulated in O):
the two-level ``s1`` multiplies each block's product row by row, which an MMA cannot do.

Left out (the launcher refuses them): 128-key blocks (tensor memory: 2·128 columns of S + O +
PV fill the 512 before the scales), packed sequences, head dims other than 128 (D=64: Q's
MXFP4 scale tile has 2 columns and V's NVFP4 one 64 rows, neither copyable by ``tcgen05.cp``:
both would move to the register path), ``block_q`` ≠ 128. Kept: causal (bottom-right
``causal_offset``), ΔS, the LSE shift, V's channel mean (epilogue), the LSE, one-level P̃
(``two_level=False``).
Known risks only a GPU can settle: the scale layouts in shared memory for ``tcgen05_copy`` (the
cuBLAS atom, from the r18 research snippets), the 64-key scale tiles, timing.
"""

from __future__ import annotations

import contextvars
import math

import torch
import triton
from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("blackwell", "lowbit_attn.inference.kernel_fp4_gluon")

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, TensorMemoryScalesLayout, allocate_tensor_memory, fence_async_shared,
    get_tmem_reg_layout, mbarrier, tcgen05_copy, tcgen05_mma_scaled, tma,
)

from lowbit_attn.core.operands import FP4_GROUP, P_TWO_LEVEL_PEAK, QuantizedFP4
from lowbit_attn.core.triton_helpers import (
    batch_head, finish_scores, key_block_bounds, online_max, strides,
)
from lowbit_attn.inference.gluon_fp4_blocks import (
    O_SLICE, correct, epilogue, exp2_shifted, key_scales, load_scales, publish_key_scales, quantize_p,
    scale_smem_layout, scale_type, v_scales_by_copy, value_scales,
)
from lowbit_attn.quant.fp4 import scale_operand

BLOCK_M = 128
SOFTMAX_WARPS = 4  # the kernel's num_warps: the default partition, one query row per thread
_WORKER_WARPS = gl.constexpr((1, 1))  # MMA, loader
_WORKER_REGS = gl.constexpr((48, 48))

_LOG2_PEAK_NV = gl.constexpr(math.log2(P_TWO_LEVEL_PEAK["nvfp4"]))
_INV_PEAK_NV = gl.constexpr(1.0 / P_TWO_LEVEL_PEAK["nvfp4"])
_LOG2_PEAK_MX = gl.constexpr(math.log2(P_TWO_LEVEL_PEAK["mxfp4"]))
_INV_PEAK_MX = gl.constexpr(1.0 / P_TWO_LEVEL_PEAK["mxfp4"])


@gluon.jit
def _loader(q_desc, k_desc, v_desc, QS, VS, sqsn, svsd, pid_m, nq, n_blocks,
            q_smem, k_smem, v_smem, qs_smem, vs_smem, q_ready, kv_ready, kv_empty,
            NV: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_D: gl.constexpr):
    """Q and its scales, then K(j), V(j) and V's scales into stage ``j % 2`` once P̃·V(j−2)
    has released it (K's scales: the softmax partition, see ``key_scales``). Scales are stored
    (and fenced for the async proxy) before the barrier's ``expect`` arrives, so one arrival
    covers both."""
    load_scales(QS, pid_m * BLOCK_M, nq, sqsn, qs_smem, BLOCK_M, BLOCK_D // GROUP, NV)
    fence_async_shared()
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [pid_m * BLOCK_M, 0], q_ready, q_smem)
    for j in range(n_blocks):
        stage = j % 2
        mbarrier.wait(kv_empty.index(stage), ((j // 2) & 1) ^ 1)
        if v_scales_by_copy(BLOCK_N, GROUP):
            load_scales(VS + j * (BLOCK_N // GROUP), 0, BLOCK_D, svsd, vs_smem.index(stage),
                        BLOCK_D, BLOCK_N // GROUP, NV)
        fence_async_shared()
        mbarrier.expect(kv_ready.index(stage),
                        k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], kv_ready.index(stage),
                                        k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [0, j * (BLOCK_N // 2)], kv_ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _issue_pv(i, p_smem, v_smem, vs_smem, ps_tmem, vs_tmem, pv_tmem, p_ready, pv_ready, pv_free,
              kv_empty, FMT: gl.constexpr, COPY_SCALES: gl.constexpr):
    """P̃(i)·V(i) into ``PV`` once P̃(i) is written and the softmax has read P̃(i−1)·V(i−1);
    its completion publishes ``PV`` and releases K/V stage ``i % 2``. Scale buffers in tensor
    memory are pairs of allocations (Gluon 3.6: "scales don't support multibuffering")."""
    stage = i % 2
    mbarrier.wait(p_ready.index(stage), (i // 2) & 1)
    mbarrier.wait(pv_free, (i & 1) ^ 1)
    if stage == 0:
        _scaled_mma(p_smem.index(0), v_smem.index(0), vs_smem.index(0), pv_tmem, ps_tmem[0],
                    vs_tmem[0], FMT, pv_ready, kv_empty.index(0), COPY_SCALES)
    else:
        _scaled_mma(p_smem.index(1), v_smem.index(1), vs_smem.index(1), pv_tmem, ps_tmem[1],
                    vs_tmem[1], FMT, pv_ready, kv_empty.index(1), COPY_SCALES)


@gluon.jit
def _scaled_mma(a_smem, b_smem, b_scale_smem, acc_tmem, a_scale_tmem, b_scale_tmem,
                FMT: gl.constexpr, bar0, bar1, COPY_SCALES: gl.constexpr):
    """``acc = A·Bᵀ`` block-scaled (B ``[N, K/2]``), B's scales copied to tensor memory first
    when ``COPY_SCALES`` (``v_scales_by_copy``; ordered before the MMA: both are this thread's
    tcgen05 operations); ``bar0``/``bar1`` arrive when it is done."""
    if COPY_SCALES:
        tcgen05_copy(b_scale_smem, b_scale_tmem)
    tcgen05_mma_scaled(a_smem, b_smem.permute((1, 0)), acc_tmem, a_scale_tmem, b_scale_tmem,
                       FMT, FMT, use_acc=False, mbarriers=[bar0, bar1])


@gluon.jit
def _mma(n_blocks, q_smem, k_smem, v_smem, p_smem, qs_smem, vs_smem, s_tmem, pv_tmem,
         qs_tmem, ks_tmem, vs_tmem, ps_tmem, q_ready, kv_ready, kv_empty, ks_ready, s_ready,
         s_free, p_ready, pv_ready, pv_free, FMT: gl.constexpr, COPY_SCALES: gl.constexpr):
    """Issue order: S(0), then S(j) and P̃(j−1)·V(j−1) for j ≥ 1, then the last P̃·V. S(j) waits
    for K(j), its scales in tensor memory and for the softmax to have read ``S[j % 2]``
    (S(j−2)). Q's scales are copied only when a product follows: a ``tcgen05.cp`` completes
    with the next product's barrier, and with no key block nothing would wait for it before the
    program exits (found by the CPU model, ``tests/inference/test_gluon_fp4_schedule.py``)."""
    mbarrier.wait(q_ready, 0)
    if n_blocks > 0:
        tcgen05_copy(qs_smem, qs_tmem)
    for j in range(n_blocks):
        stage = j % 2
        phase = (j // 2) & 1
        mbarrier.wait(kv_ready.index(stage), phase)
        mbarrier.wait(ks_ready.index(stage), phase)
        mbarrier.wait(s_free.index(stage), phase ^ 1)
        if stage == 0:
            tcgen05_mma_scaled(q_smem, k_smem.index(0).permute((1, 0)), s_tmem.index(0),
                               qs_tmem, ks_tmem[0], FMT, FMT, use_acc=False,
                               mbarriers=[s_ready.index(0)])
        else:
            tcgen05_mma_scaled(q_smem, k_smem.index(1).permute((1, 0)), s_tmem.index(1),
                               qs_tmem, ks_tmem[1], FMT, FMT, use_acc=False,
                               mbarriers=[s_ready.index(1)])
        if j > 0:
            _issue_pv(j - 1, p_smem, v_smem, vs_smem, ps_tmem, vs_tmem, pv_tmem, p_ready,
                      pv_ready, pv_free, kv_empty, FMT, COPY_SCALES)
    if n_blocks > 0:
        _issue_pv(n_blocks - 1, p_smem, v_smem, vs_smem, ps_tmem, vs_tmem, pv_tmem, p_ready,
                  pv_ready, pv_free, kv_empty, FMT, COPY_SCALES)


@gluon.jit
def _softmax_step(j, s_tmem, p_smem, ps_tmem, pv_tmem, o_tmem, ks_tmem, vs_tmem, s_ready,
                  s_free, p_ready, pv_ready, pv_free, ks_ready, m_i, l_i, alpha, s1, ks, mult,
                  nk, n_blocks, KS, sksn, VS, svsd, DS, ds_off, sdn, row0, causal_offset,
                  BLOCK_D: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  HAS_DS: gl.constexpr, NV: gl.constexpr,
                  TWO_LEVEL: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Key block ``j``: its P̃ and scales handed to the MMA warp, then block ``j−1``'s correction
    (its P̃·V ran during this softmax; S(j+1) runs during this step). Returns
    ``(m, l, α(j), s1(j), K scales of block j+2)``."""
    s_tl: gl.constexpr = TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1)
    s_rl: gl.constexpr = get_tmem_reg_layout(gl.float32, [BLOCK_M, BLOCK_N], s_tl,
                                             gl.num_warps())
    stage = j % 2
    if j + 1 < n_blocks:  # K(j+1)'s scales (loaded in the previous step): S(j+1) may start
        publish_key_scales(ks, j + 1, ks_tmem, ks_ready)
        ks = key_scales(KS, j + 2, nk, sksn, NV, GROUP, BLOCK_N, BLOCK_D)
    if not v_scales_by_copy(BLOCK_N, GROUP):
        vs = value_scales(VS, j, svsd, NV, GROUP, BLOCK_N, BLOCK_D)
    mbarrier.wait(s_ready.index(stage), (j // 2) & 1)
    s = s_tmem.index(stage).load(s_rl)
    mbarrier.arrive(s_free.index(stage), count=1)
    if HAS_DS or MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_rl))
        offs_m = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_rl))
    if HAS_DS:  # kernel_fp4's order: s·mult, + ΔS of the block's keys, then the masks
        s = finish_scores(s * mult, cols, cols < nk, offs_m, causal_offset, DS + ds_off, sdn,
                          True, MASKED, IS_CAUSAL)
        block_max = gl.max(s, axis=1)
    else:
        if MASKED:  # keys past the end or past the causal diagonal: -inf
            s = finish_scores(s, cols, cols < nk, offs_m, causal_offset, None, 0, False, True,
                              IS_CAUSAL)
        # The multiplier folded as in gluon_blocks.softmax_block: the max on the products,
        # scaled once per row (exact: mult > 0), and the exp2's argument one FMA per score
        # (kernel_fp4 rounds s·mult first: one fp32 rounding apart).
        block_max = gl.max(s, axis=1) * mult
    m_new, m_safe, alpha_new = online_max(m_i, block_max)
    if TWO_LEVEL:
        b_safe = gl.where(block_max == float("-inf"), 0.0, block_max)
        if NV:
            p = exp2_shifted(s, mult, _LOG2_PEAK_NV - b_safe, HAS_DS)
            s1_new = gl.exp2(block_max - m_safe) * _INV_PEAK_NV
        else:
            p = exp2_shifted(s, mult, _LOG2_PEAK_MX - b_safe, HAS_DS)
            s1_new = gl.exp2(block_max - m_safe) * _INV_PEAK_MX
        s1_new = gl.where(block_max == float("-inf"), 0.0, s1_new)  # never 0·inf
    else:
        p = exp2_shifted(s, mult, -m_safe, HAS_DS)
        s1_new = gl.full([BLOCK_M], 1.0, gl.float32, gl.SliceLayout(1, s_rl))
    l_i = l_i * alpha_new + gl.sum(p, axis=1) * s1_new
    packed, codes = quantize_p(p, NV, GROUP)
    # P̃(j−2)·V(j−2) has completed (waited for in the previous step): its buffers are free.
    p_smem.index(stage).store(packed)
    ps_tl: gl.constexpr = TensorMemoryScalesLayout()
    ps_rl: gl.constexpr = get_tmem_reg_layout(scale_type(NV), [BLOCK_M, BLOCK_N // GROUP],
                                              ps_tl, gl.num_warps())
    ps = gl.convert_layout(scale_operand(codes, NV), ps_rl)
    if stage == 0:
        ps_tmem[0].store(ps)
        if not v_scales_by_copy(BLOCK_N, GROUP):
            vs_tmem[0].store(vs)
    else:
        ps_tmem[1].store(ps)
        if not v_scales_by_copy(BLOCK_N, GROUP):
            vs_tmem[1].store(vs)
    fence_async_shared()
    mbarrier.arrive(p_ready.index(stage), count=1)
    if j > 0:
        correct(j - 1, pv_tmem, o_tmem, pv_ready, pv_free, alpha, s1, BLOCK_M)
    return m_new, l_i, alpha_new, s1_new, ks


@gluon.jit
def _softmax(s_tmem, p_smem, ps_tmem, pv_tmem, o_tmem, ks_tmem, vs_tmem, s_ready, s_free,
             p_ready, pv_ready, pv_free, ks_ready, KS, sksn, VS, svsd, DS, ds_off, sdn, O, LSE,
             LSH, VG, VM, o_strides, lse_strides, lsh_strides, vg_strides, vm_strides, b, h, hk,
             pid_m, nq, nk, n_full, n_blocks, mult, causal_offset,
             IS_CAUSAL: gl.constexpr, NV: gl.constexpr, TWO_LEVEL: gl.constexpr,
             HAS_VMEAN: gl.constexpr, HAS_DS: gl.constexpr, HAS_LSH: gl.constexpr,
             WRITE_LSE: gl.constexpr, GROUP: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    """The default partition: the key-block loops (whole blocks, then the tail), the last
    correction and the epilogue."""
    s_tl: gl.constexpr = TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1)
    s_rl: gl.constexpr = get_tmem_reg_layout(gl.float32, [BLOCK_M, BLOCK_N], s_tl,
                                             gl.num_warps())
    sl_tl: gl.constexpr = TensorMemoryLayout([BLOCK_M, O_SLICE], col_stride=1)
    sl_rl: gl.constexpr = get_tmem_reg_layout(gl.float32, [BLOCK_M, O_SLICE], sl_tl,
                                              gl.num_warps())
    rows_s: gl.constexpr = gl.SliceLayout(1, s_rl)
    for k in gl.static_range(BLOCK_D // O_SLICE):
        o_tmem.slice(k * O_SLICE, O_SLICE).store(gl.zeros([BLOCK_M, O_SLICE], gl.float32, sl_rl))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows_s)
    alpha = gl.zeros([BLOCK_M], gl.float32, rows_s)
    s1 = gl.zeros([BLOCK_M], gl.float32, rows_s)
    if n_blocks > 0:
        publish_key_scales(key_scales(KS, 0, nk, sksn, NV, GROUP, BLOCK_N, BLOCK_D), 0,
                           ks_tmem, ks_ready)
    ks = key_scales(KS, 1, nk, sksn, NV, GROUP, BLOCK_N, BLOCK_D)
    for j in range(n_full):
        m_i, l_i, alpha, s1, ks = _softmax_step(
            j, s_tmem, p_smem, ps_tmem, pv_tmem, o_tmem, ks_tmem, vs_tmem, s_ready, s_free,
            p_ready, pv_ready, pv_free, ks_ready, m_i, l_i, alpha, s1, ks, mult, nk, n_blocks,
            KS, sksn, VS, svsd, DS, ds_off, sdn, pid_m * BLOCK_M, causal_offset, BLOCK_D, False,
            IS_CAUSAL, HAS_DS, NV, TWO_LEVEL, GROUP, BLOCK_M, BLOCK_N)
    for j in range(n_full, n_blocks):
        m_i, l_i, alpha, s1, ks = _softmax_step(
            j, s_tmem, p_smem, ps_tmem, pv_tmem, o_tmem, ks_tmem, vs_tmem, s_ready, s_free,
            p_ready, pv_ready, pv_free, ks_ready, m_i, l_i, alpha, s1, ks, mult, nk, n_blocks,
            KS, sksn, VS, svsd, DS, ds_off, sdn, pid_m * BLOCK_M, causal_offset, BLOCK_D, True,
            IS_CAUSAL, HAS_DS, NV, TWO_LEVEL, GROUP, BLOCK_M, BLOCK_N)
    if n_blocks > 0:
        correct(n_blocks - 1, pv_tmem, o_tmem, pv_ready, pv_free, alpha, s1, BLOCK_M)
    epilogue(o_tmem, l_i, m_i, O, LSE, LSH, VG, VM, o_strides, lse_strides, lsh_strides,
             vg_strides, vm_strides, b, h, hk, pid_m, nq, sl_rl, NV, HAS_VMEAN, HAS_LSH,
             WRITE_LSE, BLOCK_M, BLOCK_D)


@gluon.jit
def _attn_fwd_fp4_gluon_kernel(
    Q, QS, K, KS, V, VS, QG, KG, VG, VM, DS, LSH, O, LSE,
    q_strides, qs_strides, k_strides, ks_strides, v_strides, vs_strides, qg_strides, kg_strides,
    vg_strides, vm_strides, ds_strides, lsh_strides, o_strides, lse_strides,
    NQ, NK, V_COLS, HQ, GROUP_HEADS, qk_multiplier, causal_offset,
    IS_CAUSAL: gl.constexpr, NV: gl.constexpr, TWO_LEVEL: gl.constexpr, HAS_VMEAN: gl.constexpr,
    HAS_DS: gl.constexpr, HAS_LSH: gl.constexpr, WRITE_LSE: gl.constexpr, GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
):
    """Packed E2M1 ``Q``/``K`` ``[B, H, N, D/2]``, V token-contiguous ``[B, H, D, N'/2]``; their
    group-scale bits (uint8) ``QS``/``KS`` ``[B, H, N, D/GROUP]``, ``VS`` ``[B, H, D, N'/GROUP]``;
    NVFP4 tensor scales ``QG``/``KG``/``VG`` ``[B, H]``; strides (batch, head, row) of each, the
    rows' elements contiguous (``O``: (batch, head, token, dim)); ``V_COLS``: V's bytes per
    channel (``N'/2``). ΔS ``DS`` ``[B, Hq, query block, key]`` (strides: those four) and the
    LSE shift ``LSH`` ``[B, Hq, token]`` (three) as in ``kernel_fp4``; either may be None."""
    sqb, sqh, sqn = q_strides
    sqsb, sqsh, sqsn = qs_strides
    skb, skh, skn = k_strides
    sksb, sksh, sksn = ks_strides
    svb, svh, svd = v_strides
    svsb, svsh, svsd = vs_strides
    sgqb, sgqh = qg_strides
    sgkb, sgkh = kg_strides
    FMT: gl.constexpr = "e2m1"
    SCALE: gl.constexpr = scale_type(NV)

    pid_m = gl.program_id(0)
    b, h = batch_head(gl.program_id(1), HQ)
    hk = h // GROUP_HEADS
    if pid_m * BLOCK_M >= NQ:
        return
    full_hi, hi = key_block_bounds(NK, pid_m, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    n_full = full_hi // BLOCK_N
    sdb, sdh, sdq, sdn = ds_strides
    ds_off = b * sdb + h * sdh + pid_m.to(gl.int64) * sdq  # this query block's ΔS row
    mult = qk_multiplier
    if NV:
        mult = mult * (gl.load(QG + b * sgqb + h * sgqh) * gl.load(KG + b * sgkb + hk * sgkh))

    HALF_D: gl.constexpr = BLOCK_D // 2
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_D], gl.uint8)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF_D], gl.uint8)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_D, BLOCK_N // 2], gl.uint8)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // 2], gl.uint8)
    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * sqh, [NQ, HALF_D], [sqn, 1],
                                        [BLOCK_M, HALF_D], q_sl)
    k_desc = tma.make_tensor_descriptor(K + b * skb + hk * skh, [NK, HALF_D], [skn, 1],
                                        [BLOCK_N, HALF_D], k_sl)
    v_desc = tma.make_tensor_descriptor(V + b * svb + hk * svh, [BLOCK_D, V_COLS], [svd, 1],
                                        [BLOCK_D, BLOCK_N // 2], v_sl)
    q_smem = gl.allocate_shared_memory(gl.uint8, [BLOCK_M, HALF_D], q_sl)
    k_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, HALF_D], k_sl)
    v_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_D, BLOCK_N // 2], v_sl)
    p_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_M, BLOCK_N // 2], p_sl)
    qs_smem = gl.allocate_shared_memory(SCALE, [BLOCK_M, BLOCK_D // GROUP],
                                        scale_smem_layout(BLOCK_M, BLOCK_D // GROUP))
    vs_smem = gl.allocate_shared_memory(SCALE, [2, BLOCK_D, BLOCK_N // GROUP],
                                        scale_smem_layout(BLOCK_D, BLOCK_N // GROUP))

    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    pv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    pv_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    s_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    s_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    ks_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    mbarrier.init(q_ready, count=1)
    mbarrier.init(pv_ready, count=1)
    mbarrier.init(pv_free, count=1)
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
        mbarrier.init(s_ready.index(i), count=1)
        mbarrier.init(s_free.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(ks_ready.index(i), count=1)

    acc_tl: gl.constexpr = TensorMemoryLayout([BLOCK_M, BLOCK_N], col_stride=1)
    o_tl: gl.constexpr = TensorMemoryLayout([BLOCK_M, BLOCK_D], col_stride=1)
    sc_tl: gl.constexpr = TensorMemoryScalesLayout()
    s_tmem = allocate_tensor_memory(gl.float32, [2, BLOCK_M, BLOCK_N], acc_tl)
    o_tmem = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_D], o_tl)
    pv_tmem = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_D], o_tl)
    qs_tmem = allocate_tensor_memory(SCALE, [BLOCK_M, BLOCK_D // GROUP], sc_tl)
    # pairs of buffers (scales in tensor memory cannot be multi-buffered in Gluon 3.6)
    ks_tmem = (allocate_tensor_memory(SCALE, [BLOCK_N, BLOCK_D // GROUP], sc_tl),
               allocate_tensor_memory(SCALE, [BLOCK_N, BLOCK_D // GROUP], sc_tl))
    vs_tmem = (allocate_tensor_memory(SCALE, [BLOCK_D, BLOCK_N // GROUP], sc_tl),
               allocate_tensor_memory(SCALE, [BLOCK_D, BLOCK_N // GROUP], sc_tl))
    ps_tmem = (allocate_tensor_memory(SCALE, [BLOCK_M, BLOCK_N // GROUP], sc_tl),
               allocate_tensor_memory(SCALE, [BLOCK_M, BLOCK_N // GROUP], sc_tl))

    gl.warp_specialize([
        (_softmax, (s_tmem, p_smem, ps_tmem, pv_tmem, o_tmem, ks_tmem, vs_tmem, s_ready,
                    s_free, p_ready, pv_ready, pv_free, ks_ready, KS + b * sksb + hk * sksh,
                    sksn, VS + b * svsb + hk * svsh, svsd, DS, ds_off, sdn, O, LSE, LSH, VG, VM,
                    o_strides, lse_strides, lsh_strides, vg_strides, vm_strides, b, h, hk, pid_m,
                    NQ, NK, n_full, n_blocks, mult, causal_offset, IS_CAUSAL, NV, TWO_LEVEL,
                    HAS_VMEAN, HAS_DS, HAS_LSH, WRITE_LSE, GROUP, BLOCK_M, BLOCK_N, BLOCK_D)),
        (_mma, (n_blocks, q_smem, k_smem, v_smem, p_smem, qs_smem, vs_smem, s_tmem,
                pv_tmem, qs_tmem, ks_tmem, vs_tmem, ps_tmem, q_ready, kv_ready, kv_empty,
                ks_ready, s_ready, s_free, p_ready, pv_ready, pv_free, FMT,
                v_scales_by_copy(BLOCK_N, GROUP))),
        (_loader, (q_desc, k_desc, v_desc, QS + b * sqsb + h * sqsh,
                   VS + b * svsb + hk * svsh, sqsn, svsd, pid_m, NQ, n_blocks,
                   q_smem, k_smem, v_smem, qs_smem, vs_smem, q_ready, kv_ready,
                   kv_empty, NV, GROUP, BLOCK_M, BLOCK_N, BLOCK_D)),
    ], _WORKER_WARPS, _WORKER_REGS)

    mbarrier.invalidate(q_ready)
    mbarrier.invalidate(pv_ready)
    mbarrier.invalidate(pv_free)
    for i in gl.static_range(2):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
        mbarrier.invalidate(s_ready.index(i))
        mbarrier.invalidate(s_free.index(i))
        mbarrier.invalidate(p_ready.index(i))
        mbarrier.invalidate(ks_ready.index(i))


KERNEL = _attn_fwd_fp4_gluon_kernel

__all__ = ["BLOCK_M", "KERNEL", "SOFTMAX_WARPS"]


# ---------------------------------------------------------------------------------------------
# launcher (opt-in: LOWBIT_ATTN_KERNEL=gluon, through gluon_fp4_check)

# 64-key blocks only: 128 would need 2×128 columns of S plus O and PV, the whole tensor memory,
# before the scales (a later version can alias PV with S as the upstream tutorial aliases P).
BLOCK_NS = (64,)
FORMATS = ("nvfp4", "mxfp4")
HEAD_DIMS = (128,)


def _scratch(size: int, alignment: int, stream):
    """Global memory for the TMA descriptors the kernel builds."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _pair(x: torch.Tensor | None) -> tuple[int, int]:
    """(batch, head) strides of a per-(batch, head) tensor; zeros when absent."""
    return (0, 0) if x is None else (x.stride(0), x.stride(1))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Scale bits as uint8 (E4M3 scales may come as float8_e4m3fn)."""
    return x if x.dtype == torch.uint8 else x.view(torch.uint8)


def check_version(version: str | None = None) -> None:
    """:class:`~lowbit_attn.core.triton_support.GluonUnavailable` (a ``RuntimeError`` and an
    ``ImportError``) unless ``version`` (default: the installed Triton's) is of a series whose
    Gluon Blackwell API this module compiles against."""
    triton_support.require_gluon("blackwell", "the Gluon FP4 attention kernel for sm_100a",
                                 version)


def attention(
    qz: QuantizedFP4,
    *,
    out: torch.Tensor,
    head_dim: int,
    block_q: int,
    block_k: int,
    causal_offset: int | None,
    two_level: bool,
    return_lse: bool,
) -> torch.Tensor | None:
    """Run the kernel, as ``kernel_fp4.attention`` (same arguments): writes ``out`` (a logical
    ``[B, Hq, Nq, D]`` view) and returns the LSE ``[B, Hq, Nq]`` fp32 when asked. Raises
    ``RuntimeError`` on a Triton whose Gluon it was not written for, ``ValueError`` for what the
    kernel does not cover (see the module docstring)."""
    check_version()
    _check_scope(qz, head_dim=head_dim, block_q=block_q, block_k=block_k,
                 causal_offset=causal_offset)
    b, hq, nq, _ = qz.q.shape
    hkv, nk = qz.k.shape[1], qz.k.shape[2]
    lse = torch.empty((b, hq, nq), device=out.device, dtype=torch.float32) if return_lse else None
    nv = qz.fmt == "nvfp4"
    grid = (triton.cdiv(nq, BLOCK_M), b * hq)

    def launch():
        triton.set_allocator(_scratch)  # in a copy of the caller's context: theirs is kept
        _attn_fwd_fp4_gluon_kernel[grid](
            Q=qz.q, QS=_bits(qz.q_scale), K=qz.k, KS=_bits(qz.k_scale), V=qz.v,
            VS=_bits(qz.v_scale), QG=qz.q_global, KG=qz.k_global, VG=qz.v_global, VM=qz.v_mean,
            DS=qz.delta_s, LSH=qz.lse_shift, O=out, LSE=lse,
            q_strides=qz.q.stride()[:3], qs_strides=qz.q_scale.stride()[:3],
            k_strides=qz.k.stride()[:3], ks_strides=qz.k_scale.stride()[:3],
            v_strides=qz.v.stride()[:3], vs_strides=qz.v_scale.stride()[:3],
            qg_strides=_pair(qz.q_global), kg_strides=_pair(qz.k_global),
            vg_strides=_pair(qz.v_global), vm_strides=_pair(qz.v_mean),
            ds_strides=strides(qz.delta_s, 4), lsh_strides=strides(qz.lse_shift, 3),
            o_strides=out.stride(), lse_strides=strides(lse, 3),
            NQ=nq, NK=nk, V_COLS=qz.v.shape[-1], HQ=hq, GROUP_HEADS=hq // hkv,
            qk_multiplier=float(qz.qk_multiplier),
            causal_offset=0 if causal_offset is None else int(causal_offset),
            IS_CAUSAL=causal_offset is not None,
            NV=nv, TWO_LEVEL=two_level, HAS_VMEAN=qz.v_mean is not None,
            HAS_DS=qz.delta_s is not None, HAS_LSH=lse is not None and qz.lse_shift is not None,
            WRITE_LSE=lse is not None, GROUP=FP4_GROUP[qz.fmt],
            BLOCK_M=BLOCK_M, BLOCK_N=block_k, BLOCK_D=qz.q.shape[-1] * 2,
            num_warps=SOFTMAX_WARPS,
        )

    contextvars.copy_context().run(launch)
    return lse


def _check_scope(qz: QuantizedFP4, *, head_dim, block_q, block_k, causal_offset) -> None:
    """``ValueError`` naming what this first version does not cover."""
    if qz.fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} for the Gluon FP4 kernel, "
                         f"got {qz.fmt!r}")
    if block_q != BLOCK_M or block_k not in BLOCK_NS:
        raise ValueError(f"block_q must be {BLOCK_M} and block_k one of {BLOCK_NS} for the "
                         f"Gluon FP4 kernel, got block_q={block_q}, block_k={block_k}")
    d = qz.q.shape[-1] * 2
    if d not in HEAD_DIMS or head_dim != d:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} (unpadded) for the Gluon FP4 "
                         f"kernel, got {head_dim} stored as {d}")
    if (qz.v.shape[-1] * 2) % block_k:
        raise ValueError(f"V must be padded to whole {block_k}-key blocks, got "
                         f"{qz.v.shape[-1] * 2} keys")
    for name, x in (("q", qz.q), ("k", qz.k), ("v", qz.v)):
        if x.stride(-1) != 1 or any((s % 16) for s in x.stride()[:-1]) or x.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned with a unit last stride and the "
                             f"others multiples of 16 bytes (TMA), got strides "
                             f"{tuple(x.stride())}")
    for name, x in (("q_scale", qz.q_scale), ("k_scale", qz.k_scale), ("v_scale", qz.v_scale)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides "
                             f"{tuple(x.stride())}")
    span = qz.k_scale.shape[2] * qz.k_scale.stride(2)  # gluon_fp4_blocks.key_scales: int32
    if span >= 2**31:
        raise ValueError(f"k_scale's tokens must span fewer than 2^31 bytes per head, got "
                         f"{qz.k_scale.shape[2]} tokens at stride {qz.k_scale.stride(2)}")


__all__ += ["BLOCK_NS", "FORMATS", "HEAD_DIMS", "attention", "check_version"]

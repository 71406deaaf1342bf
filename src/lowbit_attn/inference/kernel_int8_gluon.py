"""Attention forward with INT8 Q·Kᵀ and FP8 or fp16 P·V for Hopper (sm_90a), written in Gluon:
warp-specialized, one loader warp and two consumer warpgroups in ping-pong.

The same numerics as :mod:`lowbit_attn.inference.kernel_int8` (SageAttention2: per-token scales
folded into the exp2's argument, P̃ to E4M3 as ``exp2(S - m + log2 448)`` or to fp16 as
``exp2(S - m)``, each key block's P̃·V a fresh tensor-core product added into the fp32
accumulator; the ``@gluon.jit`` pieces in :mod:`~lowbit_attn.inference.gluon_blocks`) on the
same operands (:class:`~lowbit_attn.core.operands.QuantizedQKV`), with a schedule Triton's
``tl.dot`` cannot express: both products asynchronous, P̃·V of the previous key block in flight
while this block's softmax runs, and the two halves of the tile taking turns at the tensor cores.

One program computes ``BLOCK_M`` = 128 query rows of one (batch, query head) with three
partitions (``gl.warp_specialize``):

- the **loader** (1 warp, 24 registers) brings Q's two 64-row halves once, then K(j) and V(j) by
  TMA into two stages each, each stage released by both consumers (``*_empty`` barriers counting
  2 arrivals);
- two **consumers** (4 warps each, 64 query rows each; the kernel's default partition is
  consumer 0), each running, on its rows, key block ``j``'s iteration: issue Q·Kᵀ(j) (INT8
  wgmma) and P̃·V(j-1) (FP8 or fp16 wgmma, a fresh accumulator), both asynchronous;
  ``wait(1)``, which retires Q·Kᵀ(j) only (wgmma groups complete in order); release K(j);
  softmax(j) under P̃·V(j-1), P̃(j) stored to the other of its two shared-memory buffers;
  ``wait(0)``; release V(j-1); ``acc·α(j-1) + pv(j-1)``. The rescale reads only registers the
  finished wgmma wrote, so ptxas does not serialize the wgmmas (its warning C7514).

The two consumers take turns at the tensor cores: a consumer issues its two wgmmas only after the
other has issued its own for the same block (two ``turn`` mbarriers passed back and forth), so
one consumer's softmax runs while the other's products do. The model's bound is
max(T_QK + T_PV, T_soft) per consumer pair (``benchmarks/NOTES.md`` §11).

Registers: 12 warps (the loader's warpgroup counts whole), launched with ``maxnreg`` = 168
(12·32·168 ≤ 64 Ki); ``setmaxnreg`` gives the loader 24 and each consumer 240 (the default
partition receives what is left: 3·168 − 24 − 240 = 240). At D=128 with 128-key blocks a
consumer needs more than 240 and ptxas spills a little (tests/inference/test_aot_gluon.py holds
it to its measured bytes); nothing else spills.

P̃ goes through shared memory rather than registers: Triton 3.6 cannot carry an 8-bit register
operand through ``warpgroup_mma_wait`` ("Unexpected bitwidth in WGMMAWaitGroupOp: 8"). K and V
arrive by TMA (descriptors made in the kernel, so any token stride and exact zero fill past the
sequence's end). The per-token K scales are loaded right after the two wgmmas are issued, one key
per thread, so their latency hides under Q·Kᵀ.

Speed (H100, 2026-11-25, ``benchmarks/probes/gluon_speed.py``, B=4 H=32 N=16k D=128, FP8 P·V,
kernel alone): 657 TOP/s non-causal and 609 causal with 128-key blocks, the Triton kernel's 555
and 513; 524 and 515 with 64-key blocks, below the Triton kernel's 592 and 569.

Scope: dense or packed variable-length inputs (``VARLEN``, as the Triton kernel: each sequence's
causal mask aligned bottom-right), per-token or per-block scales (``PER_TOKEN``), FP8 P·V (E4M3
V stored ``[D, N']``: 8-bit wgmma operands must be K-major) or fp16 P·V (``PV_FP8=False``: fp16
V ``[N, D]`` as it is), D = 64 or 128, causal or not, GQA, LSE (with the K-smoothing shift).
Not covered (refused before launch, the Triton kernel runs): ΔS (``smooth_q``), Q quantized in
the kernel. Twin: ``lowbit_attn.inference.naive.quantized_attention``. Written for the Gluon
Hopper API of the Triton series ``core.triton_support.GLUON_SERIES["hopper"]`` names; another is
refused at import and at launch. Opt-in only: the op calls it when ``LOWBIT_ATTN_KERNEL=gluon``
on a device of capability 9.0 and :mod:`lowbit_attn.inference.gluon_check` admits it. Executed on
the CPU by ``tools/gluon_cpu.py`` (the partitions as cooperatively scheduled threads) in the
tests.
"""

from __future__ import annotations

import contextvars

import torch
import triton

from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("hopper", "lowbit_attn.inference.kernel_int8_gluon")

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from lowbit_attn.core.operands import QuantizedQKV, Seqs, dense_seqs
from lowbit_attn.core.triton_helpers import bhnd_strides, key_block_bounds, row_strides, strides
from lowbit_attn.inference.gluon_blocks import (
    check_tma_operands, descriptors, key_scales, program_sequence, scales_of_rows, softmax_block,
    tma_load, tma_scratch, v_box, v_operand, write_rows,
)

CONSUMER_WARPS = 4  # the kernel's num_warps: the default partition is consumer 0
CONSUMER_REGS = 240
LOADER_REGS = 24
# Globals read inside @jit functions must be constexpr.
_WORKER_WARPS = gl.constexpr((CONSUMER_WARPS, 1))  # consumer 1, the loader
_WORKER_REGS = gl.constexpr((CONSUMER_REGS, LOADER_REGS))
MAXNREG = 168  # 3 warpgroups × 128 threads × 168 = 64 Ki registers, redistributed by setmaxnreg
BLOCK_M = 128
BLOCK_NS = (64, 128)  # the sm_90 key blocks of the per-token FP8 recipe
HEAD_DIMS = (64, 128)

_KEYS = gl.constexpr(gl.BlockedLayout([1], [32], [CONSUMER_WARPS], [0]))


@gluon.jit
def _attn_fwd_int8_pingpong_kernel(
    q, k, V, VS, VM, LSH, O, LSE, CUQ, CUK,
    v_strides, vs_strides, lsh_strides, o_strides, lse_strides,
    NQ, NK, HQ, GROUP, D, causal_offset,
    IS_CAUSAL: gl.constexpr, HAS_VSCALE: gl.constexpr, HAS_VMEAN: gl.constexpr,
    HAS_LSH: gl.constexpr, WRITE_LSE: gl.constexpr, VARLEN: gl.constexpr,
    PER_TOKEN: gl.constexpr, PV_FP8: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
):
    """Operands ``q`` and ``k``: ``(INT8 values, per-token scales, values' strides, scales'
    strides)`` as in ``kernel_int8``. Strides: (batch, head, token, dim) of Q, K, ``V``, ``O``
    (V's token stride is 1: E4M3 V is stored ``[B, H, D, N']``); (batch, head, row) of the scales,
    ``LSH`` and ``LSE``; (batch, head, dim) of V's channel vectors ``VS``/``VM``. ``VARLEN``:
    packed ``[total, H, ·]`` tensors (batch strides 0, per-token vectors ``[H, total]``), sequence
    ``b`` at tokens ``CUQ[b]:CUQ[b+1]`` of Q/O and ``CUK[b]:CUK[b+1]`` of K/V, causal masks aligned
    bottom-right in each; the dense variant compiles without any of it."""
    Q, QS, q_strides, qs_strides = q
    K, KS, k_strides, ks_strides = k
    sqb, sqh, sqn, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides

    HALF: gl.constexpr = BLOCK_M // 2
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_D], gl.int8)
    k_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], gl.int8)
    # E4M3 P̃ and V ([D, keys], K-major), or fp16 ([keys, D])
    PV_TYPE: gl.constexpr = gl.float8e4nv if PV_FP8 else gl.float16
    V_TILE: gl.constexpr = [BLOCK_D, BLOCK_N] if PV_FP8 else [BLOCK_N, BLOCK_D]
    v_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(V_TILE, PV_TYPE)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_N], PV_TYPE)

    pid_m, b, h, hk, q_start, nq, k_start, nk, causal_offset = program_sequence(
        CUQ, CUK, NQ, NK, HQ, GROUP, causal_offset, VARLEN)
    if pid_m * BLOCK_M >= nq:
        return
    q_desc, k_desc, v_desc, v_col = descriptors(
        Q, K, V, b, h, hk, q_start, nq, k_start, nk, D, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
        svd, VARLEN, HALF, BLOCK_N, BLOCK_D, q_smem_layout, k_smem_layout, v_smem_layout, PV_FP8)

    q_smem = gl.allocate_shared_memory(gl.int8, [2, HALF, BLOCK_D], q_smem_layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, BLOCK_D], k_smem_layout)
    v_smem = gl.allocate_shared_memory(PV_TYPE, [2] + V_TILE, v_smem_layout)
    # P̃: two buffers per consumer (index 2·consumer + stage)
    p_smem = gl.allocate_shared_memory(PV_TYPE, [4, HALF, BLOCK_N], p_smem_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(turn.index(i), count=1)

    full_hi, hi = key_block_bounds(nk, pid_m, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    n_full = full_hi // BLOCK_N
    # Runtime values travel as one tuple; constexprs must be written in the call (a tuple held
    # in a variable turns them into runtime values).
    state = (q, k, VS, VM, LSH, O, LSE, CUQ, vs_strides, lsh_strides, o_strides, lse_strides,
             NQ, D, pid_m, b, h, hk, q_start, k_start, nq, nk, causal_offset, n_blocks, n_full,
             q_smem, k_smem, v_smem, p_smem, q_bars, k_ready, k_empty, v_ready, v_empty, turn)
    gl.warp_specialize([
        (_consumer, (state, 0, IS_CAUSAL, HAS_VSCALE, HAS_VMEAN, HAS_LSH, WRITE_LSE, VARLEN,
                     PER_TOKEN, PV_FP8, BLOCK_M, BLOCK_N, BLOCK_D)),  # the default partition
        (_consumer, (state, 1, IS_CAUSAL, HAS_VSCALE, HAS_VMEAN, HAS_LSH, WRITE_LSE, VARLEN,
                     PER_TOKEN, PV_FP8, BLOCK_M, BLOCK_N, BLOCK_D)),
        (_loader, (q_desc, k_desc, v_desc, v_col, pid_m, n_blocks, q_smem, k_smem, v_smem,
                   q_bars, k_ready, k_empty, v_ready, v_empty, PV_FP8, BLOCK_M, BLOCK_N,
                   BLOCK_D)),
    ], _WORKER_WARPS, _WORKER_REGS)

    for i in gl.static_range(2):
        mbarrier.invalidate(q_bars.index(i))
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(v_empty.index(i))
        mbarrier.invalidate(turn.index(i))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, v_col, pid_m, n_blocks, q_smem, k_smem, v_smem, q_bars,
            k_ready, k_empty, v_ready, v_empty, PV_FP8: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    """Q's two halves, then K(j) and V(j) for every key block into stage ``j % 2``, each once
    both consumers have released the block two before (a fresh barrier's wait on parity 1
    returns at once: the first two blocks need no release)."""
    HALF: gl.constexpr = BLOCK_M // 2
    if n_blocks > 0:
        for i in gl.static_range(2):
            mbarrier.expect(q_bars.index(i), HALF * BLOCK_D)
            tma_load(q_desc, [pid_m * BLOCK_M + i * HALF, 0], q_bars.index(i), q_smem.index(i))
    for j in range(n_blocks):
        stage = j % 2
        phase = (j // 2) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), BLOCK_N * BLOCK_D)
        tma_load(k_desc, [j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage),
                        BLOCK_D * BLOCK_N if PV_FP8 else 2 * BLOCK_D * BLOCK_N)
        v0, v1 = v_box(j, v_col, BLOCK_N, PV_FP8)
        tma_load(v_desc, [v0, v1], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _turn_wait(turn, WG: gl.constexpr, t):
    """Wait for consumer ``WG``'s ``t``-th turn at the tensor cores. Consumer 0 goes first: its
    turn barrier's wait on parity 1 passes at once (a fresh barrier is in phase 0); after that
    each consumer's turn ``t`` is the other's pass ``t`` (consumer 0) or ``t + 1`` (consumer 1)."""
    mbarrier.wait(turn.index(WG), (t & 1) ^ (1 - WG))


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr):
    """Hand the tensor cores to the other consumer."""
    mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _consumer(state, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_VSCALE: gl.constexpr,
              HAS_VMEAN: gl.constexpr, HAS_LSH: gl.constexpr, WRITE_LSE: gl.constexpr,
              VARLEN: gl.constexpr, PER_TOKEN: gl.constexpr, PV_FP8: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    """Consumer ``WG``: rows ``64·WG`` to ``64·WG + 63`` of the tile, the asynchronous loop of
    the module docstring on them, in turns with the other consumer, then their epilogue."""
    (q, k, VS, VM, LSH, O, LSE, CUQ, vs_strides, lsh_strides, o_strides, lse_strides,
     NQ, D, pid_m, b, h, hk, q_start, k_start, nq, nk, causal_offset, n_blocks, n_full,
     q_smem, k_smem, v_smem, p_smem, q_bars, k_ready, k_empty, v_ready, v_empty, turn) = state
    Q, QS, q_strides, qs_strides = q
    K, KS, k_strides, ks_strides = k
    sqsb, sqsh, sqsn = qs_strides
    sksb, sksh, sksn = ks_strides
    svsb, svsh, svsd = vs_strides
    slb, slh, sln = lsh_strides
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides
    HALF: gl.constexpr = BLOCK_M // 2

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_D, 32 if PV_FP8 else 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    row0 = pid_m * BLOCK_M + WG * HALF
    offs_m = row0 + gl.arange(0, HALF, layout=rows_s)
    offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
    offs_d = gl.arange(0, BLOCK_D, layout=cols_o)
    mmask = offs_m < nq
    dmask = offs_d < D
    qs, ks_base = scales_of_rows(QS, KS, b, h, hk, pid_m, q_start, k_start, offs_m, mmask, sqsb,
                                 sqsh, sqsn, sksb, sksh, sksn, BLOCK_N, _KEYS, VARLEN, PER_TOKEN)

    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.full([HALF], 0.0, gl.float32, layout=rows_s)
    acc = gl.zeros([HALF, BLOCK_D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([HALF, BLOCK_N], gl.int32, layout=s_layout)
    q_half = q_smem.index(WG)
    if n_blocks > 0:
        # Block 0: Q·Kᵀ alone (nothing to overlap yet), in this consumer's turn 0.
        ks = key_scales(ks_base, 0, offs_n, nk, _KEYS, True, PER_TOKEN, cols_s)
        mbarrier.wait(q_bars.index(WG), 0)
        mbarrier.wait(k_ready.index(0), 0)
        _turn_wait(turn, WG, 0)
        s_tok = warpgroup_mma(q_half, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        _turn_pass(turn, WG)
        s_int = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        p, m_i, l_i, alpha = softmax_block(s_int, ks, qs, m_i, l_i, 0, offs_m, offs_n, nk,
                                           causal_offset, True, IS_CAUSAL, PER_TOKEN, PV_FP8)
        p_smem.index(2 * WG).store(p)
        fence_async_shared()

        if PER_TOKEN:
            ks_ptr = ks_base + BLOCK_N * sksn
        else:
            ks_ptr = ks_base + sksn
        for j in range(1, n_full):
            acc, m_i, l_i, alpha, ks_ptr = _consumer_step(
                j, acc, m_i, l_i, alpha, qs, offs_m, offs_n, nk, causal_offset, ks_ptr, sksn,
                q_half, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready, v_empty, turn, zero_s,
                WG, False, IS_CAUSAL, BLOCK_N, BLOCK_D, s_layout, o_layout, PER_TOKEN, PV_FP8)
        j0 = gl.maximum(n_full, 1)
        if PER_TOKEN:
            ks_ptr = ks_base + (j0 * BLOCK_N).to(gl.int64) * sksn
        else:
            ks_ptr = ks_base + j0 * sksn
        for j in range(j0, n_blocks):
            acc, m_i, l_i, alpha, ks_ptr = _consumer_step(
                j, acc, m_i, l_i, alpha, qs, offs_m, offs_n, nk, causal_offset, ks_ptr, sksn,
                q_half, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready, v_empty, turn, zero_s,
                WG, True, IS_CAUSAL, BLOCK_N, BLOCK_D, s_layout, o_layout, PER_TOKEN, PV_FP8)

        # The last block's P̃·V, in turn n_blocks.
        last = n_blocks - 1
        mbarrier.wait(v_ready.index(last % 2), (last // 2) & 1)
        _turn_wait(turn, WG, n_blocks)
        pv = warpgroup_mma(p_smem.index(2 * WG + last % 2),
                           v_operand(v_smem.index(last % 2), PV_FP8),
                           gl.zeros([HALF, BLOCK_D], gl.float32, layout=o_layout),
                           use_acc=False, is_async=True)
        _turn_pass(turn, WG)
        pv = warpgroup_mma_wait(0, deps=[pv])
        mbarrier.arrive(v_empty.index(last % 2), count=1)
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None] + pv

    offs_mo = row0 + gl.arange(0, HALF, layout=rows_o)
    write_rows(acc, m_i, l_i, O, LSE, LSH, VS, VM, CUQ, b, h, hk, nq, NQ, offs_m, offs_mo, offs_d,
               dmask, svsb, svsh, svsd, sob, soh, son, sod, seb, seh, sen, slb, slh, sln, rows_o,
               VARLEN, WRITE_LSE, HAS_VSCALE, HAS_VMEAN, HAS_LSH, PV_FP8)


@gluon.jit
def _consumer_step(j, acc, m_i, l_i, alpha, qs, offs_m, offs_n, nk, causal_offset, ks_ptr, sksn,
                   q_half, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready, v_empty, turn,
                   zero_s, WG: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, s_layout: gl.constexpr,
                   o_layout: gl.constexpr, PER_TOKEN: gl.constexpr, PV_FP8: gl.constexpr):
    """Key block ``j`` (≥ 1) of consumer ``WG``, in its turn ``j``: Q·Kᵀ(j) and P̃·V(j-1) issued,
    the turn passed, K(j) released once Q·Kᵀ(j) retires, softmax(j) under P̃·V(j-1), V(j-1)
    released, ``acc·α(j-1) + pv(j-1)``; returns ``(acc, m, l, α(j))`` and ``ks_ptr`` moved to the
    next block's K scales. Block ``i`` sits in K/V stage ``i % 2`` (barrier phase
    ``(i // 2) & 1``) and in this consumer's P̃ buffer ``2·WG + i % 2``."""
    HALF: gl.constexpr = zero_s.shape[0]
    stage = j % 2
    prev = 1 - stage
    phase = (j // 2) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    mbarrier.wait(v_ready.index(prev), phase ^ prev)  # block j-1's: ((j - 1) // 2) & 1
    _turn_wait(turn, WG, j)
    s_tok = warpgroup_mma(q_half, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    pv_tok = warpgroup_mma(p_smem.index(2 * WG + prev), v_operand(v_smem.index(prev), PV_FP8),
                           gl.zeros([HALF, BLOCK_D], gl.float32, layout=o_layout),
                           use_acc=False, is_async=True)
    _turn_pass(turn, WG)
    ks = key_scales(ks_ptr, j * BLOCK_N, offs_n, nk, _KEYS, MASKED, PER_TOKEN,
                    gl.SliceLayout(0, s_layout))
    s_int = warpgroup_mma_wait(1, deps=[s_tok])
    mbarrier.arrive(k_empty.index(stage), count=1)
    p, m_new, l_i, alpha_new = softmax_block(s_int, ks, qs, m_i, l_i, j * BLOCK_N, offs_m, offs_n,
                                             nk, causal_offset, MASKED, IS_CAUSAL, PER_TOKEN,
                                             PV_FP8)
    p_smem.index(2 * WG + stage).store(p)
    fence_async_shared()
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None] + pv
    if PER_TOKEN:
        ks_ptr += BLOCK_N * sksn
    else:
        ks_ptr += sksn
    return acc, m_new, l_i, alpha_new, ks_ptr


def check_version(version: str | None = None) -> None:
    """:class:`~lowbit_attn.core.triton_support.GluonUnavailable` (a ``RuntimeError`` and an
    ``ImportError``) unless ``version`` (default: the installed Triton's) is of a series whose
    Gluon Hopper API this module compiles against."""
    triton_support.require_gluon("hopper", "the Gluon attention kernel for sm_90a", version)


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
) -> torch.Tensor | None:
    """Run the kernel, as ``kernel_int8.attention`` (same arguments); writes ``out`` (logical
    ``[B, Hq, Nq, D]`` view or packed ``[total, Hq, D]``) and returns the LSE (``[B, Hq, Nq]`` or
    ``[Hq, total]`` fp32) when asked. Raises ``RuntimeError`` on a Triton whose Gluon Hopper API
    this module does not compile against, ``ValueError`` for what the kernel does not cover."""
    check_version()
    _check_scope(qz, pv=pv, granularity=granularity, block_q=block_q, block_k=block_k,
                 seqs_q=seqs_q, seqs_k=seqs_k)
    seqs_q = seqs_q or dense_seqs(qz.q)
    seqs_k = seqs_k or dense_seqs(qz.k)
    packed = seqs_q.packed
    per_token = granularity == "per_token"
    hq, d = qz.q.shape[1], qz.q.shape[-1]
    hkv = qz.k.shape[1]
    lse = None
    if return_lse:
        shape = (hq, qz.q.shape[0]) if packed else qz.q.shape[:3]
        lse = torch.empty(shape, device=out.device, dtype=torch.float32)
    vec = qz.v_scale if qz.v_scale is not None else qz.v_mean
    grid = (triton.cdiv(seqs_q.max_len, block_q), seqs_q.batch * hq)

    def launch():
        triton.set_allocator(tma_scratch)  # in a copy of the caller's context: theirs is kept
        _attn_fwd_int8_pingpong_kernel[grid](
            q=(qz.q, qz.q_scale, bhnd_strides(qz.q, packed),
               row_strides(qz.q_scale, packed and per_token)),
            k=(qz.k, qz.k_scale, bhnd_strides(qz.k, packed),
               row_strides(qz.k_scale, packed and per_token)),
            V=qz.v, VS=qz.v_scale, VM=qz.v_mean, LSH=qz.lse_shift, O=out, LSE=lse,
            CUQ=seqs_q.cu_seqlens, CUK=seqs_k.cu_seqlens,
            v_strides=bhnd_strides(qz.v, packed), vs_strides=strides(vec, 3),
            lsh_strides=row_strides(qz.lse_shift, packed), o_strides=bhnd_strides(out, packed),
            lse_strides=row_strides(lse, packed),
            NQ=seqs_q.max_len, NK=seqs_k.max_len, HQ=hq, GROUP=hq // hkv, D=d,
            causal_offset=0 if causal_offset is None else int(causal_offset),
            IS_CAUSAL=causal_offset is not None, HAS_VSCALE=qz.v_scale is not None,
            HAS_VMEAN=qz.v_mean is not None, HAS_LSH=qz.lse_shift is not None,
            WRITE_LSE=lse is not None, VARLEN=packed, PER_TOKEN=per_token, PV_FP8=pv == "fp8",
            BLOCK_M=block_q, BLOCK_N=block_k, BLOCK_D=d,
            num_warps=CONSUMER_WARPS, maxnreg=MAXNREG,
        )

    contextvars.copy_context().run(launch)
    return lse


def _check_scope(qz: QuantizedQKV, *, pv, granularity, block_q, block_k, seqs_q, seqs_k) -> None:
    """``ValueError`` naming what this kernel does not (yet) cover."""
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16' for the Gluon kernel, got {pv!r}")
    if granularity not in ("per_token", "per_block"):
        raise ValueError(f"granularity must be 'per_token' or 'per_block' for the Gluon kernel, "
                         f"got {granularity!r}")
    if block_q != BLOCK_M or block_k not in BLOCK_NS:
        raise ValueError(f"block_q must be {BLOCK_M} and block_k one of {BLOCK_NS} for the Gluon "
                         f"kernel, got block_q={block_q}, block_k={block_k}")
    packed = seqs_q is not None and seqs_q.packed
    if packed != (seqs_k is not None and seqs_k.packed):
        raise ValueError("Q and K must be both packed or both dense for the Gluon kernel")
    if qz.delta_s is not None:
        raise ValueError("smooth_q (ΔS) is not supported by the Gluon kernel yet")
    d = qz.q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} for the Gluon kernel, got {d}")
    token = 0 if packed else 2  # V's token dimension
    if pv == "fp8" and (qz.v.dtype != torch.float8_e4m3fn or qz.v.stride(token) != 1):
        raise ValueError("v must be E4M3 stored token-contiguous ([B, H, D, N'] or packed "
                         "[H, D, total'], transposed), got "
                         f"dtype {qz.v.dtype} with strides {tuple(qz.v.stride())}")
    if pv == "fp16" and qz.v.dtype != torch.float16:
        raise ValueError(f"v must be float16 for fp16 P·V, got dtype {qz.v.dtype}")
    # TMA: 16-byte aligned bases and strides in bytes, unit inner stride.
    # (Packed V: its descriptor starts at the 16-byte boundary before each sequence.)
    inner_qk = 2 if packed else 3
    inner_v = token if pv == "fp8" else inner_qk
    check_tma_operands(("q", qz.q, inner_qk), ("k", qz.k, inner_qk), ("v", qz.v, inner_v))


__all__ = ["BLOCK_M", "BLOCK_NS", "HEAD_DIMS", "attention", "check_version"]

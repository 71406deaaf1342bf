"""Attention forward with INT8 Q·Kᵀ and FP8 or fp16 P·V for Hopper (sm_90a), written in Gluon.

The same numerics as :mod:`lowbit_attn.inference.kernel_int8` (SageAttention2: per-token scales
folded into the exp2's argument, P̃ to E4M3 as ``exp2(S - m + log2 448)`` or to fp16 as
``exp2(S - m)``, each key block's P̃·V a fresh tensor-core product added into the fp32
accumulator) on the same operands
(:class:`~lowbit_attn.core.operands.QuantizedQKV`), with a schedule Triton's ``tl.dot`` cannot
express: both products asynchronous, P̃·V of the previous key block in flight while this block's
softmax runs.

One program (8 warps: two warpgroups of 64 rows) computes ``BLOCK_M`` = 128 query rows of one
(batch, query head). Key block ``j``'s iteration:

1. issue Q·Kᵀ(j) (INT8 wgmma, Q and K(j) in shared memory), then P̃·V(j-1) (FP8 or fp16 wgmma,
   P̃(j-1) and V(j-1) in shared memory, a fresh accumulator), both asynchronous;
2. ``wait(1)``: retires Q·Kᵀ(j) only (wgmma groups complete in order);
3. softmax of block j under P̃·V(j-1): row max, ``α``, ``exp2``, ``l``; P̃(j) to E4M3 (or fp16),
   stored to the other of two shared-memory P̃ buffers;
4. ``wait(0)``; K(j+2) and V(j+1) requested into the stages just read (both together: the CTA
   barriers Triton puts before a TMA request then cover both, 3 per iteration rather than 4);
   then ``acc = acc·α(j-1) + pv(j-1)``. The rescale reads only registers the finished
   wgmma wrote, so ptxas does not serialize the wgmmas (its warning C7514, met when an accumulator
   still in flight is read).

P̃ goes through shared memory rather than registers: Triton 3.6 cannot carry an 8-bit register
operand through ``warpgroup_mma_wait`` ("Unexpected bitwidth in WGMMAWaitGroupOp: 8"). K and V
arrive by TMA (descriptors made in the kernel, so any token stride and exact zero fill past the
sequence's end), two stages each. The per-token K scales are loaded right after the two wgmmas are
issued, so their latency hides under Q·Kᵀ: loading them one block ahead, as the Triton kernel does,
keeps one more scale vector live and spills at D=128 with 128-key blocks (ptxas, see NOTES §11).

Scope: dense or packed variable-length inputs (``VARLEN``, as the Triton kernel: each sequence's
causal mask aligned bottom-right), per-token or per-block scales (``PER_TOKEN``), FP8 P·V (E4M3
V stored ``[D, N']``: 8-bit wgmma operands must be K-major) or fp16 P·V (``PV_FP8=False``: fp16
V ``[N, D]`` as it is), D = 64 or 128, causal or not, GQA, LSE (with the K-smoothing shift).
Not covered (refused before launch, the Triton kernel runs): ΔS (``smooth_q``), Q quantized in
the kernel. Twin: ``lowbit_attn.inference.naive.quantized_attention``. Written for the Gluon
Hopper API of the Triton series ``core.triton_support.GLUON_SERIES["hopper"]`` names; another is
refused at import and at launch. Opt-in only: the op calls it
when ``LOWBIT_ATTN_KERNEL=gluon`` (this module's kernel) or ``gluon-pingpong``
(:mod:`~lowbit_attn.inference.kernel_int8_gluon_pingpong`'s) and
:mod:`lowbit_attn.inference.gluon_check` admits it.
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
from lowbit_attn.core.triton_helpers import (
    bhnd_strides, key_block_bounds, row_strides, seq_span, strides,
)
from lowbit_attn.inference import kernel_int8_gluon_pingpong as pingpong
from lowbit_attn.inference.gluon_blocks import (
    check_tma_operands, descriptors, key_scales, program_sequence, scales_of_rows, softmax_block,
    tile_offsets, tma_load, tma_scratch, v_box, v_operand, write_rows,
)

SCHEDULES = ("async", "pingpong")

NUM_WARPS = 8  # two warpgroups of 64 query rows
# The K scales' load layout: one key per thread (a block's keys replicated over the 256 threads).
_KEYS = gl.constexpr(gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))
BLOCK_M = 128
BLOCK_NS = (64, 128)  # the sm_90 key blocks of the per-token FP8 recipe
HEAD_DIMS = (64, 128)


@gluon.jit
def _attn_fwd_int8_gluon_kernel(
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
    sqsb, sqsh, sqsn = qs_strides
    sksb, sksh, sksn = ks_strides
    svsb, svsh, svsd = vs_strides
    slb, slh, sln = lsh_strides
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides

    # Two warpgroups stacked along the rows; each owns 64 rows of every tile.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_D, 32 if PV_FP8 else 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.int8)
    k_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], gl.int8)
    # E4M3 P̃ and V ([D, keys], K-major), or fp16 ([keys, D])
    PV_TYPE: gl.constexpr = gl.float8e4nv if PV_FP8 else gl.float16
    V_TILE: gl.constexpr = [BLOCK_D, BLOCK_N] if PV_FP8 else [BLOCK_N, BLOCK_D]
    v_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(V_TILE, PV_TYPE)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], PV_TYPE)

    pid_m, b, h, hk, q_start, nq, k_start, nk, causal_offset = program_sequence(
        CUQ, CUK, NQ, NK, HQ, GROUP, causal_offset, VARLEN)
    if pid_m * BLOCK_M >= nq:
        return

    offs_m, offs_n, offs_d, mmask, dmask = tile_offsets(pid_m, nq, D, BLOCK_M, BLOCK_N, BLOCK_D,
                                                        rows_s, cols_s, cols_o)

    q_desc, k_desc, v_desc, v_col = descriptors(
        Q, K, V, b, h, hk, q_start, nq, k_start, nk, D, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
        svd, VARLEN, BLOCK_M, BLOCK_N, BLOCK_D, q_smem_layout, k_smem_layout, v_smem_layout,
        PV_FP8)

    q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, BLOCK_D], q_smem_layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, BLOCK_D], k_smem_layout)
    v_smem = gl.allocate_shared_memory(PV_TYPE, [2] + V_TILE, v_smem_layout)
    p_smem = gl.allocate_shared_memory(PV_TYPE, [2, BLOCK_M, BLOCK_N], p_smem_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    qs, ks_base = scales_of_rows(QS, KS, b, h, hk, pid_m, q_start, k_start, offs_m, mmask, sqsb,
                                 sqsh, sqsn, sksb, sksh, sksn, BLOCK_N, _KEYS, VARLEN, PER_TOKEN)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=rows_s)
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=s_layout)

    full_hi, hi = key_block_bounds(nk, pid_m, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    n_full = full_hi // BLOCK_N
    k_bytes: gl.constexpr = BLOCK_N * BLOCK_D
    v_bytes: gl.constexpr = BLOCK_D * BLOCK_N if PV_FP8 else 2 * BLOCK_D * BLOCK_N
    if n_blocks > 0:
        mbarrier.expect(q_bar, BLOCK_M * BLOCK_D)
        tma_load(q_desc, [pid_m * BLOCK_M, 0], q_bar, q_smem)
        # Stage 0 holds block 0; stage 1 block 1 (when there is one).
        for i in gl.static_range(2):
            more = i < n_blocks
            mbarrier.expect(k_bars.index(i), k_bytes, pred=more)
            tma_load(k_desc, [i * BLOCK_N, 0], k_bars.index(i), k_smem.index(i), pred=more)
            mbarrier.expect(v_bars.index(i), v_bytes, pred=more)
            v0, v1 = v_box(i, v_col, BLOCK_N, PV_FP8)
            tma_load(v_desc, [v0, v1], v_bars.index(i), v_smem.index(i), pred=more)

        # Block 0: its softmax waits for its Q·Kᵀ (nothing is in flight yet). Masked: a whole
        # block's masks are all true, so this costs nothing in numerics.
        ks = key_scales(ks_base, 0, offs_n, nk, _KEYS, True, PER_TOKEN, cols_s)
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        s_int = warpgroup_mma_wait(0, deps=[s_tok])
        # K(0) is read: its stage takes K(2) (each later step j loads K(j+2)).
        more = 2 < n_blocks
        mbarrier.expect(k_bars.index(0), k_bytes, pred=more)
        tma_load(k_desc, [2 * BLOCK_N, 0], k_bars.index(0), k_smem.index(0), pred=more)
        p, m_i, l_i, alpha = softmax_block(s_int, ks, qs, m_i, l_i, 0, offs_m, offs_n, nk,
                                           causal_offset, True, IS_CAUSAL, PER_TOKEN, PV_FP8)
        p_smem.index(0).store(p)
        fence_async_shared()

        # Blocks 1 .. n_full-1 unmasked, then the masked tail.
        if PER_TOKEN:
            ks_ptr = ks_base + BLOCK_N * sksn
        else:
            ks_ptr = ks_base + sksn
        for j in range(1, n_full):
            acc, m_i, l_i, alpha, ks_ptr = _step(
                j, acc, m_i, l_i, alpha, qs, offs_m, offs_n, nk, causal_offset, ks_ptr,
                sksn, q_smem, k_smem, v_smem, p_smem, k_bars, v_bars, k_desc, v_desc, v_col,
                n_blocks,
                zero_s, False, IS_CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, o_layout, PER_TOKEN,
                s_layout, PV_FP8)
        j0 = gl.maximum(n_full, 1)
        if VARLEN:  # read again: not kept live through the main loop (see the epilogue)
            _, nk = seq_span(CUK, b, NK, True)
        if PER_TOKEN:
            ks_ptr = ks_base + (j0 * BLOCK_N).to(gl.int64) * sksn
        else:
            ks_ptr = ks_base + j0 * sksn
        for j in range(j0, n_blocks):
            acc, m_i, l_i, alpha, ks_ptr = _step(
                j, acc, m_i, l_i, alpha, qs, offs_m, offs_n, nk, causal_offset, ks_ptr,
                sksn, q_smem, k_smem, v_smem, p_smem, k_bars, v_bars, k_desc, v_desc, v_col,
                n_blocks,
                zero_s, True, IS_CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, o_layout, PER_TOKEN,
                s_layout, PV_FP8)

        # The last block's P̃·V.
        last = n_blocks - 1
        mbarrier.wait(v_bars.index(last % 2), (last // 2) & 1)
        pv = warpgroup_mma(p_smem.index(last % 2), v_operand(v_smem.index(last % 2), PV_FP8),
                           gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout),
                           use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(0, deps=[pv])
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None] + pv

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    offs_mo = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_o)
    write_rows(acc, m_i, l_i, O, LSE, LSH, VS, VM, CUQ, b, h, hk, nq, NQ, offs_m, offs_mo, offs_d,
               dmask, svsb, svsh, svsd, sob, soh, son, sod, seb, seh, sen, slb, slh, sln, rows_o,
               VARLEN, WRITE_LSE, HAS_VSCALE, HAS_VMEAN, HAS_LSH, PV_FP8)


@gluon.jit
def _step(j, acc, m_i, l_i, alpha, qs, offs_m, offs_n, nk, causal_offset, ks_ptr, sksn,
          q_smem, k_smem, v_smem, p_smem, k_bars, v_bars, k_desc, v_desc, v_col, n_blocks, zero_s,
          MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, o_layout: gl.constexpr,
          PER_TOKEN: gl.constexpr = True, s_layout: gl.constexpr = None,
          PV_FP8: gl.constexpr = True):
    """Key block ``j`` (≥ 1): Q·Kᵀ(j) and P̃·V(j-1) in flight, softmax(j) under P̃·V(j-1), then
    ``acc·α(j-1) + pv(j-1)``; returns ``(acc, m, l, α(j))`` and ``ks_ptr`` moved to the next
    block's K scales (carried rather than computed from ``j``: an address from ``j`` makes LLVM
    widen the loop counter to 64 bits, and every compare and stage/phase computation with it).
    Stages alternate: block ``i`` is in K/V/P̃ stage ``i % 2``, the barrier phase of its load is
    ``(i // 2) & 1``."""
    stage = j % 2
    prev = 1 - stage
    phase = (j // 2) & 1
    mbarrier.wait(k_bars.index(stage), phase)
    s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    mbarrier.wait(v_bars.index(prev), phase ^ prev)  # block j-1's: ((j - 1) // 2) & 1
    pv_tok = warpgroup_mma(p_smem.index(prev), v_operand(v_smem.index(prev), PV_FP8),
                           gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout),
                           use_acc=False, is_async=True)
    ks = key_scales(ks_ptr, j * BLOCK_N, offs_n, nk, _KEYS, MASKED, PER_TOKEN,
                    gl.SliceLayout(0, s_layout))
    s_int = warpgroup_mma_wait(1, deps=[s_tok])
    p, m_new, l_i, alpha_new = softmax_block(s_int, ks, qs, m_i, l_i, j * BLOCK_N, offs_m, offs_n,
                                             nk, causal_offset, MASKED, IS_CAUSAL, PER_TOKEN,
                                             PV_FP8)
    p_smem.index(stage).store(p)
    fence_async_shared()
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    # K(j) and V(j-1) are read: their stages take K(j+2) and V(j+1).
    more_k = j + 2 < n_blocks
    more_v = j + 1 < n_blocks
    mbarrier.expect(k_bars.index(stage), BLOCK_N * BLOCK_D, pred=more_k)
    mbarrier.expect(v_bars.index(prev), BLOCK_D * BLOCK_N if PV_FP8 else 2 * BLOCK_D * BLOCK_N,
                    pred=more_v)
    tma_load(k_desc, [(j + 2) * BLOCK_N, 0], k_bars.index(stage), k_smem.index(stage),
             pred=more_k)
    v0, v1 = v_box(j + 1, v_col, BLOCK_N, PV_FP8)
    tma_load(v_desc, [v0, v1], v_bars.index(prev), v_smem.index(prev), pred=more_v)
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
    schedule: str = "async",
) -> torch.Tensor | None:
    """Run the kernel, as ``kernel_int8.attention`` (same arguments); writes ``out`` (logical
    ``[B, Hq, Nq, D]`` view or packed ``[total, Hq, D]``) and returns the LSE (``[B, Hq, Nq]`` or
    ``[Hq, total]`` fp32) when asked. ``schedule``: one of :data:`SCHEDULES`, ``"async"`` (this
    module's kernel) or ``"pingpong"`` (``kernel_int8_gluon_pingpong``'s, same operands and
    scope). Raises ``RuntimeError`` on a Triton other than 3.6, ``ValueError`` for what the
    kernels do not cover."""
    check_version()
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
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

    if schedule == "async":
        kernel, options = _attn_fwd_int8_gluon_kernel, dict(num_warps=NUM_WARPS)
    else:
        kernel = pingpong.KERNEL
        options = dict(num_warps=pingpong.CONSUMER_WARPS, maxnreg=pingpong.MAXNREG)

    def launch():
        triton.set_allocator(tma_scratch)  # in a copy of the caller's context: theirs is kept
        kernel[grid](
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
            BLOCK_M=block_q, BLOCK_N=block_k, BLOCK_D=d, **options,
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
    if qz.q_raw is not None or qz.q_scale is None:
        raise ValueError("the Gluon kernel needs Q quantized by its pass "
                         "(LOWBIT_ATTN_Q_QUANT=kernel is not supported)")
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


__all__ = ["SCHEDULES", "attention", "check_version"]

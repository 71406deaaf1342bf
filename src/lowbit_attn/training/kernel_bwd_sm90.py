"""The attention backward's loops for Hopper (sm_90a), in Gluon: dK/dV, dQ and the Δ pass, one set
for the trainable INT8 attention (SageBwd, P and dS per tile or per row:
``TrainRecipe.backward_granularity``) and for video sparse attention's 16-bit fine stage (the same
loops over its block-sparse lists of tiles).

dK/dV: one program holds a block of keys, 64 per consumer warpgroup (``NUM_WG`` warpgroups: 2,
128 keys, for the trainable attention; 1, one 64-token key tile, for VSA), with K and V in shared
memory, and walks the query tiles of 64 that see them (for each query head of its K/V head): the
score tile transposed, keys × queries, so that Pᵀ and dSᵀ are the A operands of ``dV = Pᵀ·dO``
and ``dK = dSᵀ·Q`` straight from registers. Per query tile, per warpgroup (64 keys × 64 queries):

1. wait for the tile's operands (TMA, two stages: the next tile's are requested here);
   ``Sᵀ = K·Qᵀ`` (INT8, or 16-bit) and ``dPᵀ = V·dOᵀ`` (16-bit), issued together;
2. ``P = exp2(Sᵀ·s_q·s_k - LSE)``, then ``dS = P ∘ (dP - Δ)``;
3. INT8: P and dS quantized per row (per key: the rows of the products' outputs; a row's amax is
   its quad's, two shuffles) or per 64×64 tile (the warpgroup's, across its warps), each value
   the exact product with the reciprocal scale rounded half to even and four packed to a
   register by one inline-PTX sequence (:data:`RNE_S8X4_PTX`: no conversion instruction), in the
   A fragment's order (``gluon_blocks.a_fragment_order``); the B operands, dO and Q, come
   token-major with their tokens permuted in groups of 16 (:func:`permuted_token_major`) to
   match. 16-bit: P and dS rounded to the inputs' dtype;
4. ``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q``: INT8 products into a fresh int32 tile, added into the fp32
   accumulators times the row's scale and the operand's (``r·(s_row·s_b)``); 16-bit products
   accumulate in the wgmma. At D = 128 (INT8) dV's and dK's channels 64-127 live in shared
   memory (registers: ``benchmarks/NOTES.md`` §8).

dQ (and Δ): one program holds 64 queries per warpgroup and walks key tiles of 64 the same way
(S and dP not transposed, dS quantized per row of queries or per tile, K token-major permuted as
dQ's B operand); the Δ pass sums ``P ∘ dP`` per row instead.

Masks: keys past the end are rows of their own (their dK and dV are not stored, and they are
kept out of every other row's scale); queries past the end, or past a VSA tile's count, get
``LSE = +inf`` (P = 0 there: their Q and dO read as zeros); the causal diagonal is masked in the
query tiles that cross it.

Numerics: those of the twins, bit for bit on the CPU model (``tools/gluon_cpu.py``):
``training.naive.backward`` (either granularity) and
``vsa.naive.fine_backward_tiles``. Written for the Gluon Hopper API of the Triton series
``core.triton_support.GLUON_SERIES["hopper"]`` names. Opt-in (``LOWBIT_ATTN_BWD_KERNEL=sm90``):
no GPU has run it yet.
"""

from __future__ import annotations

import torch
import triton

from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("hopper", "lowbit_attn.training.kernel_bwd_sm90")

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lowbit_attn.core.operands import TILE_AMAX_FLOOR, TRAIN_BLOCK, V_KEY_ORDER
from lowbit_attn.core.triton_helpers import batch_head, key_block_bounds, strides
from lowbit_attn.inference.gluon_blocks import (
    a_fragment_order, check_tma_operands, cta_barrier, max_nan, tma_load,
)

BQ = 64  # queries per tile (the scales' group along the contracted dimension)
WG_KEYS = 64  # keys per consumer warpgroup
HEAD_DIMS = (64, 128)
_BQ = gl.constexpr(BQ)
_WG_KEYS = gl.constexpr(WG_KEYS)
_BLOCK = gl.constexpr(TRAIN_BLOCK)
_FLOOR = gl.constexpr(TILE_AMAX_FLOOR)
# The LSE and Δ rows' layout in shared memory (TMA boxes of 64 fp32, read back in any layout)
_LD_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


# Four fp32 values x (times the row's reciprocal scale r) → four int8 in one register, the first
# in the low byte: fma(x, r, 1.5·2^23) rounds the exact product half to even into the low bits
# of its fp32 pattern (|x·r| < 2^22), whose low byte is the integer's two's complement; three
# PRMT gather the four low bytes. NaN and Inf give garbage bytes: their row's scale is NaN or
# Inf, which poisons that row's product whatever the bytes are.
RNE_S8X4_PTX = gl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3;\n"
    "fma.rn.f32 t0, $1, $5, 0f4B400000;\n"
    "fma.rn.f32 t1, $2, $6, 0f4B400000;\n"
    "fma.rn.f32 t2, $3, $7, 0f4B400000;\n"
    "fma.rn.f32 t3, $4, $8, 0f4B400000;\n"
    "prmt.b32 t0, t0, t1, 0x0040;\n"
    "prmt.b32 t2, t2, t3, 0x0040;\n"
    "prmt.b32 $0, t0, t2, 0x5410; }")
RNE_S8X4_CONSTRAINTS = gl.constexpr("=r,r,r,r,r,r,r,r,r")
# The program's second grid index (``gl.program_id(1)``), read again where it is needed
CTAID_Y_PTX = gl.constexpr("mov.u32 $0, %ctaid.y;")


@gluon.jit
def quantize_rows(x, a_layout: gl.constexpr, PER_TILE: gl.constexpr, rows_in_tile):
    """fp32 ``x [M, 64]`` in a wgmma accumulator's layout → ``(A operand, scales [M])``: INT8 with
    one scale ``max(amax, 2^-100)/127`` per row (NaN propagates), or with ``PER_TILE`` one per
    64×64 tile (each warpgroup's rows); each value the exact product ``x·(1/scale)`` rounded
    half to even, in ``a_layout`` and :func:`~lowbit_attn.inference.gluon_blocks.
    a_fragment_order`. Twin: ``training.naive.quantize_tiles`` (an Inf in a tile gives its scale
    Inf here, NaN there: the tile's products are not finite either way). ``rows_in_tile``
    (``PER_TILE``; None: all): the rows that set the tile's scale (the others, rows of their own
    whose products nothing reads, take it too)."""
    amax = gl.reduce(gl.abs(x), 1, max_nan)
    if PER_TILE:  # the warpgroup's largest: through shared memory, across its four warps
        if rows_in_tile is not None:
            amax = gl.where(rows_in_tile, amax, 0.0)
        rows: gl.constexpr = amax.type.layout
        m: gl.constexpr = x.shape[0]
        per_wg = gl.reshape(amax, [m // 64, 64])
        tile = gl.expand_dims(gl.reduce(per_wg, 1, max_nan), 1)
        amax = gl.convert_layout(gl.reshape(gl.broadcast(tile, per_wg)[0], [m]), rows)
    amax = gl.where(amax < _FLOOR, _FLOOR, amax)  # NaN stays NaN
    scale = amax * (1.0 / 127.0)
    inverse = gl.convert_layout(gl.div_rn(1.0, scale), gl.SliceLayout(1, a_layout))
    xa = a_fragment_order(x, a_layout)
    xa, inverse = gl.broadcast(xa, gl.expand_dims(inverse, 1))
    bits = gl.inline_asm_elementwise(RNE_S8X4_PTX, RNE_S8X4_CONSTRAINTS, [xa, inverse],
                                     dtype=gl.int8, is_pure=True, pack=4)
    return bits, scale


@gluon.jit
def _load_tile(t, pred, stage, bufs, descs, INT8: gl.constexpr, BLOCK_D: gl.constexpr):
    """Request query tile ``t``'s operands into ``stage`` (where ``pred``): Q and dO for the
    scores, the tile's LSE and Δ, and (INT8) the token-major permuted Q and dO for dK and dV.
    ``descs``: the TMA descriptors and where the query head's rows start in each."""
    k_smem, v_smem, q_smem, do_smem, qt_smem, dot_smem, ld_smem, ld_bars, park = bufs
    q_desc, do_desc, qt_desc, dot_desc, ld_desc, q_row, qt_row, ld_row, ld_plane = descs
    bar = ld_bars.index(stage)
    q_bytes: gl.constexpr = _BQ * BLOCK_D * (1 if INT8 else 2)
    t_bytes: gl.constexpr = 2 * _BQ * BLOCK_D if INT8 else 0
    mbarrier.expect(bar, q_bytes + 2 * _BQ * BLOCK_D + t_bytes + 8 * _BQ, pred=pred)
    tma_load(ld_desc, [ld_row + t * _BQ], bar, ld_smem.index(2 * stage), pred=pred)
    tma_load(ld_desc, [ld_row + ld_plane + t * _BQ], bar, ld_smem.index(2 * stage + 1),
             pred=pred)
    tma_load(q_desc, [q_row + t * _BQ, 0], bar, q_smem.index(stage), pred=pred)
    tma_load(do_desc, [q_row + t * _BQ, 0], bar, do_smem.index(stage), pred=pred)
    if INT8:
        tma_load(qt_desc, [qt_row, t * _BQ], bar, qt_smem.index(stage), pred=pred)
        tma_load(dot_desc, [qt_row, t * _BQ], bar, dot_smem.index(stage), pred=pred)


@gluon.jit
def _barriers(a_desc, b_desc, a_smem, b_smem, row, INT8: gl.constexpr):
    """A program's barriers: ``(once, stages)``, one for the tiles it loads once (``a``, INT8 or
    16-bit, and ``b``, 16-bit, at ``row``: requested here) and two for the two stages of the
    tiles it walks."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    stages = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for j in gl.static_range(2):
        mbarrier.init(stages.index(j), count=1)
    mbarrier.expect(once, a_smem.shape[0] * a_smem.shape[1] * (3 if INT8 else 4))
    tma_load(a_desc, [row, 0], once, a_smem)
    tma_load(b_desc, [row, 0], once, b_smem)
    return once, stages


@gluon.jit
def _scores_and_dp(i, ld_bars, s_a, s_b, dp_a, dp_b, zero_s, zero_p):
    """Wait for the ``i``-th walked tile's stage (``i % 2``, its ``(i // 2)``-th filling), then
    issue the tile's scores ``s_a·s_bᵀ`` and ``dp_a·dp_bᵀ`` (dP, or dPᵀ), asynchronously, in
    that order: their tokens."""
    mbarrier.wait(ld_bars.index(i & 1), (i >> 1) & 1)
    s_tok = warpgroup_mma(s_a, s_b.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(dp_a, dp_b.permute((1, 0)), zero_p, use_acc=False, is_async=True)
    return s_tok, dp_tok


@gluon.jit
def _int8_product(a, b, acc, scale, zero):
    """``acc + (a·b)·scale``: an INT8 product into a fresh int32 tile, then times each row's
    scale into the fp32 accumulator (the twin's order: ``r·s`` rounded, then added)."""
    tok = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
    r = warpgroup_mma_wait(0, deps=[tok])
    return acc + r.to(gl.float32) * gl.expand_dims(scale, 1)


@gluon.jit
def _dkdv_step(i, t, nxt, more, acc, rows, bufs, descs, LD, zeros,
               a_layout: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
               INT8: gl.constexpr, BLOCK_D: gl.constexpr, PER_TILE: gl.constexpr):
    """Query tile ``t`` (the ``i``-th of the program: stage ``i % 2``): ``acc = (dV, dK)`` with
    its share added (INT8 at D = 128: their first 64 channels; the other 64 are in ``park``, in
    shared memory); the operands of tile ``nxt`` requested where ``more``. ``rows``: ``(the
    rows' score scale, how many of them are keys, the causal offset from the first key)``."""
    k_smem, v_smem, q_smem, do_smem, qt_smem, dot_smem, ld_smem, ld_bars, park = bufs
    ld_row, ld_plane = descs[7], descs[8]
    zero_s, zero_p, zero_o = zeros
    c_rows, n_keys, shift = rows
    dv, dk = acc
    stage = i & 1
    s_tok, dp_tok = _scores_and_dp(i, ld_bars, k_smem, q_smem.index(stage), v_smem,
                                   do_smem.index(stage), zero_s, zero_p)
    # the other stage's last readers (tile i-1's products) have retired in this warpgroup; the
    # barrier waits for the others before its buffers are refilled
    cta_barrier()
    _load_tile(nxt, more, 1 - stage, bufs, descs, INT8, BLOCK_D)

    p_layout: gl.constexpr = zero_p.type.layout
    cols: gl.constexpr = gl.SliceLayout(0, p_layout)
    lse = ld_smem.index(2 * stage).load(cols)
    c = c_rows
    if INT8:
        scales = LD + 2 * ld_plane + ld_row + t * _BQ  # the tile's Q, dO and Q (for dK) scales
        c = c_rows * gl.load(scales)
    s = gl.convert_layout(warpgroup_mma_wait(1, deps=[s_tok]).to(gl.float32), p_layout)
    x = gl.fma(s, gl.expand_dims(c, 1), -gl.expand_dims(lse, 0))
    if MASKED and IS_CAUSAL:
        queries = t * _BQ + gl.arange(0, _BQ, layout=cols)
        krows = gl.arange(0, c_rows.shape[0], layout=c_rows.type.layout)  # from the first key
        seen = gl.expand_dims(krows, 1) <= gl.expand_dims(queries, 0) + shift
        x = gl.where(seen, x, float("-inf"))
    p = gl.exp2(x)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])
    ds = p * (dp - gl.expand_dims(ld_smem.index(2 * stage + 1).load(cols), 0))
    if INT8:
        W: gl.constexpr = zero_o.shape[1]
        o_layout: gl.constexpr = zero_o.type.layout
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        # keys past the end: rows of their own, outside the tile's scale
        keys = gl.arange(0, c_rows.shape[0], layout=c_rows.type.layout) < n_keys
        p8, ps = quantize_rows(p, a_layout, PER_TILE, keys)
        ds8, dss = quantize_rows(ds, a_layout, PER_TILE, keys)
        sv = gl.convert_layout(ps * gl.load(scales + 1), o_rows)
        sk = gl.convert_layout(dss * gl.load(scales + 2), o_rows)
        dot = dot_smem.index(stage)
        qt = qt_smem.index(stage)
        dv = _int8_product(p8, dot.slice(0, W).permute((1, 0)), dv, sv, zero_o)
        if BLOCK_D > W:  # the channels past the first 64 live in shared memory (NOTES §8)
            more_v = park.index(0)
            more_v.store(_int8_product(p8, dot.slice(W, W).permute((1, 0)), more_v.load(o_layout),
                                       sv, zero_o))
        dk = _int8_product(ds8, qt.slice(0, W).permute((1, 0)), dk, sk, zero_o)
        if BLOCK_D > W:
            more_k = park.index(1)
            more_k.store(_int8_product(ds8, qt.slice(W, W).permute((1, 0)),
                                       more_k.load(o_layout), sk, zero_o))
    else:
        dtype: gl.constexpr = do_smem.dtype
        p16 = gl.convert_layout(p.to(dtype), a_layout)
        ds16 = gl.convert_layout(ds.to(dtype), a_layout)
        v_tok = warpgroup_mma(p16, do_smem.index(stage), dv, is_async=True)
        k_tok = warpgroup_mma(ds16, q_smem.index(stage), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[v_tok, k_tok])
    return dv, dk


@gluon.jit
def _dkdv_sm90_kernel(
    k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, ld_desc,
    KS, LD, DK, DV, BAL, RIDX, RCNT, CNT,
    ks_strides, dk_strides, dv_strides, bal_strides, ridx_strides, rcnt_strides,
    NQ, NK, HKV, GROUP, LD_N, LD_PLANE, causal_offset, softmax_scale, qk_scale,
    IS_CAUSAL: gl.constexpr, INT8: gl.constexpr, SPARSE: gl.constexpr, HAS_BAL: gl.constexpr,
    BLOCK_D: gl.constexpr, NUM_WG: gl.constexpr, PER_TILE: gl.constexpr,
):
    """dK and dV of one block of ``64·NUM_WG`` keys of one (batch, K/V head). TMA descriptors
    (:func:`descriptors`) over contiguous ``[B, H, N, D]`` tensors seen as ``[B·H·N, D]`` rows
    (VSA: its padded tiles ``[B, H, nt, 64, D]``, N = nt·64; a key block is one key tile): K and
    V (boxes of ``64·NUM_WG`` rows), the scores' Q (INT8 or 16-bit) and dP's dO (16-bit, boxes
    of 64 rows); (INT8) Q and dO for dK and dV, token-major ``[B·H·D, N']`` with tokens permuted
    in groups of 16 (boxes ``[D, 64]``); ``LD`` ``[2 or 3, B, H, LD_N]`` fp32 (N padded to 64,
    :func:`bwd_rows`; planes ``LD_PLANE`` apart), by boxes of 64. ``KS`` ``[B, Hkv, N/64]`` K's
    per-block scales; ``BAL`` ``[B, Hkv, D]`` the balancing factors (dK divided by them). VSA
    (``SPARSE``): the query tiles of each key tile in ``RIDX [B, H, nt, nt]`` (the first
    ``RCNT [B, H, nt]`` valid), the tiles' token counts in ``CNT [nt]``, ``qk_scale`` =
    ``softmax_scale·log2 e`` (fp32) the 16-bit scores' scale."""
    BK: gl.constexpr = _WG_KEYS * NUM_WG
    WARPS: gl.constexpr = 4 * NUM_WG
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, _BQ, 32 if INT8 else 16])
    p_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, _BQ, 16])
    W: gl.constexpr = 64 if INT8 else BLOCK_D  # the accumulators' chunks of channels
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, W, 32 if INT8 else 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=4 if INT8 else 2)
    S_TYPE: gl.constexpr = k_desc.dtype  # the scores' operands: INT8, or 16-bit
    D_TYPE: gl.constexpr = v_desc.dtype  # dP's, 16-bit
    sksb, sksh, sksn = ks_strides
    srb, srh, srt, srk = ridx_strides
    scb, sch, sct = rcnt_strides

    pid_n = gl.program_id(0)
    b, hk = batch_head(gl.program_id(1), HKV)
    k0 = pid_n * BK
    HQ = HKV * GROUP

    # shared memory in the layouts of the TMA boxes that fill it (the host's descriptors)
    k_smem = gl.allocate_shared_memory(S_TYPE, [BK, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(D_TYPE, [BK, BLOCK_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(S_TYPE, [2, _BQ, BLOCK_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(D_TYPE, [2, _BQ, BLOCK_D], do_desc.layout)
    if INT8:
        qt_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_D, _BQ], qt_desc.layout)
        dot_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_D, _BQ], dot_desc.layout)
    else:
        qt_smem = q_smem
        dot_smem = do_smem
    ld_smem = gl.allocate_shared_memory(gl.float32, [4, _BQ], ld_desc.layout)  # stage s: 2s, 2s+1
    kv_bar, ld_bars = _barriers(k_desc, v_desc, k_smem, v_smem,
                                ((b * HKV + hk) * NK + k0).to(gl.int32), INT8)

    krows = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, p_layout))
    c_rows = gl.full([BK], qk_scale, gl.float32, layout=gl.SliceLayout(1, p_layout))
    if INT8:  # each key's block scale (two blocks of 64 for two warpgroups)
        c_rows = gl.load(KS + b * sksb + hk * sksh + (krows // _BLOCK).to(gl.int64) * sksn,
                         mask=krows < NK, other=0.0)
    zero_s = gl.zeros([BK, _BQ], gl.int32 if INT8 else gl.float32, layout=s_layout)
    zero_p = gl.zeros([BK, _BQ], gl.float32, layout=p_layout)
    zero_o = gl.zeros([BK, W], gl.int32 if INT8 else gl.float32, layout=o_layout)
    dv = gl.zeros([BK, W], gl.float32, layout=o_layout)
    acc = (dv, dv)
    park = ld_smem
    if BLOCK_D > W:  # INT8, D = 128: dV's and dK's channels 64-127 in shared memory
        park = gl.allocate_shared_memory(
            gl.float32, [2, BK, W], gl.NVMMASharedLayout.get_default_for([BK, W], gl.float32))
        park.index(0).store(dv)
        park.index(1).store(dv)
    bufs = (k_smem, v_smem, q_smem, do_smem, qt_smem, dot_smem, ld_smem, ld_bars, park)
    zeros = (zero_s, zero_p, zero_o)
    rows = (c_rows, NK - k0, causal_offset - k0)

    nqb = gl.cdiv(NQ, _BQ)
    lo = 0
    first_full = 0
    if IS_CAUSAL:  # query tiles below lo see none of these keys; from first_full on, all
        lo = gl.maximum(k0 - causal_offset, 0) // _BQ
        last_key = gl.minimum(k0 + BK, NK) - 1
        first_full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(last_key - causal_offset, 0), _BQ),
                                           lo), nqb)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        head = b * HQ + h
        descs = (q_desc, do_desc, qt_desc, dot_desc, ld_desc, (head * NQ).to(gl.int32),
                 (head * BLOCK_D).to(gl.int32), (head * LD_N).to(gl.int32), LD_PLANE)
        if SPARSE:
            n = gl.load(RCNT + b * scb + h * sch + pid_n * sct)
            tiles = RIDX + b * srb + h * srh + pid_n * srt
            t0 = gl.load(tiles, mask=n > 0, other=0)
            start = 0
        else:
            n = nqb
            t0 = lo
            start = lo
        _load_tile(t0, start < n, i & 1, bufs, descs, INT8, BLOCK_D)
        if SPARSE:
            for s in range(0, n):
                t = gl.load(tiles + s * srk)
                nxt = gl.load(tiles + (s + 1) * srk, mask=s + 1 < n, other=0)
                acc = _dkdv_step(i, t, nxt, s + 1 < n, acc, rows, bufs, descs,
                                 LD, zeros, a_layout, False, False, INT8, BLOCK_D,
                                 PER_TILE)
                i += 1
        else:
            for t in range(lo, first_full):
                acc = _dkdv_step(i, t, t + 1, t + 1 < n, acc, rows, bufs, descs,
                                 LD, zeros, a_layout, True, IS_CAUSAL, INT8, BLOCK_D,
                                 PER_TILE)
                i += 1
            for t in range(first_full, n):
                acc = _dkdv_step(i, t, t + 1, t + 1 < n, acc, rows, bufs, descs,
                                 LD, zeros, a_layout, False, IS_CAUSAL, INT8, BLOCK_D,
                                 PER_TILE)
                i += 1

    mbarrier.invalidate(kv_bar)
    for j in gl.static_range(2):
        mbarrier.invalidate(ld_bars.index(j))

    dv, dk = acc
    BALANCE: gl.constexpr = -1 if HAS_BAL else 0
    _store_rows(DV, dv_strides, HKV, 1, NK, CNT, dv, None, None, 0, 1.0, SPARSE, 0)
    _store_rows(DK, dk_strides, HKV, 1, NK, CNT, dk, BAL, bal_strides, 0, softmax_scale, SPARSE,
                BALANCE)
    if BLOCK_D > W:
        _store_rows(DV, dv_strides, HKV, 1, NK, CNT, park.index(0).load(o_layout), None, None, W,
                    1.0, SPARSE, 0)
        _store_rows(DK, dk_strides, HKV, 1, NK, CNT, park.index(1).load(o_layout), BAL,
                    bal_strides, W, softmax_scale, SPARSE, BALANCE)


@gluon.jit
def _dq_step(j, kt, nxt, more, acc, rows, causal_offset, nk, bufs, descs, scales, zeros,
             a_layout: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
             INT8: gl.constexpr, SPARSE: gl.constexpr, DELTA_PASS: gl.constexpr,
             BLOCK_D: gl.constexpr, PER_TILE: gl.constexpr):
    """Key tile ``kt`` (the ``j``-th of the program: stage ``j % 2``) of the program's queries:
    ``acc = (dQ, dQ', Δ)`` with its share added (``DELTA_PASS``: Δ only; INT8 at D = 128: dQ's
    two chunks of 64 channels, else the second is the first, untouched); the operands of tile
    ``nxt`` requested where ``more``. ``rows``: ``(query index, the rows' score scale, LSE, Δ)``;
    ``scales``: K's per-block scales for the scores and for dQ."""
    q_smem, do_smem, k_smem, v_smem, kt_smem, ld_bars = bufs
    zero_s, zero_p, zero_o = zeros
    qrows, c_rows, lse, delta = rows
    dq0, dq1, delta_acc = acc
    KS, KDQS, ks_strides = scales
    stage = j & 1
    s_tok, dp_tok = _scores_and_dp(j, ld_bars, q_smem, k_smem.index(stage), do_smem,
                                   v_smem.index(stage), zero_s, zero_p)
    cta_barrier()  # the other stage's readers, in every warpgroup, are done
    _load_key_tile(nxt, more, 1 - stage, bufs, descs, INT8, INT8 and not DELTA_PASS, BLOCK_D)

    p_layout: gl.constexpr = zero_p.type.layout
    cols: gl.constexpr = gl.SliceLayout(0, p_layout)
    c = c_rows
    if INT8:
        sksb, sksh, sksn = ks_strides
        c = c_rows * gl.load(KS + kt * sksn)  # KS, KDQS: the K/V head's
    s = gl.convert_layout(warpgroup_mma_wait(1, deps=[s_tok]).to(gl.float32), p_layout)
    x = gl.fma(s, gl.expand_dims(c, 1), -gl.expand_dims(lse, 1))
    if MASKED:  # keys past the end (of the sequence, or of a VSA tile), past the diagonal
        keys = gl.arange(0, _BQ, layout=cols)
        if SPARSE:
            seen = gl.expand_dims(keys < nk, 0)
        else:
            keys = kt * _BQ + keys
            seen = gl.expand_dims(keys < nk, 0)
            if IS_CAUSAL:
                seen = seen & (gl.expand_dims(keys, 0) <= gl.expand_dims(qrows, 1) + causal_offset)
        x = gl.where(seen, x, float("-inf"))
    p = gl.exp2(x)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])
    if DELTA_PASS:
        delta_acc = delta_acc + gl.sum(p * dp, axis=1)
    else:
        ds = p * (dp - gl.expand_dims(delta, 1))
        if INT8:
            W: gl.constexpr = zero_o.shape[1]
            o_rows: gl.constexpr = gl.SliceLayout(1, zero_o.type.layout)
            ds8, dss = quantize_rows(ds, a_layout, PER_TILE, None)
            sq = gl.convert_layout(dss * gl.load(KDQS + kt * sksn), o_rows)
            kt_tile = kt_smem.index(stage)
            dq0 = _int8_product(ds8, kt_tile.slice(0, W).permute((1, 0)), dq0, sq, zero_o)
            if BLOCK_D > W:
                dq1 = _int8_product(ds8, kt_tile.slice(W, W).permute((1, 0)), dq1, sq, zero_o)
        else:
            dtype: gl.constexpr = v_smem.dtype
            tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_smem.index(stage),
                                dq0, is_async=True)
            dq0 = warpgroup_mma_wait(0, deps=[tok])
    return dq0, dq1, delta_acc


@gluon.jit
def _load_key_tile(kt, pred, stage, bufs, descs, INT8: gl.constexpr, WITH_KT: gl.constexpr,
                   BLOCK_D: gl.constexpr):
    """Request key tile ``kt``'s operands into ``stage`` (where ``pred``): K and V for the
    scores and dP, and (``WITH_KT``) the token-major permuted K for dQ. ``descs``: the TMA
    descriptors and where the K/V head's rows start."""
    q_smem, do_smem, k_smem, v_smem, kt_smem, ld_bars = bufs
    k_desc, v_desc, kt_desc, k_row, kt_row = descs
    bar = ld_bars.index(stage)
    k_bytes: gl.constexpr = _BQ * BLOCK_D * (1 if INT8 else 2)
    t_bytes: gl.constexpr = _BQ * BLOCK_D if WITH_KT else 0
    mbarrier.expect(bar, k_bytes + 2 * _BQ * BLOCK_D + t_bytes, pred=pred)
    tma_load(k_desc, [k_row + kt * _BQ, 0], bar, k_smem.index(stage), pred=pred)
    tma_load(v_desc, [k_row + kt * _BQ, 0], bar, v_smem.index(stage), pred=pred)
    if WITH_KT:
        tma_load(kt_desc, [kt_row, kt * _BQ], bar, kt_smem.index(stage), pred=pred)


@gluon.jit
def _dq_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, kt_desc, QS, KS, KDQS, LSE, DELTA, DQ, BAL, IDX, CNT,
    qs_strides, ks_strides, lse_strides, delta_strides, dq_strides, bal_strides, idx_strides,
    NQ, NK, HQ, GROUP, KK, causal_offset, softmax_scale, qk_scale,
    IS_CAUSAL: gl.constexpr, INT8: gl.constexpr, SPARSE: gl.constexpr, HAS_BAL: gl.constexpr,
    DELTA_PASS: gl.constexpr, BLOCK_D: gl.constexpr, NUM_WG: gl.constexpr,
    PER_TILE: gl.constexpr,
):
    """dQ of ``64·NUM_WG`` query rows of one (batch, query head) over key tiles of 64, or with
    ``DELTA_PASS`` their ``Δ_i = Σ_j P_ij·dP_ij`` (into ``DELTA``). Descriptors as in
    :func:`_dkdv_sm90_kernel`: Q (for the scores) and dO (for dP) by boxes of the program's
    rows; K and V by key tiles; (INT8) K token-major ``[B·Hkv·D, N']`` with tokens permuted in
    groups of 16 (boxes ``[D, 64]``). ``QS`` ``[B, Hq, N/64]`` Q's per-block scales (times
    ``softmax_scale·log2 e``), ``KS``, ``KDQS`` ``[B, Hkv, N/64]`` K's for the scores and for
    dQ; ``LSE``, ``DELTA`` ``[B, Hq, N]`` base-2 LSE and Δ (strides of their own); ``BAL``
    ``[B, Hkv, D]`` (dQ times it).
    VSA (``SPARSE``): query tile ``i``'s ``KK`` key tiles in ``IDX [B, Hq, nt, KK]``, the tiles'
    token counts in ``CNT [nt]``; ``qk_scale`` the 16-bit scores' scale."""
    BM: gl.constexpr = 64 * NUM_WG
    WARPS: gl.constexpr = 4 * NUM_WG
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, _BQ, 32 if INT8 else 16])
    p_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, _BQ, 16])
    W: gl.constexpr = 64 if INT8 else BLOCK_D
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, W, 32 if INT8 else 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=4 if INT8 else 2)
    rows_p: gl.constexpr = gl.SliceLayout(1, p_layout)
    sqsb, sqsh, sqsn = qs_strides
    sksb, sksh, sksn = ks_strides
    slb, slh, sln = lse_strides
    sdb, sdh, sdn = delta_strides
    sib, sih, sit, sik = idx_strides

    pid_m = gl.program_id(0)
    b, h = batch_head(gl.program_id(1), HQ)
    hk = h // GROUP
    q0 = pid_m * BM

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, BLOCK_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BM, BLOCK_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, _BQ, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, _BQ, BLOCK_D], v_desc.layout)
    kt_smem = k_smem
    if INT8 and not DELTA_PASS:
        kt_smem = gl.allocate_shared_memory(gl.int8, [2, BLOCK_D, _BQ], kt_desc.layout)
    q_bar, ld_bars = _barriers(q_desc, do_desc, q_smem, do_smem,
                               ((b * HQ + h) * NQ + q0).to(gl.int32), INT8)

    slots = gl.arange(0, BM, layout=rows_p)
    qrows = q0 + slots
    if SPARSE:
        valid = slots < gl.load(CNT + pid_m)
    else:
        valid = qrows < NQ
    # rows past the end: LSE +inf, P = 0 (the tile's scale, per tile, is the valid rows')
    q64 = qrows.to(gl.int64)  # row offsets in int64: row·stride may pass 2^31
    lse = gl.load(LSE + b * slb + h * slh + q64 * sln, mask=valid, other=float("inf"))
    lse = gl.where(lse == float("-inf"), 0.0, lse)  # a row that sees no key: P = exp2(-inf) = 0
    delta = gl.zeros([BM], gl.float32, layout=rows_p)
    if not DELTA_PASS:
        delta = gl.load(DELTA + b * sdb + h * sdh + q64 * sdn, mask=valid, other=0.0)
    c_rows = gl.full([BM], qk_scale, gl.float32, layout=rows_p)
    if INT8:  # each query's block scale (two blocks of 64 for two warpgroups)
        c_rows = gl.load(QS + b * sqsb + h * sqsh + (q64 // _BLOCK) * sqsn, mask=valid,
                         other=0.0)
    zero_s = gl.zeros([BM, _BQ], gl.int32 if INT8 else gl.float32, layout=s_layout)
    zero_p = gl.zeros([BM, _BQ], gl.float32, layout=p_layout)
    zero_o = gl.zeros([BM, W], gl.int32 if INT8 else gl.float32, layout=o_layout)
    dq = gl.zeros([BM, W], gl.float32, layout=o_layout)
    acc = (dq, dq, delta * 0.0)
    bufs = (q_smem, do_smem, k_smem, v_smem, kt_smem, ld_bars)
    zeros = (zero_s, zero_p, zero_o)
    rows = (qrows, c_rows, lse, delta)
    scales = (KS, KDQS, ks_strides)
    if INT8:  # the K/V head's
        scales = (KS + b * sksb + hk * sksh, KDQS + b * sksb + hk * sksh, ks_strides)
    k_row = ((b * (HQ // GROUP) + hk) * NK).to(gl.int32)
    descs = (k_desc, v_desc, kt_desc, k_row, ((b * (HQ // GROUP) + hk) * BLOCK_D).to(gl.int32))
    WITH_KT: gl.constexpr = INT8 and not DELTA_PASS

    if SPARSE:
        tiles = IDX + b * sib + h * sih + pid_m * sit
        _load_key_tile(gl.load(tiles), KK > 0, 0, bufs, descs, INT8, WITH_KT, BLOCK_D)
        mbarrier.wait(q_bar, 0)
        for j in range(0, KK):
            kt = gl.load(tiles + j * sik)
            nxt = gl.load(tiles + (j + 1) * sik, mask=j + 1 < KK, other=0)
            acc = _dq_step(j, kt, nxt, j + 1 < KK, acc, rows, causal_offset, gl.load(CNT + kt),
                           bufs, descs, scales, zeros, a_layout, True, False, INT8, True,
                           DELTA_PASS, BLOCK_D, PER_TILE)
    else:
        full_hi, hi = key_block_bounds(NK, pid_m, causal_offset, IS_CAUSAL, BM, _BQ)
        n_full = full_hi // _BQ
        n = gl.cdiv(hi, _BQ)
        _load_key_tile(0, n > 0, 0, bufs, descs, INT8, WITH_KT, BLOCK_D)
        mbarrier.wait(q_bar, 0)
        for j in range(0, n_full):
            acc = _dq_step(j, j, j + 1, j + 1 < n, acc, rows, causal_offset, NK, bufs, descs,
                           scales, zeros, a_layout, False, IS_CAUSAL, INT8, False, DELTA_PASS,
                           BLOCK_D, PER_TILE)
        for j in range(n_full, n):
            acc = _dq_step(j, j, j + 1, j + 1 < n, acc, rows, causal_offset, NK, bufs, descs,
                           scales, zeros, a_layout, True, IS_CAUSAL, INT8, False, DELTA_PASS,
                           BLOCK_D, PER_TILE)

    mbarrier.invalidate(q_bar)
    for j in gl.static_range(2):
        mbarrier.invalidate(ld_bars.index(j))
    dq0, dq1, delta_acc = acc
    if DELTA_PASS:
        gl.store(DELTA + b * sdb + h * sdh + qrows.to(gl.int64) * sdn, delta_acc, mask=valid)
    else:
        BALANCE: gl.constexpr = 1 if HAS_BAL else 0
        _store_rows(DQ, dq_strides, HQ, GROUP, NQ, CNT, dq0, BAL, bal_strides, 0, softmax_scale,
                    SPARSE, BALANCE)
        if BLOCK_D > W:
            _store_rows(DQ, dq_strides, HQ, GROUP, NQ, CNT, dq1, BAL, bal_strides, W,
                        softmax_scale, SPARSE, BALANCE)


@gluon.jit
def _store_rows(X, x_strides, H, GROUP, N, CNT, acc, BAL, bal_strides, d0, factor,
                SPARSE: gl.constexpr, BALANCE: gl.constexpr):
    """Channels ``d0…`` of the gradient of the program's rows (program ``(i, b·H + h)``: rows
    ``i·M…`` of head ``h``), ``acc·factor``, into ``X [B, H, N, D]`` for the rows that exist;
    ``BALANCE``: times the balancing factors ``BAL`` of the K/V head (1: dQ, Q entered as Q∘α) or
    divided by them (-1: dK, K entered as K/α), or neither (0)."""
    sxb, sxh, sxn, sxd = x_strides
    M: gl.constexpr = acc.shape[0]
    W: gl.constexpr = acc.shape[1]
    # rows of 8 consecutive channels per thread: wide stores, and addresses made here rather
    # than kept from the prologue through the loop (the loop needs every register)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    acc = gl.convert_layout(acc * factor, layout)
    # the program's rows and (batch, head) worked out again here (the grid's second index read
    # again by inline PTX, which the compiler does not merge with the prologue's read): kept from
    # there, they would be live (and spilled) through the loop
    pid = gl.program_id(0)
    pid_bh = gl.inline_asm_elementwise(CTAID_Y_PTX, "=r", [], dtype=gl.int32, is_pure=False,
                                       pack=1)
    h = pid_bh % H
    b = ((pid_bh - h) // H).to(gl.int64)
    h = h.to(gl.int64)
    offs_d = d0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    if BALANCE != 0:
        sbb, sbh, sbd = bal_strides
        alpha = gl.expand_dims(gl.load(BAL + b * sbb + (h // GROUP) * sbh + offs_d * sbd), 0)
        if BALANCE > 0:
            acc = acc * alpha
        else:
            acc = acc / alpha
    slots = gl.arange(0, M, layout=gl.SliceLayout(1, layout))
    rows = pid * M + slots
    if SPARSE:
        exists = slots < gl.load(CNT + pid)
    else:
        exists = rows < N
    mask = gl.expand_dims(exists, 1) & gl.expand_dims(offs_d >= 0, 0)
    gl.store(X + b * sxb + h * sxh + gl.expand_dims(rows.to(gl.int64), 1) * sxn
             + gl.expand_dims(offs_d, 0) * sxd, acc.to(X.dtype.element_ty), mask=mask)


def permuted_token_major(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, N, D]`` → ``[B, H, D, N']``, N padded with zeros to a multiple of 16 and the
    tokens of each group of 16 stored in the order ``core.operands.V_KEY_ORDER`` (position ``i``
    holds token ``V_KEY_ORDER[i]``): the B operand of a product over tokens whose A operand is a
    wgmma accumulator's 8-bit fragment (:func:`quantize_rows`), K-major."""
    b, h, n, d = x.shape
    n16 = -(-n // 16) * 16
    padded = torch.nn.functional.pad(x, (0, 0, 0, n16 - n))
    order = torch.tensor(V_KEY_ORDER, device=x.device)
    stored = padded.view(b, h, n16 // 16, 16, d)[:, :, :, order]
    return stored.reshape(b, h, n16, d).transpose(-1, -2).contiguous()


def check_version(version: str | None = None) -> None:
    """:class:`~lowbit_attn.core.triton_support.GluonUnavailable` unless ``version`` (default:
    the installed Triton's) is of a series whose Gluon Hopper API this module compiles
    against."""
    triton_support.require_gluon("hopper", "the Gluon backward for sm_90a", version)


_GL_TYPES = {torch.int8: gl.int8, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
             torch.float32: gl.float32}


def _descriptor(x: torch.Tensor, rows: int, box: list[int], name: str):
    """A host TMA descriptor over contiguous ``x`` seen as rows of ``rows`` elements (2-D,
    boxes ``box``) or flat (``box`` of one dimension)."""
    check_tma_operands((name, x, x.dim() - 1))
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous for the sm90 backward, got strides "
                         f"{tuple(x.stride())}")
    if len(box) == 1:
        shape, strides, layout = [x.numel()], [1], _LD_LAYOUT
    else:
        shape, strides = [x.numel() // rows, rows], [rows, 1]
        layout = gl.NVMMASharedLayout.get_default_for(box, _GL_TYPES[x.dtype])
    return TensorDescriptor(x, shape, strides, box, layout)


def _launch(grid, num_wg: int, **kwargs) -> None:
    _dkdv_sm90_kernel[grid](**kwargs, NUM_WG=num_wg, num_warps=4 * num_wg)


def bwd_rows(lse: torch.Tensor, *, valid: torch.Tensor | None = None,
             scales: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LD [P, B, H, N64], Δ [B, H, N] view of LD[1])``: what the dK/dV kernel reads per query
    tile, N padded to a multiple of 64. ``LD[0]``: the base-2 ``lse`` ``[B, H, N]`` as the tiles
    use it, 0 where it is -inf (a row that sees no key) and +inf past N and where ``valid``
    (``[N]``) is False (P = 0 there); ``LD[1]``: zeros, where the Δ pass writes Δ; ``LD[2]``
    (INT8: ``scales`` given, per-block ``[B, H, N/64]`` tensors), each tile's scales at its first
    positions (Q's for the scores, dO's for dV, Q's for dK)."""
    b, h, n = lse.shape
    n64 = -(-n // BQ) * BQ
    ld = torch.zeros((2 + bool(scales), b, h, n64), device=lse.device, dtype=torch.float32)
    ld[0].fill_(float("inf"))
    safe = torch.where(torch.isneginf(lse), 0.0, lse.float())
    if valid is not None:
        safe = torch.where(valid, safe, float("inf"))
    ld[0, :, :, :n] = safe
    for j, x in enumerate(scales):
        ld[2].view(b, h, n64 // BQ, BQ)[..., j] = x
    return ld, ld[1, :, :, :n]


def train_dkdv(q, k, v_dp, do_dp, q_dk, do_dv, k_scale, ld, dk, dv, *, balance, causal_offset,
               softmax_scale, per_tile: bool = False) -> None:
    """The trainable attention's dK and dV (``dk``, ``dv`` ``[B, Hkv, Nk, D]``, any layout with a
    unit stride along D), P and dS per row (or ``per_tile``): INT8 ``q`` (for the scores)
    ``[B, Hq, Nq, D]`` and
    ``k`` ``[B, Hkv, Nk, D]``, 16-bit ``v_dp`` and ``do_dp`` for dP (all contiguous), INT8
    ``q_dk`` and ``do_dv`` as :func:`permuted_token_major` made them, K's per-block scales
    ``k_scale``, ``ld`` the LSE, Δ and the other operands' per-block scales (:func:`bwd_rows`),
    ``balance`` (``[B, Hkv, D]`` or None)."""
    check_version()
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    bk = 2 * WG_KEYS
    _launch(
        (triton.cdiv(nk, bk), b * hkv), 2,
        k_desc=_descriptor(k, d, [bk, d], "k"), v_desc=_descriptor(v_dp, d, [bk, d], "v"),
        q_desc=_descriptor(q, d, [BQ, d], "q"), do_desc=_descriptor(do_dp, d, [BQ, d], "do"),
        qt_desc=_descriptor(q_dk, q_dk.shape[-1], [d, BQ], "q (token-major)"),
        dot_desc=_descriptor(do_dv, do_dv.shape[-1], [d, BQ], "do (token-major)"),
        ld_desc=_descriptor(ld, 1, [BQ], "lse"),
        KS=k_scale, LD=ld, DK=dk, DV=dv, BAL=balance, RIDX=None, RCNT=None, CNT=None,
        ks_strides=k_scale.stride(), dk_strides=dk.stride(), dv_strides=dv.stride(),
        bal_strides=strides(balance, 3), ridx_strides=(0, 0, 0, 0), rcnt_strides=(0, 0, 0),
        NQ=nq, NK=nk, HKV=hkv, GROUP=hq // hkv, LD_N=ld.shape[-1], LD_PLANE=ld[0].numel(),
        causal_offset=0 if causal_offset is None else int(causal_offset),
        softmax_scale=float(softmax_scale), qk_scale=1.0,
        IS_CAUSAL=causal_offset is not None, INT8=True, SPARSE=False,
        HAS_BAL=balance is not None, BLOCK_D=d, PER_TILE=per_tile,
    )


def train_dq(q, k, v_dp, do_dp, k_dq, q_scale, k_scale, k_dq_scale, lse, delta, dq, *, balance,
             causal_offset, softmax_scale, delta_pass: bool, per_tile: bool = False) -> None:
    """The trainable attention's dQ (``dq [B, Hq, Nq, D]``, any layout with a unit stride along
    D), dS per row (or ``per_tile``), or with ``delta_pass`` its ``Δ`` into ``delta``
    ``[B, Hq, Nq]`` (a view:
    :func:`bwd_rows`' second plane): INT8 ``q`` (for the scores) and ``k``, 16-bit ``v_dp`` and
    ``do_dp`` for dP (all contiguous), INT8 ``k_dq`` as :func:`permuted_token_major` made it,
    per-block scales of Q (times ``softmax_scale·log2 e``), K (scores) and K (dQ), the forward's
    base-2 ``lse``, ``balance`` (``[B, Hkv, D]`` or None)."""
    check_version()
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    bm = 2 * WG_KEYS
    _dq_sm90_kernel[(triton.cdiv(nq, bm), b * hq)](
        q_desc=_descriptor(q, d, [bm, d], "q"), do_desc=_descriptor(do_dp, d, [bm, d], "do"),
        k_desc=_descriptor(k, d, [BQ, d], "k"), v_desc=_descriptor(v_dp, d, [BQ, d], "v"),
        kt_desc=None if delta_pass else _descriptor(k_dq, k_dq.shape[-1], [d, BQ],
                                                   "k (token-major)"),
        QS=q_scale, KS=k_scale, KDQS=k_dq_scale, LSE=lse, DELTA=delta, DQ=dq, BAL=balance,
        IDX=None, CNT=None, qs_strides=q_scale.stride(), ks_strides=k_scale.stride(),
        lse_strides=lse.stride(), delta_strides=delta.stride(), dq_strides=dq.stride(),
        bal_strides=strides(balance, 3),
        idx_strides=(0, 0, 0, 0), NQ=nq, NK=nk, HQ=hq, GROUP=hq // hkv, KK=0,
        causal_offset=0 if causal_offset is None else int(causal_offset),
        softmax_scale=float(softmax_scale), qk_scale=1.0, IS_CAUSAL=causal_offset is not None,
        INT8=True, SPARSE=False, HAS_BAL=balance is not None, DELTA_PASS=delta_pass,
        BLOCK_D=d, NUM_WG=2, num_warps=8, PER_TILE=per_tile,
    )


def refusal(ops, grad, mode: str) -> str | None:
    """Why the trainable attention's backward with these operands (``TrainOperands``,
    ``GradOperands``) and dQ ``mode`` does not run on these kernels, or ``None`` when it does."""
    if mode != "recompute":
        return f"dQ by {mode!r}: these kernels recompute it (LOWBIT_ATTN_TRAIN_DQ=recompute)"
    if not {"qk", "dv", "dk", "dq"} <= ops.int8 or "dp" in ops.int8:
        return (f"INT8 matmuls {sorted(ops.int8)}: these kernels take Q·Kᵀ, dV, dK and dQ in "
                "INT8, dP in 16-bit")
    if ops.delta_s is not None or ops.q_mean is not None:
        return "Q smoothing (ΔS): not in these kernels"
    if ops.q.shape[-1] not in HEAD_DIMS:
        return f"head dim {ops.q.shape[-1]}: these kernels take {HEAD_DIMS}"
    if ops.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {ops.dtype}: these kernels take float16 or bfloat16"
    if 0 in (ops.q.shape[2], ops.k.shape[2]) or ops.q.numel() == 0:
        return "no queries or no keys (TMA descriptors need a non-empty tensor)"
    return None


def launches(ops, grad, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             *, causal_offset: int | None, softmax_scale: float) -> list:
    """The trainable attention's backward on these kernels (where :func:`refusal` is None), as
    ``[(name, launch), ...]`` in order: Δ (:func:`train_dq`'s pass), dK and dV
    (:func:`train_dkdv`), dQ; each ``launch()`` writes its outputs, ``dq [B, Hq, Nq, D]``,
    ``dk, dv [B, Hkv, Nk, D]`` (views with a unit stride along D). The 8-bit B operands (Q and
    dO for dK and dV, K for dQ) are copied token-major and permuted here, the 16-bit ones (V and
    dO for dP) made contiguous where they are not, the LSE, Δ and scales laid out
    (:func:`bwd_rows`)."""
    qs = ops.q_scale * ops.qk_multiplier
    q, k = ops.q.contiguous(), ops.k.contiguous()
    v, do = ops.v_dp.contiguous(), grad.do_dp.contiguous()
    ld, delta = bwd_rows(lse, scales=(qs, grad.do_dv_scale, ops.q_dk_scale))
    common = dict(balance=ops.balance, causal_offset=causal_offset, softmax_scale=softmax_scale,
                  per_tile=ops.backward_granularity == "per_tile")
    dq_args = (q, k, v, do, permuted_token_major(ops.k_dq), qs, ops.k_scale, ops.k_dq_scale, lse,
               delta, dq)
    dkdv_args = (q, k, v, do, permuted_token_major(ops.q_dk), permuted_token_major(grad.do_dv),
                 ops.k_scale, ld, dk, dv)
    return [("_dq_sm90_kernel/delta", lambda: train_dq(*dq_args, **common, delta_pass=True)),
            ("_dkdv_sm90_kernel", lambda: train_dkdv(*dkdv_args, **common)),
            ("_dq_sm90_kernel", lambda: train_dq(*dq_args, **common, delta_pass=False))]


def backward(ops, grad, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             *, causal_offset: int | None, softmax_scale: float) -> None:
    """Runs :func:`launches`."""
    for _, launch in launches(ops, grad, lse, dq, dk, dv, causal_offset=causal_offset,
                              softmax_scale=softmax_scale):
        launch()


def vsa_refusal(qt: torch.Tensor, d: int) -> str | None:
    """Why video sparse attention's 16-bit fine backward on tiles ``qt [B, H, nt, TS, D]`` does
    not run on these kernels, or ``None`` when it does."""
    if qt.shape[3] != BQ:
        return f"tiles of {qt.shape[3]} slots: these kernels take {BQ}"
    if d not in HEAD_DIMS:
        return f"head dim {d}: these kernels take {HEAD_DIMS}"
    if qt.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {qt.dtype}: these kernels take float16 or bfloat16"
    return None


def vsa_backward(qt, kt, vt, dot, lse, delta, idx, reverse, counts, dq, dk, dv, *,
                 scale: float) -> None:
    """Video sparse attention's 16-bit fine backward on these loops (one warpgroup per 64-token
    tile; where :func:`vsa_refusal` is None): ``dq, dk, dv`` (tiles as ``qt``, ``kt``, zeros
    past each tile's count) for padded tiles ``qt, dot [B, Hq, nt, 64, D]``, ``kt, vt [B, Hkv,
    nt, 64, D]`` (contiguous, zeros in the empty slots), the forward's base-2 ``lse`` and
    ``delta`` ``[B, Hq, nt, 64]``, index lists ``idx [B, Hq, nt, k]`` and the reversed ones
    ``reverse = (ridx, rcount)`` (``vsa.kernel_fine.reverse_lists``), ``counts [nt]``. Twin:
    ``vsa.naive.fine_backward_tiles``."""
    check_version()
    b, hq, nt, ts, d = qt.shape
    hkv = kt.shape[1]
    n = nt * ts
    qk_scale = float(torch.tensor(scale, dtype=torch.float32) * torch.tensor(
        1.4426950408889634, dtype=torch.float32))
    valid = (torch.arange(ts, device=qt.device) < counts[:, None].to(qt.device)).reshape(n)
    ld, _ = bwd_rows(lse.reshape(b, hq, n), valid=valid)
    ld[1, :, :, :n] = torch.where(valid, delta.reshape(b, hq, n), 0.0)
    ridx, rcount = reverse
    rows = lambda x: x.reshape(x.shape[0], x.shape[1], n, d)  # noqa: E731
    q, k, v, do = (rows(x) for x in (qt, kt, vt, dot))
    flat = dict(SPARSE=True, INT8=False, HAS_BAL=False, BLOCK_D=d, NUM_WG=1, num_warps=4,
                PER_TILE=False,
                causal_offset=0, softmax_scale=float(scale), qk_scale=qk_scale,
                IS_CAUSAL=False, BAL=None, bal_strides=(0, 0, 0), CNT=counts)
    _dkdv_sm90_kernel[(nt, b * hkv)](
        k_desc=_descriptor(k, d, [BQ, d], "k"), v_desc=_descriptor(v, d, [BQ, d], "v"),
        q_desc=_descriptor(q, d, [BQ, d], "q"), do_desc=_descriptor(do, d, [BQ, d], "do"),
        qt_desc=None, dot_desc=None, ld_desc=_descriptor(ld, 1, [BQ], "lse"),
        KS=None, LD=ld, DK=rows(dk), DV=rows(dv), RIDX=ridx, RCNT=rcount,
        ks_strides=(0, 0, 0), dk_strides=rows(dk).stride(), dv_strides=rows(dv).stride(),
        ridx_strides=ridx.stride(), rcnt_strides=rcount.stride(), NQ=n, NK=n, HKV=hkv,
        GROUP=hq // hkv, LD_N=ld.shape[-1], LD_PLANE=ld[0].numel(), **flat)
    _dq_sm90_kernel[(nt, b * hq)](
        q_desc=_descriptor(q, d, [BQ, d], "q"), do_desc=_descriptor(do, d, [BQ, d], "do"),
        k_desc=_descriptor(k, d, [BQ, d], "k"), v_desc=_descriptor(v, d, [BQ, d], "v"),
        kt_desc=None, QS=None, KS=None, KDQS=None, LSE=lse.reshape(b, hq, n),
        DELTA=ld[1, :, :, :n], DQ=rows(dq), IDX=idx, qs_strides=(0, 0, 0),
        ks_strides=(0, 0, 0), lse_strides=lse.reshape(b, hq, n).stride(),
        delta_strides=ld[1, :, :, :n].stride(), dq_strides=rows(dq).stride(),
        idx_strides=idx.stride(), NQ=n, NK=n, HQ=hq, GROUP=hq // hkv, KK=idx.shape[-1],
        DELTA_PASS=False, **flat)


__all__ = ["BQ", "HEAD_DIMS", "RNE_S8X4_CONSTRAINTS", "RNE_S8X4_PTX", "WG_KEYS", "backward",
           "check_version", "launches", "refusal",
           "bwd_rows", "permuted_token_major", "quantize_rows", "train_dkdv", "train_dq", "vsa_backward",
           "vsa_refusal"]

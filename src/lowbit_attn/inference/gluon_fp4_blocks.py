"""The ``@gluon.jit`` pieces of the Blackwell FP4 forward (``kernel_fp4_gluon``): group scales
between global, shared and tensor memory, P̃'s group quantization with the hardware E2M1
conversion, the correction of O in tensor memory and the epilogue. Compiled, never run on a GPU;
run on the CPU by ``tools/gluon_cpu.py`` (see ``kernel_fp4_gluon``)."""

from __future__ import annotations


from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("blackwell", "lowbit_attn.inference.gluon_fp4_blocks")

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, TensorMemoryScalesLayout, get_tmem_reg_layout, mbarrier,
)

from lowbit_attn.core.triton_helpers import store_lse
from lowbit_attn.quant.fp4 import (
    E2M1X2_CONSTRAINTS, E2M1X2_PTX, p_group_scale, scale_operand,
)

O_SLICE = gl.constexpr(64)  # columns of O per correction step (registers: 2·64 per thread)


@gluon.constexpr_function
def scale_smem_layout(rows, cols):
    """The shared layout ``tcgen05.cp`` reads scales from (``[rows, cols]``, one byte each): the
    cuBLAS block-scale atom, 32 rows × 4 groups of 4 scale columns, rows ``r``, ``r + 32``,
    ``r + 64``, ``r + 96`` adjacent (r18 Q1b)."""
    bases = [[0, 1], [0, 2]][: min(2, (cols - 1).bit_length())]
    bases += [[32 << i, 0] for i in range(max(0, (rows // 32).bit_length() - 1))]
    bases += [[1 << i, 0] for i in range(5)]
    bases += [[0, 4 << i] for i in range(max(0, (cols // 4).bit_length() - 1))]
    return gl.SharedLinearLayout(offset_bases=bases, block_bases=[], alignment=128)


@gluon.constexpr_function
def scale_type(nv):
    """The scales' type in shared and tensor memory: it picks the MMA's format (NVFP4's E4M3
    with groups of 16, or MXFP4's E8M0 bytes with groups of 32; r18 pitfall 1)."""
    return gl.float8e4nv if nv else gl.uint8


@gluon.constexpr_function
def v_scales_by_copy(block_n, group):
    """Whether V's scale tile ``[D, block_n/group]`` goes to tensor memory by ``tcgen05.cp``
    (from the loader's shared memory; needs 4 scale columns or more: "Failed to find a valid
    layout" below) or is stored by the softmax partition from registers (MXFP4's 2 columns)."""
    return block_n // group >= 4


@gluon.jit
def load_scales(ptr, row0, n_rows, stride, smem, ROWS: gl.constexpr, COLS: gl.constexpr,
                 NV: gl.constexpr):
    """``[ROWS, COLS]`` scale bytes (row ``row0 + r`` at ``ptr + (row0 + r)·stride``, contiguous
    columns; rows from ``n_rows`` on read 0) → ``smem`` in :func:`scale_smem_layout`."""
    lay: gl.constexpr = gl.BlockedLayout([1, COLS], [32, 1], [gl.num_warps(), 1], [1, 0])
    r = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, lay))
    c = gl.arange(0, COLS, gl.SliceLayout(0, lay))
    rows = r.to(gl.int64)  # int64 row offsets, as in gluon_blocks.write_rows
    bits = gl.load(ptr + rows[:, None] * stride + c[None, :], mask=(r < n_rows)[:, None], other=0)
    smem.store(scale_operand(bits, NV))


@gluon.jit
def key_scales(KS, j, nk, sksn, NV: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_D: gl.constexpr):
    """K's scales of key block ``j`` in the tensor-memory store layout (0 past the end).
    ``tcgen05.cp`` cannot copy a 64-row scale tile (r18 layout: "failed to find a valid
    layout"), so the softmax partition stores K's scales, one block ahead of the MMA."""
    rl: gl.constexpr = get_tmem_reg_layout(scale_type(NV), [BLOCK_N, BLOCK_D // GROUP],
                                           TensorMemoryScalesLayout(), gl.num_warps())
    # r·sksn in int32: the launcher checks that K's scales of one (batch, head) span fewer than
    # 2^31 bytes (int64 addresses here spill 288 B at D = 128 in this partition)
    r = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, rl))
    c = gl.arange(0, BLOCK_D // GROUP, gl.SliceLayout(0, rl))
    bits = gl.load(KS + r[:, None] * sksn + c[None, :], mask=(r < nk)[:, None], other=0)
    return scale_operand(bits, NV)


@gluon.jit
def value_scales(VS, j, svsd, NV: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_D: gl.constexpr):
    """V's scales of key block ``j`` (``[D, BLOCK_N/GROUP]``) in the tensor-memory store
    layout, for the formats :func:`v_scales_by_copy` excludes (V is padded: no mask)."""
    rl: gl.constexpr = get_tmem_reg_layout(scale_type(NV), [BLOCK_D, BLOCK_N // GROUP],
                                           TensorMemoryScalesLayout(), gl.num_warps())
    r = gl.arange(0, BLOCK_D, gl.SliceLayout(1, rl))
    c = j * (BLOCK_N // GROUP) + gl.arange(0, BLOCK_N // GROUP, gl.SliceLayout(0, rl))
    return scale_operand(gl.load(VS + r[:, None] * svsd + c[None, :]), NV)


@gluon.jit
def publish_key_scales(ks, j, ks_tmem, ks_ready):
    """Block ``j``'s K scales to tensor memory buffer ``j % 2`` (free: S(j−2) is done, since
    S(j−1) is, which the previous step waited for), then tell the MMA warp."""
    if j % 2 == 0:
        ks_tmem[0].store(ks)
    else:
        ks_tmem[1].store(ks)
    mbarrier.arrive(ks_ready.index(j % 2), count=1)


@gluon.jit
def quantize_p(p, NV: gl.constexpr, GROUP: gl.constexpr):
    """P̃ ``[M, N]`` (≥ 0, one row per thread) → ``(E2M1 bytes [M, N/2], scale bits [M, N/GROUP]
    uint8)``: ``quant.fp4.p_group_scale``'s group scales (``kernel_fp4``'s), then the hardware
    conversion of ``P̃·(1/s)`` (element ``2i`` in the low nibble)."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    pg = gl.reshape(p, [M, N // GROUP, GROUP])
    code, denom = p_group_scale(gl.max(pg, axis=2) + gl.sum(pg * 0.0, axis=2), NV)
    rcp = gl.div_rn(gl.full(denom.shape, 1.0, gl.float32, denom.type.layout), denom)
    x = gl.reshape(pg * gl.expand_dims(rcp, 2), [M, N // 2, 2])
    lo, hi = gl.split(x)
    packed = gl.inline_asm_elementwise(E2M1X2_PTX, E2M1X2_CONSTRAINTS, [lo, hi], dtype=gl.uint8,
                                       is_pure=True, pack=4)
    return packed, code.to(gl.uint8)


@gluon.jit
def exp2_shifted(s, mult, shift, SCALED: gl.constexpr):
    """``exp2(s·mult + shift)`` per row (``shift`` ``[M]``): one FMA on the raw products, as
    ``gluon_blocks.softmax_block`` folds the multiplier, or, when ``SCALED`` (the scores already
    times ``mult`` plus ΔS, ``kernel_fp4``'s order), ``exp2(s + shift)``: the twin's
    ``s − (max − log2 peak)`` (negating is exact)."""
    if SCALED:
        return gl.exp2(s + shift[:, None])
    else:
        return gl.exp2(gl.fma(s, mult, shift[:, None]))


@gluon.jit
def correct(i, pv_tmem, o_tmem, pv_ready, pv_free, alpha, s1, BLOCK_M: gl.constexpr):
    """``O = O·α(i) + PV·s1(i)`` once P̃(i)·V(i) is done, ``O_SLICE`` columns at a time; PV is
    released after its last slice is read."""
    D: gl.constexpr = o_tmem.shape[1]
    sl_tl: gl.constexpr = TensorMemoryLayout([BLOCK_M, O_SLICE], col_stride=1)
    sl_rl: gl.constexpr = get_tmem_reg_layout(gl.float32, [BLOCK_M, O_SLICE], sl_tl,
                                              gl.num_warps())
    rows: gl.constexpr = gl.SliceLayout(1, sl_rl)
    a = gl.convert_layout(alpha, rows)[:, None]
    c = gl.convert_layout(s1, rows)[:, None]
    mbarrier.wait(pv_ready, i & 1)
    for k in gl.static_range(D // O_SLICE):
        pv = pv_tmem.slice(k * O_SLICE, O_SLICE).load(sl_rl)
        if k == D // O_SLICE - 1:
            mbarrier.arrive(pv_free, count=1)
        o = o_tmem.slice(k * O_SLICE, O_SLICE)
        o.store(o.load(sl_rl) * a + pv * c)


@gluon.jit
def epilogue(o_tmem, l_i, m_i, O, LSE, LSH, VG, VM, o_strides, lse_strides, lsh_strides,
              vg_strides, vm_strides, b, h, hk, pid_m, nq, sl_rl: gl.constexpr,
              NV: gl.constexpr, HAS_VMEAN: gl.constexpr, HAS_LSH: gl.constexpr,
              WRITE_LSE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr):
    """``O / l`` (× V's tensor scale, + V's mean), rows that saw no key 0, and the LSE (+ the
    K-smoothing shift ``LSH`` when ``HAS_LSH``), in ``kernel_fp4``'s order (``normalize_rows``,
    then the scale; ``store_lse``)."""
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides
    slb, slh, sln = lsh_strides
    sgvb, sgvh = vg_strides
    svmb, svmh = vm_strides
    rows: gl.constexpr = gl.SliceLayout(1, sl_rl)
    cols: gl.constexpr = gl.SliceLayout(0, sl_rl)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, rows)
    mmask = offs_m < nq
    o_rows = offs_m.to(gl.int64)  # int64 row offsets, as in gluon_blocks.write_rows
    l_o = gl.convert_layout(l_i, rows)
    empty = l_o == 0.0
    l_o = gl.where(empty, 1.0, l_o)
    for k in gl.static_range(BLOCK_D // O_SLICE):
        offs_d = k * O_SLICE + gl.arange(0, O_SLICE, cols)
        out = o_tmem.slice(k * O_SLICE, O_SLICE).load(sl_rl) / l_o[:, None]
        if NV:
            out = out * gl.load(VG + b * sgvb + hk * sgvh)
        if HAS_VMEAN:
            out = out + gl.load(VM + b * svmb + hk * svmh + offs_d)[None, :]
        out = gl.where(empty[:, None], 0.0, out)
        gl.store(O + b * sob + h * soh + o_rows[:, None] * son + offs_d[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=mmask[:, None])
    if WRITE_LSE:
        offs_ms = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, m_i.type.layout)
        lse_rows = offs_ms.to(gl.int64)
        store_lse(LSE, b * seb + h * seh + lse_rows * sen, LSH,
                  b * slb + h * slh + lse_rows * sln,
                  m_i, l_i, 0.0, offs_ms < nq, HAS_LSH)


__all__ = ["O_SLICE", "correct", "epilogue", "exp2_shifted", "key_scales", "load_scales", "publish_key_scales",
           "quantize_p", "scale_smem_layout", "scale_type", "v_scales_by_copy",
           "value_scales"]

"""The ``@gluon.jit`` pieces the Hopper Gluon kernels share (the one-warpgroup forward,
``kernel_int8_sm90``, and the backward loops, ``training/kernel_bwd_sm90``; some also serve the
Blackwell FP4 forward): one key block's online-softmax step, its K scales, and the TMA
descriptors over one (batch, head).

The numerics are those of ``kernel_int8._softmax_pv`` through the same ``core.triton_helpers``
functions, so the Gluon kernels and the interpreter-tested Triton kernel round alike; only the
data movement differs."""

from __future__ import annotations

import torch

from lowbit_attn.core import triton_support

# Gluon's API differs between Triton releases: refuse another one in a line, before importing it.
triton_support.require_gluon("hopper", "lowbit_attn.inference.gluon_blocks")

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from triton.language.core import PropagateNan

from lowbit_attn.core.operands import V_PERMUTED_MIN_KEYS
from lowbit_attn.core.triton_helpers import (
    finish_rows, finish_scores, online_max, p_offset, store_lse, to_e4m3, window_limits,
)
from lowbit_attn.inference.naive import EXP2_ROUND, POLY_EXP2

_NAN_ALL = gl.constexpr(PropagateNan.ALL)
_EXP2_ROUND = gl.constexpr(EXP2_ROUND)
_C0, _C1, _C2, _C3 = (gl.constexpr(c) for c in POLY_EXP2)
_V_MIN_KEYS = gl.constexpr(V_PERMUTED_MIN_KEYS)



# A TMA load of ``desc``'s box at ``coord`` into shared memory ``result``, its bytes counted on
# ``barrier`` (only where ``pred``): Gluon's ``tma.async_load`` from Triton 3.9 on,
# ``tma.async_copy_global_to_shared`` before. One definition per Triton: the JIT resolves every
# attribute a function names, in branches it does not compile too.
if triton_support.tma_load_renamed():
    @gluon.jit
    def tma_load(desc, coord, barrier, result, pred=True):
        tma.async_load(desc, coord, barrier, result, pred=pred)
else:
    @gluon.jit
    def tma_load(desc, coord, barrier, result, pred=True):
        tma.async_copy_global_to_shared(desc, coord, barrier, result, pred=pred)


# A barrier of every thread of the program: Gluon's ``thread_barrier``, ``barrier`` from Triton
# 3.9 on (as for ``tma_load``, one definition per Triton).
if hasattr(gl, "thread_barrier"):
    @gluon.jit
    def cta_barrier():
        gl.thread_barrier()
else:
    @gluon.jit
    def cta_barrier():
        gl.barrier()


def tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator hook: global memory for the TMA descriptors a kernel builds (128 bytes
    per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def check_tma_operands(*operands: tuple[str, torch.Tensor, int]) -> None:
    """``ValueError`` unless each ``(name, tensor, inner dim)`` can be read by TMA: a 16-byte
    aligned base, a unit stride along its inner dimension, every other stride a multiple of 16
    bytes."""
    for name, x, inner in operands:
        size = x.element_size()
        outer = [s * size for i, s in enumerate(x.stride()) if i != inner]
        if x.stride(inner) != 1 or any(s % 16 for s in outer) or x.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned with a unit stride along dim {inner} "
                             f"and the others multiples of 16 bytes (TMA), got strides "
                             f"{tuple(x.stride())} of {size}-byte elements")


@gluon.jit
def tile_offsets(pid_m, nq, D, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_D: gl.constexpr, rows_s: gl.constexpr, cols_s: gl.constexpr,
                 cols_o: gl.constexpr):
    """``(offs_m, offs_n, offs_d, mmask, dmask)``: a query tile's rows and a key block's columns
    in the score layout, the channels in the output's, and which rows and channels exist."""
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_s)
    offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
    offs_d = gl.arange(0, BLOCK_D, layout=cols_o)
    return offs_m, offs_n, offs_d, offs_m < nq, offs_d < D


@gluon.jit
def scales_of_rows(QS, KS, b, h, hk, pid_m, offs_m, mmask, sqsb, sqsh, sqsn, sksb, sksh, sksn,
                   BLOCK_N: gl.constexpr, KEYS: gl.constexpr, PER_TOKEN: gl.constexpr):
    """``(qs, ks_base)``: the rows' Q scales and the address of the first key block's K scales
    for :func:`key_scales` (per token: one key per thread in ``KEYS``); per block, the query
    block's one scale and the K scales' first block (``[B, H, blocks]``)."""
    ks_base = KS + b * sksb + hk * sksh
    if PER_TOKEN:  # the rows' scales; each thread's key's address (see key_scales)
        qs = gl.load(QS + b * sqsb + h * sqsh + offs_m.to(gl.int64) * sqsn, mask=mmask,
                     other=1.0)
        ks_base = ks_base + gl.arange(0, BLOCK_N, layout=KEYS) * sksn
    else:
        qs = gl.load(QS + b * sqsb + h * sqsh + pid_m * sqsn)
    return qs, ks_base


@gluon.jit
def softmax_block(s_int, ks, qs, m_i, l_i, start_n, offs_m, offs_n, nk, causal_offset,
                  MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, PER_TOKEN: gl.constexpr = True,
                  PV_FP8: gl.constexpr = True, PER_THREAD: gl.constexpr = False,
                  RAW_P: gl.constexpr = False, POLY: gl.constexpr = 0, window=None,
                  WINDOWED: gl.constexpr = False):
    """One key block's online-softmax step on its integer scores: ``(P̃, m, l, α)``, P̃ as E4M3
    (``PV_FP8``) or fp16.

    The fold of ``kernel_int8._softmax_pv`` (``t = s_int·s_k``, the row max on ``t`` scaled once
    per row, ``exp2(fma(t, s_q, -(m - offset)))``, ``offset`` = log2 448 for E4M3 P̃, 0 for fp16)
    with the same shared helpers, so both kernels round alike. ``finish_scores`` without ΔS only
    masks. ``PER_THREAD`` (one warpgroup's 64 rows by 128 keys): ``qs`` the rows' and ``ks`` the
    block's four per-thread scales, in the slices of :func:`thread_view`'s layout; see
    :func:`_thread_exp2` (and its ``POLY``). ``RAW_P``: P̃ in fp32, for the caller to convert.
    ``WINDOWED`` (not with ``IS_CAUSAL``):
    ``MASKED`` blocks mask the keys outside ``window = (left, right, chunk)``'s rule and past the
    end (``window_limits``; positions aligned by ``causal_offset = Nk - Nq``)."""
    cols = start_n + offs_n
    if PER_THREAD:
        t = s_int.to(gl.float32)
        c = qs
    elif PER_TOKEN:
        t = s_int.to(gl.float32) * ks[None, :]
        c = qs
    else:  # one scale per query block and per key block (``kernel_int8``'s per-block fold)
        t = s_int.to(gl.float32)
        c = l_i * 0.0 + qs * ks  # a row vector (l_i is finite: ·0 gives 0)
    if WINDOWED:
        if MASKED:  # the window's or chunk's rule and the end: two limits per row
            first, last = window_limits(offs_m, causal_offset, window[0], window[1], window[2],
                                        nk)
            t = gl.where((cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None]), t,
                         float("-inf"))
    elif IS_CAUSAL:
        # Keys past the end folded into each row's causal limit (the same set of keys, one
        # compare per score, and no per-key mask live in registers).
        lim = gl.minimum(offs_m + causal_offset, nk - 1) - causal_offset
        t = finish_scores(t, cols, offs_n < offs_n.shape[0], lim, causal_offset, None, 0, False,
                          MASKED, IS_CAUSAL)
    else:
        t = finish_scores(t, cols, cols < nk, offs_m, causal_offset, None, 0, False, MASKED,
                          IS_CAUSAL)
    if PER_THREAD:
        p, m_new, alpha = _thread_exp2(t, ks, qs, m_i, MASKED, PV_FP8, POLY)
    else:
        m_new, m_safe, alpha = online_max(m_i, gl.max(t, axis=1) * c, MASKED)
        p = gl.exp2(gl.fma(t, c[:, None], -(m_safe - p_offset(PV_FP8))[:, None]))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    if RAW_P:
        pass
    elif PV_FP8:
        p = to_e4m3(p, False)
    else:
        p = p.to(gl.float16)
    return p, m_new, l_i, alpha


@gluon.jit
def thread_view(t):
    """A ``[M, N]`` wgmma accumulator fragment (4 warps, N a multiple of 8) as ``[M, N/8, 4, 2]``:
    column ``8g + 2c + p`` at ``[g, c, p]``. A thread holds one ``c`` (its lane mod 4) and every
    ``g`` and ``p`` of its rows, so a value per ``c`` is a value per thread."""
    return gl.reshape(t, [t.shape[0], t.shape[1] // 8, 4, 2])


@gluon.jit
def max_nan(a, b):
    """``max(a, b)``, NaN if either is (``FMNMX.NAN``; a plain maximum drops a NaN operand)."""
    return gl.maximum(a, b, propagate_nan=_NAN_ALL)


@gluon.jit
def poly_exp2(x):
    """``2^x`` on the FMA pipe (no MUFU): ``naive.poly_exp2``, step for step. 9 instructions:
    ``FMNMX.NAN``, 3 ``FADD``, 3 ``FFMA``, a shift, an ``FMUL``."""
    x = max_nan(x, -127.0)
    r = x + _EXP2_ROUND
    f = x - (r - _EXP2_ROUND)
    p = gl.fma(gl.fma(gl.fma(f, _C3, _C2), f, _C1), f, _C0)
    return p * (r.to(gl.int32, bitcast=True) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _halves(x):
    """A ``[M, G, 4, 2]`` view (:func:`thread_view`) split into its even and odd ``g``: two
    ``[M, G/2, 4, 2]`` tensors. Every ``g`` of a row is in one thread: no data moves."""
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2, 4, 2]),
                               (0, 1, 3, 4, 2)))


@gluon.jit
def _merge(even, odd):
    """The inverse of :func:`_halves` (``odd`` taken into ``even``'s layout: the same
    registers, named by another kind of layout when it comes from a merge)."""
    both = gl.permute(gl.join(even, gl.convert_layout(odd, even.type.layout)), (0, 1, 4, 2, 3))
    return gl.reshape(both, [even.shape[0], 2 * even.shape[1], 4, 2])


@gluon.jit
def _mixed_exp2(x, SHARE: gl.constexpr):
    """``exp2`` of a :func:`thread_view` tile, the groups ``g ≡ SHARE - 1 (mod SHARE)`` by
    :func:`poly_exp2` (``naive.poly_columns``), the rest on the MUFU."""
    e1, o1 = _halves(x)
    if SHARE == 2:
        o1 = poly_exp2(o1)
    else:
        e2, o2 = _halves(o1)
        if SHARE == 4:
            o2 = poly_exp2(o2)
        else:
            e3, o3 = _halves(o2)
            if SHARE == 8:
                o3 = poly_exp2(o3)
            else:
                e4, o4 = _halves(o3)
                o3 = _merge(gl.exp2(e4), poly_exp2(o4))
            o2 = _merge(gl.exp2(e3), o3)
        o1 = _merge(gl.exp2(e2), o2)
    return _merge(gl.exp2(e1), o1)


@gluon.jit
def _thread_exp2(t, ks, qs, m_i, MASKED: gl.constexpr, PV_FP8: gl.constexpr,
                 POLY: gl.constexpr = 0):
    """The exp2 of a score tile ``t`` (fp32 integer products, ``-inf`` where masked) with
    per-thread scales: ``c = s_q·s_k`` of each row and key group (:func:`thread_view`'s ``c``),
    the block's row max ``max_c(c·max_{g,p} t)`` (= ``max(t·c)``: scales are positive and rounding
    is monotone), and ``exp2(fma(t, c, -(m - offset)))``: one FFMA per score, ``c`` and ``m`` held
    per thread. ``POLY``: one group of 8 columns in ``POLY`` takes :func:`poly_exp2` (0: none).
    Returns ``(P̃ in t's layout, m, α)``."""
    t4 = thread_view(t)
    c = gl.expand_dims(qs, 1) * gl.expand_dims(ks, 0)  # [M, 4]
    top = gl.max(gl.max(t4, axis=3), axis=1) * c
    m_new, m_safe, alpha = online_max(m_i, gl.convert_layout(gl.max(top, axis=1),
                                                             m_i.type.layout), MASKED)
    bias = gl.convert_layout(p_offset(PV_FP8) - m_safe, qs.type.layout)
    c4 = gl.expand_dims(gl.expand_dims(c, 1), 3)
    bias4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(bias, 1), 1), 3)
    c4, bias4 = gl.broadcast(c4, bias4)
    t4, c4 = gl.broadcast(t4, c4)
    t4, bias4 = gl.broadcast(t4, bias4)
    x = gl.fma(t4, c4, bias4)
    if POLY == 0:
        p = gl.exp2(x)
    else:
        p = _mixed_exp2(x, POLY)
    return gl.convert_layout(gl.reshape(p, [t.shape[0], t.shape[1]]), t.type.layout), m_new, alpha


# Four fp32 → four E4M3 (round to nearest even, saturating; NaN stays NaN) in one 32-bit
# register, the first in the low byte. ptxas merges the second pair into the first's register
# (F2FP ... MERGE_C); the packing Triton emits for a converted tensor costs a PRMT more.
E4M3X4_PTX = gl.constexpr(
    "{ .reg .b16 lo, hi;\n"
    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
    "mov.b32 $0, {lo, hi}; }")
E4M3X4_CONSTRAINTS = gl.constexpr("=r,r,r,r,r")


@gluon.jit
def a_fragment_order(p, a_layout: gl.constexpr):
    """An fp32 tile ``[M, N]`` in a wgmma accumulator's layout as the values of an 8-bit register
    A operand in ``a_layout``: column ``16G + 8h + 2c + p`` (a thread holds its ``c``) moves to
    ``16G + 4c + 2h + p``, a slot of the thread's own A fragment (``core.operands.V_KEY_ORDER``
    is where the B operand must store that column's row). No data moves between threads: four
    consecutive slots of a thread then convert into one register."""
    m: gl.constexpr = p.shape[0]
    n: gl.constexpr = p.shape[1]
    p = gl.reshape(gl.permute(gl.reshape(p, [m, n // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [m, n])
    return gl.convert_layout(p, a_layout)


@gluon.jit
def register_operand(p, a_layout: gl.constexpr, PV_FP8: gl.constexpr):
    """fp32 P̃ ``[64, N]`` in the wgmma accumulator's layout (4 warps) → the P̃·V wgmma's
    register A operand in ``a_layout``, E4M3 or fp16. E4M3: the columns in
    :func:`a_fragment_order` (the keys' order in permuted V), four to a register by one
    conversion. fp16: the fragments already agree."""
    if PV_FP8:
        p = a_fragment_order(p, a_layout)
        bits = gl.inline_asm_elementwise(E4M3X4_PTX, E4M3X4_CONSTRAINTS, [p], dtype=gl.int8,
                                         is_pure=True, pack=4)
        return bits.to(gl.float8e4nv, bitcast=True)
    else:
        return gl.convert_layout(p.to(gl.float16), a_layout)


@gluon.jit
def v_box(j, BLOCK_N: gl.constexpr, PV_FP8: gl.constexpr):
    """The TMA coordinates of key block ``j``'s V tile: E4M3 V is stored ``[D, N']`` (the box
    ``[BLOCK_D, BLOCK_N]`` at column ``j·BLOCK_N``), fp16 V ``[N, D]``."""
    if PV_FP8:
        return 0, j * BLOCK_N
    else:
        return j * BLOCK_N, 0


@gluon.jit
def v_operand(v_tile, PV_FP8: gl.constexpr):
    """A V tile in shared memory as P̃·V's B operand (``[keys, D]``): E4M3 tiles are stored
    ``[D, keys]`` (8-bit wgmma operands must be K-major), fp16 ones ``[keys, D]``."""
    if PV_FP8:
        return v_tile.permute((1, 0))
    else:
        return v_tile


@gluon.jit
def key_scales(ks_ptr, start_n, offs_n, nk, KEYS: gl.constexpr, MASKED: gl.constexpr,
               PER_TOKEN: gl.constexpr = True, COLS: gl.constexpr = None):
    """K's per-token scales of one key block in the score columns' layout ``COLS``, ``ks_ptr``
    the block's keys' addresses in the flat layout ``KEYS`` (one key per thread; 0 past the
    sequence's end in ``MASKED`` blocks); per block, the block's one scale at ``ks_ptr``.

    Loaded one key per thread, then moved to the score layout through shared memory (the CTA
    barrier this takes merges with the one Triton places after ``wait(1)``): loaded in the score
    layout, each thread would hold 32 keys' addresses and masks. With every stride and length a
    multiple of 16 those are 16 vector loads from one base, but otherwise (packed sequences, or
    lengths not a multiple of 16) 32 scalar loads whose 64-bit offsets ptxas keeps live through
    the main loop: 336 B spilled at D=128 with 128-key blocks (NOTES §11)."""
    if not PER_TOKEN:
        return gl.load(ks_ptr)
    else:
        keys = gl.arange(0, offs_n.shape[0], layout=KEYS)
        if MASKED:
            ks = gl.load(ks_ptr, mask=start_n + keys < nk, other=0.0)
        else:
            ks = gl.load(ks_ptr)
        return gl.convert_layout(ks, COLS)


@gluon.jit
def descriptors(Q, K, V, b, h, hk, nq, nk, D, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, svd,
                Q_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                q_layout: gl.constexpr, k_layout: gl.constexpr, v_layout: gl.constexpr,
                PV_FP8: gl.constexpr = True, V_PERMUTED: gl.constexpr = False):
    """TMA descriptors over one (batch, head)'s ``nq`` queries (boxes of ``Q_ROWS`` rows) and
    ``nk`` keys of K and V (E4M3 stored ``[D, N']``, boxes ``[BLOCK_D, BLOCK_N]``; fp16
    ``[N, D]``, boxes ``[BLOCK_N, BLOCK_D]``), rows past them reading as 0. ``V_PERMUTED``
    (E4M3 V whose keys are permuted in groups of 16): V's descriptor spans every stored key
    (``core.operands.permuted_v_keys``: the keys padded to 16, where the last keys are stored,
    and to at least one key block)."""
    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * sqh, [nq, D], [sqn, 1],
                                        [Q_ROWS, BLOCK_D], q_layout)
    k_desc = tma.make_tensor_descriptor(K + b * skb + hk * skh, [nk, D], [skn, 1],
                                        [BLOCK_N, BLOCK_D], k_layout)
    if PV_FP8:
        v_keys = nk
        if V_PERMUTED:
            v_keys = gl.maximum(gl.cdiv(nk, 16) * 16, _V_MIN_KEYS)
        v_desc = tma.make_tensor_descriptor(V + b * svb + hk * svh, [D, v_keys], [svd, 1],
                                            [BLOCK_D, BLOCK_N], v_layout)
    else:
        v_desc = tma.make_tensor_descriptor(V + b * svb + hk * svh, [nk, D], [svn, 1],
                                            [BLOCK_N, BLOCK_D], v_layout)
    return q_desc, k_desc, v_desc


@gluon.jit
def write_rows(acc, m_i, l_i, O, LSE, LSH, VS, VM, b, h, hk, nq, offs_m, offs_mo, offs_d, dmask,
               svsb, svsh, svsd, sob, soh, son, sod, seb, seh, sen, slb, slh, sln,
               rows_o: gl.constexpr, WRITE_LSE: gl.constexpr, HAS_VSCALE: gl.constexpr,
               HAS_VMEAN: gl.constexpr, HAS_LSH: gl.constexpr, PV_FP8: gl.constexpr = True,
               vm_weight=None, SINK: gl.constexpr = False):
    """The epilogue of a tile's rows: ``acc / l`` (V's scale and mean applied, ``finish_rows``;
    with ``SINK`` V's mean times the keys' share ``vm_weight`` of each row's sum, in ``rows_o``)
    stored to ``O`` and, with ``WRITE_LSE``, the natural-log LSE; ``offs_m``/``offs_mo`` the
    rows in the score and output layouts. Row offsets are int64 (``row·stride`` of a large output,
    or of a strided view of one, passes 2^31), as the Triton kernels' are."""
    out = finish_rows(acc, gl.convert_layout(l_i, rows_o), VS, VM, b * svsb + hk * svsh, offs_d,
                      dmask, svsd, HAS_VSCALE, HAS_VMEAN, vm_weight, SINK)
    o_rows = offs_mo.to(gl.int64)
    gl.store(O + b * sob + h * soh + o_rows[:, None] * son + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=(offs_mo < nq)[:, None] & dmask[None, :])
    if WRITE_LSE:
        rows = offs_m.to(gl.int64)
        store_lse(LSE, b * seb + h * seh + rows * sen, LSH, b * slb + h * slh + rows * sln,
                  m_i, l_i, p_offset(PV_FP8), offs_m < nq, HAS_LSH)


__all__ = ["E4M3X4_CONSTRAINTS", "E4M3X4_PTX", "a_fragment_order", "check_tma_operands",
           "cta_barrier", "descriptors", "key_scales", "max_nan", "poly_exp2", "register_operand",
           "scales_of_rows", "softmax_block", "thread_view", "tile_offsets", "tma_load",
           "tma_scratch", "v_box", "v_operand", "write_rows"]

"""Attention forward with FP4 microscaling Q·Kᵀ and P·V (SageAttention3 numerics), NVFP4 or MXFP4.

One program computes ``BLOCK_M`` query rows of one (batch, query head) with an online softmax in
base 2 over key blocks of ``BLOCK_N``. Scores are the block-scaled product of Q̂ and K̂ times
``softmax_scale·log2 e`` (and the NVFP4 tensor scales), plus ΔS. P̃ is quantized in the kernel, per
row in groups of keys, after the two-level scaling (each row's block maximum mapped to 448·6) or
directly. Twin: ``lowbit_attn.inference.naive.fp4_attention``.

``NATIVE_FP4`` (sm_100 and newer): both products are ``tl.dot_scaled`` on packed E2M1 with E4M3
(group 16) or E8M0 (group 32) scales: ``tcgen05.mma … block_scale`` on sm_100,
``mma.sync … kind::mxf4nvf4.block_scale`` on sm_120. Otherwise (Hopper and older, the interpreter)
the operands are unpacked and multiplied by their group scales, which is exact in bf16 (a 2-bit
E2M1 significand times a 4-bit E4M3 one or a power of two), and multiplied with ``tl.dot`` in fp32
accumulation: the same function. Triton 3.6 cannot compile NVFP4 ``dot_scaled`` for sm_90 at all,
and its interpreter has no ``dot_scaled``. ``EMU_FP32`` multiplies fp32 instead of bf16 (the
interpreter's bf16 dot is wrong).

``PIPELINE_QK`` (native sm_120): the unmasked key loop issues the next block's Q·Kᵀ before this
block's softmax, so that ``mma.sync`` runs under its ALU work; the same function.

The ``dot_scaled`` products start from an accumulator filled with the run-time argument ``zero``
(always 0.0) rather than from nothing: Triton 3.6 fails to compile a ``dot_scaled`` inside a loop
for sm_100 otherwise (its accumulator-init pass leaves an invalid TMEM allocation behind), and a
run-time value is not a constant it can rewrite.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit_attn.core.arch import fp4_mode, fp4_pipeline_qk, get_capability, interpreter_enabled
from lowbit_attn.core.operands import FP4_GROUP, P_TWO_LEVEL_PEAK, QuantizedFP4
from lowbit_attn.core.variants import PLAIN, Variant, cap_args, sink_logits
from lowbit_attn.core.triton_helpers import (
    LOG2E, LaunchConfig, add_sink, finish_scores, key_block_bounds, next_power_of_2,
    normalize_rows, online_max, program_heads, store_lse, strides, autotuned,
    window_block_bounds, window_limits,
)
from lowbit_attn.quant.fp4 import (
    e2m1_code, e2m1_pack, e2m1_value, e4m3_value, e8m0_value, p_group_scale, scale_operand,
)

# the two-level target peak of P̃ rows, per format (twin: reference.quant_fp4.two_level_p)
_LOG2_PEAK_NV = tl.constexpr(math.log2(P_TWO_LEVEL_PEAK["nvfp4"]))
_INV_PEAK_NV = tl.constexpr(1.0 / P_TWO_LEVEL_PEAK["nvfp4"])
_LOG2_PEAK_MX = tl.constexpr(math.log2(P_TWO_LEVEL_PEAK["mxfp4"]))
_INV_PEAK_MX = tl.constexpr(1.0 / P_TWO_LEVEL_PEAK["mxfp4"])


CONFIGS = {
    "interpreter": [LaunchConfig(4, 1)],
    "sm_80": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_89": [LaunchConfig(8, 2), LaunchConfig(4, 2)],
    "sm_90": [LaunchConfig(8, 2), LaunchConfig(8, 3), LaunchConfig(4, 2)],
}


@triton.jit
def _dequant(packed, bits, R: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr,
             NV: tl.constexpr):
    """Packed E2M1 ``[R, C/2]`` and group-scale bits ``[R, C/GROUP]`` → fp32 ``[R, C]``, the
    values times their group scales (exact)."""
    p = packed.to(tl.int32)
    values = e2m1_value(tl.reshape(tl.join(p & 0xF, p >> 4), [R, C]))
    if NV:
        scale = e4m3_value(bits.to(tl.int32))
    else:
        scale = e8m0_value(bits.to(tl.int32))
    grouped = tl.reshape(values, [R, C // GROUP, GROUP]) * scale[:, :, None]
    return tl.reshape(grouped, [R, C])


@triton.jit
def _quantize_p(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                NV: tl.constexpr):
    """P̃ ``[BLOCK_M, BLOCK_N]`` (≥ 0) → ``(x [BLOCK_M, BLOCK_N/GROUP, GROUP] fp32, scale bits
    [BLOCK_M, BLOCK_N/GROUP] int32, scales fp32)``: group amax → scale, then ``x = P̃·(1/s)``, which
    the caller rounds to E2M1. Twin: ``reference.quant_fp4.quantize_p``."""
    pg = tl.reshape(p, [BLOCK_M, BLOCK_N // GROUP, GROUP])
    code, denom = p_group_scale(tl.max(pg, axis=2) + tl.sum(pg * 0.0, axis=2), NV)
    rcp = tl.div_rn(tl.full(denom.shape, 1.0, tl.float32), denom)
    return pg * rcp[:, :, None], code, denom


@triton.jit
def _scores(
    q_op, qs_op, start_n, offs_n, limit, zero, k_base, ks_base, skn, sksn,
    NV: tl.constexpr, NATIVE_FP4: tl.constexpr, EMU_FP32: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Q̂·K̂ᵀ of the key block at ``start_n`` (unscaled fp32 ``[BLOCK_M, BLOCK_N]``); keys from
    ``limit`` on load as code 0 with scale 0 (their scores are 0: masked or discarded later)."""
    cols = start_n + offs_n
    nmask = cols < limit
    half_d = tl.arange(0, BLOCK_D // 2)
    grp_d = tl.arange(0, BLOCK_D // GROUP)
    # keys past the end load as code 0 with scale 0: finite scores, masked below
    ks = tl.load(ks_base + cols[:, None] * sksn + grp_d[None, :], mask=nmask[:, None], other=0)
    if NATIVE_FP4:
        kt = tl.load(k_base + cols[None, :] * skn + half_d[:, None], mask=nmask[None, :], other=0)
        s = tl.dot_scaled(q_op, qs_op, "e2m1", kt, scale_operand(ks, NV), "e2m1",
                          acc=tl.full([BLOCK_M, BLOCK_N], zero, tl.float32))
    else:
        k = tl.load(k_base + cols[:, None] * skn + half_d[None, :], mask=nmask[:, None], other=0)
        kd = _dequant(k, ks, BLOCK_N, BLOCK_D, GROUP, NV)
        if EMU_FP32:
            s = tl.dot(q_op, tl.trans(kd), out_dtype=tl.float32)
        else:
            s = tl.dot(q_op, tl.trans(kd).to(tl.bfloat16), out_dtype=tl.float32)
    return s


@triton.jit
def _attend_block(
    acc, m_i, l_i, s, start_n, offs_m, offs_n, nk, causal_offset, mult, zero,
    v_base, vs_base, ds_base, svd, svsd, sdn,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DS: tl.constexpr, NV: tl.constexpr,
    NATIVE_FP4: tl.constexpr, EMU_FP32: tl.constexpr, TWO_LEVEL: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    window, WINDOWED: tl.constexpr, cap, SOFTCAP: tl.constexpr,
):
    """One key block's online softmax, P̃ quantization and P̃·V from its scores ``s`` (those of
    :func:`_scores`); ``window``, ``cap``: see ``finish_scores``."""
    cols = start_n + offs_n
    nmask = cols < nk
    s = s * mult
    s = finish_scores(s, cols, nmask, offs_m, causal_offset, ds_base, sdn, HAS_DS, MASKED,
                      IS_CAUSAL, window, WINDOWED, cap, SOFTCAP)
    block_max = tl.max(s, axis=1)
    m_new, m_safe, alpha = online_max(m_i, block_max)
    if TWO_LEVEL:
        b_safe = tl.where(block_max == float("-inf"), 0.0, block_max)
        if NV:
            p = tl.exp2(s - (b_safe - _LOG2_PEAK_NV)[:, None])
            s1 = tl.exp2(block_max - m_safe) * _INV_PEAK_NV
        else:
            p = tl.exp2(s - (b_safe - _LOG2_PEAK_MX)[:, None])
            s1 = tl.exp2(block_max - m_safe) * _INV_PEAK_MX
        s1 = tl.where(block_max == float("-inf"), 0.0, s1)  # never 0·inf
    else:
        p = tl.exp2(s - m_safe[:, None])
        s1 = tl.full([BLOCK_M], 1.0, tl.float32)
    l_i = l_i * alpha + tl.sum(p, axis=1) * s1

    x, pcode, pscale = _quantize_p(p, BLOCK_M, BLOCK_N, GROUP, NV)
    offs_d = tl.arange(0, BLOCK_D)
    grp_n = start_n // GROUP + tl.arange(0, BLOCK_N // GROUP)
    vs = tl.load(vs_base + offs_d[:, None] * svsd + grp_n[None, :])
    if NATIVE_FP4:
        pk = e2m1_pack(x, BLOCK_M, BLOCK_N, True)  # the hardware conversion
        half_n = start_n // 2 + tl.arange(0, BLOCK_N // 2)
        vt = tl.load(v_base + half_n[:, None] + offs_d[None, :] * svd)
        pv = tl.dot_scaled(pk, scale_operand(pcode.to(tl.uint8), NV), "e2m1",
                           vt, scale_operand(vs, NV), "e2m1",
                           acc=tl.full([BLOCK_M, BLOCK_D], zero, tl.float32))
    else:
        pq = tl.reshape(e2m1_value(e2m1_code(x)) * pscale[:, :, None], [BLOCK_M, BLOCK_N])
        half_n = start_n // 2 + tl.arange(0, BLOCK_N // 2)
        v = tl.load(v_base + half_n[None, :] + offs_d[:, None] * svd)
        vd = tl.trans(_dequant(v, vs, BLOCK_D, BLOCK_N, GROUP, NV))
        if EMU_FP32:
            pv = tl.dot(pq, vd, out_dtype=tl.float32)
        else:
            pv = tl.dot(pq.to(tl.bfloat16), vd.to(tl.bfloat16), out_dtype=tl.float32)
    acc = acc * alpha[:, None] + pv * s1[:, None]
    return acc, m_new, l_i


@triton.jit
def _masked_block(acc, m_i, l_i, start_n, q_ops, rows, keys, ds_base, window, cap,
                  IS_CAUSAL: tl.constexpr, HAS_DS: tl.constexpr, NV: tl.constexpr,
                  NATIVE_FP4: tl.constexpr, EMU_FP32: tl.constexpr, TWO_LEVEL: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key block that some rows see in part: :func:`_scores` and :func:`_attend_block`
    with masks. ``q_ops``: ``(q_op, qs_op)``; ``rows``: ``(offs_m, offs_n, nk, causal_offset,
    mult, zero, sdn)``; ``keys``: ``(k_base, ks_base, skn, sksn, v_base, vs_base, svd,
    svsd)``."""
    q_op, qs_op = q_ops
    offs_m, offs_n, nk, causal_offset, mult, zero, sdn = rows
    k_base, ks_base, skn, sksn, v_base, vs_base, svd, svsd = keys
    s = _scores(q_op, qs_op, start_n, offs_n, nk, zero, k_base, ks_base, skn, sksn,
                NV, NATIVE_FP4, EMU_FP32, GROUP, BLOCK_M, BLOCK_N, BLOCK_D)
    return _attend_block(
        acc, m_i, l_i, s, start_n, offs_m, offs_n, nk, causal_offset, mult, zero,
        v_base, vs_base, ds_base, svd, svsd, sdn, True, IS_CAUSAL, HAS_DS, NV, NATIVE_FP4,
        EMU_FP32, TWO_LEVEL, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, window, WINDOWED, cap, SOFTCAP,
    )


@triton.jit
def _attn_fwd_fp4_kernel(
    q, k, v, VM, DS, LSH, O, LSE, SINK, vm_strides, ds_strides, lsh_strides, o_strides,
    lse_strides, NQ, NK, HQ, GROUP_HEADS, D, causal_offset, qk_multiplier, zero, N_BUCKET,
    left, right, chunk, cap2, two_over,
    IS_CAUSAL: tl.constexpr, NV: tl.constexpr, NATIVE_FP4: tl.constexpr, EMU_FP32: tl.constexpr,
    TWO_LEVEL: tl.constexpr, HAS_VMEAN: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_LSH: tl.constexpr, WRITE_LSE: tl.constexpr, PIPELINE_QK: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The LLM variants as in ``kernel_int8`` (``WINDOWED``, ``SOFTCAP``, ``SINK``; a window's
    loop is not pipelined). Operands ``q``, ``k``, ``v``: ``(packed codes, group scales, tensor
    scale or None, and the
    three's strides)``; codes and scales are contiguous along their last dim, their strides are
    (batch, head, token) for Q and K, (batch, head, dim) for V (token-contiguous); the tensor
    scale's (batch, head). Strides: (batch, head) of V's channel mean ``VM``; (batch, head, query
    block, key) of ``DS``; (batch, head, token, dim) of ``O``; (batch, head, token) of ``LSH`` and
    ``LSE``."""
    Q, QS, QG, q_strides, qs_strides, qg_strides = q
    K, KS, KG, k_strides, ks_strides, kg_strides = k
    V, VS, VG, v_strides, vs_strides, vg_strides = v
    sqb, sqh, sqn = q_strides
    sqsb, sqsh, sqsn = qs_strides
    skb, skh, skn = k_strides
    sksb, sksh, sksn = ks_strides
    svb, svh, svd = v_strides
    svsb, svsh, svsd = vs_strides
    sgqb, sgqh = qg_strides
    sgkb, sgkh = kg_strides
    sgvb, sgvh = vg_strides
    svmb, svmh = vm_strides
    sdb, sdh, sdq, sdn = ds_strides
    slb, slh, sln = lsh_strides
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides
    # int64 batch/head bases: offsets of large tensors may pass 2^31 elements
    pid_m, b, h, hk = program_heads(HQ, GROUP_HEADS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mmask = offs_m < NQ

    half_d = tl.arange(0, BLOCK_D // 2)
    grp_d = tl.arange(0, BLOCK_D // GROUP)
    q_blk = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + half_d[None, :],
                mask=mmask[:, None], other=0)
    qs = tl.load(QS + b * sqsb + h * sqsh + offs_m[:, None] * sqsn + grp_d[None, :],
                 mask=mmask[:, None], other=0)
    if NATIVE_FP4:
        q_op = q_blk
        qs_op = scale_operand(qs, NV)
    else:
        q_op = _dequant(q_blk, qs, BLOCK_M, BLOCK_D, GROUP, NV)
        if not EMU_FP32:
            q_op = q_op.to(tl.bfloat16)
        qs_op = qs
    mult = qk_multiplier
    if NV:
        mult = mult * (tl.load(QG + b * sgqb + h * sgqh) * tl.load(KG + b * sgkb + hk * sgkh))

    k_base = K + b * skb + hk * skh
    ks_base = KS + b * sksb + hk * sksh
    v_base = V + b * svb + hk * svh
    vs_base = VS + b * svsb + hk * svsh
    ds_base = DS
    if HAS_DS:
        ds_base = DS + b * sdb + h * sdh + pid_m * sdq

    window = window_limits(offs_m, causal_offset, left, right, chunk, NK)
    shift = tl.zeros([BLOCK_M], dtype=tl.float32)  # K smoothing's row shift, base 2
    if (SOFTCAP or HAS_SINK) and HAS_LSH:
        shift = tl.load(LSH + b * slb + h * slh + offs_m * sln, mask=mmask, other=0.0) * LOG2E
    cap = (cap2, two_over, shift)
    q_ops = (q_op, qs_op)
    rows = (offs_m, offs_n, NK, causal_offset, mult, zero, sdn)
    keys = (k_base, ks_base, skn, sksn, v_base, vs_base, svd, svsd)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if WINDOWED:  # masked blocks at both ends of the window's range, whole ones between
        lo, full_lo, full_hi, hi = window_block_bounds(NK, pid_m, causal_offset, left, right,
                                                       chunk, BLOCK_M, BLOCK_N)
        for start_n in range(lo, full_lo, BLOCK_N):
            acc, m_i, l_i = _masked_block(
                acc, m_i, l_i, start_n, q_ops, rows, keys, ds_base, window, cap, IS_CAUSAL,
                HAS_DS, NV, NATIVE_FP4, EMU_FP32, TWO_LEVEL, GROUP, BLOCK_M, BLOCK_N, BLOCK_D,
                WINDOWED, SOFTCAP,
            )
    else:
        full_lo = 0
        full_hi, hi = key_block_bounds(NK, pid_m, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    # Q·Kᵀ one block ahead: the next block's products are issued before this block's softmax,
    # which does not depend on them (ptxas interleaves them with its exp2s). After the last
    # unmasked block the last one is loaded again (its product discarded): no masks in the loop.
    # Native causal MXFP4 stays serial: pipelined it spills on sm_120a (16 B at 255 registers;
    # benchmarks/NOTES.md §7); the emulation takes either form.
    PIPELINED: tl.constexpr = (PIPELINE_QK and (NV or not IS_CAUSAL or not NATIVE_FP4)
                               and not WINDOWED)
    if PIPELINED:
        s_next = _scores(q_op, qs_op, 0, offs_n, NK, zero, k_base, ks_base, skn, sksn,
                         NV, NATIVE_FP4, EMU_FP32, GROUP, BLOCK_M, BLOCK_N, BLOCK_D)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        if PIPELINED:
            s = s_next
            s_next = _scores(q_op, qs_op, tl.minimum(start_n + BLOCK_N, full_hi - BLOCK_N),
                             offs_n, NK, zero, k_base, ks_base, skn, sksn, NV, NATIVE_FP4,
                             EMU_FP32, GROUP, BLOCK_M, BLOCK_N, BLOCK_D)
        else:
            s = _scores(q_op, qs_op, start_n, offs_n, NK, zero, k_base, ks_base, skn, sksn,
                        NV, NATIVE_FP4, EMU_FP32, GROUP, BLOCK_M, BLOCK_N, BLOCK_D)
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, s, start_n, offs_m, offs_n, NK, causal_offset, mult, zero,
            v_base, vs_base, ds_base, svd, svsd, sdn,
            False, IS_CAUSAL, HAS_DS, NV, NATIVE_FP4, EMU_FP32, TWO_LEVEL,
            GROUP, BLOCK_M, BLOCK_N, BLOCK_D, window, WINDOWED, cap, SOFTCAP,
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _masked_block(acc, m_i, l_i, start_n, q_ops, rows, keys, ds_base,
                                      window, cap, IS_CAUSAL, HAS_DS, NV, NATIVE_FP4, EMU_FP32,
                                      TWO_LEVEL, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, WINDOWED,
                                      SOFTCAP)
    w = l_i
    if HAS_SINK:  # one term after the loop (m raised to the sink's logit when above)
        sink = tl.load(SINK + h + offs_m * 0) - shift
        acc, m_i, l_i, w = add_sink(acc, m_i, l_i, sink, 0.0)

    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    out, empty = normalize_rows(acc, l_i)
    if NV:
        out = out * tl.load(VG + b * sgvb + hk * sgvh)
    if HAS_VMEAN:
        vm = tl.load(VM + b * svmb + hk * svmh + offs_d, mask=dmask, other=0.0)
        if HAS_SINK:
            out = out + vm[None, :] * w[:, None]
        else:
            out = out + vm[None, :]
    out = tl.where(empty[:, None], 0.0, out)
    tl.store(  # int64 rows: an NHD output's rows span H·D each, 2^31 elements at N·H·D
        O + b * sob + h * soh + offs_m.to(tl.int64)[:, None] * son + offs_d[None, :] * sod,
        out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :],
    )
    if WRITE_LSE:
        store_lse(LSE, b * seb + h * seh + offs_m * sen, LSH, b * slb + h * slh + offs_m * sln,
                  m_i, l_i, 0.0, mmask, HAS_LSH)


_attn_fwd_fp4 = autotuned(
    CONFIGS,
    # N_BUCKET (a power of two of the key length, unused by the kernel): tune per length range.
    key=["N_BUCKET", "BLOCK_D", "IS_CAUSAL", "NV", "TWO_LEVEL", "BLOCK_M", "BLOCK_N",
         "WINDOWED", "SOFTCAP"],
)(
    triton.heuristics(
        {
            "HAS_SINK": lambda a: a["SINK"] is not None,
            "HAS_VMEAN": lambda a: a["VM"] is not None,
            "HAS_DS": lambda a: a["DS"] is not None,
            "HAS_LSH": lambda a: a["LSH"] is not None,
            "WRITE_LSE": lambda a: a["LSE"] is not None,
        }
    )(_attn_fwd_fp4_kernel)
)


def _pair(x: torch.Tensor | None) -> tuple[int, int]:
    """(batch, head) strides of a per-(batch, head) tensor or vector; zeros when absent."""
    return (0, 0) if x is None else (x.stride(0), x.stride(1))


def _operand(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None):
    """An FP4 operand as one kernel argument (see the kernel's docstring)."""
    return (codes, scales, tensor_scale, codes.stride()[:3], scales.stride()[:3],
            _pair(tensor_scale))


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
    pipeline_qk: bool | None = None,
    variant: Variant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run the kernel; writes ``out`` (a logical ``[B, Hq, Nq, D]`` view) and returns the LSE
    ``[B, Hq, Nq]`` fp32 when asked. ``pipeline_qk``: issue Q·Kᵀ one key block ahead (the same
    results); by default on the native sm_120 path only. ``variant``, ``sinks``: as
    ``kernel_int8.attention``."""
    b, hq, nq, _ = qz.q.shape
    hkv, nk = qz.k.shape[1], qz.k.shape[2]
    lse = torch.empty((b, hq, nq), device=out.device, dtype=torch.float32) if return_lse else None
    nv = qz.fmt == "nvfp4"
    native = fp4_mode(out.device.type, "triton", get_capability()) == "native"
    if pipeline_qk is None:
        pipeline_qk = native and fp4_pipeline_qk(get_capability())
    grid = (triton.cdiv(nq, block_q), b * hq)
    cap2, two_over = cap_args(variant.softcap)
    _attn_fwd_fp4[grid](
        q=_operand(qz.q, qz.q_scale, qz.q_global), k=_operand(qz.k, qz.k_scale, qz.k_global),
        v=_operand(qz.v, qz.v_scale, qz.v_global), VM=qz.v_mean, DS=qz.delta_s,
        LSH=qz.lse_shift, O=out, LSE=lse, SINK=sink_logits(sinks), vm_strides=_pair(qz.v_mean),
        ds_strides=strides(qz.delta_s, 4), lsh_strides=strides(qz.lse_shift, 3),
        o_strides=out.stride(), lse_strides=strides(lse, 3),
        NQ=nq, NK=nk, HQ=hq, GROUP_HEADS=hq // hkv, D=head_dim,
        causal_offset=nk - nq if variant.windowed else (
            0 if causal_offset is None else int(causal_offset)),
        qk_multiplier=float(qz.qk_multiplier), zero=0.0,
        N_BUCKET=min(next_power_of_2(nk), 32768), left=variant.left, right=variant.right,
        chunk=variant.chunk, cap2=cap2, two_over=two_over, WINDOWED=variant.windowed,
        SOFTCAP=variant.softcap > 0,
        IS_CAUSAL=causal_offset is not None and not variant.windowed, NV=nv,
        NATIVE_FP4=native, EMU_FP32=interpreter_enabled(), TWO_LEVEL=two_level,
        PIPELINE_QK=pipeline_qk,
        GROUP=FP4_GROUP[qz.fmt], BLOCK_M=block_q, BLOCK_N=block_k, BLOCK_D=qz.q.shape[-1] * 2,
    )
    return lse

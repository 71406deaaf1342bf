"""Triton FP4 quantizers: NVFP4 and MXFP4. Twins: ``lowbit_attn.quant.fp4_naive`` (bit-identical);
the numerics and the edge-case conventions are documented there.

Every code (E2M1 values, E4M3 and E8M0 scales) is built with fp32 arithmetic and integer bit
operations, never with Triton's float8 conversions, so a GPU and the interpreter give the same bits.
Inputs are ``[..., K]``; the leading dimensions are flattened into rows, and one program handles a
block of ``BLOCK_R`` rows × ``BLOCK_K`` elements (whole groups). :func:`quantize_groups` is the
group quantizer the FP4 attention operands use too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit_attn.core.checks import quant_groups
# the tensor scale (a host-side torch reduction, or the caller's checked), the same for both twins
from lowbit_attn.quant.fp4_naive import nvfp4_global_scale, nvfp4_quant_scale
from lowbit_attn.core.triton_helpers import e4m3_round, next_power_of_2, round_half_even

NVFP4_GROUP = 16
MXFP4_GROUP = 32


@triton.jit
def e2m1_code(y):
    """fp32 → E2M1 code (int32, 0..15): RNE on the code (even code = even mantissa), saturating at
    ±6, NaN → 0, sign bit for every negative input. Twin: ``reference.fp4.e2m1_code``."""
    a = tl.minimum(tl.abs(y), 6.0)
    code = tl.where(
        a < 2.0,
        round_half_even(a * 2.0),
        tl.where(a < 4.0, round_half_even(a) + 2.0, round_half_even(a * 0.5) + 4.0),
    )
    code = tl.where(y == y, code, 0.0).to(tl.int32)
    return tl.where(y < 0.0, code | 8, code)


# Four ``cvt.rn.satfinite.e2m1x2.f32`` (sm_100a, sm_120a): each packs two fp32 into one byte, its
# first source in the high nibble; ``$1..$4`` are the even elements, ``$5..$8`` the odd ones, and
# the four bytes come back as one 32-bit register (``pack=4``). Shared with the Gluon kernels.
E2M1X2_PTX = tl.constexpr(
    "{ .reg .b8 b0, b1, b2, b3;\n"
    "cvt.rn.satfinite.e2m1x2.f32 b0, $5, $1;\n"
    "cvt.rn.satfinite.e2m1x2.f32 b1, $6, $2;\n"
    "cvt.rn.satfinite.e2m1x2.f32 b2, $7, $3;\n"
    "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $4;\n"
    "mov.b32 $0, {b0, b1, b2, b3}; }")
E2M1X2_CONSTRAINTS = tl.constexpr("=r,r,r,r,r,r,r,r,r")


@triton.jit
def e2m1_pack(y, R: tl.constexpr, C: tl.constexpr, HW_CVT: tl.constexpr):
    """fp32 ``[R, C]`` (any shape of ``R·C`` elements, row-major) → E2M1 bytes ``[R, C/2]`` uint8,
    element ``2i`` in the low nibble (twin: ``reference.fp4.pack_fp4`` of ``e2m1_code``).

    ``HW_CVT`` (sm_100a, sm_120a): the hardware conversion, ``cvt.rn.satfinite.e2m1x2.f32``,
    one instruction per two values; round to nearest even and saturation to ±6 are the twin's
    :func:`e2m1_code` for every non-NaN input (the ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to
    the even code; ±Inf to ±6); a NaN's code is the hardware's, where the twin writes 0 (its group
    scale is NaN either way). Otherwise :func:`e2m1_code` in fp32 arithmetic (~20 operations per
    value; the interpreter has no inline PTX)."""
    lo, hi = tl.split(tl.reshape(y, [R, C // 2, 2]))
    if HW_CVT:
        return tl.inline_asm_elementwise(E2M1X2_PTX, E2M1X2_CONSTRAINTS, [lo, hi],
                                         dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return (e2m1_code(lo) | (e2m1_code(hi) << 4)).to(tl.uint8)


@triton.jit
def scale_operand(bits, NV: tl.constexpr):
    """Scale bits (uint8) as the block-scaled products take them (``tl.dot_scaled``, Gluon's
    ``tcgen05_mma_scaled``): E4M3 (NVFP4, group 16) or E8M0 bytes (MXFP4, group 32)."""
    if NV:
        return bits.to(tl.float8e4nv, bitcast=True)
    else:
        return bits


@triton.jit
def e4m3_group_scale(s, nonzero):
    """Non-negative (or NaN) fp32 → ``(E4M3 value as fp32, E4M3 bits as int32)``: RNE, saturating
    at 448, NaN → 0x7F, at least 2^-9 (code 1) where ``nonzero``."""
    r, code = e4m3_round(s)
    tiny = nonzero & (r == 0.0)
    r = tl.where(tiny, 0.001953125, r)
    code = tl.where(tiny, 1, code)
    nan = s != s
    return tl.where(nan, float("nan"), r), tl.where(nan, 0x7F, code)


@triton.jit
def e8m0_group_scale(amax):
    """Group amax (fp32, ≥ 0 or NaN) → ``(E8M0 bits as int32, 2^e as fp32)`` with
    ``e = floor(log2 amax) - 2`` from the exponent field (zero and subnormal amax clamp to -127),
    NaN → code 255 and a NaN scale. Twin: ``reference.fp4.mxfp4_scale_code``."""
    exp_field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    code = tl.minimum(tl.maximum(exp_field - 129, -127), 127) + 127
    nan = amax != amax
    code = tl.where(nan, 255, code)
    return code, e8m0_value(code)


@triton.jit
def p_group_scale(amax, NV: tl.constexpr):
    """P̃'s group scale from its group amax (≥ 0; P̃ has no tensor scale): ``(scale bits as int32,
    the divisor as fp32)``, the E4M3 of ``amax/6`` (``NV``; an all-zero group divides by 1) or
    the E8M0 of :func:`e8m0_group_scale`. The Triton and Gluon FP4 forwards both quantize P̃
    with it. Twin: ``quant.fp4_qkv_naive.quantize_p``."""
    if NV:
        s, code = e4m3_group_scale(tl.div_rn(amax, 6.0), amax > 0.0)
        denom = tl.where(code == 0, 1.0, s)
    else:
        code, denom = e8m0_group_scale(amax)
    return code, denom


@triton.jit
def e8m0_value(code):
    """E8M0 bits (int32) → fp32 ``2^(code - 127)``, built from bits (exact, 2^-127 too); 255 → NaN.
    Twin: ``reference.fp4.e8m0_value``."""
    v = tl.where(code >= 1, code << 23, 0x400000).to(tl.float32, bitcast=True)
    return tl.where(code == 255, float("nan"), v)


@triton.jit
def e4m3_value(code):
    """E4M3 bits (int32, sign clear) → fp32, built from bits: ``man·2^-9`` below 2^-6,
    ``(1 + man/8)·2^(exp-7)`` above; 0x7F → NaN. (The interpreter cannot convert float8.)"""
    exp = (code >> 3) & 0xF
    man = code & 0x7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    v = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32, 0..15) → fp32 value: magnitudes 0, 0.5, 1, 1.5 (``c/2``), 2, 3 (``c-2``),
    4, 6 (``2c-8``); bit 3 is the sign."""
    c = (code & 7).to(tl.float32)
    mag = tl.where(c < 4.0, c * 0.5, tl.where(c < 6.0, c - 2.0, c * 2.0 - 8.0))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def nvfp4_global_from_amax(amax):
    """NVFP4 tensor scale ``g = amax/2688`` (at least 2^-126; 1 if amax is 0; NaN stays NaN).
    Twin: ``reference.fp4.global_scale_from_amax``."""
    g = tl.maximum(tl.div_rn(amax, 2688.0), 1.1754943508222875e-38)
    g = tl.where(amax != amax, amax, g)  # a GPU max drops NaN
    return tl.where(amax == 0.0, 1.0, g)


@triton.jit
def quantize_groups(y, g, R: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr,
                    NV: tl.constexpr):
    """``[R, C]`` fp32 grouped along C → ``(packed bytes [R, C/2] uint8, scale bits [R, C/GROUP]
    uint8)``: NVFP4 under the tensor scale ``g`` (``NV``) or MXFP4. The group amax is NaN when any
    element is NaN or ±Inf (a GPU max drops NaN; the sum keeps it). Twins:
    ``reference.fp4.nvfp4_group_codes`` / ``mxfp4_group_codes`` and ``pack_fp4``."""
    yg = tl.reshape(y, [R, C // GROUP, GROUP])
    amax = tl.max(tl.abs(yg), axis=2) + tl.sum(yg * 0.0, axis=2)
    if NV:
        s, code = e4m3_group_scale(tl.div_rn(tl.div_rn(amax, 6.0), g), amax > 0.0)
        denom = tl.where(code == 0, 1.0, s * g)  # all-zero group: no 0/0
    else:
        code, denom = e8m0_group_scale(amax)
    return e2m1_pack(tl.div_rn(yg, denom[:, :, None]), R, C, False), code.to(tl.uint8)


@triton.jit
def _quantize_fp4_rows_kernel(
    X, OUT, SCALE, GSCALE,
    R, K, sxr, sxk, sor, ssr,
    NV: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = (rows < R)[:, None]
    x = tl.load(X + rows.to(tl.int64)[:, None] * sxr + cols.to(tl.int64)[None, :] * sxk,
                mask=rmask & (cols < K)[None, :], other=0.0).to(tl.float32)
    g = 1.0
    if NV:
        g = tl.load(GSCALE)
    packed, code = quantize_groups(x, g, BLOCK_R, BLOCK_K, GROUP, NV)
    half = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(OUT + rows.to(tl.int64)[:, None] * sor + half[None, :], packed,
             mask=rmask & (half < K // 2)[None, :])
    grp = pid_k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    tl.store(SCALE + rows.to(tl.int64)[:, None] * ssr + grp[None, :], code,
             mask=rmask & (grp < K // GROUP)[None, :])


def _launch(x: torch.Tensor, group: int, scale_dtype: torch.dtype, gscale=None):
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)  # not -1: ambiguous when K is 0
    r, ng = x2.shape[0], k // group
    packed = torch.empty((r, k // 2), device=x.device, dtype=torch.uint8)
    scales = torch.empty((r, ng), device=x.device, dtype=scale_dtype)
    codes = scales.view(torch.uint8)  # store bits: no float8 conversion anywhere
    # up to 16 groups of a row per program, and rows enough for ~64 groups
    block_g = min(16, next_power_of_2(max(ng, 1)))
    block_r = 64 // block_g
    grid = (triton.cdiv(r, block_r), triton.cdiv(ng, block_g))
    if r > 0 and ng > 0:
        _quantize_fp4_rows_kernel[grid](
            X=x2, OUT=packed, SCALE=codes, GSCALE=gscale, R=r, K=k, sxr=x2.stride(0),
            sxk=x2.stride(1), sor=packed.stride(0), ssr=codes.stride(0), NV=gscale is not None,
            GROUP=group, BLOCK_R=block_r, BLOCK_K=block_g * group,
        )
    lead = x.shape[:-1]
    return packed.view(*lead, k // 2), scales.view(*lead, ng)


def quantize_nvfp4(
    x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`lowbit_attn.quant.fp4_naive.quantize_nvfp4` (bit-identical).

    Returns ``(packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale fp32 0-dim)``.
    """
    quant_groups(x, NVFP4_GROUP)
    g = nvfp4_quant_scale(x, global_scale).contiguous()
    packed, scales = _launch(x, NVFP4_GROUP, torch.float8_e4m3fn, g)
    return packed, scales, g


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`lowbit_attn.quant.fp4_naive.quantize_mxfp4` (bit-identical).

    Returns ``(packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32])``.
    """
    quant_groups(x, MXFP4_GROUP)
    return _launch(x, MXFP4_GROUP, torch.uint8)


__all__ = ["nvfp4_global_scale", "quantize_nvfp4", "quantize_mxfp4"]

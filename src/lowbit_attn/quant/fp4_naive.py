"""FP4 microscaling quantizers in plain PyTorch: NVFP4 and MXFP4. Twins: ``lowbit_attn.quant.fp4``.

Both formats hold E2M1 values (codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign), grouped
along the last (reduction) dimension, two per byte with element ``2i`` in the low nibble and ``2i+1``
in the high nibble. Arithmetic is fp32, in the kernels' order, so both twins give the same bits.

**NVFP4** (groups of 16, one E4M3 scale per group, one fp32 scale per tensor)::

    amax_t = max |x| over the finite elements of the tensor
    g      = amax_t / 2688            (2688 = 448·6; g = 1 if amax_t == 0; at least 2^-126, normal)
             or the caller's g, from that default to 229376 times it (see nvfp4_quant_scale)
    s      = e4m3_rne((amax_group / 6) / g)      (saturating at 448)
    values = e2m1_rne(x / (s · g))               (saturating at ±6)
    x̂      = value · (s · g)

**MXFP4** (groups of 32, E8M0 power-of-two scales, OCP MX v1.0)::

    e      = clamp(floor(log2(amax_group)) - 2, -127, 127)     code = e + 127
    values = e2m1_rne(x / 2^e)                                 (saturating at ±6)
    x̂      = value · 2^e

Edge cases, the same in both twins:

- *All-zero group*: NVFP4 scale 0 (and ``s == 0`` happens for no other group); MXFP4 scale code 0
  (2^-127, what the formula gives with ``log2(0) = -inf``). All value codes 0.
- *Tiny non-zero NVFP4 group* whose ``(amax/6)/g`` rounds to E4M3 zero (below 2^-10): the scale is
  raised to E4M3's smallest step 2^-9, so the group still quantizes (its values are then below 3
  and never saturate) instead of being flushed to zero.
- *NaN or ±Inf anywhere in a group*: the group's scale is NaN (E4M3 code 0x7F, E8M0 code 255) and
  its value codes are 0, so the whole group dequantizes to NaN: never hidden, never spread to other
  groups (NVFP4's tensor scale is taken over the finite elements only).
- The sign bit is set for every negative input, also one that rounds to zero (code 0x8, −0).
"""

from __future__ import annotations

import math
import numbers

import torch

from lowbit_attn.core.checks import quant_groups, shown
from lowbit_attn.quant.int8_naive import div_rn, nonfinite_guard

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
NVFP4_TENSOR_DIVISOR = 2688.0  # 448·6: the largest group scale times the largest E2M1 value
FLT_MIN = 2.0**-126
# the largest tensor scale: 6·448·g, the largest value a group can dequantize to, stays finite
NVFP4_GLOBAL_MAX = torch.finfo(torch.float32).max / NVFP4_TENSOR_DIVISOR
E4M3_MIN_STEP = 2.0**-9
# E4M3's positive range 448/2^-9: how far above the default amax/2688 a caller's tensor scale may go
NVFP4_GLOBAL_SPAN = E4M3_MAX / E4M3_MIN_STEP
E4M3_NAN = 0x7F
E8M0_NAN = 255

# The E2M1 value of each 4-bit code (bit 3 is the sign).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """fp32 → 4-bit E2M1 code (uint8 in 0..15): round to nearest, ties to even, saturate at ±6.

    The grid's step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on, so the code is ``rne(2a)``,
    ``rne(a) + 2`` or ``rne(a/2) + 4`` of ``a = min(|y|, 6)``; even codes are the even mantissas,
    so RNE on the code is RNE on the value. NaN gives code 0 (its group's scale carries the NaN).
    """
    y = y.float()
    a = torch.clamp(y.abs(), max=E2M1_MAX)
    code = torch.where(
        a < 2.0,
        torch.round(a * 2.0),
        torch.where(a < 4.0, torch.round(a) + 2.0, torch.round(a * 0.5) + 4.0),
    )
    code = torch.nan_to_num(code, nan=0.0).to(torch.uint8)
    return torch.where(y < 0, code | 8, code)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 code (any integer dtype, 0..15) → fp32 value."""
    return E2M1_VALUES.to(code.device)[code.long() & 0xF]


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the E2M1 grid (fp32): nearest, ties to even, saturating at ±6."""
    return e2m1_value(e2m1_code(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` 4-bit codes → ``[..., K/2]`` uint8, element ``2i`` in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` uint8 → ``[..., K]`` 4-bit codes (uint8)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` in fp32 over the finite elements (0-dim; 0 for an empty or all-NaN tensor)."""
    xf = x.float()
    if xf.numel() == 0:  # amax() has no identity; an empty tensor scales like an all-zero one
        return xf.new_zeros(())
    return torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf)).amax()


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor fp32 scale ``g`` (a 0-dim tensor), see the module docstring.

    The amax is over the finite elements: a NaN or Inf marks its own group (NaN scale), not the
    whole tensor.
    """
    return global_scale_from_amax(finite_amax(x))


def nvfp4_tensor_scale(global_scale, device: torch.device) -> torch.Tensor:
    """A caller's NVFP4 tensor scale → fp32 0-dim tensor on ``device``.

    ``global_scale`` is a real number (``float``, ``int``, NumPy scalar) or a one-element real
    tensor; its fp32 value must lie in ``[2^-126, FLT_MAX/2688]``, the range of the default
    ``amax/2688``. Outside it the result is silently wrong whatever the data: with 0 or a subnormal
    scale the group factors ``s·g`` flush and the tensor dequantizes to zeros, a negative one flips
    the scales' sign, a larger one lets ``6·448·g`` overflow to Inf, NaN poisons every group. Reads
    the value on the host (a GPU synchronisation). :func:`nvfp4_quant_scale` checks it against x.
    """
    if isinstance(global_scale, torch.Tensor):
        if global_scale.dtype == torch.bool or global_scale.is_complex():
            raise TypeError(
                f"global_scale must be a real number or tensor, got a {global_scale.dtype} tensor"
            )
        if global_scale.numel() != 1:
            raise ValueError(
                "global_scale must be one number (a 0-dim tensor), got shape "
                f"{tuple(global_scale.shape)}"
            )
        g = global_scale.detach().to(device=device, dtype=torch.float32).reshape(())
    elif isinstance(global_scale, numbers.Real) and not isinstance(global_scale, bool):
        try:
            value = float(global_scale)
        except OverflowError:  # an int past fp64
            value = math.inf
        g = torch.tensor(value, dtype=torch.float32, device=device)
    else:
        raise TypeError(
            "global_scale must be a real number or a one-element tensor, got "
            f"{shown(global_scale)}"
        )
    value = g.item()
    if not FLT_MIN <= value <= NVFP4_GLOBAL_MAX:
        raise ValueError(
            "global_scale must be a positive normal fp32 number of at most FLT_MAX/2688, from "
            f"2^-126 ≈ 1.18e-38 to ≈ {NVFP4_GLOBAL_MAX:.4g} (the range of the default amax/2688: "
            "below it the E4M3 group factors s·global_scale flush to zero, above it "
            f"6·448·global_scale overflows), got {value!r} in fp32"
        )
    return g


def nvfp4_quant_scale(x: torch.Tensor, global_scale) -> torch.Tensor:
    """The tensor scale ``quantize_nvfp4`` uses for ``x``: the default :func:`nvfp4_global_scale`,
    or the caller's (:func:`nvfp4_tensor_scale`) if it lies from that default to
    ``229376 = 448/2^-9`` times it.

    The largest group scale is ``amax/(6·g)`` and E4M3 holds it only from 2^-9 to 448: with a
    smaller ``g`` the largest groups saturate at ``±6·448·g`` (a ``g`` far too small dequantizes
    the tensor to almost zeros), with a larger one every group scale is below E4M3's smallest step
    and the values round to zero. A tensor with no finite non-zero element takes any valid ``g``.
    Reads both scales on the host.
    """
    amax = finite_amax(x)
    default = global_scale_from_amax(amax)
    if global_scale is None:
        return default
    g = nvfp4_tensor_scale(global_scale, x.device)
    if amax.item() == 0:
        return g
    lo, value = default.item(), g.item()
    hi = min(lo * NVFP4_GLOBAL_SPAN, NVFP4_GLOBAL_MAX)
    if not lo <= value <= hi:
        raise ValueError(
            f"global_scale must be from {lo:.9g} to {hi:.9g} for this x: at least the default "
            "amax/2688 (amax = max |x| over the finite elements) and at most 448/2^-9 = 229376 "
            "times it, so that the largest group scale amax/(6·global_scale) is representable "
            "in E4M3 (from 2^-9 to 448; below the range the values saturate, above it they round "
            f"to zero), got {value:.9g} in fp32"
        )
    return g


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``g = amax/2688``, at least 2^-126 (normal), 1 where ``amax == 0``, NaN where it is NaN."""
    g = torch.clamp(div_rn(amax.float(), NVFP4_TENSOR_DIVISOR), min=FLT_MIN)
    return torch.where(amax == 0, torch.ones_like(g), g)


def e4m3_scale_code(s: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """Non-negative (or NaN) fp32 scales → E4M3 bits (uint8): RNE, saturating at 448, NaN → 0x7F,
    and at least the smallest step 2^-9 (code 1) where ``nonzero``."""
    code = torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    code = torch.where(nonzero & (code == 0), torch.ones_like(code), code)
    return torch.where(torch.isnan(s), torch.full_like(code, E4M3_NAN), code)


def quantize_nvfp4(
    x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 values in groups of 16 along the last dimension, E4M3 group scales, one fp32
    tensor scale.

    Args:
        x: ``[..., K]`` any float dtype, ``K`` a multiple of 16 (0 elements give empty outputs).
        global_scale: the tensor scale ``g``, a number or one-element tensor; by default
            :func:`nvfp4_global_scale`, a caller's from that to 229376 times it
            (:func:`nvfp4_quant_scale`).
    Returns:
        ``(packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale fp32 0-dim)``.
    """
    quant_groups(x, NVFP4_GROUP)
    g = nvfp4_quant_scale(x, global_scale)
    codes, code = nvfp4_group_codes(_grouped(x, NVFP4_GROUP), g)
    return pack_fp4(codes.flatten(-2)), code.view(torch.float8_e4m3fn), g


def nvfp4_group_codes(
    xg: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 core: fp32 groups ``[..., n_groups, 16]`` and the tensor scale ``g`` (broadcastable
    to ``[..., n_groups]``) → ``(E2M1 codes [..., n_groups, 16], E4M3 scale bits [..., n_groups])``,
    both uint8."""
    amax = xg.abs().amax(dim=-1) + nonfinite_guard(xg, -1)
    code = e4m3_scale_code(div_rn(amax, 6.0) / g, amax > 0)
    s = code.view(torch.float8_e4m3fn).float()
    sg = torch.where(code == 0, torch.ones_like(s), s * g)  # all-zero group: no 0/0
    return e2m1_code(xg / sg.unsqueeze(-1)), code


def fp4_operands(packed, scales, group: int, scale_dtype: torch.dtype) -> None:
    """``packed`` uint8 ``[..., K/2]`` and ``scales`` of ``scale_dtype`` ``[..., K/group]`` on one
    device: what the quantizers return (no broadcasting)."""
    for name, t, dtype in (("packed", packed, torch.uint8), ("scales", scales, scale_dtype)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else shown(t)
            raise TypeError(f"{name} must be a {dtype} tensor, got {got}")
    half = group // 2
    if packed.dim() < 1 or packed.shape[-1] % half != 0:
        raise ValueError(
            f"packed's last dimension must be a multiple of {half} (the bytes of {group} values), "
            f"got shape {tuple(packed.shape)}"
        )
    expected = (*packed.shape[:-1], packed.shape[-1] // half)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales must have shape {expected}, one per group of {group} values of packed "
            f"{tuple(packed.shape)}, got {tuple(scales.shape)}"
        )
    if scales.device != packed.device:
        raise ValueError(
            f"scales must be on packed's device {packed.device}, got {scales.device}"
        )


def dequantize_groups(packed: torch.Tensor, factor: torch.Tensor, group: int) -> torch.Tensor:
    """``value · factor`` in fp32: ``packed`` ``[..., K/2]``, fp32 ``factor`` ``[..., K/group]``
    (one per group) → ``[..., K]``. No checks: the dequantizers' core."""
    vals = e2m1_value(unpack_fp4(packed))
    return (_grouped(vals, group) * factor.unsqueeze(-1)).flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale) -> torch.Tensor:
    """NVFP4 back to fp32: ``value · (s · g)``. A group with a NaN scale is all NaN.

    Args:
        packed: uint8 ``[..., K/2]``, as :func:`quantize_nvfp4` returns it.
        scales: float8_e4m3fn ``[..., K/16]``, on packed's device (no broadcasting).
        global_scale: the tensor scale, a number or one-element tensor, as for
            :func:`quantize_nvfp4` (read on the host).

    Returns:
        fp32 ``[..., K]``.

    Raises:
        TypeError: ``packed`` or ``scales`` not a tensor of its dtype; ``global_scale`` neither
            a real number nor a real tensor.
        ValueError: a ``packed`` whose last dimension is not a multiple of 8, ``scales`` of
            another shape or device, a ``global_scale`` of more than one number or outside
            ``[2^-126, FLT_MAX/2688]``.

    Examples:
        >>> import torch
        >>> from lowbit_attn import fp4
        >>> # values E2M1 holds exactly
        >>> x = torch.tensor([[0.5, -1.0, 3.0, 6.0] * 4])
        >>> torch.equal(fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(x)), x)
        True
    """
    fp4_operands(packed, scales, NVFP4_GROUP, torch.float8_e4m3fn)
    g = nvfp4_tensor_scale(global_scale, packed.device)
    return dequantize_groups(packed, scales.float() * g, NVFP4_GROUP)


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """E8M0 bits (uint8) → fp32 ``2^(code - 127)``; 255 → NaN. Built from bits: exact, 2^-127 too."""
    c = code.to(torch.int32)
    bits = torch.where(c >= 1, c << 23, torch.full_like(c, 0x400000))
    v = bits.view(torch.float32)
    return torch.where(c == E8M0_NAN, torch.full_like(v, float("nan")), v)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (OCP MX): E2M1 values in groups of 32 along the last dimension, E8M0 scales.

    Args:
        x: ``[..., K]`` any float dtype, ``K`` a multiple of 32.
    Returns:
        ``(packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32])`` (127 = 2^0, 255 = NaN).
    """
    quant_groups(x, MXFP4_GROUP)
    codes, code = mxfp4_group_codes(_grouped(x, MXFP4_GROUP))
    return pack_fp4(codes.flatten(-2)), code


def mxfp4_scale_code(amax: torch.Tensor) -> torch.Tensor:
    """Group amax (fp32, ≥ 0 or NaN) → E8M0 bits (uint8): ``floor(log2 amax) - 2 + 127`` clamped
    to ``[0, 254]``, NaN → 255."""
    # floor(log2(amax)) is the exponent field - 127 (subnormal and zero amax clamp to -127 anyway)
    exp_field = (amax.view(torch.int32) >> 23) & 0xFF
    shared = torch.clamp(exp_field - 127 - 2, -127, 127)
    code = torch.where(torch.isnan(amax), torch.full_like(shared, E8M0_NAN), shared + 127)
    return code.to(torch.uint8)


def mxfp4_group_codes(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 core: fp32 groups ``[..., n_groups, 32]`` → ``(E2M1 codes, E8M0 scale bits)``."""
    code = mxfp4_scale_code(xg.abs().amax(dim=-1) + nonfinite_guard(xg, -1))
    return e2m1_code(xg / e8m0_value(code).unsqueeze(-1)), code


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 back to fp32: ``value · 2^e``. A group with scale code 255 is all NaN.

    Args:
        packed: uint8 ``[..., K/2]``, as :func:`quantize_mxfp4` returns it.
        scales: the E8M0 scale bits, uint8 ``[..., K/32]``, on packed's device (no broadcasting).

    Returns:
        fp32 ``[..., K]``.

    Raises:
        TypeError: ``packed`` or ``scales`` is not a uint8 tensor.
        ValueError: a ``packed`` whose last dimension is not a multiple of 16, or ``scales`` of
            another shape or device.

    Examples:
        >>> import torch
        >>> from lowbit_attn import fp4
        >>> x = torch.linspace(-6, 6, 32).reshape(1, 32)
        >>> # the nearest of E2M1's 15 values
        >>> y = fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(x))
        >>> y.shape, sorted(set(y.abs().flatten().tolist()))
        (torch.Size([1, 32]), [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    """
    fp4_operands(packed, scales, MXFP4_GROUP, torch.uint8)
    return dequantize_groups(packed, e8m0_value(scales), MXFP4_GROUP)


__all__ = [
    "E2M1_VALUES", "e2m1_code", "e2m1_value", "e2m1_round", "pack_fp4", "unpack_fp4",
    "finite_amax", "nvfp4_global_scale", "global_scale_from_amax", "nvfp4_tensor_scale",
    "nvfp4_quant_scale", "nvfp4_group_codes",
    "quantize_nvfp4", "fp4_operands", "dequantize_groups", "dequantize_nvfp4", "e8m0_value",
    "mxfp4_scale_code", "mxfp4_group_codes", "quantize_mxfp4", "dequantize_mxfp4",
]

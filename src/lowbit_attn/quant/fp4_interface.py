"""FP4 microscaling quantizers for users, public as ``lowbit_attn.fp4``: NVFP4 and MXFP4, on the
backend of the tensor's device (Triton on a GPU, the PyTorch twin on a CPU; bit-identical).
Numerics and edge cases: :mod:`lowbit_attn.quant.fp4_naive`.

    packed, scales, g = lowbit_attn.fp4.quantize_nvfp4(x)        # x [..., K], K % 16 == 0
    x_hat = lowbit_attn.fp4.dequantize_nvfp4(packed, scales, g)
"""

from __future__ import annotations

import torch

from lowbit_attn.core.arch import backend_for
from lowbit_attn.quant import fp4_naive as _ref
from lowbit_attn.quant.fp4_naive import dequantize_mxfp4, dequantize_nvfp4


def _impl(x: torch.Tensor):
    if isinstance(x, torch.Tensor) and backend_for(x.device) == "triton":
        from lowbit_attn.quant import fp4

        return fp4
    return _ref


def quantize_nvfp4(
    x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 values in groups of 16 along the last dimension, one E4M3 scale per group and
    one fp32 tensor scale; Triton on a GPU, the bit-identical PyTorch twin on a CPU.

    Args:
        x: ``[..., K]``, any floating dtype (read as fp32: a float64 value past fp32's range
            counts as Inf), ``K`` a multiple of 16 (an empty tensor gives empty outputs). NaN or
            Inf marks its own group (NaN scale), not the whole tensor.
        global_scale: the tensor scale ``g``: ``None`` for ``amax/(448·6)`` (amax over the finite
            elements), or a number or one-element tensor whose fp32 value lies in
            ``[2^-126, FLT_MAX/2688]`` and from that default up to 448/2^-9 = 229376 times it, so
            that every group scale fits E4M3 without saturating or flushing to zero. Read on the
            host (a GPU synchronisation).

    Returns:
        ``(packed, scales, global_scale)``: uint8 ``[..., K/2]`` (two values a byte, low nibble
            first), float8_e4m3fn ``[..., K/16]``, and the fp32 0-dim tensor scale.

    Raises:
        TypeError: ``x`` is not a floating-point tensor; ``global_scale`` is neither a real
            number nor a real tensor.
        ValueError: ``x`` is 0-dim or its last dimension is not a multiple of 16;
            ``global_scale`` holds more than one number or lies outside the range above.

    Examples:
        >>> import torch
        >>> from lowbit_attn import fp4
        >>> x = torch.randn(4, 32)
        >>> # two E2M1 values a byte, groups of 16
        >>> packed, scales, global_scale = fp4.quantize_nvfp4(x)
        >>> packed.shape, scales.shape
        (torch.Size([4, 16]), torch.Size([4, 2]))
        >>> # an error of at most half a step of E2M1's top binade (amax/6 a group), plus E4M3's
        >>> # rounding of each group scale
        >>> err = (fp4.dequantize_nvfp4(packed, scales, global_scale) - x).abs()
        >>> bool((err <= 1.07 * x.abs().amax() / 6).all())
        True
    """
    return _impl(x).quantize_nvfp4(x, global_scale=global_scale)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (OCP MX): E2M1 values in groups of 32 along the last dimension, one E8M0
    (power-of-two) scale per group; Triton on a GPU, the bit-identical PyTorch twin on a CPU.

    Args:
        x: ``[..., K]``, any floating dtype (read as fp32: a float64 value past fp32's range
            counts as Inf), ``K`` a multiple of 32. NaN or Inf marks its own group (NaN scale).

    Returns:
        ``(packed, scales)``: uint8 ``[..., K/2]`` (two values a byte, low nibble first) and the
            E8M0 scale bits, uint8 ``[..., K/32]`` (127 is 2^0, 255 NaN).

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: ``x`` is 0-dim or its last dimension is not a multiple of 32.

    Examples:
        >>> import torch
        >>> from lowbit_attn import fp4
        >>> x = torch.randn(4, 32)
        >>> # groups of 32, power-of-two scales
        >>> packed, scales = fp4.quantize_mxfp4(x)
        >>> packed.shape, scales.shape
        (torch.Size([4, 16]), torch.Size([4, 1]))
        >>> fp4.dequantize_mxfp4(packed, scales).shape
        torch.Size([4, 32])
    """
    return _impl(x).quantize_mxfp4(x)


__all__ = ["quantize_nvfp4", "dequantize_nvfp4", "quantize_mxfp4", "dequantize_mxfp4"]

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
    """NVFP4: ``(packed uint8 [..., K/2], E4M3 scales [..., K/16], fp32 tensor scale)``; two values a
    byte, low nibble first. ``global_scale`` defaults to ``amax/(448·6)``; a caller's (a number or
    one-element tensor) must be from that default to 448/2^-9 = 229376 times it, so that every group
    scale fits E4M3 without saturating, and is read on the host."""
    return _impl(x).quantize_nvfp4(x, global_scale=global_scale)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (OCP MX): ``(packed uint8 [..., K/2], E8M0 scale bits uint8 [..., K/32])``."""
    return _impl(x).quantize_mxfp4(x)


__all__ = ["quantize_nvfp4", "dequantize_nvfp4", "quantize_mxfp4", "dequantize_mxfp4"]

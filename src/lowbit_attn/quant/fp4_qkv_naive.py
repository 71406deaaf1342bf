"""PyTorch twins of the FP4 attention quantizers: Q, K and V operands, and P̃ inside the attention.
Twins: ``lowbit_attn.quant.fp4_qkv`` (operands, bit for bit given the same statistics) and
the P̃ quantization in ``lowbit_attn.inference.kernel_fp4``.

The group numerics are those of :mod:`lowbit_attn.quant.fp4_naive` (NVFP4: E4M3 group scales under
one fp32 tensor scale, here one per (batch, head); MXFP4: E8M0 group scales). Q and K are grouped
along channels, V along tokens, P̃ along keys.
"""

from __future__ import annotations

import math

import torch

from lowbit_attn.core.checks import fp4_amax
from lowbit_attn.core.operands import FP4_GROUP, P_TWO_LEVEL_PEAK, padded_head_dim
from lowbit_attn.quant.fp4_naive import (
    dequantize_groups, e2m1_code, e2m1_value, e4m3_scale_code, e8m0_value, global_scale_from_amax,
    mxfp4_group_codes, mxfp4_scale_code, nvfp4_group_codes, pack_fp4,
)
from lowbit_attn.quant.int8_naive import div_rn, expand_blocks


def head_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 tensor scale per (batch, head) from per-channel amax ``[B, H, D]`` → ``[B, H]`` fp32."""
    return global_scale_from_amax(amax.amax(dim=-1))


def _quantize_rows(y: torch.Tensor, fmt: str, amax: torch.Tensor | None):
    """Padded fp32 ``[B, H, R, C]`` grouped along C → ``(packed [B, H, R, C/2], scale bits
    [B, H, R, C/group], NVFP4 tensor scale [B, H] from ``amax`` or None)``, contiguous."""
    fp4_amax(fmt, amax)
    b, h, r, c = y.shape
    group = FP4_GROUP[fmt]
    yg = y.reshape(b, h, r, c // group, group)
    if fmt == "nvfp4":
        g = head_global_scale(amax)
        codes, scale = nvfp4_group_codes(yg, g[:, :, None, None])
    else:
        g = None
        codes, scale = mxfp4_group_codes(yg)
    return pack_fp4(codes.flatten(-2)).contiguous(), scale.contiguous(), g


def quantize_qk_fp4(
    x: torch.Tensor,
    fmt: str,
    *,
    center: torch.Tensor | None = None,
    center_per_block: bool = False,
    block: int = 0,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q or K → FP4 grouped along channels.

    Args:
        x: ``[B, H, N, D]``.
        fmt: ``"nvfp4"`` or ``"mxfp4"``.
        center: ``[B, H, D]`` (one per head) or ``[B, H, nb, D]`` with ``center_per_block`` (one per
            ``block`` tokens), subtracted first.
        amax: per-channel ``max |x - center|`` ``[B, H, D]`` (NVFP4's tensor scale comes from it).
    Returns:
        ``(packed uint8 [B, H, N, dp/2], scale bits uint8 [B, H, N, dp/group], tensor scale
        fp32 [B, H] or None)``.
    """
    b, h, n, d = x.shape
    y = x.float()
    if center is not None:
        y = y - (expand_blocks(center, block, n) if center_per_block else center.unsqueeze(-2))
    return _quantize_rows(torch.nn.functional.pad(y, (0, padded_head_dim(d) - d)), fmt, amax)


def quantize_v_fp4(
    v: torch.Tensor,
    fmt: str,
    *,
    block_k: int,
    center: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """V → FP4 grouped along tokens, stored transposed.

    Args:
        v: ``[B, H, N, D]``; center: ``[B, H, D]`` (V smoothing); amax: ``[B, H, D]``.
    Returns:
        ``(packed uint8 [B, H, dp, N_pad/2], scale bits [B, H, dp, N_pad/group], tensor scale
        [B, H] or None)`` with ``N_pad`` the tokens rounded up to whole key blocks of ``block_k``.
    """
    b, h, n, d = v.shape
    y = v.float()
    if center is not None:
        y = y - center.unsqueeze(-2)
    n_pad = -(-n // block_k) * block_k
    yt = torch.nn.functional.pad(y, (0, padded_head_dim(d) - d, 0, n_pad - n)).transpose(-1, -2)
    return _quantize_rows(yt, fmt, amax)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored FP4 operand → fp32 ``value·group scale`` (without NVFP4's tensor scale): exactly what
    the block-scaled MMA multiplies."""
    if fmt == "nvfp4":
        factor = scale.view(torch.float8_e4m3fn).float()
    else:
        factor = e8m0_value(scale)
    return dequantize_groups(packed, factor, FP4_GROUP[fmt])


def quantize_p(p: torch.Tensor, fmt: str) -> torch.Tensor:
    """P̃ ``[..., n]`` (n a multiple of the group) → its FP4 value in fp32 (codes times group
    scales), groups of keys along the last dimension, no tensor scale.

    Values are divided by multiplying with the scale's reciprocal (``x·(1/s)``, as the kernel
    does: one division per group instead of one per element).
    """
    group = FP4_GROUP[fmt]
    pg = p.reshape(*p.shape[:-1], p.shape[-1] // group, group)
    amax = pg.amax(dim=-1) + (pg * 0.0).sum(dim=-1)
    if fmt == "nvfp4":
        code = e4m3_scale_code(div_rn(amax, 6.0), amax > 0)
        s = code.view(torch.float8_e4m3fn).float()
        denom = torch.where(code == 0, torch.ones_like(s), s)
    else:
        denom = e8m0_value(mxfp4_scale_code(amax))
    values = e2m1_value(e2m1_code(pg * (1.0 / denom).unsqueeze(-1)))
    return (values * denom.unsqueeze(-1)).flatten(-2)


def two_level_p(s: torch.Tensor, block_max: torch.Tensor, m_safe: torch.Tensor, fmt: str):
    """SageAttention3's first level for one key block: ``(P̃ rows peaking at the format's target,
    the factor s1 that undoes it after P·V)``.

    ``P̃ = exp2(s - max_block + log2 peak)`` and ``s1 = exp2(max_block - m)/peak``; a row with no
    visible key in the block gets ``P̃ = 0`` and ``s1 = 0`` (never ``0·inf``).
    """
    peak = P_TWO_LEVEL_PEAK[fmt]
    b_safe = torch.where(torch.isneginf(block_max), 0.0, block_max)
    p = torch.exp2(s - (b_safe - math.log2(peak)).unsqueeze(-1))
    s1 = torch.exp2(block_max - m_safe) * (1.0 / peak)
    return p, torch.where(torch.isneginf(block_max), torch.zeros_like(s1), s1)

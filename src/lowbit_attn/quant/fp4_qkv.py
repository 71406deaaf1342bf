"""Triton kernels that quantize the FP4 attention operands: Q and K grouped along channels, V
grouped along tokens (stored transposed), smoothing fused in, NVFP4's per-(batch, head) tensor scale
computed in-kernel from the channel statistics. Twins: ``lowbit_attn.quant.fp4_qkv_naive``
(bit-identical given the same statistics). Dense ``[B, H, N, D]`` inputs, any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core.checks import fp4_amax
from lowbit_attn.core.operands import FP4_GROUP, padded_head_dim
from lowbit_attn.core.triton_helpers import batch_head, strides
from lowbit_attn.quant.fp4 import nvfp4_global_from_amax, quantize_groups
from lowbit_attn.quant.int8 import center_strides
from lowbit_attn.quant.tile import load_centered


@triton.jit
def _tensor_scale(AMAX, G, b, h, amax_strides, g_strides, D, write, BLOCK_D: tl.constexpr):
    """NVFP4 tensor scale of one (batch, head) from its per-channel amax; stored when ``write``.
    Strides: (batch, head) of ``AMAX`` (``[B, H, D]``, channels contiguous) and of ``G``."""
    sab, sah = amax_strides
    sgb, sgh = g_strides
    offs_d = tl.arange(0, BLOCK_D)
    a = tl.load(AMAX + b * sab + h * sah + offs_d, mask=offs_d < D, other=0.0)
    g = nvfp4_global_from_amax(tl.max(a, axis=0) + tl.sum(a * 0.0, axis=0))
    if write:
        tl.store(G + b * sgb + h * sgh, g)
    return g


@triton.jit
def _quantize_fp4_kernel(
    X, OUT, SCALE, G, CENTER_PTR, AMAX,
    x_strides, out_strides, scale_strides, c_strides, amax_strides, g_strides,
    N, H, D,
    NV: tl.constexpr, CENTER: tl.constexpr, TRANSPOSED: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One tile of ``BLOCK_N`` tokens × all channels. Q and K (``TRANSPOSED`` off): groups along
    channels, rows = tokens. V (``TRANSPOSED``): groups along tokens, rows = channels, the token
    dimension padded with zeros to whole tiles. Strides: (batch, head, token, dim) of ``X``;
    (batch, head, row) of ``OUT`` and ``SCALE`` (bytes and scale codes contiguous along a row);
    (batch, head, block, dim) of ``CENTER_PTR``; (batch, head) of ``AMAX`` and ``G``."""
    sob, soh, sor = out_strides
    ssb, ssh, ssr = scale_strides
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = batch_head(pid_bh, H)
    x, rows, _, _ = load_centered(
        X, CENTER_PTR, b, h, b * 0, pid_n, N, x_strides, c_strides, D, CENTER, BLOCK_N, BLOCK_D,
    )
    g = 1.0
    if NV:
        g = _tensor_scale(AMAX, G, b, h, amax_strides, g_strides, D, pid_n == 0, BLOCK_D)
    if TRANSPOSED:
        packed, code = quantize_groups(tl.trans(x), g, BLOCK_D, BLOCK_N, GROUP, NV)
        offs_d = tl.arange(0, BLOCK_D)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(OUT + b * sob + h * soh + offs_d[:, None] * sor + cols[None, :], packed)
        grp = pid_n * (BLOCK_N // GROUP) + tl.arange(0, BLOCK_N // GROUP)
        tl.store(SCALE + b * ssb + h * ssh + offs_d[:, None] * ssr + grp[None, :], code)
    else:
        packed, code = quantize_groups(x, g, BLOCK_N, BLOCK_D, GROUP, NV)
        rmask = (rows < N)[:, None]
        cols = tl.arange(0, BLOCK_D // 2)
        tl.store(OUT + b * sob + h * soh + rows[:, None] * sor + cols[None, :], packed,
                 mask=rmask)
        grp = tl.arange(0, BLOCK_D // GROUP)
        tl.store(SCALE + b * ssb + h * ssh + rows[:, None] * ssr + grp[None, :], code,
                 mask=rmask)


def _launch(x, fmt, *, transposed, block_n, center, center_strides, center_mode, amax):
    fp4_amax(fmt, amax)
    b, h, n, d = x.shape
    dp = padded_head_dim(d)
    group = FP4_GROUP[fmt]
    n_pad = triton.cdiv(n, block_n) * block_n
    rows, cols = (dp, n_pad) if transposed else (n, dp)
    packed = torch.empty((b, h, rows, cols // 2), device=x.device, dtype=torch.uint8)
    scale = torch.empty((b, h, rows, cols // group), device=x.device, dtype=torch.uint8)
    g = torch.empty((b, h), device=x.device, dtype=torch.float32) if fmt == "nvfp4" else None
    _quantize_fp4_kernel[(n_pad // block_n, b * h)](
        X=x, OUT=packed, SCALE=scale, G=g, CENTER_PTR=center,
        AMAX=amax if g is not None else None,  # the amax and tensor scales: NVFP4 only
        x_strides=x.stride(), out_strides=packed.stride()[:3], scale_strides=scale.stride()[:3],
        c_strides=center_strides,
        amax_strides=(0, 0) if g is None else amax.stride()[:2], g_strides=strides(g, 2),
        N=n, H=h, D=d, NV=fmt == "nvfp4", CENTER=center_mode, TRANSPOSED=transposed, GROUP=group,
        BLOCK_N=block_n, BLOCK_D=dp, num_warps=8 if block_n * dp >= 8192 else 4,
    )
    return packed, scale, g


def quantize_qk_fp4(
    x: torch.Tensor,
    fmt: str,
    *,
    center: torch.Tensor | None = None,
    center_per_block: bool = False,
    block: int = 0,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of :func:`lowbit_attn.quant.fp4_qkv_naive.quantize_qk_fp4` (bit-identical)."""
    # Q's centers are per query block: the tile is that block; K's are per head: any tile works
    per_block = center_per_block and center is not None
    return _launch(
        x, fmt, transposed=False, block_n=block if per_block else 64, center=center,
        center_strides=center_strides(center, center_per_block),
        center_mode=0 if center is None else (2 if center_per_block else 1), amax=amax,
    )


def quantize_v_fp4(
    v: torch.Tensor,
    fmt: str,
    *,
    block_k: int,
    center: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of :func:`lowbit_attn.quant.fp4_qkv_naive.quantize_v_fp4` (bit-identical)."""
    return _launch(
        v, fmt, transposed=True, block_n=block_k, center=center,
        center_strides=center_strides(center, False), center_mode=0 if center is None else 1,
        amax=amax,
    )

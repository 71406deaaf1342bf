"""Tokens ↔ padded tiles for video sparse attention, with the tile means fused in.

``tile``: one program per (tile, batch·head) reads the tile's tokens once (by index, from any
``[B, H, N, D]`` strides) and writes them as a padded tile (zeros in the empty slots) and/or their
mean in fp32. ``untile`` is its adjoint: each token gets its tile slot's value plus its tile's
pooled value divided by the tile's count. Every token sits in exactly one slot, so neither needs
atomics, and each is the other's backward. Twins: ``lowbit_attn.vsa.naive.gather_tiles``,
``pool_tiles``, ``scatter_tiles``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core.triton_helpers import batch_head, next_pow2, strides


@triton.jit
def _program_tile(INDEX, H, D, TT, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's tile, (batch, head), slot and channel offsets, the tokens of its slots (−1:
    empty) and the mask of its valid elements."""
    t = tl.program_id(0)
    b, h = batch_head(tl.program_id(1), H)
    offs_s = tl.arange(0, SLOTS)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    tok = tl.load(INDEX + t * TT + offs_s, mask=offs_s < TT, other=-1)
    return t, b, h, offs_s, offs_d, dmask, tok, (tok >= 0)[:, None] & dmask[None, :]


@triton.jit
def _tile_kernel(
    X, INDEX, CNT, TILES, POOL, x_strides, tiles_strides, pool_strides, H, D, TT,
    SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_TILES: tl.constexpr,
    WRITE_POOL: tl.constexpr,
):
    """Strides: (batch, head, token, dim) of ``X``; (batch, head, tile, slot, dim) of ``TILES``;
    (batch, head, tile, dim) of ``POOL``."""
    sxb, sxh, sxn, sxd = x_strides
    stb, sth, stt, sts, std = tiles_strides
    spb, sph, spt, spd = pool_strides
    t, b, h, offs_s, offs_d, dmask, tok, rows = _program_tile(INDEX, H, D, TT, SLOTS, BLOCK_D)
    x = tl.load(X + b * sxb + h * sxh + tok.to(tl.int64)[:, None] * sxn + offs_d[None, :] * sxd,
                mask=rows, other=0.0)
    if WRITE_TILES:
        tl.store(TILES + b * stb + h * sth + t.to(tl.int64) * stt + offs_s[:, None] * sts
                 + offs_d[None, :] * std, x, mask=dmask[None, :])
    if WRITE_POOL:
        mean = tl.sum(x.to(tl.float32), axis=0) / tl.load(CNT + t).to(tl.float32)
        tl.store(POOL + b * spb + h * sph + t.to(tl.int64) * spt + offs_d * spd, mean, mask=dmask)


@triton.jit
def _untile_kernel(
    TILES, POOL, INDEX, CNT, X, tiles_strides, pool_strides, x_strides, H, D, TT,
    SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TILES: tl.constexpr, HAS_POOL: tl.constexpr,
):
    """Strides as in :func:`_tile_kernel`."""
    stb, sth, stt, sts, std = tiles_strides
    spb, sph, spt, spd = pool_strides
    sxb, sxh, sxn, sxd = x_strides
    t, b, h, offs_s, offs_d, dmask, tok, rows = _program_tile(INDEX, H, D, TT, SLOTS, BLOCK_D)
    x = tl.zeros([SLOTS, BLOCK_D], dtype=tl.float32)
    if HAS_TILES:
        x += tl.load(TILES + b * stb + h * sth + t.to(tl.int64) * stt + offs_s[:, None] * sts
                     + offs_d[None, :] * std, mask=rows, other=0.0).to(tl.float32)
    if HAS_POOL:
        p = tl.load(POOL + b * spb + h * sph + t.to(tl.int64) * spt + offs_d * spd, mask=dmask,
                    other=0.0).to(tl.float32)
        x += (p / tl.load(CNT + t).to(tl.float32))[None, :]
    tl.store(X + b * sxb + h * sxh + tok.to(tl.int64)[:, None] * sxn + offs_d[None, :] * sxd,
             x.to(X.dtype.element_ty), mask=rows)


def _slots(index: torch.Tensor, slots: int) -> int:
    return max(slots, next_pow2(index.shape[1], minimum=1))


def tile(x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, *, slots: int,
         pool: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``x [B, H, N, D]`` (any strides), ``index [n_tiles, tile_tokens]`` int64 (−1: empty slot),
    ``counts [n_tiles]`` → ``(tiles [B, H, n_tiles, slots, D]`` in x's dtype (``None`` when
    ``slots`` is 0), ``pooled [B, H, n_tiles, D]`` fp32 tile means (``None`` unless ``pool``))."""
    b, h, _, d = x.shape
    nt, tt = index.shape
    if slots and (slots < tt or slots & (slots - 1)):
        raise ValueError(f"slots must be 0 or a power of two >= {tt}, got {slots}")
    tiles = torch.empty((b, h, nt, slots, d), device=x.device, dtype=x.dtype) if slots else None
    pooled = torch.empty((b, h, nt, d), device=x.device, dtype=torch.float32) if pool else None
    _tile_kernel[(nt, b * h)](
        X=x, INDEX=index, CNT=counts, TILES=tiles, POOL=pooled, x_strides=x.stride(),
        tiles_strides=strides(tiles, 5), pool_strides=strides(pooled, 4), H=h, D=d, TT=tt,
        SLOTS=_slots(index, slots), BLOCK_D=next_pow2(d), WRITE_TILES=tiles is not None,
        WRITE_POOL=pool, num_warps=4,
    )
    return tiles, pooled


def untile(tiles: torch.Tensor | None, pooled: torch.Tensor | None, index: torch.Tensor,
           counts: torch.Tensor, *, n_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The adjoint of :func:`tile`: ``x [B, H, N, D]`` in ``dtype`` with each token's slot of
    ``tiles`` plus its tile's ``pooled / count`` (either may be ``None``)."""
    like = tiles if tiles is not None else pooled
    b, h, d = like.shape[0], like.shape[1], like.shape[-1]
    nt, tt = index.shape
    x = torch.empty((b, h, n_tokens, d), device=like.device, dtype=dtype)
    _untile_kernel[(nt, b * h)](
        TILES=tiles, POOL=pooled, INDEX=index, CNT=counts, X=x, tiles_strides=strides(tiles, 5),
        pool_strides=strides(pooled, 4), x_strides=x.stride(), H=h, D=d, TT=tt,
        SLOTS=next_pow2(tt, minimum=1), BLOCK_D=next_pow2(d), HAS_TILES=tiles is not None,
        HAS_POOL=pooled is not None, num_warps=4,
    )
    return x

"""Video sparse attention (VSA) in plain PyTorch: the coarse stage over mean-pooled tiles, the fine
stage over the tokens of selected key tiles, and the dense masked attention both must equal. All
differentiable by autograd (the top-k choice itself is not).

Tensors are HND ``[B, H, N, D]`` with tokens in row-major ``(T, H, W)`` order; a
:class:`~lowbit_attn.tiles.TileLayout` says which tokens make each tile.
"""

from __future__ import annotations

import torch

from ..tiles import TileLayout
from .attention import _expand_heads


def gather_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """``[B, H, N, D]`` → ``[B, H, n_tiles, tile_tokens, D]``, zeros in the slots of partial tiles."""
    valid = (layout.index >= 0).unsqueeze(-1)
    tiles = x[:, :, layout.index.clamp(min=0)]
    return torch.where(valid, tiles, torch.zeros((), dtype=x.dtype, device=x.device))


def scatter_tiles(tiles: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`gather_tiles`: ``[B, H, n_tiles, tile_tokens, D]`` → ``[B, H, N, D]``."""
    b, h, _, _, d = tiles.shape
    valid = layout.index >= 0
    return tiles[:, :, valid][:, :, layout.inverse]


def pool_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Mean of each tile's tokens (partial tiles: of the tokens they have): ``[B, H, n_tiles, D]``."""
    sums = gather_tiles(x, layout).sum(dim=3)
    return sums / layout.counts.to(x.dtype).unsqueeze(-1)


def coarse(q, k, v, layout: TileLayout, *, scale: float, topk: int):
    """Dense attention between pooled tiles.

    Returns:
        ``(out [B, Hq, N, D]`` (each token gets its query tile's coarse output),
        ``tile_indices [B, Hq, n_tiles, topk]`` int64 (the highest-scoring key tiles per query tile,
        in increasing order), ``scores [B, Hq, n_tiles, n_tiles]`` (pooled Q·Kᵀ·scale))``.
    """
    hq = q.shape[1]
    qp = pool_tiles(q, layout)
    kp = _expand_heads(pool_tiles(k, layout), hq)
    vp = _expand_heads(pool_tiles(v, layout), hq)
    scores = torch.matmul(qp, kp.transpose(-1, -2)) * scale
    out_tiles = torch.matmul(torch.softmax(scores, dim=-1), vp)
    out = out_tiles[:, :, layout.tile_of]
    with torch.no_grad():
        indices = scores.topk(topk, dim=-1).indices.sort(dim=-1).values
    return out, indices, scores


def fine(q, k, v, layout: TileLayout, tile_indices: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Exact attention of each query tile over the tokens of its key tiles ``tile_indices``
    (``[B, Hq, n_tiles, k]`` int64, distinct per row), gathered tile by tile as the kernels do.
    Returns ``[B, Hq, N, D]``."""
    b, hq, _, d = q.shape
    nt, ts = layout.n_tiles, layout.tile_tokens
    kk = tile_indices.shape[-1]
    qt = gather_tiles(q, layout)                                   # [B, Hq, nt, ts, D]
    kt = _expand_heads(gather_tiles(k, layout), hq)                # [B, Hq, nt, ts, D]
    vt = _expand_heads(gather_tiles(v, layout), hq)
    sel = tile_indices.reshape(b, hq, nt * kk)
    gather = lambda t: torch.gather(  # noqa: E731 - [B, Hq, nt, kk·ts, D]
        t, 2, sel[..., None, None].expand(b, hq, nt * kk, ts, d)
    ).reshape(b, hq, nt, kk * ts, d)
    ks, vs = gather(kt), gather(vt)
    key_valid = (layout.index >= 0)[tile_indices].reshape(b, hq, nt, 1, kk * ts)
    s = torch.matmul(qt, ks.transpose(-1, -2)) * scale            # [B, Hq, nt, ts, kk·ts]
    s = s.masked_fill(~key_valid, float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), vs)
    return scatter_tiles(out, layout)


def block_mask(layout: TileLayout, tile_indices: torch.Tensor) -> torch.Tensor:
    """Token-level mask ``[B, Hq, N, N]`` (query, key) of a tile selection."""
    b, hq, nt, _ = tile_indices.shape
    tiles = torch.zeros(b, hq, nt, nt, dtype=torch.bool, device=tile_indices.device)
    tiles.scatter_(-1, tile_indices, True)
    t = layout.tile_of
    return tiles[:, :, t][:, :, :, t]


def masked_attention(q, k, v, mask: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Dense attention with a boolean ``[B, Hq, N, N]`` mask (the oracle of the fine stage)."""
    hq = q.shape[1]
    s = torch.matmul(q, _expand_heads(k, hq).transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(p, _expand_heads(v, hq))

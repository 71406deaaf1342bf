"""Token order of a video's ``(T, H, W)`` grid and its tiles: which tokens make each tile, and the
permutation between row-major order (how video DiTs lay tokens out) and tile-contiguous order
(what block-sparse kernels read).

A tile is ``(tt, th, tw)`` consecutive positions along T, H, W. Tiles at the far edges hold fewer
tokens when a dimension is not a multiple of the tile; tiles are numbered row-major over the tile
grid, and tokens inside a tile row-major too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from lowbit_attn.core.arch import traceable

MAX_TILE_TOKENS = 256


@dataclass(frozen=True)
class TileLayout:
    """Where each tile's tokens are.

    Attributes:
        video_shape: ``(T, H, W)``; tile: ``(tt, th, tw)``.
        grid: tiles along T, H, W.
        index: ``[n_tiles, tile_tokens]`` int64: the row-major token index of each token of each
            tile, its ``counts[t]`` tokens first, then ``-1`` for the slots a partial edge tile
            lacks.
        counts: ``[n_tiles]`` int64: tokens in each tile.
        perm: ``[N]`` int64: row-major token index of each position in tile order (``x[perm]`` is
            tile-contiguous); ``inverse`` undoes it.
        tile_of: ``[N]`` int64: the tile of each row-major token.
    """

    video_shape: tuple[int, int, int]
    tile: tuple[int, int, int]
    grid: tuple[int, int, int]
    index: torch.Tensor
    counts: torch.Tensor
    perm: torch.Tensor
    inverse: torch.Tensor
    tile_of: torch.Tensor

    @property
    def n_tiles(self) -> int:
        return self.index.shape[0]

    @property
    def tile_tokens(self) -> int:
        return self.index.shape[1]

    @property
    def n_tokens(self) -> int:
        return math.prod(self.video_shape)

    def to(self, device) -> TileLayout:
        return _layout_on(self.video_shape, self.tile, str(torch.device(device)))


def check_video(video_shape, tile, n_tokens: int | None = None) -> tuple[tuple, tuple]:
    """Validate ``video_shape`` and ``tile`` (and that the grid holds ``n_tokens``); ints tuples."""
    shapes = {}
    for name, value in (("video_shape", video_shape), ("tile", tile)):
        if (not isinstance(value, (tuple, list)) or len(value) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) for x in value)):
            raise TypeError(f"{name} must be a tuple of three ints (T, H, W), got {value!r}")
        if any(x < 1 for x in value):
            raise ValueError(f"{name} must hold positive sizes, got {tuple(value)}")
        shapes[name] = tuple(int(x) for x in value)
    if math.prod(shapes["tile"]) > MAX_TILE_TOKENS:
        raise ValueError(
            f"tile {shapes['tile']} holds {math.prod(shapes['tile'])} tokens; at most "
            f"{MAX_TILE_TOKENS} fit a kernel tile (the default (4, 4, 4) holds 64)"
        )
    if n_tokens is not None and math.prod(shapes["video_shape"]) != n_tokens:
        raise ValueError(
            f"video_shape {shapes['video_shape']} holds {math.prod(shapes['video_shape'])} tokens "
            f"but the sequence has {n_tokens}"
        )
    return shapes["video_shape"], shapes["tile"]


def tile_layout(video_shape, tile=(4, 4, 4), device="cpu") -> TileLayout:
    """The :class:`TileLayout` of a ``(T, H, W)`` grid cut into ``tile``-sized tiles (cached)."""
    video_shape, tile = check_video(video_shape, tile)
    return traceable(_layout_on)(video_shape, tile, str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _layout_on(video_shape, tile, device: str) -> TileLayout:
    dims = video_shape
    grid = tuple(-(-n // t) for n, t in zip(dims, tile))
    # coordinates of every slot of every tile, [n_tiles, tile_tokens, 3]
    tiles = torch.cartesian_prod(*(torch.arange(g) for g in grid)).reshape(-1, 3)
    slots = torch.cartesian_prod(*(torch.arange(t) for t in tile)).reshape(-1, 3)
    coords = tiles[:, None, :] * torch.tensor(tile) + slots[None, :, :]
    inside = (coords < torch.tensor(dims)).all(dim=-1)
    flat = (coords[..., 0] * dims[1] + coords[..., 1]) * dims[2] + coords[..., 2]
    # each tile's tokens first (row-major), then -1 for the slots a partial tile lacks
    first = torch.argsort((~inside).to(torch.int8), dim=1, stable=True)
    inside = torch.gather(inside, 1, first)
    index = torch.where(inside, torch.gather(flat, 1, first), torch.full_like(flat, -1))
    perm = index[inside]  # tile-major, row-major inside each tile
    inverse = torch.argsort(perm)
    tile_of = torch.arange(index.shape[0]).repeat_interleave(inside.sum(dim=1))[inverse]
    dev = torch.device(device)
    return TileLayout(
        video_shape=video_shape, tile=tile, grid=grid, index=index.to(dev),
        counts=inside.sum(dim=1).to(dev), perm=perm.to(dev), inverse=inverse.to(dev),
        tile_of=tile_of.to(dev),
    )


def to_tile_order(x: torch.Tensor, video_shape, tile=(4, 4, 4), *, dim: int = -2) -> torch.Tensor:
    """Reorder the token dimension ``dim`` of ``x`` from row-major ``(T, H, W)`` to tile-contiguous
    order (tile by tile, each tile's tokens row-major).

    Permute once outside the model when every attention layer of a video transformer uses the same
    grid and tile: tokens can stay in tile order through the MLPs and norms (they act per token),
    and only position embeddings (computed from coordinates, also permuted once) and the final
    unpatchify need the row-major order. Then pass ``token_order="tiled"`` to
    :func:`~lowbit_attn.video_sparse_attention`, which otherwise gathers and scatters every call.

    Args:
        x: any tensor whose dimension ``dim`` holds the ``T·H·W`` tokens.
        video_shape: ``(T, H, W)``, three positive ints.
        tile: ``(tt, th, tw)`` tokens per tile (at most 256 in all); edge tiles may be partial.
        dim: the token dimension (``-2`` for ``[B, H, N, D]``; ``1`` for ``[B, N, H, D]``).

    Returns:
        A new tensor, ``x`` with its tokens in tile order.

    Raises:
        TypeError: ``x`` not a tensor; ``video_shape`` or ``tile`` is not three ints.
        ValueError: ``video_shape`` or ``tile`` not positive, a tile of more than 256 tokens, or
            ``x`` without ``T·H·W`` tokens along ``dim``.
        IndexError: ``dim`` is not a dimension of ``x``.

    Examples:
        >>> import torch
        >>> from lowbit_attn import tiles
        >>> # [B, N, C]: token ids, video_shape (2, 4, 4)
        >>> x = torch.arange(32).reshape(1, 32, 1)
        >>> tiled = tiles.to_tile_order(x, (2, 4, 4), (2, 2, 2), dim=1)
        >>> # the first 2×2×2 tile's tokens, together
        >>> tiled[0, :8, 0].tolist()
        [0, 1, 4, 5, 16, 17, 20, 21]
    """
    return _reordered(x, video_shape, tile, dim, inverse=False)


def from_tile_order(x: torch.Tensor, video_shape, tile=(4, 4, 4), *, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`to_tile_order`: tile order back to row-major ``(T, H, W)``.

    Args:
        x: as for :func:`to_tile_order`, its tokens in tile order.
        video_shape: as for :func:`to_tile_order`.
        tile: likewise.
        dim: likewise.

    Returns:
        A new tensor, ``x`` with its tokens in row-major order.

    Raises:
        TypeError: as :func:`to_tile_order`.
        ValueError: likewise.
        IndexError: likewise.

    Examples:
        >>> import torch
        >>> from lowbit_attn import tiles
        >>> # [B, H, N, D], tokens in (t, h, w) order
        >>> x = torch.randn(1, 2, 4 * 8 * 8, 32)
        >>> # 4×4×4 tiles, as VSA's kernels read them
        >>> y = tiles.to_tile_order(x, (4, 8, 8))
        >>> torch.equal(tiles.from_tile_order(y, (4, 8, 8)), x)
        True
    """
    return _reordered(x, video_shape, tile, dim, inverse=True)


def _reordered(x, video_shape, tile, dim: int, *, inverse: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    layout = tile_layout(video_shape, tile, x.device)
    if x.shape[dim] != layout.n_tokens:
        raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim}; video_shape {video_shape} "
                         f"holds {layout.n_tokens}")
    return x.index_select(dim, layout.inverse if inverse else layout.perm)

"""FastVideo's ``video_sparse_attn`` (the VSA entry point of ``fastvideo_kernel`` / ``vsa``) with its
signature and its meaning, on :func:`lowbit_attn.video_sparse_attention`.

FastVideo's convention: q, k, v are ``[B, H, S, D]`` with the video's tokens already in tile order,
every tile padded to ``block_elements`` slots (its ``variable_block_sizes[t]`` tokens first, zeros
after). Without ``compress_attn_weight`` it returns ``O_coarse + O_fine``; with it,
``O_coarse * compress_attn_weight + O_fine``. (Ours, called directly with ``gate_coarse=None``,
returns ``O_fine`` alone: the two differ by the whole coarse branch.)
"""

from __future__ import annotations

import functools
import math

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.arch import traceable
from lowbit_attn.vsa import video_sparse_attention
from lowbit_attn.vsa.interface import check_gate
from lowbit_attn.vsa.tiles import MAX_TILE_TOKENS


def tile_shape(block_size) -> tuple[int, int, int]:
    """FastVideo's ``block_size`` as ``(tt, th, tw)``: a tuple of three ints as it is, an int as the
    tokens per tile, a cube (64 → ``(4, 4, 4)``)."""
    if isinstance(block_size, (tuple, list)) and len(block_size) == 3 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in block_size):
        if min(block_size) < 1:
            raise ValueError(f"block_size's three tile sides must be at least 1, got "
                             f"{tuple(block_size)}")
        tile = tuple(int(x) for x in block_size)
    elif isinstance(block_size, int) and not isinstance(block_size, bool):
        side = round(block_size ** (1 / 3)) if block_size > 0 else 0
        if side < 1 or side ** 3 != block_size:
            raise ValueError(f"block_size as an int is the tokens per tile, a cube (64 for 4x4x4 "
                             f"tiles), got {block_size}")
        tile = (side, side, side)
    else:
        raise TypeError(f"block_size must be an int (tokens per cubic tile) or a tuple of three "
                        f"ints, got {block_size!r}")
    if math.prod(tile) > MAX_TILE_TOKENS:
        raise ValueError(f"block_size {tile} holds {math.prod(tile)} tokens a tile; at most "
                         f"{MAX_TILE_TOKENS} fit a kernel tile")
    return tile


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=64)
def video_grid(counts: tuple[int, ...], tile: tuple[int, int, int]) -> tuple[int, int, int]:
    """A ``(T, H, W)`` grid whose ``tile``-sized tiles, row-major, hold ``counts`` tokens each
    (FastVideo's ``variable_block_sizes``: only the last tile along each dimension may be partial).
    Any such grid gives the same attention (each tile is the same set of tokens in tile order).

    Raises:
        ValueError: no grid gives these counts.
    """
    n, total = len(counts), sum(counts)
    for gt in _divisors(n):
        for gh in _divisors(n // gt):
            gw = n // (gt * gh)
            for rt in range(1, tile[0] + 1):
                for rh in range(1, tile[1] + 1):
                    for rw in range(1, tile[2] + 1):
                        dims = [(g - 1) * t + r for g, t, r in zip((gt, gh, gw), tile, (rt, rh, rw))]
                        if math.prod(dims) != total or rt * rh * rw != counts[-1]:
                            continue
                        sizes = [[t] * (g - 1) + [r] for g, t, r in zip((gt, gh, gw), tile,
                                                                        (rt, rh, rw))]
                        if counts == tuple(a * b * c for a in sizes[0] for b in sizes[1]
                                           for c in sizes[2]):
                            return tuple(dims)
    raise ValueError(
        f"variable_block_sizes must be the token counts of a (T, H, W) video cut into {tile} tiles "
        f"(row-major; only each dimension's last tile partial); no grid gives {list(counts)[:8]}"
        f"{' ...' if n > 8 else ''}"
    )


def _counts(name: str, sizes, n_tiles: int, per_tile: int) -> tuple[int, ...]:
    if not isinstance(sizes, torch.Tensor) or sizes.dtype.is_floating_point or sizes.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (valid tokens per tile), got "
                        f"{getattr(sizes, 'dtype', type(sizes).__name__)}")
    if sizes.numel() != n_tiles:
        raise ValueError(f"{name} must hold one count per tile ({n_tiles}), got {sizes.numel()}")
    counts = tuple(int(c) for c in sizes.reshape(-1).tolist())
    if any(not 1 <= c <= per_tile for c in counts):
        raise ValueError(f"{name} must be in [1, {per_tile}] (tokens per tile), got "
                         f"{min(counts)}..{max(counts)}")
    return counts


def video_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variable_block_sizes: torch.Tensor,
    q_variable_block_sizes: torch.Tensor,
    topk: int,
    block_size: int | tuple = 64,
    compress_attn_weight: torch.Tensor = None,
) -> torch.Tensor:
    """FastVideo's VSA: ``O_coarse * compress_attn_weight + O_fine``, or ``O_coarse + O_fine``
    without a weight, on :func:`lowbit_attn.video_sparse_attention` (16-bit ``"exact"`` fine stage,
    trainable).

    Other differences from FastVideo: the coarse stage runs in fp32 (theirs rounds the tile means
    to q's dtype); the scale is ``D ** -0.5`` in both.

    Args:
        q: ``[B, Hq, S, D]``, ``S = n_tiles · block_elements``, tokens in tile order with each
            tile padded (its valid tokens first) → the valid tokens, ``token_order="tiled"``,
            ``layout="HND"``.
        k: ``[B, Hkv, S, D]``; ``Hq`` may be a multiple of ``Hkv`` here (GQA); theirs needs equal
            heads.
        v: the same shape as k.
        variable_block_sizes: ``[n_tiles]`` valid tokens per key tile → the tiles of the
            ``video_shape`` that gives these counts (:func:`video_grid`; a host read of the
            counts).
        q_variable_block_sizes: ``[n_tiles]`` valid tokens per query tile: must equal
            ``variable_block_sizes`` (self-attention over one grid; theirs also takes cross
            attention between two grids).
        topk: key tiles per query tile → ``topk``: an int of at least 1, more than ``n_tiles``
            meaning all of them (as theirs: ``min(topk, kv_blocks)``); ours also takes a fraction
            of the tiles (a float in ``(0, 1]``).
        block_size: ``(tt, th, tw)`` → ``tile``; an int is the tokens per cubic tile (64 →
            ``(4, 4, 4)``); theirs reads an int ``b`` as ``(b, b, b)``.
        compress_attn_weight: ``None`` → ``gate_coarse`` = 1 (the sum of both branches); a tensor
            broadcastable to q (its token axis, if not 1, over the padded ``S`` slots) →
            ``gate_coarse`` on the valid tokens.

    Returns:
        ``[B, Hq, S, D]`` in q's dtype; the padding slots of partial tiles are 0 (theirs leaves
            values there that callers drop).

    Raises:
        TypeError: as :func:`lowbit_attn.video_sparse_attention`; a block-size count that is not
            an integer tensor; a ``block_size`` that is neither an int nor three ints; a
            ``compress_attn_weight`` that is not a tensor.
        ValueError: as :func:`lowbit_attn.video_sparse_attention`; an int ``block_size`` that
            is not a cube; q, k, v with different slot counts or a count that is not a multiple
            of the tile; block sizes that are not one count per tile in ``[1, block_elements]``,
            that differ between q and k, or that no video grid gives; a ``compress_attn_weight``
            whose token axis is neither 1 nor ``S``.

    Examples:
        >>> import torch
        >>> from lowbit_attn.compat.fastvideo import video_sparse_attn
        >>> # 4 tiles of 64 tokens, tile order
        >>> q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
        >>> sizes = torch.full((4,), 64)
        >>> video_sparse_attn(q, k, v, sizes, sizes, topk=2).shape
        torch.Size([1, 2, 256, 32])
    """
    tile = tile_shape(block_size)
    per_tile = math.prod(tile)
    qh, kh, _ = checks.dense_qkv(q, k, v, "HND", dtypes=checks.FLOAT_DTYPES + (torch.float64,))
    slots = qh.shape[2]
    if slots % per_tile != 0 or kh.shape[2] != slots:
        raise ValueError(f"q, k and v must have the same number of slots, a multiple of "
                         f"block_elements={per_tile}, got {qh.shape[2]} and {kh.shape[2]}")
    n_tiles = slots // per_tile
    counts = _counts("variable_block_sizes", variable_block_sizes, n_tiles, per_tile)
    if _counts("q_variable_block_sizes", q_variable_block_sizes, n_tiles, per_tile) != counts:
        raise ValueError("q_variable_block_sizes must equal variable_block_sizes: only "
                         "self-attention over one token grid is supported")
    video_shape = traceable(video_grid)(counts, tile)
    sizes = torch.tensor(counts, device=q.device)
    valid = torch.nonzero(torch.arange(per_tile, device=q.device).expand(n_tiles, per_tile)
                          < sizes[:, None]).reshape(-1, 2)
    valid = valid[:, 0] * per_tile + valid[:, 1]  # the slots that hold tokens, in tile order
    gate = torch.ones((), dtype=q.dtype, device=q.device)
    if compress_attn_weight is not None:
        if not isinstance(compress_attn_weight, torch.Tensor):
            raise TypeError(f"compress_attn_weight must be a tensor or None, got "
                            f"{type(compress_attn_weight).__name__}")
        gate = compress_attn_weight
        if gate.dim() >= 2 and gate.shape[-2] not in (1, slots):
            raise ValueError(f"compress_attn_weight's token axis (-2) must be 1 or {slots} (the "
                             f"padded slots), got shape {tuple(compress_attn_weight.shape)}")
        check_gate("compress_attn_weight", gate, q.shape, q.device)  # the output's shape
        if gate.dim() >= 2 and gate.shape[-2] == slots:
            gate = gate.index_select(-2, valid)
    if isinstance(topk, int) and not isinstance(topk, bool) and topk > n_tiles:
        topk = n_tiles  # as theirs: min(topk, kv_blocks)
    tokens = [x.index_select(2, valid) for x in (q, k, v)]
    out = video_sparse_attention(*tokens, video_shape=video_shape, tile=tile, topk=topk,
                                 gate_coarse=gate, layout="HND", recipe="exact",
                                 token_order="tiled")
    full = out.new_zeros(out.shape[:2] + (slots,) + out.shape[3:])
    return full.index_copy(2, valid, out)

"""lowbit_attn.compat.fastvideo.video_sparse_attn: FastVideo's signature and meaning (no weight: the
sum of both branches; with a weight: our gated VSA), on padded tile-ordered tokens."""

from __future__ import annotations

import inspect

import pytest
import torch

import lowbit_attn
from helpers import assert_close
from lowbit_attn.compat.fastvideo import tile_shape, video_grid, video_sparse_attn

VIDEO, TILE = (5, 6, 7), (4, 4, 4)  # partial tiles along every dimension: 2 x 2 x 2 tiles


def _padded(x: torch.Tensor, video_shape=VIDEO, tile=TILE) -> torch.Tensor:
    """Row-major ``[B, H, N, D]`` → FastVideo's layout: tile by tile, each padded to full size."""
    layout = lowbit_attn.tiles.tile_layout(video_shape, tile)
    slots = x[:, :, layout.index.clamp(min=0)] * (layout.index >= 0)[..., None].to(x.dtype)
    return slots.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


def _unpadded(x: torch.Tensor, video_shape=VIDEO, tile=TILE) -> torch.Tensor:
    """Inverse of :func:`_padded`: the valid slots, back to row-major order."""
    layout = lowbit_attn.tiles.tile_layout(video_shape, tile)
    valid = (layout.index >= 0).reshape(-1)
    return x[:, :, valid][:, :, layout.inverse]


def _inputs(dtype=torch.float64, hq=2, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = VIDEO[0] * VIDEO[1] * VIDEO[2]
    q = torch.randn(1, hq, n, 32, generator=g, dtype=dtype)
    k, v = (torch.randn(1, hkv, n, 32, generator=g, dtype=dtype) for _ in range(2))
    counts = lowbit_attn.tiles.tile_layout(VIDEO, TILE).counts
    return q, k, v, counts


def test_signature_equals_fastvideo():
    E, PK = inspect.Parameter.empty, inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert [(p.name, p.kind, p.default) for p in
            inspect.signature(video_sparse_attn).parameters.values()] == [
        ("q", PK, E), ("k", PK, E), ("v", PK, E), ("variable_block_sizes", PK, E),
        ("q_variable_block_sizes", PK, E), ("topk", PK, E), ("block_size", PK, 64),
        ("compress_attn_weight", PK, None)]


@pytest.mark.parametrize("block_size", [64, (4, 4, 4)])
def test_all_tiles_without_a_weight_is_coarse_plus_fine(block_size):
    q, k, v, counts = _inputs()
    n_tiles = counts.numel()
    padded = [_padded(x) for x in (q, k, v)]
    before = [x.clone() for x in padded]
    out = video_sparse_attn(*padded, counts, counts.clone(), n_tiles, block_size)
    # by hand: the two stages of our VSA, added
    coarse, indices, _ = lowbit_attn.vsa.coarse(q, k, v, video_shape=VIDEO, tile=TILE, topk=n_tiles)
    fine = lowbit_attn.vsa.fine(q, k, v, video_shape=VIDEO, tile=TILE, tile_indices=indices)
    assert_close(_unpadded(out), coarse + fine, atol=1e-12)
    # with every tile, the fine stage is dense attention
    dense = torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, -1) @ v
    assert_close(_unpadded(out), coarse + dense, atol=1e-10)
    # padding slots are zero; the inputs are untouched
    pad = ~(lowbit_attn.tiles.tile_layout(VIDEO, TILE).index >= 0).reshape(-1)
    assert torch.all(out[:, :, pad] == 0)
    assert all(torch.equal(x, y) for x, y in zip(padded, before))


@pytest.mark.parametrize("weight_shape", ["full", "per_token", "scalar"])
@pytest.mark.parametrize("hkv", [2, 1])
def test_a_weight_is_our_gated_vsa(weight_shape, hkv):
    q, k, v, counts = _inputs(dtype=torch.float32, hkv=hkv, seed=1)
    g = torch.Generator().manual_seed(2)
    gate = {"full": lambda: torch.rand(1, 2, q.shape[2], 32, generator=g),
            "per_token": lambda: torch.rand(1, 1, q.shape[2], 1, generator=g),
            "scalar": lambda: torch.tensor(0.3)}[weight_shape]()
    padded_gate = _padded(gate) if gate.dim() == 4 else gate
    out = video_sparse_attn(*(_padded(x) for x in (q, k, v)), counts, counts, 3, (4, 4, 4),
                            padded_gate)
    ours = lowbit_attn.video_sparse_attention(q, k, v, video_shape=VIDEO, tile=TILE, topk=3,
                                              gate_coarse=gate)
    assert_close(_unpadded(out), ours, atol=1e-6)


def test_the_grid_is_found_from_the_counts():
    for video in [(5, 6, 7), (8, 8, 8), (1, 3, 9), (4, 9, 4)]:
        counts = tuple(lowbit_attn.tiles.tile_layout(video, TILE).counts.tolist())
        found = video_grid(counts, TILE)
        assert tuple(lowbit_attn.tiles.tile_layout(found, TILE).counts.tolist()) == counts
    assert tile_shape(64) == (4, 4, 4) and tile_shape(8) == (2, 2, 2) and tile_shape((2, 4, 8)) == (2, 4, 8)


def test_bad_arguments():
    q, k, v, counts = _inputs()
    padded = [_padded(x) for x in (q, k, v)]
    with pytest.raises(ValueError, match="block_size"):
        video_sparse_attn(*padded, counts, counts, 2, 60)
    with pytest.raises(TypeError, match="block_size"):
        video_sparse_attn(*padded, counts, counts, 2, "4x4x4")
    for sides in ((0, 2, 2), (-2, -2, 2)):
        with pytest.raises(ValueError, match="block_size's three tile sides must be at least 1"):
            video_sparse_attn(*padded, counts, counts, 2, sides)
    with pytest.raises(ValueError, match="q_variable_block_sizes"):
        video_sparse_attn(*padded, counts, counts.flip(0), 2)
    with pytest.raises(ValueError, match="variable_block_sizes"):
        video_sparse_attn(*padded, counts[:-1], counts, 2)
    with pytest.raises(TypeError, match="variable_block_sizes"):
        video_sparse_attn(*padded, counts.float(), counts, 2)
    odd = torch.tensor([64, 3, 64, 64, 64, 64, 64, 7])  # no (T, H, W) grid gives these
    with pytest.raises(ValueError, match="no grid"):
        video_sparse_attn(*padded, odd, odd, 2)
    with pytest.raises(ValueError, match="topk"):
        video_sparse_attn(*padded, counts, counts, 0)
    # more tiles than there are means all of them, as FastVideo's min(topk, kv_blocks)
    assert torch.equal(video_sparse_attn(*padded, counts, counts, 9),
                       video_sparse_attn(*padded, counts, counts, 8))
    # a weight that does not broadcast over the slots, or on another device, a tile too large:
    # named as the caller passed them (not gate_coarse, tile)
    for weight in (torch.ones(1, 2, 7, 32), torch.ones(padded[0].shape[2]),
                   torch.ones(1, device="meta")):
        with pytest.raises(ValueError, match="compress_attn_weight"):
            video_sparse_attn(*padded, counts, counts, 2, 64, weight)
    with pytest.raises(ValueError, match=r"block_size \(8, 8, 8\) holds 512"):
        video_sparse_attn(*padded, counts, counts, 2, (8, 8, 8))
    with pytest.raises(ValueError, match="slots"):
        video_sparse_attn(*(x[:, :, :-1] for x in padded), counts, counts, 2)

"""Video sparse attention (VSA) in plain PyTorch: the coarse stage over mean-pooled tiles, the fine
stage over the tokens of selected key tiles, and the dense masked attention both must equal. All
differentiable by autograd (the top-k choice itself is not).

Tensors are HND ``[B, H, N, D]`` with tokens in row-major ``(T, H, W)`` order; a
:class:`~lowbit_attn.vsa.tiles.TileLayout` says which tokens make each tile.
"""

from __future__ import annotations

import torch

from lowbit_attn.core.operands import QuantizedQKV
from lowbit_attn.vsa.tiles import TileLayout
from lowbit_attn.inference.naive import expand_heads, finish, softmax_step


def gather_tiles(x: torch.Tensor, layout: TileLayout, slots: int | None = None) -> torch.Tensor:
    """``[B, H, N, ...]`` → ``[B, H, n_tiles, slots, ...]`` (``slots`` ≥ ``tile_tokens``, that by
    default), zeros in the slots a tile lacks. Any dtype, 1-byte floats included."""
    index = layout.index
    if slots is not None and slots > index.shape[1]:
        index = torch.nn.functional.pad(index, (0, slots - index.shape[1]), value=-1)
    valid = (index >= 0).reshape(*index.shape, *([1] * (x.dim() - 3)))
    raw = x.view(torch.uint8) if x.dtype.itemsize == 1 and x.dtype.is_floating_point else x
    tiles = raw[:, :, index.clamp(min=0)]
    tiles = torch.where(valid, tiles, torch.zeros((), dtype=raw.dtype, device=x.device))
    return tiles.view(x.dtype) if raw is not x else tiles


def scatter_tiles(tiles: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`gather_tiles`: ``[B, H, n_tiles, slots, D]`` → ``[B, H, N, D]``."""
    valid = layout.index >= 0
    return tiles[:, :, :, : layout.tile_tokens][:, :, valid][:, :, layout.inverse]


def pool_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Mean of each tile's tokens (partial tiles: of the tokens they have): ``[B, H, n_tiles, D]``."""
    sums = gather_tiles(x, layout).sum(dim=3)
    return sums / layout.counts.to(x.dtype).unsqueeze(-1)


def coarse_pooled(qp, kp, vp, *, scale: float, topk: int):
    """Dense attention between pooled tiles ``qp [B, Hq, n_tiles, D]``, ``kp, vp [B, Hkv, n_tiles,
    D]``.

    Returns:
        ``(out [B, Hq, n_tiles, D]``, ``tile_indices [B, Hq, n_tiles, topk]`` int64 (the
        highest-scoring key tiles per query tile, in increasing order), ``scores [B, Hq, n_tiles,
        n_tiles]`` (pooled Q·Kᵀ·scale))``.
    """
    hq = qp.shape[1]
    scores = torch.matmul(qp, expand_heads(kp, hq).transpose(-1, -2)) * scale
    out = torch.matmul(torch.softmax(scores, dim=-1), expand_heads(vp, hq))
    with torch.no_grad():
        indices = scores.topk(topk, dim=-1).indices.sort(dim=-1).values
    return out, indices, scores


def coarse(q, k, v, layout: TileLayout, *, scale: float, topk: int):
    """The coarse stage from ``[B, H, N, D]`` tokens: :func:`coarse_pooled` of the tile means, its
    output given to every token of the query tile (``[B, Hq, N, D]``)."""
    out, indices, scores = coarse_pooled(*(pool_tiles(x, layout) for x in (q, k, v)), scale=scale,
                                         topk=topk)
    return out[:, :, layout.tile_of], indices, scores


def fine(q, k, v, layout: TileLayout, tile_indices: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Exact attention of each query tile over the tokens of its key tiles ``tile_indices``
    (``[B, Hq, n_tiles, k]`` int64, distinct per row), gathered tile by tile as the kernels do.
    Returns ``[B, Hq, N, D]``."""
    b, hq, _, d = q.shape
    nt, ts = layout.n_tiles, layout.tile_tokens
    kk = tile_indices.shape[-1]
    qt = gather_tiles(q, layout)                                   # [B, Hq, nt, ts, D]
    kt = expand_heads(gather_tiles(k, layout), hq)                # [B, Hq, nt, ts, D]
    vt = expand_heads(gather_tiles(v, layout), hq)
    sel = tile_indices.reshape(b, hq, nt * kk)
    gather = lambda t: torch.gather(  # noqa: E731 - [B, Hq, nt, kk·ts, D or 1]
        t, 2, sel[..., None, None].expand(b, hq, nt * kk, ts, t.shape[-1])
    ).reshape(b, hq, nt, kk * ts, t.shape[-1])
    ks, vs = gather(kt), gather(vt)
    # the valid slots gathered as the keys are (an index by tile_indices, then a reshape, was
    # compiled by Inductor with dynamic shapes into a wrong index when kk is 1)
    valid = (layout.index >= 0)[:, :, None].expand(b, hq, nt, ts, 1)
    key_valid = gather(valid).transpose(-1, -2)                   # [B, Hq, nt, 1, kk·ts]
    s = torch.matmul(qt, ks.transpose(-1, -2)) * scale            # [B, Hq, nt, ts, kk·ts]
    s = s.masked_fill(~key_valid, float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), vs)
    return scatter_tiles(out, layout)


def fine_quantized(qz: QuantizedQKV, layout: TileLayout, tile_indices: torch.Tensor, *,
                   pv: str) -> torch.Tensor:
    """The 8-bit fine stage: INT8 Q·Kᵀ with one scale per token (``qz`` as
    :func:`lowbit_attn.inference.prepare.quantize_qkv` makes it with per-token granularity, row-major
    tokens), P̃ and V in E4M3 (``pv="fp8"``) or fp16; each selected key tile is one block of the
    online softmax, in the order of ``tile_indices``, as the kernel walks them. Returns
    ``[B, Hq, N, D]`` fp32."""
    b, hq, _, d = qz.q.shape
    nt, ts = layout.n_tiles, layout.tile_tokens
    qt = gather_tiles(qz.q.float(), layout)                                 # [B, Hq, nt, ts, D]
    qs = gather_tiles(qz.q_scale.unsqueeze(-1), layout).squeeze(-1)          # [B, Hq, nt, ts]
    kt = expand_heads(gather_tiles(qz.k.float(), layout), hq)
    ks = expand_heads(gather_tiles(qz.k_scale.unsqueeze(-1), layout).squeeze(-1), hq)
    vt = expand_heads(gather_tiles(qz.v.float(), layout), hq)
    valid = layout.index >= 0
    m = torch.full((b, hq, nt, ts), float("-inf"), device=qt.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros((b, hq, nt, ts, d), device=qt.device)
    for slot in range(tile_indices.shape[-1]):
        j = tile_indices[..., slot]                                          # [B, Hq, nt]
        take = lambda t: torch.gather(  # noqa: E731 - key tile j of each query tile
            t, 2, j.reshape(b, hq, nt, *([1] * (t.dim() - 3))).expand(b, hq, nt, *t.shape[3:]))
        s = torch.matmul(qt, take(kt).transpose(-1, -2)) * (qs.unsqueeze(-1) * take(ks).unsqueeze(-2))
        s = s.masked_fill(~valid[j].unsqueeze(-2), float("-inf"))
        acc, m, l_sum = softmax_step(s, take(vt), acc, m, l_sum, pv=pv)
    v_scale = None if qz.v_scale is None else expand_heads(qz.v_scale, hq).unsqueeze(-2)
    out, _ = finish(acc.reshape(b, hq, nt * ts, d), l_sum.reshape(b, hq, nt * ts), m.reshape(b, hq, -1),
                    0.0, v_scale, qz.v_mean, None)
    return scatter_tiles(out.reshape(b, hq, nt, ts, d), layout)


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
    s = torch.matmul(q, expand_heads(k, hq).transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(p, expand_heads(v, hq))


def _pick(x: torch.Tensor, heads: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """``x [B, H, nt, ...]`` at head ``heads`` and tile ``tiles`` (``[B, n]`` each) → ``[B, n, ...]``."""
    b = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[b, heads, tiles.long()]


def fine_backward_tiles(qt, kt, vt, dot, lse, delta, idx, counts, *, scale: float):
    """The 16-bit fine stage's backward on padded tiles, tile by tile in the order the Gluon
    backward (``training/kernel_bwd_sm90.py``) walks them: ``(dq, dk, dv)`` fp32 tiles for
    ``qt, dot [B, Hq, nt, TS, D]``, ``kt, vt [B, Hkv, nt, TS, D]``, the forward's base-2 ``lse``
    and ``delta = rowsum(dO ∘ O)`` ``[B, Hq, nt, TS]``, ``idx [B, Hq, nt, k]`` and ``counts [nt]``.
    Per pair of tiles: ``S = Q·Kᵀ``, scaled by ``scale·log2 e`` (rounded to fp32), ``P = exp2(S
    - LSE)`` (-inf past the key tile's count, an LSE of -inf taken as 0), ``dP = dO·Vᵀ``, ``dS =
    P ∘ (dP - Δ)``; P and dS rounded to the inputs' dtype, their products added into fp32 with
    one rounding (as a 16-bit wgmma accumulates): dQ over each query tile's key tiles in ``idx``
    order, dK and dV over each key tile's query tiles (:func:`~lowbit_attn.vsa.kernel_fine.
    reverse_lists`' order, each query head of the K/V head in turn); dQ and dK times ``scale``.
    Rows past a tile's count are 0."""
    from lowbit_attn.vsa.kernel_fine import reverse_lists

    b, hq, nt, ts, d = qt.shape
    hkv = kt.shape[1]
    dtype = qt.dtype
    c = torch.tensor(scale, dtype=torch.float32) * torch.tensor(1.4426950408889634,
                                                                dtype=torch.float32)
    f = {name: x.float() for name, x in (("q", qt), ("k", kt), ("v", vt), ("do", dot))}
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
    slots = torch.arange(ts, device=qt.device)

    def tile_grads(qi, ki, vi, doi, lse_i, delta_i, cnt_k):
        s = torch.matmul(qi.double(), ki.double().transpose(-1, -2)).float() * c
        s = s.masked_fill(~(slots < cnt_k[..., None])[..., None, :], float("-inf"))
        p = torch.exp2(s - lse_i[..., :, None])
        dp = torch.matmul(doi.double(), vi.double().transpose(-1, -2)).float()
        return p.to(dtype).float(), (p * (dp - delta_i[..., :, None])).to(dtype).float()

    def add(acc, a, b_, valid):  # acc + a·b_ with one rounding, where valid
        new = (acc.double() + torch.matmul(a.double(), b_.double())).float()
        return torch.where(valid[..., None, None], new, acc)

    heads = torch.arange(hq, device=qt.device)[None, :, None].expand(b, hq, nt)
    tiles = torch.arange(nt, device=qt.device)[None, None, :].expand(b, hq, nt)
    flat = lambda x: x.reshape(b, hq * nt)  # noqa: E731
    dq = torch.zeros(b, hq * nt, ts, d)
    for s_ in range(idx.shape[-1]):
        j = flat(idx[..., s_])
        hk = flat(heads) // (hq // hkv)
        p, ds = tile_grads(_pick(f["q"], flat(heads), flat(tiles)), _pick(f["k"], hk, j),
                           _pick(f["v"], hk, j), _pick(f["do"], flat(heads), flat(tiles)),
                           _pick(lse_safe, flat(heads), flat(tiles)),
                           _pick(delta, flat(heads), flat(tiles)), counts[j.long()])
        dq = add(dq, ds, _pick(f["k"], hk, j), torch.ones_like(j, dtype=torch.bool))
    ridx, rcount = reverse_lists(idx, nt)
    group = hq // hkv
    kh = torch.arange(hkv, device=qt.device)[None, :, None].expand(b, hkv, nt).reshape(b, -1)
    kj = torch.arange(nt, device=qt.device)[None, None, :].expand(b, hkv, nt).reshape(b, -1)
    dk = torch.zeros(b, hkv * nt, ts, d)
    dv = torch.zeros(b, hkv * nt, ts, d)
    for g in range(group):
        h = kh * group + g
        n = _pick(rcount.unsqueeze(-1), h, kj).squeeze(-1)
        for s_ in range(nt):
            i = _pick(ridx[..., s_].unsqueeze(-1), h, kj).squeeze(-1)
            p, ds = tile_grads(_pick(f["q"], h, i), _pick(f["k"], kh, kj), _pick(f["v"], kh, kj),
                               _pick(f["do"], h, i), _pick(lse_safe, h, i), _pick(delta, h, i),
                               counts[kj.long()])
            dv = add(dv, p.transpose(-1, -2), _pick(f["do"], h, i), s_ < n)
            dk = add(dk, ds.transpose(-1, -2), _pick(f["q"], h, i), s_ < n)
    rows = (slots < counts[:, None])[None, None, :, :, None]
    out = [x.reshape(b, -1, nt, ts, d) for x in (dq * scale, dk * scale, dv)]
    return tuple(torch.where(rows, x, 0.0) for x in out)

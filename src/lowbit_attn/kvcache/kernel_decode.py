"""Split-KV (flash-decoding) attention against the quantized KV cache, reading its pages directly.

``_decode_split_kernel``: one program per (sequence, KV head, split). Its rows are the GQA group's
query heads × the ``n`` query tokens (row ``r`` = head ``r // n`` of the group, token ``r % n``),
padded to ``BLOCK_R ≥ 16`` for ``tl.dot``; the rows are multiplied by the sequence's balancing factors and
quantized to INT8 per row. A split covers a contiguous range of the sequence's
pages; each page is looked up in the block table, its INT8 K and per-token scales give
``S = ((Q̂·K̂ᵀ)·s_k)·s_q`` in fp32 (base 2), an online softmax runs over the split's pages, and
each page's ``P̃·V̂`` is a fresh fp32 product times the page's per-channel V scale (the open page:
``P̃·V`` with V exact in the cache's dtype). The split writes its unnormalised accumulator, row max
and row sum to a workspace; ``_decode_merge_kernel`` (one program per (sequence, KV head)) merges
the splits into the output and the LSE. Twin: ``lowbit_attn.kvcache.naive`` (its docstring is the
numerics; it takes one row maximum over every key, this kernel a running one, so P̃ is rounded at
other points: the two agree to that rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.operands import LOG2E
from lowbit_attn.core.triton_helpers import (
    LN2, exact_fp8, next_pow2, online_max, p_offset, strides, to_e4m3,
)
from lowbit_attn.kvcache.pages import PagedLayer
from lowbit_attn.kvcache.recipes import KVRecipe
from lowbit_attn.quant.tile import balance_multiplier, int8_lines

# Keys per split (rounded down to whole pages, at least one): a split's pages depend only on its
# own sequence's length, never on the batch around it, so a sequence's result is the same alone
# or in any batch. 512 keys: at N = 32k, 64 splits per (sequence, KV head); at 1k, 2.
TOKENS_PER_SPLIT = 512


@triton.jit
def _quantize_rows(x, qk_multiplier):
    """Q rows fp32 → ``(int8, s_q)``: ``amax/127`` per row (1 for a zero row, NaN for a
    non-finite one), round half to even; ``s_q`` times ``scale·log2 e``. Twin:
    ``quant.int8_naive.quantize_int8(per_token, scale_multiplier=...)``."""
    q8, scale = int8_lines(x, 1)
    return q8, scale * qk_multiplier


@triton.jit
def _decode_split_kernel(
    Q, AQ, AK, K, KS, V, VS, VO, BT, LEN, WACC, WM, WL,
    q_strides, amax_strides, k_strides, ks_strides, v_strides, vs_strides, vo_strides, bt_strides,
    wacc_strides, wml_strides, qk_multiplier, N, GROUP, D, pages_per_split,
    PAGE: tl.constexpr, PV_FP8: tl.constexpr, EXACT_FP8: tl.constexpr,
    OPEN_MODE: tl.constexpr, EMU_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Strides: ``Q`` (batch, head, token, dim); the frozen balancing statistics ``AQ``, ``AK``
    (batch, head; unit stride over dim); the pools ``K``, ``V`` (page, head, slot, dim),
    ``KS`` (page, head, slot), ``VS`` (page, head, dim); the open pages ``VO`` (batch, head, slot,
    dim); ``BT`` (batch, page); the workspace ``WACC`` (batch, head, split, row, dim), ``WM`` and
    ``WL`` (batch, head, split, row)."""
    sqb, sqh, sqn, sqd = q_strides
    skp, skh, skn, skd = k_strides
    sksp, sksh, sksn = ks_strides
    svp, svh, svn, svd = v_strides
    svsp, svsh, svsd = vs_strides
    sob, soh, son, sod = vo_strides
    sbb, sbp = bt_strides
    swb, swh, sws, swr, swd = wacc_strides
    smb, smh, sms, smr = wml_strides
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_r < GROUP * N
    dmask = offs_d < D
    token = offs_r % N
    head = hk * GROUP + offs_r // N

    length = tl.load(LEN + b).to(tl.int32)
    pages = tl.cdiv(length, PAGE)
    first = split * pages_per_split  # past the sequence's pages: an empty split
    last = tl.minimum(first + pages_per_split, pages)
    full_pages = length // PAGE
    # row r sees keys j <= length - N + token
    limit = length - N + token

    x = tl.load(Q + b * sqb + head[:, None] * sqh + token[:, None] * sqn + offs_d[None, :] * sqd,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    balance = balance_multiplier(AQ, AK, b, hk, offs_d, D, amax_strides, amax_strides, 1,
                               ROLE=1, BLOCK_D=BLOCK_D)  # statistics per KV head: a group of 1
    q8, qs = _quantize_rows(x * balance[None, :], qk_multiplier)
    offset = p_offset(PV_FP8)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for page_no in range(first, last):
        page = tl.load(BT + b * sbb + page_no * sbp).to(tl.int64)
        cols = page_no * PAGE + offs_p
        smask = (offs_p < PAGE) & (cols < length)
        kt = tl.load(K + page * skp + hk * skh + offs_p[None, :] * skn + offs_d[:, None] * skd,
                     mask=smask[None, :] & dmask[:, None], other=0)
        ks = tl.load(KS + page * sksp + hk * sksh + offs_p * sksn, mask=smask, other=0.0)
        s_int = tl.dot(q8, kt, out_dtype=tl.int32)
        s = (s_int.to(tl.float32) * ks[None, :]) * qs[:, None]  # the twin's order
        s = tl.where(smask[None, :] & (cols[None, :] <= limit[:, None]), s, float("-inf"))
        m_new, m_safe, alpha = online_max(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - (m_safe - offset)[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if page_no < full_pages:
            vq = tl.load(V + page * svp + hk * svh + offs_p[:, None] * svn + offs_d[None, :] * svd,
                        mask=(offs_p < PAGE)[:, None] & dmask[None, :], other=0.0)
            vs = tl.load(VS + page * svsp + hk * svsh + offs_d * svsd, mask=dmask, other=0.0)
            if PV_FP8:
                p8 = to_e4m3(p, EXACT_FP8)
                if EMU_FP32:
                    pv = tl.dot(p8.to(tl.float32), vq.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p8, vq, out_dtype=tl.float32)
            else:  # INT8 V is exact in fp16
                if EMU_FP32:
                    pv = tl.dot(p.to(tl.float16).to(tl.float32), vq.to(tl.float32),
                                input_precision="ieee")
                else:
                    pv = tl.dot(p.to(tl.float16), vq.to(tl.float16), out_dtype=tl.float32)
            pv = pv * vs[None, :]
        else:  # the open page: V exact in the cache's dtype, P̃ rounded as on every page (the
            # branches name their V apart: Triton types a name assigned in both alike)
            vo = tl.load(VO + b * sob + hk * soh + offs_p[:, None] * son + offs_d[None, :] * sod,
                        mask=smask[:, None] & dmask[None, :], other=0.0)
            if PV_FP8:
                pr = to_e4m3(p, EXACT_FP8).to(tl.float32)
            else:
                pr = p.to(tl.float16).to(tl.float32)
            if OPEN_MODE == 3:  # fp32 V on a GPU: P̃ is exact in TF32, V = big + small
                pv = tl.dot(pr, vo.to(tl.float32), input_precision="tf32x3")
            elif OPEN_MODE == 1:  # the interpreter: exact fp32 products
                pv = tl.dot(pr, vo.to(tl.float32), input_precision="ieee")
            elif OPEN_MODE == 2:  # fp16 P̃, bf16 V: P̃ = hi + lo, both exact in bf16 (11 bits)
                hi = pr.to(tl.bfloat16)
                lo = (pr - hi.to(tl.float32)).to(tl.bfloat16)
                pv = tl.dot(hi, vo, out_dtype=tl.float32)
                pv = tl.dot(lo, vo, acc=pv, out_dtype=tl.float32)
            else:  # E4M3 P̃ is exact in V's 16-bit type, fp16 P̃ in fp16
                pv = tl.dot(pr.to(vo.dtype), vo, out_dtype=tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    w = b * smb + hk * smh + split * sms + offs_r * smr
    tl.store(WM + w, m_i, mask=rmask)
    tl.store(WL + w, l_i, mask=rmask)
    tl.store(WACC + b * swb + hk * swh + split * sws + offs_r[:, None] * swr + offs_d[None, :] * swd,
             acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _decode_merge_kernel(
    Q, KM, WACC, WM, WL, O, LSE,
    q_strides, km_strides, wacc_strides, wml_strides, o_strides, lse_strides,
    softmax_scale, N, GROUP, D, SPLITS,
    PV_FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merges the splits of one (sequence, KV head): ``out = Σ acc_s·2^(m_s - M) / Σ l_s·2^(m_s -
    M)``, ``LSE = (M + log2 l - offset)·ln 2 + scale·(q·μ)``; rows that saw no key give 0 and
    ``-inf``. Strides: ``Q``, ``O`` (batch, head, token, dim); ``KM`` (batch, head, dim); ``LSE``
    (batch, head, token); the workspace as in ``_decode_split_kernel``."""
    sqb, sqh, sqn, sqd = q_strides
    skb, skh, skd = km_strides
    swb, swh, sws, swr, swd = wacc_strides
    smb, smh, sms, smr = wml_strides
    sob, soh, son, sod = o_strides
    seb, seh, sen = lse_strides
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_r < GROUP * N
    dmask = offs_d < D
    token = offs_r % N
    head = hk * GROUP + offs_r // N
    offset = p_offset(PV_FP8)

    w = b * smb + hk * smh + offs_r * smr
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, SPLITS):
        m = tl.maximum(m, tl.load(WM + w + s * sms, mask=rmask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    wa = WACC + b * swb + hk * swh + offs_r[:, None] * swr + offs_d[None, :] * swd
    for s in range(0, SPLITS):
        factor = tl.exp2(tl.load(WM + w + s * sms, mask=rmask, other=float("-inf")) - m_safe)
        l_sum += tl.load(WL + w + s * sms, mask=rmask, other=0.0) * factor
        part = tl.load(wa + s * sws, mask=rmask[:, None] & dmask[None, :], other=0.0)
        acc += part * factor[:, None]
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    tl.store(O + b * sob + head[:, None] * soh + token[:, None] * son + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])

    x = tl.load(Q + b * sqb + head[:, None] * sqh + token[:, None] * sqn + offs_d[None, :] * sqd,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    mu = tl.load(KM + b * skb + hk * skh + offs_d * skd, mask=dmask, other=0.0)
    shift = tl.sum(x * mu[None, :], axis=1) * softmax_scale
    lse = (m + tl.log2(l_sum) - offset) * LN2 + shift
    lse = tl.where(empty, float("-inf"), lse)  # μ is unset (unread garbage) for empty sequences
    tl.store(LSE + b * seb + head * seh + token * sen, lse, mask=rmask)


def pages_per_split_for(page_size: int) -> int:
    """Pages per split: :data:`TOKENS_PER_SPLIT` keys, at least one page."""
    return max(1, TOKENS_PER_SPLIT // page_size)


def attention(q: torch.Tensor, layer: PagedLayer, recipe: KVRecipe, *, scale: float,
              pages_per_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, n, D]`` (``n ≥ 1``) against one layer of the cache, the twin's
    arguments (``kvcache.naive.attention_with_kv_cache_naive``) plus ``pages_per_split``
    (default: :func:`pages_per_split_for` the page size): split ``s`` of a sequence covers its
    pages ``s·pages_per_split`` onwards, so the result of a sequence does not depend on the
    batch. Returns ``(out [B, Hq, n, D] in q's dtype, lse fp32 [B, Hq, n])``."""
    bsz, hq, n, d = q.shape
    hkv = layer.k.shape[1]
    group = hq // hkv
    page = layer.page_size
    if pages_per_split is None:
        pages_per_split = pages_per_split_for(page)
    max_pages = -(-max(layer.host_lengths) // page)  # the grid, from the host mirror: no sync
    num_splits = max(1, -(-max_pages // pages_per_split))
    block_r = next_pow2(group * n, 16)
    block_d = next_pow2(d, 32)  # INT8 MMA: k ≥ 32 (and FP8's over the page's slots, below)
    pv_fp8 = recipe.pv == "fp8"
    on = {"device": q.device, "dtype": torch.float32}
    wacc = torch.empty((bsz, hkv, num_splits, block_r, d), **on)
    wm = torch.empty((bsz, hkv, num_splits, block_r), **on)
    wl = torch.empty((bsz, hkv, num_splits, block_r), **on)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((bsz, hq, n), **on)
    interpreted = interpreter_enabled()
    open_mode = 0  # how the open page's P̃·V stays exact: see the kernel
    if interpreted:
        open_mode = 1
    elif layer.v_open.dtype == torch.float32:
        open_mode = 3  # an IEEE fp32 product (FMA loop) spills about 5 KB (ptxas, sm_90a, D=128)
    elif not pv_fp8 and layer.v_open.dtype == torch.bfloat16:
        open_mode = 2  # one fp32 FMA product there spills (ptxas, sm_90a, D=128)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        Q=q, AQ=layer.q_amax, AK=layer.k_amax, K=layer.k, KS=layer.k_scale, V=layer.v, VS=layer.v_scale, VO=layer.v_open,
        BT=layer.block_table, LEN=layer.lengths, WACC=wacc, WM=wm, WL=wl,
        q_strides=strides(q, 4), amax_strides=layer.q_amax.stride()[:2],
        k_strides=strides(layer.k, 4), ks_strides=strides(layer.k_scale, 3), v_strides=strides(layer.v, 4),
        vs_strides=strides(layer.v_scale, 3), vo_strides=strides(layer.v_open, 4),
        bt_strides=strides(layer.block_table, 2), wacc_strides=strides(wacc, 5),
        wml_strides=strides(wm, 4), qk_multiplier=scale * LOG2E, N=n, GROUP=group, D=d,
        pages_per_split=pages_per_split, PAGE=page, PV_FP8=pv_fp8, EXACT_FP8=exact_fp8(), OPEN_MODE=open_mode,
        EMU_FP32=interpreted, BLOCK_R=block_r, BLOCK_P=next_pow2(page, 32 if pv_fp8 else 16),
        BLOCK_D=block_d, num_warps=8 if open_mode == 3 else 4,
    )
    _decode_merge_kernel[(bsz, hkv)](
        Q=q, KM=layer.k_mean, WACC=wacc, WM=wm, WL=wl, O=out, LSE=lse,
        q_strides=strides(q, 4), km_strides=strides(layer.k_mean, 3),
        wacc_strides=strides(wacc, 5), wml_strides=strides(wm, 4), o_strides=strides(out, 4),
        lse_strides=strides(lse, 3), softmax_scale=scale, N=n, GROUP=group, D=d,
        SPLITS=num_splits, PV_FP8=pv_fp8, BLOCK_R=block_r, BLOCK_D=block_d,
    )
    return out, lse

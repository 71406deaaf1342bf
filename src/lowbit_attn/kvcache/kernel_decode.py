"""Split-KV (flash-decoding) attention against the quantized KV cache, reading its pages directly.

``_decode_split_kernel``: one program per (sequence, KV head, split). Its rows are the GQA group's
query heads × the ``n`` query tokens (row ``r`` = head ``r // n`` of the group, token ``r % n``),
in blocks of at most 32 (a program each: :func:`split_launch`), padded to ``BLOCK_R ≥ 16`` for
``tl.dot``; the rows are multiplied by the sequence's balancing factors and quantized to INT8 per
row. A split covers a contiguous range of the sequence's pages;
each page is looked up in the block table, its INT8 K and per-token scales give
``S = ((Q̂·K̂ᵀ)·s_k)·s_q`` in fp32 (base 2), an online softmax runs over the split's pages, and
each page's ``P̃·V̂`` is a fresh fp32 product times the page's per-channel V scale. The full pages
are one loop with nothing conditional in it, so Triton's pipeliner streams their K and V into
shared memory pages ahead (the bytes in flight that a memory-bound loop needs: :data:`STAGES`);
the open page (``P̃·V`` with V exact in the cache's dtype), in the split that holds it, comes after
the loop. The split writes its unnormalised accumulator, row max and row sum to a workspace;
``_decode_merge_kernel`` (one program per query row) merges the splits into the output and the
LSE, reading ``BLOCK_S`` splits per step. Twin: ``lowbit_attn.kvcache.naive`` (its docstring is
the numerics; it takes one row maximum over every key, this kernel a running one, so P̃ is rounded
at other points: the two agree to that rounding, not bit for bit).

The pools, the open pages, the statistics, the block table and the workspace are the cache's and
this module's own contiguous tensors: the kernels compute their offsets from the shapes (``HKV``,
``PAGE``, ``D``, ``MAX_PAGES``), so a launch passes q's strides only (a launch's host time grows
with its arguments).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lowbit_attn.core import measured
from lowbit_attn.core.arch import get_capability, interpreter_enabled
from lowbit_attn.core.operands import LOG2E
from lowbit_attn.core.triton_helpers import (
    LN2, exact_fp8, family, next_pow2, online_max, p_offset, softcap_scores, strides, to_e4m3,
)
from lowbit_attn.core.variants import cap_args
from lowbit_attn.kvcache.pages import PagedLayer
from lowbit_attn.kvcache.recipes import KVRecipe
from lowbit_attn.quant.tile import balance_multiplier, int8_lines

# Keys per split (rounded down to whole pages, at least one) where no GPU run measured another for
# the architecture (``core.measured.DECODE_SPLITS``): a split's pages depend only on its own
# sequence's length, never on the batch around it, so a sequence's result is the same alone or
# in any batch. 512 keys: at N = 32k, 64 splits per (sequence, KV head); at 1k, 2.
TOKENS_PER_SPLIT = 512
# Splits the merge reads per step. Fixed, not sized to the launch: its sums are then the same tree
# whatever the number of splits of the batch (empty splits add exact zeros).
MERGE_SPLITS = 32
# Pipeline stages of the full-page loop. K and V are loaded through the page id, itself a load,
# so the pipeliner splits the stages between the two: with 5, the page ids run ahead of K and V,
# which run two pages ahead (sm_90a SASS: ``DEPBAR.LE SB0, 0x5``; with 3 or 4, one: NOTES §13b).
STAGES = 5
# Unbounded LEFT or CHUNK of a local layer (positions stay below 2^31 - 2^30)
UNBOUNDED = 1 << 30
LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _quantize_rows(x, qk_multiplier):
    """Q rows fp32 → ``(int8, s_q)``: ``amax/127`` per row (1 for a zero row, NaN for a
    non-finite one), round half to even; ``s_q`` times ``scale·log2 e``. Twin:
    ``quant.int8_naive.quantize_int8(per_token, scale_multiplier=...)``."""
    q8, scale = int8_lines(x, 1)
    return q8, scale * qk_multiplier


@triton.jit
def _page_scores(q8, qs, kt, ks, cols, seen, limit, first, shift, cap2, two_over, m_i, l_i,
                 offset, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr):
    """One page's scores ``S = ((Q̂·K̂ᵀ)·s_k)·s_q`` (the twin's order), with ``SOFTCAP``
    soft-capped on the true logits (``triton_helpers.softcap_scores``: ``shift`` is what K's
    smoothing took off each row, added back inside the tanh and taken off again after, so the
    scores stay in the smoothed frame), masked where a key is not stored
    (``seen``), lies after a row's last key (``limit``) or, with ``LOCAL``, before its first
    (``first``); and the online softmax's step: returns ``(P̃ unrounded, m_new, alpha,
    l_new)``."""
    s_int = tl.dot(q8, kt, out_dtype=tl.int32)
    s = (s_int.to(tl.float32) * ks[None, :]) * qs[:, None]
    if SOFTCAP:
        s = softcap_scores(s, cap2, two_over, shift[:, None])
    visible = seen[None, :] & (cols[None, :] <= limit[:, None])
    if LOCAL:
        visible = visible & (cols[None, :] >= first[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new, m_safe, alpha = online_max(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - (m_safe - offset)[:, None])
    return p, m_new, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _decode_split_kernel(
    Q, AQ, AK, KM, K, KS, V, VS, VO, BT, LEN, WACC, WM, WL,
    q_strides, qk_multiplier, cap2, two_over, LEFT, CHUNK, N, GROUP, HKV, MAX_PAGES,
    pages_per_split, ADDED, ROW_BLOCKS,
    D: tl.constexpr, PAGE: tl.constexpr, PV_FP8: tl.constexpr, EXACT_FP8: tl.constexpr,
    OPEN_MODE: tl.constexpr, EMU_FP32: tl.constexpr, STAGES: tl.constexpr,
    LOCAL: tl.constexpr, SOFTCAP: tl.constexpr, PARTS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``Q`` (batch, head, token, dim) with ``q_strides``; contiguous: the statistics ``AQ``,
    ``AK`` ``[B, HKV, D]``; the pools ``K``, ``V`` ``[pages, HKV, PAGE, D]``, ``KS``
    ``[pages, HKV, PAGE]``, ``VS`` ``[pages, HKV, D]``; the open pages ``VO`` ``[B, HKV, PAGE, D]``;
    ``BT`` ``[B, MAX_PAGES]``; the workspace ``WACC`` ``[B, HKV, splits, GROUP·N, D]``, ``WM`` and
    ``WL`` ``[B, HKV, splits, GROUP·N]``. A split covers ``pages_per_split`` pages or, with
    ``PARTS`` > 0, the block's pages (from its first visible one) in ``PARTS`` splits of at least
    one page each. ``ADDED``: tokens stored since ``LEN`` was last
    advanced (a decode step's, ``kvcache/step.py``; 0 otherwise). Axis 0 of the grid: sequence
    × ``ROW_BLOCKS`` blocks of ``BLOCK_R`` rows (more than one for long query chunks).
    ``LOCAL`` (a window or chunked layer): row ``r`` sees keys from ``max(p - LEFT, p - p % CHUNK)``
    (``p`` its position; ``LEFT``, ``CHUNK`` 2^30 where unbounded) and the splits start at the
    block's first such page, so a read covers the window, never the whole sequence. ``SOFTCAP``:
    ``(cap2, two_over) = (softcap·log2 e, 2/softcap)``, the scores capped on the true logits
    (``KM``: μ, whose shift ``scale·log2 e·(q·μ)`` comes back inside the tanh)."""
    sqb, sqh, sqn, sqd = q_strides
    b = (tl.program_id(0) // ROW_BLOCKS).to(tl.int64)
    row_block = tl.program_id(0) % ROW_BLOCKS
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    rows = GROUP * N

    offs_r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_r < rows
    dmask = offs_d < D
    pmask = offs_p < PAGE
    token = offs_r % N
    head = hk * GROUP + offs_r // N

    # a replayed step past its reserved pages reads within the block table (its output: NaN)
    length = tl.minimum(tl.load(LEN + b).to(tl.int32) + ADDED, MAX_PAGES * PAGE)
    pages = tl.cdiv(length, PAGE)
    limit = length - N + token  # row r sees keys j <= limit
    if LOCAL:  # and j >= first_key: the splits start at the block's first page of keys
        first_key = tl.maximum(limit - LEFT, limit - limit % CHUNK)
        start_page = tl.min(tl.where(rmask, first_key, MAX_PAGES * PAGE), axis=0) // PAGE
    else:
        first_key = limit
        start_page = 0
    per_split = pages_per_split
    first = start_page + split * per_split  # past the sequence's pages: an empty split
    # and no page past the block's last visible key (a long query chunk is causal): those would
    # only add masked scores, exact zeros
    seen_pages = tl.cdiv(length - N + tl.max(tl.where(rmask, token, 0), axis=0) + 1, PAGE)
    if PARTS > 0:  # the block's pages in PARTS splits: a function of its own length only
        per_split = tl.maximum(tl.cdiv(seen_pages - start_page, PARTS), 1)
        first = start_page + split * per_split
    last = tl.minimum(tl.minimum(first + per_split, pages), seen_pages)
    full_pages = length // PAGE
    full_last = tl.minimum(last, full_pages)

    x = tl.load(Q + b * sqb + head[:, None] * sqh + token[:, None] * sqn + offs_d[None, :] * sqd,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    balance = balance_multiplier(AQ, AK, b, hk, offs_d, D, (HKV * D, D), (HKV * D, D), 1,
                                 ROLE=1, BLOCK_D=BLOCK_D)  # statistics per KV head: a group of 1
    q8, qs = _quantize_rows(x * balance[None, :], qk_multiplier)
    offset = p_offset(PV_FP8)
    shift = tl.zeros([BLOCK_R], dtype=tl.float32)
    if SOFTCAP:  # scale·log2 e·(q·μ): what K's smoothing took off each row's scores
        mu = tl.load(KM + (b * HKV + hk) * D + offs_d, mask=dmask, other=0.0)
        shift = tl.sum(x * mu[None, :], axis=1) * qk_multiplier

    # [page, HKV, PAGE, D] pools: page p's head hk starts at (p·HKV + hk)·PAGE·D
    tile = offs_p[:, None] * D + offs_d[None, :]
    tile_mask = pmask[:, None] & dmask[None, :]
    kv_head = hk * PAGE * D
    bt_row = BT + b * MAX_PAGES
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for page_no in tl.range(first, full_last, num_stages=STAGES):  # full pages: K and V quantized
        page = tl.maximum(tl.load(bt_row + page_no), 0).to(tl.int64)  # -1: no page (overflow)
        kt = tl.load(K + page * (HKV * PAGE * D) + kv_head + tl.trans(tile), mask=tl.trans(tile_mask),
                     other=0)
        ks = tl.load(KS + (page * HKV + hk) * PAGE + offs_p, mask=pmask, other=0.0)
        vq = tl.load(V + page * (HKV * PAGE * D) + kv_head + tile, mask=tile_mask, other=0.0)
        vs = tl.load(VS + (page * HKV + hk) * D + offs_d, mask=dmask, other=0.0)
        p, m_i, alpha, l_i = _page_scores(q8, qs, kt, ks, page_no * PAGE + offs_p, pmask, limit,
                                          first_key, shift, cap2, two_over, m_i, l_i, offset, LOCAL,
                                          SOFTCAP)
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
        acc = acc * alpha[:, None] + pv * vs[None, :]

    if (first <= full_pages) & (full_pages < last):  # this split holds the open page: V exact
        page = tl.maximum(tl.load(bt_row + full_pages), 0).to(tl.int64)
        cols = full_pages * PAGE + offs_p
        seen = pmask & (cols < length)
        kt = tl.load(K + page * (HKV * PAGE * D) + kv_head + tl.trans(tile),
                     mask=tl.trans(seen[:, None] & dmask[None, :]), other=0)
        ks = tl.load(KS + (page * HKV + hk) * PAGE + offs_p, mask=seen, other=0.0)
        vo = tl.load(VO + (b * HKV + hk) * PAGE * D + tile, mask=seen[:, None] & dmask[None, :],
                     other=0.0)
        p, m_i, alpha, l_i = _page_scores(q8, qs, kt, ks, cols, seen, limit, first_key, shift,
                                          cap2, two_over, m_i, l_i, offset, LOCAL, SOFTCAP)
        if PV_FP8:  # P̃ rounded as on every page
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

    w = ((b * HKV + hk) * tl.num_programs(2) + split) * rows + offs_r
    tl.store(WM + w, m_i, mask=rmask)
    tl.store(WL + w, l_i, mask=rmask)
    tl.store(WACC + w[:, None] * D + offs_d[None, :], acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _decode_merge_kernel(
    Q, KM, SINK, WACC, WM, WL, O, LSE, LEN, ERR,
    q_strides, softmax_scale, N, GROUP, HKV, SPLITS, ADDED,
    D: tl.constexpr, PV_FP8: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merges the splits of one query row (program (row of the group, KV head, sequence)):
    ``out = Σ acc_s·2^(m_s - M) / Σ l_s·2^(m_s - M)``, ``LSE = (M + log2 l - offset)·ln 2 +
    scale·(q·μ)``; a row that saw no key gives 0 and ``-inf``. ``BLOCK_S`` splits per step, each
    step's loads independent of the last. ``Q`` strided (``q_strides``); contiguous: ``KM``
    ``[B, HKV, D]``, ``O`` ``[B, HKV·GROUP, N, D]``, ``LSE`` ``[B, HKV·GROUP, N]``, the workspace
    as in ``_decode_split_kernel``. A decode step (``ERR`` not None, ``kvcache/step.py``): the
    rows of a sequence whose token found no page (``ERR[b]``) give NaN, and the others' lengths
    advance by ``ADDED`` here, after every split has read them. ``SINK`` (fp32 ``[HKV·GROUP]``,
    or None): one more logit per row in the denominator, with no value, in the splits' frame
    (``sink·log2 e`` less the row's smoothing shift); it counts in the LSE, and a row that saw
    no key gives 0 (NaN under a NaN or +inf sink) and LSE ``sink``."""
    sqb, sqh, sqn, sqd = q_strides
    r = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = GROUP * N
    head = hk * GROUP + r // N
    token = r % N
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offset = p_offset(PV_FP8)

    first = (b * HKV + hk) * SPLITS * rows + r  # split s of this row: first + s·rows
    m = tl.full([], float("-inf"), tl.float32)
    l_sum = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        smask = s0 + offs_s < SPLITS
        w = first + (s0 + offs_s) * rows
        ms = tl.load(WM + w, mask=smask, other=float("-inf"))
        ls = tl.load(WL + w, mask=smask, other=0.0)
        part = tl.load(WACC + w[:, None] * D + offs_d[None, :], mask=smask[:, None] & dmask[None, :],
                       other=0.0)
        m_new = tl.maximum(m, tl.max(ms, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        factor = tl.exp2(ms - m_safe)
        l_sum = l_sum * alpha + tl.sum(ls * factor, axis=0)
        acc = acc * alpha + tl.sum(part * factor[:, None], axis=0)
        m = m_new
    empty = l_sum == 0.0
    x = tl.load(Q + b * sqb + head * sqh + token * sqn + offs_d * sqd, mask=dmask,
                other=0.0).to(tl.float32)
    mu = tl.load(KM + (b * HKV + hk) * D + offs_d, mask=dmask, other=0.0)
    shift = tl.sum(x * mu, axis=0) * softmax_scale
    if SINK is not None:
        shift = tl.where(empty, 0.0, shift)  # μ is unset for empty sequences
        z = tl.load(SINK + head) * LOG2E_C - shift * LOG2E_C
        m_new = tl.maximum(m, z)
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.exp2(z - m_new + offset)
        acc = acc * alpha
        m = m_new
    zero = tl.zeros([], dtype=tl.float32)
    if SINK is not None:
        zero = 0.0 * l_sum  # NaN where a NaN or +inf sink leaves a row without keys undefined
    out = tl.where(empty, zero, acc / tl.where(empty, 1.0, l_sum))
    if ERR is not None:
        err = tl.load(ERR + b)
        out = tl.where(err != 0, float("nan"), out)
    o_row = (b * HKV * GROUP + head) * N + token
    tl.store(O + o_row * D + offs_d, out.to(O.dtype.element_ty), mask=dmask)

    lse = (m + tl.log2(l_sum) - offset) * LN2 + shift
    if SINK is None:
        lse = tl.where(empty, float("-inf"), lse)  # μ is unset for empty sequences
    if ERR is not None:
        lse = tl.where(err != 0, float("nan"), lse)
        if (hk == 0) & (r == 0) & (err == 0):
            tl.store(LEN + b, tl.load(LEN + b) + ADDED)
    tl.store(LSE + o_row, lse)


def split_launch(rows: int, block_d: int, open_mode: int,
                 variant: bool = False) -> tuple[int, dict]:
    """The split kernel's tile: ``(BLOCK_R, launch options)`` for ``rows`` query rows per
    (sequence, KV head). Measured on sm_90a (2026-11-25, ptxas of Triton 3.6):

    - rows per program at most 32 (16 for D = 256): a longer query chunk, a prefill through the
      cache, is cut into blocks. One tile of all its rows spilled 1.9 KB at 256 rows and 78 KB at
      2048 (D = 64); 64 rows spill on sm_89 (D = 128) and sm_120a (D = 64), 32 rows of D = 256
      on sm_120a (bf16 cache, INT8 V); at the bounds, none on sm_90a, sm_89, sm_120a, sm_100a;
    - 4 warps; 8 for an fp32 cache (the open page's TF32x3 product) and for D = 256 (4 warps
      spill there: 80-368 B);
    - with 16 rows, D ≤ 128 and one product on the open page, at most 168 registers: three
      programs per SM instead of two (65536 registers, 128 threads each), so half as many more
      pages in flight. ptxas fits those in 168 without spilling on sm_90a, sm_89, sm_120a and
      sm_100a (205 uncapped on sm_90a, D = 128); 32 rows, D = 256 or the bf16 open page's two
      products spill under the cap, and so does a ``variant`` (a local layer or a softcap:
      8-88 B, 2026-11-28), which runs uncapped."""
    block_r = min(next_pow2(rows, 16), 32 if block_d <= 128 else 16)
    if open_mode == 3 or block_d > 128:
        return block_r, {"num_warps": 8}
    if block_r == 16 and open_mode == 0 and not variant:
        return block_r, {"num_warps": 4, "maxnreg": 168}
    return block_r, {"num_warps": 4}


def split_for(page_size: int) -> tuple[int, int]:
    """``(pages per split, parts)`` of a read on the architecture kernels target: what
    ``core.measured.DECODE_SPLITS`` measured for it, else :data:`TOKENS_PER_SPLIT` keys per
    split (at least one page) and ``parts`` 0; ``parts`` > 0: each sequence's pages in that many
    splits instead (:func:`attention`)."""
    entry = measured.DECODE_SPLITS and measured.decode_split(family(get_capability()))
    tokens = (entry.tokens if entry else None) or TOKENS_PER_SPLIT
    return max(1, tokens // page_size), entry.parts if entry else 0


class Buffers(NamedTuple):
    """What one launch writes: the output and LSE, and the splits' workspace (the accumulators,
    the row maxima, the row sums, views of one allocation), for ``splits`` splits."""

    out: torch.Tensor
    lse: torch.Tensor
    wacc: torch.Tensor
    wm: torch.Tensor
    wl: torch.Tensor
    splits: int


def workspace_size(q_shape, kv_heads: int, splits: int) -> int:
    """fp32 elements of the splits' workspace for ``q_shape = (B, Hq, n, D)``."""
    bsz, hq, n, d = q_shape
    return bsz * kv_heads * splits * (hq // kv_heads) * n * (d + 2)


def buffers(q_shape, dtype, device, kv_heads: int, splits: int,
            work: torch.Tensor | None = None) -> Buffers:
    """Buffers for a launch of ``q_shape = (B, Hq, n, D)`` over ``splits`` splits: a fresh
    output and LSE, and the workspace in ``work`` (fp32, at least :func:`workspace_size`
    elements) or a fresh one."""
    bsz, hq, n, d = q_shape
    parts = workspace_size(q_shape, kv_heads, splits) // (d + 2)
    if work is None:
        work = torch.empty(parts * (d + 2), device=device, dtype=torch.float32)
    return Buffers(torch.empty(q_shape, dtype=dtype, device=device),
                   torch.empty((bsz, hq, n), device=device, dtype=torch.float32),
                   work[: parts * d], work[parts * d : parts * (d + 1)], work[parts * (d + 1) :],
                   splits)


def splits_for(tokens: int, page_size: int, pages_per_split: int) -> int:
    """Splits covering ``tokens`` keys (at least one)."""
    return max(1, -(-(-(-tokens // page_size)) // pages_per_split))


def splits_of(layer: PagedLayer, pages_per_split: int | None = None, n: int = 1,
              longest: int | None = None, parts: int = 0) -> int:
    """Splits of a read of ``n`` query tokens of ``layer`` (by default the architecture's:
    :func:`split_for`): enough for its longest sequence (``longest``, by default the host
    mirror's now); in a local layer, for the pages that the rows' keys can touch (its reach and
    the ``n`` rows, one page more for where they start). With ``parts``, at most that many."""
    if pages_per_split is None:
        pages_per_split, parts = split_for(layer.page_size)
    tokens = max(layer.host_lengths) if longest is None else longest
    back = layer.reach()
    if back is not None:
        tokens = min(tokens, back + n + layer.page_size)
    if parts:
        return min(parts, splits_for(tokens, layer.page_size, 1))
    return splits_for(tokens, layer.page_size, pages_per_split)


def attention(q: torch.Tensor, layer: PagedLayer, recipe: KVRecipe, *, scale: float,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              pages_per_split: int | None = None, parts: int = 0,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, n, D]`` (``n ≥ 1``) against one layer of the cache, the twin's
    arguments (``kvcache.naive.attention_with_kv_cache_naive``) plus ``pages_per_split`` and
    ``parts`` (default: the architecture's, :func:`split_for`): split ``s`` of a sequence covers
    its pages ``s·pages_per_split`` onwards (from its window's first page in a local layer) or,
    with ``parts`` > 0, the ``s``-th of ``parts`` runs of ``ceil(pages / parts)`` of them; either
    way the result of a sequence does not depend on the batch. Returns ``(out [B, Hq, n, D] in
    q's dtype, lse fp32 [B, Hq, n])``."""
    if pages_per_split is None:
        pages_per_split, parts = split_for(layer.page_size)
    # the grid, from the host: no sync
    splits = splits_of(layer, pages_per_split, q.shape[2], parts=parts)
    found = buffers(q.shape, q.dtype, q.device, layer.k.shape[1], splits)
    launch(q, layer, recipe, scale=scale, softcap=softcap, sinks=sinks,
           pages_per_split=pages_per_split, parts=parts, into=found)
    return found.out, found.lse


def launch(q: torch.Tensor, layer: PagedLayer, recipe: KVRecipe, *, scale: float,
           pages_per_split: int, into: Buffers, added: int = 0, replayable: bool = False,
           softcap: float | None = None, sinks: torch.Tensor | None = None,
           parts: int = 0) -> None:
    """The split and merge launches of :func:`attention`, writing ``into``'s tensors. A decode
    step's (``replayable``, ``kvcache/step.py``): the last ``added`` tokens were just stored
    and ``layer.lengths`` does not count them yet; the merge advances it, and a sequence whose
    append overflowed (``layer.overflow``) gets NaN rows. ``softcap`` (a positive float) and
    ``sinks`` (fp32 contiguous ``[Hq]``) are compile-time options of the kernels (the split
    kernel's ``SOFTCAP``, the merge's ``SINK`` None or not): off, their code is not there."""
    bsz, hq, n, d = q.shape
    hkv = layer.k.shape[1]
    group = hq // hkv
    rows = group * n
    page = layer.page_size
    pv_fp8 = recipe.pv == "fp8"
    interpreted = interpreter_enabled()
    open_mode = 0  # how the open page's P̃·V stays exact: see the kernel
    if interpreted:
        open_mode = 1
    elif layer.v_open.dtype == torch.float32:
        open_mode = 3  # an IEEE fp32 product (FMA loop) spills about 5 KB (ptxas, sm_90a, D=128)
    elif not pv_fp8 and layer.v_open.dtype == torch.bfloat16:
        open_mode = 2  # one fp32 FMA product there spills (ptxas, sm_90a, D=128)
    q_strides = strides(q, 4)
    cap2, two_over = cap_args(softcap or 0.0)
    block_d = next_pow2(d, 32)  # INT8 MMA: k ≥ 32
    block_r, options = split_launch(rows, block_d, open_mode,
                                    variant=layer.local or softcap is not None)
    row_blocks = -(-rows // block_r)
    _decode_split_kernel[(bsz * row_blocks, hkv, into.splits)](
        Q=q, AQ=layer.q_amax, AK=layer.k_amax, KM=layer.k_mean, K=layer.k, KS=layer.k_scale,
        V=layer.v, VS=layer.v_scale, VO=layer.v_open, BT=layer.block_table, LEN=layer.lengths,
        WACC=into.wacc, WM=into.wm, WL=into.wl, q_strides=q_strides,
        qk_multiplier=scale * LOG2E, cap2=cap2, two_over=two_over,
        LEFT=UNBOUNDED if layer.window is None else layer.window,
        CHUNK=UNBOUNDED if layer.chunk is None else layer.chunk, N=n, GROUP=group, D=d, HKV=hkv,
        MAX_PAGES=layer.block_table.shape[1], pages_per_split=pages_per_split, ADDED=added,
        ROW_BLOCKS=row_blocks, PAGE=page, PV_FP8=pv_fp8, EXACT_FP8=exact_fp8(), OPEN_MODE=open_mode,
        EMU_FP32=interpreted, STAGES=STAGES, LOCAL=layer.local, SOFTCAP=softcap is not None,
        PARTS=parts,
        BLOCK_R=block_r,
        BLOCK_P=next_pow2(page, 32 if pv_fp8 else 16), BLOCK_D=block_d,
        **options,
    )
    _decode_merge_kernel[(rows, hkv, bsz)](  # rows on axis 0: up to 2^31 (a long prefill)
        Q=q, KM=layer.k_mean, SINK=sinks, WACC=into.wacc, WM=into.wm, WL=into.wl, O=into.out, LSE=into.lse,
        LEN=layer.lengths, ERR=layer.overflow if replayable else None, q_strides=q_strides,
        softmax_scale=scale, N=n, GROUP=group, D=d, HKV=hkv, SPLITS=into.splits, ADDED=added,
        PV_FP8=pv_fp8, BLOCK_S=MERGE_SPLITS, BLOCK_D=block_d,
    )

"""The LLM attention variants (issue 44): sliding windows, chunked local attention, soft-capping
and attention sinks. The reference path and the twins against float64 exact attention with the
mask built here, independently; the window and chunk rules against transformers' own mask
functions; the Triton kernels bit for bit with their twins under the interpreter; the key blocks
a windowed query block visits; the argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import lowbit_attn
from helpers import assert_bits, channel_biased, exact64, independent_mask
from lowbit_attn.core.triton_helpers import (
    window_block_bounds, window_limits, window_query_bounds,
)
from lowbit_attn.core.variants import (
    Variant, check, key_block_range, key_blocks_visited, query_block_range,
)


CASES = [
    # (b, hq, hkv, nq, nk, d, causal, window, softcap, sinks, chunk)
    pytest.param(1, 2, 1, 37, 53, 40, False, (5, 3), None, False, None, id="win5-3-GQA-Nq<Nk"),
    pytest.param(1, 2, 2, 45, 45, 64, True, (7, -1), None, False, None, id="win7-causal"),
    pytest.param(2, 2, 1, 29, 61, 32, True, None, None, False, 16, id="chunk16-causal"),
    pytest.param(1, 4, 2, 33, 33, 64, False, None, 5.0, False, None, id="softcap5"),
    pytest.param(1, 3, 1, 31, 47, 48, True, None, None, True, None, id="sinks-causal"),
    pytest.param(1, 2, 1, 50, 30, 32, False, (3, 2), 2.0, True, 8, id="all-Nq>Nk"),
    pytest.param(1, 2, 2, 40, 70, 64, False, (-1, 4), None, True, None, id="right4-sinks"),
]


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,causal,window,softcap,sinks,chunk", CASES)
@pytest.mark.parametrize("recipe,atol", [("exact", 2e-6), ("qk_int8_pv_fp16", 0.05),
                                         ("qk_int8_pv_fp8", 0.15), ("qk_fp4_pv_fp4", 0.8)])
def test_reference_against_float64(b, hq, hkv, nq, nk, d, causal, window, softcap, sinks, chunk,
                                   recipe, atol, monkeypatch):
    """The PyTorch path (the twins; float32 exact) against float64 with the mask built here."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    if recipe == "qk_fp4_pv_fp4" and d % 32:
        d = 64
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + nk, bias=2.0)
    s = torch.randn(hq) * 2 if sinks else None
    mask = independent_mask(nq, nk, causal=causal, window=window, chunk=chunk)
    o, lse = lowbit_attn.attention(q, k, v, is_causal=causal, window=window, softcap=softcap,
                                   sinks=s, chunk=chunk, recipe=recipe, return_lse=True)
    want, want_lse = exact64(q, k, v, mask, scale=d ** -0.5, softcap=softcap, sinks=s)
    err = (o.double() - want).abs().max().item()
    assert err <= atol * max(1.0, want.abs().max().item()), err
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    lse_err = (lse.double() - want_lse)[seen].abs().max().item() if seen.any() else 0.0
    assert lse_err <= max(atol, 1e-5) * 4, lse_err
    empty = ~mask.any(-1)
    if empty.any():  # rows that see no key: 0, with or without a sink
        assert torch.all(o[:, :, empty] == 0)


def test_fully_masked_rows_behave_as_causal_ones(monkeypatch):
    """A non-causal window with Nq > Nk leaves the first rows without a key: they give 0 and LSE
    -inf, as the causal mask's empty rows do; with sinks 0 and the sink's logit."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    q, k, v = channel_biased((1, 2, 20, 32), (1, 2, 6, 32), seed=3)
    o, lse = lowbit_attn.attention(q, k, v, window=(0, 0), return_lse=True,
                                   recipe="qk_int8_pv_fp16")
    oc, lsec = lowbit_attn.attention(q, k, v, is_causal=True, return_lse=True,
                                     recipe="qk_int8_pv_fp16")
    assert torch.all(o[:, :, :14] == 0) and torch.all(oc[:, :, :14] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :14])) and torch.all(torch.isneginf(lsec[:, :, :14]))
    s = torch.tensor([0.5, -1.0])
    o, lse = lowbit_attn.attention(q, k, v, window=(0, 0), sinks=s, return_lse=True)
    assert torch.all(o[:, :, :14] == 0)
    torch.testing.assert_close(lse[0, :, :14], s[:, None].expand(2, 14), atol=1e-5, rtol=0)


def test_nan_is_not_hidden(monkeypatch):
    """A NaN in a visible key reaches the rows that see it, not the others."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    q, k, v = channel_biased((1, 1, 16, 32), (1, 1, 16, 32), seed=5)
    k[0, 0, 3, 0] = float("nan")
    o = lowbit_attn.attention(q, k, v, window=(2, 0), is_causal=True, softcap=4.0,
                              sinks=torch.zeros(1), recipe="exact")
    sees = independent_mask(16, 16, causal=True, window=(2, 0))[:, 3]
    assert torch.all(torch.isnan(o[0, 0, sees]).any(-1))
    assert not torch.isnan(o[0, 0, ~sees]).any()


# --- the window and chunk rules against transformers' mask functions -------------------------

def _theirs(fn, nq, nk, past=0):
    """A transformers mask function (index tensors, broadcast) as a boolean ``[nq, nk]``."""
    zero = torch.tensor(0)
    i = torch.arange(nq)[:, None] + past
    j = torch.arange(nk)[None, :]
    return torch.as_tensor(fn(zero, zero, i, j)).expand(nq, nk)


@pytest.mark.parametrize("w", [1, 3, 8])
def test_sliding_window_matches_transformers(w):
    mu = pytest.importorskip("transformers.masking_utils")
    nq = nk = 19
    fn = mu.sliding_window_causal_mask_function(w)
    theirs = _theirs(fn, nq, nk)
    v = check(is_causal=True, window=(w - 1, 0), softcap=None, chunk=None, sinks=None, hq=1,
              device=torch.device("cpu"))
    assert torch.equal(v.visible(torch.arange(nq), torch.arange(nk), 0), theirs)
    assert torch.equal(independent_mask(nq, nk, causal=True, window=(w - 1, 0)), theirs)


@pytest.mark.parametrize("c", [1, 4, 7])
@pytest.mark.parametrize("past", [0, 5])
def test_chunk_matches_transformers(c, past):
    """Llama 4's chunked attention, queries at absolute positions ``past + i`` (a KV cache)."""
    mu = pytest.importorskip("transformers.masking_utils")
    nq, nk = 13, 13 + past
    fn = mu.chunked_causal_mask_function(c, torch.zeros(1, dtype=torch.long))
    theirs = _theirs(fn, nq, nk, past)
    v = check(is_causal=True, window=None, softcap=None, chunk=c, sinks=None, hq=1,
              device=torch.device("cpu"))
    assert torch.equal(v.visible(torch.arange(nq), torch.arange(nk), nk - nq), theirs)


def test_bidirectional_window_matches_transformers():
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "sliding_window_bidirectional_mask_function"):
        pytest.skip("no bidirectional sliding window in this transformers")
    fn = mu.sliding_window_bidirectional_mask_function(3)
    theirs = _theirs(fn, 17, 17)
    v = check(is_causal=False, window=(3, 3), softcap=None, chunk=None, sinks=None, hq=1,
              device=torch.device("cpu"))
    assert torch.equal(v.visible(torch.arange(17), torch.arange(17), 0), theirs)


# --- the key-block ranges ----------------------------------------------------------------------

def _range_cases():
    for nq, nk in ((1, 1), (37, 53), (64, 64), (200, 70), (70, 200)):
        for left, right, chunk in ((-1, -1, 0), (-1, 0, 0), (5, 0, 0), (0, 0, 0), (40, 3, 0),
                                   (-1, 7, 0), (130, -1, 0), (-1, 0, 16), (-1, -1, 50),
                                   (9, 0, 32), (3, 2, 8), (-1, -1, 1)):
            yield nq, nk, left, right, chunk


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64)])
def test_block_range_covers_exactly_the_visible_keys(block_m, block_n):
    """Every visible key lies in ``[lo, hi)``; every key of ``[full_lo, full_hi)`` is visible to
    every row of the block; ``lo <= full_lo <= full_hi``; no block outside the union is
    visited."""
    for nq, nk, left, right, chunk in _range_cases():
        v = Variant(left=left, right=right, chunk=chunk)
        mask = v.visible(torch.arange(nq + block_m), torch.arange(nk), nk - nq)
        for row_lo in range(0, nq, block_m):
            rows = mask[row_lo:row_lo + block_m]
            lo, flo, fhi, hi = key_block_range(nk, row_lo, row_lo + block_m, nk - nq, left,
                                               right, chunk, block_n)
            assert lo % block_n == 0 and flo % block_n == 0 and fhi % block_n == 0
            assert lo <= flo <= fhi
            seen = rows.any(0).nonzero().flatten()
            if len(seen):
                assert lo <= seen.min() and seen.max() < hi
                assert seen.min() - lo < block_n and hi - seen.max() - 1 < block_n
            assert torch.all(rows[:, flo:fhi])
            assert fhi <= nk


def test_window_cost_is_proportional_to_the_window():
    """A 512-key window over 16k keys: each 128-row query block visits at most
    ceil((512 + 128) / 64) + 1 key blocks of 64, not 16384 / 64."""
    n, bm, bn = 16384, 128, 64
    v = check(is_causal=True, window=(511, 0), softcap=None, chunk=None, sinks=None, hq=1,
              device=torch.device("cpu"))
    counts = key_blocks_visited(n, n, v, bm, bn)
    assert max(counts) <= math.ceil((512 + bm) / bn) + 1
    causal = key_blocks_visited(n, n, Variant(right=0), bm, bn)
    assert max(causal) == n // bn
    chunked = key_blocks_visited(n, n, Variant(right=0, chunk=1024), bm, bn)
    assert max(chunked) <= 1024 // bn


# --- argument checks ---------------------------------------------------------------------------

BAD = [
    pytest.param(dict(window=(-2, 0)), ValueError, "window\\[0\\]", id="left-2"),
    pytest.param(dict(window=(3, -5)), ValueError, "window\\[1\\]", id="right-5"),
    pytest.param(dict(window=(1.5, 0)), TypeError, "window\\[0\\]", id="left-float"),
    pytest.param(dict(window=(True, 0)), TypeError, "window\\[0\\]", id="left-bool"),
    pytest.param(dict(window=3), TypeError, "window must be", id="window-int"),
    pytest.param(dict(window=(1, 2, 3)), TypeError, "window must be", id="window-3"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-neg"),
    pytest.param(dict(softcap=float("inf")), ValueError, "softcap", id="softcap-inf"),
    pytest.param(dict(softcap=float("nan")), ValueError, "softcap", id="softcap-nan"),
    pytest.param(dict(softcap="2"), TypeError, "softcap", id="softcap-str"),
    # outside float32's normal range once log2 e is folded in: an OverflowError, or NaN, before
    pytest.param(dict(softcap=10**400), ValueError, "softcap must be a positive finite",
                 id="softcap-huge-int"),
    pytest.param(dict(softcap=1e39), ValueError, "softcap must be between 2\\*\\*-125",
                 id="softcap-1e39"),
    pytest.param(dict(softcap=1e8), ValueError, r"softcap must be between 2\*\*-125 and 2\*\*16",
                 id="softcap-1e8"),
    pytest.param(dict(softcap=1e-40), ValueError, r"softcap must be between 2\*\*-125 and 2\*\*16",
                 id="softcap-1e-40"),
    pytest.param(dict(scale=1e39), ValueError, "scale must be between 2\\*\\*-125",
                 id="scale-1e39"),
    pytest.param(dict(scale=1e-45), ValueError, "scale must be between", id="scale-1e-45"),
    pytest.param(dict(chunk=0), ValueError, "chunk", id="chunk-0"),
    pytest.param(dict(chunk=-4), ValueError, "chunk", id="chunk-neg"),
    pytest.param(dict(chunk=4.0), TypeError, "chunk", id="chunk-float"),
    pytest.param(dict(sinks=torch.zeros(3)), ValueError, "sinks must have shape \\(2,\\)",
                 id="sinks-shape"),
    pytest.param(dict(sinks=torch.zeros(2, dtype=torch.float64)), TypeError, "sinks must be",
                 id="sinks-dtype"),
    pytest.param(dict(sinks=[0.0, 0.0]), TypeError, "sinks must be a torch.Tensor",
                 id="sinks-list"),
    pytest.param(dict(sinks=torch.zeros(2, device="meta")), ValueError, "sinks must be on",
                 id="sinks-device"),
]


@pytest.mark.parametrize("kw,exc,match", BAD)
def test_bad_arguments(kw, exc, match):
    q, k, v = channel_biased((1, 2, 8, 32), (1, 1, 8, 32), seed=1)
    with pytest.raises(exc, match=match):
        lowbit_attn.attention(q, k, v, **kw)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(exc, match=match):
        lowbit_attn.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                     v[0].transpose(0, 1), cu, cu, 8, 8, **kw)


def test_no_window_is_plain_attention(monkeypatch):
    """``(-1, -1)``, softcap 0 and ``(-1, 0)`` are plain and plain causal attention: the same
    bits."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    q, k, v = channel_biased((1, 2, 24, 32), (1, 2, 30, 32), seed=2)
    base = lowbit_attn.attention(q, k, v)
    assert_bits(lowbit_attn.attention(q, k, v, window=(-1, -1), softcap=0.0), base, "plain")
    causal = lowbit_attn.attention(q, k, v, is_causal=True)
    assert_bits(lowbit_attn.attention(q, k, v, window=(-1, 0)), causal, "(-1, 0)")
    assert_bits(lowbit_attn.attention(q, k, v, window=(-1, 5), is_causal=True), causal, "causal")


# --- the Triton kernels against their twins (the interpreter on a CPU) -------------------------

KERNEL_VARIANTS = [
    pytest.param(Variant(left=5, right=3), False, id="win5-3"),
    pytest.param(Variant(left=20, right=0, chunk=32), False, id="win20-causal-chunk32"),
    pytest.param(Variant(softcap=2.0), False, id="softcap2"),
    pytest.param(Variant(right=0, softcap=3.0, sinks=True), True, id="causal-softcap-sinks"),
    pytest.param(Variant(left=4, right=2, chunk=8, softcap=1.5, sinks=True), True, id="all"),
]
KERNEL_SHAPES = [
    pytest.param(1, 2, 1, 45, 70, 40, id="GQA2:1-Nq45-Nk70-D40"),
    pytest.param(2, 1, 1, 70, 33, 64, id="B2-Nq70>Nk33-D64"),
]


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", KERNEL_SHAPES)
@pytest.mark.parametrize("variant,with_sinks", KERNEL_VARIANTS)
@pytest.mark.parametrize("pv", ["fp16", "fp8"])
@pytest.mark.parametrize("granularity", ["per_block", "per_token", "per_thread"])
def test_int8_kernel_matches_twin(b, hq, hkv, nq, nk, d, variant, with_sinks, pv, granularity,
                                  device):
    """The INT8 kernel and ``naive.quantized_attention`` on the same quantized inputs (smoothed
    K and V, so the sinks' V-mean weighting and the softcap's shift are exercised), within the
    existing kernel test's rounding bounds (exp2 differs in the last bit between
    implementations)."""
    from lowbit_attn import get_recipe
    from lowbit_attn.inference import kernel_int8
    from lowbit_attn.inference.naive import quantized_attention
    from lowbit_attn.inference.prepare import quantize_qkv
    from helpers import Bound, assert_within

    recipe = get_recipe(f"qk_int8_pv_{pv}").replace(granularity=granularity, block_q=16,
                                                     block_k=16, smooth_v=True)
    device.needs(recipe)
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + nk, device=device.name)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)).to(device.name)
    sinks = sinks if with_sinks else None
    qz = quantize_qkv(q, k, v, recipe, d ** -0.5, need_lse_shift=True, backend="reference")
    co = nk - nq if variant.causal else None
    want, want_lse = quantized_attention(qz, pv=pv, granularity=granularity, block_q=16,
                                         block_k=16, causal_offset=co, variant=variant,
                                         sinks=sinks)
    out = torch.empty(qz.q.shape, device=device.name)
    lse = kernel_int8.attention(qz, out=out, pv=pv, granularity=granularity, block_q=16,
                                block_k=16, causal_offset=co, return_lse=True, variant=variant,
                                sinks=sinks)
    # one P̃ that crosses an fp16 (2^-11) or E4M3 (2^-4) rounding boundary moves an output by
    # about that step of its weight; short windows leave few keys to average it
    bound = Bound(atol=1e-3 if pv == "fp16" else 4e-3, cos=0.999999)
    assert_within(out, want, device.bound(f"int8 out {pv}", bound), name="out")
    assert_within(lse, want_lse, device.bound("lse", Bound(atol=1e-5, rtol=1e-5)), name="lse")


@pytest.mark.parametrize("variant,with_sinks", KERNEL_VARIANTS)
@pytest.mark.parametrize("name", ["qk_fp4_pv_fp4", "qk_mxfp4_pv_mxfp4"])
def test_fp4_kernel_matches_twin(variant, with_sinks, name, device):
    from lowbit_attn import get_recipe
    from lowbit_attn.inference import kernel_fp4
    from lowbit_attn.inference.naive import fp4_attention
    from lowbit_attn.inference.prepare import quantize_qkv_fp4
    from helpers import Bound, assert_within

    b, hq, hkv, nq, nk, d = 1, 2, 1, 45, 150, 64
    recipe = get_recipe(name).replace(smooth_v=True)
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=7, device=device.name)
    sinks = torch.tensor([0.7, -2.0], device=device.name) if with_sinks else None
    qz = quantize_qkv_fp4(q, k, v, recipe, d ** -0.5, need_lse_shift=True, backend="reference")
    co = nk - nq if variant.causal else None
    kw = dict(head_dim=d, block_q=recipe.block_q, block_k=recipe.block_k, causal_offset=co,
              two_level=recipe.two_level_p, variant=variant, sinks=sinks)
    want, want_lse = fp4_attention(qz, **kw)
    out = torch.empty(b, hq, nq, d, device=device.name)
    lse = kernel_fp4.attention(qz, out=out, return_lse=True, **kw)
    assert_within(out, want, device.bound("fp4 out", Bound(atol=2e-3, cos=0.99999)), name="out")
    assert_within(lse, want_lse, device.bound("lse", Bound(atol=1e-5, rtol=1e-5)), name="lse")


VARLEN_VARIANTS = [
    pytest.param(dict(window=(6, 0), is_causal=True), id="win6-causal"),
    pytest.param(dict(window=(3, 5), softcap=4.0), id="win3-5-softcap"),
    pytest.param(dict(chunk=16, is_causal=True, sinks=True), id="chunk16-sinks"),
]


@pytest.mark.parametrize("kw", VARLEN_VARIANTS)
def test_varlen_kernel_matches_reference(kw, monkeypatch, device):
    """Packed sequences of different lengths (``Nq != Nk`` each), every sequence aligned
    bottom-right on its own: the packed kernel against the twin run one sequence at a time."""
    kw = dict(kw)
    lens_q, lens_k = [5, 40, 17], [30, 40, 9]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), 4, 32, generator=g).to(device.name, torch.float16)
    k = (torch.randn(sum(lens_k), 2, 32, generator=g) + 2).to(device.name, torch.float16)
    v = torch.randn(sum(lens_k), 2, 32, generator=g).to(device.name, torch.float16)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device.name)
    cu_q = torch.tensor([0, 5, 45, 62], dtype=torch.int32, device=device.name)
    cu_k = torch.tensor([0, 30, 70, 79], dtype=torch.int32, device=device.name)
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        results.append(lowbit_attn.attention_varlen(q, k, v, cu_q, cu_k, 40, 40, return_lse=True,
                                                    recipe="qk_int8_pv_fp16", **kw))
    (want, want_lse), (got, got_lse) = results
    torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=0)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), seen)
    torch.testing.assert_close(got_lse[seen], want_lse[seen], atol=1e-3, rtol=0)


@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp8", "qk_fp4_pv_fp4"])
def test_public_call_triton_equals_reference(recipe, monkeypatch, device):
    """The public call's routing (K smoothing's shift computed for softcap and sinks without
    ``return_lse``; NHD layout; GQA) on both backends."""
    q, k, v = channel_biased((1, 4, 50, 64), (1, 2, 90, 64), seed=9, dtype=torch.float16,
                             device=device.name)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    kw = dict(window=(30, 0), is_causal=True, softcap=5.0, chunk=64, layout="NHD",
              sinks=torch.tensor([1.0, 0.0, -1.0, 3.0], device=device.name), recipe=recipe)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    want = lowbit_attn.attention(q, k, v, **kw)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    got = lowbit_attn.attention(q, k, v, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=0)


# --- the kernels' block range is key_block_range ----------------------------------------------

@triton.jit
def _bounds_kernel(OUT, nk, offset, left, right, chunk, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = window_block_bounds(nk, pid, offset, left, right, chunk,
                                                   BLOCK_M, BLOCK_N)
    tl.store(OUT + pid * 4 + 0, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


@triton.jit
def _query_bounds_kernel(OUT, nq, offset, left, right, chunk, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    lo, hi = window_query_bounds(nq, pid, offset, left, right, chunk, BLOCK_N, BLOCK_M)
    tl.store(OUT + pid * 2 + 0, lo)
    tl.store(OUT + pid * 2 + 1, hi)


@triton.jit
def _limits_kernel(OUT, nq, nk, offset, left, right, chunk, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    first, last = window_limits(r, offset, left, right, chunk, nk)
    c = tl.arange(0, BLOCK)
    seen = (c[None, :] >= first[:, None]) & (c[None, :] <= last[:, None])
    tl.store(OUT + r[:, None] * BLOCK + c[None, :], seen.to(tl.int8),
             mask=(r[:, None] < nq) & (c[None, :] < nk))


@pytest.mark.interpreter
def test_window_limits_are_the_visibility_rule():
    """``triton_helpers.window_limits`` (the sm90 forward's edge-block mask: two limits per row)
    sees exactly the keys :meth:`Variant.visible` does, keys past the end unseen."""
    for nq, nk, left, right, chunk in _range_cases():
        out = torch.zeros(256, 256, dtype=torch.int8)
        _limits_kernel[(1,)](out, nq, nk, nk - nq, left, right, chunk, BLOCK=256)
        want = Variant(left=left, right=right, chunk=chunk).visible(
            torch.arange(nq), torch.arange(nk), nk - nq)
        assert torch.equal(out[:nq, :nk].bool(), want), (nq, nk, left, right, chunk)


@pytest.mark.interpreter
def test_kernel_block_bounds_are_the_python_formula():
    """``triton_helpers.window_block_bounds`` (what the kernels' loops run), launched for every
    query block, gives :func:`key_block_range`'s four numbers."""
    for bm, bn in ((16, 16), (32, 16), (16, 64)):
        for nq, nk, left, right, chunk in _range_cases():
            blocks = -(-nq // bm)
            out = torch.empty(blocks, 4, dtype=torch.int32)
            _bounds_kernel[(blocks,)](out, nk, nk - nq, left, right, chunk, BLOCK_M=bm, BLOCK_N=bn)
            want = [key_block_range(nk, p * bm, (p + 1) * bm, nk - nq, left, right, chunk, bn)
                    for p in range(blocks)]
            assert out.tolist() == [list(w) for w in want], (nq, nk, left, right, chunk, bm, bn)
            kblocks = -(-nk // bn)
            out = torch.empty(kblocks, 2, dtype=torch.int32)
            _query_bounds_kernel[(kblocks,)](out, nq, nk - nq, left, right, chunk, BLOCK_N=bn,
                                             BLOCK_M=bm)
            want = [query_block_range(nq, p * bn, (p + 1) * bn, nk - nq, left, right, chunk, bm)
                    for p in range(kblocks)]
            assert out.tolist() == [list(w) for w in want], (nq, nk, left, right, chunk, bm, bn)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 64), (16, 64)])
def test_query_range_covers_the_rows_that_see_a_key_block(block_m, block_n):
    """The trainable backward's dK/dV loop: every row that sees a key of the block lies in
    ``[lo, hi)``, and ``lo`` is within one query block of the first such row."""
    for nq, nk, left, right, chunk in _range_cases():
        v = Variant(left=left, right=right, chunk=chunk)
        mask = v.visible(torch.arange(nq), torch.arange(nk), nk - nq)
        for col_lo in range(0, nk, block_n):
            lo, hi = query_block_range(nq, col_lo, col_lo + block_n, nk - nq, left, right, chunk,
                                       block_m)
            seen = mask[:, col_lo:col_lo + block_n].any(1).nonzero().flatten()
            assert lo % block_m == 0
            if len(seen):
                assert lo <= seen.min() and seen.max() < hi and seen.min() - lo < block_m


@pytest.mark.aot
def test_aot_compiles_the_variants():
    """The variants' kernels compile for sm_90a (INT8) without spills."""
    from lowbit_attn.tools import aot

    v = Variant(left=511, right=0, chunk=1024, softcap=30.0, sinks=True)
    report = aot.compile_recipe("qk_int8_pv_fp8", "sm_90a", variant=v, return_lse=True)[-1]
    assert report.error is None, report.error
    assert report.kernel == "_attn_fwd_int8_kernel" and report.spill_stores == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["sm90", "gluon"])
def test_the_sm90_forward_routes_variants(kernel, monkeypatch):
    """With the sm90 forward chosen (``sm90``, or ``gluon``: Hopper's Gluon forward is the sm90
    one) and applying, as on an H100: it takes a window, chunk or sinks but not softcap (a tanh
    per score); softcap runs the Triton kernel, never a forward with the variant dropped."""
    from lowbit_attn.inference import gluon_fp4_check, kernel_int8, sm90_check

    taken = []

    def boom(*args, **kwargs):
        if "variant" in kwargs:
            taken.append(kwargs["variant"])
            return None
        raise AssertionError(f"the {kernel} forward ran without the variant")

    for mod in (sm90_check, gluon_fp4_check):
        monkeypatch.setattr(mod, "attention", boom)
    monkeypatch.setattr(sm90_check, "applies", lambda device: True)
    monkeypatch.setattr(sm90_check, "wanted", lambda *a, **k: True)
    monkeypatch.setattr(sm90_check, "admitted", lambda device: True)
    ran = []
    real = kernel_int8.attention
    monkeypatch.setattr(kernel_int8, "attention", lambda *a, **k: ran.append(k) or real(*a, **k))
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", kernel)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    q, k, v = channel_biased((1, 2, 20, 64), (1, 2, 30, 64), seed=6, dtype=torch.float16)
    for kw in (dict(window=(4, 0)), dict(softcap=5.0), dict(sinks=torch.zeros(2)),
               dict(chunk=8)):
        lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8", **kw)
        if "softcap" not in kw:
            assert not taken[-1].plain and taken[-1].softcap == 0
        else:
            assert not ran[-1]["variant"].plain
    assert len(taken) == 3 and len(ran) == 1


@pytest.mark.parametrize("recipe", ["exact", "qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_an_infinite_sink_is_not_hidden(recipe):
    """A sink of +inf leaves its head's rows undefined: NaN in every recipe (``exact`` gave the
    unnormalised sum of its keys before), the other head untouched."""
    q, k, v = channel_biased((1, 2, 16, 32), (1, 2, 16, 32), seed=3)
    sinks = torch.tensor([float("inf"), 0.5])
    out = lowbit_attn.attention(q, k, v, recipe=recipe, sinks=sinks)
    assert out[0, 0].isnan().all()
    want = lowbit_attn.attention(q, k, v, recipe=recipe, sinks=torch.tensor([0.0, 0.5]))
    assert torch.equal(out[0, 1], want[0, 1])


@pytest.mark.parametrize("recipe", ["exact", "qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_a_nan_sink_is_not_hidden_on_rows_that_see_no_key(recipe):
    """A NaN sink makes its head's rows NaN in every recipe, the rows that see no key included
    (``exact`` gave them 0 before: no visible term carried the NaN); the other head's rows that
    see no key stay 0, with the sink as their LSE."""
    q, k, v = channel_biased((1, 2, 6, 32), (1, 2, 2, 32), seed=6)
    out, lse = lowbit_attn.attention(q, k, v, is_causal=True, recipe=recipe, return_lse=True,
                                     sinks=torch.tensor([float("nan"), 0.25]))
    assert out[0, 0].isnan().all() and lse[0, 0].isnan().all()
    assert torch.equal(out[0, 1, :4], torch.zeros(4, 32))  # rows 0-3 see no key (bottom-right)
    torch.testing.assert_close(lse[0, 1, :4], torch.full((4,), 0.25), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["reference",
                                     pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("recipe", ["exact", "qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_a_nan_sink_is_not_hidden_on_a_packed_sequence_without_keys(recipe, backend, monkeypatch):
    """The same over packed sequences, one of which has no key: its rows are NaN under the NaN
    sink (the twins gave 0 before; the kernels NaN), 0 under the other, LSE the sink."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(5, 2, 32, generator=g).half()
    k = torch.randn(3, 2, 32, generator=g).half()
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 5], [0, 3, 3]))
    sinks = torch.tensor([float("nan"), 0.25])
    out, lse = lowbit_attn.attention_varlen(q, k, k, cu_q, cu_k, 3, 3, recipe=recipe,
                                            return_lse=True, sinks=sinks)
    assert out[:, 0].isnan().all() and lse[0].isnan().all()
    assert torch.equal(out[2:, 1].float(), torch.zeros(3, 32))
    torch.testing.assert_close(lse[1, 2:], torch.full((3,), 0.25), atol=1e-5, rtol=0)

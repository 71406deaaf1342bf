"""lowbit_attn.compat.flash_attn_interface: FlashAttention 3's signatures (a pinned copy), its
windows, chunks, softcap and LSE checked against float64 attention with masks built here from
FlashAttention 3's rules, gradients through the trainable attention, the GQA-packed qkv, and the
refusals."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from helpers import assert_close, channel_biased, independent_mask, exact64_nhd
from lowbit_attn.compat import flash_attn_interface as fa3

E = inspect.Parameter.empty
PK, KO = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
DESCALES = [("q_descale", PK, None), ("k_descale", PK, None), ("v_descale", PK, None)]
OURS = [("recipe", KO, "auto"), ("train_recipe", KO, "sagebwd_int8")]


def _pos(*names):
    return [(n, PK, E) for n in names]


def _defaults(*pairs):
    return [(n, PK, d) for n, d in pairs]


# FlashAttention 3 (Dao-AILab/flash-attention, hopper/flash_attn_interface.py at 0251105, 2.8.4):
# name, kind and default of every parameter, in order; then our two keyword-only ones.
MIDDLE = DESCALES + _defaults(("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                              ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
                              ("sm_margin", 0), ("return_attn_probs", False))
PINNED = {
    "flash_attn_func": _pos("q", "k", "v") + _defaults(
        ("softmax_scale", None), ("causal", False), ("qv", None)) + MIDDLE + OURS,
    "flash_attn_varlen_func": _pos("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                   "max_seqlen_k") + _defaults(
        ("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False),
        ("qv", None)) + MIDDLE + OURS,
    "flash_attn_qkvpacked_func": _pos("qkv") + _defaults(("softmax_scale", None), ("causal", False))
    + DESCALES + _defaults(("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                           ("deterministic", False), ("num_heads_q", None), ("sm_margin", 0),
                           ("return_attn_probs", False)) + OURS,
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_signature_is_flash_attention_3s(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == PINNED[name]


def test_every_pinned_function_is_exported():
    assert sorted(fa3.__all__) == sorted(PINNED)


def _visible(nq: int, nk: int, causal: bool, window, chunk: int = 0) -> torch.Tensor:
    """``[nq, nk]`` bool as FlashAttention 3's ``mask.h`` and ``flash_api.cpp`` read the
    arguments: a negative side unbounded (its ``Nk - 1`` / ``Nq - 1`` bound nothing), causal
    sets the right side to 0, a chunk keeps ``[⌊p/C⌋·C, ⌊p/C⌋·C + C)``, ``p = i + nk - nq``:
    the rule of :func:`helpers.independent_mask`."""
    return independent_mask(nq, nk, causal=causal, window=tuple(max(x, -1) for x in window),
                            chunk=chunk or None)


def _qkv(nq, nk, hq=4, hkv=2, d=64, seed=0):
    q, k, v = channel_biased((2, hq, nq, d), (2, hkv, nk, d), seed=seed)
    return (x.transpose(1, 2).contiguous() for x in (q, k, v))  # NHD


VARIANTS = [
    dict(), dict(causal=True), dict(window=(16, 8)), dict(window=(16, -1)), dict(window=(-1, 5)),
    dict(window=(-7, 30)), dict(causal=True, window=(24, -3)), dict(chunk=32),
    dict(causal=True, chunk=24), dict(window=(10, 10), chunk=32), dict(softcap=5.0),
    dict(softcap=-3.0, causal=True),
]


@pytest.mark.parametrize("nq,nk", [(96, 96), (40, 96), (96, 40)])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_exact_recipe_is_flash_attention_3s_definition(nq, nk, variant):
    q, k, v = _qkv(nq, nk)
    causal, window = variant.get("causal", False), variant.get("window", (-1, -1))
    chunk, softcap = variant.get("chunk", 0), variant.get("softcap", 0.0)
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                   attention_chunk=chunk, softcap=softcap,
                                   return_attn_probs=True, recipe="exact")
    ref, ref_lse = exact64_nhd(q, k, v, _visible(nq, nk, causal, window, chunk),
                               softcap=max(softcap, 0.0))  # <= 0: off
    assert out.shape == q.shape and lse.shape == (2, 4, nq)
    assert_close(out.double(), ref, atol=2e-5)
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)  # rows that see no key: -inf
    assert_close(lse.double().nan_to_num(neginf=0), ref_lse.nan_to_num(neginf=0), atol=2e-5)


def test_gqa_packed_qkv_splits_its_heads_as_flash_attention_3():
    q, k, v = _qkv(48, 48, hq=6, hkv=2)
    want = fa3.flash_attn_func(q, k, v, causal=True, recipe="exact")
    got = fa3.flash_attn_qkvpacked_func(torch.cat([q, k, v], dim=2), causal=True, num_heads_q=6,
                                        recipe="exact")
    assert torch.equal(got, want)
    q, k, v = _qkv(48, 48, hq=2, hkv=2)
    got = fa3.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), window_size=(8, 8),
                                        recipe="exact")
    assert torch.equal(got, fa3.flash_attn_func(q, k, v, window_size=(8, 8), recipe="exact"))
    for heads in (5, 10, 0):
        with pytest.raises(ValueError, match="num_heads_q must leave an even, positive"):
            fa3.flash_attn_qkvpacked_func(torch.randn(1, 8, 10, 16), num_heads_q=heads)
    with pytest.raises(TypeError, match=r"num_heads_q \(for a 4-D qkv\) must be an int"):
        fa3.flash_attn_qkvpacked_func(torch.randn(1, 8, 10, 16))


def test_varlen_is_each_sequence():
    g = torch.Generator().manual_seed(3)
    lengths_q, lengths_k = [30, 0, 17, 50], [40, 9, 0, 50]
    q = torch.randn(sum(lengths_q), 4, 32, generator=g)
    k, v = (torch.randn(sum(lengths_k), 2, 32, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 50, 50, causal=True,
                                          window_size=(12, -1), attention_chunk=16,
                                          return_attn_probs=True, recipe="exact")
    assert lse.shape == (4, q.shape[0])
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(bq, bq[1:], bk, bk[1:]):
        if q1 > q0:
            seen = _visible(q1 - q0, k1 - k0, True, (12, -1), 16)
            ref, ref_lse = exact64_nhd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], seen)
            assert_close(out[q0:q1].double(), ref[0], atol=2e-5)
            assert torch.equal(lse[:, q0:q1] == -math.inf, ref_lse[0] == -math.inf)


def test_gradients_run_the_trainable_attention_chunks_included():
    q, k, v = (x.double().requires_grad_() for x in _qkv(40, 40, d=32, seed=5))
    fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=16, softcap=6.0,
                        train_recipe="exact").square().sum().backward()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    seen = _visible(40, 40, True, (-1, -1), 16)
    exact64_nhd(*leaves, seen, softcap=6.0)[0].square().sum().backward()
    for got, leaf in zip((q, k, v), leaves, strict=True):
        assert_close(got.grad, leaf.grad, atol=1e-9)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(qv=torch.ones(1)), ValueError, "qv must be None"),
    (dict(q_descale=torch.ones(1)), ValueError, "q_descale must be None"),
    (dict(attention_chunk=-1), ValueError, "attention_chunk must be 0"),
    (dict(attention_chunk=2.0), TypeError, "attention_chunk must be an int"),
    (dict(window_size=(4, None)), TypeError, "window_size must be a"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a number.*NaN"),
    (dict(num_splits=None), TypeError, "num_splits must be an int"),
    (dict(pack_gqa="yes"), TypeError, "pack_gqa must be a bool"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    q, k, v = _qkv(16, 16)
    with pytest.raises(error, match=match):
        fa3.flash_attn_func(q, k, v, **kwargs)


def test_used_lengths_and_probs_with_gradients_are_refused():
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k must be None"):
        fa3.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, seqused_k=torch.tensor([4]))
    with pytest.raises(ValueError, match="return_attn_probs=True is not supported where"):
        fa3.flash_attn_varlen_func(q.requires_grad_(), q, q, cu, cu, 8, 8, return_attn_probs=True)


def test_sides_that_bound_nothing_are_unbounded_however_large():
    """``mha_fwd`` makes ``left >= Nk - 1`` and ``right >= Nq - 1`` unbounded before anything
    narrows them; a window may also come as a two-element tensor (FlashAttention 3's own tests
    pass one), a chunk as long as an int allows."""
    q, k, v = _qkv(40, 24)
    want = fa3.flash_attn_func(q, k, v, recipe="exact")
    for window in ((2**31, -1), (-1, 2**40), (23, 39), (2**31, 2**31)):
        assert torch.equal(fa3.flash_attn_func(q, k, v, window_size=window, recipe="exact"), want)
    assert torch.equal(fa3.flash_attn_func(q, k, v, attention_chunk=2**31 - 1, recipe="exact"),
                       fa3.flash_attn_func(q, k, v, attention_chunk=64, recipe="exact"))
    got = fa3.flash_attn_func(q, k, v, window_size=torch.tensor([5, 2]), recipe="exact")
    assert torch.equal(got, fa3.flash_attn_func(q, k, v, window_size=(5, 2), recipe="exact"))


def test_packed_sequences_without_any_key():
    """No key in any sequence: zeros and, as FlashAttention 3 skips its kernel then, a +inf LSE;
    with gradients, zero gradients (the output still depends on q)."""
    q = torch.randn(6, 2, 16)
    k = v = torch.zeros(0, 2, 16)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    cu_k = torch.zeros(3, dtype=torch.int32)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 0, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.equal(lse, torch.full((2, 6), math.inf))
    q.requires_grad_()
    fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 0).sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))

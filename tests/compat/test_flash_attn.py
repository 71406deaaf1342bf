"""lowbit_attn.compat.flash_attn: FlashAttention 2's signatures (a pinned copy), its masks and LSE
checked against float64 attention with masks built here from FlashAttention 2's rules, gradients
through the trainable attention, packed forms, and the refusals."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import lowbit_attn
from helpers import assert_close, channel_biased, exact64_nhd
from lowbit_attn.compat import flash_attn as fa

E = inspect.Parameter.empty
PK, KO = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
COMMON = [("dropout_p", PK, 0.0), ("softmax_scale", PK, None), ("causal", PK, False),
          ("window_size", PK, (-1, -1)), ("softcap", PK, 0.0), ("alibi_slopes", PK, None),
          ("deterministic", PK, False), ("return_attn_probs", PK, False)]
OURS = [("recipe", KO, "auto"), ("train_recipe", KO, "sagebwd_int8")]
VARLEN = [("cu_seqlens_q", PK, E), ("cu_seqlens_k", PK, E), ("max_seqlen_q", PK, E),
          ("max_seqlen_k", PK, E)]


def _pos(*names):
    return [(n, PK, E) for n in names]


# FlashAttention 2 (Dao-AILab/flash-attention, flash_attn/flash_attn_interface.py at 0251105):
# name, kind and default of every parameter, in order; then our two keyword-only ones.
PINNED = {
    "flash_attn_func": _pos("q", "k", "v") + COMMON + OURS,
    "flash_attn_kvpacked_func": _pos("q", "kv") + COMMON + OURS,
    "flash_attn_qkvpacked_func": _pos("qkv") + COMMON + OURS,
    "flash_attn_varlen_func": _pos("q", "k", "v") + VARLEN + COMMON
    + [("block_table", PK, None)] + OURS,
    "flash_attn_varlen_kvpacked_func": _pos("q", "kv") + VARLEN + COMMON + OURS,
    "flash_attn_varlen_qkvpacked_func": _pos("qkv", "cu_seqlens", "max_seqlen") + COMMON + OURS,
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_signature_is_flash_attention_2s(name):
    params = inspect.signature(getattr(fa, name)).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == PINNED[name]


def test_every_pinned_function_is_exported():
    assert sorted(fa.__all__) == sorted(PINNED)


def _visible(nq: int, nk: int, causal: bool, window, nk_max: int | None = None) -> torch.Tensor:
    """``[nq, nk]`` bool: which keys each query sees, key by key, as FlashAttention 2's kernels
    do (``flash_api.cpp``: a side ``>= seqlen_k`` or negative is unbounded, causal sets the right
    side to 0, one bounded side makes the other ``seqlen_k``; ``seqlen_k`` is ``max_seqlen_k``
    for packed sequences)."""
    bound = nk if nk_max is None else nk_max
    left, right = (w if 0 <= w < bound else -1 for w in window)
    if causal:
        right = 0
    if left >= 0 and right < 0:
        right = bound
    if right >= 0 and left < 0:
        left = bound
    seen = torch.ones(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            centre = i + nk - nq
            if left >= 0 and j < centre - left:
                seen[i, j] = False
            if right >= 0 and j > centre + right:
                seen[i, j] = False
    return seen


def _reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, nk_max=None):
    """Float64 attention with the mask of :func:`_visible`: the output and the LSE (+inf where a
    row sees nothing, as FlashAttention 2 gives it)."""
    seen = _visible(q.shape[1], k.shape[1], causal, window, nk_max)
    out, lse = exact64_nhd(q, k, v, seen, softcap=max(softcap, 0.0), scale=scale)  # <= 0: off
    return out, lse.masked_fill(~seen.any(-1), math.inf)


# How close the exact recipe's float32 attention stays to float64 here (scores up to |S| ≈ 18):
# torch's CPU float32 `logsumexp` is not the same in every process (a test's first call moved
# the LSE by 4.7e-5 and the output by 2.7e-5 in about one process in eight, Triton 3.9
# installed; later calls agreed with each other to the bit), while a key too many or too few
# in a mask moves outputs by more than 1e-2.
EXACT_FP32 = 1e-4


def _qkv(nq, nk, hq=4, hkv=2, d=64, seed=0, dtype=torch.float32):
    q, k, v = channel_biased((2, hq, nq, d), (2, hkv, nk, d), seed=seed, dtype=dtype)
    return (x.transpose(1, 2).contiguous() for x in (q, k, v))  # NHD


VARIANTS = [
    dict(causal=False), dict(causal=True), dict(window=(16, 8)), dict(window=(16, -1)),
    dict(window=(-1, 5)), dict(window=(-7, 300)), dict(window=(-1, 40)),
    dict(causal=True, window=(24, -1)),
    dict(causal=True, window=(24, 40)), dict(softcap=5.0), dict(softcap=-3.0, causal=True),
]


@pytest.mark.parametrize("nq,nk", [(96, 96), (40, 96), (96, 40)])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_exact_recipe_is_flash_attention_2s_definition(nq, nk, variant):
    q, k, v = _qkv(nq, nk)
    out, lse, probs = fa.flash_attn_func(
        q, k, v, causal=variant.get("causal", False), window_size=variant.get("window", (-1, -1)),
        softcap=variant.get("softcap", 0.0), return_attn_probs=True, recipe="exact")
    ref, ref_lse = _reference(q, k, v, **variant)
    assert out.shape == q.shape and lse.shape == (2, 4, nq)
    assert probs.shape == (0,) and probs.dtype == q.dtype  # FA2's S_dmask without dropout
    assert_close(out.double(), ref, atol=EXACT_FP32)
    assert torch.equal(lse == math.inf, ref_lse == math.inf)  # rows that see no key: +inf
    assert_close(lse.double().nan_to_num(posinf=0), ref_lse.nan_to_num(posinf=0), atol=EXACT_FP32)


def test_a_bounded_left_side_makes_the_right_one_nk_as_flash_attention_2():
    """With ``Nq > Nk + 1``, ``window_size=(w, -1)`` cuts the first queries' keys beyond
    ``i + 2·Nk - Nq``: FlashAttention 2's kernels, not an unbounded right side."""
    q, k, v = _qkv(64, 20)
    out = fa.flash_attn_func(q, k, v, window_size=(5, -1), recipe="exact")
    assert_close(out.double(), _reference(q, k, v, window=(5, -1))[0], atol=EXACT_FP32)
    unbounded = lowbit_attn.attention(q, k, v, layout="NHD", window=(5, -1), recipe="exact")
    assert (out - unbounded).abs().amax() > 1e-2
    # the same at the largest left side FlashAttention 2 keeps bounded (Nk - 1), and with the
    # window as a two-element tensor
    got = fa.flash_attn_func(q, k, v, window_size=torch.tensor([19, -1]), recipe="exact")
    assert_close(got.double(), _reference(q, k, v, window=(19, -1))[0], atol=EXACT_FP32)
    assert (got - fa.flash_attn_func(q, k, v, recipe="exact")).abs().amax() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_default_recipe_is_within_8_bit_error(causal):
    q, k, v = _qkv(128, 128, d=128, seed=1)
    out = fa.flash_attn_func(q, k, v, causal=causal)
    ref = _reference(q, k, v, causal=causal)[0]
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0)
    assert cos > 0.999


def test_packed_forms_equal_the_unpacked_call():
    q, k, v = _qkv(48, 48, hq=2, hkv=2)
    want = fa.flash_attn_func(q, k, v, causal=True, recipe="exact")
    qkv = torch.stack([q, k, v], dim=2)
    assert torch.equal(fa.flash_attn_qkvpacked_func(qkv, causal=True, recipe="exact"), want)
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(fa.flash_attn_kvpacked_func(q, kv, causal=True, recipe="exact"), want)
    with pytest.raises(ValueError, match=r"qkv must have shape \[B, N, 3, H, D\]"):
        fa.flash_attn_qkvpacked_func(kv)
    pq, pk, pv, cu_q, cu_k = _packed([30, 0, 17], [30, 0, 17], hq=2, hkv=2)
    want = fa.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, 30, 30, causal=True, recipe="exact")
    got = fa.flash_attn_varlen_qkvpacked_func(torch.stack([pq, pk, pv], 1), cu_q, 30,
                                              causal=True, recipe="exact")
    assert torch.equal(got, want)
    got = fa.flash_attn_varlen_kvpacked_func(pq, torch.stack([pk, pv], 1), cu_q, cu_k, 30, 30,
                                             causal=True, recipe="exact")
    assert torch.equal(got, want)


def _packed(lengths_q, lengths_k, hq=4, hkv=2, d=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g) + 2.0 * torch.randn(d, generator=g)
    v = torch.randn(sum(lengths_k), hkv, d, generator=g)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
          for n in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


LENGTHS = ([30, 0, 17, 50], [40, 9, 0, 50])


@pytest.mark.parametrize("variant", [dict(causal=True), dict(window=(8, -1)),
                                     dict(causal=True, window=(12, 3), softcap=4.0)], ids=str)
def test_varlen_is_each_sequence_with_max_seqlen_k_bounding_the_window(variant):
    q, k, v, cu_q, cu_k = _packed(*LENGTHS)
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 50, 50, causal=variant.get("causal", False),
        window_size=variant.get("window", (-1, -1)), softcap=variant.get("softcap", 0.0),
        return_attn_probs=True, recipe="exact")
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for (q0, q1), (k0, k1) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]),
                                  zip(cu_k.tolist(), cu_k.tolist()[1:])):
        if q1 == q0:
            continue
        ref, ref_lse = _reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], nk_max=50,
                                  **variant)
        assert_close(out[q0:q1].double(), ref[0], atol=EXACT_FP32)
        got_lse = lse[:, q0:q1].double()
        assert torch.equal(got_lse == math.inf, ref_lse[0] == math.inf)
        assert_close(got_lse.nan_to_num(posinf=0), ref_lse[0].nan_to_num(posinf=0), atol=EXACT_FP32)


def _grads(fn, *inputs):
    inputs = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = fn(*inputs)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    return out.detach(), [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.grad is not None]


@pytest.mark.parametrize("variant", [dict(causal=True), dict(window=(10, 4), softcap=6.0)], ids=str)
def test_gradients_run_the_trainable_attention(variant):
    q, k, v = _qkv(40, 40, d=32, seed=5)
    kw = dict(causal=variant.get("causal", False), window_size=variant.get("window", (-1, -1)),
              softcap=variant.get("softcap", 0.0))
    out, grads = _grads(lambda a, b, c: fa.flash_attn_func(a, b, c, train_recipe="exact", **kw),
                        q, k, v)
    ref_out, ref_grads = _grads(lambda a, b, c: _reference(a, b, c, **variant)[0], q, k, v)
    assert_close(out, ref_out, atol=1e-10)
    for got, want in zip(grads, ref_grads, strict=True):
        assert_close(got, want, atol=1e-9)
    out8, grads8 = _grads(lambda a, b, c: fa.flash_attn_func(a.float(), b.float(), c.float(),
                                                             **kw).double(), q, k, v)
    for got, want in zip(grads8, ref_grads, strict=True):
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cos > 0.99


def test_varlen_gradients_run_one_trainable_call_per_sequence():
    q, k, v, cu_q, cu_k = _packed(*LENGTHS, d=32)

    def packed(a, b, c):
        return fa.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 50, 50, causal=True,
                                         train_recipe="exact")

    out, grads = _grads(packed, q, k, v)
    assert len(grads) == 3
    for (q0, q1), (k0, k1) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]),
                                  zip(cu_k.tolist(), cu_k.tolist()[1:])):
        if q1 > q0:
            ref = _reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True)[0][0]
            assert_close(out[q0:q1], ref, atol=1e-10)
    ref_grads = []
    for x in (q, k, v):
        ref_grads.append(torch.zeros(x.shape, dtype=torch.float64))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    pieces = []
    for (q0, q1), (k0, k1) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]),
                                  zip(cu_k.tolist(), cu_k.tolist()[1:])):
        if q1 > q0 and k1 > k0:
            pieces.append(_reference(leaves[0][None, q0:q1], leaves[1][None, k0:k1],
                                     leaves[2][None, k0:k1], causal=True)[0][0])
        else:
            pieces.append(leaves[0].new_zeros((q1 - q0, 4, 32)))
    ref_out = torch.cat(pieces)
    ref_out.backward(torch.cos(torch.arange(ref_out.numel(), dtype=torch.float64)).view_as(ref_out))
    for got, leaf in zip(grads, leaves, strict=True):
        assert_close(got, leaf.grad, atol=1e-9)


def test_inputs_are_untouched():
    q, k, v = _qkv(64, 64)
    before = [x.clone() for x in (q, k, v)]
    fa.flash_attn_func(q, k, v, causal=True, softcap=3.0, return_attn_probs=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
    (dict(dropout_p="0"), TypeError, "dropout_p must be a float"),
    (dict(alibi_slopes=torch.ones(4)), ValueError, "alibi_slopes must be None"),
    (dict(window_size=(4.0, 2)), TypeError, "window_size must be a"),
    (dict(window_size=5), TypeError, "window_size must be a"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a number.*NaN"),
    (dict(softcap=2.0**17), ValueError, r"softcap must be between 2\*\*-125 and 2\*\*16"),
    (dict(softmax_scale=-0.1), ValueError, "scale must be a positive"),
    (dict(softcap="30"), TypeError, "softcap must be a float"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(deterministic=None), TypeError, "deterministic must be a bool"),
    (dict(return_attn_probs=1), TypeError, "return_attn_probs must be a bool"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    q, k, v = _qkv(16, 16)
    with pytest.raises(error, match=match):
        fa.flash_attn_func(q, k, v, **kwargs)


def test_what_is_refused_where_gradients_are_needed_or_keys_are_paged():
    q, k, v = _qkv(16, 16)
    with pytest.raises(ValueError, match="return_attn_probs=True is not supported where"):
        fa.flash_attn_func(q.requires_grad_(), k, v, return_attn_probs=True)
    with torch.no_grad():
        assert len(fa.flash_attn_func(q, k, v, return_attn_probs=True)) == 3
    pq, pk, pv, cu_q, cu_k = _packed([8], [8])
    with pytest.raises(ValueError, match="block_table must be None"):
        fa.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, 8, 8, block_table=torch.zeros(1, 1))
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        fa.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, 8, 8.0)
    for maxima in ((7, 8), (8, 7)):  # below the longest sequence, with and without gradients
        with pytest.raises(ValueError, match=r"must be an int >= the longest sequence \(8\)"):
            fa.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, *maxima)
        with pytest.raises(ValueError, match=r"must be an int >= the longest sequence \(8\)"):
            fa.flash_attn_varlen_func(pq.requires_grad_(), pk, pv, cu_q, cu_k, *maxima)


def test_compiles_in_one_graph():
    q, k, v = _qkv(64, 64, hq=2, hkv=2)

    def call(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, window_size=(16, -1), softcap=20.0,
                                  return_attn_probs=True)

    torch._dynamo.reset()
    out, lse, _ = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    want, want_lse, _ = call(q, k, v)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_the_kernels_take_flash_attention_2s_windows(recipe, triton_backend):
    """The Triton kernels (interpreted) under the windows only FlashAttention 2's reading makes:
    a right side of ``Nk`` cutting the first queries when ``Nq > Nk + 1``, with softcap."""
    q, k, v = _qkv(150, 40, seed=9)
    out, lse, _ = fa.flash_attn_func(q, k, v, window_size=(5, -1), softcap=30.0, recipe=recipe,
                                     return_attn_probs=True)
    ref, ref_lse = _reference(q, k, v, window=(5, -1), softcap=30.0)
    assert torch.equal(lse == math.inf, ref_lse == math.inf)
    rows = ~torch.isinf(ref_lse[0, 0])  # the rows that see a key (the same in every head)
    assert rows.any() and not rows.all()
    assert torch.equal(out[:, ~rows], torch.zeros_like(out[:, ~rows]))
    cos = torch.nn.functional.cosine_similarity(out[:, rows].double().flatten(),
                                                ref[:, rows].flatten(), dim=0)
    assert cos > 0.999


def test_varlen_training_gives_k_and_v_gradients_where_no_query_reads_them():
    """Sequences whose queries see no key (none, or no queries at all) gave k and v no gradient
    (None) when no sequence read them; the dense call gives zeros, and so does this one, even
    where k holds a NaN no query reads."""
    from lowbit_attn.compat.flash_attn import flash_attn_varlen_func

    q = torch.randn(0, 2, 32, requires_grad=True)
    k = torch.full((4, 2, 32), float("nan"), requires_grad=True)
    v = torch.randn(4, 2, 32, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 4)
    out.sum().backward()
    assert out.shape == (0, 2, 32)
    for x in (q, k, v):
        assert x.grad is not None and not bool(x.grad.any())

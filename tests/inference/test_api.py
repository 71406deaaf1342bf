"""Public API: argument checks, dtypes, the SDPA drop-in and its fallbacks (PyTorch reference path)."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowbit_attn
from helpers import assert_close, channel_biased
from lowbit_attn.integrations import sdpa as api
from lowbit_attn.inference.naive import exact_attention


def qkv(b=1, hq=2, hkv=2, nq=64, nk=64, d=64, dtype=torch.float16):
    return channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq * 7 + nk, dtype=dtype)


BAD_CALLS = [
    pytest.param(lambda q, k, v: lowbit_attn.attention(q[0], k, v), ValueError, "q must have 4",
                 id="q-rank"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k[:, :, :, :32], v), ValueError,
                 "k and v must have the same shape", id="kv-shape"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k[:, :, :, :32], v[:, :, :, :32]),
                 ValueError, "same head dim", id="head-dim"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q.repeat(2, 1, 1, 1), k, v), ValueError,
                 "same batch size", id="batch"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q[:, :1].repeat(1, 3, 1, 1), k, v),
                 ValueError, "multiple of the number of key/value heads", id="gqa-ratio"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q.to(torch.int32), k, v), TypeError,
                 "q must be float16, bfloat16 or float32", id="int-dtype"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k.float(), v), TypeError,
                 "share one dtype", id="mixed-dtype"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, layout="BHSD"), ValueError,
                 "layout must be", id="layout"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, recipe="int4"), ValueError,
                 "unknown recipe 'int4'", id="recipe"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, recipe=3), TypeError,
                 "recipe must be a str", id="recipe-type"),
    pytest.param(lambda q, k, v: lowbit_attn.get_recipe("auto"), ValueError,
                 "recipe 'auto' is chosen per device when a call runs", id="get-recipe-auto"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, scale=-1.0), ValueError,
                 "scale must be a positive", id="scale"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, scale=10**400), ValueError,
                 r"scale must be a positive finite number, got int ~1e400", id="scale-huge-int"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, scale=np.float32("inf")),
                 ValueError, "scale must be a positive finite number", id="scale-np-inf"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, scale="0.1"), TypeError,
                 "scale must be a float or None, got str '0.1'", id="scale-str"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, is_causal=1), TypeError,
                 "is_causal must be a bool, got int 1", id="causal-type"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k[:, :, :0], v[:, :, :0]), ValueError,
                 "at least one token", id="empty-kv"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v.numpy()), TypeError,
                 "v must be a torch.Tensor", id="not-a-tensor"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q, k, v, recipe=lowbit_attn.get_recipe(
        "qk_int8_pv_fp8").replace(granularity="per_warp")), ValueError, "granularity",
                 id="granularity"),
    pytest.param(lambda q, k, v: lowbit_attn.attention(q[..., :0], k[..., :0], v[..., :0]),
                 ValueError, "head dim must be between", id="head-dim-zero"),
]


@pytest.mark.parametrize("call,error,message", BAD_CALLS)
def test_bad_input_raises_a_clear_error(call, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        call(q, k, v)


def test_nhd_errors_name_the_shapes_passed():
    q = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError, match=r"got \(1, 16, 2, 64\) and \(1, 15, 2, 64\)"):
        lowbit_attn.attention(q, q, q[:, :15], layout="NHD")
    with pytest.raises(ValueError, match=r"at least one token, got shape \(1, 0, 2, 64\)"):
        lowbit_attn.attention(q, q[:, :0], q[:, :0], layout="NHD")
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple .* \(2\)"):
        lowbit_attn.attention(torch.randn(1, 16, 3, 64), q, q, layout="NHD")


def test_mixed_devices_are_rejected():
    q, k, v = qkv()
    meta = torch.empty(k.shape, dtype=k.dtype, device="meta")
    with pytest.raises(ValueError, match="one device"):
        lowbit_attn.attention(q, meta, v)


VARLEN_BAD = [
    pytest.param(dict(cu_seqlens_q=torch.tensor([0, 10, 20])), "end at the number of packed tokens", id="cu-end"),
    pytest.param(dict(cu_seqlens_q=torch.tensor([0, 20, 10, 30], dtype=torch.int32)),
                 "non-decreasing", id="cu-order"),
    pytest.param(dict(cu_seqlens_q=torch.tensor([[0, 30]], dtype=torch.int32)), "1-D int32",
                 id="cu-rank"),
    pytest.param(dict(max_seqlen_q=5), "max_seqlen_q must be an int >= the longest", id="max-len"),
    pytest.param(dict(cu_seqlens_k=torch.tensor([0, 30], dtype=torch.int32)),
                 "same number of sequences", id="batch-mismatch"),
]


@pytest.mark.parametrize("change,message", VARLEN_BAD)
def test_varlen_bad_input(change, message):
    q = torch.randn(30, 2, 32)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    args = dict(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20, max_seqlen_k=20)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        lowbit_attn.attention_varlen(**args)


@pytest.mark.parametrize("value", [np.bool_(True), True, 20.0, None, torch.tensor(20)], ids=str)
def test_varlen_longest_length_of_another_type_is_a_type_error(value):
    q = torch.randn(30, 2, 32)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        lowbit_attn.attention_varlen(q, q, q, cu, cu, 20, value)


def test_varlen_takes_numpy_integers_for_the_longest_lengths():
    """``max_seqlen_q``/``_k`` as NumPy integers (what a length computed with NumPy is), as every
    other int argument takes them: the same result as Python ints."""
    q = torch.randn(30, 2, 32)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    want = lowbit_attn.attention_varlen(q, q, q, cu, cu, 20, 20)
    got = lowbit_attn.attention_varlen(q, q, q, cu, cu, np.int64(20), np.int32(20))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", ["exact", "qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_dtypes_shapes_and_accuracy(dtype, recipe):
    q, k, v = qkv(hq=4, hkv=2, nq=70, nk=129, d=64, dtype=dtype)
    out, lse = lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 70)
    ref, ref_lse = exact_attention(q, k, v, scale=64**-0.5, causal_offset=129 - 70)
    errs = lowbit_attn.errors(out, ref)
    assert errs.cosine > (0.99999 if recipe == "exact" else 0.999)
    assert_close(lse, ref_lse, atol=0.05 if recipe != "exact" else 1e-4, name="lse")


@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_head_dims_beyond_the_fast_path(recipe):
    for d in (32, 96, 256, 8):
        q, k, v = qkv(nq=50, nk=60, d=d, dtype=torch.float32)
        out = lowbit_attn.attention(q, k, v, recipe=recipe)
        ref, _ = exact_attention(q, k, v, scale=d**-0.5)
        assert lowbit_attn.errors(out, ref).cosine > 0.999, d


def test_empty_query_returns_empty():
    q, k, v = qkv(nq=0)
    out, lse = lowbit_attn.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 0)


def test_auto_recipe_follows_the_device():
    from lowbit_attn.core.recipes import auto_recipe

    assert auto_recipe(None).name == "qk_int8_pv_fp16"
    assert auto_recipe((8, 0)).name == "qk_int8_pv_fp16"
    assert auto_recipe((8, 9)).name == "qk_int8_pv_fp8"
    assert auto_recipe((9, 0)).name == "qk_int8_pv_fp8"


def test_recipe_options_are_validated():
    r = lowbit_attn.get_recipe("qk_int8_pv_fp8")
    assert r.replace(granularity="per_token").granularity == "per_token"
    with pytest.raises(TypeError, match=r"^Recipe\.replace got unknown option\(s\) \['smoothing'\]"):
        r.replace(smoothing=True)
    train = lowbit_attn.TRAIN_RECIPES["sagebwd_int8"]
    with pytest.raises(TypeError, match=r"^TrainRecipe\.replace got unknown option\(s\) \['a', 'b'\]"):
        train.replace(b=1, a=2)
    with pytest.raises(ValueError, match="block_q"):
        r.replace(block_q=100)


@pytest.mark.parametrize("changes,error,message", [
    pytest.param(dict(balance_qk=1, smooth_k=1), TypeError,
                 "Recipe.smooth_k must be a bool, got int 1", id="bool-from-int"),
    pytest.param(dict(smooth_v="True"), TypeError, "Recipe.smooth_v must be a bool, got str",
                 id="bool-from-str"),
    pytest.param(dict(two_level_p=None), TypeError, "Recipe.two_level_p must be a bool",
                 id="bool-from-none"),
    pytest.param(dict(block_q=64.0), TypeError, "Recipe.block_q must be an int, got float 64.0",
                 id="block-float"),
    pytest.param(dict(block_k=True), TypeError, "Recipe.block_k must be an int, got bool",
                 id="block-bool"),
    pytest.param(dict(block_k=256), ValueError, "Recipe.block_k must be 16, 32, 64 or 128",
                 id="block-range"),
    pytest.param(dict(name="a;b"), ValueError, "Recipe.name must be a Python identifier",
                 id="name-semicolon"),
    pytest.param(dict(name="x=1"), ValueError, "Recipe.name must be a Python identifier",
                 id="name-equals"),
    pytest.param(dict(name=b"fp8"), TypeError, "Recipe.name must be a str", id="name-bytes"),
    pytest.param(dict(qk=8), TypeError, "Recipe.qk must be a str", id="qk-type"),
    pytest.param(dict(pv="fp4"), ValueError, "Recipe.pv must be one of", id="pv-value"),
    pytest.param(dict(granularity=None), TypeError, "Recipe.granularity must be a str",
                 id="granularity-type"),
])
def test_recipe_fields_are_checked_by_type_and_value(changes, error, message):
    """A wrong type is refused, not coerced: ``balance_qk=1`` once ran as False."""
    with pytest.raises(error, match=message):
        lowbit_attn.get_recipe("qk_int8_pv_fp16").replace(**changes)


def test_recipe_stores_numpy_options_as_python_values():
    r = lowbit_attn.get_recipe("qk_int8_pv_fp16")
    got = r.replace(smooth_v=np.bool_(True), balance_qk=np.False_, block_q=np.int64(64))
    assert got == r.replace(smooth_v=True, balance_qk=False, block_q=64)
    assert type(got.smooth_v) is bool and type(got.balance_qk) is bool and type(got.block_q) is int


def test_numpy_scalars_are_taken_as_python_ones():
    q, k, v = qkv(nq=24, nk=40, d=32)
    want = lowbit_attn.attention(q, k, v, scale=0.25, is_causal=True)
    for scale in (np.float32(0.25), np.float64(0.25), np.float16(0.25)):
        got = lowbit_attn.attention(q, k, v, scale=scale, is_causal=np.bool_(True))
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="scale must be a float or None, got numpy.bool"):
        lowbit_attn.attention(q, k, v, scale=np.True_)


def test_sdpa_signature_is_pytorchs():
    ours = inspect.signature(lowbit_attn.scaled_dot_product_attention)
    assert list(ours.parameters) == [
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"
    ]
    for name, p in ours.parameters.items():
        assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, name


@pytest.mark.parametrize("nq,nk", [(64, 64), (40, 100), (100, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_drop_in_follows_pytorch_semantics(nq, nk, causal):
    q, k, v = qkv(nq=nq, nk=nk, dtype=torch.float32)
    ours = lowbit_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # top-left causal
    assert lowbit_attn.errors(ours, theirs).cosine > 0.999


def test_sdpa_three_dims_gqa_and_scale():
    q, k, v = qkv(hq=4, hkv=2, nq=33, nk=47, dtype=torch.float32)
    ours = lowbit_attn.scaled_dot_product_attention(q, k, v, scale=0.07, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, scale=0.07, enable_gqa=True)
    assert lowbit_attn.errors(ours, theirs).cosine > 0.999
    ours3 = lowbit_attn.scaled_dot_product_attention(q[0, :2], k[0], v[0])
    assert ours3.shape == q[0, :2].shape
    theirs3 = F.scaled_dot_product_attention(q[0, :2], k[0], v[0])
    assert lowbit_attn.errors(ours3, theirs3).cosine > 0.999


FALLBACKS = [
    pytest.param(dict(attn_mask=torch.ones(32, 32, dtype=torch.bool).tril()), "attn_mask",
                 id="mask"),
    pytest.param(dict(dropout_p=0.1), "dropout_p", id="dropout"),
]


def test_kernel_calls_count_the_calls_the_ops_serve():
    """The tooling hooks: served calls (attention, packed, the drop-in) count, fallbacks do not;
    a reset fallback reason warns again."""
    from lowbit_attn.core.counters import kernel_calls

    q, k, v = qkv(nq=32, nk=32, dtype=torch.float32)
    before = kernel_calls()
    lowbit_attn.attention(q, k, v)
    lowbit_attn.scaled_dot_product_attention(q, k, v)
    cu = torch.tensor([0, 32], dtype=torch.int32)
    packed = (x[0].transpose(0, 1) for x in (q, k, v))
    lowbit_attn.attention_varlen(*packed, cu, cu, 32, 32)
    assert kernel_calls() == before + 3
    for _ in range(2):
        api.reset_fallback_warnings()
        with pytest.warns(UserWarning, match="dropout_p"):
            lowbit_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert kernel_calls() == before + 3


@pytest.mark.parametrize("kwargs,reason", FALLBACKS)
def test_sdpa_fallback_is_exact_and_warns_once(kwargs, reason, monkeypatch):
    api.reset_fallback_warnings()
    q, k, v = qkv(nq=32, nk=32, dtype=torch.float32)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=reason):
        ours = lowbit_attn.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.manual_seed(0)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.equal(ours, theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowbit_attn.scaled_dot_product_attention(q, k, v, **kwargs)  # second time: silent


# Calls PyTorch's SDPA serves, as (q shape, k and v shape, keyword arguments, whether the drop-in
# falls back to PyTorch's function for it).
SDPA_LIKE_TORCH = [
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), {}, False, id="4d"),
    pytest.param((3, 33, 16), (3, 47, 16), {}, False, id="3d"),
    pytest.param((3, 47, 16), (3, 33, 16), dict(is_causal=True), False, id="3d-causal-nq>nk"),
    pytest.param((2, 4, 33, 16), (2, 4, 47, 16), dict(is_causal=True), False,
                 id="4d-causal-nq<nk"),  # top-left: the last 14 keys are never seen
    pytest.param((2, 4, 47, 16), (2, 2, 33, 16), dict(is_causal=True, enable_gqa=True), False,
                 id="gqa-causal-nq>nk"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=0.0), True, id="scale-zero"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=-0.3), True, id="scale-negative"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=-0.0), True, id="scale-minus-zero"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=float("inf")), True,
                 id="scale-inf"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=float("nan")), True,
                 id="scale-nan"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=torch.tensor(0.2)), True,
                 id="scale-tensor"),
    pytest.param((2, 4, 33, 16), (2, 4, 33, 16), dict(scale=True), True, id="scale-bool"),
    pytest.param((2, 0, 33, 16), (2, 0, 33, 16), {}, True, id="no-heads"),
    pytest.param((2, 0, 33, 16), (2, 0, 33, 16), dict(enable_gqa=True, is_causal=True), True,
                 id="no-heads-gqa"),
    pytest.param((2, 0, 33, 16), (2, 2, 33, 16), dict(enable_gqa=True), True,
                 id="no-query-heads-gqa"),
    pytest.param((2, 4, 33, 16), (2, 0, 33, 16), dict(enable_gqa=True), True,
                 id="no-kv-heads-gqa"),
    pytest.param((2, 4, 0, 16), (2, 4, 33, 16), dict(is_causal=True), True, id="no-queries"),
    pytest.param((2, 4, 33, 16), (2, 4, 0, 16), dict(is_causal=True), True, id="no-keys"),
    pytest.param((3, 0, 16), (3, 0, 16), {}, True, id="3d-no-tokens"),
    pytest.param((0, 4, 33, 16), (0, 4, 33, 16), {}, False, id="no-batch"),
]


@pytest.mark.parametrize("backend",
                         ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("patched", [False, True], ids=["function", "patch_sdpa"])
@pytest.mark.parametrize("q_shape,kv_shape,kwargs,falls_back", SDPA_LIKE_TORCH)
def test_sdpa_drop_in_returns_what_pytorch_returns(q_shape, kv_shape, kwargs, falls_back, patched,
                                                   backend, monkeypatch):
    """Whatever PyTorch's SDPA computes, the drop-in computes too (never raising instead): the
    same result on a fallback, the recipe's accuracy on the kernels."""
    api.reset_fallback_warnings()
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    torch.manual_seed(len(q_shape) * 100 + q_shape[-2])
    q, (k, v) = torch.randn(q_shape), (torch.randn(kv_shape) for _ in range(2))
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if patched:
            with lowbit_attn.patch_sdpa():
                ours = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            ours = lowbit_attn.scaled_dot_product_attention(q, k, v, **kwargs)
    fell_back = [str(w.message) for w in caught if "falling back" in str(w.message)]
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if falls_back:
        assert len(fell_back) == 1, fell_back
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    else:
        assert fell_back == []
        if ours.numel():
            assert lowbit_attn.errors(ours, theirs).cosine > 0.9999


def test_sdpa_scale_fallback_names_the_reason(monkeypatch):
    api.reset_fallback_warnings()
    q, k, v = qkv(nq=8, nk=8, dtype=torch.float32)
    with pytest.warns(UserWarning, match="scale is not a positive finite number"):
        lowbit_attn.scaled_dot_product_attention(q, k, v, scale=0.0)
    with pytest.raises(OverflowError):  # what PyTorch raises for this scale
        lowbit_attn.scaled_dot_product_attention(q, k, v, scale=10**400)


@pytest.mark.parametrize("patched", [False, True], ids=["function", "patch_sdpa"])
@pytest.mark.parametrize("kwargs", [
    dict(is_causal="False"), dict(is_causal=1), dict(is_causal=np.bool_(True)),
    dict(is_causal=torch.tensor(True)), dict(is_causal=None), dict(enable_gqa="False"),
], ids=repr)
def test_sdpa_non_bool_flags_raise_what_pytorch_raises(kwargs, patched, monkeypatch):
    """PyTorch takes only a bool for ``is_causal`` and ``enable_gqa``; the drop-in must not read
    ``"False"`` as true and run causal (or grouped) attention where PyTorch raises."""
    api.reset_fallback_warnings()
    q, k, v = qkv(hq=2, hkv=1, nq=8, nk=8, dtype=torch.float32)  # grouped: enable_gqa matters
    kwargs = dict(enable_gqa=True) | kwargs
    with pytest.raises(TypeError, match="must be bool") as theirs:
        api.TORCH_SDPA(q, k, v, **kwargs)
    with pytest.raises(TypeError) as ours, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if patched:
            with lowbit_attn.patch_sdpa():
                F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            lowbit_attn.scaled_dot_product_attention(q, k, v, **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_sdpa_falls_back_for_autograd_and_stays_differentiable(monkeypatch):
    api.reset_fallback_warnings()
    q, k, v = (x.requires_grad_() for x in qkv(dtype=torch.float32))
    with pytest.warns(UserWarning, match="gradient"):
        out = lowbit_attn.scaled_dot_product_attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None


def test_sdpa_can_replace_the_torch_function(monkeypatch):
    q, k, v = qkv(dtype=torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lowbit_attn.scaled_dot_product_attention)
    got = F.scaled_dot_product_attention(q, k, v)
    assert lowbit_attn.errors(got, expected).cosine > 0.999
    # a fallback must reach the original, not recurse into the patched name
    with pytest.warns(UserWarning):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def test_inputs_are_never_modified():
    q, k, v = qkv(dtype=torch.float32)
    snapshots = [x.clone() for x in (q, k, v)]
    for recipe in ("qk_int8_pv_fp16", "qk_int8_pv_fp8"):
        lowbit_attn.attention(q, k, v, recipe=recipe)
    for x, s in zip((q, k, v), snapshots):
        assert torch.equal(x, s)


@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp16", "qk_int8_pv_fp8"])
def test_nan_input_gives_nan_output_on_the_reference(recipe):
    q, k, v = qkv(dtype=torch.float32)
    k[0, 0, 3, 5] = float("nan")
    out = lowbit_attn.attention(q, k, v, recipe=recipe)
    assert torch.isnan(out[0, 0]).any(dim=-1).all()
    assert torch.isfinite(out[0, 1]).all()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 3]),
    nq=st.integers(1, 150), nk=st.integers(1, 150), d=st.sampled_from([16, 40, 64]),
    causal=st.booleans(), recipe=st.sampled_from(["qk_int8_pv_fp16", "qk_int8_pv_fp8"]),
    granularity=st.sampled_from(["per_block", "per_token"]), layout=st.sampled_from(["HND", "NHD"]),
    seed=st.integers(0, 2**16),
)
def test_any_shape_agrees_with_exact_attention(b, hkv, group, nq, nk, d, causal, recipe,
                                               granularity, layout, seed):
    """Reference path on random shapes: rows that see keys match exact attention; others are 0."""
    q, k, v = channel_biased((b, hkv * group, nq, d), (b, hkv, nk, d), seed=seed)
    r = lowbit_attn.get_recipe(recipe).replace(granularity=granularity)
    args = (q, k, v) if layout == "HND" else tuple(x.transpose(1, 2) for x in (q, k, v))
    out, lse = lowbit_attn.attention(*args, recipe=r, is_causal=causal, layout=layout,
                                     return_lse=True)
    if layout == "NHD":
        out = out.transpose(1, 2)
    ref, ref_lse = exact_attention(q, k, v, scale=d**-0.5, causal_offset=nk - nq if causal else None)
    seen = torch.isfinite(ref_lse)
    assert torch.all(out[~seen] == 0) and torch.all(torch.isneginf(lse[~seen]))
    if seen.any():
        rows_out, rows_ref = out[seen], ref[seen]
        # a row that sees one key returns that value: the error is the quantization of V alone
        assert lowbit_attn.errors(rows_out, rows_ref).cosine > 0.995
        assert_close(lse[seen], ref_lse[seen], atol=0.05, name="lse")


@pytest.mark.parametrize("name, capability, head_dim, refused", [
    pytest.param("qk_int8_pv_fp16", (7, 5), 64, "compute capability 8.0", id="int8-on-sm75"),
    pytest.param("qk_int8_pv_fp8", (8, 6), 64, "FP8 tensor cores", id="fp8-on-sm86"),
    pytest.param("qk_int8_pv_fp16", (8, 6), 64, None, id="fp16-on-sm86"),
    pytest.param("qk_fp4_pv_fp4", (10, 0), 48, "multiple of 32", id="fp4-D48"),
    pytest.param("exact", (7, 0), 48, None, id="exact-anywhere"),
])
def test_sdpa_falls_back_where_the_recipe_cannot_run(name, capability, head_dim, refused):
    # attention() raises for these; the drop-in must hand them to PyTorch, which serves any GPU
    reason = api.recipe_reason(lowbit_attn.get_recipe(name), torch.device("cuda"), capability,
                               head_dim)
    assert (reason is None) if refused is None else (refused in reason)


def test_sdpa_fp4_recipe_with_an_odd_head_dim_falls_back(monkeypatch):
    q, k, v = (torch.randn(1, 2, 20, 48) for _ in range(3))
    api.reset_fallback_warnings()
    with lowbit_attn.patch_sdpa("qk_fp4_pv_fp4"), pytest.warns(UserWarning, match="multiple of 32"):
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, api.TORCH_SDPA(q, k, v))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_meta_tensors_give_meta_outputs(backend, monkeypatch):
    """Tensors on the meta device (a model built without memory) carry shapes only: every call
    returns meta outputs of the right shape on either backend (the Triton backend used to launch
    its quantization on them: ``NotImplementedError: Cannot copy out of meta tensor``)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    q, k, v = (torch.empty(1, 4, 24, 32, device="meta", dtype=torch.float16) for _ in range(3))
    for recipe in ("auto", "qk_int8_pv_fp8", "exact"):
        out, lse = lowbit_attn.attention(q, k[:, :2], v[:, :2], is_causal=True, recipe=recipe,
                                         return_lse=True)
        assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (1, 4, 24)
    out = lowbit_attn.trainable_attention(q, k, v, is_causal=True)
    assert out.device.type == "meta" and out.shape == q.shape


def test_varlen_lse_is_fp32_whatever_the_default_dtype():
    """The packed LSE is fp32 as documented (and as the op's fake says), also where the default
    dtype is float64 (it followed the default: float64)."""
    q, k = torch.randn(30, 4, 32), torch.randn(40, 2, 32)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 10, 30], [0, 25, 40]))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, lse = lowbit_attn.attention_varlen(q, k, k, cu_q, cu_k, 20, 25, return_lse=True)
    finally:
        torch.set_default_dtype(previous)
    assert lse.dtype == torch.float32


@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp8", "qk_int8_pv_fp16", "qk_fp4_pv_fp4"])
def test_the_reference_path_gives_the_same_bits_for_any_layout(recipe):
    """The same values in another layout (channel-major, or an NHD view) give the same output and
    LSE bits: the CPU path's sums (K's mean, ΔS, the LSE shift) followed the strides and moved
    the last bit (the kernels read every layout in one order)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 96, 64, generator=g) for _ in range(3))
    want = lowbit_attn.attention(q, k, v, recipe=recipe, return_lse=True)
    layouts = (lambda x: x.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0),
               lambda x: x.transpose(1, 2).contiguous().transpose(1, 2))
    for layout in layouts:
        for i in range(3):
            args = [q, k, v]
            args[i] = layout(args[i])
            got = lowbit_attn.attention(*args, recipe=recipe, return_lse=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (recipe, i)

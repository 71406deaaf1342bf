"""lowbit_attn.compat.sageattention: SageAttention's signatures (a pinned copy of 2.x's, and the
1.0.6 wheel's when one is given), results equal to our own API, masks warned and exact, inputs
untouched, bad arguments named; and the ``sageattention`` import alias, in fresh processes."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import lowbit_attn
from helpers import assert_close
from lowbit_attn.compat import sageattention as sa

SRC = Path(__file__).resolve().parents[2] / "src"
E = inspect.Parameter.empty
PK, VK = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD
QKV = [("q", PK, E), ("k", PK, E), ("v", PK, E)]
KW = [("kwargs", VK, E)]

# SageAttention 2.x (thu-ml/SageAttention, sageattention/core.py and sageattention3_blackwell/
# sageattn3/api.py, as of 2.2): name, kind and default of every parameter, in order.
PINNED_2X = {
    "sageattn": QKV + [("tensor_layout", PK, "HND"), ("is_causal", PK, False),
                       ("sm_scale", PK, None), ("return_lse", PK, False)] + KW,
    "sageattn_qk_int8_pv_fp16_triton": QKV + [
        ("tensor_layout", PK, "HND"), ("quantization_backend", PK, "triton"),
        ("is_causal", PK, False), ("attn_mask", PK, None), ("sm_scale", PK, None),
        ("smooth_k", PK, True), ("return_lse", PK, False)] + KW,
    "sageattn_qk_int8_pv_fp16_cuda": QKV + [
        ("tensor_layout", PK, "HND"), ("is_causal", PK, False), ("qk_quant_gran", PK, "per_thread"),
        ("sm_scale", PK, None), ("pv_accum_dtype", PK, "fp32"), ("smooth_k", PK, True),
        ("smooth_v", PK, False), ("return_lse", PK, False)] + KW,
    "sageattn_qk_int8_pv_fp8_cuda": QKV + [
        ("tensor_layout", PK, "HND"), ("is_causal", PK, False), ("qk_quant_gran", PK, "per_thread"),
        ("sm_scale", PK, None), ("pv_accum_dtype", PK, "fp32+fp16"), ("smooth_k", PK, True),
        ("smooth_v", PK, False), ("return_lse", PK, False)] + KW,
    "sageattn_qk_int8_pv_fp8_cuda_sm90": QKV + [
        ("tensor_layout", PK, "HND"), ("is_causal", PK, False), ("qk_quant_gran", PK, "per_thread"),
        ("sm_scale", PK, None), ("pv_accum_dtype", PK, "fp32+fp32"), ("smooth_k", PK, True),
        ("return_lse", PK, False)] + KW,
    "sageattn_varlen": QKV + [
        ("cu_seqlens_q", PK, E), ("cu_seqlens_k", PK, E), ("max_seqlen_q", PK, E),
        ("max_seqlen_k", PK, E), ("is_causal", PK, False), ("sm_scale", PK, None),
        ("smooth_k", PK, True)] + KW,
    "sageattn3_blackwell": QKV + [("attn_mask", PK, None), ("is_causal", PK, False),
                                  ("per_block_mean", PK, True)] + KW,
}
# 1.x parameters that 2.x dropped and our function still honours through **kwargs.
ONE_X_KEYWORDS = {("sageattn", "smooth_k")}


def _signature(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(PINNED_2X))
def test_signature_equals_sageattention_2x(name):
    assert _signature(getattr(sa, name)) == PINNED_2X[name]


def test_every_pinned_function_is_exported():
    assert sorted(sa.__all__) == sorted(PINNED_2X)


def _wheel_functions() -> dict[str, list[tuple]] | None:
    """Public functions of an original SageAttention's core.py, read with ``ast``: from the wheel
    named by LOWBIT_ATTN_SAGEATTENTION_WHEEL, else from an installed ``sageattention``."""
    path = os.environ.get("LOWBIT_ATTN_SAGEATTENTION_WHEEL")
    if path and Path(path).is_file():
        with zipfile.ZipFile(path) as wheel:
            source = wheel.read("sageattention/core.py").decode()
    else:
        spec = importlib.util.find_spec("sageattention")
        if spec is None or spec.origin is None or getattr(spec.loader, "__module__", "").startswith(
                "lowbit_attn"):
            return None
        core = Path(spec.origin).with_name("core.py")
        if not core.is_file():
            return None
        source = core.read_text()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("sageattn"):
            args = node.args
            defaults = [E] * (len(args.args) - len(args.defaults)) + [
                ast.literal_eval(d) for d in args.defaults]
            params = [(a.arg, PK, d) for a, d in zip(args.args, defaults)]
            if args.kwarg is not None:
                params.append((args.kwarg.arg, VK, E))
            found[node.name] = params
    return found


def test_signatures_equal_the_wheel():
    """Set LOWBIT_ATTN_SAGEATTENTION_WHEEL to a downloaded wheel (e.g. sageattention==1.0.6,
    ``pip download sageattention==1.0.6 --no-deps``) to run; CI does not download it."""
    original = _wheel_functions()
    if original is None:
        pytest.skip("no SageAttention wheel (LOWBIT_ATTN_SAGEATTENTION_WHEEL) or installed package")
    assert original, "no sageattn* function found in the original's core.py"
    for name, params in original.items():
        if name not in PINNED_2X:
            continue  # a function 2.x does not have
        ours = {p[0]: (i, p) for i, p in enumerate(_signature(getattr(sa, name)))}
        for position, param in enumerate(params):
            if (name, param[0]) in ONE_X_KEYWORDS:
                assert "kwargs" in ours, (name, param)
                continue
            assert param[0] in ours, f"{name}: parameter {param[0]!r} missing"
            index, mine = ours[param[0]]
            assert mine == param, f"{name}: {mine} != the original's {param}"
            assert index == position, f"{name}: {param[0]!r} at {index}, the original's at {position}"


# --- results equal to our own API ------------------------------------------------------------

def _qkv(layout="HND", hq=4, hkv=2, nq=96, nk=96, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    def make(h, n):
        shape = (2, h, n, d) if layout == "HND" else (2, n, h, d)
        return (torch.randn(shape, generator=g) + 0.5).to(dtype)
    return make(hq, nq), make(hkv, nk), make(hkv, nk)


R = lowbit_attn.get_recipe
CASES = [
    ("sageattn", {}, "auto"),
    ("sageattn_qk_int8_pv_fp16_triton", {}, R("qk_int8_pv_fp16")),
    ("sageattn_qk_int8_pv_fp16_triton", {"smooth_k": False, "quantization_backend": "cuda"},
     R("qk_int8_pv_fp16").replace(smooth_k=False)),
    ("sageattn_qk_int8_pv_fp16_cuda", {}, R("qk_int8_pv_fp16").replace(
        granularity="per_thread", block_k=128)),
    ("sageattn_qk_int8_pv_fp16_cuda",
     {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp16", "smooth_v": True},
     R("qk_int8_pv_fp16").replace(granularity="per_block", smooth_v=True)),
    ("sageattn_qk_int8_pv_fp8_cuda", {}, R("qk_int8_pv_fp8").replace(
        granularity="per_thread", block_k=128)),
    ("sageattn_qk_int8_pv_fp8_cuda", {"pv_accum_dtype": "fp32", "smooth_v": True},
     R("qk_int8_pv_fp8").replace(smooth_v=True, granularity="per_thread", block_k=128)),
    ("sageattn_qk_int8_pv_fp8_cuda_sm90", {"qk_quant_gran": "per_warp"},
     R("qk_int8_pv_fp8").replace(granularity="per_block")),
]


@pytest.mark.parametrize("name, options, recipe", CASES, ids=lambda x: x if isinstance(x, str) else None)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_results_equal_our_attention(name, options, recipe, layout, is_causal):
    q, k, v = _qkv(layout, nq=80 if is_causal else 96)
    out, lse = getattr(sa, name)(q, k, v, tensor_layout=layout, is_causal=is_causal, sm_scale=0.1,
                                 return_lse=True, **options)
    if is_causal:  # 80 queries, 96 keys, top-left: no query sees the last 16 keys
        k, v = (x.narrow(2 if layout == "HND" else 1, 0, 80) for x in (k, v))
    ref_out, ref_lse = lowbit_attn.attention(q, k, v, is_causal=is_causal, scale=0.1, layout=layout,
                                             recipe=recipe, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert lse.shape == (2, 4, q.shape[2 if layout == "HND" else 1]) and lse.dtype == torch.float32


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_lse_is_the_natural_log_of_the_true_scores(layout):
    """SageAttention 2.x returns ``lse_base2 / log2(e) + q·mean(k)·sm_scale``: the natural-log LSE of
    q·kᵀ·sm_scale before smoothing. Ours, through every function, the same quantity."""
    q, k, v = _qkv(layout, hq=2, hkv=2)
    qh, kh = (x.transpose(1, 2) if layout == "NHD" else x for x in (q, k))
    exact = torch.logsumexp(torch.matmul(qh.double(), kh.double().transpose(-1, -2)) * 0.125, -1)
    for name, options, _ in CASES:
        _, lse = getattr(sa, name)(q, k, v, tensor_layout=layout, return_lse=True, **options)
        assert_close(lse, exact, atol=0.05, name=name)


def test_smooth_k_of_sageattention_1x_goes_to_the_automatic_recipe():
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sa.sageattn(q, k, v, smooth_k=False)
    ref = lowbit_attn.attention(q, k, v, recipe=R("qk_int8_pv_fp16").replace(smooth_k=False))
    assert torch.equal(out, ref)


def test_sageattn3_is_the_nvfp4_recipe():
    q, k, v = _qkv(hq=2, hkv=2, d=64, dtype=torch.bfloat16)
    for per_block_mean in (True, False):
        out = sa.sageattn3_blackwell(q, k, v, is_causal=True, per_block_mean=per_block_mean)
        assert torch.equal(out, lowbit_attn.attention(q, k, v, is_causal=True,
                                                      recipe="qk_fp4_pv_fp4"))


def test_varlen_equals_attention_varlen():
    g = torch.Generator().manual_seed(1)
    lengths = [37, 64, 5]
    cu = torch.tensor([0, 37, 101, 106], dtype=torch.int32)
    q = torch.randn(sum(lengths), 4, 64, generator=g).half()
    k, v = (torch.randn(sum(lengths), 2, 64, generator=g).half() for _ in range(2))
    for is_causal in (False, True):
        out = sa.sageattn_varlen(q, k, v, cu, cu.long(), 64, 64, is_causal=is_causal, sm_scale=0.2,
                                 smooth_k=False)
        ref = lowbit_attn.attention_varlen(
            q, k, v, cu, cu, 64, 64, is_causal=is_causal, scale=0.2,
            recipe=R("qk_int8_pv_fp16").replace(smooth_k=False))
        assert torch.equal(out, ref)


@pytest.mark.parametrize("nq, nk", [(48, 80), (80, 48)], ids=["Nq<Nk", "Nq>Nk"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_causal_with_unequal_lengths_is_top_left_as_theirs(nq, nk, layout):
    """SageAttention's kernels, as PyTorch's SDPA, mask the keys ``j > i`` of query ``i`` whatever
    Nq and Nk: against float64 with that mask (built in ``_exact``)."""
    q, k, v = _qkv(layout, nq=nq, nk=nk)
    for name, options, _ in CASES:
        out, lse = getattr(sa, name)(q, k, v, tensor_layout=layout, is_causal=True,
                                     return_lse=True, **options)
        ref, ref_lse = _exact(q, k, v, torch.ones(1, 1, 1, nk, dtype=torch.bool), layout, True,
                              64 ** -0.5)
        cosine = torch.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0)
        assert cosine >= 0.999, (name, float(cosine))  # bottom-right: below 0.9
        assert_close(lse.double(), ref_lse, atol=0.05, name=name)


def test_varlen_causal_with_unequal_lengths_is_top_left_per_sequence():
    g = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 20, 84, 89], dtype=torch.int32)  # 20, 64, 5 queries
    cu_k = torch.tensor([0, 37, 101, 104], dtype=torch.int32)  # 37, 64, 3 keys
    q = (torch.randn(89, 4, 64, generator=g) + 0.5).half()
    k, v = ((torch.randn(104, 2, 64, generator=g) + 0.5).half() for _ in range(2))
    out = sa.sageattn_varlen(q, k, v, cu_q, cu_k, 64, 64, is_causal=True, sm_scale=0.2)
    assert out.shape == q.shape and out.dtype == q.dtype
    ones = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    for (q0, q1), (k0, k1) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]),
                                  zip(cu_k.tolist(), cu_k.tolist()[1:])):
        ref, _ = _exact(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], ones, "NHD", True, 0.2)
        cosine = torch.cosine_similarity(out[q0:q1].double().flatten(), ref[0].flatten(), dim=0)
        assert cosine >= 0.999, (q0, float(cosine))


def test_varlen_causal_with_sequences_without_queries_or_keys():
    """The per-sequence top-left path with a sequence of no queries and one of no keys: no rows,
    and rows of 0 (as ``attention_varlen`` gives where a row sees no key); the others as each
    sequence alone."""
    g = torch.Generator().manual_seed(4)
    cu_q = torch.tensor([0, 0, 7, 12], dtype=torch.int32)  # 0, 7, 5 queries
    cu_k = torch.tensor([0, 4, 15, 15], dtype=torch.int32)  # 4, 11, 0 keys
    q = torch.randn(12, 2, 64, generator=g)
    k, v = (torch.randn(15, 2, 64, generator=g) for _ in range(2))
    out = sa.sageattn_varlen(q, k, v, cu_q, cu_k, 7, 11, is_causal=True)
    assert out.shape == q.shape
    assert torch.equal(out[7:], torch.zeros(5, 2, 64))
    alone = sa.sageattn_varlen(q[0:7], k[4:15], v[4:15], torch.tensor([0, 7], dtype=torch.int32),
                               torch.tensor([0, 11], dtype=torch.int32), 7, 11, is_causal=True)
    assert torch.equal(out[0:7], alone)


def test_varlen_int64_offsets_outside_int32_are_refused():
    """int64 offsets are cast to int32: one that the cast would wrap (2**32 + 3 → 3) is refused,
    not read as another offset."""
    q = torch.randn(8, 2, 64)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for bad in ([0, 2**32 + 3, 8], [0, -2**32 + 3, 8]):
        with pytest.raises(ValueError, match="cu_seqlens_q must hold offsets from 0 to 2"):
            sa.sageattn_varlen(q, q, q, torch.tensor(bad), cu, 5, 5)
    assert torch.equal(sa.sageattn_varlen(q, q, q, cu.long(), cu, 5, 5),
                       sa.sageattn_varlen(q, q, q, cu, cu, 5, 5))


def test_a_mask_that_does_not_broadcast_is_refused():
    q, k, v = _qkv(nq=8, nk=8)
    for shape in ((3, 3), (1, 1, 1, 8, 8), (9, 8)):
        with pytest.raises(ValueError, match=r"attn_mask must broadcast to \[B, Hq, Nq, Nk\]"):
            sa.sageattn(q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool))


def test_flags_and_scales_are_read_as_theirs_reads_them():
    """``if is_causal:`` in theirs: 0/1, None and one-element tensors are flags too; a
    one-element ``sm_scale`` tensor is its value; PyTorch SDPA's ``scale=`` keyword (``sageattn``
    in place of ``F.scaled_dot_product_attention``) is the scale, without a warning."""
    q, k, v = _qkv(nq=64, nk=64)
    causal, plain = sa.sageattn(q, k, v, is_causal=True), sa.sageattn(q, k, v)
    for flag in (1, torch.tensor(True), torch.tensor(1)):
        assert torch.equal(sa.sageattn(q, k, v, is_causal=flag), causal)
    for flag in (0, None, torch.tensor(False)):
        assert torch.equal(sa.sageattn(q, k, v, is_causal=flag), plain)
    scaled = sa.sageattn(q, k, v, sm_scale=0.1)
    assert not torch.equal(scaled, plain)
    assert torch.equal(sa.sageattn(q, k, v, sm_scale=torch.tensor(0.1)), scaled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(sa.sageattn(q, k, v, scale=0.1), scaled)
        assert torch.equal(sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, scale=0.1),
                           sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, sm_scale=0.1))
    for bad in (2, "yes", 0.5, torch.tensor([1, 0])):
        with pytest.raises(TypeError, match="is_causal"):
            sa.sageattn(q, k, v, is_causal=bad)


# --- masks: warned, exact ----------------------------------------------------------------------

def _exact(q, k, v, mask, layout, is_causal, scale):
    qh, kh, vh = (x.transpose(1, 2) if layout == "NHD" else x for x in (q, k, v))
    rep = qh.shape[1] // kh.shape[1]
    kh, vh = (x.repeat_interleave(rep, dim=1).double() for x in (kh, vh))
    s = torch.matmul(qh.double(), kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if is_causal:
        nq, nk = s.shape[-2:]
        keep = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None]  # top-left, as theirs
        s = s.masked_fill(~keep, float("-inf"))
    out = torch.matmul(torch.softmax(s, -1), vh)
    out = out.transpose(1, 2) if layout == "NHD" else out
    return out, torch.logsumexp(s, -1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("how", ["parameter", "kwargs", "sageattn3"])
def test_a_mask_warns_and_is_exact(layout, kind, is_causal, how):
    if how == "sageattn3" and layout == "NHD":
        pytest.skip("sageattn3_blackwell takes HND only")
    q, k, v = _qkv(layout, nq=48, nk=64)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, 48, 64, generator=g) > 0.3
    mask = keep if kind == "bool" else torch.where(keep, torch.rand(keep.shape, generator=g),
                                                   torch.tensor(float("-inf"))).half()
    with pytest.warns(UserWarning, match="attn_mask"):
        if how == "parameter":
            out, lse = sa.sageattn_qk_int8_pv_fp16_triton(
                q, k, v, tensor_layout=layout, is_causal=is_causal, attn_mask=mask, return_lse=True)
        elif how == "kwargs":
            out, lse = sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, tensor_layout=layout,
                                                       is_causal=is_causal, attn_mask=mask,
                                                       return_lse=True)
        else:
            out, lse = sa.sageattn3_blackwell(q, k, v, attn_mask=mask, is_causal=is_causal), None
    ref, ref_lse = _exact(q, k, v, mask, layout, is_causal, 64 ** -0.5)
    dead = torch.isinf(ref_lse)  # rows that see no key: 0 here (NaN in the float64 softmax)
    dead_out = dead.unsqueeze(-1).expand(ref.shape if layout == "HND" else ref.transpose(1, 2).shape)
    dead_out = dead_out if layout == "HND" else dead_out.transpose(1, 2)
    assert torch.all(out[dead_out] == 0)
    assert_close(out.masked_fill(dead_out, 0), ref.masked_fill(dead_out, 0).to(out.dtype),
                 atol=2e-3, rtol=2e-3)
    if lse is not None:
        assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_sageattn_with_a_mask_in_kwargs_is_exact_too():
    q, k, v = _qkv()
    mask = torch.ones(96, 96, dtype=torch.bool).tril()
    with pytest.warns(UserWarning, match="attn_mask"):
        out = sa.sageattn(q, k, v, attn_mask=mask)
    assert_close(out, _exact(q, k, v, mask, "HND", False, 0.125)[0].half(), atol=2e-3, rtol=2e-3)


def test_a_float32_bias_keeps_its_values_with_half_precision_inputs():
    """PyTorch adds a float32 mask to half-precision scores as it is: a bias past fp16's range
    (7e4) is a bias, and a row of float32's min (transformers' masked value) sees every key
    alike; neither becomes an infinity (NaN, or a dead row of zeros)."""
    q, k, v = _qkv(nq=8, nk=12)
    mask = torch.zeros(8, 12)
    mask[1, 2] = 7e4
    mask[3] = torch.finfo(torch.float32).min
    with pytest.warns(UserWarning, match="attn_mask"):
        out, lse = sa.sageattn(q, k, v, attn_mask=mask, return_lse=True)
    ref, ref_lse = _exact(q, k, v, mask, "HND", False, 64 ** -0.5)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, ref.to(out.dtype), atol=2e-3, rtol=2e-3)
    assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_the_masked_exact_path_computes_cpu_half_precision_in_float32(monkeypatch, dtype, kind):
    """PyTorch's float16/bfloat16 CPU SDPA is not on every CPU (``ATEN_CPU_CAPABILITY=default`` on
    some AVX-512 CPUs raises ``pack_vnni2 is only supported when avx512 is supported``):
    the exact path hands it float32 tensors, so a PyTorch that refuses the reduced dtypes does not
    reach the user, and the answer is the float32 one rounded once."""
    from lowbit_attn.integrations import sdpa

    torch_sdpa = sdpa.TORCH_SDPA

    def refusing(q, k, v, attn_mask=None, **kwargs):
        if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        assert attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype)
        return torch_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    for module in (sdpa, sa):  # (sa: should it call PyTorch's function by that name again)
        monkeypatch.setattr(module, "TORCH_SDPA", refusing, raising=False)
    q, k, v = _qkv(dtype=dtype, nq=40, nk=40)
    keep = torch.rand(40, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    mask = keep if kind == "bool" else torch.where(keep, 0.0, float("-inf"))
    with pytest.warns(UserWarning, match="attn_mask"):
        out = sa.sageattn(q, k, v, attn_mask=mask)
    want = torch_sdpa(q.float(), k.float(), v.float(), attn_mask=keep, scale=0.125,
                      enable_gqa=True)
    assert out.dtype == dtype
    assert torch.equal(out, want.to(dtype))


# --- the caller's tensors are never modified -----------------------------------------------------

CALLS = [(name, options) for name, options, _ in CASES] + [("sageattn3_blackwell", {})]


@pytest.mark.parametrize("name, options", CALLS, ids=[c[0] for c in CALLS])
@pytest.mark.parametrize("masked", [False, True])
def test_inputs_are_never_modified(name, options, masked):
    q, k, v = _qkv(dtype=torch.bfloat16)
    before = [x.clone() for x in (q, k, v)]
    extra = {"attn_mask": torch.ones(96, 96, dtype=torch.bool)} if masked else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(sa, name)(q, k, v, **options, **extra)
    for x, y in zip((q, k, v), before):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))  # bit for bit


def test_varlen_inputs_are_never_modified():
    q, k, v = (torch.randn(70, 2, 64).half() for _ in range(3))
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    before = [x.clone() for x in (q, k, v, cu)]
    sa.sageattn_varlen(q, k, v, cu, cu, 40, 40)
    assert all(torch.equal(x.view(torch.int16) if x.is_floating_point() else x,
                           y.view(torch.int16) if y.is_floating_point() else y)
               for x, y in zip((q, k, v, cu), before))


# --- arguments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, name", [
    (lambda q, k, v: sa.sageattn(q, k, v, tensor_layout="BHSD"), ValueError, "tensor_layout"),
    (lambda q, k, v: sa.sageattn(q, k, v, tensor_layout=None), TypeError, "tensor_layout"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp16_triton(q, k, v, quantization_backend="tk"),
     ValueError, "quantization_backend"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp16_cuda(q, k, v, qk_quant_gran="per_block"),
     ValueError, "qk_quant_gran"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp16_cuda(q, k, v, pv_accum_dtype="fp8"),
     ValueError, "pv_accum_dtype"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, pv_accum_dtype="fp16"),
     ValueError, "pv_accum_dtype"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, pv_accum_dtype="fp32+fp16"),
     ValueError, "pv_accum_dtype"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, smooth_k="yes"), TypeError, "smooth_k"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp16_cuda(q, k, v, smooth_v=2), TypeError, "smooth_v"),
    (lambda q, k, v: sa.sageattn3_blackwell(q, k, v, per_block_mean="yes"), TypeError,
     "per_block_mean"),
    (lambda q, k, v: sa.sageattn(q, k, v, is_causal="no"), TypeError, "is_causal"),
    (lambda q, k, v: sa.sageattn_qk_int8_pv_fp16_triton(q, k, v, attn_mask=[[1]]), TypeError,
     "attn_mask"),
    # an integer 0/1 mask, refused as PyTorch's SDPA refuses it (it was read as a +0/+1 bias)
    (lambda q, k, v: sa.sageattn(q, k, v, attn_mask=torch.ones(q.shape[2], k.shape[2],
                                                               dtype=torch.int64)),
     TypeError, "attn_mask must be bool"),
])
def test_bad_arguments_are_named(call, error, name):
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=name):
            call(q, k, v)


def test_varlen_bad_arguments():
    q = k = v = torch.randn(10, 2, 64).half()
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        sa.sageattn_varlen(q, k, v, cu.float(), cu, 10, 10)
    with pytest.raises(ValueError, match="attn_mask"):
        sa.sageattn_varlen(q, k, v, cu, cu, 10, 10, attn_mask=torch.ones(10, 10, dtype=torch.bool))


def test_unknown_keywords_are_ignored_with_one_warning():
    q, k, v = _qkv()
    sa._warned.clear()
    with pytest.warns(UserWarning, match="'dropout_p' is ignored"):
        out = sa.sageattn_qk_int8_pv_fp16_triton(q, k, v, dropout_p=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sa.sageattn_qk_int8_pv_fp16_triton(q, k, v, dropout_p=0.0)  # warned once already
    assert torch.equal(out, lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp16"))


def test_smooth_v_is_ignored_where_sageattention_ignores_it():
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="smooth_v will be ignored"):
        out = sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, smooth_v=True)  # pv_accum_dtype="fp32+fp16"
    assert torch.equal(out, sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v))


@pytest.mark.parametrize("call", [
    pytest.param(lambda q, k, v, m: sa.sageattn(q, k, v, attn_mask=m), id="sageattn-mask"),
    pytest.param(lambda q, k, v, m: sa.sageattn_qk_int8_pv_fp16_triton(q, k, v, attn_mask=m),
                 id="triton-mask"),
    pytest.param(lambda q, k, v, m: sa.sageattn_qk_int8_pv_fp16_cuda(q, k, v, attn_mask=m),
                 id="fp16-cuda-mask"),
    pytest.param(lambda q, k, v, m: sa.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, dropout_p=0.0),
                 id="sm90-keyword"),
    pytest.param(lambda q, k, v, m: sa.sageattn_qk_int8_pv_fp8_cuda(q, k, v, smooth_v=True),
                 id="fp8-cuda-smooth-v"),
    pytest.param(lambda q, k, v, m: sa.sageattn3_blackwell(q, k, v, attn_mask=m), id="sage3-mask"),
])
def test_warnings_point_at_the_caller(call):
    q, k, v = _qkv()
    sa._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(q, k, v, torch.ones(q.shape[2], k.shape[2], dtype=torch.bool))
    assert caught and all(w.filename == __file__ for w in caught), [w.filename for w in caught]


# --- the import alias, in fresh processes -----------------------------------------------------

def _python(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    paths = [str(SRC)] + ([str(extra_path)] if extra_path else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


REAL_INSTALLED = importlib.util.find_spec("sageattention") is not None


@pytest.mark.skipif(REAL_INSTALLED, reason="a real sageattention is installed here")
def test_alias_gives_our_functions_and_uninstalls_cleanly(tmp_path):
    result = _python("""
        import sys
        import lowbit_attn.compat as compat
        try:
            import sageattention
            raise SystemExit("sageattention importable before the alias")
        except ImportError:
            pass
        compat.install_sageattention_alias()
        compat.install_sageattention_alias()  # idempotent
        import sageattention
        from sageattention import sageattn, sageattn_varlen
        assert sageattention.sageattn is compat.sageattention.sageattn
        assert sageattn_varlen is compat.sageattention.sageattn_varlen
        assert sorted(sageattention.__all__) == sorted(compat.sageattention.__all__)
        from sageattn3 import sageattn3_blackwell  # SageAttention3's import name
        assert sageattn3_blackwell is compat.sageattention.sageattn3_blackwell
        assert compat.uninstall_sageattention_alias() is True
        assert "sageattention" not in sys.modules and "sageattn3" not in sys.modules
        for name in ("sageattention", "sageattn3"):
            try:
                __import__(name)
                raise SystemExit(f"{name} still importable after uninstall")
            except ImportError:
                pass
        assert compat.uninstall_sageattention_alias() is False
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def _fake_package(root: Path) -> Path:
    package = root / "sageattention"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\ndef sageattn(*a, **k):\n    return 'real'\n")
    return package


def test_alias_refuses_to_shadow_an_installed_package(tmp_path):
    package = _fake_package(tmp_path)
    result = _python("""
        import lowbit_attn.compat as compat
        try:
            compat.install_sageattention_alias()
        except RuntimeError as error:
            print(error)
        else:
            raise SystemExit("installed over a real package")
        import sageattention
        assert sageattention.REAL
    """, extra_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert str(package) in result.stdout and "does not shadow" in result.stdout


@pytest.mark.skipif(REAL_INSTALLED, reason="a real sageattention is installed here")
def test_a_package_installed_after_the_alias_still_wins(tmp_path):
    _fake_package(tmp_path)
    result = _python(f"""
        import sys
        import lowbit_attn.compat as compat
        compat.install_sageattention_alias()
        sys.path.insert(0, {str(tmp_path)!r})
        import sageattention
        assert getattr(sageattention, "REAL", False), sageattention
        try:
            compat.install_sageattention_alias()
        except RuntimeError as error:
            assert "already imported" in str(error)
        else:
            raise SystemExit("no refusal with the real module imported")
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

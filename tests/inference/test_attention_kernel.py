"""The Triton attention kernel against the PyTorch reference, under the interpreter (small shapes);
the tests that take ``device`` on each target (tests/conftest.py), GPU-sized cases on cuda alone."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import Bound, assert_close, assert_within, channel_biased
from lowbit_attn.integrations import sdpa as api
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference.naive import exact_attention, quantized_attention

RECIPES = ["qk_int8_pv_fp16", "qk_int8_pv_fp8"]

CASES = [
    pytest.param(1, 2, 2, 130, 130, 64, id="B1-H2-N130-D64"),
    pytest.param(2, 4, 2, 77, 200, 32, id="B2-GQA4:2-Nq77-Nk200-D32"),
    pytest.param(1, 3, 1, 200, 90, 96, id="B1-MQA3:1-Nq200-Nk90-D96"),
    pytest.param(1, 1, 1, 1, 257, 128, id="B1-H1-decode-Nq1-Nk257-D128"),
]
# test_gpu.py's shapes: many query and key blocks per head, as the autotuner sees them in use, and
# one query row against a long cache
GPU_CASES = [
    pytest.param(2, 8, 4, 1000, 1500, d, id=f"gpu-B2-GQA8:4-Nq1000-Nk1500-D{d}",
                 marks=pytest.mark.gpu)
    for d in (64, 128)
] + [pytest.param(1, 8, 2, 1, 3000, 128, id="gpu-decode-Nq1-Nk3000-D128", marks=pytest.mark.gpu)]


def _kernel_attention(qz, recipe, causal_offset, return_lse=True):
    from lowbit_attn.inference import kernel_int8 as attn_fwd_int8

    out = torch.empty(qz.q.shape, dtype=torch.float32, device=qz.q.device)
    lse = attn_fwd_int8.attention(
        qz, out=out, pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
        block_k=recipe.block_k, causal_offset=causal_offset, return_lse=return_lse,
    )
    return out, lse


def _whole_and_halves(qz, recipe, causal_offset, monkeypatch, **variant):
    """``(out, lse)`` of the kernel on whole 128-row query blocks, then on halves (``M_SPLIT``
    2), the autotuner held to each in turn (``variant``: ``attention``'s)."""
    from lowbit_attn.inference import kernel_int8 as attn_fwd_int8

    results = []
    for m_split in (1, 2):
        config = attn_fwd_int8.LaunchConfig(4, 1, (("PIPELINE", False), ("M_SPLIT", m_split)))
        monkeypatch.setattr(attn_fwd_int8._attn_fwd_int8, "configs",
                            attn_fwd_int8.triton_configs({"interpreter": [config]}, None))
        out = torch.empty(qz.q.shape, dtype=torch.float32, device=qz.q.device)
        results += [out, attn_fwd_int8.attention(
            qz, out=out, pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
            block_k=recipe.block_k, causal_offset=causal_offset, return_lse=True, **variant)]
    return results


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", CASES + GPU_CASES)
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("granularity", ["per_block", "per_token", "per_thread"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_matches_reference_on_the_same_quantized_inputs(b, hq, hkv, nq, nk, d, name,
                                                                granularity, causal, device):
    recipe = get_recipe(name).replace(granularity=granularity)
    device.needs(recipe)
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + nk, device=device.name)
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    offset = nk - nq if causal else None
    want, want_lse = quantized_attention(
        qz, pv=recipe.pv, granularity=granularity, block_q=recipe.block_q,
        block_k=recipe.block_k, causal_offset=offset,
    )
    got, got_lse = _kernel_attention(qz, recipe, offset)
    # exp2 differs in the last bit between implementations, which now and then moves P̃ across an
    # fp16 (2^-11) or E4M3 (2^-4) rounding boundary: a bound of a few such steps of one weight.
    out_bound = Bound(atol=3e-4 if recipe.pv == "fp16" else 4e-3, cos=0.999999)
    assert_within(got, want, device.bound(f"int8 out {recipe.pv}", out_bound), name="out")
    assert_within(got_lse, want_lse, device.bound("lse", Bound(atol=1e-5, rtol=1e-5)), name="lse")


@pytest.mark.interpreter
@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_per_thread_scales_do_not_depend_on_the_query_block(b, hq, hkv, nq, nk, d, causal,
                                                             monkeypatch):
    """Per-thread groups are fixed by 16-row slices and 128-key blocks, not by ``block_q``: 64-
    and 128-row query blocks give the same bits, in the twin and the Triton kernel (so the
    SageAttention shim's per-thread calls can run 128-row blocks, half the instructions per score
    of 64-row ones on sm_90a: ``benchmarks/NOTES.md`` §17)."""
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + 2 * nk)
    for backend in ("reference", "triton"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        got = [lowbit_attn.attention(q, k, v, is_causal=causal, return_lse=True,
                                     recipe=get_recipe("qk_int8_pv_fp8").replace(
                                         granularity="per_thread", block_q=block_q, block_k=128))
               for block_q in (64, 128)]
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), backend


@pytest.mark.interpreter
@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", CASES)
@pytest.mark.parametrize("granularity", ["per_token", "per_thread"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_permuted_v_changes_no_bit(b, hq, hkv, nq, nk, d, granularity, causal):
    """E4M3 V with its keys in the register-operand order (``QuantizedQKV.v_permuted``): the
    quantizers store it, the twin and the Triton kernel read it back, the same bits as V in
    order."""
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity=granularity, block_k=128)
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + nk)
    offset = nk - nq if causal else None
    results = []
    for backend in ("reference", "triton"):
        plain, permuted = (quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True,
                                        backend=backend, permute_v=p) for p in (False, True))
        assert permuted.v_permuted and permuted.v.shape[2] == max(-(-nk // 16) * 16, 128)
        for qz in (plain, permuted):
            if backend == "reference":
                results.append(quantized_attention(
                    qz, pv="fp8", granularity=granularity, block_q=recipe.block_q,
                    block_k=recipe.block_k, causal_offset=offset))
            else:
                results.append(_kernel_attention(qz, recipe, offset))
    for (out, lse), (want, want_lse) in zip(results[1::2], results[0::2]):
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"smooth_q": True, "smooth_v": True}, id="smooth_qv"),
        pytest.param({"smooth_k": False, "balance_qk": False}, id="no_smoothing"),
        pytest.param({"block_q": 64, "block_k": 32, "granularity": "per_block"}, id="blocks64x32"),
        pytest.param({"block_k": 128}, id="block_k128"),
        pytest.param({"granularity": "per_thread", "block_q": 64, "block_k": 128},
                     id="per_thread"),
        pytest.param({"granularity": "per_thread", "smooth_q": True}, id="per_thread_smooth_q"),
    ],
)
def test_public_call_triton_equals_reference(name, options, monkeypatch, device):
    recipe = get_recipe(name).replace(**options)
    device.needs(recipe)
    q, k, v = channel_biased((2, 4, 100, 64), (2, 2, 150, 64), seed=5, dtype=torch.float16,
                             device=device.name)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    want, want_lse = lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True, return_lse=True)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    got, got_lse = lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True, return_lse=True)
    assert got.dtype == torch.float16
    # Statistics are summed in another order, so a few scales differ in the last bit and a few
    # quantized values (INT8, and FP8 of P̃) land on the other side of a rounding boundary
    # (H100, 2026-11-25: 2.014e-2 on one of 51200 values with smooth_qv and FP8 P̃).
    out_bound = Bound(atol=3e-2 if recipe.pv == "fp8" else 3e-3, cos=0.99999)
    assert_within(got.float(), want.float(), device.bound(f"int8 out {recipe.pv}", out_bound),
                  name="out")
    assert_within(got_lse, want_lse, device.bound("lse", Bound(atol=1e-3)), name="lse")


@pytest.mark.interpreter
def test_lse_is_that_of_the_unsmoothed_scores(triton_backend):
    q, k, v = channel_biased((1, 2, 96, 64), (1, 2, 96, 64), seed=8)
    _, lse = lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp16", return_lse=True)
    _, exact_lse = exact_attention(q, k, v, scale=64**-0.5)
    assert_close(lse, exact_lse.float(), atol=0.05, name="lse")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_layouts_strides_and_offsets(layout, triton_backend, device):
    base = torch.randn(3, 2, 150, 40).to(device.name)
    # non-contiguous views with a storage offset, in either layout
    q = base[1:, :, 10:110, :32]
    k = base[:2, :, 20:140:1, 4:36]
    v = base[:2, :, 5:125, 8:40]
    if layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    snapshot = base.clone()
    out = lowbit_attn.attention(q, k, v, layout=layout, recipe="qk_int8_pv_fp16")
    assert torch.equal(base, snapshot), "the caller's tensors must not be modified"
    assert out.shape == q.shape and out.is_contiguous()
    qh, kh, vh = ((x.transpose(1, 2) if layout == "NHD" else x) for x in (q, k, v))
    ref, _ = exact_attention(qh, kh, vh, scale=32**-0.5)
    ref = ref.transpose(1, 2) if layout == "NHD" else ref
    assert_within(out, ref, device.bound("exact", Bound(cos=0.9995)), name="out")


VARLEN_SIZES = [
    pytest.param([5, 70, 0, 33], [9, 40, 3, 33], 4, 2, 32, id="Nmax70-GQA4:2-D32"),
    # test_gpu.py's: sequences of many query blocks, one of a single token
    pytest.param([1, 700, 129, 2048], [1, 700, 129, 2048], 8, 2, 128, id="gpu-Nmax2048-GQA8:2-D128",
                 marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d", VARLEN_SIZES)
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_equals_each_sequence_alone(name, causal, lens_q, lens_k, hq, hkv, d,
                                           triton_backend, device):
    device.needs(name)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lens_q), hq, d, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, generator=g) + 3 * torch.randn(hkv, d, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, generator=g)
    q, k, v = (x.to(device.name) for x in (q, k, v))
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                               device=device.name) for lens in (lens_q, lens_k))
    out, lse = lowbit_attn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                            is_causal=causal, recipe=name, return_lse=True)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        alone, alone_lse = lowbit_attn.attention(
            q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0), layout="NHD",
            is_causal=causal, recipe=name, return_lse=True,
        )
        # the same kernels; on a GPU K's and V's statistics may be summed in another order
        assert_within(out[q0:q1], alone[0], device.bound("sum order", Bound(atol=1e-5)),
                      name=f"seq{i}")
        assert_within(lse[:, q0:q1], alone_lse[0], device.bound("lse", Bound(atol=1e-5)),
                      name=f"lse{i}")


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_fp8_v_padded_per_sequence_gives_the_same_bits(d, causal, monkeypatch):
    """Packed E4M3 V starts each sequence at a multiple of 16 tokens (``QuantizedQKV``): with
    sequences that start unaligned in the input (17, 18, 58 keys in), each sequence's output is
    the bits of the same sequence alone (dense V, unpadded), and the reference backend agrees to
    rounding."""
    lens_q, lens_k = [5, 1, 33, 2], [17, 1, 40, 16]
    g = torch.Generator().manual_seed(13)
    q = torch.randn(sum(lens_q), 2, d, generator=g)
    k = torch.randn(sum(lens_k), 1, d, generator=g) + 2
    v = torch.randn(sum(lens_k), 1, d, generator=g)
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        results[backend] = lowbit_attn.attention_varlen(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=causal,
            recipe="qk_int8_pv_fp8")
    out = results["triton"]
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        alone = lowbit_attn.attention(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0),
                                      v[k0:k1].unsqueeze(0), layout="NHD", is_causal=causal,
                                      recipe="qk_int8_pv_fp8")
        assert torch.equal(out[q0:q1], alone[0]), f"seq{i} differs"
    assert_close(out, results["reference"], atol=3e-3, name="out")


@pytest.mark.interpreter
def test_varlen_reference_backend_agrees(monkeypatch):
    lens = [17, 64, 1]
    q = torch.randn(sum(lens), 2, 64)
    k = torch.randn(sum(lens), 2, 64) + 2
    v = torch.randn(sum(lens), 2, 64)
    cu = torch.tensor([0, 17, 81, 82], dtype=torch.int32)
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        results.append(lowbit_attn.attention_varlen(q, k, v, cu, cu, 64, 64, is_causal=True,
                                                    recipe="qk_int8_pv_fp16"))
    assert_close(results[1], results[0], atol=3e-3, name="out")



@pytest.mark.interpreter
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_varlen_sequence_with_queries_and_no_keys(name, causal, backend, with_sinks,
                                                  monkeypatch):
    """Sequence 2 has 4 queries and no key: its rows are 0 and their LSE -inf (its K statistics
    are those of no token, not 0/0), or with sinks the sink's logit (the sink alone in each
    row's softmax: its V scale, never read for a key, is still written), and the other
    sequences are what they are alone."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    sinks = torch.tensor([0.5, -1.5]) if with_sinks else None
    cu_q = torch.tensor([0, 5, 9, 13, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 14, 14, 24], dtype=torch.int32)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(20, 2, 32, generator=g).half()
    k = (torch.randn(24, 1, 32, generator=g) + 3 * torch.randn(32, generator=g)).half()
    v = torch.randn(24, 1, 32, generator=g).half()
    out, lse = lowbit_attn.attention_varlen(q, k, v, cu_q, cu_k, 7, 10, is_causal=causal,
                                            recipe=name, return_lse=True, sinks=sinks)
    assert torch.all(out[9:13] == 0)
    if with_sinks:
        torch.testing.assert_close(lse[:, 9:13], sinks[:, None].expand(2, 4), atol=1e-6, rtol=0)
    else:
        assert torch.all(torch.isneginf(lse[:, 9:13]))
    for i in (0, 1, 3):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        alone, alone_lse = lowbit_attn.attention(
            q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0), layout="NHD",
            is_causal=causal, recipe=name, return_lse=True, sinks=sinks,
        )
        assert_close(out[q0:q1], alone[0], atol=1e-3, name=f"seq{i}")
        assert_close(lse[:, q0:q1], alone_lse[0], atol=1e-5, name=f"lse{i}")


@pytest.mark.interpreter
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_query_heads_give_empty_results(name, backend, monkeypatch):
    """``q[:, :0]`` with K/V heads: an empty output and LSE of the right shapes on both paths
    (the reference's quantizers reduced over no element: IndexError), as PyTorch's SDPA for the
    drop-in."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    q, k, v = channel_biased((2, 2, 9, 32), (2, 2, 11, 32), seed=23)
    q0 = q[:, :0]
    for layout, args in (("HND", (q0, k, v)), ("NHD", (x.transpose(1, 2) for x in (q0, k, v)))):
        out, lse = lowbit_attn.attention(*args, layout=layout, is_causal=True, recipe=name,
                                         return_lse=True)
        assert out.shape == (q0 if layout == "HND" else q0.transpose(1, 2)).shape
        assert out.dtype == q.dtype and lse.shape == (2, 0, 9) and lse.dtype == torch.float32
    assert lowbit_attn.attention(q0, k, v, recipe=name).shape == q0.shape
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    packed_q, packed_k, packed_v = (x.transpose(1, 2).flatten(0, 1) for x in (q[:1], k[:1], v[:1]))
    out, lse = lowbit_attn.attention_varlen(packed_q[:, :0], packed_k, packed_v, cu_q, cu_k, 5, 6,
                                            recipe=name, return_lse=True)
    assert out.shape == (9, 0, 32) and out.dtype == q.dtype
    assert lse.shape == (0, 9) and lse.dtype == torch.float32
    want = torch.nn.functional.scaled_dot_product_attention(q0, k, v, enable_gqa=True)
    api.reset_fallback_warnings()
    with torch.no_grad(), lowbit_attn.patch_sdpa(name), pytest.warns(UserWarning, match="empty"):
        got = torch.nn.functional.scaled_dot_product_attention(q0, k, v, enable_gqa=True)
    assert got.shape == want.shape and got.dtype == want.dtype


def _v_of_magnitude(factor, dtype, seed=21):
    q, k, v = channel_biased((1, 2, 70, 32), (1, 2, 70, 32), seed=seed)
    v[0, 0, 9] = 12.0  # with factor 1e4: 1.2e5, past fp16's 65504
    v[0, 1, :, 5] = 0.0  # an all-zero channel
    return q.to(dtype), k.to(dtype), (v * factor).to(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tiny_and_huge_v_keep_their_relative_precision(name, dtype, backend, monkeypatch):
    """V of 1e-8 or 1e-7 (flushed or subnormal in fp16) and of 1e4 (past 65504 in fp16): the
    same relative error as V of order 1, on both paths and both P·V formats."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)

    def rel_l1(factor):
        q, k, v = _v_of_magnitude(factor, dtype)
        out = lowbit_attn.attention(q, k, v, recipe=name)
        ref, _ = exact_attention(q.double(), k.double(), v.double(), scale=32**-0.5)
        assert torch.isfinite(out).all() and torch.all(out[0, 1, :, 5] == 0)
        return lowbit_attn.errors(out, ref).rel_l1

    base = rel_l1(1.0)
    for factor in (1e-8, 1e-7, 1e4):
        # measured: within 1 % of the order-1 error (bf16 rounds each V differently)
        assert rel_l1(factor) < 1.05 * base, factor

@pytest.mark.interpreter
def test_causal_rows_that_see_nothing_are_zero(triton_backend):
    q, k, v = channel_biased((1, 1, 40, 32), (1, 1, 16, 32), seed=3)
    out, lse = lowbit_attn.attention(q, k, v, is_causal=True, recipe="qk_int8_pv_fp8",
                                     return_lse=True)
    # bottom-right alignment: query i sees keys j <= i - 24
    assert torch.all(out[0, 0, :24] == 0) and torch.all(torch.isneginf(lse[0, 0, :24]))
    ref, _ = exact_attention(q, k, v, scale=32**-0.5, causal_offset=-24)
    assert lowbit_attn.errors(out[0, 0, 24:], ref[0, 0, 24:]).cosine > 0.999


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_and_inf_are_never_hidden(name, where, triton_backend, device):
    device.needs(name)
    q, k, v = channel_biased((1, 2, 80, 32), (1, 2, 80, 32), seed=4, device=device.name)
    tensors = {"q": q, "k": k, "v": v}
    for bad in (float("nan"), float("inf")):
        poisoned = {n: t.clone() for n, t in tensors.items()}
        poisoned[where][0, 1, 5, 3] = bad
        out = lowbit_attn.attention(poisoned["q"], poisoned["k"], poisoned["v"], recipe=name)
        assert torch.isfinite(out[0, 0]).all(), "a head without the bad value stays finite"
        if where == "q":
            assert not torch.isfinite(out[0, 1, 5]).all()  # the row that reads it
        else:
            assert (~torch.isfinite(out[0, 1])).any(dim=-1).all()  # every row reads key 5


@pytest.mark.interpreter
@pytest.mark.parametrize("var,value", [
    ("LOWBIT_ATTN_TRAIN_DQ", "fused"),
    ("LOWBIT_ATTN_BWD_KERNEL", "gluon"), ("LOWBIT_ATTN_KERNEL", "Gluon"),
    ("LOWBIT_ATTN_LAUNCH", "graph"),
])
def test_placement_modes_are_checked(var, value, triton_backend, monkeypatch):
    """Every placement variable is read by every call: a bad value raises on a forward call,
    naming the variable (values are case-sensitive)."""
    monkeypatch.setenv(var, value)
    q = torch.randn(1, 1, 8, 64)
    with pytest.raises(ValueError, match=var):
        lowbit_attn.attention(q, q, q, recipe="qk_int8_pv_fp8")


PIPELINE_CASES = [
    pytest.param(name, granularity, 130, 300, id=f"{name}-{granularity}")
    for name in RECIPES for granularity in ("per_block", "per_token")
] + [
    # no whole key block for some rows (causal diagonal), exactly one, a decode row, fewer keys
    # than one block
    pytest.param("qk_int8_pv_fp8", "per_token", nq, nk, id=f"fp8-Nq{nq}-Nk{nk}")
    for nq, nk in ((100, 100), (64, 128), (1, 257), (70, 40))
]


@pytest.mark.interpreter
@pytest.mark.parametrize("name,granularity,nq,nk", PIPELINE_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pipelined_loop_gives_the_same_bits(name, granularity, nq, nk, causal, triton_backend,
                                            monkeypatch):
    """The Hopper candidate that issues the next block's Q·Kᵀ before this block's softmax runs the
    same arithmetic in the same order as the plain loop."""
    from lowbit_attn.inference import kernel_int8 as attn_fwd_int8

    recipe = get_recipe(name).replace(granularity=granularity)
    q, k, v = channel_biased((1, 2, nq, 64), (1, 2, nk, 64), seed=4, dtype=torch.float16)
    tuner = attn_fwd_int8._attn_fwd_int8
    results = []
    for pipeline in (False, True):
        config = attn_fwd_int8.LaunchConfig(4, 1, (("PIPELINE", pipeline),))
        monkeypatch.setattr(tuner, "configs", attn_fwd_int8.triton_configs(
            {"interpreter": [config]}, None))
        results.append(lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=causal,
                                             return_lse=True))
    for plain, pipelined in zip(*results):
        assert torch.equal(plain, pipelined)


D256_CASES = [  # recipe, granularity, smooth_q (ΔS: read per query block)
    pytest.param("qk_int8_pv_fp8", "per_token", False, id="fp8-per_token"),
    pytest.param("qk_int8_pv_fp16", "per_block", True, id="fp16-per_block-smooth_q"),
    pytest.param("qk_int8_pv_fp8", "per_thread", False, id="fp8-per_thread"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("name,granularity,smooth_q", D256_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_256_in_half_blocks_gives_the_same_bits(name, granularity, smooth_q, causal,
                                                         monkeypatch):
    """At D = 256 a GPU runs halves of each 128-row query block (``M_SPLIT`` 2 in
    ``kernel_int8.CONFIGS``; whole blocks spill): rows are independent and per-block scales and
    ΔS are read by query block, so the same bits as whole blocks (the interpreter's config), and
    both the twin's to rounding. Nq = 150: two query blocks, three programs of 64 rows."""
    recipe = get_recipe(name).replace(granularity=granularity, smooth_q=smooth_q)
    q, k, v = channel_biased((1, 2, 150, 256), (1, 1, 100, 256), seed=256)
    offset = -20 if causal else None  # the first 20 rows see no key
    qz = quantize_qkv(q, k, v, recipe, 256**-0.5, need_lse_shift=True, backend="reference")
    assert (qz.delta_s is not None) == smooth_q
    want, want_lse = quantized_attention(
        qz, pv=recipe.pv, granularity=granularity, block_q=recipe.block_q,
        block_k=recipe.block_k, causal_offset=offset,
    )
    whole, whole_lse, halves, halves_lse = _whole_and_halves(qz, recipe, offset, monkeypatch)
    assert torch.equal(whole, halves) and torch.equal(whole_lse, halves_lse)
    out_bound = Bound(atol=3e-4 if recipe.pv == "fp16" else 4e-3, cos=0.999999)
    assert_within(halves, want, out_bound, name="out")
    assert_within(halves_lse, want_lse, Bound(atol=1e-5, rtol=1e-5), name="lse")


@pytest.mark.interpreter
@pytest.mark.parametrize("name,granularity", [("qk_int8_pv_fp8", "per_token"),
                                              ("qk_int8_pv_fp8", "per_thread"),
                                              ("qk_int8_pv_fp16", "per_block")])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [None, (40, 0)], ids=["causal", "window"])
def test_trial_64_row_programs_give_the_same_bits(name, granularity, d, window, monkeypatch):
    """``kernel_int8.TRIALS`` (64-row programs at D ≤ 128, two per SM on a GPU): each program
    takes half of a 128-row query block, as at D = 256, so the same bits as whole blocks, causal
    or windowed (the window's limits are per row). Nq = 150: three programs of 64 rows."""
    from lowbit_attn.core.variants import Variant

    recipe = get_recipe(name).replace(granularity=granularity)
    q, k, v = channel_biased((1, 2, 150, d), (1, 1, 170, d), seed=d)
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    variant = Variant() if window is None else Variant(left=window[0], right=window[1])
    whole, whole_lse, halves, halves_lse = _whole_and_halves(qz, recipe, 20, monkeypatch,
                                                             variant=variant)
    assert torch.equal(whole, halves) and torch.equal(whole_lse, halves_lse)
    assert whole.isfinite().all()

"""FP4 attention (SageAttention3 recipes): operand quantizers (kernel = twin, bit for bit), the P̃
quantizer's edges, the attention kernel against its PyTorch twin (on each target of the ``device``
fixture, tests/conftest.py), the twin against exact attention, recipe options and bad input."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import Bound, assert_close, assert_same, assert_within, channel_biased
from lowbit_attn.inference.prepare import quantize_qkv_fp4
from lowbit_attn.core.operands import padded_head_dim
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.quant import fp4_naive as ref_fp4
from lowbit_attn.quant import int8_naive as ref_quant
from lowbit_attn.quant import fp4_qkv_naive as ref_qf4
from lowbit_attn.inference.naive import fp4_attention

FORMATS = ["nvfp4", "mxfp4"]
RECIPE_OF = {"nvfp4": "qk_fp4_pv_fp4", "mxfp4": "qk_mxfp4_pv_mxfp4"}


# --- recipes ------------------------------------------------------------------------------------


def test_fp4_recipes_defaults():
    nv, mx = get_recipe("qk_fp4_pv_fp4"), get_recipe("qk_mxfp4_pv_mxfp4")
    assert (nv.qk, nv.pv, mx.qk, mx.pv) == ("nvfp4", "nvfp4", "mxfp4", "mxfp4")
    for r in (nv, mx):
        assert r.is_fp4 and r.smooth_q and r.smooth_k and r.two_level_p and not r.balance_qk


@pytest.mark.parametrize(
    "changes, message",
    [
        pytest.param({"pv": "fp8"}, "one format", id="mixed-formats"),
        pytest.param({"granularity": "per_token"}, "granularity", id="per-token"),
        pytest.param({"balance_qk": True}, "balance_qk", id="balance"),
        pytest.param({"block_k": 16}, "block_k", id="block_k-16"),
    ],
)
def test_fp4_recipe_rejects_options_it_cannot_take(changes, message):
    with pytest.raises(ValueError, match=message):
        get_recipe("qk_fp4_pv_fp4").replace(**changes)


@pytest.mark.parametrize("d", [40, 100])
def test_head_dim_not_a_multiple_of_32_is_refused(d):
    q = torch.randn(1, 1, 8, d)
    with pytest.raises(ValueError, match="multiple of 32"):
        lowbit_attn.attention(q, q, q, recipe="qk_fp4_pv_fp4")


# --- operand quantizers -------------------------------------------------------------------------


def _stats(x, center, block=0):
    return ref_quant.channel_stats(x, center=center, block=block)


@pytest.mark.parametrize("fmt", FORMATS)
def test_operands_dequantize_close_to_their_input(fmt):
    """Q (smoothed per block), K (smoothed per head), V (transposed, tokens padded): what the MMA
    sees, plus the centers and NVFP4 tensor scales, reproduces the input to FP4 precision; padding
    channels and tokens are exact zeros."""
    q, k, v = channel_biased((2, 2, 70, 96), (2, 2, 70, 96), seed=1)
    qm, qa = _stats(q, "block_mean", 32)
    km, ka = _stats(k, "mean")
    _, va = _stats(v, "none")
    dp = padded_head_dim(96)
    q4 = ref_qf4.quantize_qk_fp4(q, fmt, center=qm, center_per_block=True, block=32, amax=qa)
    k4 = ref_qf4.quantize_qk_fp4(k, fmt, center=km, amax=ka)
    v4 = ref_qf4.quantize_v_fp4(v, fmt, block_k=64, amax=va)
    assert q4[0].shape == (2, 2, 70, dp // 2) and v4[0].shape == (2, 2, dp, 64)
    for (packed, scale, g), x, center in (
        (q4, q, ref_quant.expand_blocks(qm, 32, 70)), (k4, k, km.unsqueeze(-2)),
        (v4, v.transpose(-1, -2), None),
    ):
        deq = ref_qf4.dequantize_fp4(packed, scale, fmt)
        if g is not None:
            deq = deq * g[:, :, None, None]
        n = x.shape[-1]
        if center is not None:
            x = x - center
        assert torch.all(deq[..., x.shape[-2]:, :] == 0) and torch.all(deq[..., n:] == 0)
        err = lowbit_attn.errors(deq[..., : x.shape[-2], :n], x)
        assert err.cosine > 0.99 and err.rel_l1 < 0.12, (fmt, err)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "shape",
    [pytest.param((1, 2, 70, 64), id="N70-D64"), pytest.param((2, 1, 130, 96), id="B2-N130-D96"),
     pytest.param((1, 1, 33, 32), id="N33-D32"),
     pytest.param((2, 8, 1000, 128), id="gpu-B2-H8-N1000-D128", marks=pytest.mark.gpu)],
)
def test_operand_kernels_equal_their_twins_bit_for_bit(fmt, shape, device):
    from lowbit_attn.quant import fp4_qkv as kqf4

    q, k, v = channel_biased(shape, shape, seed=shape[2], device=device.name)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    qm, qa = _stats(q, "block_mean", 64)
    km, ka = _stats(k, "mean")
    vm, va = _stats(v, "mean")
    cases = [
        ("q", lambda m: m.quantize_qk_fp4(q, fmt, center=qm, center_per_block=True, block=64,
                                          amax=qa)),
        ("k", lambda m: m.quantize_qk_fp4(k, fmt, center=km, amax=ka)),
        ("k-raw", lambda m: m.quantize_qk_fp4(k, fmt, amax=_stats(k, "none")[1])),
        ("v", lambda m: m.quantize_v_fp4(v, fmt, block_k=64, amax=va)),
        ("v-smoothed", lambda m: m.quantize_v_fp4(v, fmt, block_k=32, center=vm, amax=va)),
    ]
    for name, run in cases:
        want, got = run(ref_qf4), run(kqf4)
        assert_same(got[0], want[0], device, "fp4 codes", name=f"{name}: packed values")
        assert_same(got[1], want[1], device, "fp4 codes", name=f"{name}: scales")
        if fmt == "nvfp4":
            assert_same(got[2], want[2], device, "fp4 codes", name=f"{name}: tensor scales")
        else:
            assert got[2] is None and want[2] is None


# --- P̃ quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_p_quantizer_edges(fmt):
    """All-zero groups stay zero, a two-level row's peak 2688 is exact in NVFP4 (scale 448, E4M3's
    largest), NaN is kept in its group."""
    group = ref_qf4.FP4_GROUP[fmt]
    p = torch.zeros(3, 64)
    p[0, 0] = 2688.0
    p[0, 1] = 2688.0 / 6 * 1.5
    p[1, :group] = torch.linspace(0, 1, group)
    p[2, 5] = float("nan")
    out = ref_qf4.quantize_p(p, fmt)
    assert out[0, 0] == (2688.0 if fmt == "nvfp4" else 2048.0 * 1.5)  # MXFP4: 2^9 · 6 < 2688
    assert torch.all(out[0, group:] == 0) and torch.all(out[1, group:] == 0)
    # a row of P̃ ∈ [0, 1] quantized directly: NVFP4's scale 1/6 rounds to E4M3 0.171875, so its
    # peak comes back as 6·0.171875 (the loss two-level quantization avoids); MXFP4's 2^-2 is exact
    assert out[1, 0] == 0 and out[1, group - 1] == (1.03125 if fmt == "nvfp4" else 1.0)
    assert torch.isnan(out[2, :group]).all() and not torch.isnan(out[2, group:]).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_level_rows_peak_where_the_format_holds_them_exactly(fmt):
    """NVFP4 rows peak at 448·6 (scale 448), MXFP4 rows at 6 (a power-of-two scale holds 6 exactly;
    2688 would come back 14% high); rows without a visible key give P̃ = 0 and s1 = 0, and s1 stays
    finite however far below the running max the block is."""
    s = torch.tensor([[0.0, -1.0, -3.0] + [float("-inf")] * 61,
                      [float("-inf")] * 64,
                      [-300.0, -301.0] + [float("-inf")] * 62])
    block_max = s.amax(dim=-1)
    m = torch.tensor([0.0, -400.0, 10.0])
    p, s1 = ref_qf4.two_level_p(s, block_max, m, fmt)
    peak = 2688.0 if fmt == "nvfp4" else 6.0
    # exp2(log2 peak) is peak to an ulp of fp32; the quantized peak is exact
    assert p[0, 0] == pytest.approx(peak, rel=1e-6) and ref_qf4.quantize_p(p, fmt)[0, 0] == peak
    assert torch.all(p[1] == 0) and s1[1] == 0
    assert torch.isfinite(s1).all() and s1[0] == pytest.approx(1 / peak)
    assert s1[2] == pytest.approx(2.0**-310 / peak, rel=1e-3) or s1[2] == 0  # fp32 underflow


# --- the attention kernel against its twin ------------------------------------------------------


def _kernel(qz, recipe, head_dim, causal_offset, dtype=torch.float32, pipeline_qk=None):
    from lowbit_attn.inference import kernel_fp4 as attn_fwd_fp4

    b, hq, nq, _ = qz.q.shape
    out = torch.empty((b, hq, nq, head_dim), dtype=dtype, device=qz.q.device)
    lse = attn_fwd_fp4.attention(
        qz, out=out, head_dim=head_dim, block_q=recipe.block_q, block_k=recipe.block_k,
        causal_offset=causal_offset, two_level=recipe.two_level_p, return_lse=True,
        pipeline_qk=pipeline_qk,
    )
    return out, lse


KERNEL_CASES = [
    pytest.param(1, 2, 2, 130, 130, 64, id="B1-H2-N130-D64"),
    pytest.param(2, 4, 2, 77, 150, 32, id="B2-GQA4:2-Nq77-Nk150-D32"),
    pytest.param(1, 1, 1, 1, 100, 96, id="B1-decode-Nq1-Nk100-D96"),
] + [  # test_gpu.py's shapes: many query and key blocks per head
    pytest.param(2, 8, 4, 1000, 1500, d, id=f"gpu-B2-GQA8:4-Nq1000-Nk1500-D{d}",
                 marks=pytest.mark.gpu)
    for d in (64, 128)
]


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", KERNEL_CASES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_matches_reference_on_the_same_quantized_inputs(b, hq, hkv, nq, nk, d, fmt,
                                                                causal, device):
    recipe = get_recipe(RECIPE_OF[fmt])
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + nk, device=device.name)
    qz = quantize_qkv_fp4(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    offset = nk - nq if causal else None
    want, want_lse = fp4_attention(qz, head_dim=d, block_q=recipe.block_q,
                                   block_k=recipe.block_k, causal_offset=offset, two_level=True)
    got, got_lse = _kernel(qz, recipe, d, offset)
    # exp2 and the fp32 sums differ in the last bits, which now and then moves a P̃ value across
    # an E2M1 rounding boundary (a step of 1/6 to 1/3 of its group's largest value).
    assert_within(got, want, device.bound("fp4 out", Bound(atol=5e-3, cos=0.99999)), name="out")
    assert_within(got_lse, want_lse, device.bound("lse", Bound(atol=1e-5, rtol=1e-5)), name="lse")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", KERNEL_CASES[:2])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qk_one_block_ahead_gives_the_same_bits(b, hq, hkv, nq, nk, d, fmt, causal, device):
    """``pipeline_qk`` (Q·Kᵀ of the next key block issued before this block's softmax, the native
    sm_120 schedule) computes the serial loop's function exactly: the same bits."""
    recipe = get_recipe(RECIPE_OF[fmt]).replace(block_q=32, block_k=32)  # several key blocks
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=nq + nk, device=device.name)
    qz = quantize_qkv_fp4(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    offset = nk - nq if causal else None
    serial = _kernel(qz, recipe, d, offset, pipeline_qk=False)
    pipelined = _kernel(qz, recipe, d, offset, pipeline_qk=True)
    for got, want in zip(pipelined, serial):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"two_level_p": False}, id="direct-P"),
        pytest.param({"smooth_q": False, "smooth_k": False}, id="no-smoothing"),
        pytest.param({"smooth_v": True, "block_q": 64, "block_k": 32}, id="smooth_v-64x32"),
    ],
)
def test_public_call_triton_equals_reference(fmt, options, monkeypatch, device):
    recipe = get_recipe(RECIPE_OF[fmt]).replace(**options)
    q, k, v = channel_biased((1, 2, 90, 64), (1, 1, 120, 64), seed=3, dtype=torch.float16,
                             device=device.name)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # NHD
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    want, want_lse = lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True, layout="NHD",
                                           return_lse=True)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    got, got_lse = lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True, layout="NHD",
                                         return_lse=True)
    assert got.dtype == torch.float16 and got.shape == q.shape
    # statistics are summed in another order: a few scales and FP4 values differ by one step
    assert_within(got, want, device.bound("fp4 out", Bound(cos=0.9999)), name="out")
    assert_within(got_lse, want_lse, device.bound("lse", Bound(atol=1e-3)), name="lse")


@pytest.mark.interpreter
def test_varlen_runs_each_sequence_like_a_dense_call(triton_backend):
    q, k, v = channel_biased((1, 2, 100, 32), (1, 2, 100, 32), seed=8)
    cu = torch.tensor([0, 37, 100], dtype=torch.int32)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    got = lowbit_attn.attention_varlen(*packed, cu, cu, 63, 63, recipe="qk_fp4_pv_fp4",
                                       is_causal=True)
    for lo, hi in ((0, 37), (37, 100)):
        want = lowbit_attn.attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi],
                                     recipe="qk_fp4_pv_fp4", is_causal=True)
        assert_close(got[lo:hi], want[0].transpose(0, 1), atol=1e-6, name=f"seq {lo}:{hi}")


# --- the twin against exact attention -----------------------------------------------------------


# (the bar on the channel-biased input, NVFP4 vs MXFP4: tests/tools/test_accuracy.py)


def test_exact_edges_rows_without_keys_and_nan(reference_backend):
    q, k, v = channel_biased((1, 1, 80, 64), (1, 1, 40, 64), seed=2)
    out = lowbit_attn.attention(q, k, v, recipe="qk_fp4_pv_fp4", is_causal=True)
    assert torch.all(out[:, :, :40] == 0)  # queries 0..39 see no key (bottom-right alignment)
    assert torch.isfinite(out).all()
    v = v.clone()
    v[0, 0, 3, 5] = float("nan")
    out = lowbit_attn.attention(q, k, v, recipe="qk_fp4_pv_fp4")
    assert torch.isnan(out).any(), "a NaN in V must not be hidden"


def test_global_scale_from_amax_handles_zero_and_nan():
    amax = torch.tensor([0.0, 2688.0, float("nan"), 1e-45])
    g = ref_fp4.global_scale_from_amax(amax)
    assert g[0] == 1 and g[1] == 1 and torch.isnan(g[2]) and g[3] == 2.0**-126

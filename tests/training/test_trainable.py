"""Trainable attention (SageBwd): the reference against float64 autograd of exact attention (the
accuracy bars and the dP-in-INT8 ablation), finite-difference gradient checks of the exact recipe,
the Triton kernels against the reference (on each target of the ``device`` fixture,
tests/conftest.py), autograd plumbing, torch.compile, bad input."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import Bound, assert_close, assert_within, channel_biased
from lowbit_attn.tools.inputs import FAMILIES
from lowbit_attn.core.metrics import errors
from lowbit_attn.training.prepare import prepare, prepare_grad
from lowbit_attn.core.operands import TRAIN_MATMULS
from lowbit_attn.core.recipes import TrainRecipe, recipe_from_key, recipe_key, resolve_train
from lowbit_attn.training import naive as ref
from lowbit_attn.training.op import train_fwd

ALL_16BIT = tuple(TRAIN_MATMULS)


def _grads(fn, q, k, v, do, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def _exact(q, k, v, *, is_causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                            enable_gqa=True)


# --- accuracy of the numerics (CPU reference) against float64 autograd --------------------------


@pytest.fixture(scope="module")
def channel_biased_grads():
    """Errors of output and gradients on ``channel_bias_k`` (bf16, N=1024, D=128, 2 heads), per
    variant and causality, measured against float64 autograd of exact attention."""
    out = {}
    for causal in (False, True):
        g = torch.Generator().manual_seed(0)
        q, k, v = FAMILIES["channel_bias_k"](g, 1, 2, 2, 1024, 1024, 128, torch.bfloat16)
        do = torch.randn(q.shape, generator=g).to(torch.bfloat16)
        exact = _grads(_exact, *(x.double() for x in (q, k, v, do)), is_causal=causal)
        for name, kw in (("sagebwd", {}), ("dp_int8", {"keep_16bit": ()})):
            got = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=causal, **kw)
            out[name, causal] = [errors(a, e) for a, e in zip(got, exact)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sagebwd_meets_the_accuracy_bars(channel_biased_grads, causal):
    o, dq, dk, dv = channel_biased_grads["sagebwd", causal]
    # Bars of the issue (output 0.999, dV 0.995, dQ and dK 0.99) and the published dQ cosine
    # with dP in 16-bit, 0.9977. Measured here: 0.9998 / 0.9989 / 0.9989 / 0.9992 (full).
    assert o.cosine >= 0.999 and dv.cosine >= 0.995
    assert dq.cosine >= 0.9977 and dk.cosine >= 0.9977
    assert max(dq.rel_l1, dk.rel_l1, dv.rel_l1) < 0.06  # measured ≤ 0.048


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dp_in_int8_is_worse(channel_biased_grads, causal):
    """dP = dO·Vᵀ in INT8 adds error to dS, hence to dQ and dK; dV does not use dP."""
    base, ablation = channel_biased_grads["sagebwd", causal], channel_biased_grads["dp_int8", causal]
    for i in (1, 2):  # dq, dk
        assert ablation[i].cosine < base[i].cosine and ablation[i].rel_l1 > base[i].rel_l1
    assert ablation[3] == base[3] and ablation[0] == base[0]


@pytest.mark.slow
def test_balancing_rescues_outlier_channels():
    """Not part of SageBwd: Q/K channel balancing (as in the inference recipes) for inputs whose Q
    and K have outlier channels. Measured (N=512, D=128, GQA 4/2, bf16): output 0.979 → 0.9994,
    dQ 0.973 → 0.998, dK 0.972 → 0.999, dV 0.977 → 0.998."""
    g = torch.Generator().manual_seed(0)
    q, k, v = FAMILIES["outliers"](g, 1, 4, 2, 512, 512, 128, torch.bfloat16)
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    exact = _grads(_exact, *(x.double() for x in (q, k, v, do)))
    plain = _grads(lowbit_attn.trainable_attention, q, k, v, do)
    balanced = _grads(lowbit_attn.trainable_attention, q, k, v, do, balance_qk=True)
    for name, p, b, e in zip(("out", "dq", "dk", "dv"), plain, balanced, exact):
        assert errors(b, e).cosine > max(errors(p, e).cosine, 0.997), name
    assert errors(balanced[0], exact[0]).cosine >= 0.999


def test_exact_recipe_matches_float64_autograd():
    q, k, v = channel_biased((2, 4, 50, 24), (2, 2, 60, 24), seed=3, dtype=torch.float64)
    do = torch.randn(q.shape, dtype=torch.float64)
    for causal in (False, True):
        got = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=causal, recipe="exact",
                     smooth_q=True)
        # SDPA's causal mask is top-left; ours bottom-right: shift with explicit masks.
        mask = torch.ones(50, 60, dtype=torch.bool).tril(10) if causal else None
        want = _grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, attn_mask=mask, enable_gqa=True), q, k, v, do)
        for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, e, atol=1e-12, rtol=1e-10, name=name)


@pytest.mark.parametrize(
    "kw, causal",
    [
        pytest.param({}, True, id="smooth_k-causal"),
        pytest.param({"smooth_k": False}, False, id="no-smoothing"),
        pytest.param({"smooth_q": True}, True, id="smooth_q-causal"),
        pytest.param({"balance_qk": True, "smooth_q": True}, False, id="balance-smooth_q"),
    ],
)
def test_gradcheck_exact_recipe(kw, causal):
    """Finite differences in float64 check the backward's formulas (dS, Δ, the scale, GQA sums,
    the Q-smoothing dK correction, a bottom-right causal mask). Keys span
    two 64-token blocks; D=2 keeps the full Jacobian cheap (fast_mode's random projections are
    too small at these sizes to catch even a 50% error in one gradient)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 20, 2, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 66, 2, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 66, 2, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b, c: lowbit_attn.trainable_attention(a, b, c, is_causal=causal, recipe="exact", **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_rows_that_see_no_key_give_zero_output_and_gradients():
    q, k, v = channel_biased((1, 2, 80, 16), (1, 2, 64, 16), seed=4)
    do = torch.randn(q.shape)
    out, dq, dk, dv = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=True)
    assert torch.all(out[:, :, :16] == 0) and torch.all(dq[:, :, :16] == 0)
    assert all(torch.isfinite(x).all() for x in (out, dq, dk, dv))


def test_nan_is_never_hidden():
    q, k, v = channel_biased((1, 2, 70, 32), (1, 2, 70, 32), seed=5)
    v[0, 1, 3, 5] = float("nan")
    out, dq, dk, dv = _grads(lowbit_attn.trainable_attention, q, k, v, torch.ones(q.shape))
    assert torch.isnan(out[0, 1]).any() and not torch.isnan(out[0, 0]).any()
    assert torch.isnan(dq[0, 1]).any() and torch.isnan(dk[0, 1]).any()
    assert torch.isfinite(dv).all()  # dV = Pᵀ·dO does not involve V
    assert not any(torch.isnan(x[0, 0]).any() for x in (dq, dk, dv))


# --- nearly one-hot rows: FlashAttention's bwd_overflow inputs ----------------------------------


def _bwd_overflow(dtype, n, d, seed=0):
    """FlashAttention's ``test_flash_attn_bwd_overflow`` inputs (B=2, 2 query heads on 1 K/V head):
    Q×5, K and V×3 of N(0, 1), dO N(0, 1). Scores of tens make most rows of P nearly one-hot."""
    g = torch.Generator().manual_seed(seed + 100 * n + d)
    q = (torch.randn(2, 2, n, d, generator=g) * 5).to(dtype)
    k, v = ((torch.randn(2, 1, n, d, generator=g) * 3).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=g).to(dtype)


OVERFLOW_GRID = [(n, d) for n in (1, 2, 5, 17) for d in (16, 32, 64)]
TWO_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


@pytest.mark.parametrize("dtype", TWO_DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_rows_of_ds_sum_to_zero(dtype, causal):
    """Δ_i = Σ_j P_ij·dP_ij from the P and dP that dS uses, so Σ_j dS_ij is fp32 rounding of the
    terms (measured ≤ 11.6 eps·Σ_j |P_ij·dP_ij|). With Δ = rowsum(dO ∘ O) and the INT8 forward's
    O the row sums reached 2.3e7 eps, 2.7× the terms' size."""
    r = resolve_train("sagebwd_int8")
    eps = torch.finfo(torch.float32).eps
    for n, d in OVERFLOW_GRID:
        q, k, v, do = _bwd_overflow(dtype, n, d)
        ops = prepare(q, k, v, r, d ** -0.5, "reference")
        offset = 0 if causal else None
        _, lse = ref.forward(ops, causal_offset=offset)
        p, dp, ds = ref.probabilities(ops, prepare_grad(do, r, "reference"), lse,
                                      causal_offset=offset)
        bound = 32 * eps * (p * dp).abs().sum(dim=-1)
        assert torch.all(ds.sum(dim=-1).abs() <= bound), (n, d)


ONE_KEY_PATHS = [
    pytest.param("reference", "recompute", id="reference"),
    pytest.param("triton", "recompute", marks=pytest.mark.interpreter, id="triton"),
    pytest.param("triton", "atomic", marks=pytest.mark.interpreter, id="triton-atomic"),
]


@pytest.mark.parametrize("backend, dq_mode", ONE_KEY_PATHS)
@pytest.mark.parametrize("dtype", TWO_DTYPES)
def test_one_key_gives_zero_dq_and_dk(monkeypatch, backend, dq_mode, dtype):
    """One key: P = 1 whatever Q and K are, so the exact dQ and dK are 0 (here exactly 0). dK was
    5-22 % of max|dV| with Δ from the INT8 forward's output (both dQ modes: Δ is shared)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", dq_mode)
    for d, causal in ((16, False), (64, True)):
        q, k, v, do = _bwd_overflow(dtype, 1, d)
        _, dq, dk, dv = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=causal)
        scale = float(dv.abs().max())
        ratios = [float(x.abs().max()) / scale for x in (dq, dk)]
        assert scale > 1 and max(ratios) <= 1e-6, (d, causal, ratios)


def _overflow_cosines(dtype, causal, grid):
    """``[(cos dQ, cos dK, cos dV), ...]`` of the public function against float64 autograd."""
    out = []
    for n, d in grid:
        q, k, v, do = _bwd_overflow(dtype, n, d)
        exact = _grads(_exact, *(x.double() for x in (q, k, v, do)), is_causal=causal)
        got = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=causal)
        out.append(tuple(errors(a.float(), e).cosine for a, e in zip(got[1:], exact[1:])))
    return torch.tensor(out)


@pytest.mark.parametrize("dtype", TWO_DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_nearly_one_hot_rows_meet_a_gradient_bar(dtype, causal):
    """Measured on the reference (N = 2, 5, 17; D = 16, 32, 64): dQ and dK cosine ≥ 0.979, their
    mean per dtype and causality ≥ 0.9954 (with Δ from the INT8 forward's output: ≥ 0.838, mean
    0.975-0.987); dV ≥ 0.9991 (unchanged). What remains is dS quantized to INT8 per 64×64 tile:
    rows whose dS is small next to the tile's largest keep few digits."""
    cos = _overflow_cosines(dtype, causal, [(n, d) for n, d in OVERFLOW_GRID if n > 1])
    assert cos[:, :2].min() >= 0.975 and cos[:, :2].mean() >= 0.995, cos
    assert cos[:, 2].min() >= 0.999, cos


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype, dq_mode", [
    pytest.param(torch.float16, "recompute", id="fp16"),
    pytest.param(torch.bfloat16, "recompute", id="bf16"),
    pytest.param(torch.float16, "atomic", id="fp16-atomic"),
])
def test_nearly_one_hot_rows_on_the_kernels(monkeypatch, triton_backend, dtype, dq_mode):
    """The same bar on the Triton path (interpreted), causal and not, dQ by its own kernel or by
    atomics in the dK/dV kernel."""
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", dq_mode)
    for causal in (False, True):
        cos = _overflow_cosines(dtype, causal, [(2, 64), (5, 16), (17, 32)])
        assert cos[:, :2].min() >= 0.975 and cos[:, 2].min() >= 0.999, (causal, cos)


# --- kernels against the reference (interpreter, and compiled on a GPU) -------------------------

KERNEL_CASES = [
    pytest.param(torch.float16, False, {}, (1, 2, 1, 100, 96, 64), id="fp16-B1-H2/1-N100x96-D64"),
    pytest.param(torch.float16, True, {}, (2, 4, 2, 130, 100, 64), id="fp16-causal-B2-H4/2-N130x100"),
    pytest.param(torch.bfloat16, True, {}, (1, 2, 2, 70, 70, 128), id="bf16-causal-D128"),
    pytest.param(torch.bfloat16, False, {"keep_16bit": ()}, (1, 2, 1, 70, 90, 40), id="bf16-dp-int8-D40"),
    pytest.param(torch.float16, True, {"smooth_q": True}, (1, 2, 2, 80, 90, 64), id="fp16-causal-smooth_q"),
    pytest.param(torch.float16, False, {"smooth_k": False}, (1, 1, 1, 64, 64, 64), id="fp16-no-smoothing"),
    pytest.param(torch.float16, True, {"keep_16bit": ALL_16BIT}, (1, 2, 1, 64, 70, 32), id="fp16-all-16bit"),
    pytest.param(torch.float16, False, {"keep_16bit": ("qk", "dv")}, (1, 2, 1, 65, 64, 64), id="fp16-qk-dv-16bit"),
    pytest.param(torch.bfloat16, True, {"balance_qk": True, "smooth_q": True}, (1, 4, 2, 70, 80, 64),
                 id="bf16-causal-balance-smooth_q-GQA"),
    pytest.param(torch.float16, False, {"balance_qk": True, "keep_16bit": ("qk", "dq")}, (1, 2, 1, 64, 64, 32),
                 id="fp16-balance-qk-dq-16bit"),
]
GPU_KERNEL_CASES = [  # test_gpu.py's shapes: many query and key blocks per head
    pytest.param(torch.bfloat16, True, {}, (2, 8, 4, 700, 900, 128),
                 id="gpu-bf16-causal-B2-H8/4-N700x900-D128", marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, False, {"keep_16bit": ()}, (2, 8, 4, 700, 900, 64),
                 id="gpu-bf16-dp-int8-B2-H8/4-N700x900-D64", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("dtype, causal, kw, shape", KERNEL_CASES + GPU_KERNEL_CASES)
def test_kernels_match_reference(dtype, causal, kw, shape, device):
    _kernels_match_reference(dtype, causal, kw, shape, "recompute", device)


@pytest.mark.parametrize("dtype, causal, kw, shape",
                         [KERNEL_CASES[1], KERNEL_CASES[-2], KERNEL_CASES[-1]] + GPU_KERNEL_CASES)
def test_atomic_dq_matches_reference(dtype, causal, kw, shape, device):
    """dQ added by the dK/dV kernel (``LOWBIT_ATTN_TRAIN_DQ=atomic``) instead of its own kernel."""
    _kernels_match_reference(dtype, causal, kw, shape, "atomic", device)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["recompute", "atomic"])
def test_tensor_memory_targets_give_the_same_gradients(monkeypatch, mode):
    """On the sm_100 family the backward reduces each dS tile's scale as a ``[1, 1]`` tile
    (Triton 3.6 cannot compile the scalar reduction there): the same gradients, bit for bit."""
    from lowbit_attn.training import kernel_bwd

    q, k, v = channel_biased((1, 2, 100, 64), (1, 1, 90, 64), seed=3, dtype=torch.float16)
    do = torch.randn(q.shape).to(torch.float16)
    r = resolve_train("sagebwd_int8")
    ops = prepare(q, k, v, r, 0.125, "reference")
    grad = prepare_grad(do, r, "reference")
    _, lse = ref.forward(ops, causal_offset=None)
    grads = []
    for tmem in (False, True):
        monkeypatch.setattr(kernel_bwd, "tensor_memory", lambda capability, tmem=tmem: tmem)
        got = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        kernel_bwd.backward(ops, grad, lse, *got, causal_offset=None, softmax_scale=0.125,
                            mode=mode)
        grads.append(got)
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name


def _kernels_match_reference(dtype, causal, kw, shape, mode, device):
    from lowbit_attn.training import kernel_bwd as attn_train_bwd, kernel_fwd as attn_train_fwd

    b, hq, hkv, nq, nk, d = shape
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=6, dtype=dtype,
                             device=device.name)
    do = torch.randn(q.shape).to(device.name, dtype)
    r = resolve_train("sagebwd_int8", **kw)
    scale = d ** -0.5
    offset = nk - nq if causal else None
    ops = prepare(q, k, v, r, scale, "reference")
    want_o, want_lse = ref.forward(ops, causal_offset=offset)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    lse = attn_train_fwd.forward(ops, out=out, causal_offset=offset)
    assert_within(lse, want_lse, device.bound("train lse", Bound(atol=2e-5)), name="lse")
    out_bound = device.bound("train out", Bound(atol=2e-2 if dtype == torch.bfloat16 else 2e-3,
                                                cos=0.99999))
    assert_within(out.float(), want_o.to(dtype).float(), out_bound.only("atol"), name="out")
    assert_within(out.float(), want_o, out_bound.only("cos"), name="out")

    grad = prepare_grad(do, r, "reference")
    want = ref.backward(ops, grad, lse, causal_offset=offset, softmax_scale=scale)
    got = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    attn_train_bwd.backward(ops, grad, lse, *got, causal_offset=offset, softmax_scale=scale,
                            mode=mode)
    # relative L2: an INT8 rounding tie decided the other way (one step of 1/127 in one P or dS
    # element) moves a single gradient entry by ~1e-3 of the largest, but not the norm
    grad_bound = device.bound("train grad", Bound(rel_l2=5e-3 if dtype == torch.bfloat16 else 1e-3,
                                                  cos=0.99999))
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert_within(a.float(), e, grad_bound, name=name)


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_public_function_on_the_kernels(triton_backend, layout):
    """End to end through the custom ops and autograd, kernels interpreted, against the reference."""
    q, k, v = channel_biased((1, 4, 72, 64), (1, 2, 72, 64), seed=7, dtype=torch.float16)
    do = torch.randn(q.shape).to(torch.float16)
    if layout == "NHD":
        q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    got = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=True, layout=layout)
    import os

    os.environ["LOWBIT_ATTN_BACKEND"] = "reference"
    want = _grads(lowbit_attn.trainable_attention, q, k, v, do, is_causal=True, layout=layout)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert errors(a.float(), e.float()).cosine > 0.99999, name


# --- autograd plumbing, compile, bad input (CPU reference) ---------------------------------------


def test_only_the_inputs_that_require_grad_get_one():
    q, k, v = channel_biased((1, 2, 40, 32), (1, 2, 40, 32), seed=8)
    q.requires_grad_()
    out = lowbit_attn.trainable_attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None


def test_without_grad_it_is_a_plain_forward():
    q, k, v = channel_biased((1, 2, 40, 32), (1, 2, 40, 32), seed=8)
    with torch.no_grad():
        out = lowbit_attn.trainable_attention(q, k, v)
    assert not out.requires_grad and out.shape == q.shape


def test_double_backward_raises_a_clear_error():
    q, k, v = channel_biased((1, 2, 20, 16), (1, 2, 20, 16), seed=9)
    q.requires_grad_()
    out = lowbit_attn.trainable_attention(q, k, v)
    (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        g.sum().backward()


def test_fullgraph_compile_with_backward_matches_eager():
    torch._dynamo.reset()
    q, k, v = channel_biased((1, 2, 40, 32), (1, 1, 48, 32), seed=10)
    do = torch.randn(q.shape)

    def f(q, k, v):
        return lowbit_attn.trainable_attention(q * 1.5, k, v, is_causal=True).tanh()

    eager = _grads(f, q, k, v, do)
    compiled = _grads(torch.compile(f, fullgraph=True, backend="aot_eager"), q, k, v, do)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("nhd", [False, True])
def test_custom_op_passes_opcheck(nhd):
    q, k, v = channel_biased((1, 4, 20, 16), (1, 2, 24, 16), seed=11)
    if nhd:
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    q.requires_grad_()
    r = resolve_train("sagebwd_int8", balance_qk=True)
    args = (q, k, v, recipe_key(r), 0.25, True, 4, nhd)
    torch.library.opcheck(train_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static",
                                      "test_autograd_registration"))


def test_dq_mode_is_checked_in_the_forward(monkeypatch):
    """The backward reads it; a bad value raised only there, after the forward had run."""
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", "fused")
    q = torch.randn(1, 1, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="LOWBIT_ATTN_TRAIN_DQ"):
        lowbit_attn.trainable_attention(q, q, q)


def test_recipe_key_round_trips_train_recipes():
    custom = resolve_train("sagebwd_int8", smooth_q=True, balance_qk=True, keep_16bit=("qk", "dq"))
    for r in (*lowbit_attn.TRAIN_RECIPES.values(), custom):
        assert recipe_from_key(recipe_key(r), TrainRecipe) == r
    unsorted = recipe_key(lowbit_attn.TRAIN_RECIPES["sagebwd_int8"]).replace("dk,dq", "dq,dk")
    with pytest.raises(ValueError, match="recipe key"):
        recipe_from_key(unsorted, TrainRecipe)


def test_recipes():
    sage = lowbit_attn.TRAIN_RECIPES["sagebwd_int8"]
    assert sage.int8 == frozenset(TRAIN_MATMULS) - {"dp"} and sage.smooth_k and not sage.smooth_q
    assert resolve_train("sagebwd_int8", smooth_k=True, smooth_q=False, keep_16bit=()).int8 == frozenset(TRAIN_MATMULS)
    assert resolve_train("exact", smooth_k=False, smooth_q=False, keep_16bit=("dp",)).is_exact


@pytest.mark.parametrize(
    "kw, exc, message",
    [
        pytest.param({"recipe": "qk_int8_pv_fp8"}, ValueError, "unknown trainable recipe", id="inference-recipe"),
        pytest.param({"recipe": 3}, TypeError, "recipe must be", id="recipe-type"),
        pytest.param({"keep_16bit": ("dO",)}, ValueError, "keep_16bit names unknown", id="keep-unknown"),
        pytest.param({"keep_16bit": "dp"}, TypeError, "keep_16bit must be a tuple", id="keep-str"),
        pytest.param({"keep_16bit": 3}, TypeError, "keep_16bit must be a tuple of matmul names.*got int 3",
                     id="keep-int"),
        pytest.param({"keep_16bit": ("dp", 2)}, TypeError, "keep_16bit must hold matmul names", id="keep-items"),
        pytest.param({"scale": 10**400}, ValueError, "scale must be a positive finite", id="scale-huge"),
        pytest.param({"smooth_k": 1}, TypeError, "smooth_k must be a bool", id="smooth-type"),
        pytest.param({"is_causal": None}, TypeError, "is_causal must be a bool", id="causal-type"),
        pytest.param({"layout": "BHND"}, ValueError, "layout must be", id="layout"),
        pytest.param({"scale": -1.0}, ValueError, "scale must be a positive", id="scale"),
    ],
)
def test_bad_options(kw, exc, message):
    q, k, v = channel_biased((1, 2, 8, 16), (1, 2, 8, 16), seed=0)
    with pytest.raises(exc, match=message):
        lowbit_attn.trainable_attention(q, k, v, **kw)


def test_bad_tensors():
    q, k, v = channel_biased((1, 2, 8, 16), (1, 2, 8, 16), seed=0)
    with pytest.raises(TypeError, match="share one dtype"):
        lowbit_attn.trainable_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="q must be"):
        lowbit_attn.trainable_attention(q.int(), k, v)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        lowbit_attn.trainable_attention(torch.randn(1, 3, 8, 16), k, v)
    with pytest.raises(ValueError, match="same shape"):
        lowbit_attn.trainable_attention(q, k, v[:, :, :4])


@pytest.mark.interpreter
def test_kernels_refuse_fp32(triton_backend):
    q, k, v = channel_biased((1, 2, 8, 16), (1, 2, 8, 16), seed=0)
    with pytest.raises(TypeError, match="kernels take float16 or bfloat16"):
        lowbit_attn.trainable_attention(q, k, v)


def test_empty_queries_give_an_empty_output_with_a_graph():
    """No query rows: an empty output whose backward gives q, k and v zero gradients (k and v
    got none before), even where k holds a NaN (no row reads it)."""
    q = torch.zeros(1, 2, 0, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    k[0, 0, 0, 0] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    out = lowbit_attn.trainable_attention(q, k, v)
    assert out.shape == q.shape
    out.sum().backward()
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))

"""trainable_attention with the LLM variants (issue 44): window, chunk and softcap forward and
backward against float64 autograd of exact attention with the mask built entry by entry
(``helpers.independent_mask``); the Triton kernels (the interpreter on a CPU) against their twins;
K smoothing under a softcap; the refusals (sinks; the sm90 backward for a variant)."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import channel_biased, exact64, independent_mask, needs_gluon
from lowbit_attn.core.variants import Variant


def _exact64(q, k, v, *, causal=False, window=None, softcap=None, chunk=None):
    mask = independent_mask(q.shape[2], k.shape[2], causal=causal, window=window, chunk=chunk)
    return exact64(q, k, v, mask, scale=q.shape[-1] ** -0.5, softcap=softcap)[0]


def _grads(fn, q, k, v, do, dtype, **kw):
    leaves = [x.to(dtype).clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(do.to(dtype))
    return [out.detach().double()] + [x.grad.double() for x in leaves]


VARIANTS = [
    pytest.param(dict(window=(5, 3)), id="win5-3"),
    pytest.param(dict(window=(9, 0), is_causal=True), id="win9-causal"),
    pytest.param(dict(softcap=2.0), id="softcap2"),
    pytest.param(dict(chunk=16, is_causal=True, softcap=3.0), id="chunk16-softcap3"),
    pytest.param(dict(window=(4, 2), chunk=8), id="win4-2-chunk8"),
    # K smoothed under a softcap, with Q smoothed and the channels balanced: the rows' shift,
    # dQ's K-mean term after α, dK's Q-mean term
    pytest.param(dict(softcap=4.0, is_causal=True, smooth_k=True, smooth_q=True, balance_qk=True),
                 id="softcap4-smoothed-balanced"),
]


@pytest.mark.parametrize("kw", VARIANTS)
# exact in float64: float64 throughout, the softcap's constants too (fp32 ones gave ~1e-8)
@pytest.mark.parametrize("recipe,dtype,rel", [("exact", torch.float64, 1e-12),
                                              ("sagebwd_int8", torch.float32, 6e-2)])
def test_reference_against_float64_autograd(kw, recipe, dtype, rel, monkeypatch):
    """Output and dQ, dK, dV of the PyTorch path against float64 autograd (relative L2)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    q, k, v = channel_biased((1, 2, 45, 32), (1, 1, 70, 32), seed=11, dtype=torch.float64,
                             bias=1.0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = _grads(_exact64, q, k, v, do, torch.float64, causal=kw.get("is_causal", False),
                  window=kw.get("window"), softcap=kw.get("softcap"), chunk=kw.get("chunk"))
    got = _grads(lowbit_attn.trainable_attention, q, k, v, do, dtype, recipe=recipe, **kw)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((g - w).norm() / w.norm())
        assert err < rel, f"{name}: relative L2 {err:.2e}"


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("recipe", ["exact", "sagebwd_int8"])
def test_kernels_match_twins(kw, recipe, monkeypatch, device):
    """The Triton forward and backward against the twins, fp16 inputs, GQA, Nq < Nk."""
    q, k, v = channel_biased((1, 2, 45, 32), (1, 1, 70, 32), seed=12, device=device.name,
                             bias=1.0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(device.name)
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        results.append(_grads(lowbit_attn.trainable_attention, q, k, v, do, torch.float16,
                              recipe=recipe, **kw))
    for name, g, w in zip(("out", "dq", "dk", "dv"), *results):
        err = float((g - w).norm() / w.norm())
        assert err < 2e-3, f"{name}: relative L2 {err:.2e} between the kernels and the twins"


def test_atomic_dq_takes_the_dq_kernel_under_a_softcap(monkeypatch, device):
    """dQ's K-mean correction is the dQ kernel's: LOWBIT_ATTN_TRAIN_DQ=atomic computes such a
    backward there, and gives the twins' gradients."""
    q, k, v = channel_biased((1, 2, 45, 32), (1, 1, 70, 32), seed=13, device=device.name,
                             bias=1.0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(device.name)
    monkeypatch.setenv("LOWBIT_ATTN_TRAIN_DQ", "atomic")
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        results.append(_grads(lowbit_attn.trainable_attention, q, k, v, do, torch.float16,
                              recipe="sagebwd_int8", softcap=2.0))
    for name, g, w in zip(("out", "dq", "dk", "dv"), *results):
        err = float((g - w).norm() / w.norm())
        assert err < 2e-3, f"{name}: relative L2 {err:.2e} between the kernels and the twins"


@pytest.mark.parametrize("causal", [False, True])
def test_k_smoothing_keeps_dq_accurate_under_a_softcap(causal, monkeypatch):
    """Keys with a channel bias: a softcap keeps K smoothed (the tanh takes each row's shift back,
    dQ gets Σ_j dS_ij·mean K), so dQ is as accurate as without a cap; with smoothing off (as
    every softcapped call ran before) its error is several times larger."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")
    q, k, v = channel_biased((1, 2, 192, 64), (1, 2, 192, 64), seed=21, dtype=torch.float64,
                             bias=4.0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = _grads(_exact64, q, k, v, do, torch.float64, causal=causal, softcap=20.0)
    errs = {}
    for smooth in (None, False):
        got = _grads(lowbit_attn.trainable_attention, q, k, v, do, torch.bfloat16,
                     recipe="sagebwd_int8", is_causal=causal, softcap=20.0, smooth_k=smooth)
        errs[smooth] = [float((g - w).norm() / w.norm()) for g, w in zip(got, want)]
    smoothed, plain = errs[None], errs[False]
    assert smoothed[1] < 0.06 and plain[1] > 3 * smoothed[1], (smoothed, plain)  # dQ
    assert max(smoothed[0], smoothed[2], smoothed[3]) < 0.06, smoothed


def test_refusals():
    q, k, v = channel_biased((1, 2, 8, 32), (1, 2, 8, 32), seed=1)
    with pytest.raises(ValueError, match="sinks"):
        lowbit_attn.trainable_attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks .* got list"):  # as attention() names the type
        lowbit_attn.trainable_attention(q, k, v, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match="window\\[0\\]"):
        lowbit_attn.trainable_attention(q, k, v, window=(-3, 0))
    with pytest.raises(ValueError, match="softcap"):
        lowbit_attn.trainable_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="chunk"):
        lowbit_attn.trainable_attention(q, k, v, chunk=0)


@pytest.mark.interpreter
@needs_gluon("hopper")
def test_sm90_backward_is_not_used_for_a_variant(monkeypatch):
    """With ``kernel="sm90"`` a window/softcap backward runs on the Triton kernels (the sm90 loops
    do not take the variants), even where the sm90 backward would otherwise apply."""
    from lowbit_attn.core import triton_support
    from lowbit_attn.core.recipes import resolve_train
    from lowbit_attn.training import kernel_bwd, kernel_bwd_sm90, kernel_fwd
    from lowbit_attn.training.prepare import prepare, prepare_grad

    def boom(*args, **kwargs):
        raise AssertionError("the sm90 backward ran for a variant")

    monkeypatch.setattr(triton_support, "gluon_available", lambda *a: True)
    monkeypatch.setattr(kernel_bwd_sm90, "refusal", lambda *a: None)
    monkeypatch.setattr(kernel_bwd_sm90, "backward", boom)
    q, k, v = channel_biased((1, 1, 32, 32), (1, 1, 32, 32), seed=4, dtype=torch.float16)
    r = resolve_train("sagebwd_int8", smooth_k=False)
    ops = prepare(q, k, v, r, 32 ** -0.5, "triton")
    grad = prepare_grad(torch.ones_like(q), r, "triton")
    variant = Variant(left=4, right=0, softcap=3.0)
    lse = kernel_fwd.forward(ops, out=torch.empty_like(q), causal_offset=None, variant=variant)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    kernel_bwd.backward(ops, grad, lse, dq, dk, dv, causal_offset=None, softmax_scale=32 ** -0.5,
                        mode="recompute", kernel="sm90", variant=variant)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    with pytest.raises(AssertionError, match="sm90 backward ran"):  # plain attention takes it
        kernel_bwd.backward(ops, grad, lse, dq, dk, dv, causal_offset=None,
                            softmax_scale=32 ** -0.5, mode="recompute", kernel="sm90")

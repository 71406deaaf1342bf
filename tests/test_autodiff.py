"""What differentiates a call other than ``loss.backward()``: forward-mode AD, ``torch.func``'s
transforms and ``torch.autocast``, on every public entry point.

The custom ops define reverse-mode gradients only, and PyTorch passes a forward-mode tangent
through them without a word (``func.jvp`` gave zero tangents, ``forward_ad`` none, ``attention``
a wrong one), so the calls refuse them, and the SDPA drop-in and the transformers function hand
them to PyTorch. Under autocast the inputs are cast as PyTorch's SDPA casts them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lowbit_attn
from helpers import channel_biased
from lowbit_attn.core import plans
from lowbit_attn.integrations import sdpa


def _qkv(dtype=torch.float32, n=32, seed=0):
    return channel_biased((1, 2, n, 32), (1, 2, n, 32), seed=seed, dtype=dtype)


def _jvp_by_forward_ad(fn, x, tangent):
    with fwAD.dual_level():
        return fwAD.unpack_dual(fn(fwAD.make_dual(x, tangent))).tangent


@pytest.mark.parametrize("how", ["forward_ad", "func.jvp"])
def test_attention_refuses_forward_mode_tangents(how):
    q, k, v = _qkv()
    t = torch.randn_like(q)
    calls = {
        "attention": lambda x: lowbit_attn.attention(x, k, v),
        "attention_varlen": lambda x: lowbit_attn.attention_varlen(
            x[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            torch.tensor([0, 32], dtype=torch.int32), torch.tensor([0, 32], dtype=torch.int32),
            32, 32),
    }
    for name, fn in calls.items():
        with pytest.raises(ValueError, match="forward-only and cannot be differentiated by "
                                             "forward-mode AD"):
            if how == "forward_ad":
                _jvp_by_forward_ad(fn, q, t)
            else:
                torch.func.jvp(fn, (q,), (t,))


@pytest.mark.parametrize("how", ["forward_ad", "func.jvp", "func.grad", "func.vjp"])
def test_trainable_attention_refuses_what_is_not_reverse_mode(how):
    q, k, v = _qkv(torch.float64)

    def fn(x):
        return lowbit_attn.trainable_attention(x, k, v, recipe="exact")

    with pytest.raises(ValueError, match="gradients are reverse-mode only"):
        if how == "forward_ad":
            _jvp_by_forward_ad(fn, q, torch.randn_like(q))
        elif how == "func.jvp":
            torch.func.jvp(fn, (q,), (torch.randn_like(q),))
        elif how == "func.grad":
            torch.func.grad(lambda x: fn(x).sum())(q)
        else:
            torch.func.vjp(fn, q)


def test_vmap_alone_is_still_served():
    q, k, v = _qkv()
    qs = torch.stack([q, 2 * q])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's note on the op's batching rule
        got = torch.vmap(lambda x: lowbit_attn.attention(x, k, v))(qs)
    for i in range(2):
        torch.testing.assert_close(got[i], lowbit_attn.attention(qs[i], k, v))


def test_the_sdpa_drop_in_hands_torch_func_and_forward_ad_to_pytorch():
    """Patched with a train recipe, ``func.grad`` raised a PyTorch-internal error about
    ``setup_context`` and forward AD lost its tangent; both now get PyTorch's answer."""
    q, k, v = _qkv()
    t = torch.randn_like(q)

    def loss(x):
        return F.scaled_dot_product_attention(x, k, v).square().sum()

    with sdpa_kernel(SDPBackend.MATH):  # PyTorch's CPU flash kernel has no forward AD
        want_grad = torch.func.grad(loss)(q)
        want_tangent = _jvp_by_forward_ad(lambda x: F.scaled_dot_product_attention(x, k, v), q, t)
        sdpa.reset_fallback_warnings()
        with lowbit_attn.patch_sdpa(train_recipe="sagebwd_int8"), \
                pytest.warns(UserWarning, match="torch.func transform") as record:
            got_grad = torch.func.grad(loss)(q)
            got_tangent = _jvp_by_forward_ad(
                lambda x: F.scaled_dot_product_attention(x, k, v), q, t)
    assert any("forward-mode AD" in str(w.message) for w in record)
    torch.testing.assert_close(got_grad, want_grad)
    torch.testing.assert_close(got_tangent, want_tangent)


def test_no_plan_is_replayed_under_forward_ad():
    x = torch.randn(2, 2)
    assert plans.eager(x)
    with fwAD.dual_level():
        assert not plans.eager(x)


def test_autocast_casts_the_inputs_as_sdpa_does():
    """fp32 inputs under CPU autocast (bfloat16): PyTorch's SDPA returns bfloat16; ours gave
    float32, and the kernels' dtype error told the user to use the autocast they were in."""
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.scaled_dot_product_attention(q, k, v).dtype == torch.bfloat16
        got = {
            "attention": lowbit_attn.attention(q, k, v),
            "sdpa": lowbit_attn.scaled_dot_product_attention(q, k, v),
            "trainable": lowbit_attn.trainable_attention(q, k, v),
        }
        double = lowbit_attn.trainable_attention(*(x.double() for x in (q, k, v)))
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    want = {
        "attention": lowbit_attn.attention(q16, k16, v16),
        "sdpa": lowbit_attn.scaled_dot_product_attention(q16, k16, v16),
        "trainable": lowbit_attn.trainable_attention(q16, k16, v16),
    }
    for name in got:
        assert got[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert double.dtype == torch.float64  # float64 is not cast, as autocast leaves it


def test_autocast_gradients_reach_the_fp32_leaves():
    q, k, v = (x.requires_grad_() for x in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lowbit_attn.trainable_attention(q, k, v)
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in (q, k, v))


def _module(causal):
    module = torch.nn.Module()
    module.is_causal = causal
    return module


def test_transformers_key_padding_with_only_v_requiring_grad_falls_back():
    """LoRA on ``v_proj`` only, a padded batch: the key-padding path (forward-only) raised
    "must not require grad"; the call falls back and v gets SDPA's gradient."""
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lowbit_attn.integrations import transformers as lowbit_hf

    q, k, v = _qkv(n=16, seed=3)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    mask[..., 12:] = False
    v_ours, v_theirs = v.clone().requires_grad_(), v.clone().requires_grad_()
    want, _ = sdpa_attention_forward(_module(False), q, k, v_theirs, mask)
    sdpa.reset_fallback_warnings()
    with pytest.warns(UserWarning, match="while training"):
        got, _ = lowbit_hf.attention_function("exact")(_module(False), q, k, v_ours, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(v_ours.grad, v_theirs.grad, rtol=1e-5, atol=1e-5)


def test_transformers_sinks_that_learn_fall_back_with_their_gradient():
    """gpt-oss with frozen q, k, v and learnable sinks: raised "sinks must not require grad";
    the call falls back to the definition, and the sinks get its gradient."""
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    q, k, v = _qkv(n=6, seed=4)
    sinks = torch.randn(2, requires_grad=True)
    sdpa.reset_fallback_warnings()
    with pytest.warns(UserWarning, match="sinks while training"):
        got, _ = lowbit_hf.attention_function("exact")(_module(True), q, k, v, None,
                                                       sinks=sinks)
    s = (q @ k.transpose(-1, -2) * 32 ** -0.5).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    ref_sinks = sinks.detach().clone().requires_grad_()
    s = torch.cat([s, ref_sinks[None, :, None, None].expand(1, 2, 6, 1)], dim=-1)
    want = (s.softmax(-1)[..., :6] @ v).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(sinks.grad, ref_sinks.grad, rtol=1e-5, atol=1e-5)

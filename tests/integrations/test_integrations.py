"""Plug-and-play: patching F.scaled_dot_product_attention (exact restore, nesting, threads,
fallbacks, torch.compile), the transformers attention implementation and the diffusers hooks
(reference path on the CPU; tiny models built from configs, nothing downloaded)."""

from __future__ import annotations

import contextlib
import threading
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import lowbit_attn
from helpers import channel_biased
from lowbit_attn.integrations import sdpa


@pytest.fixture(autouse=True)
def _no_patch_left():
    original = F.scaled_dot_product_attention
    sdpa.reset_fallback_warnings()
    yield
    while lowbit_attn.unpatch_sdpa():
        pass
    assert F.scaled_dot_product_attention is original and not sdpa.sdpa_patched()


@contextlib.contextmanager
def _no_fallback():
    """Fail on a fallback warning of ours (the frameworks' own warnings are not ours to judge)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowbit_attn")
        yield


def _qkv(seed=0, n=48, d=32):
    return channel_biased((2, 4, n, d), (2, 4, n, d), seed=seed)


def _ours(q, k, v, recipe, **kw):
    return lowbit_attn.attention(q, k, v, recipe=recipe, **kw)


# --- patch_sdpa ------------------------------------------------------------------------------------


def test_patch_restores_the_original_function_object():
    original = F.scaled_dot_product_attention
    q, k, v = _qkv()
    with lowbit_attn.patch_sdpa("qk_int8_pv_fp16") as p:
        assert F.scaled_dot_product_attention is not original and "active=True" in repr(p)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           _ours(q, k, v, "qk_int8_pv_fp16", is_causal=True))
    assert F.scaled_dot_product_attention is original
    lowbit_attn.patch_sdpa()
    assert torch.nn.functional.scaled_dot_product_attention is not original
    assert lowbit_attn.unpatch_sdpa() and not lowbit_attn.unpatch_sdpa()
    assert F.scaled_dot_product_attention is original


def test_the_patched_function_has_pytorchs_signature():
    import inspect

    assert inspect.signature(sdpa._patched_sdpa) == inspect.signature(
        lowbit_attn.scaled_dot_product_attention)


def test_patches_nest_and_the_innermost_recipe_runs():
    q, k, v = _qkv(1)
    outer = lowbit_attn.patch_sdpa("qk_int8_pv_fp8")
    with lowbit_attn.patch_sdpa("qk_int8_pv_fp16"):
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), _ours(q, k, v, "qk_int8_pv_fp16"))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v), _ours(q, k, v, "qk_int8_pv_fp8"))
    inner = lowbit_attn.patch_sdpa("exact")
    assert lowbit_attn.unpatch_sdpa(outer)          # not the innermost: the inner one stays
    assert torch.equal(F.scaled_dot_product_attention(q, k, v), _ours(q, k, v, "exact"))
    assert lowbit_attn.unpatch_sdpa(inner) and not lowbit_attn.unpatch_sdpa(inner)


def test_calls_the_kernels_cannot_take_fall_back_with_one_warning():
    q, k, v = _qkv(2)
    mask = torch.rand(2, 1, 48, 48) > 0.3
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with lowbit_attn.patch_sdpa("qk_int8_pv_fp8"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for _ in range(3)]
        dropout = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert all(torch.equal(g, want) for g in got) and dropout.shape == q.shape
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "an attn_mask was given" in messages[0] and "dropout_p > 0" in messages[1]


def test_patch_rejects_an_unknown_recipe_up_front():
    with pytest.raises(ValueError, match="recipe"):
        lowbit_attn.patch_sdpa("int4")
    assert not sdpa.sdpa_patched()


def test_someone_elses_later_patch_is_left_in_place():
    original = F.scaled_dot_product_attention
    lowbit_attn.patch_sdpa()
    theirs = lambda *a, **kw: original(*a, **kw)  # noqa: E731
    F.scaled_dot_product_attention = theirs
    with pytest.warns(UserWarning, match="replaced by someone else"):
        lowbit_attn.unpatch_sdpa()
    assert F.scaled_dot_product_attention is theirs
    F.scaled_dot_product_attention = original


def test_concurrent_patching_from_threads_leaves_the_original():
    original = F.scaled_dot_product_attention
    q, k, v = _qkv(3, n=16, d=16)
    errors = []

    def worker(recipe):
        try:
            for _ in range(20):
                with lowbit_attn.patch_sdpa(recipe):
                    F.scaled_dot_product_attention(q, k, v)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in ("qk_int8_pv_fp16", "exact") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and F.scaled_dot_product_attention is original


def test_a_routed_scope_leaves_other_threads_alone():
    q, k, v = _qkv(4)
    exact = F.scaled_dot_product_attention(q, k, v)
    inside, done, seen = threading.Event(), threading.Event(), {}

    def other():
        inside.wait()
        seen["out"] = F.scaled_dot_product_attention(q, k, v)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with sdpa.routed("qk_int8_pv_fp16"):
        inside.set()
        done.wait(30)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), _ours(q, k, v, "qk_int8_pv_fp16"))
    t.join()
    assert torch.equal(seen["out"], exact)


def test_patched_sdpa_compiles_fullgraph():
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sin()

    q, k, v = _qkv(5)
    with torch.no_grad(), lowbit_attn.patch_sdpa("qk_int8_pv_fp8"):
        eager = Block()(q, k, v)
        compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(eager, compiled)


# --- transformers ----------------------------------------------------------------------------------


def _tiny_llama(transformers):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_transformers_attention_implementation_runs_the_recipe():
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    assert lowbit_hf.register() == "lowbit"
    lowbit_hf.register("lowbit_exact", recipe="exact")
    model = _tiny_llama(transformers)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), _no_fallback():  # causal, no mask → the kernels' path
        model.set_attn_implementation("sdpa")
        want = model(ids).logits
        model.set_attn_implementation("lowbit_exact")
        exact = model(ids).logits
        model.set_attn_implementation("lowbit")
        got = model(ids).logits
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, want)
    assert lowbit_attn.errors(got, want).cosine > 0.9999


def test_transformers_left_padded_causal_mask_runs_as_packed_sequences():
    """A decoder's mask for a left-padded batch (causal with padding) reaches the kernels as
    packed sequences, no fallback: the real positions equal SDPA's with the exact recipe; a
    right-padded one (not bottom-right) still falls back to the exact result, with one
    warning."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register()
    lowbit_hf.register("lowbit_exact", recipe="exact")
    model = _tiny_llama(transformers)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    real = mask.bool()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask).logits
        with _no_fallback():
            model.set_attn_implementation("lowbit_exact")
            exact = model(ids, attention_mask=mask).logits
            model.set_attn_implementation("lowbit")
            got = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(exact[real], want[real], rtol=1e-5, atol=1e-5)
        assert lowbit_attn.errors(got[real], want[real]).cosine > 0.9999
        right = mask.flip(1)
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=right).logits
        model.set_attn_implementation("lowbit")
        with pytest.warns(UserWarning, match="a right-padded batch") as caught:
            got = model(ids, attention_mask=right).logits
    assert torch.equal(got, want) and len(caught) == 1


def _tiny_bert(transformers):
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


def test_transformers_encoder_without_padding_reaches_the_kernels():
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register("lowbit_fp8", recipe="qk_int8_pv_fp8")
    model = _tiny_bert(transformers)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), _no_fallback():
        model.set_attn_implementation("sdpa")
        want = model(ids).last_hidden_state
        model.set_attn_implementation("lowbit_fp8")
        got = model(ids).last_hidden_state
    assert not torch.equal(got, want) and lowbit_attn.errors(got, want).cosine > 0.999


@contextlib.contextmanager
def _registered_as_sdpa(transformers):
    """``register("sdpa")`` for the block; transformers' own "sdpa" put back after it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lowbit_attn.integrations import transformers as lowbit_hf

    saved = ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    try:
        yield lowbit_hf.register("sdpa", recipe="exact")
    finally:
        transformers.AttentionInterface.register("sdpa", saved[0])
        transformers.AttentionMaskInterface.register("sdpa", saved[1])


def test_transformers_a_masked_call_that_needs_gradients_says_so():
    """A left-padded batch while training falls back (the masked paths are forward-only), and
    the warning says that, not that the mask is of another pattern (it is causal with left
    padding); the logits are transformers' SDPA's."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import sdpa
    from lowbit_attn.integrations import transformers as lowbit_hf

    model = _tiny_llama(transformers)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    model.set_attn_implementation("sdpa")
    want = model(ids, attention_mask=mask).logits
    lowbit_hf.register("lowbit_exact", recipe="exact")
    model.set_attn_implementation("lowbit_exact")
    sdpa.reset_fallback_warnings()
    with pytest.warns(UserWarning, match="a mask while training or with dropout"):
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)


def test_transformers_registered_as_sdpa_falls_back_to_transformers_sdpa():
    """A user who registers ours under the name "sdpa": the fallbacks reach transformers' own
    functions, not the registered name (which is ours, so they would recurse): the attention
    weights asked for come from the model's eager attention, as eager's."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = _tiny_llama(transformers)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids, output_attentions=True)
        model.set_attn_implementation("sdpa")
        with _registered_as_sdpa(transformers):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
            with pytest.warns(UserWarning, match="the model passes output_attentions"):
                got = model(ids, output_attentions=True)
            q = torch.randn(2, 4, 8, 16)
            module = model.model.layers[0].self_attn
            # a softcap, which transformers' SDPA would refuse and Llama's eager would drop:
            # the kernels' (or, without them, the definition's)
            capped, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, q[:, :2], q[:, :2], None,
                                                        softcap=3.0)
            k = q[:, :2].repeat_interleave(2, dim=1)
            s = 3.0 * torch.tanh(q @ k.transpose(-1, -2) / 4.0 / 3.0)
            s = s.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
            torch.testing.assert_close(capped, (s.softmax(-1) @ k).transpose(1, 2))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_queries", [1, 12], ids=["mask-1-query", "mask-all-queries"])
def test_transformers_key_padding_mask_of_batch_one_broadcasts(mask_queries):
    """A key-padding mask ``[1, 1, Q or 1, K]`` over a batch of 2, as "sdpa" takes it."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lowbit_attn.integrations import transformers as lowbit_hf

    module = _tiny_bert(transformers).encoder.layer[0].attention.self
    q, k, v = channel_biased((2, 2, 12, 32), (2, 2, 12, 32), seed=7)
    mask = torch.ones(1, 1, mask_queries, 12, dtype=torch.bool)
    mask[..., 9:] = False
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    with torch.no_grad(), _no_fallback():
        exact, _ = lowbit_hf.attention_function("exact")(module, q, k, v, mask)
        got, _ = lowbit_hf.attention_function("qk_int8_pv_fp16")(module, q, k, v, mask)
    assert got.shape == exact.shape == want.shape
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    assert lowbit_attn.errors(got, want).cosine > 0.999


def test_transformers_mask_of_the_wrong_query_length_raises_as_sdpa_does():
    """A padding-like mask ``[B, 1, 5, K]`` for 12 queries: "sdpa" raises (it does not
    broadcast), so must we, rather than read the mask's first row as every query's keys."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lowbit_attn.integrations import transformers as lowbit_hf

    module = _tiny_bert(transformers).encoder.layer[0].attention.self
    q, k, v = channel_biased((2, 2, 12, 32), (2, 2, 12, 32), seed=8)
    mask = torch.ones(2, 1, 5, 12, dtype=torch.bool)
    mask[..., 9:] = False
    with pytest.raises(RuntimeError, match="must match the size") as theirs:
        sdpa_attention_forward(module, q, k, v, mask)
    with torch.no_grad(), pytest.raises(RuntimeError) as ours, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowbit_hf.attention_function("qk_int8_pv_fp16")(module, q, k, v, mask)
    assert str(ours.value) == str(theirs.value)


def test_transformers_register_checks_its_arguments():
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    with pytest.raises(TypeError, match="name"):
        lowbit_hf.register("")
    with pytest.raises(ValueError, match="recipe"):
        lowbit_hf.register("x", recipe="int4")


# --- diffusers -------------------------------------------------------------------------------------


def _tiny_dit(diffusers):
    torch.manual_seed(0)
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=32, in_channels=4, num_layers=2, sample_size=16,
        patch_size=2, num_embeds_ada_norm=10).eval()


def test_diffusers_enable_routes_the_denoiser_and_disable_restores():
    diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
    from lowbit_attn.integrations import diffusers as lowbit_diffusers

    model = _tiny_dit(diffusers)
    pipe = types.SimpleNamespace(components={"transformer": model, "scheduler": object()})
    args = dict(hidden_states=torch.randn(2, 4, 16, 16), timestep=torch.tensor([1, 5]),
                class_labels=torch.tensor([0, 3]))
    original = F.scaled_dot_product_attention
    with torch.no_grad():
        want = model(**args).sample
        assert lowbit_diffusers.enable(pipe, recipe="qk_int8_pv_fp16") == ["transformer"]
        got = model(**args).sample
        assert F.scaled_dot_product_attention is original  # routed only during the forward
        assert lowbit_diffusers.disable(pipe) == ["transformer"] and lowbit_diffusers.disable(pipe) == []
        back = model(**args).sample
    assert not torch.equal(got, want) and lowbit_attn.errors(got, want).cosine > 0.9999
    assert torch.equal(back, want)


def test_diffusers_enable_checks_its_target():
    diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
    from lowbit_attn.integrations import diffusers as lowbit_diffusers

    model = _tiny_dit(diffusers)
    with pytest.raises(TypeError, match="pipeline or a torch.nn.Module"):
        lowbit_diffusers.enable(object())
    with pytest.raises(ValueError, match="components must name"):
        lowbit_diffusers.enable(types.SimpleNamespace(components={"vae": model}))
    with pytest.raises(ValueError, match="components must name"):
        lowbit_diffusers.enable(types.SimpleNamespace(components={"vae": model}), components=["unet"])
    assert lowbit_diffusers.enable(types.SimpleNamespace(components={"vae": model}),
                                   components=["vae"]) == ["vae"]
    assert lowbit_diffusers.enable(types.SimpleNamespace(components={"vae": model}),
                                   components="vae") == ["vae"]  # one name, not its letters
    lowbit_diffusers.disable(model)


def test_diffusers_enable_routes_each_thread_on_its_own():
    """One hooked model run by two threads at once, the first to start ending first: each thread
    leaves its own routed scope (they shared one list, and the first thread left the second's:
    a ValueError from the context variable in both, and the count of routed scopes stuck above
    0 with SDPA patched for good)."""
    from lowbit_attn.integrations import diffusers as lowbit_diffusers
    from lowbit_attn.integrations import sdpa

    inside = {name: threading.Event() for name in ("one", "two")}
    one_done = threading.Event()

    class Attention(torch.nn.Module):
        def forward(self, q, name):
            inside[name].set()
            if name == "one":
                inside["two"].wait(10)  # both inside; one leaves first
            else:
                one_done.wait(10)
            return F.scaled_dot_product_attention(q, q, q)

    model, q, errors = Attention(), torch.randn(1, 2, 16, 16), []
    original = F.scaled_dot_product_attention
    lowbit_diffusers.enable(model, "exact")

    def run(name):
        try:
            model(q, name)
        except Exception as e:  # noqa: BLE001 — what the test looks for
            errors.append(e)
        finally:
            if name == "one":
                one_done.set()

    threads = {name: threading.Thread(target=run, args=(name,)) for name in ("one", "two")}
    threads["one"].start()
    inside["one"].wait(10)
    threads["two"].start()
    for t in threads.values():
        t.join(10)
    lowbit_diffusers.disable(model)
    assert errors == [] and sdpa._routed_users == 0
    assert F.scaled_dot_product_attention is original


def test_the_core_package_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, lowbit_attn; import lowbit_attn.integrations; "
            "print(sorted(m for m in ('transformers', 'diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_patch_trains_with_the_trainable_attention_when_asked():
    q, k, v = (x.requires_grad_() for x in _qkv(6))
    do = torch.randn(q.shape)
    with lowbit_attn.patch_sdpa("qk_int8_pv_fp16", train_recipe="sagebwd_int8"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    want = lowbit_attn.trainable_attention(q, k, v, is_causal=True)
    assert torch.equal(out, want)
    for g, w in zip(grads, torch.autograd.grad(want, (q, k, v), do)):
        assert torch.equal(g, w)
    with lowbit_attn.patch_sdpa("qk_int8_pv_fp16"), pytest.warns(UserWarning, match="train_recipe"):
        exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(exact, sdpa.TORCH_SDPA(q, k, v, is_causal=True))
    with pytest.raises(ValueError, match="trainable recipe"):
        lowbit_attn.patch_sdpa(train_recipe="qk_int8_pv_fp8")


def test_diffusers_video_transformer_reaches_the_kernels():
    """A video DiT (Wan) whose attention goes through diffusers' attention dispatcher (native
    backend): every call routed, none falls back."""
    diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
    from lowbit_attn.integrations import diffusers as lowbit_diffusers

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    args = dict(hidden_states=torch.randn(1, 4, 4, 16, 16), timestep=torch.tensor([10]),
                encoder_hidden_states=torch.randn(1, 8, 16))
    with torch.no_grad():
        want = model(**args).sample
        lowbit_diffusers.enable(model, recipe="qk_int8_pv_fp8")
        with _no_fallback():
            got = model(**args).sample
        lowbit_diffusers.disable(model)
    assert not torch.equal(got, want) and lowbit_attn.errors(got, want).cosine > 0.9999


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_transformers_model_compiles_fullgraph_with_the_lowbit_implementation():
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register()
    torch._dynamo.reset()
    model = _tiny_llama(transformers)
    model.set_attn_implementation("lowbit")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(eager, compiled)


def test_transformers_encoder_padded_batch_runs_as_packed_sequences():
    """A key-padding mask (every query of a row sees the same keys) reaches the kernels through
    attention_varlen: exact recipe = PyTorch's masked SDPA to rounding, padded query rows too."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register("lowbit_exact", recipe="exact")
    lowbit_hf.register("lowbit_fp8", recipe="qk_int8_pv_fp8")
    model = _tiny_bert(transformers)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 13:] = 0
    mask[2, 4:] = 0
    with torch.no_grad(), _no_fallback():
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("lowbit_exact")
        exact = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("lowbit_fp8")
        got = model(ids, attention_mask=mask).last_hidden_state
        alone = model(ids[2:, :4]).last_hidden_state      # row 2 without its padding
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, want) and lowbit_attn.errors(got, want).cosine > 0.999
    # quantization statistics are per row (the padded queries of row 2 take part in its Q/K
    # balancing, so not bit for bit): row 2 in the batch ≈ row 2 alone
    assert lowbit_attn.errors(got[2:, :4], alone).cosine > 0.9999


def test_transformers_generate_with_a_kv_cache_reaches_the_kernels():
    """Prefill (causal, no mask) and one-token decode steps against the cache (no mask, one
    query): no call falls back, greedy tokens match exact attention's on this tiny model."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
    from lowbit_attn.integrations import transformers as lowbit_hf

    lowbit_hf.register("lowbit_exact", recipe="exact")
    model = _tiny_llama(transformers)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    tokens = {}
    with _no_fallback():
        for impl in ("sdpa", "lowbit_exact"):
            model.set_attn_implementation(impl)
            tokens[impl] = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens["sdpa"], tokens["lowbit_exact"])

"""Sliding-window, chunked, softcapped and sink attention of transformers models through lowbit_attn:
``QuantizedCache`` generation and the registered attention function, on tiny random-init models
built from configs (Gemma 2/3, gpt-oss, Mistral, Llama 4; 2 layers, hidden 64, window or chunk of
8 tokens against prompts of 20), fp32, nothing downloaded.

The reference is transformers' eager attention run on the same tokens (teacher forcing): a random
tiny model's logits are flat (top-2 gaps down to 1e-4), so greedy tokens of two correct
implementations can part at a near tie and the logits are what is bounded."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

from lowbit_attn.integrations import transformers as lowbit_hf  # noqa: E402
from lowbit_attn.integrations import transformers_cache  # noqa: E402

WINDOW = 8
PROMPT = 20
NEW = 16
KINDS = ["gemma3", "gemma2", "gpt_oss", "mistral", "llama4"]


def build(kind: str, layers: int = 2):
    """A random-init model of ``kind``: layers alternate sliding (or chunked) and full; Gemma 2
    with a softcap of 2 on the logits (its default 50 would not show); gpt-oss with sinks drawn
    from N(0, 1) (its init leaves them at 0) and both its experts active (a router flip would be
    a discontinuity, not an attention error)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    alternate = ["sliding_attention", "full_attention"] * (layers // 2)
    if kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=WINDOW, layer_types=alternate)
        cls = transformers.Gemma3ForCausalLM
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, sliding_window=WINDOW, layer_types=alternate,
                                        attn_logit_softcapping=2.0, query_pre_attn_scalar=16)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, sliding_window=WINDOW, layer_types=alternate,
                                        num_local_experts=2, num_experts_per_tok=2)
        cls = transformers.GptOssForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=WINDOW)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Llama4TextConfig(**common, attention_chunk_size=WINDOW,
                                            intermediate_size_mlp=128, num_local_experts=1,
                                            num_experts_per_tok=1, interleave_moe_layer_step=2,
                                            no_rope_layers=[1, 0] * (layers // 2))
        cls = transformers.Llama4ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    lowbit_hf.register()
    return build(request.param)


def prompts(pad: int = 5):
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    ids[1, :pad] = 0  # 0: the pad token
    return ids, (ids != 0).long()


def eager_logits(model, sequences, mask):
    """Eager attention's logits for every position of ``sequences`` (one forward, no cache)."""
    model.set_attn_implementation("eager")
    full = torch.cat([mask, torch.ones(mask.shape[0], sequences.shape[1] - mask.shape[1],
                                       dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        return model(sequences, attention_mask=full).logits


def test_the_cache_reads_each_layers_kind_from_the_config(model):
    cache = lowbit_hf.QuantizedCache(model.config, batch=1, max_tokens=64, dtype=torch.float32)
    kind = model.config.model_type
    windows = [layer.window for layer in cache.store.layers]
    chunks = [layer.chunk for layer in cache.store.layers]
    if kind == "mistral":
        assert windows == [WINDOW - 1] * 2 and chunks == [None] * 2
    elif kind == "llama4_text":
        assert windows == [None] * 2 and chunks == [WINDOW, None]
    else:  # transformers' sliding_window counts the query's own key: W - 1 back
        assert windows == [WINDOW - 1, None] and chunks == [None] * 2
    assert cache.is_sliding == [layer.local for layer in cache.store.layers]


def test_generation_with_the_quantized_cache_matches_eager_attention(model):
    """A left-padded batch, prefill in slices of 8 (max_append), 16 greedy steps: every step's
    logits against eager attention on the same tokens; a local layer ends holding its window and
    one page. Measured 2026-11-28 (kv_int8_fp8, page 4): max |Δlogit| gemma3 0.019, gemma2 0.017,
    gpt_oss 0.011, mistral 0.0087, llama4 0.0081; greedy tokens equal to eager's generation for
    all 16 steps of both rows except Mistral's row 1, which parts at step 1 on a top-2 gap of
    6e-5 (and so does gpt-oss's where both experts' router ties: see ``build``)."""
    ids, mask = prompts()
    cache = lowbit_hf.QuantizedCache(model.config, batch=2, max_tokens=64, dtype=torch.float32,
                                     page_size=4, max_append=8)
    model.set_attn_implementation("lowbit")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowbit_attn")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, cache=cache, output_logits=True,
                             return_dict_in_generate=True)
    got = torch.stack(out.logits, dim=1)
    want = eager_logits(model, out.sequences, mask)[:, PROMPT - 1 : PROMPT - 1 + NEW]
    assert (got - want).abs().max() < 0.04
    for i, layer in enumerate(cache.store.layers):
        if layer.local:
            assert max(cache.store.held_pages(i)) <= -(-WINDOW // 4) + 1


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt_oss", "gemma2"])
def test_the_decode_kernel_serves_local_layers_as_its_twin(kind, monkeypatch):
    """The same generation on the split-KV Triton kernel (the interpreter) and its twin: the
    windows, sinks and softcap agree to the rounding of P̃ (the kernel against each split's
    running maximum, the twin against the row's: tests/kvcache/test_decode_kernel.py; with
    4-token pages, E4M3 P̃). Measured 2026-11-28: gpt-oss max |Δlogit| 0.0077, same tokens."""
    lowbit_hf.register()
    model = build(kind)
    ids, mask = prompts()
    got = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        cache = lowbit_hf.QuantizedCache(model.config, batch=2, max_tokens=64,
                                         dtype=torch.float32, page_size=4, max_append=8)
        model.set_attn_implementation("lowbit")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             pad_token_id=0, cache=cache, output_logits=True,
                             return_dict_in_generate=True)
        got[backend] = out.sequences, torch.stack(out.logits, dim=1)
    assert torch.equal(got["triton"][0], got["reference"][0])
    assert (got["triton"][1] - got["reference"][1]).abs().max() < 0.02


def test_the_layers_pattern_is_the_masks():
    """``local_visible`` (what the cache checks a mask against, and the kernels compute) is
    transformers' own sliding-window and chunked mask functions, on a left-padded batch."""
    from transformers import masking_utils

    n, pad = 30, torch.tensor([0, 3])
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    sliding = masking_utils.sliding_window_causal_mask_function(WINDOW)
    for b in range(2):
        pos = torch.arange(n) - pad[b]
        want = sliding(b, 0, q, k) & (k >= pad[b])
        got = (pos >= 0)[None, :] & transformers_cache.local_visible(pos, pos, WINDOW - 1, None)
        assert torch.equal(got[pad[b]:], want[pad[b]:])
        chunked = masking_utils.chunked_causal_mask_function(WINDOW, pad)
        want = chunked(b, 0, q, k) & (k >= pad[b])
        got = (pos >= 0)[None, :] & transformers_cache.local_visible(pos, pos, None, WINDOW)
        assert torch.equal(got[pad[b]:], want[pad[b]:])


# --- the registered attention function (no QuantizedCache) ------------------------------------


@pytest.mark.parametrize("kernels", [False, True], ids=["fallback", "kernels"])
def test_the_attention_function_matches_eager_attention(model, kernels, monkeypatch):
    """A left-padded prompt longer than the window through ``attn_implementation`` with the
    exact recipe: the real positions' logits are eager attention's. With the kernels' local
    options every call runs on lowbit_attn (no fallback); without them the windows, softcap and
    sinks fall back to the model's own exact definition (gpt-oss's sinks are not dropped, Gemma
    2's softcap does not raise)."""
    if kernels and not lowbit_hf.LOCAL_KERNELS:
        pytest.skip("the prefill kernels do not take window/chunk/softcap/sinks in this build")
    monkeypatch.setattr(lowbit_hf, "LOCAL_KERNELS", kernels)
    from lowbit_attn.integrations import sdpa

    lowbit_hf.register("lowbit_exact", recipe="exact")
    ids, mask = prompts()
    want = eager_logits(model, ids, mask)
    model.set_attn_implementation("lowbit_exact")
    sdpa.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = model(ids, attention_mask=mask).logits
    ours = [str(w.message) for w in caught if "lowbit_attn" in str(w.message)]
    assert (ours == []) if kernels else ours, ours
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_generate_through_the_attention_function_is_eagers(model):
    """``generate`` with transformers' own cache and the exact recipe: 16 greedy tokens equal to
    eager attention's, every call on lowbit_attn."""
    if not lowbit_hf.LOCAL_KERNELS:
        pytest.skip("the prefill kernels do not take window/chunk/softcap/sinks in this build")
    lowbit_hf.register("lowbit_exact", recipe="exact")
    ids, mask = prompts()
    tokens = {}
    for impl in ("eager", "lowbit_exact"):
        model.set_attn_implementation(impl)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="lowbit_attn")
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                          do_sample=False, pad_token_id=0)
    assert torch.equal(tokens["eager"], tokens["lowbit_exact"])


def test_a_static_cache_prefill_is_eagers(model):
    """A prefill into transformers' empty ``StaticCache``: unpadded, transformers leaves the mask
    out and relies on SDPA's causal mask aligned top-left, since the keys past the prompt are the
    cache's empty slots; left-padded, its mask's last keys are those slots. Both run on
    lowbit_attn, with eager attention's logits (a layer with a softcap or sinks attended to the
    empty slots before, Gemma 2's logits 0.25 off; the padded batch fell back)."""
    if not lowbit_hf.LOCAL_KERNELS:
        pytest.skip("the prefill kernels do not take window/chunk/softcap/sinks in this build")
    from lowbit_attn.integrations import sdpa

    lowbit_hf.register("lowbit_exact", recipe="exact")
    ids, mask = prompts()
    forward = model.forward.__wrapped__ if hasattr(model.forward, "__wrapped__") else model.forward
    key = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    for rows in (slice(0, 1), slice(0, 2)):  # unpadded; a left-padded batch
        logits = {}
        for impl in ("eager", "lowbit_exact"):
            model.set_attn_implementation(impl)
            cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + 12)
            sdpa.reset_fallback_warnings()
            with warnings.catch_warnings(), torch.no_grad():
                warnings.filterwarnings("error", message="lowbit_attn")
                logits[impl] = model(ids[rows], attention_mask=mask[rows], **{key: cache}).logits
        real = mask[rows].bool()
        torch.testing.assert_close(logits["lowbit_exact"][real], logits["eager"][real],
                                   rtol=1e-5, atol=1e-5)


def test_a_fallback_never_drops_a_softcap_or_sinks():
    """A module whose eager attention has no softcap (Llama) or other sinks than the call's: the
    fallback computes the definition rather than drop them."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    module = transformers.LlamaForCausalLM(cfg).model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 16, generator=g), *torch.randn(2, 1, 2, 6, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    got, _ = lowbit_hf.exact_fallback(module, q, k, v, None, 0.0, 0.25, None, 3.0, sinks, {})
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = 3.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / 3.0)
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    s = torch.cat([s, sinks[None, :, None, None].expand(1, 4, 6, 1)], dim=-1)
    want = (s.softmax(-1)[..., :6] @ vv).transpose(1, 2)
    torch.testing.assert_close(got, want)


def test_a_fallback_keeps_a_position_bias_beside_a_softcap_or_sinks():
    """A call with T5's ``position_bias`` falls back; with a softcap, or per-row sinks
    (``[B, H, Q, 1]``), it runs attention by its definition, which adds the bias (it was
    dropped: the same output as without it). Per-row sinks alone fall back too (the kernels
    take one per head: they raised)."""
    fn = lowbit_hf.attention_function("exact")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    bias = 3 * torch.randn(1, 2, 6, 6, generator=g)
    sinks = torch.randn(1, 2, 6, 1, generator=g)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for options in (dict(softcap=50.0), dict(sinks=sinks), dict(sinks=sinks, no_bias=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            no_bias = options.pop("no_bias", False)  # per-row sinks alone fall back too
            got, _ = fn(module, q, k, v, None, position_bias=None if no_bias else bias, **options)
        s = q @ k.transpose(-1, -2) * 0.25
        if "softcap" in options:
            s = 50.0 * torch.tanh(s / 50.0)
        s = (s if no_bias else s + bias).masked_fill(~causal, float("-inf"))
        if "sinks" in options:
            s = torch.cat([s, sinks], dim=-1)
        want = (s.softmax(-1)[..., :6] @ v).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_fp4_recipe_with_a_head_dim_it_cannot_group_falls_back_on_every_path():
    """An FP4 recipe at head dim 16 (NVFP4 groups 32 channels): a left-padded Gemma 2 batch (the
    packed path, with a softcap and a window) falls back with the recipe's reason, as an
    unpadded call did, rather than raising in the middle of the model."""
    from lowbit_attn.integrations import sdpa

    model = build("gemma2")
    lowbit_hf.register("lowbit_fp4", recipe="qk_fp4_pv_fp4")
    ids, mask = prompts()
    want = eager_logits(model, ids, mask)
    model.set_attn_implementation("lowbit_fp4")
    sdpa.reset_fallback_warnings()
    with pytest.warns(UserWarning, match="needs a head dim that is a multiple of 32"), \
            torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)

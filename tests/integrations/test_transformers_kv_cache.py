"""``QuantizedCache``: generation with transformers whose K and V live in the 8-bit paged
``QuantizedKVCache`` and are read by ``attention_with_kv_cache`` (the reference twin on the CPU).
A tiny random Llama built from a config, fp32, seeded; nothing downloaded.

The bounds below are measured on this model (recorded where each is asserted); a random tiny model
has flat logits (|logit| ≲ 0.6), so the logits are compared as well as the tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

from lowbit_attn.integrations import transformers as lowbit_hf  # noqa: E402
from lowbit_attn.integrations import transformers_cache  # noqa: E402

NEW = 16


@pytest.fixture(scope="module")
def model():
    lowbit_hf.register()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompt(n, seed):
    # tokens from 1 on: 0 is the pad token, which generate would read as padding
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _cache(model, batch, max_tokens=64):
    return lowbit_hf.QuantizedCache(model.config, batch=batch, max_tokens=max_tokens,
                                    dtype=torch.float32)


def _generate(model, impl, ids, mask=None, cache=None, sample=False):
    """``generate`` with ``impl``; our own warnings are errors (the cache path never falls back)."""
    model.set_attn_implementation(impl)
    mask = torch.ones_like(ids) if mask is None else mask
    options = dict(do_sample=True, top_k=0) if sample else dict(do_sample=False)
    if sample:
        torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowbit_attn")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, cache=cache,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **options)
    return out.sequences, torch.stack(out.logits, dim=1)   # logits [B, NEW, vocab]


def _kl(want, got):
    """KL(want ‖ got) per row and step, of the next-token distributions."""
    return torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generation_matches_exact_attention_with_the_dynamic_cache(model, sample):
    ids = _prompt(20, 3)
    want_tokens, want = _generate(model, "sdpa", ids, sample=sample)
    tokens, got = _generate(model, "lowbit", ids, cache=_cache(model, 1), sample=sample)
    # measured: 16 of 16 tokens agree greedy and sampled (same seed); max |Δlogit| 0.0052
    # against |logit| ≤ 0.62, KL ≤ 1.6e-6 (greedy)
    assert torch.equal(tokens, want_tokens)
    assert (got - want).abs().max() < 0.02
    assert _kl(want, got).max() < 1e-4


def test_left_padded_batch_rows_equal_each_prompt_alone(model):
    a, b = _prompt(20, 5), _prompt(13, 6)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 7, dtype=torch.long), b], dim=1)])
    tokens, logits = _generate(model, "lowbit", ids, mask=(ids != 0).long(), cache=_cache(model, 2))
    for row, prompt, pad in ((0, a, 0), (1, b, 7)):
        alone_tokens, alone = _generate(model, "lowbit", prompt, cache=_cache(model, 1))
        assert torch.equal(tokens[row, pad:], alone_tokens[0])
        # not bit for bit: the linear layers round differently for a batch of 2 and of 1 on the
        # CPU (transformers' sdpa with a DynamicCache differs by 1.5e-7 the same way); measured
        # 1.5e-7 here too
        assert (logits[row] - alone[0]).abs().max() < 1e-5


def test_the_quantized_cache_holds_the_tokens_and_serves_every_step(model, monkeypatch):
    calls = []
    real = transformers_cache.attention_with_kv_cache

    def spy(q, cache, layer, **kw):
        calls.append((layer, q.shape[2]))
        return real(q, cache, layer, **kw)

    monkeypatch.setattr(transformers_cache, "attention_with_kv_cache", spy)
    a, b = _prompt(20, 5), _prompt(13, 6)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 7, dtype=torch.long), b], dim=1)])
    cache = _cache(model, 2, max_tokens=4096)
    tokens, _ = _generate(model, "lowbit", ids, mask=(ids != 0).long(), cache=cache)
    assert tokens.shape == (2, 20 + NEW) and cache.batch_size == 2
    # the last token generated is never fed back: prompt (padding not stored) + NEW - 1 tokens
    for layer in range(2):
        assert cache.store.length(layer).tolist() == [20 + NEW - 1, 13 + NEW - 1]
    assert cache.get_seq_length() == 20 + NEW - 1           # positions, padding included
    # one call per layer per forward: the prefill (20 queries), then NEW - 1 decode steps
    assert calls == [(layer, n) for n in [20] + [1] * (NEW - 1) for layer in range(2)]
    # against an fp16 cache of the same capacity (K and V, 2 bytes each): measured 0.547; K and V
    # in one byte each plus K's fp32 scale per token and head make 0.516, the rest is each
    # sequence's open page of V (fp32 here) and the per-page V scales
    fp16 = 2 * 2 * 2 * 2 * 4096 * 64 * 2  # layers · (K, V) · batch · kv_heads · tokens · D · 2B
    assert cache.store.nbytes() < 0.56 * fp16


def test_reset_empties_the_cache_for_the_next_generation(model):
    ids = _prompt(9, 4)
    cache = _cache(model, 1)
    first, _ = _generate(model, "lowbit", ids, cache=cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.store.length(0).tolist() == [0]
    again, _ = _generate(model, "lowbit", ids, cache=cache)
    assert torch.equal(first, again)


@pytest.mark.parametrize("config, windows", [
    pytest.param(dict(cls="Qwen2Config", use_sliding_window=True, sliding_window=32,
                      max_window_layers=1), [None, 31], id="layer-types"),
    pytest.param(dict(cls="MistralConfig", sliding_window=32), [31, 31], id="window"),
    pytest.param(dict(cls="MistralConfig", sliding_window=None), [None, None], id="no-window"),
])
def test_sliding_window_configs_give_sliding_layers(config, windows):
    config = dict(config)
    cfg = getattr(transformers, config.pop("cls"))(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **config)
    cache = lowbit_hf.QuantizedCache(cfg, batch=1, max_tokens=64, dtype=torch.float32)
    assert [layer.window for layer in cache.store.layers] == windows


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_marker_reaching_another_attention_implementation_raises(model, impl):
    with pytest.raises(RuntimeError, match="attention implementation other than lowbit_attn's"):
        _generate(model, impl, _prompt(9, 1), cache=_cache(model, 1))


def test_calls_the_cache_cannot_serve_raise(model):
    ids = torch.cat([torch.cat([_prompt(6, 2), torch.zeros(1, 3, dtype=torch.long)], dim=1),
                     _prompt(9, 3)])
    with pytest.raises(ValueError, match="pad on the left"):
        _generate(model, "lowbit", ids, mask=(ids != 0).long(), cache=_cache(model, 2))
    model.set_attn_implementation("lowbit")
    with pytest.raises(ValueError, match="output_attentions"), torch.no_grad():
        model(_prompt(9, 1), cache=_cache(model, 1), output_attentions=True)
    with pytest.raises(TypeError, match="dtype=model.dtype"), torch.no_grad():
        model(_prompt(9, 1), cache=lowbit_hf.QuantizedCache(model.config, batch=1, max_tokens=64))
    with pytest.raises(ValueError, match="batch=1"), torch.no_grad():
        model(torch.cat([_prompt(9, 1)] * 2), cache=_cache(model, 1))


def test_a_refused_beam_search_leaves_a_cache_that_says_to_reset(model):
    """transformers reorders the cache only after the prefill has stored the prompt: a greedy
    retry on that cache appended the prompt again and gave other tokens, with no word. It
    raises until ``reset()``, and then generates as a fresh cache."""
    ids = _prompt(9, 5)
    model.set_attn_implementation("lowbit")
    cache = _cache(model, 3)
    with pytest.raises(NotImplementedError, match="beam search is not served.*cache.reset()"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, num_beams=3,
                       cache=cache, pad_token_id=0, do_sample=False)
    rows = ids.repeat(3, 1)  # the batch the cache was built for
    with pytest.raises(RuntimeError, match=r"refused \(beam search\); call cache.reset\(\)"):
        _generate(model, "lowbit", rows, cache=cache)
    cache.reset()
    got, _ = _generate(model, "lowbit", rows, cache=cache)
    want, _ = _generate(model, "lowbit", rows, cache=_cache(model, 3))
    assert torch.equal(got, want)


def test_a_step_refused_before_it_stored_anything_leaves_the_cache_as_it_was(model):
    """A step whose append is refused (past ``max_tokens``) left its layer's position count
    and pending keys behind: the cache said one more token than it held, and the next call
    blamed the attention implementation. Now the layer is as before the step."""
    ids = _prompt(12, 6)
    model.set_attn_implementation("lowbit")
    cache = _cache(model, 1, max_tokens=16)
    with pytest.raises(ValueError, match="max_tokens=16"):
        _generate(model, "lowbit", ids, cache=cache)
    assert cache.get_seq_length() == 16 == cache.store.length(0).item()
    assert all(layer.pending is None for layer in cache.layers)


def test_a_step_refused_by_a_later_layer_keeps_saying_to_reset():
    """Layer 1 refuses a step layer 0 has stored (a window it was not built with): layer 1 is not
    rolled back, since the layers would then hold different histories with no word; the next
    step raises until ``reset()``."""
    import types

    cache = lowbit_hf.QuantizedCache(batch=1, max_tokens=64, num_layers=2, kv_heads=2,
                                     head_dim=32, dtype=torch.float32, window=[None, 3])
    modules = [types.SimpleNamespace(sliding_window=None), types.SimpleNamespace(sliding_window=4)]

    def step(n, window=None):
        for i, module in enumerate(modules):
            k, v, q = (torch.randn(1, 2, n, 32) for _ in range(3))
            keys, values = cache.layers[i].update(k, v)
            extra = {"sliding_window": window} if window and i == 1 else {}
            transformers_cache.attend(module, q, keys, values, None, **extra)

    with torch.no_grad():
        step(3)
        with pytest.raises(ValueError, match="layer 1 cannot serve window=7"):
            step(2, window=8)
        with pytest.raises(RuntimeError, match="call cache.reset"):
            step(1)
        cache.reset()
        step(1)
    assert [layer.seen for layer in cache.layers] == [1, 1]


def test_the_marker_is_not_a_tensor():
    layer = transformers_cache.QuantizedCacheLayer(
        lowbit_hf.QuantizedCache(num_layers=1, kv_heads=1, head_dim=16, batch=1,
                                 max_tokens=8).store, 0)
    key, _ = layer.update(torch.zeros(1, 1, 2, 16, dtype=torch.float16),
                          torch.zeros(1, 1, 2, 16, dtype=torch.float16))
    for use in (lambda: key.shape, lambda: torch.matmul(torch.zeros(2, 16), key),
                lambda: key.transpose(1, 2)):
        with pytest.raises(RuntimeError, match="the keys of layer 0"):
            use()
    assert layer.get_seq_length() == 2 and layer.get_mask_sizes(1) == (3, 0)


@pytest.mark.interpreter
def test_the_triton_decode_kernel_serves_generation_as_its_twin(model, monkeypatch):
    """The same left-padded generation with ``attention_with_kv_cache`` on the split-KV Triton
    kernel (the interpreter on the CPU) and on its twin: prefill and decode steps agree."""
    a, b = _prompt(20, 5), _prompt(13, 6)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 7, dtype=torch.long), b], dim=1)])
    got = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        got[backend] = _generate(model, "lowbit", ids, mask=(ids != 0).long(),
                                 cache=_cache(model, 2))
    assert torch.equal(got["triton"][0], got["reference"][0])
    # measured 1.3e-7 (the kernel's order of sums, to rounding)
    assert (got["triton"][1] - got["reference"][1]).abs().max() < 1e-5

"""The quantized, paged KV cache: what it stores (K INT8 per token less the frozen prompt mean, V
quantized per page when the page fills, the open page exact), pages and block tables, appends in
any chunking giving the same bits, its size, and refused appends leaving it unchanged."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit_attn
from lowbit_attn.quant.int8_naive import quantize_int8
from lowbit_attn.tools import inputs

RECIPES = ("kv_int8_fp8", "kv_int8_int8")


def kv(n: int, *, batch: int = 2, heads: int = 2, d: int = 64, seed: int = 0):
    _, k, v = inputs.make("channel_bias_k", seed=seed, batch=batch, heads_q=heads, heads_kv=heads,
                          n_q=1, n_k=n, head_dim=d)
    return k, v


def state(cache) -> list:
    """Everything the cache holds (tensors cloned, free lists), for before/after comparisons."""
    return [({name: t.clone() for name, t in layer.tensors().items()}, layer.free.snapshot())
            for layer in cache.layers]


def same_state(a, b) -> bool:
    def eq(x, y):  # NaN-poisoned, never-written memory compares equal to itself
        return torch.equal(x.view(torch.uint8).reshape(-1), y.view(torch.uint8).reshape(-1))
    return all(fa == fb and all(eq(ta[n], tb[n]) for n in ta) for (ta, fa), (tb, fb) in zip(a, b))


@pytest.mark.parametrize("recipe", RECIPES)
def test_what_is_stored(recipe):
    """μ is the prompt's mean (frozen afterwards); every K token is INT8 per token of K − μ; a
    full page's V is quantized per channel over the page; the open page's V is the input."""
    size, prompt, total = 16, 21, 40
    k, v = kv(total)
    cache = lowbit_attn.QuantizedKVCache(2, 2, 2, 64, max_tokens=total, page_size=size, recipe=recipe)
    cache.append(1, k[:, :, :prompt], v[:, :, :prompt])
    for t in range(prompt, total):
        cache.append(1, k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert cache.length(1).tolist() == [total] * 2 and cache.length(0).tolist() == [0, 0]
    mean = k[:, :, :prompt].float().mean(dim=2)
    k8, k_scale = quantize_int8(k, granularity="per_token", block=1, center=mean)
    for b in range(2):
        seq = cache.sequence(1, b)
        torch.testing.assert_close(seq.k_mean, mean[b], rtol=1e-6, atol=1e-6)
        assert torch.equal(seq.k, k8[b]) and torch.equal(seq.k_scale, k_scale[b])
        assert seq.pages.tolist() == cache.layers[1].block_table[b, :3].tolist()
        for page in range(total // size):
            x = v[b, :, page * size : (page + 1) * size].float()
            amax = x.abs().amax(dim=1)
            levels = 448 if recipe == "kv_int8_fp8" else 127
            torch.testing.assert_close(seq.v_scale[:, page], amax / levels, rtol=1e-6, atol=0)
            got = seq.v[:, page * size : (page + 1) * size].float() * seq.v_scale[:, page, None]
            # within half a step: E4M3 has 3 mantissa bits (2^-4 of the value; subnormals below
            # 2^-6 step by 2^-9, of the scaled value), INT8 amax/254
            scale = (amax / levels)[:, None]
            step = (torch.maximum(x.abs() / 16, scale / 1024) if recipe == "kv_int8_fp8"
                    else scale / 2)
            assert torch.all((got - x).abs() <= step * 1.0001 + 1e-6)
        assert torch.equal(seq.v_open, v[b, :, 2 * size :])
    used = sorted(cache.layers[1].block_table[:, :3].flatten().tolist())
    assert used == list(range(6)) and len(cache.layers[1].free) == 2 * 3 - 6


def test_a_one_token_first_append_sets_the_mean_to_that_token():
    k, v = kv(3, batch=1)
    cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 64, max_tokens=3, page_size=2)
    cache.append(0, k[:, :, :1], v[:, :, :1])
    cache.append(0, k[:, :, 1:], v[:, :, 1:])
    seq = cache.sequence(0, 0)
    assert torch.equal(seq.k_mean, k[0, :, 0].float())
    assert torch.all(seq.k[:, 0] == 0) and torch.all(seq.k_scale[:, 0] == 1)


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8),
       recipe=st.sampled_from(RECIPES), size=st.sampled_from([1, 4, 5, 16]))
def test_any_chunking_stores_the_same_bits(chunks, recipe, size):
    """A prompt of ``chunks[0]`` tokens then the later chunks, against the prompt then every later
    token one at a time: the stored sequences are identical (K per token; V quantized at fill)."""
    total = sum(chunks)
    k, v = kv(total, batch=1, d=24, seed=total)
    caches = [lowbit_attn.QuantizedKVCache(1, 1, 2, 24, max_tokens=total, page_size=size,
                                           recipe=recipe) for _ in range(2)]
    start = 0
    for n in chunks:
        caches[0].append(0, k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
    caches[1].append(0, k[:, :, : chunks[0]], v[:, :, : chunks[0]])
    for t in range(chunks[0], total):
        caches[1].append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
    for x, y in zip(caches[0].sequence(0, 0), caches[1].sequence(0, 0)):
        assert torch.equal(x, y)


def test_nbytes_is_at_most_0_56_of_an_fp16_cache():
    """At N = 4096, D = 128, pages of 64: K and V 1 byte per value, plus per-token K scales
    (4 bytes per token and head), per-page V scales (4·D bytes per page and head), each sequence's
    open page of V in fp16, μ and the balancing statistics, the block table and the lengths:
    0.532 of fp16's 2·B·Hkv·N·D·2."""
    b, hkv, n, d = 2, 2, 4096, 128
    cache = lowbit_attn.QuantizedKVCache(1, b, hkv, d, max_tokens=n, page_size=64)
    layer = cache.layers[0]
    assert cache.nbytes() == sum(t.numel() * t.element_size() for t in layer.tensors().values())
    fp16 = 2 * b * hkv * n * d * 2
    assert cache.nbytes() <= 0.56 * fp16, cache.nbytes() / fp16
    two = lowbit_attn.QuantizedKVCache(2, b, hkv, d, max_tokens=n, page_size=64)
    assert two.nbytes() == 2 * cache.nbytes()


def test_reset_empties_every_sequence_and_frees_every_page():
    k, v = kv(10)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=10, page_size=4)
    cache.append(0, k, v)
    cache.reset()
    assert cache.length(0).tolist() == [0, 0] and len(cache.layers[0].free) == 6
    assert torch.all(cache.layers[0].block_table == -1)
    cache.append(0, k[:, :, 3:], v[:, :, 3:])  # a new prompt: a new μ
    torch.testing.assert_close(cache.sequence(0, 1).k_mean, k[1, :, 3:].float().mean(dim=1))


def test_the_first_append_freezes_the_balancing_statistics():
    """μ, max|Q| (over the group's query heads and the valid tokens) and max|K - μ| come from a
    sequence's first append and stay; a later append's queries are not read; K is stored as
    ``(K - μ)/α`` (so a token equal to μ + α·c is stored as c, to the INT8 step)."""
    k, v = kv(5)
    q = torch.randn(2, 4, 5, 64).half()
    valid = torch.tensor([[True] * 5, [False, True, True, True, True]])
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=10, page_size=4)
    cache.append(0, k, v, valid=valid, q=q)
    layer = cache.layers[0]
    frozen = [t.clone() for t in (layer.k_mean, layer.q_amax, layer.k_amax)]
    want_q = q.float().abs()[1, :, 1:].amax(dim=1).view(2, 2, 64).amax(dim=1)  # sequence 1
    assert torch.equal(layer.q_amax[1], want_q)
    mean = k[1, :, 1:].float().mean(dim=1)
    spread = (k[1, :, 1:].float() - mean[:, None]).abs().amax(1)  # at least a quarter its median
    torch.testing.assert_close(layer.k_amax[1],
                               torch.maximum(spread, spread.median(-1, keepdim=True).values / 4))
    cache.append(0, k, v, q=100 * q)
    for before, now in zip(frozen, (layer.k_mean, layer.q_amax, layer.k_amax)):
        assert torch.equal(before, now)
    seq = cache.sequence(0, 0)
    alpha = torch.sqrt(layer.k_amax[0] / layer.q_amax[0])
    stored = seq.k.float() * seq.k_scale[..., None] * alpha[:, None]
    torch.testing.assert_close(stored + seq.k_mean[:, None], k[0].float().repeat(1, 2, 1),
                               atol=float((seq.k_scale[..., None] * alpha[:, None]).max()), rtol=0)


def test_a_constant_key_channel_freezes_no_balancing():
    """A prompt whose keys are all equal: ``max|K - μ|`` is 0 (μ's own rounding left ~1e-7, an
    ``α`` of ~1e-4 frozen, and the later tokens' reads lost Q in every channel: cosine 0.685),
    so ``α = 1`` and a read after 40 more tokens is as close to exact attention as without
    queries."""
    g = torch.Generator().manual_seed(0)
    first = torch.randn(1, 1, 1, 64, generator=g).expand(1, 1, 5, 64).contiguous()
    later, v = torch.randn(1, 1, 40, 64, generator=g), torch.randn(1, 1, 45, 64, generator=g)
    q = torch.randn(1, 1, 1, 64, generator=g)
    k = torch.cat([first, later], 2)
    want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, -1) @ v.double()
    cache = lowbit_attn.QuantizedKVCache(1, 1, 1, 64, max_tokens=64, page_size=16,
                                         dtype=torch.float32)
    cache.append(0, first, v[:, :, :5], q=torch.randn(1, 1, 5, 64, generator=g))
    assert torch.equal(cache.layers[0].k_amax, torch.zeros(1, 1, 64))
    cache.append(0, later, v[:, :, 5:])
    assert lowbit_attn.errors(lowbit_attn.attention_with_kv_cache(q, cache, 0), want).cosine > 0.999


@pytest.mark.parametrize("family", ["peaked", "qk_bias"])
def test_a_two_token_prompt_freezes_a_balancing_the_later_tokens_can_use(family):
    """A prompt of two tokens given with its queries, then 158 more: no channel's frozen
    ``max|K - μ|`` is below a quarter of the median one, so no channel that barely varied in the
    prompt is dropped from Q for the tokens after it (the worst of 4 seeds was 0.9437 on
    ``peaked``, 0.9797 on ``qk_bias``; 0.9929 and 0.9989 now)."""
    worst = 1.0
    for seed in range(4):
        q, k, v = (x.float() for x in inputs.make(family, seed=seed, batch=1, heads_q=4,
                                                   heads_kv=1, n_q=160, n_k=160, head_dim=64))
        cache = lowbit_attn.QuantizedKVCache(1, 1, 1, 64, max_tokens=192, page_size=16,
                                             dtype=torch.float32)
        cache.append(0, k[:, :, :2], v[:, :, :2], q=q[:, :, :2])
        cache.append(0, k[:, :, 2:], v[:, :, 2:])
        want = torch.softmax(q[:, :, -1:].double() @ k.double().repeat_interleave(4, 1)
                             .transpose(-1, -2) / 8, -1) @ v.double().repeat_interleave(4, 1)
        got = lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0)
        worst = min(worst, lowbit_attn.errors(got, want).cosine)
    assert worst > 0.99, worst


def bad_appends():
    k, v = kv(5)
    yes = torch.ones(2, 5, dtype=torch.bool)
    return [
        pytest.param(dict(layer=2), ValueError, "layer must be in [0, 2)", id="layer-past"),
        pytest.param(dict(layer=-1), ValueError, "layer must be in", id="layer-negative"),
        pytest.param(dict(layer="0"), TypeError, "layer must be an int", id="layer-str"),
        pytest.param(dict(k=k.float()), TypeError, "k must have the cache's dtype", id="k-dtype"),
        pytest.param(dict(v=v[..., :32]), ValueError, "v must have shape", id="v-head-dim"),
        pytest.param(dict(k=k[:1], v=v[:1]), ValueError, "k must have shape", id="batch"),
        pytest.param(dict(k=k[:, :, :0], v=v[:, :, :0]), ValueError, "n >= 1", id="no-token"),
        pytest.param(dict(v=v[:, :, :4]), ValueError, "k and v must have the same shape", id="k-v"),
        pytest.param(dict(k=k[0]), ValueError, "k must have 4 dimensions", id="k-3d"),
        pytest.param(dict(k=k.numpy()), TypeError, "k must be a torch.Tensor", id="k-array"),
        pytest.param(dict(k=k.to("meta")), ValueError, "k must be on the cache's device", id="k-device"),
        pytest.param(dict(valid=yes.int()), ValueError, "valid must be a bool tensor", id="valid-int"),
        pytest.param(dict(valid=yes[:, :4]), ValueError, "valid must be a bool tensor", id="valid-n"),
        pytest.param(dict(valid=[[True] * 5] * 2), TypeError, "valid must be a torch.Tensor",
                     id="valid-list"),
        pytest.param(dict(q=torch.zeros(2, 3, 5, 64, dtype=torch.float16)), ValueError,
                     "q must have shape", id="q-heads"),
        pytest.param(dict(q=torch.zeros(2, 4, 4, 64, dtype=torch.float16)), ValueError,
                     "n=5", id="q-tokens"),
        pytest.param(dict(q=torch.zeros(2, 4, 5, 64)), TypeError, "q must have the cache's dtype",
                     id="q-dtype"),
        pytest.param(dict(q=torch.zeros(2, 4, 5)), ValueError, "q must have 4 dimensions", id="q-3d"),
        pytest.param(dict(k=k.clone().requires_grad_()), ValueError, "must not require grad",
                     id="k-requires-grad"),
        pytest.param(dict(q=torch.zeros(2, 4, 5, 64, dtype=torch.float16, requires_grad=True)),
                     ValueError, "k, v and q must not require grad", id="q-requires-grad"),
        # sequence 0 fits (5 + 3 <= 8), sequence 1 does not (4 + 5): neither is written
        pytest.param(dict(valid=torch.tensor([[True] * 3 + [False] * 2, [True] * 5])), ValueError,
                     "would pass max_tokens=8 for sequence 1", id="past-max-tokens"),
    ]


@pytest.mark.parametrize("change, error, message", bad_appends())
def test_a_refused_append_names_its_argument_and_changes_nothing(change, error, message):
    k, v = kv(5)
    cache = lowbit_attn.QuantizedKVCache(2, 2, 2, 64, max_tokens=8, page_size=4)
    cache.append(0, k, v, valid=torch.tensor([[True] * 5, [False, True, True, True, True]]))
    before = state(cache)
    args = dict(layer=0, k=k, v=v, valid=None, q=None) | change
    with pytest.raises(error, match=re.escape(message)):
        cache.append(args["layer"], args["k"], args["v"], valid=args["valid"], q=args["q"])
    assert same_state(before, state(cache))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(recipe="kv_fp4"), ValueError, "recipe must be one of"),
    (dict(page_size=0), ValueError, "page_size must be at least 1"),
    (dict(max_tokens=2.0), TypeError, "max_tokens must be an int"),
    (dict(dtype=torch.int8), TypeError, "dtype must be"),
    (dict(head_dim=300), ValueError, "head_dim must be between 1 and 256"),
    (dict(device="nope"), ValueError, "device must be a torch.device or a device string"),
    (dict(device=3.5), TypeError, "device must be a torch.device or a device string"),
])
def test_a_refused_cache_names_its_argument(kwargs, error, message):
    args = dict(num_layers=1, batch=1, kv_heads=1, head_dim=64, max_tokens=8) | kwargs
    with pytest.raises(error, match=message):
        lowbit_attn.QuantizedKVCache(args.pop("num_layers"), args.pop("batch"), args.pop("kv_heads"),
                                     args.pop("head_dim"), **args)


@pytest.mark.parametrize("change, error, message", [
    (dict(q=torch.zeros(2, 3, 1, 64, dtype=torch.float16)), ValueError, "multiple of the cache's kv_heads"),
    (dict(q=torch.zeros(2, 4, 1, 64)), TypeError, "q must have the cache's dtype"),
    (dict(q=torch.zeros(2, 4, 1, 32, dtype=torch.float16)), ValueError, "q must have shape"),
    (dict(layer=1), ValueError, "layer must be in"),
    (dict(cache="cache"), TypeError, "cache must be a QuantizedKVCache"),
    (dict(scale=-1.0), ValueError, "scale must be a positive finite number"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(q=torch.zeros(2, 4, 1, 64, dtype=torch.float16, requires_grad=True)), ValueError,
     "^q must not require grad"),
])
def test_a_refused_attention_names_its_argument(change, error, message):
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=8, page_size=4)
    args = dict(q=torch.zeros(2, 4, 1, 64, dtype=torch.float16), cache=cache, layer=0, scale=None,
                return_lse=False) | change
    with pytest.raises(error, match=message):
        lowbit_attn.attention_with_kv_cache(args["q"], args["cache"], args["layer"],
                                            scale=args["scale"], return_lse=args["return_lse"])


def test_a_cuda_graph_capture_is_refused_and_changes_nothing(monkeypatch):
    """Under capture an append and a read are refused: a replay would not update the host's pages
    and lengths. Shown on a CPU cache that believes it is on a GPU being captured."""
    k, v = kv(5)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=8, page_size=4)
    cache.append(0, k, v)
    before = state(cache)
    cache.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="QuantizedKVCache.append cannot be captured in a CUDA graph"):
        cache.append(0, k[:, :, :1], v[:, :, :1])
    with pytest.raises(RuntimeError, match="attention_with_kv_cache cannot be captured"):
        lowbit_attn.attention_with_kv_cache(torch.zeros(2, 4, 1, 64, dtype=torch.float16), cache, 0)
    assert same_state(before, state(cache))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(ValueError, match="k must be on the cache's device cuda:0"):
        cache.append(0, k[:, :, :1], v[:, :, :1])  # not capturing: the ordinary checks


@pytest.mark.gpu
def test_a_real_cuda_graph_capture_is_refused():
    k, v = (x.cuda() for x in kv(5))
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=8, page_size=4, device="cuda")
    cache.append(0, k, v)
    q = torch.zeros(2, 4, 1, 64, dtype=torch.float16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph):
            lowbit_attn.attention_with_kv_cache(q, cache, 0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_deep_copy_and_a_saved_cache_go_on_alone(recipe, tmp_path):
    """What the class docstring promises: ``copy.deepcopy`` and ``torch.save``/``torch.load``
    give a cache with the same contents that appends and reads apart from the original."""
    import copy

    k, v = kv(6)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=16, page_size=4, recipe=recipe)
    cache.append(0, k, v)
    torch.save(cache, tmp_path / "cache.pt")
    copies = [copy.deepcopy(cache), torch.load(tmp_path / "cache.pt", weights_only=False)]
    q = kv(1, heads=2, seed=3)[0]
    for other in copies:
        assert same_state(state(other), state(cache))
        assert torch.equal(lowbit_attn.attention_with_kv_cache(q, other, 0),
                           lowbit_attn.attention_with_kv_cache(q, cache, 0))
    before = state(cache)
    k2, v2 = kv(2, seed=5)
    for other in copies:
        other.append(0, k2, v2)
        assert other.length(0).tolist() == [8, 8]
    assert cache.length(0).tolist() == [6, 6] and same_state(before, state(cache))

"""Attention against the quantized KV cache (the PyTorch twin): accuracy against exact attention
in float64, page boundaries, GQA, head dims, padded batches and prefill-then-decode, the last three
bit for bit."""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from lowbit_attn.inference.naive import exact_attention
from lowbit_attn.tools import inputs

# Measured 2026-11-25 (CPU twin; Hq=8, Hkv=2, D=128, a prompt of 1000 tokens appended with its
# queries, then 4 decode steps; the prompt's last 16 rows and the 4 decode rows against float64
# exact attention; worst of seeds 0-2), and the same rows through lowbit_attn.attention with the
# matching dense recipe:
#                               cosine     rel L1   max|lse-ref|  | dense recipe: cosine  rel L1
#   channel_bias_k kv_int8_fp8  0.999325   0.0367   0.0026        | qk_int8_pv_fp8  0.999304  0.0374
#                  kv_int8_int8 0.999934   0.0113   0.0026        | qk_int8_pv_fp16 0.999925  0.0120
#   outliers       kv_int8_fp8  0.999405   0.0337   0.083         | qk_int8_pv_fp8  0.999410  0.0325
#                  kv_int8_int8 0.999769   0.0209   0.083         | qk_int8_pv_fp16 0.999636  0.0268
#   peaked         kv_int8_fp8  0.999181   0.0366   0.21          | qk_int8_pv_fp8  0.999176  0.0363
#                  kv_int8_int8 0.999501   0.0262   0.21          | qk_int8_pv_fp16 0.999246  0.0296
#   flat           kv_int8_fp8  0.999373   0.0350   0.0000        | qk_int8_pv_fp8  0.999302  0.0368
#                  kv_int8_int8 0.999979   0.0066   0.0000        | qk_int8_pv_fp16 1.000000  0.0006
# Without the prompt's queries (no balancing) `outliers` (two channels of Q and two of K ×15)
# measures 0.991070 / 0.1178 and 0.991344 / 0.1144, the dense recipe with balance_qk=False
# 0.99425 / 0.1016; the other families move by less than 1.3e-4 in cosine. The bars: 1 - cosine
# and the LSE error about twice the worst measured, rel L1 1.5 times.
BARS = {  # (family, recipe): (cosine, rel L1, lse)
    ("channel_bias_k", "kv_int8_fp8"): (0.9986, 0.055, 0.01),
    ("channel_bias_k", "kv_int8_int8"): (0.99986, 0.017, 0.01),
    ("outliers", "kv_int8_fp8"): (0.9988, 0.051, 0.17),
    ("outliers", "kv_int8_int8"): (0.99953, 0.032, 0.17),
    ("peaked", "kv_int8_fp8"): (0.9983, 0.055, 0.4),
    ("peaked", "kv_int8_int8"): (0.9990, 0.04, 0.4),
    ("flat", "kv_int8_fp8"): (0.99875, 0.053, 0.001),
    ("flat", "kv_int8_int8"): (0.99996, 0.01, 0.001),
}
RECIPES = ("kv_int8_fp8", "kv_int8_int8")


def generate(q, k, v, prompt: int, *, recipe: str, page_size: int = 64, rows: int = 16,
             balance: bool = True):
    """Prefill ``prompt`` tokens (given their queries, for the balancing, unless not
    ``balance``), attend with the prompt's last ``rows`` queries, then one decode step per
    remaining token (append, then attend). Returns ``(out, lse)`` of those rows and the cache."""
    b, hkv, n, d = k.shape
    cache = lowbit_attn.QuantizedKVCache(1, b, hkv, d, max_tokens=n, page_size=page_size,
                                         recipe=recipe, dtype=k.dtype)
    cache.append(0, k[:, :, :prompt], v[:, :, :prompt], q=q[:, :, :prompt] if balance else None)
    results = [lowbit_attn.attention_with_kv_cache(q[:, :, prompt - rows : prompt], cache, 0,
                                                   return_lse=True)]
    for t in range(prompt, n):
        cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        results.append(lowbit_attn.attention_with_kv_cache(q[:, :, t : t + 1], cache, 0,
                                                           return_lse=True))
    return torch.cat([o for o, _ in results], 2), torch.cat([lse for _, lse in results], 2), cache


def exact(q, k, v):
    """Exact attention of the last rows ``q`` against all of ``k, v`` (causal, bottom-right)."""
    return exact_attention(q.double(), k.double(), v.double(), scale=q.shape[-1] ** -0.5,
                           causal_offset=k.shape[2] - q.shape[2])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", ["channel_bias_k", "outliers", "peaked", "flat"])
def test_accuracy_against_exact_attention(family, recipe):
    prompt, steps = 1000, 4
    q, k, v = inputs.make(family, seed=0, batch=1, heads_q=8, heads_kv=2, n_q=prompt + steps,
                          n_k=prompt + steps, head_dim=128)
    out, lse, _ = generate(q, k, v, prompt, recipe=recipe)
    ref, ref_lse = exact(q[:, :, prompt - 16 :], k, v)
    cos, rel_l1, lse_err = BARS[family, recipe]
    errs = lowbit_attn.errors(out, ref)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert errs.cosine >= cos and errs.rel_l1 <= rel_l1, errs
    assert float((lse.double() - ref_lse).abs().max()) <= lse_err


def test_the_prompts_queries_balance_outlier_channels():
    """The same `outliers` rows with and without the prompt's queries at the first append: the
    balancing factors they freeze take 1 - cosine from ~9e-3 to ~6e-4 (measured above)."""
    prompt = 1000
    q, k, v = inputs.make("outliers", seed=0, batch=1, heads_q=8, heads_kv=2, n_q=prompt + 4,
                          n_k=prompt + 4, head_dim=128)
    ref, _ = exact(q[:, :, prompt - 16 :], k, v)
    plain, _, cache = generate(q, k, v, prompt, recipe="kv_int8_fp8", balance=False)
    assert torch.all(cache.layers[0].q_amax == 0)  # no queries: no balancing
    balanced, _, cache = generate(q, k, v, prompt, recipe="kv_int8_fp8")
    assert torch.all(cache.layers[0].q_amax > 0)
    plain_err = 1 - lowbit_attn.errors(plain, ref).cosine
    balanced_err = 1 - lowbit_attn.errors(balanced, ref).cosine
    assert plain_err > 5e-3 and balanced_err < plain_err / 8, (plain_err, balanced_err)


PAGE = 16


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("size", [PAGE, 64])
@pytest.mark.parametrize("pages", [(0, 1), (1, -1), (1, 0), (1, 1), (2, 3)], ids=[
    "1", "page-1", "page", "page+1", "2page+3"])
def test_page_boundaries(pages, size, recipe):
    """Lengths around page edges, each reached by a prompt and by the same prompt less one token
    plus a decode step: the pages in use, V exact on the open page, and every row against exact
    attention (one token: exactly V; more: cosine 0.998, a bar loosened for a handful of keys)."""
    length = pages[0] * size + pages[1]
    q, k, v = inputs.make("channel_bias_k", seed=length, batch=1, heads_q=4, heads_kv=2,
                          n_q=length, n_k=length, head_dim=64)
    for prompt in {length, max(1, length - 1)}:
        out, lse, cache = generate(q, k, v, prompt, recipe=recipe, page_size=size, rows=prompt)
        seq = cache.sequence(0, 0)
        full = length // size
        assert seq.pages.tolist() == list(range(-(-length // size)))
        assert seq.v.shape[1] == full * size and seq.v_scale.shape[1] == full
        assert torch.equal(seq.v_open, v[0, :, full * size :])
        ref, ref_lse = exact(q, k, v)
        if length == 1:  # one key: P̃ = 448 (or 1) exactly, V exact on the open page
            assert torch.equal(out, v.repeat_interleave(2, dim=1))
        errs = lowbit_attn.errors(out, ref)
        assert errs.cosine >= 0.998, errs
        # rows of one or two keys: the LSE is about one score, whose INT8 error is not averaged
        # (measured up to 0.033; the dense recipes' grid budget is 0.05)
        assert float((lse.double() - ref_lse).abs().max()) <= 0.05


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gqa_and_head_dims(group, head_dim, recipe):
    """Hq = group·Hkv: each query head reads its KV head (the output equals the same query heads run
    against a cache per group of one KV head), and the accuracy is channel_bias_k's."""
    hkv, prompt = 2, 150
    q, k, v = inputs.make("channel_bias_k", seed=group + head_dim, batch=1, heads_q=group * hkv,
                          heads_kv=hkv, n_q=prompt + 2, n_k=prompt + 2, head_dim=head_dim)
    out, _, _ = generate(q, k, v, prompt, recipe=recipe, rows=8)
    ref, _ = exact(q[:, :, prompt - 8 :], k, v)
    errs = lowbit_attn.errors(out, ref)
    assert errs.cosine >= BARS["channel_bias_k", recipe][0], errs
    for h in range(hkv):  # KV head h alone, with its query heads
        heads = slice(h * group, (h + 1) * group)
        alone, _, _ = generate(q[:, heads], k[:, h : h + 1], v[:, h : h + 1], prompt,
                               recipe=recipe, rows=8)
        assert torch.equal(out[:, heads], alone)


def padded(xs: list[torch.Tensor], n: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, n_b, D]`` tensors into ``[B, H, n, D]`` padded with NaN on ``side``, and ``valid``."""
    batch = torch.full((len(xs), xs[0].shape[0], n, xs[0].shape[-1]), float("nan"), dtype=xs[0].dtype)
    valid = torch.zeros(len(xs), n, dtype=torch.bool)
    for b, x in enumerate(xs):
        span = slice(n - x.shape[1], n) if side == "left" else slice(0, x.shape[1])
        batch[b, :, span] = x
        valid[b, span] = True
    return batch, valid


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side, recipe):
    """A batch of prompts of lengths 0, 1, 15, 33 and 40 (padding marked invalid, NaN in its
    slots, the prompts' queries given), then three decode steps: every sequence's stored tokens, its decode outputs and (left
    padding: its rows are the last ones) its prompt rows are those of the sequence run alone, bit
    for bit."""
    lengths, n, steps, hkv, hq, d = [0, 1, 15, 33, 40], 40, 3, 2, 4, 64
    seqs = [inputs.make("channel_bias_k", seed=10 + i, batch=1, heads_q=hq, heads_kv=hkv,
                        n_q=m + steps, n_k=m + steps, head_dim=d) for i, m in enumerate(lengths)]
    q, _ = padded([s[0][0, :, : m] for s, m in zip(seqs, lengths)], n, side)
    k, valid = padded([s[1][0, :, : m] for s, m in zip(seqs, lengths)], n, side)
    v, _ = padded([s[2][0, :, : m] for s, m in zip(seqs, lengths)], n, side)
    cache = lowbit_attn.QuantizedKVCache(1, len(lengths), hkv, d, max_tokens=n + steps,
                                         page_size=PAGE, recipe=recipe)
    cache.append(0, k, v, valid=valid, q=q)  # the padding's queries are NaN too: never read
    prefill = lowbit_attn.attention_with_kv_cache(q.nan_to_num(), cache, 0)
    decode = []
    for t in range(steps):
        step = [torch.stack([s[i][0, :, m + t : m + t + 1] for s, m in zip(seqs, lengths)])
                for i in range(3)]
        cache.append(0, step[1], step[2])
        decode.append(lowbit_attn.attention_with_kv_cache(step[0], cache, 0))
    assert cache.length(0).tolist() == [m + steps for m in lengths]
    for b, ((qb, kb, vb), m) in enumerate(zip(seqs, lengths)):
        alone = lowbit_attn.QuantizedKVCache(1, 1, hkv, d, max_tokens=n + steps, page_size=PAGE,
                                             recipe=recipe)
        if m:
            alone.append(0, kb[:, :, :m], vb[:, :, :m], q=qb[:, :, :m])
            if side == "left":
                rows = lowbit_attn.attention_with_kv_cache(qb[:, :, :m], alone, 0)
                assert torch.equal(prefill[b : b + 1, :, n - m :], rows)
        for t in range(steps):
            alone.append(0, kb[:, :, m + t : m + t + 1], vb[:, :, m + t : m + t + 1])
            got = lowbit_attn.attention_with_kv_cache(qb[:, :, m + t : m + t + 1], alone, 0)
            assert torch.equal(decode[t][b : b + 1], got)
        for x, y in zip(cache.sequence(0, b)[:-1], alone.sequence(0, 0)[:-1]):
            assert torch.equal(x, y)


@pytest.mark.parametrize("recipe", RECIPES)
def test_decode_steps_equal_attention_on_a_cache_filled_at_once(recipe):
    """Each decode step's output (prompt, then one token at a time) equals, bit for bit, the
    attention of the same query against a cache that received the prompt and then every later token
    in one call: the same stored pages give the same result however they were filled."""
    prompt, steps = 30, 7
    q, k, v = inputs.make("outliers", seed=3, batch=2, heads_q=4, heads_kv=2, n_q=prompt + steps,
                          n_k=prompt + steps, head_dim=64)
    out, lse, _ = generate(q, k, v, prompt, recipe=recipe, page_size=PAGE, rows=1)
    for t in range(1, steps + 1):
        fresh = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=prompt + steps,
                                             page_size=PAGE, recipe=recipe)
        fresh.append(0, k[:, :, :prompt], v[:, :, :prompt], q=q[:, :, :prompt])
        fresh.append(0, k[:, :, prompt : prompt + t], v[:, :, prompt : prompt + t])
        o, l = lowbit_attn.attention_with_kv_cache(q[:, :, prompt + t - 1 : prompt + t], fresh, 0,
                                                   return_lse=True)
        assert torch.equal(out[:, :, t : t + 1], o) and torch.equal(lse[:, :, t : t + 1], l)


def test_rows_that_see_no_key():
    """An empty sequence and the first rows of a prompt longer than what is stored give 0 and LSE
    -inf; the scale argument is the softmax scale."""
    cache = lowbit_attn.QuantizedKVCache(1, 2, 1, 32, max_tokens=8, page_size=4)
    k = torch.randn(2, 1, 3, 32, dtype=torch.float16)
    cache.append(0, k, k, valid=torch.tensor([[True] * 3, [False] * 3]))
    q = torch.randn(2, 2, 5, 32, dtype=torch.float16)
    out, lse = lowbit_attn.attention_with_kv_cache(q, cache, 0, return_lse=True)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.all(out[0, :, :2] == 0) and torch.all(torch.isneginf(lse[0, :, :2]))
    assert torch.isfinite(lse[0, :, 2:]).all()
    _, lse2 = lowbit_attn.attention_with_kv_cache(q, cache, 0, scale=0.5, return_lse=True)
    ref, ref_lse = exact_attention(q[:1].double(), k[:1].double(), k[:1].double(), scale=0.5,
                                   causal_offset=-2)
    # scores at 3x the default scale: larger INT8 errors in them
    assert float((lse2[0, :, 2:].double() - ref_lse[0, :, 2:]).abs().max()) < 0.06

"""Local layers of the KV cache (sliding windows, chunks) and the decode options (softcap,
sinks): the pages a local layer holds, the twin against float64 exact attention with a mask built
here independently, and the decode kernel against the twin under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch

import lowbit_attn
from helpers import assert_close
from lowbit_attn.kvcache import kernel_decode
from lowbit_attn.kvcache.naive import attention_with_kv_cache_naive

PAGE = 8


def reference(q, k, v, positions, *, window=None, chunk=None, softcap=None, sinks=None):
    """Exact attention in float64 of rows ``q [B, Hq, n, D]`` at ``positions`` (one per row)
    against keys ``k, v [B, Hkv, L, D]`` at positions 0..L-1; the mask by loops, from the
    definitions: causal, ``p - j <= window``, ``j // chunk == p // chunk``; the softcap on the
    scaled logits; the sinks as one more logit of the denominator. Returns ``(out, lse)``."""
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i, p in enumerate(positions):
        for j in range(length):
            mask[i, j] = (j <= p and (window is None or p - j <= window)
                          and (chunk is None or j // chunk == p // chunk))
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(d)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, hq, n, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return p[..., :length] @ vv, lse


def decode(cache, q, k, v, prompt, **options):
    """A prompt of ``prompt`` tokens (given its queries), its last row read, then one decode step
    per further token; returns the rows' outputs, LSEs and positions, and the pages held after
    each step."""
    cache.append(0, k[:, :, :prompt], v[:, :, :prompt], q=q[:, :, :prompt])
    outs, lses, held = [], [], []
    out, lse = lowbit_attn.attention_with_kv_cache(q[:, :, prompt - 1 : prompt], cache, 0,
                                                   return_lse=True, **options)
    outs.append(out), lses.append(lse)
    for t in range(prompt, k.shape[2]):
        cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        out, lse = lowbit_attn.attention_with_kv_cache(q[:, :, t : t + 1], cache, 0,
                                                       return_lse=True, **options)
        outs.append(out), lses.append(lse)
        held.append(cache.held_pages(0))
    return torch.cat(outs, 2), torch.cat(lses, 2), list(range(prompt - 1, k.shape[2])), held


def data(n, *, batch=1, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, n, d, generator=g)
    k = torch.randn(batch, hkv, n, d, generator=g) + torch.randn(batch, hkv, 1, d, generator=g)
    v = torch.randn(batch, hkv, n, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("recipe", ["kv_int8_fp8", "kv_int8_int8"])
def test_a_sliding_layer_holds_its_window_and_one_page(recipe):
    """transformers' ``sliding_window = 20`` (window 19 back): after 4x the window of decoding a
    sequence holds at most ceil(20/8) + 1 pages, its pool is that small, and its pages are
    reused (the pool would not last otherwise)."""
    w, prompt = 19, 12
    n = prompt + 4 * (w + 1)
    q, k, v = data(n, batch=2)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 32, max_tokens=n, page_size=PAGE, recipe=recipe,
                                         dtype=torch.float32, window=w, max_append=prompt)
    full = lowbit_attn.QuantizedKVCache(1, 2, 2, 32, max_tokens=n, page_size=PAGE, recipe=recipe,
                                        dtype=torch.float32)
    assert cache.layers[0].k.shape[0] == 2 * (-(-(w + prompt) // PAGE) + 1) < full.layers[0].k.shape[0]
    assert cache.nbytes() < 0.55 * full.nbytes()  # 10 pages of 24, the open pages the same
    _, _, _, held = decode(cache, q, k, v, prompt)
    bound = -(-(w + 1) // PAGE) + 1
    assert all(h <= bound for step in held for h in step), held
    assert cache.length(0).tolist() == [n, n]
    layer = cache.layers[0]
    assert layer.host_first == [(n - 1 - w) // PAGE] * 2
    assert (layer.block_table[:, : layer.host_first[0]] == -1).all()


CASES = [
    pytest.param(dict(window=5), id="window5"),
    pytest.param(dict(window=11), id="window11"),
    pytest.param(dict(chunk=12), id="chunk12"),
    pytest.param(dict(window=9, softcap=2.0), id="window9-softcap"),
    pytest.param(dict(window=7, sinks=True), id="window7-sinks"),
    pytest.param(dict(softcap=1.5, sinks=True), id="full-softcap-sinks"),
    pytest.param(dict(chunk=10, softcap=3.0, sinks=True), id="chunk10-softcap-sinks"),
]


def options_of(case, hq, seed=3):
    opts = {"softcap": case.get("softcap")}
    if case.get("sinks"):
        opts["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) + 1.0
    else:
        opts["sinks"] = None
    return opts


@pytest.mark.parametrize("case", CASES)
def test_decode_against_exact_attention(case):
    """The twin through the public function, prompt then 30 decode steps, against float64
    exact attention on the unquantized K and V, within the 8-bit budget of the recipe."""
    prompt, n, hq = 9, 40, 4
    q, k, v = data(n, hq=hq, seed=1)
    opts = options_of(case, hq)
    cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=n, page_size=PAGE,
                                         recipe="kv_int8_int8", dtype=torch.float32,
                                         window=case.get("window"), chunk=case.get("chunk"),
                                         max_append=prompt)
    out, lse, positions, _ = decode(cache, q, k, v, prompt, **opts)
    ref, ref_lse = reference(q[:, :, positions], k, v, positions, window=case.get("window"),
                             chunk=case.get("chunk"), **opts)
    errs = lowbit_attn.errors(out, ref)
    assert errs.cosine > 0.9995 and errs.rel_l1 < 0.03, errs
    assert float((lse.double() - ref_lse).abs().max()) < 0.02
    if case.get("window") or case.get("chunk"):  # a real window: pages were given back
        assert cache.layers[0].host_first[0] > 0


def test_the_options_off_are_the_plain_read():
    """A local layer whose window covers everything and no options: the same bits as a full
    layer."""
    q, k, v = data(20, seed=2)
    results = []
    for window in (None, 100):
        cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=20, page_size=PAGE,
                                             dtype=torch.float32, window=window)
        results.append(decode(cache, q, k, v, 7)[:2])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_softcap_and_sinks_are_checked():
    q, k, v = data(8)
    cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=8, page_size=PAGE,
                                         dtype=torch.float32)
    cache.append(0, k, v)
    with pytest.raises(ValueError, match="softcap"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, softcap=-1.0)
    for cap in (1e8, 1e-40):
        with pytest.raises(ValueError, match=r"softcap must be between 2\*\*-125 and 2\*\*16"):
            lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, softcap=cap)
    # 0 is off, as in attention()
    assert torch.equal(lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, softcap=0.0),
                       lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0))
    with pytest.raises(TypeError, match="softcap"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, softcap="1")
    with pytest.raises(ValueError, match="softcap must be a positive finite"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, softcap=10**400)
    with pytest.raises(ValueError, match="softcap must be between"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, softcap=1e39)
    with pytest.raises(ValueError, match="scale must be between"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, scale=1e-45)
    with pytest.raises(ValueError, match="sinks"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0, sinks=torch.zeros(3))
    # the same check as attention()'s: float64 sinks are refused there too
    with pytest.raises(TypeError, match="sinks must be float32, bfloat16 or float16"):
        lowbit_attn.attention_with_kv_cache(q[:, :, -1:], cache, 0,
                                            sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="window"):
        lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=8, window=-1)
    with pytest.raises(ValueError, match="per layer"):
        lowbit_attn.QuantizedKVCache(2, 1, 2, 32, max_tokens=8, window=[3])


def test_a_read_past_the_window_is_refused():
    """The rows of a read must see only held pages: after decoding past the window, reading
    the whole prompt's rows again reaches tokens given back."""
    q, k, v = data(40)
    cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=40, page_size=PAGE,
                                         dtype=torch.float32, window=4)
    cache.append(0, k[:, :, :30], v[:, :, :30])
    cache.append(0, k[:, :, 30:31], v[:, :, 30:31])  # gives back the pages before 30 - 4
    with pytest.raises(ValueError, match="gave back"):
        lowbit_attn.attention_with_kv_cache(q[:, :, :31], cache, 0)
    lowbit_attn.attention_with_kv_cache(q[:, :, 30:31], cache, 0)


def test_a_chunked_prefill_of_a_sliding_layer():
    """A prompt appended in chunks to a sliding layer, each chunk's rows read: the same as one
    exact attention over the whole prompt (8-bit budget), pages given back between chunks."""
    n, w = 40, 6
    q, k, v = data(n, seed=4)
    cache = lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=n, page_size=PAGE,
                                         recipe="kv_int8_int8", dtype=torch.float32, window=w,
                                         max_append=16)
    outs = []
    for start in range(0, n, 16):
        end = min(start + 16, n)
        cache.append(0, k[:, :, start:end], v[:, :, start:end], q=q[:, :, start:end])
        outs.append(lowbit_attn.attention_with_kv_cache(q[:, :, start:end], cache, 0))
        assert cache.held_pages(0)[0] <= -(-(w + 16) // PAGE) + 1
    ref, _ = reference(q, k, v, list(range(n)), window=w)
    errs = lowbit_attn.errors(torch.cat(outs, 2), ref)
    assert errs.cosine > 0.9995, errs


def test_an_append_the_local_pool_cannot_hold_names_max_append():
    """``max_append`` sizes a sliding layer's pool: a larger append is stored while the pool has
    the pages, and refused, naming ``max_append``, when it has not (nothing stored)."""
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 32, max_tokens=64, page_size=4, window=3,
                                         max_append=4, dtype=torch.float32)
    x = torch.randn(2, 2, 20, 32)
    with pytest.raises(ValueError, match="sized for appends of at most max_append=4 tokens"):
        cache.append(0, x, x)
    assert cache.layers[0].host_lengths == [0, 0]
    cache.append(0, x[:, :, :4], x[:, :, :4])
    cache.append(0, x[:, :, 4:9], x[:, :, 4:9])  # 5 > max_append, and the pool has the pages
    assert cache.layers[0].host_lengths == [9, 9]


def test_a_refused_append_gives_back_no_page():
    """A sliding layer gives back the pages no later query sees when an append is stored, not
    before its checks: a refused one (wrong dtype) leaves the pages, the block table and the
    last append's reads as they were; the next append, counting those pages as free, fits."""
    cache = lowbit_attn.QuantizedKVCache(1, 1, 1, 8, max_tokens=64, page_size=4, window=2,
                                         max_append=12, dtype=torch.float32)
    x = torch.randn(1, 1, 13, 8)
    cache.append(0, x[:, :, :12], x[:, :, :12])
    q = torch.randn(1, 1, 12, 8)
    read = lowbit_attn.attention_with_kv_cache(q, cache, 0)
    layer = cache.layers[0]
    before = (cache.held_pages(0), list(layer.host_first), layer.block_table.clone(),
              layer.free.snapshot())
    with pytest.raises(TypeError, match="k must be float16, bfloat16 or float32"):
        cache.append(0, x[:, :, 12:].double(), x[:, :, 12:].double())
    assert (cache.held_pages(0), list(layer.host_first)) == before[:2]
    assert torch.equal(layer.block_table, before[2]) and layer.free.snapshot() == before[3]
    assert torch.equal(lowbit_attn.attention_with_kv_cache(q, cache, 0), read)
    cache.append(0, x[:, :, 12:], x[:, :, 12:])
    assert cache.held_pages(0) == [2]


# the kernel against the twin (tests/kvcache/test_decode_kernel.py's bars, max|V| = 4 here)
BARS = {"kv_int8_fp8": 0.015, "kv_int8_int8": 2e-4}


@pytest.mark.parametrize("recipe", ["kv_int8_fp8", "kv_int8_int8"])
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_matches_the_twin(device, recipe, case):
    """Two sequences of unequal lengths, prompt then decode steps past the window, one and
    several splits (``pages_per_split`` 1 and 2, and the window's pages in 2 ``parts``): every
    read's rows against the twin's."""
    dev = device.name
    hq, n = 4, 34
    q, k, v = data(n, batch=2, hq=hq, seed=5)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, :6] = False  # sequence 1: a left-padded prompt of 14
    opts = options_of(case, hq)
    opts["sinks"] = None if opts["sinks"] is None else opts["sinks"].to(dev)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 32, max_tokens=n, page_size=PAGE, recipe=recipe,
                                         dtype=torch.float32, device=dev,
                                         window=case.get("window"), chunk=case.get("chunk"))
    q, k, v = q.to(dev), k.to(dev), v.to(dev)
    cache.append(0, k[:, :, :20], v[:, :, :20], valid=valid.to(dev), q=q[:, :, :20])
    layer = cache.layers[0]
    reads = [(q[:, :, 17:20], None)]
    for t in range(20, n):
        reads.append((q[:, :, t : t + 1], (k[:, :, t : t + 1], v[:, :, t : t + 1])))
    for i, (rows, new) in enumerate(reads):
        if new is not None:
            cache.append(0, *new)
        if i % 5 and i != len(reads) - 1:
            continue
        ref, ref_lse = attention_with_kv_cache_naive(rows, layer, cache.recipe, scale=32 ** -0.5,
                                                     **opts)
        for per_split, parts in ((1, 0), (2, 0), (1, 2)):
            out, lse = kernel_decode.attention(rows, layer, cache.recipe, scale=32 ** -0.5,
                                               pages_per_split=per_split, parts=parts, **opts)
            name = f"{per_split} {parts}"
            assert_close(out, ref, atol=BARS[recipe] * 4.0, rtol=0, name=f"out {name}")
            assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5, name=f"lse {name}")
    if layer.local:  # the grid covers the window's pages, counted from its first: not all
        assert kernel_decode.splits_of(layer, 1) < -(-max(layer.host_lengths) // PAGE)


def test_a_decode_step_on_a_sliding_layer_is_the_eager_step(device, monkeypatch):
    """``DecodeStep`` with a window, softcap and sinks: the eager steps' bits (its reserved pages
    are held until the next eager append, which gives back those before the window)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    dev, hq = device.name, 4
    q, k, v = (x.to(dev) for x in data(24, hq=hq, seed=6))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(2)).to(dev)
    caches = [lowbit_attn.QuantizedKVCache(1, 1, 2, 32, max_tokens=24, page_size=PAGE,
                                           dtype=torch.float32, device=dev, window=5)
              for _ in range(2)]
    for cache in caches:
        cache.append(0, k[:, :, :10], v[:, :, :10], q=q[:, :, :10])
    step = lowbit_attn.DecodeStep(caches[0], 0, heads=hq, steps=6, softcap=2.0, sinks=sinks)
    for t in range(10, 16):
        got = step.run(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]).clone()
        caches[1].append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        want = lowbit_attn.attention_with_kv_cache(q[:, :, t : t + 1], caches[1], 0,
                                                   softcap=2.0, sinks=sinks)
        assert torch.equal(got, want), t
    assert caches[0].held_pages(0)[0] >= caches[1].held_pages(0)[0]
    caches[0].append(0, k[:, :, 16:17], v[:, :, 16:17])  # eager: gives back what it can
    caches[1].append(0, k[:, :, 16:17], v[:, :, 16:17])
    assert caches[0].layers[0].host_first == caches[1].layers[0].host_first


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89", "sm_120a", "sm_100a"])
@pytest.mark.parametrize("recipe", ["kv_int8_fp8", "kv_int8_int8"])
def test_a_local_read_with_softcap_and_sinks_compiles_without_spills(monkeypatch, recipe, arch):
    """The split kernel with ``LOCAL`` and ``SOFTCAP`` and the merge with ``SINK``, compiled
    ahead of time (D = 128, GQA 8, fp16 cache, 64-token pages, one query): no spills, and on
    sm_90a the full-page loop still streams K and V by ``cp.async`` (no ``LDG`` waited on).
    Measured 2026-11-28 (Triton 3.6): under the plain read's 168-register cap it spilled 8 B
    (88 B on sm_120a, INT8 V), so a variant runs uncapped (``kernel_decode.split_launch``):
    split kernel 213 (E4M3 V) / 215 (INT8 V) registers on sm_90a, 168 / 225 on sm_89, 168 / 230
    on sm_120a, 217 / 219 on sm_100a; the merge 25-28."""
    from helpers import record_launches
    from lowbit_attn.tools import aot, sass

    launches = record_launches(monkeypatch, kernel_decode,
                               ("_decode_split_kernel", "_decode_merge_kernel"))
    monkeypatch.setattr(kernel_decode, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(kernel_decode, "exact_fp8", lambda: False)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 4, 128, max_tokens=1024, page_size=64,
                                         recipe=recipe, dtype=torch.float16, window=300)
    kv = torch.randn(2, 4, 700, 128).half()
    cache.append(0, kv, kv)
    kernel_decode.attention(torch.randn(2, 32, 1, 128).half(), cache.layers[0], cache.recipe,
                            scale=128 ** -0.5, softcap=30.0, sinks=torch.zeros(32))
    for launch in launches:
        r = aot.compile_launch(launch, arch)
        assert r.error is None, r.error
        assert r.spill_stores == 0 and r.spill_loads == 0, (r.kernel, r.registers, r.spill_stores)
        if arch == "sm_90a" and "split" in r.kernel:
            (body,) = sass.key_block_loops(sass.disassemble(r.cubin), mma="IMMA")
            ops = [line.split()[0] for line in body]
            assert not any(op.startswith("LDG.") for op in ops)
            assert any(op.startswith("LDGSTS") for op in ops)

"""The split-KV decode kernel (``kvcache/kernel_decode.py``) against its twin on the same cache:
page boundaries (lengths 1, page−1, page, page+1 with 16-token pages), GQA 1, 4 and 8, head dims
64, 128 and 256, batches of unequal lengths (one empty), n = 1 and 3 query rows, 1 to 3 splits, both
recipes and the three cache dtypes; and the public function's routing.

Why not bit for bit: the twin rounds ``P̃ = exp2(S - m + o)`` against each row's global maximum,
the kernel against the running maximum of its split (then rescales by ``2^(m_run - M)``), so
the two round P̃ at different points. Each P̃ element is within half an ulp of its exact value in
both (relative ``2^-4`` in E4M3, ``2^-11`` in fp16), so ``|out - twin| ≤ 2·u·max|V|`` in the worst
case (``2^-3·max|V|`` for ``kv_int8_fp8``, ``2^-10·max|V|`` for ``kv_int8_int8``), plus the
output's own rounding to q's dtype (``u_dtype·|out|``). Rounding errors of random rows mostly
cancel; measured 2026-11-25 (interpreter, the cases below with seeds 0-1, ``max|out - twin| /
max|V|`` with ``out`` in fp32, and the LSE's relative error):

    kv_int8_fp8   several pages: 0.0067     one page, one split (fp32): 6.4e-8    LSE 1.2e-6
    kv_int8_int8  several pages: 5.1e-5     one page, one split (fp32): 6.4e-8    LSE 1.0e-6
    splits 2, 3 against 1:  kv_int8_fp8 0.0053,  kv_int8_int8 5.1e-5 (fp32) to 4.9e-4 (bf16 out)

The bars below are about twice those, and within the worst-case bounds. With one split and at most
one page the running maximum is the global one: P̃ is the twin's to the bit and only the fp32
order of sums differs (bar 1e-6·max|V|): the merge of a single split is exact.
"""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import assert_close
from helpers import record_launches as recorded
from lowbit_attn.kvcache import kernel_decode
from lowbit_attn.kvcache.naive import attention_with_kv_cache_naive

PAGE = 16
RECIPES = ("kv_int8_fp8", "kv_int8_int8")
# max|out - twin| / max|V| (before the output's rounding to q's dtype)
BARS = {"kv_int8_fp8": 0.015, "kv_int8_int8": 2e-4}
ONE_PAGE_BAR = 1e-6
LSE_RTOL = 1e-5
# The output's rounding to q's dtype, relative; bf16 a whole ulp: the interpreter's fp32 → bf16
# conversion truncates (seen: 1.07027 stored as 1.0625, not 1.0703125).
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -7, torch.float32: 0.0}


def build(lengths, kv_heads: int, head_dim: int, recipe: str, dtype, device, seed: int = 0,
          prompt_heads: int | None = None):
    """A one-layer cache holding ``lengths[b]`` tokens of sequence ``b`` (K with a per-channel
    bias, so that μ matters), stored by one padded append; with ``prompt_heads``, the append is
    given queries of that many heads (Q's channel 0 and K's channel 1 ×8, so that the balancing
    factors are far from 1). Returns ``(cache, max|V|)``."""
    g = torch.Generator().manual_seed(seed)
    batch, longest = len(lengths), max(max(lengths), 1)
    cache = lowbit_attn.QuantizedKVCache(1, batch, kv_heads, head_dim, max_tokens=4 * PAGE,
                                         page_size=PAGE, recipe=recipe, dtype=dtype,
                                         device=device)
    shape = (batch, kv_heads, longest, head_dim)
    k = torch.randn(shape, generator=g) + 2.0 * torch.randn(batch, kv_heads, 1, head_dim,
                                                            generator=g)
    v = torch.randn(shape, generator=g)
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    q = None
    if prompt_heads is not None:
        k[..., 1] *= 8.0
        q = torch.randn(batch, prompt_heads, longest, head_dim, generator=g)
        q[..., 0] *= 8.0
        q = q.to(device, dtype)
    cache.append(0, k.to(device, dtype), v.to(device, dtype), valid=valid.to(device), q=q)
    return cache, float(v.to(dtype).abs().max())


def queries(batch, heads, n, head_dim, dtype, device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, head_dim, generator=g).to(device, dtype)


def check_against_twin(out, lse, ref, ref_lse, *, bar: float, vmax: float, dtype, name: str):
    seen = torch.isfinite(ref_lse)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.all(out[~seen] == 0), f"{name}: a row that sees no key is not 0"
    assert torch.all(torch.isneginf(lse[~seen])), f"{name}: a row that sees no key has LSE != -inf"
    assert_close(out.float(), ref, atol=bar * vmax, rtol=UNIT_ROUNDOFF[dtype], name=f"{name} out")
    assert_close(lse, ref_lse, atol=LSE_RTOL, rtol=LSE_RTOL, name=f"{name} lse")


CASES = [  # lengths, kv heads, GQA group, head dim, n, dtype
    pytest.param((1, 15), 2, 1, 64, 1, torch.float16, id="L1,15-G1-D64-n1-fp16"),
    pytest.param((16, 17), 1, 4, 64, 3, torch.float16, id="L16,17-G4-D64-n3-fp16"),
    pytest.param((17, 0), 2, 4, 64, 1, torch.float32, id="L17,0-G4-D64-n1-fp32"),
    pytest.param((40, 2), 1, 1, 128, 3, torch.bfloat16, id="L40,2-G1-D128-n3-bf16"),
    pytest.param((33, 48), 1, 4, 64, 3, torch.float16, id="L33,48-G4-D64-n3-fp16"),
    pytest.param((16, 1), 1, 8, 256, 1, torch.bfloat16, id="L16,1-G8-D256-n1-bf16"),
    # a chunk of 40 queries: 160 rows in blocks of 32 (sequence 1's first three see no key)
    pytest.param((40, 37), 1, 4, 64, 40, torch.float16, id="L40,37-G4-D64-n40-fp16"),
]


@pytest.mark.parametrize("balanced", [False, True], ids=["", "balanced"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("lengths, kv_heads, group, head_dim, n, dtype", CASES)
def test_kernel_matches_the_twin_for_every_split_size(device, recipe, lengths, kv_heads, group,
                                                      head_dim, n, dtype, balanced):
    cache, vmax = build(lengths, kv_heads, head_dim, recipe, dtype, device.name,
                        prompt_heads=kv_heads * group if balanced else None)
    if balanced:  # the factors differ from 1 (the appended queries and keys had outliers)
        longest, layer = lengths.index(max(lengths)), cache.layers[0]
        assert layer.q_amax[longest, :, 0].min() > 2 * layer.q_amax[longest, :, 2:].max()
        assert layer.k_amax[longest, :, 1].min() > 2 * layer.k_amax[longest, :, 2:].max()
    q = queries(len(lengths), kv_heads * group, n, head_dim, dtype, device.name)
    layer, scale = cache.layers[0], head_dim ** -0.5
    ref, ref_lse = attention_with_kv_cache_naive(q, layer, cache.recipe, scale=scale)
    results = []
    for per_split in (3, 2, 1):  # up to 3 pages: one split, two, three
        out, lse = kernel_decode.attention(q, layer, cache.recipe, scale=scale,
                                           pages_per_split=per_split)
        check_against_twin(out, lse, ref, ref_lse, bar=BARS[recipe], vmax=vmax, dtype=dtype,
                           name=f"pages_per_split={per_split}")
        results.append((out.float(), lse))
    for per_split, (out, lse) in zip((2, 1), results[1:]):  # split sizes agree with each other
        assert_close(out, results[0][0], atol=BARS[recipe] * vmax, rtol=UNIT_ROUNDOFF[dtype],
                     name=f"pages_per_split={per_split} vs 3")
        assert_close(lse, results[0][1], atol=LSE_RTOL, rtol=LSE_RTOL,
                     name=f"lse pages_per_split={per_split}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_page_and_one_split_give_the_twin_to_fp32_rounding(device, recipe):
    """One split over one page: the running maximum is the global one, so P̃ is the twin's bit for
    bit and the merge divides by ``2^0 = 1``; only the fp32 order of sums differs."""
    cache, vmax = build((PAGE, 9), 2, 64, recipe, torch.float32, device.name, prompt_heads=8)
    q = queries(2, 8, 3, 64, torch.float32, device.name)
    ref, ref_lse = attention_with_kv_cache_naive(q, cache.layers[0], cache.recipe, scale=0.125)
    out, lse = kernel_decode.attention(q, cache.layers[0], cache.recipe, scale=0.125,
                                       pages_per_split=1)
    check_against_twin(out, lse, ref, ref_lse, bar=ONE_PAGE_BAR, vmax=vmax, dtype=torch.float32,
                       name="one split")


@pytest.mark.parametrize("recipe", RECIPES)
def test_with_sinks_one_split_gives_the_twin_to_fp32_rounding(device, recipe):
    """The sinks join after P·V, in the merge kernel as in the twin: P̃ is rounded against the
    keys' own maximum in both (a twin that raised the maximum to the sink first rounded P̃ on
    another scale: outputs 0.03 apart)."""
    cache, vmax = build((PAGE, 9), 2, 64, recipe, torch.float32, device.name, prompt_heads=8)
    q = queries(2, 8, 3, 64, torch.float32, device.name) * 3
    sinks = torch.linspace(-3.0, 3.0, 8).to(device.name)
    ref, ref_lse = attention_with_kv_cache_naive(q, cache.layers[0], cache.recipe, scale=0.125,
                                                 sinks=sinks)
    out, lse = kernel_decode.attention(q, cache.layers[0], cache.recipe, scale=0.125,
                                       pages_per_split=1, sinks=sinks)
    check_against_twin(out, lse, ref, ref_lse, bar=ONE_PAGE_BAR, vmax=vmax, dtype=torch.float32,
                       name="one split, sinks")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_sink_is_not_hidden_on_an_empty_sequence(device, bad):
    """A NaN or +inf sink leaves its head's rows undefined, the rows of a sequence without keys
    included: NaN in the kernel as in the twin (the kernel gave those rows 0 before); the other
    heads' rows there stay 0 with their sink as LSE."""
    cache, _ = build((PAGE, 0), 2, 64, "kv_int8_fp8", torch.float32, device.name)
    q = queries(2, 8, 1, 64, torch.float32, device.name)
    sinks = torch.tensor([bad] + [0.5] * 7, device=device.name)
    for out, lse in (attention_with_kv_cache_naive(q, cache.layers[0], cache.recipe, scale=0.125,
                                                   sinks=sinks),
                     kernel_decode.attention(q, cache.layers[0], cache.recipe, scale=0.125,
                                             sinks=sinks)):
        assert out[:, 0].isnan().all(), "head 0 (the bad sink)"
        assert torch.equal(out[1, 1:].cpu(), torch.zeros(7, 1, 64))
        torch.testing.assert_close(lse[1, 1:].cpu(), torch.full((7, 1), 0.5), atol=1e-5, rtol=0)


def test_the_public_function_runs_the_kernel_on_the_triton_backend(device, monkeypatch):
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    cache, _ = build((5, 20), 2, 64, "kv_int8_fp8", torch.float16, device.name)
    q = queries(2, 4, 1, 64, torch.float16, device.name)
    calls = []
    attention = kernel_decode.attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return attention(*args, **kwargs)

    monkeypatch.setattr(kernel_decode, "attention", recording)
    out, lse = lowbit_attn.attention_with_kv_cache(q, cache, 0, return_lse=True)
    assert len(calls) == 1
    want, want_lse = attention(q, cache.layers[0], cache.recipe, scale=0.125)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_a_split_is_a_fixed_number_of_pages():
    assert kernel_decode.split_for(64) == (kernel_decode.TOKENS_PER_SPLIT // 64, 0)
    assert kernel_decode.split_for(16) == (kernel_decode.TOKENS_PER_SPLIT // 16, 0)
    assert kernel_decode.split_for(4096) == (1, 0)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("lengths, kv_heads, group, head_dim, n, dtype", [CASES[1], CASES[4],
                                                                          CASES[6]])
def test_a_sequence_in_parts_matches_the_twin(device, recipe, lengths, kv_heads, group,
                                              head_dim, n, dtype):
    """``parts``: each sequence's pages (each block's, from its first visible one) in that many
    splits, at least one page each: against the twin as every split size is, and the grid no
    larger than ``parts``."""
    cache, vmax = build(lengths, kv_heads, head_dim, recipe, dtype, device.name)
    q = queries(len(lengths), kv_heads * group, n, head_dim, dtype, device.name)
    layer, scale = cache.layers[0], head_dim ** -0.5
    ref, ref_lse = attention_with_kv_cache_naive(q, layer, cache.recipe, scale=scale)
    for parts in (2, 3, 8):
        assert kernel_decode.splits_of(layer, 1, n, parts=parts) == min(
            parts, -(-max(lengths) // PAGE))
        out, lse = kernel_decode.attention(q, layer, cache.recipe, scale=scale,
                                           pages_per_split=1, parts=parts)
        check_against_twin(out, lse, ref, ref_lse, bar=BARS[recipe], vmax=vmax, dtype=dtype,
                           name=f"parts={parts}")


def test_a_measured_split_is_the_architecture_s(device, monkeypatch):
    """An entry of ``core.measured.DECODE_SPLITS`` for the family kernels target sets the split
    (keys per split, or parts) of every read (the public call, its plan key's splits,
    ``DecodeStep``): another family's entry changes nothing."""
    from lowbit_attn.core import measured
    from lowbit_attn.core.arch import get_capability
    from lowbit_attn.core.triton_helpers import family

    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    here = family(get_capability())
    cache, _ = build((40, 7), 2, 64, "kv_int8_fp8", torch.float16, device.name)
    q = queries(2, 4, 1, 64, torch.float16, device.name)
    layer = cache.layers[0]
    monkeypatch.setattr(measured, "DECODE_SPLITS", (measured.DecodeSplit("sm_0", 16, "test"),))
    assert kernel_decode.split_for(PAGE) == (kernel_decode.TOKENS_PER_SPLIT // PAGE, 0)
    monkeypatch.setattr(measured, "DECODE_SPLITS", (measured.DecodeSplit(here, 2 * PAGE, "t"),))
    assert kernel_decode.split_for(PAGE) == (2, 0)
    assert kernel_decode.split_for(4 * PAGE) == (1, 0)
    assert kernel_decode.splits_of(layer) == 2  # 40 keys in splits of 32
    seen, launch = [], kernel_decode.launch

    def spy(*args, **kwargs):
        seen.append((kwargs["pages_per_split"], kwargs["into"].splits))
        return launch(*args, **kwargs)

    monkeypatch.setattr(kernel_decode, "launch", spy)
    out = lowbit_attn.attention_with_kv_cache(q, cache, 0)
    assert seen == [(2, 2)]
    want, _ = kernel_decode.attention(q, layer, cache.recipe, scale=64 ** -0.5, pages_per_split=2)
    assert torch.equal(out, want)
    step = lowbit_attn.DecodeStep(cache, 0, heads=4, steps=2)
    assert (step.pages_per_split, step.parts) == (2, 0)
    # an entry in parts: every sequence's pages in that many splits
    monkeypatch.setattr(measured, "DECODE_SPLITS", (measured.DecodeSplit(here, None, "t", 2),))
    assert kernel_decode.split_for(PAGE) == (kernel_decode.TOKENS_PER_SPLIT // PAGE, 2)
    seen.clear()
    out = lowbit_attn.attention_with_kv_cache(q, cache, 0)
    assert seen == [(kernel_decode.TOKENS_PER_SPLIT // PAGE, 2)]
    want, _ = kernel_decode.attention(q, layer, cache.recipe, scale=64 ** -0.5,
                                      pages_per_split=1, parts=2)
    assert torch.equal(out, want)
    step = lowbit_attn.DecodeStep(cache, 0, heads=4, steps=2)
    assert (step.parts, step.buffers.splits) == (2, 2)


@pytest.mark.parametrize("per_split, parts", [(1, 0), (1, 2), (1, 3)])
def test_a_sequence_gives_the_same_bits_alone_or_in_a_batch(device, per_split, parts):
    """Its splits depend on its own length only (``pages_per_split`` pages each, or its pages in
    ``parts`` splits), not on the batch: sequence 0 of a batch of three (whose longest has more
    pages, so more splits) and the same tokens in a cache of its own give the same bits."""
    lengths = (40, 60, 7)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(3, 2, 60, 64, generator=g) + 2.0 * torch.randn(3, 2, 1, 64, generator=g)
    v = torch.randn(3, 2, 60, 64, generator=g)
    valid = torch.arange(60)[None, :] < torch.tensor(lengths)[:, None]
    q = queries(3, 8, 1, 64, torch.float16, device.name)
    results = []
    for rows in (slice(0, 3), slice(0, 1)):
        batch = rows.stop - rows.start
        cache = lowbit_attn.QuantizedKVCache(1, batch, 2, 64, max_tokens=4 * PAGE, page_size=PAGE,
                                             dtype=torch.float16, device=device.name)
        cache.append(0, *(x[rows].to(device.name, torch.float16) for x in (k, v)),
                     valid=valid[rows].to(device.name))
        results.append(kernel_decode.attention(q[rows], cache.layers[0], cache.recipe,
                                               scale=0.125, pages_per_split=per_split,
                                               parts=parts))
    (both, both_lse), (one, one_lse) = results
    assert torch.equal(both[:1], one) and torch.equal(both_lse[:1], one_lse)


def record_launches(monkeypatch) -> list:
    """The decode kernels replaced by recorders (``helpers.record_launches``)."""
    return recorded(monkeypatch, kernel_decode, ("_decode_split_kernel", "_decode_merge_kernel"))


def test_the_launches_pass_keywords_only_and_few_of_them(monkeypatch):
    """The launch rules of tests/tools/test_launch_arguments.py, on a recorded call."""
    launches = record_launches(monkeypatch)
    cache, _ = build((5, 20), 2, 64, "kv_int8_fp8", torch.float16, "cpu")
    kernel_decode.attention(queries(2, 4, 1, 64, torch.float16, "cpu"), cache.layers[0],
                            cache.recipe, scale=0.125, pages_per_split=1)
    assert [launch.name for launch in launches] == ["_decode_split_kernel", "_decode_merge_kernel"]
    for launch in launches:
        assert launch.args == () and len(launch.kwargs) <= 42
        for name, value in launch.kwargs.items():
            if name.endswith("_strides"):
                assert isinstance(value, tuple) and all(isinstance(s, int) for s in value), name


AOT_CASES = [  # recipe, cache dtype, n (D=128, 64-token pages, GQA 8)
    pytest.param("kv_int8_fp8", torch.bfloat16, 1, id="fp8-bf16-n1"),
    pytest.param("kv_int8_int8", torch.bfloat16, 1, id="int8-bf16-n1"),
    pytest.param("kv_int8_fp8", torch.float16, 4, id="fp8-fp16-n4"),
    pytest.param("kv_int8_int8", torch.float16, 4, id="int8-fp16-n4"),
    pytest.param("kv_int8_fp8", torch.float32, 1, id="fp8-fp32-n1"),
    pytest.param("kv_int8_int8", torch.float32, 4, id="int8-fp32-n4"),
    pytest.param("kv_int8_fp8", torch.float16, 64, id="fp8-fp16-n64"),  # 512 rows: 16 blocks
]


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89", "sm_120a", "sm_100a"])
@pytest.mark.parametrize("recipe, dtype, n", AOT_CASES)
def test_the_kernels_compile_without_spills(monkeypatch, recipe, dtype, n, arch):
    """Compiled ahead of time from a recorded launch, with the GPU's flags (not the
    interpreter's). Measured 2026-11-25 (Triton 3.6; rows ≤ 32, so mma.sync, not wgmma; with Q's
    balancing; the full pages pipelined over 5 stages): on sm_90a the split kernel takes 168
    registers with 16 rows (its cap: ``kernel_decode.split_launch``; 205 uncapped), 242-245 with
    32 rows (n=4), and with an fp32 cache (8 warps, the open page's product in TF32x3: P̃ is
    exact in TF32, V split in two, within 2^-22·|V| of fp32) 173 (n=1) to 255 (n=4); the merge
    kernel 40. As an IEEE fp32 product (an FMA loop) the open page spilled about 5 KB. sm_89:
    128-255 registers, sm_120a: 128-252, sm_100a: 168-255, no spills. A chunk of 64 queries
    (512 rows) runs in blocks of 32 rows; as one tile it could not fit (78 KB of spills at 2048
    rows)."""
    from lowbit_attn.tools import aot

    launches = record_launches(monkeypatch)
    monkeypatch.setattr(kernel_decode, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(kernel_decode, "exact_fp8", lambda: False)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 4, 128, max_tokens=256, page_size=64,
                                         recipe=recipe, dtype=dtype)
    kv = torch.randn(2, 4, 100, 128).to(dtype)
    cache.append(0, kv, kv)
    kernel_decode.attention(torch.randn(2, 32, n, 128).to(dtype), cache.layers[0], cache.recipe,
                            scale=128 ** -0.5, pages_per_split=1)
    for launch in launches:
        r = aot.compile_launch(launch, arch)
        assert r.error is None, r.error
        assert r.spill_stores == 0 and r.spill_loads == 0, (r.kernel, r.registers, r.spill_stores)


def compiled_split_kernel(monkeypatch, arch: str, head_dim: int, recipe: str = "kv_int8_fp8",
                          n: int = 1):
    """The split kernel's AOT report for ``n`` queries (GQA 8, fp16 cache, 64-token pages)."""
    from lowbit_attn.tools import aot

    launches = record_launches(monkeypatch)
    monkeypatch.setattr(kernel_decode, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(kernel_decode, "exact_fp8", lambda: False)
    cache = lowbit_attn.QuantizedKVCache(1, 2, 4, head_dim, max_tokens=1024, page_size=64,
                                         recipe=recipe, dtype=torch.float16)
    kv = torch.randn(2, 4, 700, head_dim).half()
    cache.append(0, kv, kv)
    kernel_decode.attention(torch.randn(2, 32, n, head_dim).half(), cache.layers[0], cache.recipe,
                            scale=head_dim ** -0.5)
    report = aot.compile_launch(launches[0], arch)
    assert report.error is None, report.error
    return report


@pytest.mark.aot
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_full_page_loop_keeps_pages_in_flight(monkeypatch, recipe):
    """What makes the memory-bound loop fast, read in its SASS (sm_90a, D = 128): every byte of a
    page's K and V arrives by ``cp.async`` (``LDGSTS``, K in 16-byte and V in 8-byte pieces: 8 KB
    each over 128 threads), none by a load the loop waits on (``LDG``), and the loop's wait
    (``DEPBAR.LE SB0, k``) leaves groups pending: the next pages are loading while this one is
    multiplied. Measured 2026-11-25: 16 LDGSTS per thread (4 for K, 8 for V, 4 for the page id
    and the scales) and ``DEPBAR.LE SB0, 0x5``; before the open page left the loop, V came by
    ``LDG`` in a branch, waited for on every page (this test failed there)."""
    from lowbit_attn.tools import sass

    report = compiled_split_kernel(monkeypatch, "sm_90a", 128, recipe)
    assert report.registers <= 168 and report.spill_stores == 0
    (body,) = sass.key_block_loops(sass.disassemble(report.cubin), mma="IMMA")
    ops = [line.split()[0] for line in body]
    assert not any(op.startswith("LDG.") for op in ops), "a synchronous global load in the loop"
    k_pieces = sum(op.startswith("LDGSTS.E.BYPASS.128") for op in ops)
    v_pieces = sum(op == "LDGSTS.E.64" for op in ops)
    assert k_pieces * 16 * 128 >= 64 * 128, k_pieces  # K: 64 slots × 128 channels, int8
    assert v_pieces * 8 * 128 >= 64 * 128, v_pieces
    waits = [line for line in body if line.startswith("DEPBAR.LE")]
    assert waits and all(int(w.split(",")[-1].strip().rstrip(";"), 16) > 0 for w in waits), waits


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("n", [1, 64])
def test_head_dim_256_compiles_without_spills(monkeypatch, n, recipe, arch):
    """D = 256 runs on 8 warps (4 spill 80 B, measured 2026-11-25, sm_90a): 236 registers for
    one query; a chunk of 64 (512 rows) in blocks of 16 (blocks of 64 spilled 96 B). Both
    recipes, sm_90a and sm_89 (issue 44 item 6; NOTES.md)."""
    report = compiled_split_kernel(monkeypatch, arch, 256, recipe, n=n)
    assert report.num_warps == 8 and report.spill_stores == 0 and report.spill_loads == 0

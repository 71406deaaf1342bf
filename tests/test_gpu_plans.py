"""Launch plans on a CUDA GPU (skipped without one): every eager call with plans on (the default)
gives the bits of the same call with ``LOWBIT_ATTN_LAUNCH=triton``, through a key's normal
calls, its capture, its first-use check and its replays; nothing turns plans off.

What the CPU cannot show (``tests/test_launch_plans.py``, ``tests/inference/test_plans.py`` and
``tests/kvcache/test_planned.py`` run the plans against stand-in launches): the compiled
kernels' own launchers, Triton's scratch allocator under the Gluon forwards' TMA descriptors,
CUDA graph capture, streams, ``torch.jit.trace`` on CUDA tensors, and threads.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import lowbit_attn
from helpers import assert_bits
from lowbit_attn.core import plans
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import planned

pytestmark = pytest.mark.gpu

CALLS = 4  # seen, captured, checked (a kernel signature's first plan), replayed


@pytest.fixture(autouse=True)
def nan_poisoned_allocations():
    """Allocations are not NaN-filled here (``conftest.py``'s fixture, overridden): its ``fill_``
    after each ``torch.empty`` is a PyTorch operation inside the call, and a call that runs one gets
    no plan, so every test below would see none. The plans' first-use check poisons its own
    copies."""
    yield


@pytest.fixture(autouse=True)
def plans_on(monkeypatch):
    """Every test starts with plans asked for (``LOWBIT_ATTN_LAUNCH=plan``: not the default), no
    plans, plans not turned off, and fails on a warning that they were turned off."""
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "plan")
    planned.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*launch plans are off.*")
        yield
    assert not plans._off, plans._off


def _both(monkeypatch, call):
    """``call()`` with ``LOWBIT_ATTN_LAUNCH=triton``, then with plans (each synchronized)."""
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "triton")
    want = call()
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "plan")
    got = call()
    torch.cuda.synchronize()
    as_tuple = (lambda x: x if isinstance(x, tuple) else (x,))
    return as_tuple(got), as_tuple(want)


def _like_triton(monkeypatch, call, calls: int = CALLS) -> None:
    for i in range(calls):
        got, want = _both(monkeypatch, call)
        for j, (a, b) in enumerate(zip(got, want)):
            assert_bits(a, b, f"call {i + 1}, output {j}")


def _qkv(b=2, h=4, n=300, d=128, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g)
                 for _ in range(3))


def _state(q, k, v, **kw):
    key = planned.key(q, k, v, kw.get("is_causal", False), None, kw.get("layout", "HND"),
                      kw.get("recipe", "auto"), kw.get("return_lse", False))
    return planned.state(key)


# what the one-warpgroup Hopper forward takes (128-key blocks, per-thread scales)
SM90_RECIPE = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_k=128)
FAMILIES = [
    pytest.param("qk_int8_pv_fp8", "triton", id="int8-fp8"),
    pytest.param("qk_int8_pv_fp16", "triton", id="int8-fp16"),
    pytest.param("qk_fp4_pv_fp4", "triton", id="nvfp4"),
    pytest.param("qk_mxfp4_pv_mxfp4", "triton", id="mxfp4"),
    pytest.param(SM90_RECIPE, "sm90", id="int8-sm90"),
    pytest.param("qk_fp4_pv_fp4", "gluon", id="nvfp4-gluon"),
]


@pytest.mark.parametrize("recipe,kernel", FAMILIES)
@pytest.mark.parametrize("causal,lse", [(False, False), (True, True)], ids=["full", "causal-lse"])
def test_each_family_replays_the_bits_of_triton_s_path(monkeypatch, recipe, kernel, causal, lse):
    """Issue 37: the dense families, the Gluon forwards too where they apply (their TMA
    descriptors take Triton's scratch allocator at every launch, replays included). FP4 calls
    get no plan (their quantization zeroes a buffer): Triton's path every time."""
    from lowbit_attn.inference import gluon_check, gluon_fp4_check

    device = torch.device("cuda")
    fp4 = "fp4" in getattr(recipe, "name", recipe)
    applies = gluon_fp4_check.applies if fp4 else gluon_check.applies
    if kernel != "triton" and not applies(device):
        pytest.skip(f"LOWBIT_ATTN_KERNEL={kernel} runs the Triton kernel on this GPU")
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", kernel)
    q, k, v = _qkv()
    kw = dict(recipe=recipe, is_causal=causal, return_lse=lse)
    if kernel != "triton":  # the first call starts the admission check: no kernel switch below
        lowbit_attn.attention(q, k, v, **kw)
        gluon_check.wait_for_admission()
    _like_triton(monkeypatch, lambda: lowbit_attn.attention(q, k, v, **kw))
    state = _state(q, k, v, **kw)
    if fp4:
        assert "PyTorch operations" in str(state), state
    else:
        assert isinstance(state, plans.Plan), state


@pytest.mark.parametrize("shared", ["fused", "v-with-q-then-k", "v-with-k-then-q"])
def test_inputs_sharing_storage_replay_the_bits_of_triton_s_path(monkeypatch, shared):
    """Issue 37 (3): q, k, v views of one fused projection; v in the same storage as q, then as
    k at the same distance (each its own key, the second's plan not the first's), or the other
    way round."""
    b, h, n, d = 2, 4, 256, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, b, h, n, d, device="cuda", dtype=torch.float16, generator=g)
    other = torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g)
    if shared == "fused":
        q, k, v = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.float16,
                              generator=g).unbind(2)
        _like_triton(monkeypatch, lambda: lowbit_attn.attention(q, k, v, layout="NHD"))
        return
    first, v = x.unbind(0)
    orders = [(first, other), (other, first)]  # v with q's storage, v with k's
    for q, k in orders if shared == "v-with-q-then-k" else orders[::-1]:
        _like_triton(monkeypatch, lambda: lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8"))
        assert isinstance(_state(q, k, v, recipe="qk_int8_pv_fp8"), plans.Plan)


@pytest.mark.parametrize("eager_calls", [1, CALLS])
def test_capture_after_warm_up_gives_the_bits_of_triton_s_path(monkeypatch, eager_calls):
    """Issue 37 (2): one eager call (or enough for a plan), then a CUDA graph capture of the same
    call: no plan, no check inside the capture; the replayed graph gives the eager bits."""
    q, k, v = _qkv()
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "triton")
    want = lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "plan")
    for _ in range(eager_calls):
        lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_bits(out, want, "graph replay")


def test_a_second_stream_gets_the_bits_of_triton_s_path(monkeypatch):
    """Issue 37 (7): plans captured on the default stream, then calls on a second stream (the
    replays launch on the current stream, as Triton's path)."""
    q, k, v = _qkv()
    call = lambda: lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")  # noqa: E731
    _like_triton(monkeypatch, call)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _like_triton(monkeypatch, call)
        got = call()
    torch.cuda.current_stream().wait_stream(side)
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "triton")
    assert_bits(got, call(), "second stream")


def test_jit_trace_gives_the_bits_of_triton_s_path(monkeypatch):
    """Issue 37 (5): a function traced after plans were taken holds the custom op, and gives
    on new inputs what the eager call gives."""
    q, k, v = _qkv()

    def f(q, k, v):
        return lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")

    _like_triton(monkeypatch, lambda: f(q, k, v))
    traced = torch.jit.trace(f, (q, k, v), check_trace=False)
    assert "lowbit_attn::attention_fwd" in str(traced.graph)
    q2, k2, v2 = _qkv(seed=5)
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "triton")
    assert_bits(traced(q2, k2, v2), f(q2, k2, v2), "traced")


def _decode(cache, steps: int, seed: int, layer: int = 0) -> list[torch.Tensor]:
    """``steps`` decode steps on ``layer``: a one-token append, then a read; the reads."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, hkv, d = cache.batch, cache.kv_heads, cache.head_dim
    reads = []
    for _ in range(steps):
        k, v = (torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.float16, generator=g)
                for _ in range(2))
        q = torch.randn(b, hkv * 4, 1, d, device="cuda", dtype=torch.float16, generator=g)
        cache.append(layer, k, v)
        reads.append(lowbit_attn.attention_with_kv_cache(q, cache, layer))
    return reads


def _cache(layers: int = 1):
    cache = lowbit_attn.QuantizedKVCache(layers, 2, 2, 128, max_tokens=600, page_size=16,
                                         device="cuda")
    g = torch.Generator(device="cuda").manual_seed(9)
    for layer in range(layers):
        prompt = torch.randn(2, 2, 500, 128, device="cuda", dtype=torch.float16, generator=g)
        cache.append(layer, prompt, prompt)
    return cache


def _same_caches(got, want) -> None:
    for layer in range(got.num_layers):
        for b in range(got.batch):
            for name, x, y in zip(("k", "k_scale", "v", "v_scale", "v_open"),
                                  got.sequence(layer, b), want.sequence(layer, b)):
                assert_bits(x.float(), y.float(), f"layer {layer} sequence {b} {name}")


def test_kv_cache_appends_and_reads_give_the_bits_of_triton_s_path(monkeypatch):
    """Issue 37: 20 decode steps past a page boundary and into a second split, with plans and
    with Triton's path: the same reads, the same stored tokens."""
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "triton")
    want_cache = _cache()
    want = _decode(want_cache, 20, seed=3)
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "plan")
    got_cache = _cache()
    got = _decode(got_cache, 20, seed=3)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bits(a, b, f"read {i}")
    _same_caches(got_cache, want_cache)


def test_two_threads_appending_to_a_kv_cache_give_the_bits_of_triton_s_path(monkeypatch):
    """Issue 37 (6): two threads decode one layer each of one cache at the same time, with
    plans; the stored tokens and reads are those of the same steps run one after the other
    with Triton's path."""
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "triton")
    want_cache = _cache(layers=2)
    want = [_decode(want_cache, 12, seed=layer, layer=layer) for layer in range(2)]
    monkeypatch.setenv("LOWBIT_ATTN_LAUNCH", "plan")
    got_cache = _cache(layers=2)
    got: list = [None, None]
    errors: list = []

    def decode(layer):
        try:
            got[layer] = _decode(got_cache, 12, seed=layer, layer=layer)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=decode, args=(layer,)) for layer in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    for layer in range(2):
        for i, (a, b) in enumerate(zip(got[layer], want[layer])):
            assert_bits(a, b, f"layer {layer} read {i}")
    _same_caches(got_cache, want_cache)

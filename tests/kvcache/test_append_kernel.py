"""The append kernel (``kvcache/kernel_append.py``) against its twin, the cache's ``_write`` loop:
the same sequence of appends given to two caches, one on each backend, must leave every stored
byte the same (K, its scales, V of full pages and their scales, the open pages' stored slots, μ,
the balancing statistics, the block tables, the lengths and the free lists). Pages' unused slots
and a full page's ``v_open`` slots are never read (``torch.empty``), so they are not compared.

Covered: prompts of 1, page−1, page, page+1 and 3·page+5 tokens followed by decode steps across
page boundaries, chunked prefill (appends of 5 crossing pages), left and right padding and an
empty sequence through ``valid``, both recipes, fp16/bf16/fp32 caches, with and without the
prompt's queries, head dims 64 and 128, one and two KV heads, non-contiguous inputs, NaN in a
stored and in a padding token; and the compiled kernel's registers for sm_90a.
"""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import record_launches as recorded
from lowbit_attn.kvcache import kernel_append

PAGE = 16
RECIPES = ("kv_int8_fp8", "kv_int8_int8")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("reference", "triton")


def new_caches(device, *, batch, kv_heads, head_dim, recipe, dtype, max_tokens=4 * PAGE + 8):
    return {backend: lowbit_attn.QuantizedKVCache(1, batch, kv_heads, head_dim,
                                                  max_tokens=max_tokens, page_size=PAGE,
                                                  recipe=recipe, dtype=dtype, device=device)
            for backend in BACKENDS}


def tokens(batch, kv_heads, n, head_dim, dtype, device, g, *, q_heads=None):
    """``(k, v, q)`` ``[B, H, n, D]``: K with a per-channel bias (μ matters) and an outlier
    channel, Q (``q_heads`` heads, or None) with another (the balancing factors are not 1)."""
    k = torch.randn(batch, kv_heads, n, head_dim, generator=g) + 2.0 * torch.randn(
        batch, kv_heads, 1, head_dim, generator=g)
    k[..., 1] *= 8.0
    v = torch.randn(batch, kv_heads, n, head_dim, generator=g)
    v[..., 2] *= 30.0
    q = None
    if q_heads is not None:
        q = torch.randn(batch, q_heads, n, head_dim, generator=g)
        q[..., 0] *= 8.0
        q = q.to(device, dtype)
    return k.to(device, dtype), v.to(device, dtype), q


def append_both(monkeypatch, caches, k, v, *, valid=None, q=None):
    for backend, cache in caches.items():
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
        cache.append(0, k, v, valid=valid, q=q)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)  # fp8 and NaN compared by their bits


def assert_same_bytes(caches, what: str = ""):
    ref, ker = (caches[backend].layers[0] for backend in BACKENDS)
    assert ref.host_lengths == ker.host_lengths == ref.lengths.tolist(), what
    assert torch.equal(ref.lengths, ker.lengths), what
    assert torch.equal(ref.block_table, ker.block_table), what
    assert ref.free.snapshot() == ker.free.snapshot(), what
    for name in ("q_amax", "k_amax"):
        assert torch.equal(as_bytes(getattr(ref, name)), as_bytes(getattr(ker, name))), \
            f"{what}: {name}"
    for b, length in enumerate(ref.host_lengths):
        if length == 0:  # nothing stored; μ unset
            continue
        seq_ref = caches["reference"].sequence(0, b)
        seq_ker = caches["triton"].sequence(0, b)
        for name in seq_ref._fields:  # k, k_scale, v, v_scale, v_open (stored slots), μ, pages
            a, c = getattr(seq_ref, name), getattr(seq_ker, name)
            assert a.shape == c.shape and torch.equal(as_bytes(a), as_bytes(c)), \
                f"{what}: sequence {b}'s {name} differs"


PROMPTS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5]


@pytest.mark.parametrize("with_q", [False, True], ids=["", "q"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda n: f"prompt{n}")
def test_a_prompt_then_decode_steps_store_the_twins_bytes(device, monkeypatch, prompt, recipe,
                                                        dtype, with_q):
    """A prompt, then one token at a time past the next page boundary (and the one after)."""
    g = torch.Generator().manual_seed(prompt)
    caches = new_caches(device.name, batch=2, kv_heads=2, head_dim=64, recipe=recipe,
                        dtype=dtype)
    k, v, q = tokens(2, 2, prompt, 64, dtype, device.name, g, q_heads=4 if with_q else None)
    append_both(monkeypatch, caches, k, v, q=q)
    assert_same_bytes(caches, "prompt")
    steps = PAGE - prompt % PAGE + 2 if prompt < 3 * PAGE else PAGE - prompt % PAGE + 1
    for step in range(steps):
        k, v, q = tokens(2, 2, 1, 64, dtype, device.name, g, q_heads=4 if with_q else None)
        append_both(monkeypatch, caches, k, v, q=q)  # later appends' queries are not read
        assert_same_bytes(caches, f"decode step {step}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_chunked_prefill_stores_the_twins_bytes(device, monkeypatch, recipe, dtype):
    """Appends of 5 tokens (one KV head, D = 128), 3 of the 9 crossing a page boundary."""
    g = torch.Generator().manual_seed(7)
    caches = new_caches(device.name, batch=2, kv_heads=1, head_dim=128, recipe=recipe,
                        dtype=dtype)
    for chunk in range(9):
        k, v, q = tokens(2, 1, 5, 128, dtype, device.name, g, q_heads=2)
        append_both(monkeypatch, caches, k, v, q=q if chunk == 0 else None)
        assert_same_bytes(caches, f"chunk {chunk}")


@pytest.mark.parametrize("with_q", [False, True], ids=["", "q"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_padded_batches_store_the_twins_bytes(device, monkeypatch, recipe, dtype, with_q):
    """A batch of four through ``valid``: left-padded (13 of 20), right-padded (17 of 20), empty,
    and with holes (every third token); then steps where the empty one stays empty, then gets
    its first token (its statistics frozen from it), while the others cross pages."""
    g = torch.Generator().manual_seed(11)
    caches = new_caches(device.name, batch=4, kv_heads=2, head_dim=64, recipe=recipe,
                        dtype=dtype)
    n = 20
    pos = torch.arange(n)
    valid = torch.stack([pos >= n - 13, pos < 17, torch.zeros(n, dtype=torch.bool),
                         pos % 3 == 0]).to(device.name)
    k, v, q = tokens(4, 2, n, 64, dtype, device.name, g, q_heads=4 if with_q else None)
    append_both(monkeypatch, caches, k, v, valid=valid, q=q)
    assert_same_bytes(caches, "padded prompt")
    steps = [[True, True, False, True]] * 3 + [[True, True, True, True]] * 2 + \
        [[False, True, True, False]] * 2
    for step, mask in enumerate(steps):
        k, v, q = tokens(4, 2, 1, 64, dtype, device.name, g, q_heads=4 if with_q else None)
        step_valid = torch.tensor(mask, device=device.name)[:, None]
        append_both(monkeypatch, caches, k, v, valid=step_valid, q=q)
        assert_same_bytes(caches, f"step {step}")
    k, v, q = tokens(4, 2, 12, 64, dtype, device.name, g)  # a right-padded chunk of unequal counts
    valid = torch.arange(12)[None, :] < torch.tensor([12, 3, 0, 7])[:, None]
    append_both(monkeypatch, caches, k, v, valid=valid.to(device.name))
    assert_same_bytes(caches, "padded chunk")


def test_any_strides_give_the_same_bytes(device, monkeypatch):
    """K and V as views of a ``[B, n, H, D]`` tensor (token-major, as a projection gives them)."""
    g = torch.Generator().manual_seed(5)
    caches = new_caches(device.name, batch=2, kv_heads=2, head_dim=64, recipe="kv_int8_fp8",
                        dtype=torch.float16)
    for n in (21, 1, 13):
        kv = torch.randn(2, n, 2, 2, 64, generator=g).to(device.name, torch.float16)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        assert not k.is_contiguous()
        append_both(monkeypatch, caches, k, v)
        assert_same_bytes(caches, f"n={n}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_nan_in_a_stored_token_gives_a_nan_scale(device, monkeypatch, recipe):
    g = torch.Generator().manual_seed(9)
    caches = new_caches(device.name, batch=2, kv_heads=2, head_dim=64, recipe=recipe,
                        dtype=torch.float16)
    k, v, _ = tokens(2, 2, 10, 64, torch.float16, device.name, g)
    append_both(monkeypatch, caches, k, v)
    k, v, _ = tokens(2, 2, 8, 64, torch.float16, device.name, g)
    k[0, 1, 3, 5] = float("nan")  # token 13 of sequence 0, head 1
    append_both(monkeypatch, caches, k, v)
    assert_same_bytes(caches, "NaN")
    seq = caches["triton"].sequence(0, 0)
    nan = torch.isnan(seq.k_scale)
    assert nan[1, 13] and nan.sum() == 1
    assert torch.all(seq.k[1, 13] == 0)  # its values are 0: the scale carries the NaN


@pytest.mark.parametrize("recipe", RECIPES)
def test_nan_in_a_padding_token_changes_nothing(device, monkeypatch, recipe):
    """Sequence 1's last two tokens are padding: NaN there (K and V) stores the same bytes as
    finite padding, across the page boundary at 16."""
    g = torch.Generator().manual_seed(9)
    caches = {name: new_caches(device.name, batch=2, kv_heads=2, head_dim=64, recipe=recipe,
                               dtype=torch.float16)["triton"] for name in ("reference", "triton")}
    k, v, _ = tokens(2, 2, 10, 64, torch.float16, device.name, g)
    append_both(monkeypatch, caches, k, v)
    k, v, _ = tokens(2, 2, 8, 64, torch.float16, device.name, g)
    valid = (torch.arange(8)[None, :] < torch.tensor([8, 6])[:, None]).to(device.name)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[1, 0, 7, 0] = poisoned_v[1, 1, 6, 3] = float("nan")
    for name, (kk, vv) in zip(BACKENDS, ((k, v), (poisoned_k, poisoned_v))):
        monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")  # both caches on the kernel path
        caches[name].append(0, kk, vv, valid=valid)
    assert_same_bytes(caches, "NaN in padding")
    for b in range(2):
        seq = caches["triton"].sequence(0, b)
        assert torch.isfinite(seq.k_scale).all() and torch.isfinite(seq.v_scale).all()


def record_launches(monkeypatch) -> list:
    """The append kernel replaced by a recorder (``helpers.record_launches``)."""
    return recorded(monkeypatch, kernel_append, ("_append_kernel",))


@pytest.mark.parametrize("backend, launched", [("triton", 1), ("reference", 0)])
def test_an_append_is_one_launch_on_the_triton_backend_and_none_elsewhere(monkeypatch, backend,
                                                                          launched):
    """One launch per append, by keyword (the rules of tests/tools/test_launch_arguments.py),
    one program per (sequence, KV head)."""
    launches = record_launches(monkeypatch)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", backend)
    cache = lowbit_attn.QuantizedKVCache(1, 3, 2, 64, max_tokens=64, page_size=PAGE)
    k, v, _ = tokens(3, 2, 40, 64, torch.float16, "cpu", torch.Generator().manual_seed(0))
    cache.append(0, k, v)
    assert len(launches) == launched
    for launch in launches:
        assert launch.grid == (3, 2)
        assert launch.args == () and len(launch.kwargs) <= 42
        for name, value in launch.kwargs.items():
            if name.endswith("_strides"):
                assert isinstance(value, tuple) and all(isinstance(s, int) for s in value), name


AOT_CASES = [  # recipe, cache dtype (D=128, 64-token pages)
    pytest.param("kv_int8_fp8", torch.float16, id="fp8-fp16"),
    pytest.param("kv_int8_fp8", torch.bfloat16, id="fp8-bf16"),
    pytest.param("kv_int8_int8", torch.float16, id="int8-fp16"),
    pytest.param("kv_int8_int8", torch.bfloat16, id="int8-bf16"),
]


@pytest.mark.aot
@pytest.mark.parametrize("padded", [True, False], ids=["valid", "all"])
@pytest.mark.parametrize("recipe, dtype", AOT_CASES)
def test_the_append_kernel_compiles_for_sm_90a_without_spills(monkeypatch, recipe, dtype, padded):
    """Compiled ahead of time from a recorded launch, with the GPU's flags (not the
    interpreter's), with ``valid`` (index tensors) and without (every token, no index tensors).
    Measured 2026-11-25 (Triton 3.6, 4 warps, D = 128, 64-token pages): 218 registers for each
    recipe with fp16 and bf16 caches, no spills (177 with 8 warps)."""
    from lowbit_attn.tools import aot

    launches = record_launches(monkeypatch)
    monkeypatch.setattr(kernel_append, "exact_fp8", lambda: False)
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")
    cache = lowbit_attn.QuantizedKVCache(1, 2, 4, 128, max_tokens=256, page_size=64,
                                         recipe=recipe, dtype=dtype)
    kv = torch.randn(2, 4, 100, 128).to(dtype)
    cache.append(0, kv, kv, valid=torch.ones(2, 100, dtype=torch.bool) if padded else None)
    (launch,) = launches
    assert (launch.kwargs["SRC"] is None) == (not padded)
    r = aot.compile_launch(launch, "sm_90a")
    assert r.error is None, r.error
    assert r.spill_stores == 0 and r.spill_loads == 0, (r.kernel, r.registers, r.spill_stores)

"""Launch plans of the decode path (``kvcache/planned.py``): an eager read
(``attention_with_kv_cache``) or one-token append replayed from its plan launches the same kernels
with the same grids and arguments as Triton's own path, pointers aside (the same inputs and cache
tensors, the outputs at the same places, intermediates at distinct workspace buffers); the
host's state after a run of decode steps (lengths, pages, block table, free list) is the same
with plans and without; what the host checks of the lengths is checked on every replayed call.

As in ``tests/inference/test_plans.py``, each check runs in a child process without
``TRITON_INTERPRET``, under the stand-in driver of ``tools/bench/host.py`` (nothing is written to
the cache there: only launches and host state are compared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers.py
CHILD = r'''
import json, os, sys
import torch
import lowbit_attn
from lowbit_attn.core import plans
from lowbit_attn.kvcache import planned
from lowbit_attn.tools.bench.host import stubbed_launches
sys.path.insert(0, os.environ["LOWBIT_ATTN_TESTS"])
from helpers import check_replayed_args

def host_state(cache):
    store = cache.layers[0]
    return {"lengths": store.host_lengths, "pages": store.host_pages,
            "table": store.block_table.tolist(), "free": list(store.free.snapshot())}

def steps(case, mode, sink):
    """A prompt, then case["steps"] decode steps (append one token, read), with plans (mode
    "plan") or without ("triton"). Returns the launches of each call, and what was checked."""
    os.environ["LOWBIT_ATTN_LAUNCH"] = mode
    torch.manual_seed(0)
    b, hkv, group, d, page, prompt, n_steps = (case[x] for x in
        ("batch", "kv_heads", "group", "head_dim", "page", "prompt", "steps"))
    dtype = getattr(torch, case.get("dtype", "float16"))
    cache = lowbit_attn.QuantizedKVCache(1, b, hkv, d, max_tokens=prompt + n_steps,
                                         page_size=page, dtype=dtype)
    k = torch.randn(b, hkv, prompt, d, dtype=dtype)
    cache.append(0, k, k)
    q = torch.randn(b, hkv * group, 1, d, dtype=dtype)
    kn, vn = (torch.randn(b, hkv, 1, d, dtype=dtype) for _ in range(2))
    lse = case.get("lse", False)
    store = cache.layers[0]
    calls, normal, replays = [], {}, {"append": 0, "read": 0}
    for _ in range(n_steps):
        for what, key_now, call, inputs in (
            ("append", lambda: planned.append_key(cache, 0, kn, vn, None, None),
             lambda: cache.append(0, kn, vn), (kn, vn, *store.launch_inputs)),
            ("read", lambda: planned.read_key(q, cache, 0, None, lse),
             lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0, return_lse=lse),
             (q, *store.launch_inputs)),
        ):
            key = key_now()  # after the step's append: a read's splits follow the lengths
            replayed = isinstance(cache.plans.state(key), plans.Plan)
            checking = isinstance(cache.plans.state(key), plans.Unchecked)
            sink.clear()
            out = call()
            out = () if out is None else out if isinstance(out, tuple) else (out,)
            # a first-use check's replay (on copies, every tensor an address) is not the call's
            launches = [(s, a) for s, a in sink if not checking or any(
                isinstance(y, torch.Tensor) for x in a[9:]
                for y in (x if isinstance(x, tuple) else (x,)))]
            calls.append([(s.name, a[:3]) for s, a in launches])
            if not replayed:
                normal[key] = (launches, out)
                continue
            replays[what] += 1
            ref, out2 = normal[key]
            assert [s for s, _ in ref] == [s for s, _ in launches], "kernels"
            slots = {}
            for (_, a), (_, r) in zip(ref, launches):
                check_replayed_args(a, r, inputs, out2, out, slots)
            spans = sorted(slots.values())
            for (lo, size), (hi, _) in zip(spans, spans[1:]):
                assert lo + size <= hi, "workspace buffers overlap"
    past = None
    try:  # one token past max_tokens: refused, with nothing taken, plan or not
        before = host_state(cache)
        cache.append(0, kn, vn)
    except ValueError as exc:
        past = str(exc)
        assert host_state(cache) == before
    cache.reset()  # a first append again (statistics frozen): the normal way
    cache.append(0, kn, vn)
    state = host_state(cache)
    off = None
    if mode == "plan":  # plans turned off (a failed first-use check): appends go Triton's way
        plans._off.append("turned off by the test")
        try:
            sink.clear()
            cache.append(0, kn, vn)
            off = [type(sink[0][1][9]).__name__, store.host_lengths]
        finally:
            plans._off.clear()
    lowbit_attn.attention_with_kv_cache(q, cache, 0, return_lse=lse)
    return {"calls": calls, "state": state, "replays": replays, "past": past, "off": off}

class OffAfterTheFirstLook(list):
    """``plans._off`` as another thread turns plans off just after this thread's first look."""

    looks = 0

    def __bool__(self):
        self.looks += 1
        return self.looks > 1


def lost_append(sink):
    """An append whose key has a plan, while another thread turns plans off: it launches (the
    plan's way or Triton's) and the host's lengths say what it did."""
    os.environ["LOWBIT_ATTN_LAUNCH"] = "plan"
    cache = lowbit_attn.QuantizedKVCache(1, 2, 1, 64, max_tokens=64, page_size=16)
    k = torch.randn(2, 1, 1, 64, dtype=torch.float16)
    cache.append(0, k.expand(2, 1, 8, 64), k.expand(2, 1, 8, 64))
    for _ in range(5):
        cache.append(0, k, k)
    key = planned.append_key(cache, 0, k, k, None, None)
    store = cache.layers[0]
    had_plan = isinstance(cache.plans.state(key), plans.Plan)
    before = list(store.host_lengths)
    plans._off = OffAfterTheFirstLook()
    try:
        sink.clear()
        cache.append(0, k, k)
    finally:
        plans._off = []
    return {"had_plan": had_plan, "launches": len(sink),
            "advanced": [a - b for a, b in zip(store.host_lengths, before)]}


def run(case):
    with stubbed_launches((9, 0)) as sink:
        if case == "lost_append":
            return lost_append(sink)
        runs = {mode: steps(case, mode, sink) for mode in ("plan", "triton")}
    plan, triton = runs["plan"], runs["triton"]
    return {"same_launches": plan["calls"] == triton["calls"], "off": plan["off"],
            "same_state": plan["state"] == triton["state"],
            "replays": plan["replays"], "replays_off": triton["replays"],
            "past": plan["past"], "past_off": triton["past"]}

print(json.dumps([run(c) for c in json.loads(sys.argv[1])]))
'''


def _child(cases: list) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOWBIT_ATTN_ARCH="sm_90", LOWBIT_ATTN_TESTS=TESTS,
               LOWBIT_ATTN_LAUNCH="plan")  # plans are opt-in
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# 500 tokens then 40 steps of 16-token pages: pages taken at 512, 528; splits (512 keys each)
# go from 1 to 2 at 513, a new read key
CASES = [
    dict(batch=2, kv_heads=2, group=4, head_dim=64, page=16, prompt=500, steps=40),
    dict(batch=3, kv_heads=1, group=8, head_dim=128, page=16, prompt=500, steps=40, lse=True,
         dtype="bfloat16"),
]


@pytest.mark.slow
def test_replays_launch_what_triton_would_and_keep_the_host_state():
    """Every replayed append and read matches the last normal call of its key launch by launch;
    the kernels and grids of every call are the same as with plans off; an append past
    ``max_tokens`` is refused either way; once plans are turned off, an append whose key has a
    plan goes Triton's way."""
    for case, row in zip(CASES, _child(CASES)):
        assert row["same_launches"] and row["same_state"], (case, row)
        # two normal calls per key (the append's one key, the reads' two: 1 split, then 2), and
        # the first-use check of each kernel signature (Triton compiles the reads' merge apart
        # for one split: an int argument equal to 1 is specialized)
        assert row["replays"] == {"append": case["steps"] - 3, "read": case["steps"] - 6}, row
        assert row["replays_off"] == {"append": 0, "read": 0}, row
        assert "max_tokens" in row["past"] and row["past"] == row["past_off"], row
        # with plans off, a key that has one takes Triton's path (tensors, not addresses)
        assert row["off"] == ["Tensor", [2] * case["batch"]], row


@pytest.mark.slow
def test_an_append_is_not_lost_when_plans_turn_off_meanwhile():
    """Issue 37 (6): plans turned off by another thread between an append's look at its plan and
    the replay: the append still launches once, and the host's lengths advance by its token."""
    [row] = _child(["lost_append"])
    assert row["had_plan"], row
    assert row["launches"] == 1 and row["advanced"] == [1, 1], row


def test_no_key_outside_eager_use():
    """A read or append gets no key for a layer of another kind or out of range, a tensor
    subclass, a ``valid`` mask or queries (those appends take the normal way), a non-bool
    ``return_lse``, or a cache whose host mirror is stale."""
    import torch

    import lowbit_attn
    from lowbit_attn.kvcache import planned

    cache = lowbit_attn.QuantizedKVCache(2, 1, 1, 16, max_tokens=32, page_size=16)
    x = torch.randn(1, 1, 1, 16, dtype=torch.float16)
    cache.append(0, x, x)
    assert planned.read_key(x, cache, 0, None, False) is not None
    assert planned.append_key(cache, 0, x, x, None, None) is not None
    assert planned.read_key(x, cache, 0, None, False) != planned.read_key(x, cache, 1, None, False)
    for layer in (2, -1, True, 0.0):
        assert planned.read_key(x, cache, layer, None, False) is None
        assert planned.append_key(cache, layer, x, x, None, None) is None
    assert planned.read_key(torch.nn.Parameter(x), cache, 0, None, False) is None
    assert planned.read_key(x, cache, 0, None, 1) is None
    assert planned.read_key(x, cache, 0, 1, False) is None
    assert planned.append_key(cache, 0, x, x, torch.ones(1, 1, dtype=torch.bool), None) is None
    assert planned.append_key(cache, 0, x, x, None, x) is None
    cache.layers[0].host_stale = True
    assert planned.read_key(x, cache, 0, None, False) is None
    assert planned.append_key(cache, 0, x, x, None, None) is None


@pytest.mark.slow
def test_bench_decode_host_prints_the_host_times():
    """``bench_decode.py --host`` on a CPU-only machine: ``decode_host_us=`` and
    ``append_host_us=``, two launches per read and one per append (values: NOTES §13)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(TESTS), "benchmarks", "bench_decode.py")
    done = subprocess.run([sys.executable, script, "--host", "--seqlens", "1k", "--batches", "2"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decode_host_us=" in done.stdout and "append_host_us=" in done.stdout, done.stdout
    assert "decode_launches=2 append_launches=1" in done.stdout, done.stdout


BENCH_CHILD = r'''
import importlib.util, json, os, sys
import torch
import lowbit_attn
from lowbit_attn.core import plans
from lowbit_attn.tools.bench.calls import environment
from lowbit_attn.tools.bench.host import stubbed_launches

spec = importlib.util.spec_from_file_location("bench_decode", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
seen = {}
with stubbed_launches((9, 0)):
    for mode in ("triton", "plan"):
        cache = lowbit_attn.QuantizedKVCache(1, 2, 2, 64, max_tokens=300, page_size=16)
        k = torch.randn(2, 2, 200, 64, dtype=torch.float16)
        cache.append(0, k, k)
        q = torch.randn(2, 8, 1, 64, dtype=torch.float16)
        with environment(LOWBIT_ATTN_LAUNCH=mode):
            bench.planned_calls(lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0))
            seen[mode] = bench.replays(cache, q)
            plans._off.append("turned off by the test")
            seen["off"] = bench.replays(cache, q)
            plans._off.clear()
print(json.dumps(seen))
'''


@pytest.mark.slow
def test_bench_decode_times_plan_rows_on_replays_only():
    """``bench_decode.py``'s ``… plan`` rows: after :func:`planned_calls` (the key's normal call,
    its capture, its check) a read replays its plan under ``LOWBIT_ATTN_LAUNCH=plan``, and
    :func:`replays` says so; it says not with plans off (``triton``) or turned off by a check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOWBIT_ATTN_ARCH="sm_90")
    script = os.path.join(os.path.dirname(TESTS), "benchmarks", "bench_decode.py")
    done = subprocess.run([sys.executable, "-c", BENCH_CHILD, script], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"triton": False, "plan": True, "off": False}, seen

"""Launch plans (``core/plans.py``, ``inference/planned.py``): a replayed call launches the same
kernels with the same grids and arguments as Triton's own path, pointers aside, which point at the
same inputs and outputs and at distinct buffers of one workspace; calls a replay would get wrong
get no plan; ``bench --host`` measures the path.

Triton's launch path needs compiled (not interpreted) kernels, so each check runs in a child
process without ``TRITON_INTERPRET``, under the stand-in driver of ``tools/bench/host.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import needs_gluon, script_module

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers.py
CHILD = r'''
import json, os, sys
import torch
import lowbit_attn
from lowbit_attn.core import plans
from lowbit_attn.inference import planned
from lowbit_attn.tools.bench.host import stubbed_launches
sys.path.insert(0, os.environ["LOWBIT_ATTN_TESTS"])
from helpers import check_replayed_args as check_args

def run(case):
    torch.manual_seed(0)
    b, hq, hkv, n, d = case["shape"]
    dtype = getattr(torch, case.get("dtype", "float16"))
    shape = lambda h: (b, n, h, d) if case.get("layout") == "NHD" else (b, h, n, d)
    if case.get("fused"):  # q, k, v views of one [B, N, 3, H, D] projection
        q, k, v = torch.randn(b, n, 3, hq, d, dtype=dtype).unbind(2)
    else:
        q = torch.randn(shape(hq), dtype=dtype)
        k, v = (torch.randn(shape(hkv), dtype=dtype) for _ in range(2))
    recipe = case["recipe"]
    if case.get("smooth_q"):
        import dataclasses
        from lowbit_attn.core.recipes import RECIPES
        recipe = dataclasses.replace(RECIPES[recipe], smooth_q=True)
    kw = dict(recipe=recipe, is_causal=case.get("causal", False),
              layout=case.get("layout", "HND"), return_lse=case.get("lse", False))
    key = planned.key(q, k, v, kw["is_causal"], None, kw["layout"], kw["recipe"], kw["return_lse"])
    with stubbed_launches((9, 0)) as sink:
        lowbit_attn.attention(q, k, v, **kw)
        sink.clear()
        out2 = lowbit_attn.attention(q, k, v, **kw)  # captured
        normal = list(sink)
        if isinstance(planned.state(key), plans.Unchecked):
            lowbit_attn.attention(q, k, v, **kw)  # its kernels' first-use check
        sink.clear()
        out3 = lowbit_attn.attention(q, k, v, **kw)  # replayed
        replayed = list(sink)
        state = planned.state(key)
        if not isinstance(state, plans.Plan):
            return {"state": str(state), "launches": len(replayed)}
        out2 = out2 if isinstance(out2, tuple) else (out2,)
        out3 = out3 if isinstance(out3, tuple) else (out3,)
        assert [s for s, _ in normal] == [s for s, _ in replayed], "kernels"
        slots = {}
        for (_, a), (_, r) in zip(normal, replayed):
            check_args(a, r, (q, k, v), out2, out3, slots)
        spans = sorted(slots.values())
        for (lo, size), (hi, _) in zip(spans, spans[1:]):
            assert lo + size <= hi, "workspace buffers overlap"
        assert all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(out2, out3))
        return {"state": "plan", "launches": len(replayed), "buffers": len(slots),
                "names": [s.name for s, _ in replayed]}

print(json.dumps([run(c) for c in json.loads(sys.argv[1])]))
'''


CONTEXT_CHILD = r"""
import json, os, sys
import torch
import lowbit_attn
from lowbit_attn.core import arch, plans
from lowbit_attn.inference import planned
from lowbit_attn.tools.bench.host import stubbed_launches
sys.path.insert(0, os.environ["LOWBIT_ATTN_TESTS"])
from helpers import check_replayed_args, print_scenarios

KW = dict(recipe="qk_int8_pv_fp8")


def launches(sink, q, k, v, mode, kw=KW):
    os.environ["LOWBIT_ATTN_LAUNCH"] = mode
    sink.clear()
    out = lowbit_attn.attention(q, k, v, **kw)
    return list(sink), (out,)


def way(got):
    # "plan" when no launch was given a tensor (a replay passes addresses), else "triton"
    flat = [y for _, r in got for x in r[9:] for y in (x if isinstance(x, tuple) else (x,))]
    return "triton" if any(isinstance(x, torch.Tensor) for x in flat) else "plan"


def like_triton(sink, q, k, v, kw=KW):
    # a call with plans, launch by launch against Triton's own path on the same tensors ("plan",
    # "triton", or "check": Triton's launches, then the check's replay on copies, not compared)
    ref, out2 = launches(sink, q, k, v, "triton", kw)
    os.environ["LOWBIT_ATTN_LAUNCH"] = "plan"
    key = planned.key(q, k, v, False, None, "HND", kw["recipe"], False)
    checking = isinstance(planned.state(key), plans.Unchecked)
    got, out3 = launches(sink, q, k, v, "plan", kw)
    got = got[:len(ref)] if checking else got
    try:
        assert [s for s, _ in ref] == [s for s, _ in got], "kernels"
        slots = {}
        for (_, a), (_, r) in zip(ref, got):
            check_replayed_args(a, r, (q, k, v), out2, out3, slots)
    except AssertionError as exc:
        return f"differs: {exc}"
    return "check" if checking else way(got)


def sharing(sharer):
    # v a view of the same storage as q (or k), at the same distance either way
    torch.manual_seed(0)
    pair = torch.randn(2, 1, 2, 128, 64, dtype=torch.float16)
    other = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    first, v = pair.unbind(0)
    return (first, other, v) if sharer == "q" else (other, first, v)


def shared_storage(sink):
    # a plan of "v shares q's storage" applied to "v shares k's": the same kernels and
    # arguments as Triton's path, v's pointers at v
    rows = [like_triton(sink, *sharing("q")) for _ in range(4)]
    return rows + [like_triton(sink, *sharing("k")) for _ in range(4)]


def graph_capture(sink):
    # a warm-up call, then calls as if a CUDA graph were being captured: no key, no plan, no
    # check (a replay or a check's synchronization would break the capture)
    q, k, v = sharing("q")[0], *sharing("k")[:2]
    seen_key = planned.key(q, k, v, False, None, "HND", KW["recipe"], False)
    launches(sink, q, k, v, "plan")
    capturing, arch.graph_capturing = arch.graph_capturing, lambda device: True
    try:
        keys = [planned.key(q, k, v, False, None, "HND", KW["recipe"], False)]
        ways = []
        for _ in range(3):
            ways.append(way(launches(sink, q, k, v, "plan")[0]))
    finally:
        arch.graph_capturing = capturing
    return {"keys": [str(k) for k in keys], "ways": ways, "state": str(planned.state(seen_key))}


def gluon(sink, kernel):
    # the Gluon forwards as if they applied here and were admitted (their TMA descriptors take
    # Triton's scratch, here from the CPU): every call launches what Triton's path launches,
    # each attention launch with scratch from the Gluon launcher's allocator
    from lowbit_attn.core.recipes import get_recipe
    from lowbit_attn.inference import (gluon_fp4_check, kernel_fp4_gluon, kernel_int8_sm90,
                                       sm90_check)

    gluon_fp4_check.applies = sm90_check.applies = lambda device: True
    gluon_fp4_check.admitted = sm90_check.admitted = lambda device: True
    kernel_int8_sm90.tma_scratch = kernel_fp4_gluon._scratch = (
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    os.environ["LOWBIT_ATTN_KERNEL"] = "gluon" if kernel == "fp4" else kernel
    recipes = {"fp4": "qk_fp4_pv_fp4", "sm90": get_recipe("qk_int8_pv_fp8").replace(
        granularity="per_thread", block_k=128)}
    kw = dict(recipe=recipes.get(kernel, "qk_int8_pv_fp8"))
    q, k, v = (torch.randn(1, 2, 200, 128, dtype=torch.float16) for _ in range(3))
    rows = [like_triton(sink, q, k, v, kw) for _ in range(3)]
    stubs = {s for s, _ in sink}
    before = sum(s.scratch_calls for s in stubs)
    rows.append(like_triton(sink, q, k, v, kw))  # the last call's launches stay in sink
    names = [s.name for s, _ in sink]
    scratch = sum(s.scratch_calls for s in stubs) - before
    return {"rows": rows, "names": names, "scratch": scratch}


SCENARIOS = {"shared_storage": shared_storage, "graph_capture": graph_capture}
SCENARIOS.update({f"gluon-{k}": lambda sink, k=k: gluon(sink, k)
                  for k in ("fp4", "sm90")})
SCRATCH = {"_attn_fwd_fp4_gluon_kernel": 128, "_attn_fwd_sm90_kernel": 128}
with stubbed_launches(arch.get_capability(), SCRATCH) as sink:
    print_scenarios(SCENARIOS, json.loads(sys.argv[1]), sink, planned.clear)
"""


def _child(cases: list, code: str = CHILD, **env):
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base.update({"LOWBIT_ATTN_ARCH": "sm_90", "LOWBIT_ATTN_TESTS": TESTS,
                 "LOWBIT_ATTN_LAUNCH": "plan", **env})  # plans are opt-in
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=base,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = [
    dict(recipe="qk_int8_pv_fp8", shape=(2, 4, 4, 256, 128)),
    dict(recipe="qk_int8_pv_fp8", shape=(1, 8, 2, 200, 64), causal=True, lse=True),
    dict(recipe="qk_int8_pv_fp8", shape=(2, 4, 4, 256, 128), layout="NHD", dtype="bfloat16"),
    dict(recipe="qk_int8_pv_fp16", shape=(1, 4, 4, 320, 128), causal=True),
    dict(recipe="qk_int8_pv_fp8", shape=(1, 4, 4, 128, 64), layout="NHD", fused=True),
]


@pytest.mark.slow
def test_a_replay_launches_what_triton_would():
    """Each case: the same kernels, grids and values as Triton's path; the pointers at the same
    inputs and outputs, intermediates at distinct workspace buffers; quantization and attention
    in three launches (statistics; Q, K and V; attention)."""
    rows = _child(CASES)
    for case, row in zip(CASES, rows):
        assert row["state"] == "plan", (case, row)
        assert row["names"][:2] == ["_channel_stats_kernel", "_quantize_kernel"], row
        extra = 1 if case.get("lse") else 0  # the LSE shift of smoothed K
        assert row["launches"] == 3 + extra, (case, row)
        assert row["buffers"] >= 4


@pytest.mark.slow
def test_no_plan_where_a_replay_would_be_wrong_or_is_turned_off():
    """A recipe whose call runs a PyTorch operation (Q smoothing zeroes ΔS's buffer) gets no plan,
    and the reason; ``LOWBIT_ATTN_LAUNCH=triton`` turns plans off."""
    [row] = _child([dict(recipe="qk_int8_pv_fp16", shape=(1, 2, 2, 128, 64), smooth_q=True)])
    assert "PyTorch operations" in row["state"] and "zero" in row["state"], row
    [row] = _child(CASES[:1], LOWBIT_ATTN_LAUNCH="triton")
    assert row["state"] == "seen" and row["launches"] == 3, row


def test_the_key_holds_how_inputs_share_memory():
    """Views of one fused projection and separate tensors of the same shapes and strides get
    different keys (a plan addresses shared inputs from the first)."""
    import torch

    from lowbit_attn.inference import planned

    qkv = torch.randn(1, 16, 3, 2, 8)
    q, k, v = qkv.unbind(2)
    q2, k2, v2 = (torch.randn(1, 16, 3, 2, 8).unbind(2)[i] for i in range(3))
    args = (False, None, "NHD", "auto", False)
    assert planned.key(q, k, v, *args) != planned.key(q2, k2, v2, *args)
    assert planned.key(q, k, v, *args) == planned.key(*torch.randn_like(qkv).unbind(2), *args)


def test_the_key_says_which_input_shares_storage_with_which():
    """Issue 37 (3): "v shares q's storage" and "v shares k's storage", at the same distance,
    get different keys (a plan addresses v from the input it shared with when captured)."""
    import torch

    from lowbit_attn.inference import planned

    pair, other = torch.randn(2, 1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    first, v = pair.unbind(0)
    args = (False, None, "HND", "auto", False)
    assert planned.key(first, other, v, *args) != planned.key(other, first, v, *args)


@pytest.fixture(scope="module")
def context_rows() -> dict:
    return _child(["shared_storage", "graph_capture"], CONTEXT_CHILD)


@pytest.mark.slow
def test_calls_sharing_storage_otherwise_launch_what_triton_would(context_rows):
    """Issue 37 (3): a plan captured with v sharing q's storage is not replayed for v sharing
    k's at the same distance; every call launches Triton's kernels, grids, streams and
    arguments, v's pointers at v."""
    rows = context_rows["shared_storage"]
    assert "raised" not in rows, rows
    assert all(row in ("plan", "triton", "check") for row in rows), rows
    assert rows[3] == "plan" and rows[7] == "plan", rows  # each configuration gets its plan


PLANNED = ["triton", "triton", "check", "plan"]
GLUON_FORWARDS = [
    pytest.param("gluon-sm90", "sm_90", PLANNED, marks=needs_gluon("hopper"), id="int8-sm90"),
    # FP4 calls get no plan (their quantization zeroes a buffer): Triton's way every time
    pytest.param("gluon-fp4", "sm_100", ["triton"] * 4, marks=needs_gluon("blackwell"), id="fp4"),
]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,arch,ways", GLUON_FORWARDS)
def test_gluon_forwards_replay_under_their_scratch_allocator(scenario, arch, ways):
    """Issue 37 (1): with ``LOWBIT_ATTN_KERNEL=sm90`` (or ``gluon`` for FP4) the attention
    launch needs global scratch (TMA descriptors made on the device): every call, its check's
    replay and later replays too, launches what Triton's path launches and takes the scratch
    from the Gluon launcher's allocator (without it: "no allocator was set")."""
    [row] = _child([scenario], CONTEXT_CHILD, LOWBIT_ATTN_ARCH=arch).values()
    assert "raised" not in row, row
    assert row["rows"] == ways, row
    gluon = [name for name in row["names"]
             if any(k in name for k in ("gluon", "sm90"))]
    # the last call: Triton's path, then the plan's (the sink holds the latter's launches)
    assert gluon and row["scratch"] == 2 * len(gluon), row


@pytest.mark.slow
def test_no_plan_and_no_check_while_a_graph_is_captured(context_rows):
    """Issue 37 (2): after one eager call, calls made while a CUDA graph is being captured (as
    ``core.arch.graph_capturing`` says) get no key: Triton's launches, nothing captured."""
    row = context_rows["graph_capture"]
    assert "raised" not in row, row
    assert row["keys"] == ["None"] and row["ways"] == ["triton"] * 3, row
    assert row["state"] == "seen", row


def test_jit_trace_records_the_custom_op():
    """Issue 37 (5): under ``torch.jit.trace`` a call is not eager: the trace holds the custom
    op (not what one eager run did), and the traced function computes on new inputs what the
    public call computes."""
    import torch

    import lowbit_attn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))

    def f(q, k, v):
        return lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp16")

    for _ in range(3):  # a key seen, captured and checked before the trace
        f(q, k, v)
    traced = torch.jit.trace(f, (q, k, v), check_trace=False)
    assert "lowbit_attn::attention_fwd" in str(traced.graph), traced.graph
    q2, k2, v2 = (torch.randn(1, 2, 64, 32) for _ in range(3))
    assert torch.equal(traced(q2, k2, v2), f(q2, k2, v2))


def test_no_key_outside_eager_mode():
    """Under a dispatch mode, for a tensor subclass or an unusual argument kind, a call gets no
    key (it goes the custom op's way, checks included)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowbit_attn.inference import planned

    q = torch.randn(1, 2, 8, 16)
    assert planned.key(q, q, q, False, None, "HND", "auto", False) is not None
    assert planned.key(q, q, q, 1, None, "HND", "auto", False) is None
    assert planned.key(q, q, q, False, 1, "HND", "auto", False) is None
    assert planned.key(q, q, q, False, None, "HND", ["auto"], False) is None

    class Nothing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Nothing():
        assert planned.key(q, q, q, False, None, "HND", "auto", False) is None
    sub = torch.nn.Parameter(q)
    assert planned.key(sub, q, q, False, None, "HND", "auto", False) is None


def test_eager_calls_on_cpu_match_the_custom_op():
    """On the reference backend the eager path calls the op's implementation directly; its
    result is the custom op's, bit for bit (three calls: seen, then plan-eligible keys)."""
    import torch

    import lowbit_attn
    from lowbit_attn.core.recipes import RECIPES, recipe_key
    from lowbit_attn.inference import op

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    want, _ = op.attention_fwd(q, k, v, recipe_key(RECIPES["qk_int8_pv_fp16"]), 32 ** -0.5,
                               False, 0, False, False)
    for _ in range(3):
        got = lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp16")
        assert torch.equal(got, want)


@pytest.mark.slow
def test_bench_host_prints_host_time_and_launches():
    """``lowbit-attn bench --host`` on a CPU-only machine: ``host_us=`` and ``launches=3``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "lowbit_attn.tools.cli", "bench", "--host", "--recipes",
         "qk_int8_pv_fp8", "--dims", "128"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "host_us=" in done.stdout and "launches=3" in done.stdout, done.stdout



POISONED = """
import os, sys, torch
sys.path.insert(0, os.environ["LOWBIT_ATTN_TESTS"])
import lowbit_attn
from helpers import poison
from lowbit_attn.inference import planned
from lowbit_attn.tools.bench.host import stubbed_launches
if sys.argv[1] == "poisoned":  # as conftest's nan_poisoned_allocations
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3))
key = planned.key(q, k, v, False, None, "HND", "qk_int8_pv_fp8", False)
with stubbed_launches((9, 0)):
    for _ in range(3):
        lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8")
print(type(planned.state(key)).__name__, planned.state(key))
"""


@pytest.mark.triton_internals  # the stand-in launches patch Triton's launch path
def test_no_plan_under_the_suites_poisoned_allocations_so_the_gpu_plan_tests_opt_out():
    """``conftest.py`` fills every ``torch.empty`` with NaN: a PyTorch operation inside each
    recorded call, which refuses the call a plan (shown in a child process, with stand-in
    launches, against the same calls unpoisoned). ``tests/test_gpu_plans.py`` overrides that
    fixture, or none of its calls would get a plan and its tests would fail, or pass without
    replaying anything."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOWBIT_ATTN_ARCH="sm_90", LOWBIT_ATTN_TESTS=TESTS, LOWBIT_ATTN_LAUNCH="plan")
    said = {}
    for mode in ("plain", "poisoned"):
        done = subprocess.run([sys.executable, "-c", POISONED, mode], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        said[mode] = done.stdout.strip().splitlines()[-1]
    assert said["plain"].startswith("Plan"), said
    assert "PyTorch operations ['fill_']" in said["poisoned"], said
    gpu_tests = script_module("tests/test_gpu_plans.py")
    assert "nan_poisoned_allocations" in vars(gpu_tests)

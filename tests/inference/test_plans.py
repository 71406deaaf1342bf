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
        sink.clear()
        out3 = lowbit_attn.attention(q, k, v, **kw)  # replayed
        replayed = list(sink)
        state = planned.state(key)
        if not isinstance(state, plans.Plan):
            return {"state": state, "launches": len(replayed)}
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


def _child(cases: list[dict], **env) -> list[dict]:
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base.update(LOWBIT_ATTN_ARCH="sm_90", LOWBIT_ATTN_TESTS=TESTS, **env)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], env=base,
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

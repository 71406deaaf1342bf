"""Compiling ahead (``LOWBIT_ATTN_COMPILE=parallel``, ``core/plan_launches.compile_ahead``): a
new configuration's first ``attention()`` call runs first as a dry pass in which each launch
submits its kernel's compile to a pool of threads and nothing runs; then the call runs and
launches what it would have launched. The dry pass runs PyTorch's allocations and views only,
stops before any other operation (whatever the call catches), and leaves an autotuner no choice.

Triton's launch path needs compiled (not interpreted) kernels, so the calls run in a child
process without ``TRITON_INTERPRET``, under the stand-in driver of ``tools/bench/host.py``, whose
stand-in compiles run in the pool's threads as Triton's own do (each stub notes its thread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lowbit_attn.core import plan_launches

try:
    import triton.runtime._async_compile  # noqa: F401
    ASYNC = True
except ImportError:  # a Triton without them (3.4): the option compiles serially
    ASYNC = False
needs_async_compiles = pytest.mark.skipif(not ASYNC, reason="this Triton has no "
                                          "asynchronous compiles")

CHILD = r'''
import json, sys
import torch
import triton
import triton.language as tl
from triton.runtime import autotuner
import lowbit_attn
from lowbit_attn.core import plan_launches
from lowbit_attn.core.triton_helpers import tuned
from lowbit_attn.tools.bench.host import stubbed_launches

@triton.jit
def _copy_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)

_configs = [triton.Config({"BLOCK": b}) for b in (32, 64, 128)]
_copy = triton.autotune(configs=_configs, key=["n"])(_copy_kernel)
_tuned = tuned(triton.autotune(configs=_configs, key=["n"])(_copy_kernel))
keep_on_disk = autotuner.Autotuner.check_disk_cache  # the stand-ins keep nothing on disk

def described(arg):
    if isinstance(arg, torch.Tensor):
        return [str(arg.dtype), list(arg.shape), list(arg.stride())]
    if isinstance(arg, tuple):
        return [described(a) for a in arg]
    return repr(arg)

def launches(sink):
    return [[stub.name, stub.thread, list(args[:3]), [described(a) for a in args[9:]]]
            for stub, args in sink]

def threads(jit_fn):
    return sorted(k.thread for cache in jit_fn.device_caches.values() for k in cache[0].values())

torch.manual_seed(0)
q = torch.randn(1, 4, 200, 64, dtype=torch.float16)
k, v = (torch.randn(1, 2, 200, 64, dtype=torch.float16) for _ in range(2))
found = {}
with stubbed_launches((9, 0)) as sink:
    if sys.argv[1] == "tuned":  # an autotuned kernel's dry pass, then its call
        x, y = torch.zeros(1000), torch.empty(1000)
        call = lambda: _copy[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, y, 1000)
        found["why"] = plan_launches.compile_ahead(call)
        found.update(launched=len(sink), choices=len(_copy.cache), compiled_on=threads(_copy.fn))
        call()
        found.update(then_launched=len(sink), then_compiled=len(threads(_copy.fn)))
    elif sys.argv[1].startswith("disk"):  # the package's autotuner, with its choice on disk
        autotuner.Autotuner.check_disk_cache = keep_on_disk
        timed = []
        autotuner.Autotuner._bench = lambda self, *a, config, **m: (
            timed.append(config.kwargs["BLOCK"]) or [abs(config.kwargs["BLOCK"] - 64) + 1.0] * 3)
        x, y = torch.zeros(1000), torch.empty(1000)
        call = lambda: _tuned[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, y, 1000)
        if sys.argv[1] == "disk-ahead":
            found["why"] = plan_launches.compile_ahead(call)
            found.update(compiled=len(threads(_tuned.fn)), choices=len(_tuned.cache))
        call()
        found.update(timed=timed, chose=_tuned.best_config.kwargs["BLOCK"],
                     then_compiled=len(threads(_tuned.fn)))
    else:
        lowbit_attn.attention(q, k, v, is_causal=True)
        found["first"] = launches(sink)
        sink.clear()
        lowbit_attn.attention(q, k, v, is_causal=True)
        found["second"] = launches(sink)
print("RESULT " + json.dumps(found))
'''


def _child(tmp_path, mode: str, **env) -> dict:
    script = tmp_path / f"child_{mode}.py"  # a file: Triton reads a kernel's source
    script.write_text(CHILD)
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    done = subprocess.run([sys.executable, str(script), mode], env=environ, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


@needs_async_compiles
def test_a_first_call_compiles_side_by_side_and_launches_what_it_would(tmp_path):
    serial = _child(tmp_path, "call", LOWBIT_ATTN_COMPILE="serial")
    ahead = _child(tmp_path, "call", LOWBIT_ATTN_COMPILE="parallel")
    names = [launch[0] for launch in serial["first"]]
    assert names == ["_channel_stats_kernel", "_quantize_kernel", "_attn_fwd_int8_kernel"]
    # the same launches (grids, argument shapes and values), one call's worth: the dry pass
    # launched nothing
    drop_thread = lambda calls: [[n, grid, args] for n, _, grid, args in calls]  # noqa: E731
    assert drop_thread(ahead["first"]) == drop_thread(serial["first"])
    assert drop_thread(ahead["second"]) == drop_thread(serial["second"])
    # serial: each kernel compiled by the call's own thread at its launch; ahead: in the pool
    assert {t for _, t, _, _ in serial["first"]} == {"MainThread"}
    assert all(t.startswith("lowbit_attn-compile") for _, t, _, _ in ahead["first"])


@needs_async_compiles
def test_an_autotuner_compiles_its_candidates_ahead_and_keeps_no_choice(tmp_path):
    found = _child(tmp_path, "tuned")
    assert found["why"] is None and found["launched"] == 0
    assert found["choices"] == 0  # nothing timed, nothing kept
    # its three candidates, each compiled in the pool
    assert len(found["compiled_on"]) == 3
    assert all(t.startswith("lowbit_attn-compile") for t in found["compiled_on"])
    # the call then times them and launches its choice, compiling nothing more
    assert found["then_launched"] == 1 and found["then_compiled"] == 3


@needs_async_compiles
def test_an_autotuner_with_its_choice_on_disk_compiles_that_alone_ahead(tmp_path):
    """A later process's dry pass (the package's autotuner, which keeps its timings in Triton's
    cache) compiles the candidate an earlier process chose, not all three; fails if the dry
    pass ignores the disk."""
    cache = {"TRITON_CACHE_DIR": str(tmp_path / "cache")}
    first = _child(tmp_path, "disk-fill", **cache)
    assert first["timed"] == [32, 64, 128] and first["chose"] == 64
    later = _child(tmp_path, "disk-ahead", **cache)
    assert later["why"] is None and later["choices"] == 1 and later["compiled"] == 1
    assert later["timed"] == [] and later["chose"] == 64 and later["then_compiled"] == 1


@needs_async_compiles
def test_a_dry_pass_stops_before_any_other_pytorch_operation():
    from triton.runtime import autotuner, jit

    originals = (jit.JITFunction.run, autotuner.Autotuner.run)
    x = torch.zeros(3)
    caught = []

    def call():
        y = x.new_empty(3).view(1, 3)  # allocations and views run
        try:
            x.add_(1)
        except Exception as exc:  # noqa: BLE001 - the stop is not the call's to catch
            caught.append(exc)
        return y

    why = plan_launches.compile_ahead(call)
    assert why == "the call runs the PyTorch operation add_"
    assert torch.equal(x, torch.zeros(3)) and caught == []
    assert (jit.JITFunction.run, autotuner.Autotuner.run) == originals  # unwrapped after

    def fails():
        raise ValueError("a bad argument")

    assert plan_launches.compile_ahead(fails) == "the dry pass raised ValueError: a bad argument"
    assert (jit.JITFunction.run, autotuner.Autotuner.run) == originals


def test_the_dispatch_modes_do_not_import_dynamo():
    """A capture's and a dry pass's dispatch mode are not wrapped against Dynamo, whose import
    PyTorch's default wrapping makes at a mode's first use (1.1 s on a CPU of 2026-11-30): a
    first call would pay it."""
    code = ("import sys, torch\n"
            "from lowbit_attn.core import plan_launches\n"
            "with plan_launches._watched_ops([], set()):\n"
            "    torch.empty(3).view(1, 3)\n"
            "plan_launches.compile_ahead(lambda: torch.empty(3).view(1, 3))\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]

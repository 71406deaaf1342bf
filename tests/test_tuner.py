"""The package's autotuner (``core.triton_helpers.tuned``): a candidate kept alone is not timed,
and choices among several are kept on disk, in Triton's cache, for later processes (under
``LOWBIT_ATTN_AUTOTUNE=measured``, the default; ``all`` times anew)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from lowbit_attn.core import triton_helpers
from lowbit_attn.core.triton_helpers import tuned
from lowbit_attn.inference import kernel_fp4, kernel_int8
from lowbit_attn.training import kernel_bwd, kernel_fwd
from lowbit_attn.vsa import kernel_fine


@triton.jit
def _copy_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


def test_every_autotuned_kernel_is_the_packages_tuner():
    tuners = [kernel_int8._attn_fwd_int8, kernel_fp4._attn_fwd_fp4, kernel_fwd._train_fwd,
              kernel_bwd._dkdv, kernel_bwd._dkdv_small_d, kernel_bwd._dq, kernel_fine._fwd,
              kernel_fine._dq, kernel_fine._dkdv]
    assert all(type(t) is triton_helpers._Tuner for t in tuners)


def test_a_candidate_kept_alone_is_not_timed(monkeypatch):
    """A launch whose prune filter keeps one candidate runs it untimed (Triton 3.6 would time
    it: ~0.1 s of a new shape's first call); one that keeps several times each, as before."""
    from triton.runtime import autotuner

    timed, keep = [], [1]
    monkeypatch.setattr(autotuner.Autotuner, "_bench",
                        lambda self, *args, config, **meta: timed.append(config.kwargs["BLOCK"])
                        or [float(config.kwargs["BLOCK"])] * 3)
    tuner = tuned(triton.autotune(
        configs=[triton.Config({"BLOCK": b}) for b in (32, 64, 128)], key=["n"],
        prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: configs[:keep[0]]},
    )(_copy_kernel))
    x = torch.arange(100, dtype=torch.float32)
    y = torch.zeros(100)
    tuner[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, y, 100)
    assert timed == [] and torch.equal(y, x)
    keep[0] = 3
    y.zero_()
    tuner[lambda meta: (triton.cdiv(99, meta["BLOCK"]),)](x, y, 99)  # a new key: three kept
    assert timed == [32, 64, 128] and torch.equal(y[:99], x[:99]) and y[99] == 0


# One process's autotuning of a three-candidate kernel under the stand-in launches of
# tools/bench/host.py (compiled Triton's path, no GPU), with Triton's disk cache as on a GPU
# (``real``: the stand-ins keep nothing on disk) and timings that make BLOCK = 64 the fastest.
CHILD = textwrap.dedent("""
    import json, sys
    import torch, triton
    import triton.language as tl
    from triton.runtime import autotuner
    from lowbit_attn.core.triton_helpers import tuned
    from lowbit_attn.tools.bench.host import stubbed_launches

    @triton.jit
    def copy(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)

    tuner = tuned(triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (32, 64, 128)],
                                  key=["n"])(copy))
    real = autotuner.Autotuner.check_disk_cache
    timed = []
    x, y = torch.zeros(100), torch.zeros(100)
    with stubbed_launches((9, 0)):
        if sys.argv[1] == "real":
            autotuner.Autotuner.check_disk_cache = real
        autotuner.Autotuner._bench = lambda self, *a, config, **m: (
            timed.append(config.kwargs["BLOCK"]) or [abs(config.kwargs["BLOCK"] - 64) + 1.0] * 3)
        tuner[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, y, 100)
    print("RESULT " + json.dumps({"timed": timed, "chose": tuner.best_config.kwargs["BLOCK"]}))
""")


# tools/bench/host.py's stand-in launches build on Triton 3.5's JITFunction._do_compile
needs_stand_ins = pytest.mark.skipif(not hasattr(JITFunction, "_do_compile"),
                                     reason="the stand-in launches need JITFunction._do_compile")


def _child(folder, mode="real", autotune=None) -> dict:
    """The child in a process of its own (a file: ``triton.jit`` reads its source), with
    ``folder/cache`` as Triton's cache."""
    script = folder / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "LOWBIT_ATTN_AUTOTUNE")}
    env["TRITON_CACHE_DIR"] = str(folder / "cache")
    if autotune:
        env["LOWBIT_ATTN_AUTOTUNE"] = autotune
    done = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def _kept(folder) -> list:
    return [f for _, _, files in os.walk(folder / "cache") for f in files
            if f.endswith(".autotune.json")]


@needs_stand_ins
def test_a_later_process_takes_the_choice_from_disk_without_timing(tmp_path):
    """Fails without ``cache_results`` (the second process times the three candidates again)."""
    first = _child(tmp_path)
    assert first == {"timed": [32, 64, 128], "chose": 64} and len(_kept(tmp_path)) == 1
    assert _child(tmp_path) == {"timed": [], "chose": 64}
    # ``all`` times anew (the benchmarks' ``tuned`` rows measure the autotuner's choice)
    assert _child(tmp_path, autotune="all") == {"timed": [32, 64, 128], "chose": 64}


@needs_stand_ins
def test_the_stand_in_launches_keep_no_timings_on_disk(tmp_path):
    """Their timings are not a GPU's: a GPU's later processes must not take them (the decode
    stage of ``run_on_gpu.sh`` times the host path under them on the GPU machine)."""
    assert _child(tmp_path, mode="stubs") == {"timed": [32, 64, 128], "chose": 64}
    assert _kept(tmp_path) == []

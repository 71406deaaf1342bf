"""What differs between Triton releases, kept in ``core.triton_support``: the series and their
names, the one-line refusal of a Gluon module written for another Triton, what ``doctor`` reports,
and the interpreter fix that lets the kernels run under each release's interpreter."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from lowbit_attn.core import triton_support


@pytest.mark.parametrize("version,series", [("3.6.0", "3.6"), ("3.9.0+git1a2b3c", "3.9"),
                                            ("3.10.1", "3.10"), ("4.0", "4.0")])
def test_series_of_a_version(version, series):
    assert triton_support.series(version) == series


def test_the_installed_triton_is_one_the_suite_runs_on():
    assert triton_support.series() in triton_support.TESTED, triton.__version__


@pytest.mark.parametrize("version", ["3.5.1", "3.7.0", "3.60.0"])
def test_a_series_check_names_what_it_accepts_and_what_it_found(version):
    with pytest.raises(RuntimeError, match=rf"^needs 3\.6\.x, 3\.9\.x; found {version}$"):
        triton_support.check_triton_series(("3.6", "3.9"), "needs {series}; found {version}",
                                           version)
    triton_support.check_triton_series("3.6", "", "3.6.1+git")  # accepted: no error


def test_a_gluon_module_on_another_triton_raises_one_line_naming_both(monkeypatch):
    monkeypatch.setitem(triton_support.GLUON_SERIES, "hopper", ("3.99",))
    with pytest.raises(triton_support.GluonUnavailable) as caught:
        triton_support.require_gluon("hopper", "the kernel", "3.9.0")
    message = str(caught.value)
    assert "\n" not in message
    assert re.search(r"the kernel is written for Gluon's Hopper API of Triton 3\.99\.x, found "
                     r"Triton 3\.9\.0", message), message
    # an ImportError where a module is imported, a RuntimeError where a kernel is launched
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, RuntimeError)
    triton_support.require_gluon("hopper", "the kernel", "3.99.2")  # accepted: no error


def test_doctor_rows_follow_the_gluon_series(monkeypatch):
    rows = dict(triton_support.parts("3.9.0"))
    assert rows["Triton kernels"] == "tested on this series"
    monkeypatch.setitem(triton_support.GLUON_SERIES, "hopper", ("3.9",))
    monkeypatch.setitem(triton_support.GLUON_SERIES, "blackwell", ("3.6",))
    rows = dict(triton_support.parts("3.9.0"))
    assert rows["Gluon INT8 forward (sm_90a, opt-in)"].startswith("available")
    assert rows["Gluon FP4 forward (sm_100a, opt-in)"] == "unavailable: needs Triton 3.6.x"
    assert dict(triton_support.parts("3.10.0"))["Triton kernels"].startswith("untested")


def test_importing_the_package_imports_no_gluon_module():
    """Gluon code is imported only when asked for (an opt-in kernel, inspect --kernel gluon):
    ``import lowbit_attn`` and a call work on any Triton."""
    code = ("import sys, lowbit_attn; "
            "print(sorted(m for m in sys.modules if 'gluon' in m and m.startswith('lowbit')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_aot_walk_leaves_out_a_gluon_module_that_cannot_be_imported(monkeypatch):
    from lowbit_attn.tools import aot

    monkeypatch.setitem(triton_support.GLUON_SERIES, "blackwell", ("3.99",))
    for name in ("lowbit_attn.inference.kernel_fp4_gluon", "lowbit_attn.inference.gluon_fp4_blocks"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    names = {m.__name__ for m in aot.kernel_modules(("inference",))}
    assert "lowbit_attn.inference.kernel_int8" in names
    assert "lowbit_attn.inference.kernel_fp4_gluon" not in names
    with pytest.raises(ImportError, match="Blackwell API of Triton 3.99.x"):
        importlib.import_module("lowbit_attn.inference.kernel_fp4_gluon")


@triton.jit
def _scalar_condition_mask(X, LIM, O, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    limit = tl.load(LIM).to(tl.int64)
    keep = (offs < BLOCK - 1) & (limit >= 0)  # a scalar comparison splatted into the mask
    tl.store(O + offs, tl.load(X + offs, mask=keep, other=-1.0), mask=keep)


@pytest.mark.interpreter
@pytest.mark.parametrize("limit,expected", [(3, [1.0, 2.0, 3.0, 0.0]), (-1, [0.0] * 4)])
def test_a_mask_holding_a_scalar_comparison_runs_under_the_interpreter(limit, expected):
    """The kernels' masks combine block and scalar comparisons (the KV cache's ``page >= 0``):
    under Triton 3.9's interpreter such a mask arrived as integers and the load refused it."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = torch.zeros(4)
    _scalar_condition_mask[(1,)](x, torch.tensor([limit]), out, BLOCK=4)
    assert out.tolist() == expected


def _exact_fma_fp32(a: float, b: float, c: float) -> float:
    """``a·b + c`` of fp32 numbers rounded once to fp32 (to nearest, ties to even), from exact
    rationals."""
    import numpy as np
    from fractions import Fraction

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = np.float32(float(exact))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near,
                  np.nextafter(near, np.float32(np.inf))]
    gaps = [abs(Fraction(float(t)) - exact) for t in candidates]
    best = [t for t, g in zip(candidates, gaps) if g == min(gaps)]
    if len(best) > 1:
        best = [t for t in best if int(np.float32(t).view(np.int32)) % 2 == 0]
    return float(best[0])


@triton.jit
def _fma_kernel(A, B, C, O, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(O + offs, tl.fma(tl.load(A + offs), tl.load(B + offs), tl.load(C + offs)))


@pytest.mark.interpreter
def test_the_interpreter_s_fma_rounds_once():
    """``tl.fma`` under the interpreter rounds once, as a GPU's does (Triton 3.4 to 3.6 rounded the
    product, then the sum): against exact rationals, on sums that nearly cancel the product (a
    division's residual) and on products whose rounding lands on a tie of the sum."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, generator=g) * torch.exp2(torch.randint(-30, 30, (512,), generator=g))
    b = torch.randn(512, generator=g) * torch.exp2(torch.randint(-30, 30, (512,), generator=g))
    c = -(a.double() * b.double() * (1 + torch.randn(512, generator=g, dtype=torch.float64)
                                      * 1e-6)).float()
    c[:128] = torch.randn(128, generator=g) * 1e-3
    a[:2], b[:2], c[:2] = 1 + 2.0**-12, 1 + 2.0**-12, torch.tensor([-1.0, 2.0**-24])
    out = torch.empty(512)
    _fma_kernel[(1,)](a, b, c, out, BLOCK=512)
    want = [_exact_fma_fp32(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert out.tolist() == want
    # the first two: a·b = 1 + 2^-11 + 2^-24, a tie that two roundings break the other way
    assert out[0] != a[0] * b[0] + c[0] and out[1] != a[1] * b[1] + c[1]
    assert triton_support.fma_fp32(a.numpy(), b.numpy(), c.numpy()).tolist() == want


def test_without_triton_the_package_imports_and_runs_the_reference_path():
    """Triton publishes Linux wheels only and the metadata asks for it on Linux alone: elsewhere
    ``import lowbit_attn`` works, CPU calls run the reference, CUDA tensors are sent there with
    one warning, and asking for the kernels names what is missing."""
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["triton"] = None  # import triton raises ImportError, as where it is absent
        import torch, lowbit_attn
        from lowbit_attn.core import arch, triton_support
        assert not triton_support.triton_installed()
        q = torch.randn(1, 2, 16, 64)
        out = lowbit_attn.attention(q, q, q, is_causal=True)
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
            q, q, q, is_causal=True), atol=0.05, rtol=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert arch.backend_for(torch.device("cuda")) == "reference"
            assert arch.backend_for(torch.device("cuda")) == "reference"
        assert len(caught) == 1 and "reference path" in str(caught[0].message), caught
        import os
        os.environ["LOWBIT_ATTN_BACKEND"] = "triton"
        try:
            arch.backend_for(torch.device("cpu"))
        except RuntimeError as err:
            print(err)
        assert "triton" not in sys.modules or sys.modules["triton"] is None
        from lowbit_attn.tools.cli import main
        main(["doctor"])  # says so
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("LOWBIT_ATTN_BACKEND=triton needs Triton, which is not "
                                 "installed (Triton publishes wheels for Linux"), out.stdout
    assert re.search(r"\ntriton +not installed \(wheels for Linux only\)", out.stdout), out.stdout
    doctor = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        sys.modules["triton"] = None
        from lowbit_attn.tools.cli import main
        main(["doctor"])
    """)], capture_output=True, text=True)
    assert doctor.returncode == 0 and "not installed" in doctor.stdout, doctor.stderr
    assert "Warning" not in doctor.stderr, doctor.stderr  # its triton line says it, once


def test_the_metadata_admits_the_triton_of_every_supported_torch_on_linux_alone():
    """pyproject.toml's requirements against :data:`TORCH_TRITON` (`make check-resolve` asks the
    index): each torch's Triton is admitted, the oldest is the lower bound, torch's own lower bound
    is the oldest supported torch, and Triton is asked for on Linux only."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    reqs = {r.name: r for r in map(Requirement, project["project"]["dependencies"])}
    triton_req, torch_req = reqs["triton"], reqs["torch"]
    for torch_series, triton_series in triton_support.TORCH_TRITON.items():
        assert triton_req.specifier.contains(Version(triton_series + ".0")), triton_series
        assert torch_req.specifier.contains(Version(torch_series + ".0")), torch_series
    major, minor = min(tuple(map(int, s.split("."))) for s in triton_support.TORCH_TRITON)
    assert not torch_req.specifier.contains(Version(f"{major}.{minor - 1}.9"))  # (torch 2.7)
    major, minor = map(int, triton_support.OLDEST.split("."))
    assert not triton_req.specifier.contains(Version(f"{major}.{minor - 1}.9"))
    assert set(triton_support.TESTED) <= {s for s in ("3.4", "3.5", "3.6", "3.7", "3.8", "3.9")
                                          if triton_req.specifier.contains(Version(s + ".0"))}
    for platform, wanted in (("linux", True), ("win32", False), ("darwin", False)):
        assert triton_req.marker.evaluate({"sys_platform": platform}) is wanted
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    oldest = re.search(r"^OLDEST_TRITON_SPEC \?= triton==(\S+)$", makefile, re.M)[1]
    assert triton_support.series(oldest) == triton_support.OLDEST  # what make test-oldest installs


def test_a_triton_that_does_not_import_is_named_with_what_it_raised():
    """Triton's interpreter imports numpy, which a fresh install may lack: the doctor and
    LOWBIT_ATTN_BACKEND=triton said "not installed"; they say what the import raised."""
    script = textwrap.dedent("""
        import os, subprocess, sys
        sys.modules["numpy"] = None  # as an environment without numpy
        os.environ.update(TRITON_INTERPRET="1", LOWBIT_ATTN_BACKEND="triton")
        import torch
        import lowbit_attn
        try:
            lowbit_attn.attention(*(torch.randn(1, 1, 4, 16) for _ in range(3)))
        except RuntimeError as exc:
            print(exc)
        from lowbit_attn.tools import cli
        cli.main(["doctor"])
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode in (0, 1), run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("LOWBIT_ATTN_BACKEND=triton needs Triton, which is installed, "
                               "but its import raised ModuleNotFoundError"), run.stdout
    assert "needs numpy: pip install numpy" in lines[0]
    (row,) = [line for line in lines if line.lstrip().startswith("triton ")]
    assert "not installed" not in row and "ModuleNotFoundError" in row, row


def _key_stand_in(release):
    """A module like Triton's, whose ``triton_key`` (an ``lru_cache``) counts its calls and, on
    the hashing thread alone, waits for ``release``."""
    import functools
    import threading
    import types

    module = types.ModuleType("stand_in_cache")
    module.calls = 0

    @functools.lru_cache()
    def triton_key():
        module.calls += 1
        if threading.current_thread().name == triton_support.HASH_THREAD:
            assert release.wait(30)
        return "3.x-key"

    module.triton_key = triton_key
    return module


def test_a_compile_during_the_hash_waits_for_it_and_the_key_is_computed_once():
    import threading

    release = threading.Event()
    module = _key_stand_in(release)
    original = module.triton_key
    thread = triton_support.hash_ahead(module)
    assert thread is not None and module.triton_key is not original
    got = []
    caller = threading.Thread(target=lambda: got.append(module.triton_key()))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and not got  # waits rather than hashing again
    release.set()
    caller.join(10)
    thread.join(10)
    assert got == ["3.x-key"] and module.calls == 1
    assert module.triton_key is original  # the stand-in is gone once the key is computed
    assert triton_support.hash_ahead(module) is None  # already computed: nothing to do


def test_a_compile_waits_for_the_hash_a_bounded_time(monkeypatch):
    """A hashing thread that does not finish (it waits for what the caller holds, say) keeps a
    compile waiting ``HASH_WAIT_S`` at most; then the caller computes the key itself."""
    import threading
    import time

    monkeypatch.setattr(triton_support, "HASH_WAIT_S", 0.2)
    release = threading.Event()
    module = _key_stand_in(release)
    thread = triton_support.hash_ahead(module)
    try:
        start = time.monotonic()
        assert module.triton_key() == "3.x-key"
        assert 0.15 < time.monotonic() - start < 5 and module.calls == 2  # its own, beside
    finally:
        release.set()
        thread.join(10)


def test_a_process_forked_during_the_hash_computes_the_key_itself():
    import os
    import threading
    import time

    release = threading.Event()
    module = _key_stand_in(release)
    original = module.triton_key
    thread = triton_support.hash_ahead(module)
    pid = os.fork()
    if pid == 0:  # the child: no hashing thread here to wait for
        ok = module.triton_key is original and original() == "3.x-key"
        os._exit(0 if ok else 1)
    try:
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung/failed"
    finally:
        release.set()
        thread.join(10)


def test_the_installed_triton_s_key_is_hashed_ahead_to_the_same_value():
    module = triton_support.key_module()
    assert module is not None, (triton_support.KEY_MODULES, triton.__version__)
    original = module.triton_key
    want = original.__wrapped__()  # computed here, not cached
    original.cache_clear()
    thread = triton_support.hash_ahead()
    thread.join(60)
    assert not thread.is_alive() and module.triton_key is original
    assert original.cache_info().currsize == 1 and original() == want
    assert want.startswith(triton.__version__)


@pytest.mark.parametrize("cuda,interpret,wanted", [("12.8", "", True), ("12.8", "1", False),
                                                    (None, "", False)])
def test_the_import_hashes_ahead_on_a_gpu_build_outside_the_interpreter(monkeypatch, cuda,
                                                                        interpret, wanted):
    from lowbit_attn.core import arch

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert triton_support.hash_ahead_wanted(arch.interpreter_enabled()) is wanted

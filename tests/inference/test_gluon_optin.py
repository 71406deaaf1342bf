"""``LOWBIT_ATTN_KERNEL=sm90`` and ``gluon``: which forward a call runs (``inference/sm90_check.py``,
``inference/gluon_fp4_check.py``, their machinery ``inference/gluon_check.py``).

What a CPU can check is the selection logic, not the Gluon kernels (there is no Gluon
interpreter): the option's parsing; that a Gluon launcher is never reached on CPU tensors or under
the interpreter; and, with the device condition faked and the Gluon launcher replaced by a
stand-in that raises, returns wrong values or returns the Triton kernel's, that the one-time
check admits or drops it, warns once, and that every call still gets the Triton kernel's result.
``gluon`` sends the INT8 recipes to the one-warpgroup Hopper forward (as ``sm90``) and the FP4
recipes to the Blackwell one (capability 10.x), whose real kernel, run by the CPU model, passes
its whole check here. The real kernels on a GPU: tests/test_gpu.py.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
import triton

import lowbit_attn
from lowbit_attn.core.options import KernelOptions
from helpers import require_gluon
require_gluon("hopper", "blackwell")  # before importing Gluon code

from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import (
    gluon_check, gluon_fp4_check, kernel_fp4, kernel_fp4_gluon, kernel_int8, kernel_int8_sm90,
    sm90_check,
)

# One small check case instead of sm90_check.CASES (the interpreter runs the Triton side): 128-key
# blocks, per-thread scales, permuted V.
TINY_SM90 = (gluon_check.Case(1, 2, 1, 40, 70, 64, 128, causal=True, lse=True,
                              granularity="per_thread"),)
SM90_RECIPE = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_k=128)
# The same for the FP4 check (D=64: the stand-ins take it).
TINY_FP4 = (gluon_fp4_check.Case(1, 2, 1, 40, 70, "nvfp4", causal=True, lse=True, d=64),)


@dataclass(frozen=True)
class Route:
    """One opt-in route of ``LOWBIT_ATTN_KERNEL``: its check module, the Gluon launcher's
    module, the Triton kernel's module, a recipe it routes, its tiny check cases, and the reason
    a stand-in with wrong rows is refused with."""

    check: object
    launcher: object
    triton: object
    recipe: object
    cases: tuple
    wrong_rows: str
    value: str = "gluon"  # LOWBIT_ATTN_KERNEL


ROUTES = {
    "int8-sm90": Route(sm90_check, kernel_int8_sm90, kernel_int8, SM90_RECIPE, TINY_SM90,
                       "max |gluon - triton|", "sm90"),
    "int8-sm90-gluon": Route(sm90_check, kernel_int8_sm90, kernel_int8, SM90_RECIPE, TINY_SM90,
                             "max |gluon - triton|"),
    "fp4-sm100": Route(gluon_fp4_check, kernel_fp4_gluon, kernel_fp4, "qk_fp4_pv_fp4", TINY_FP4,
                       "cosine"),
}


@pytest.mark.parametrize("capability,kernel", [((9, 0), "sm90"), ((8, 9), "triton")])
def test_the_default_forward_is_the_one_measured_on_the_architecture(monkeypatch, capability,
                                                                     kernel):
    """``LOWBIT_ATTN_KERNEL`` unset (``measured``): the forward ``core.measured.KERNEL_CHOICES``
    names for the device's architecture (an entry stands in here: none is measured yet), else the
    Triton kernels; with no entry for the forward, no device query on the call's path."""
    from lowbit_attn.core import measured

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device: asked.append(device) or capability)
    assert KernelOptions().forward_kernel(cuda) == "triton" and asked == []
    entry = measured.KernelChoice("kernel", "sm_90", "sm90", "a stand-in run")
    monkeypatch.setattr(measured, "KERNEL_CHOICES", (*measured.KERNEL_CHOICES, entry))
    assert KernelOptions().forward_kernel(cuda) == kernel and asked == [cuda]
    assert KernelOptions(kernel="triton").forward_kernel(cuda) == "triton"


def test_the_kernel_option_is_read_and_checked(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("LOWBIT_ATTN_KERNEL", raising=False)
    assert KernelOptions.from_env().kernel == "measured"
    assert KernelOptions.from_env().forward_kernel(cpu) == "triton"  # nothing measured on a CPU
    for value in ("triton", "gluon", "sm90"):
        monkeypatch.setenv("LOWBIT_ATTN_KERNEL", value)
        assert KernelOptions.from_env().forward_kernel(cpu) == value
    # gluon-pingpong is not a value (its kernel is deleted): gluon runs the sm90 forward on Hopper
    for value in ("cudnn", "gluon-pingpong"):
        monkeypatch.setenv("LOWBIT_ATTN_KERNEL", value)
        with pytest.raises(ValueError, match=r"LOWBIT_ATTN_KERNEL must be one of \('measured', "
                                             rf"'triton', 'gluon', 'sm90'\), got '{value}'"):
            KernelOptions.from_env()


@pytest.mark.parametrize("route,written_for", [("int8-sm90", {(9, 0)}),
                                                ("fp4-sm100", {(10, 0), (10, 3)})])
def test_applies_only_to_compiled_kernels_on_the_capability_it_is_written_for(monkeypatch, route,
                                                                               written_for):
    check = ROUTES[route].check
    cuda = torch.device("cuda", 0)
    assert not check.applies(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not check.applies(cuda)  # decided before any CUDA query
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for capability in ((9, 0), (8, 9), (10, 0), (10, 3), (12, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert check.applies(cuda) is (capability in written_for), capability


def _inputs(d=64, nq=50, nk=90):
    g = torch.Generator().manual_seed(d + nq)
    q = torch.randn(1, 2, nq, d, generator=g, dtype=torch.float32).half()
    k = torch.randn(1, 1, nk, d, generator=g, dtype=torch.float32).half()
    v = torch.randn(1, 1, nk, d, generator=g, dtype=torch.float32).half()
    return q, k, v


def _call(q, k, v, recipe="qk_int8_pv_fp8"):
    return lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True, return_lse=True)


def _fresh(monkeypatch, route: Route):
    """No verdict yet, the route's tiny check case, and the default (Triton kernel) result of a
    call for comparison; the option itself is set by each test."""
    monkeypatch.setattr(gluon_check, "_verdicts", {})
    monkeypatch.setattr(route.check, "CASES", route.cases)
    monkeypatch.delenv("LOWBIT_ATTN_KERNEL", raising=False)
    q, k, v = _inputs()
    return (q, k, v), _call(q, k, v, route.recipe)


@pytest.fixture(params=list(ROUTES))
def routed(request, monkeypatch, triton_backend):
    """``(route, inputs, want)``, :func:`_fresh` for each route."""
    route = ROUTES[request.param]
    return (route, *_fresh(monkeypatch, route))


@contextlib.contextmanager
def no_gluon_warning():
    """The option's warning becomes an error (the interpreter's own warnings stay warnings)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LOWBIT_ATTN_KERNEL")
        yield


@contextlib.contextmanager
def gluon_warnings():
    """The messages of the option's warnings raised in the block (others are dropped)."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield messages
    messages += [str(w.message) for w in record if "LOWBIT_ATTN_KERNEL" in str(w.message)
                 and issubclass(w.category, RuntimeWarning)]


def _same(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.interpreter
def test_on_cpu_the_option_runs_the_triton_kernel_and_never_the_gluon_one(routed, monkeypatch):
    route, inputs, want = routed

    def never(*args, **kwargs):
        raise AssertionError("the Gluon forward was reached on CPU tensors")

    monkeypatch.setattr(route.launcher, "attention", never)
    monkeypatch.setattr(route.check, "self_check", never)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", route.value)
    with no_gluon_warning():
        _same(_call(*inputs, route.recipe), want)
    assert route.check.verdict(torch.device("cpu")) == "not checked"


def _counting(fn):
    """``fn`` standing in for a Gluon launcher; each call's head dim recorded (the FP4
    launcher's ``head_dim``, the INT8 one's Q's last dimension)."""
    calls = []

    def wrapper(qz, **kw):
        calls.append(kw["head_dim"] if "head_dim" in kw else qz.q.shape[-1])
        return fn(qz, **kw)

    return wrapper, calls


def _stand_in(kind: str, triton):
    """A stand-in for a Gluon launcher built on the Triton kernel's ``attention``: ``raises``,
    leaves ``out`` ``unwritten``, negates ``wrong-rows`` (the last 10, which see keys in every
    case), or returns a ``wrong-lse``; each call's arguments are recorded."""
    calls = []

    def fake(qz, **kw):
        calls.append(qz)
        if kind == "raises":
            raise RuntimeError("boom: no kernel image")
        if kind == "unwritten":
            return triton.attention(qz, **{**kw, "out": torch.empty_like(kw["out"])})
        lse = triton.attention(qz, **kw)
        if kind == "wrong-rows":
            kw["out"][:, :, -10:] *= -1
        return lse + 0.01 if kind == "wrong-lse" else lse

    return fake, calls


@pytest.mark.interpreter
@pytest.mark.parametrize("kind,reason", [
    ("raises", "RuntimeError: boom: no kernel image"),
    ("wrong-rows", None),
    ("unwritten", "outputs not finite or not written"),
    ("wrong-lse", "max |LSE gluon - triton| = 0.01"),
])
def test_a_failed_check_warns_once_and_keeps_the_triton_kernel(routed, monkeypatch, kind,
                                                                reason):
    route, inputs, want = routed
    reason = reason or route.wrong_rows
    monkeypatch.setattr(route.check, "applies", lambda device: True)  # a device it is written for
    fake, calls = _stand_in(kind, route.triton)
    monkeypatch.setattr(route.launcher, "attention", fake)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", route.value)
    with gluon_warnings() as messages:
        _same(_call(*inputs, route.recipe), want)
    (message,) = messages
    assert reason in message and "the Triton kernel runs instead" in message
    assert len(calls) == 1  # the check's one case; the call itself ran the Triton kernel
    with no_gluon_warning():  # no second warning, no second check
        _same(_call(*inputs, route.recipe), want)
    assert len(calls) == 1
    assert reason in route.check.verdict(torch.device("cpu"))
    for other in ROUTES.values():  # each route its own verdict
        if other.check is not route.check:
            assert other.check.verdict(torch.device("cpu")) == "not checked"


@pytest.mark.interpreter
def test_another_triton_version_is_refused_with_the_pin_as_reason(routed, monkeypatch):
    route, inputs, want = routed
    monkeypatch.setattr(route.check, "applies", lambda device: True)
    monkeypatch.setattr(triton, "__version__", "3.7.0")  # the real launcher, refused before launch
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", route.value)
    with gluon_warnings() as messages:
        _same(_call(*inputs, route.recipe), want)
    (message,) = messages
    assert re.search(r"written for Gluon's (Hopper|Blackwell) API of Triton "
                     r"3\.6\.x(, 3\.8\.x, 3\.9\.x)?, found Triton 3\.7\.0: install one of those",
                     message), message


@pytest.mark.interpreter
@pytest.mark.parametrize("value", ["sm90", "gluon"])
def test_a_passed_check_admits_the_sm90_forward_with_permuted_v(monkeypatch, triton_backend,
                                                                value):
    """``LOWBIT_ATTN_KERNEL=sm90`` (or ``gluon``): a stand-in with the Triton kernel's results
    passes the check; calls it covers then quantize V permuted and reach it (the same bits as the
    default path); calls it does not cover (D=32, 64-key blocks, packed sequences) never quantize
    for it or reach it."""
    route = ROUTES["int8-sm90"]
    inputs, want = _fresh(monkeypatch, route)
    seen = []

    def stand_in(qz, **kw):
        seen.append(qz.v_permuted)
        return kernel_int8.attention(qz, **kw)

    monkeypatch.setattr(sm90_check, "applies", lambda device: True)
    monkeypatch.setattr(kernel_int8_sm90, "attention", stand_in)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", value)
    with no_gluon_warning():
        _same(_call(*inputs, SM90_RECIPE), want)
        assert sm90_check.verdict(torch.device("cpu")) is None
        assert seen == [True, True]  # the check, then the call
        q32, k32, v32 = _inputs(d=32)
        got32 = _call(q32, k32, v32, SM90_RECIPE)
        got64 = _call(*inputs, SM90_RECIPE.replace(block_k=64))
        packed = [x[0].transpose(0, 1) for x in inputs]  # one sequence, [total, H, D]
        cu_q, cu_k = (torch.tensor([0, x.shape[0]], dtype=torch.int32) for x in packed[:2])
        varlen = (*packed, cu_q, cu_k, packed[0].shape[0], packed[1].shape[0])
        got_packed = lowbit_attn.attention_varlen(*varlen, recipe=SM90_RECIPE)
    assert seen == [True, True]
    monkeypatch.delenv("LOWBIT_ATTN_KERNEL")
    _same(got32, _call(q32, k32, v32, SM90_RECIPE))
    _same(got64, _call(*inputs, SM90_RECIPE.replace(block_k=64)))
    assert torch.equal(got_packed, lowbit_attn.attention_varlen(*varlen, recipe=SM90_RECIPE))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [sm90_check.CASES[0], sm90_check.CASES[5]], ids=str)
def test_the_sm90_check_builds_its_inputs(monkeypatch, case):
    """Two of the sm90 check's cases end to end on the interpreter (the Triton kernel standing in
    for the Gluon one, on the same permuted V): agreement gives no reason, a wrong row one."""
    monkeypatch.setattr(kernel_int8_sm90, "attention", kernel_int8.attention)
    assert sm90_check._compare(case, torch.device("cpu")) is None

    def wrong(qz, *, out, **kw):
        lse = kernel_int8.attention(qz, out=out, **kw)
        out[0, 0, 3] += 0.5
        return lse

    monkeypatch.setattr(kernel_int8_sm90, "attention", wrong)
    assert "max |gluon - triton|" in sm90_check._compare(case, torch.device("cpu"))


# --- the FP4 recipes: the Gluon FP4 forward for sm_100a (inference/gluon_fp4_check.py) ----------

FP4 = "qk_fp4_pv_fp4"


def test_the_fp4_recipes_follow_gluon(monkeypatch):
    for value, expected in (("triton", False), ("gluon", True), ("sm90", False)):
        monkeypatch.setenv("LOWBIT_ATTN_KERNEL", value)
        assert (KernelOptions.from_env().forward_kernel(torch.device("cpu")) == "gluon") \
            is expected, value


@pytest.mark.interpreter
def test_a_passed_fp4_check_admits_the_gluon_forward_for_what_it_takes(monkeypatch,
                                                                        triton_backend):
    """A stand-in with the Triton FP4 kernel's results passes; later FP4 calls go to it, what
    it refuses (ValueError before launching, as the real launcher does for D ≠ 128) to the
    Triton kernel; ``sm90`` leaves the FP4 recipes on the Triton kernel."""
    inputs, want = _fresh(monkeypatch, ROUTES["fp4-sm100"])

    def in_scope(qz, **kw):
        if kw["head_dim"] != 64:
            raise ValueError("head dim must be one of (64,) for the stand-in")
        return kernel_fp4.attention(qz, **kw)

    monkeypatch.setattr(gluon_fp4_check, "applies", lambda device: True)
    fake, calls = _counting(in_scope)
    monkeypatch.setattr(kernel_fp4_gluon, "attention", fake)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", "gluon")
    with no_gluon_warning():
        _same(_call(*inputs, FP4), want)
        assert gluon_fp4_check.verdict(torch.device("cpu")) is None
        assert calls == [64, 64]  # the check, then the call
        _same(_call(*inputs, FP4), want)
        assert len(calls) == 3
        q32, k32, v32 = _inputs(d=32)
        got = _call(q32, k32, v32, FP4)
        assert calls[3:] == [32]  # tried, refused
        monkeypatch.setenv("LOWBIT_ATTN_KERNEL", "sm90")
        _same(_call(*inputs, FP4), want)
        assert len(calls) == 4  # not tried
    monkeypatch.delenv("LOWBIT_ATTN_KERNEL")
    _same(got, _call(q32, k32, v32, FP4))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [
    gluon_fp4_check.Case(1, 2, 1, 30, 45, "mxfp4", causal=False, lse=True, two_level=False,
                         smooth_v=True, d=64),
    gluon_fp4_check.Case(1, 2, 1, 40, 20, "nvfp4", causal=True, lse=True, offset=-25, d=64),
], ids=str)
def test_the_fp4_check_builds_its_inputs(monkeypatch, case):
    """The FP4 check's cases run end to end on the interpreter, the Triton FP4 kernel standing
    in for the Gluon one: agreement gives no reason, wrong rows give one."""
    monkeypatch.setattr(kernel_fp4_gluon, "attention", kernel_fp4.attention)
    assert gluon_fp4_check._compare(case, torch.device("cpu")) is None
    monkeypatch.setattr(kernel_fp4_gluon, "attention", _stand_in("wrong-rows", kernel_fp4)[0])
    assert "cosine" in gluon_fp4_check._compare(case, torch.device("cpu"))


def test_the_fp4_check_cases_are_what_the_gluon_launcher_covers():
    """Every check case reaches the Gluon kernel (D=128, the recipes' blocks), so the check tests
    the kernel and not the fallback; both formats, both P̃ modes, causal and not, LSE and V's
    mean are among them."""
    cases = gluon_fp4_check.CASES
    assert all(c.d == 128 for c in cases)
    for recipe in gluon_fp4_check.RECIPES.values():
        r = lowbit_attn.get_recipe(recipe)
        assert (r.block_q, r.block_k, r.smooth_q, r.smooth_k) == (128, 64, True, True)
    assert {c.fmt for c in cases} == {"nvfp4", "mxfp4"}
    assert {c.two_level for c in cases} == {True, False}
    assert {c.causal for c in cases} == {True, False}
    assert any(c.lse for c in cases) and any(c.smooth_v for c in cases)
    assert abs(gluon_fp4_check.CHECK_COSINE - 0.9996) < 1e-5


@pytest.mark.interpreter
def test_the_gluon_fp4_kernel_run_by_the_cpu_model_passes_its_check():
    """The whole check (every case of ``gluon_fp4_check.CASES``) with the real Gluon FP4 kernel
    run by the CPU model (``tools/gluon_cpu.py``, the GPU's fused FMA, the eager interleaving)
    against the Triton FP4 kernel under the interpreter: the tolerances admit the kernel as far
    as the model can tell (the GPU's own roundings are what it cannot see)."""
    from lowbit_attn.tools import gluon_cpu

    try:
        kernel_fp4_gluon.check_version()
    except RuntimeError as e:  # pragma: no cover - another Triton
        pytest.skip(str(e))
    with gluon_cpu.kernel_on_cpu(kernel_fp4_gluon, "_attn_fwd_fp4_gluon_kernel", schedule="eager",
                                 numerics=gluon_cpu.Numerics(fused_fma=True)):
        assert gluon_fp4_check.self_check(torch.device("cpu")) is None


def test_a_cuda_check_runs_in_a_process_of_its_own(monkeypatch):
    """On a CUDA device the check runs in a child process: its verdict comes back, and a child
    that crashes (a faulting kernel kills its CUDA context) or hangs refuses the kernel with that
    as the reason instead of taking the caller down. Stand-in checks from tests/helpers.py; the
    child builds the device object only, so this runs on a CPU machine."""
    import os

    import helpers

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(helpers.__file__))
    cuda = torch.device("cuda", 0)
    assert gluon_check.isolated(cuda, helpers.check_passes, "x") is None
    assert gluon_check.isolated(cuda, helpers.check_fails, "x") == (
        "mismatch on cuda:0 with ('x',)")
    crashed = gluon_check.isolated(cuda, helpers.check_crashes)
    assert crashed.startswith("its check's process exited with code 3"), crashed
    monkeypatch.setattr(gluon_check, "CHECK_TIMEOUT", 2)
    assert gluon_check.isolated(cuda, helpers.check_hangs) == "its check did not finish in 2 s"
    ran = []
    assert gluon_check.checker(torch.device("cpu"), lambda d, s: ran.append((d, s)), "x")() is None
    assert ran == [(torch.device("cpu"), "x")]  # elsewhere (the CPU stand-ins): in this process

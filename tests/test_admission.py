"""The admission checks of the opt-in sm90 kernels (issue 43): the forward's
(``inference/sm90_check.py``, ``LOWBIT_ATTN_KERNEL=sm90``) and the backward's
(``training/sm90_check.py``, ``LOWBIT_ATTN_BWD_KERNEL=sm90``), both on ``inference/gluon_check.py``'s
machinery.

What a CPU can check: that the case lists cover what users run (asserted on the lists); the
checks' comparisons on the interpreter, with the real Gluon kernels run by the CPU model
(``tools/gluon_cpu.py``) on cases small enough for it, and with stand-ins that are right or wrong;
and the backward's routing: the loops are never reached without a passed check, a failed check
warns once and keeps the Triton backward. The real kernels against the Triton ones on a GPU:
tests/test_gpu.py (``-k "sm90 and admission"``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import triton

from helpers import require_gluon
require_gluon("hopper")  # before importing Gluon code

from lowbit_attn.core.options import KernelOptions
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import gluon_check, kernel_int8_sm90
from lowbit_attn.inference import sm90_check as fwd_check
from lowbit_attn.training import kernel_bwd, kernel_bwd_sm90
from lowbit_attn.training import sm90_check as bwd_check
from lowbit_attn.inference.gluon_check import Case

H100_SMS = 132


def _programs(case: Case) -> int:
    """The sm90 forward's grid: 64-row query tiles × B·Hq."""
    return triton.cdiv(case.nq, kernel_int8_sm90.BLOCK_M) * case.b * case.hq


# --- the case lists ---------------------------------------------------------------------------


def test_the_forward_check_covers_what_users_run():
    cases = fwd_check.CASES
    assert any(c.nq % 128 == 0 and c.nk % 128 == 0 for c in cases)  # unmasked tiles only
    assert any(c.nq % 16 == 0 and c.nk % 16 == 0 and (c.nq % 128 or c.nk % 128) for c in cases)
    assert any(c.nq % 16 and c.nk % 16 for c in cases)  # neither: the masked paths
    assert any(c.nq == 1 for c in cases) and any(c.nk == 1 for c in cases)
    for d in fwd_check.HEAD_DIMS:  # ≥ 2 programs on every SM of an H100, at each head dim
        assert max(_programs(c) for c in cases if c.d == d) >= 2 * H100_SMS, d
    assert max(c.b * c.hq for c in cases if c.nq == 1024) * 16 >= 2 * H100_SMS
    assert any(c.hq > c.hkv for c in cases) and any(c.hq == c.hkv for c in cases)
    assert {c.d for c in cases} == set(fwd_check.HEAD_DIMS)
    assert {c.causal for c in cases} == {True, False}
    assert {c.granularity for c in cases} == set(fwd_check.GRANULARITIES)
    assert {c.pv for c in cases} == {"fp8", "fp16"}
    assert any(c.lse for c in cases)
    for c in cases:  # each reaches the kernel (wanted), not the fallback
        recipe = lowbit_recipe(c)
        assert fwd_check.wanted(recipe, c.d, packed=False), c
    big = [c for c in cases if _programs(c) >= 2 * H100_SMS]
    assert {c.d for c in big} == {64, 128} and {c.causal for c in big} == {True, False}


def lowbit_recipe(case: Case):
    from lowbit_attn.core.recipes import get_recipe

    return get_recipe(f"qk_int8_pv_{case.pv}").replace(block_k=case.block_k,
                                                       granularity=case.granularity)


def test_the_backward_check_covers_what_users_run():
    dense = [c for c in bwd_check.CASES if isinstance(c, Case)]
    vsa = [c for c in bwd_check.CASES if isinstance(c, bwd_check.VsaCase)]
    assert {c.d for c in dense} == set(kernel_bwd_sm90.HEAD_DIMS)
    assert {c.causal for c in dense} == {True, False}
    assert {c.granularity for c in dense} == {"per_tile", "per_row"}
    assert any(c.hq > c.hkv for c in dense)
    assert any(c.nq % 128 == 0 and c.nk % 128 == 0 for c in dense)
    assert any(c.nq % 16 == 0 and c.nk % 16 == 0 and c.nq % 128 for c in dense)
    assert any(c.nq % 16 and c.nk % 16 for c in dense)
    assert any(c.nq == 1 for c in dense)
    assert len(vsa) == 1 and vsa[0].d in kernel_bwd_sm90.HEAD_DIMS
    assert 0 < vsa[0].last < kernel_bwd_sm90.BQ  # a partial tile
    assert abs(bwd_check.CHECK_COSINE - 0.99983) < 1e-5


# --- the comparisons on the interpreter -------------------------------------------------------

TINY_FWD = [Case(1, 2, 1, 1, 130, 64, 128, causal=True, lse=True, granularity="per_thread"),
            Case(1, 2, 2, 32, 1, 64, 128, causal=False, lse=True),
            # the one-key case the H200 failed (2026-11-29): the model agrees with the Triton kernel
            next(c for c in fwd_check.CASES if c.nk == 1),
            Case(1, 2, 1, 48, 144, 64, 128, causal=True, lse=True),
            Case(1, 2, 1, 70, 400, 64, 128, causal=True, lse=True, granularity="per_thread",
                 window=(150, 0), sinks=True)]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", TINY_FWD, ids=str)
def test_the_forward_check_passes_the_kernel_run_by_the_cpu_model(case):
    """The new kinds of case (one query, one key, counts that are multiples of 16, a causal
    window with sinks), the real sm90 kernel run by the CPU model against the Triton kernel on
    the interpreter."""
    from lowbit_attn.tools import gluon_cpu

    with gluon_cpu.kernel_on_cpu(kernel_int8_sm90, "_attn_fwd_sm90_kernel"):
        assert fwd_check._compare(case, torch.device("cpu")) is None


TINY_BWD = Case(1, 2, 1, 40, 72, 64, 64, causal=True, lse=False, granularity="per_row")


@pytest.mark.interpreter
def test_the_backward_check_passes_the_loops_run_by_the_cpu_model():
    """A backward case end to end: the real dK/dV and dQ loops run by the CPU model against the
    Triton backward on the interpreter."""
    from lowbit_attn.tools import gluon_cpu

    with gluon_cpu.kernel_on_cpu(kernel_bwd_sm90, "_dkdv_sm90_kernel"), \
            gluon_cpu.kernel_on_cpu(kernel_bwd_sm90, "_dq_sm90_kernel"):
        assert bwd_check._compare(TINY_BWD, torch.device("cpu")) is None


@pytest.mark.interpreter
def test_the_backward_check_passes_the_video_sparse_loops_run_by_the_cpu_model():
    """The video sparse case (a partial last tile, GQA) the same way: the loops on the CPU
    model against the Triton fine stage's backward on the interpreter."""
    from lowbit_attn.tools import gluon_cpu

    case = bwd_check.VsaCase(1, 2, 1, 2, 1, 64, last=40)
    with gluon_cpu.kernel_on_cpu(kernel_bwd_sm90, "_dkdv_sm90_kernel"), \
            gluon_cpu.kernel_on_cpu(kernel_bwd_sm90, "_dq_sm90_kernel"):
        assert bwd_check._compare(case, torch.device("cpu")) is None


def _triton_backward(ops, grad, lse, dq, dk, dv, *, causal_offset, softmax_scale):
    kernel_bwd.backward(ops, grad, lse, dq, dk, dv, causal_offset=causal_offset,
                        softmax_scale=softmax_scale, mode="recompute", kernel="triton")


@pytest.mark.interpreter
def test_the_backward_check_catches_wrong_stand_ins(monkeypatch):
    """The Triton backward standing in for the loops passes; one wrong dK row, an unwritten dQ
    or an exception each give a reason naming it (and, for a mismatch, its case)."""
    monkeypatch.setattr(kernel_bwd_sm90, "backward", _triton_backward)
    monkeypatch.setattr(bwd_check, "CASES", (TINY_BWD,))
    assert bwd_check.self_check(torch.device("cpu")) is None
    for wrong, reason in (("dk-row", f"{TINY_BWD}: dk: cosine"),
                          ("dq-unwritten", f"{TINY_BWD}: dq: "),
                          ("raises", "RuntimeError: boom")):
        def bad(ops, grad, lse, dq, dk, dv, wrong=wrong, **kw):
            if wrong == "raises":
                raise RuntimeError("boom")
            _triton_backward(ops, grad, lse, dq, dk, dv, **kw)
            if wrong == "dk-row":
                dk[0, 0, 5] *= -3
            else:
                dq.fill_(float("nan"))

        monkeypatch.setattr(kernel_bwd_sm90, "backward", bad)
        found = bwd_check.self_check(torch.device("cpu"))
        assert found is not None and found.startswith(reason), (wrong, found)


# --- the backward's routing -------------------------------------------------------------------


def _train_call(monkeypatch, value: str):
    """One trainable attention forward and backward on CPU tensors (the interpreter), with
    ``LOWBIT_ATTN_BWD_KERNEL=value``; the gradients."""
    import lowbit_attn

    monkeypatch.setenv("LOWBIT_ATTN_BWD_KERNEL", value)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).half().requires_grad_() for _ in range(3))
    out = lowbit_attn.trainable_attention(q, k, v, is_causal=True)
    return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


@pytest.fixture
def routed(monkeypatch, triton_backend):
    """No verdict yet; the loops replaced by a recorder that runs the Triton backward; the
    check's runs recorded (a stand-in check, set per test)."""
    monkeypatch.setattr(gluon_check, "_verdicts", {})
    ran = []

    def loops(ops, grad, lse, dq, dk, dv, **kw):
        ran.append("loops")
        _triton_backward(ops, grad, lse, dq, dk, dv, **kw)

    monkeypatch.setattr(kernel_bwd_sm90, "backward", loops)
    monkeypatch.setattr(kernel_bwd_sm90, "refusal", lambda ops, grad, mode: None)
    return ran


def _bwd_warnings():
    return warnings.catch_warnings(record=True)


@pytest.mark.interpreter
def test_the_backward_never_takes_the_loops_on_a_cpu(routed, monkeypatch):
    def never(device):
        raise AssertionError("the check ran for a CPU call")

    monkeypatch.setattr(bwd_check, "self_check", never)
    want = _train_call(monkeypatch, "triton")
    got = _train_call(monkeypatch, "sm90")
    assert routed == [] and bwd_check.verdict(torch.device("cpu")) == "not checked"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.interpreter
def test_a_failed_backward_check_warns_once_and_keeps_the_triton_backward(routed, monkeypatch):
    monkeypatch.setattr(bwd_check, "applies", lambda device: True)  # a device it is written for
    checks = []
    monkeypatch.setattr(bwd_check, "self_check",
                        lambda device: checks.append(device) or "dk: cosine 0.5 < 0.99983")
    want = _train_call(monkeypatch, "triton")
    assert checks == []  # the default never checks
    with _bwd_warnings() as record:
        warnings.simplefilter("always")
        got = _train_call(monkeypatch, "sm90")
        again = _train_call(monkeypatch, "sm90")
    messages = [str(w.message) for w in record if "LOWBIT_ATTN_BWD_KERNEL" in str(w.message)]
    assert len(messages) == 1 and "dk: cosine 0.5" in messages[0], messages
    assert "the Triton kernel runs instead" in messages[0]
    assert checks == [torch.device("cpu")] and routed == []
    assert "dk: cosine 0.5" in bwd_check.verdict(torch.device("cpu"))
    for a, b, c in zip(got, again, want):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.interpreter
def test_a_passed_backward_check_admits_the_loops(routed, monkeypatch):
    monkeypatch.setattr(bwd_check, "applies", lambda device: True)
    checks = []
    monkeypatch.setattr(bwd_check, "self_check", lambda device: checks.append(device))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LOWBIT_ATTN_BWD_KERNEL")
        _train_call(monkeypatch, "sm90")
        _train_call(monkeypatch, "sm90")
    assert len(checks) == 1 and routed == ["loops", "loops"]
    assert bwd_check.verdict(torch.device("cpu")) is None
    assert fwd_check.verdict(torch.device("cpu")) == "not checked"  # each kernel its own verdict
    _train_call(monkeypatch, "triton")
    assert routed == ["loops", "loops"]


def _out_of_resources(*args, **kwargs):
    """What a kernel raises when a call compiles to more shared memory than the device has."""
    raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")


def _compile_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "failed to compile" in str(w.message)]


@pytest.mark.interpreter
def test_a_backward_that_fails_to_compile_after_admission_falls_back_once(routed, monkeypatch):
    """Admitted loops that fail to compile a call (Triton's OutOfResources, raised before a
    launch) give the Triton backward's gradients with one warning, and are not tried again."""
    monkeypatch.setattr(bwd_check, "applies", lambda device: True)
    monkeypatch.setattr(bwd_check, "self_check", lambda device: None)
    want = _train_call(monkeypatch, "triton")
    _train_call(monkeypatch, "sm90")
    assert routed == ["loops"]
    monkeypatch.setattr(kernel_bwd_sm90, "backward",
                        lambda *a, **kw: routed.append("raised") or _out_of_resources())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _train_call(monkeypatch, "sm90")
        again = _train_call(monkeypatch, "sm90")
    messages = _compile_warnings(record)
    assert len(messages) == 1 and "'sm90-bwd'" in messages[0] and "OutOfResources" in messages[0]
    assert routed == ["loops", "raised"]
    assert bwd_check.verdict(torch.device("cpu")).startswith("OutOfResources on a later call")
    for a, b, c in zip(got, again, want):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.interpreter
def test_a_forward_that_fails_to_compile_after_admission_falls_back_once(monkeypatch,
                                                                          triton_backend):
    """The same for the sm90 forward: the call that fails to compile and every later one get the
    Triton kernel's result; one warning; a ValueError (a case the launcher does not cover) still
    falls back without refusing the kernel."""
    import lowbit_attn

    monkeypatch.setattr(gluon_check, "_verdicts", {})
    monkeypatch.setattr(fwd_check, "applies", lambda device: True)
    monkeypatch.setattr(fwd_check, "self_check", lambda device: None)
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_k=128)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).half() for _ in range(3))

    def call():
        return lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True)

    monkeypatch.delenv("LOWBIT_ATTN_KERNEL", raising=False)
    want = call()
    tried = []

    def launcher(qz, **kw):
        tried.append(len(tried))
        if len(tried) == 1:
            raise ValueError("not a case this kernel covers")
        _out_of_resources()

    monkeypatch.setattr(kernel_int8_sm90, "attention", launcher)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", "sm90")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        refused = call()
        assert fwd_check.verdict(torch.device("cpu")) is None  # a ValueError refuses nothing
        failed, again = call(), call()
    messages = _compile_warnings(record)
    assert len(messages) == 1 and "'sm90'" in messages[0] and "OutOfResources" in messages[0]
    assert tried == [0, 1]
    assert "OutOfResources" in fwd_check.verdict(torch.device("cpu"))
    for got in (refused, failed, again):
        assert torch.equal(got, want)


def test_kernel_for_asks_the_check_only_when_the_option_and_the_device_say_so(monkeypatch):
    monkeypatch.setattr(gluon_check, "_verdicts", {})
    asked = []
    monkeypatch.setattr(bwd_check, "admitted", lambda device: asked.append(device) or True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(bwd_check, "applies", lambda device: False)
    assert bwd_check.kernel_for(cuda, "sm90") == "triton" and asked == []
    monkeypatch.setattr(bwd_check, "applies", lambda device: True)
    assert bwd_check.kernel_for(cuda, "triton") == "triton" and asked == []
    assert bwd_check.kernel_for(cuda, "sm90") == "sm90" and asked == [cuda]
    monkeypatch.setattr(bwd_check, "admitted", lambda device: False)
    assert bwd_check.kernel_for(cuda, "sm90") == "triton"


@pytest.mark.parametrize("capability,kernel", [((9, 0), "sm90"), ((8, 9), "triton"),
                                               ((8, 0), "triton")])
def test_the_default_backward_is_the_one_measured_on_the_architecture(monkeypatch, capability,
                                                                      kernel):
    """``LOWBIT_ATTN_BWD_KERNEL`` unset: the sm90 loops on Hopper (the H200 run of 2026-11-29),
    admitted as the option's are; the Triton backward where no run measured another."""
    from lowbit_attn.core import measured

    assert KernelOptions().bwd_kernel == "measured"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bwd_check.torch.cuda, "get_device_capability", lambda device: capability)
    monkeypatch.setattr(bwd_check, "applies", lambda device: True)
    asked = []
    monkeypatch.setattr(bwd_check, "admitted", lambda device: asked.append(device) or True)
    cuda = torch.device("cuda", 0)
    assert bwd_check.kernel_for(cuda, "measured") == kernel
    assert asked == ([cuda] if kernel == "sm90" else [])
    monkeypatch.setattr(bwd_check, "admitted", lambda device: False)  # not (yet) admitted
    assert bwd_check.kernel_for(cuda, "measured") == "triton"
    monkeypatch.setattr(bwd_check, "applies", lambda device: False)  # not a device they run on
    monkeypatch.setattr(bwd_check, "admitted", lambda device: True)
    assert bwd_check.kernel_for(cuda, "measured") == "triton"
    assert measured.kernel_choice("bwd_kernel", "interpreter") is None


# --- the verdict on disk, the check in the background (issue 43: a first call pays ≤ 2 s) -----

STAND_IN = "stand-in"  # the kernel's key among the verdicts
CUDA = torch.device("cuda", 0)


def _admit(device, check, *args):
    return gluon_check.admit(device, STAND_IN, gluon_check.checker(device, check, *args),
                             "the stand-in kernel", "the Triton kernel")


def _route(device, check, *args):
    """What a call runs (``gluon_check.dispatch``, as every checked kernel's route)."""
    return gluon_check.dispatch(device, STAND_IN, lambda d: True,
                                lambda d: _admit(d, check, *args),
                                lambda: "admitted kernel", lambda: "triton kernel")


def _new_process(monkeypatch):
    """This process's verdicts forgotten, as a later process starts (the disk keeps its own)."""
    monkeypatch.setattr(gluon_check, "_verdicts", {})


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as the machinery sees it on this CPU machine: its facts made up, no capture;
    stand-in checks (tests/helpers.py) run in child processes that build the device object
    only."""
    import os

    import helpers

    _new_process(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(helpers.__file__))
    monkeypatch.setattr(gluon_check, "graph_capturing", lambda device: False)
    monkeypatch.setattr(gluon_check, "_device_facts", lambda device: {
        "device": "NVIDIA H100 stand-in", "capability": [9, 0], "driver": 12080, "cuda": "12.8"})
    return helpers


def _wait_until(predicate, seconds=120.0):
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the stand-in check never finished"
        time.sleep(0.05)


def test_a_first_call_starts_the_check_and_runs_the_triton_kernel_at_once(fake_gpu):
    """The check (a child that sleeps 3 s after starting Python) does not hold the first call
    up: it returns the Triton kernel's result well before the verdict; later calls poll, still
    on the Triton kernel, until the verdict is in, then take the admitted kernel. The child
    stored the verdict on disk."""
    import time

    t0 = time.perf_counter()
    assert _route(CUDA, fake_gpu.check_sleeps, "3") == "triton kernel"
    first = time.perf_counter() - t0
    assert first < 1.0, first  # the spawn, not the check (which takes > 3 s)
    assert gluon_check.verdict(CUDA, STAND_IN) == gluon_check.RUNNING
    assert _route(CUDA, fake_gpu.check_sleeps, "3") == "triton kernel"
    _wait_until(lambda: gluon_check.verdict(CUDA, STAND_IN) is None)
    assert time.perf_counter() - t0 > 3
    assert _route(CUDA, fake_gpu.check_sleeps, "3") == "admitted kernel"
    path, record = gluon_check.checker(CUDA, fake_gpu.check_sleeps, "3").where(STAND_IN)
    assert gluon_check.load_verdict(path, record) == (True, None)


def test_wait_for_admission_blocks_until_the_verdict(fake_gpu):
    assert not _admit(CUDA, fake_gpu.check_sleeps, "1")
    assert gluon_check.wait_for_admission() == {f"{STAND_IN}@0": None}
    assert _admit(CUDA, fake_gpu.check_sleeps, "1")
    assert gluon_check.wait_for_admission(timeout=0) == {f"{STAND_IN}@0": None}


def test_a_stored_verdict_is_read_by_a_later_process_without_a_check(fake_gpu, monkeypatch):
    """A later process (this one's verdicts forgotten) reads the verdict from disk at its first
    call and takes the kernel at once: no child process."""
    import time

    assert not _admit(CUDA, fake_gpu.check_passes)
    gluon_check.wait_for_admission()
    _new_process(monkeypatch)

    def no_child(*args):
        raise AssertionError("a check started although its verdict is on disk")

    monkeypatch.setattr(gluon_check, "_Child", no_child)
    t0 = time.perf_counter()
    assert _route(CUDA, fake_gpu.check_passes) == "admitted kernel"
    assert time.perf_counter() - t0 < 0.5


class _Starts:
    """Stand-in child processes: each start recorded, each decided at once with ``verdict``."""

    def __init__(self, verdict=None):
        self.verdict, self.records = verdict, []

    def __call__(self, device, check, args, path, record):
        self.records.append(record)
        if path is not None:
            gluon_check.store_verdict(path, record, self.verdict)
        return gluon_check._Done(self.verdict)


@pytest.mark.parametrize("change", ["triton", "torch", "sources", "cases", "device", "driver"])
def test_a_verdict_is_keyed_by_what_could_change_it(fake_gpu, monkeypatch, change):
    """A stored verdict is for one device, driver, software and source: change any and the next
    process checks again."""
    starts = _Starts()
    monkeypatch.setattr(gluon_check, "_Child", starts)
    assert _admit(CUDA, fake_gpu.check_passes) and len(starts.records) == 1
    _new_process(monkeypatch)
    assert _admit(CUDA, fake_gpu.check_passes) and len(starts.records) == 1  # read from disk
    _new_process(monkeypatch)
    if change in ("triton", "torch"):
        monkeypatch.setattr(triton if change == "triton" else torch, "__version__", "9.9.9")
    elif change == "sources":  # an edited kernel, Gluon block or check
        monkeypatch.setattr(gluon_check, "_sources_digest", lambda: "0" * 64)
    elif change == "cases":
        monkeypatch.setattr(fake_gpu, "CASES", ("another case",), raising=False)
    else:
        facts = gluon_check._device_facts(CUDA)
        facts.update(device="NVIDIA H200") if change == "device" else facts.update(driver=13000)
        monkeypatch.setattr(gluon_check, "_device_facts", lambda device: facts)
    assert _admit(CUDA, fake_gpu.check_passes) and len(starts.records) == 2
    assert starts.records[0] != starts.records[1]


@pytest.mark.parametrize("content", ["{not json", "", '{"record": {}, "verdict": null}', "[1]",
                                     None])
def test_a_corrupt_or_foreign_verdict_file_is_ignored(fake_gpu, monkeypatch, content):
    """A file that is not JSON, is empty, is for another record or is a folder: the check runs
    again, and its verdict replaces the file."""
    import os

    starts = _Starts()
    monkeypatch.setattr(gluon_check, "_Child", starts)
    path, record = gluon_check.checker(CUDA, fake_gpu.check_passes).where(STAND_IN)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if content is None:
        os.makedirs(path)  # unreadable as a file, and not replaceable: kept in memory only
    else:
        with open(path, "w") as f:
            f.write(content)
    assert _admit(CUDA, fake_gpu.check_passes) and len(starts.records) == 1
    assert gluon_check.load_verdict(path, record) == ((False, None) if content is None
                                                      else (True, None))
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tmp")] == []


def test_a_failed_verdict_is_stored_and_warned_once_per_process(fake_gpu, monkeypatch):
    starts = _Starts("dk: cosine 0.5 < 0.99983")
    monkeypatch.setattr(gluon_check, "_Child", starts)
    for process in range(2):  # the one that checks, then one that reads the verdict from disk
        _new_process(monkeypatch)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert _route(CUDA, fake_gpu.check_passes) == "triton kernel"
            assert _route(CUDA, fake_gpu.check_passes) == "triton kernel"
        messages = [str(w.message) for w in record if "stand-in kernel" in str(w.message)]
        assert len(messages) == 1 and "dk: cosine 0.5" in messages[0], (process, messages)
        assert "dk: cosine 0.5" in gluon_check.verdict(CUDA, STAND_IN)
    assert len(starts.records) == 1


@pytest.mark.parametrize("reason,kept", [
    (None, True), ("Case(...): cosine 0.5 < 0.99996", True),
    ("its check's process exited with code -4: ", True),  # an illegal instruction
    ("its check did not finish in 600 s", False),
    ("OutOfMemoryError: CUDA out of memory", False),
    ("its check's process exited with code -9: ", False),  # killed from outside
    ("its check's process exited with code -2: KeyboardInterrupt", False),
    ("its check could not start: [Errno 11] Resource temporarily unavailable", False),
])
def test_only_lasting_verdicts_are_stored(tmp_path, reason, kept):
    path = str(tmp_path / "v.json")
    gluon_check.store_verdict(path, {"k": 1}, reason)
    assert gluon_check.load_verdict(path, {"k": 1}) == ((True, reason) if kept else (False, None))


def test_a_check_that_cannot_start_refuses_the_kernel_for_this_process_only(fake_gpu,
                                                                          monkeypatch):
    def no_process(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(gluon_check.subprocess, "Popen", no_process)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _route(CUDA, fake_gpu.check_passes) == "triton kernel"
    assert any("its check could not start" in str(w.message) for w in record)
    path, record_ = gluon_check.checker(CUDA, fake_gpu.check_passes).where(STAND_IN)
    assert gluon_check.load_verdict(path, record_) == (False, None)


def test_a_crashed_check_is_refused_and_stored(fake_gpu):
    assert not _admit(CUDA, fake_gpu.check_crashes)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        verdicts = gluon_check.wait_for_admission()
    assert verdicts[f"{STAND_IN}@0"].startswith("its check's process exited with code 3")
    path, record = gluon_check.checker(CUDA, fake_gpu.check_crashes).where(STAND_IN)
    assert gluon_check.load_verdict(path, record)[0]


@pytest.mark.parametrize("during", ["capture", "compile"])
def test_nothing_starts_during_a_capture_or_a_trace(fake_gpu, monkeypatch, during):
    """Inside a CUDA graph capture or torch.compile tracing a call neither reads nor starts
    anything: it runs the Triton kernel, and the first call outside one starts the check."""
    starts = _Starts()
    monkeypatch.setattr(gluon_check, "_Child", starts)
    inside = [True]
    if during == "capture":
        monkeypatch.setattr(gluon_check, "graph_capturing", lambda device: inside[0])
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: inside[0])
    assert _route(CUDA, fake_gpu.check_passes) == "triton kernel"
    assert starts.records == [] and gluon_check.verdict(CUDA, STAND_IN) == "not checked"
    inside[0] = False
    assert _route(CUDA, fake_gpu.check_passes) == "admitted kernel"
    assert len(starts.records) == 1


def test_a_check_s_reason_says_where_outputs_are_not_finite():
    """A GPU run's reason is all the next session sees: it names the indices, dimension by
    dimension (here one column of every row of every head)."""
    want = torch.zeros(1, 4, 96, 64)
    got = want.clone()
    got[..., 3] = float("nan")
    reason = gluon_check.compare_outputs(got, want, None, None, atol=1e-3, cosine=0.99,
                                         lse_atol=0.0)
    where = ("384 outputs not finite or not written at indices 1 of 1 (0); "
             "4 of 4 (0,1,2,3); 96 of 96 (0,1,2,3,4,5,…); 1 of 64 (3)")
    assert reason == where + "; the Triton kernel's: 0 not finite, 0 of them at the same places"
    # and whether the Triton kernel's are too (a cause in the shared quantized operands)
    want[..., 3] = float("inf")
    want[0, 0, 0, 0] = float("nan")
    reason = gluon_check.compare_outputs(got, want, None, None, atol=1e-3, cosine=0.99,
                                         lse_atol=0.0)
    assert reason == where + "; the Triton kernel's: 385 not finite, 384 of them at the same places"

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
from lowbit_attn.inference import gluon_check, kernel_int8, kernel_int8_sm90
from lowbit_attn.inference import sm90_check as fwd_check
from lowbit_attn.training import kernel_bwd, kernel_bwd_sm90, op as train_op
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
        assert fwd_check.wanted(recipe, c.d, packed=False, q_in_kernel=False), c
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
            Case(1, 2, 1, 48, 144, 64, 128, causal=True, lse=True)]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", TINY_FWD, ids=str)
def test_the_forward_check_passes_the_kernel_run_by_the_cpu_model(case):
    """The new kinds of case (one query, one key, counts that are multiples of 16), the real
    sm90 kernel run by the CPU model against the Triton kernel on the interpreter."""
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
    assert KernelOptions().bwd_kernel == "triton"

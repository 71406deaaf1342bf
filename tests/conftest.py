"""Test set-up: the Triton interpreter on CPU-only machines (set before triton is imported), the
markers, the ``device`` fixture (each target the Triton kernels run on), a NaN-poisoned
allocator and a seeded global generator."""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from helpers import Target, pinned_codegen, poison  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The targets of the ``device`` fixture: the interpreter on CPU tensors where TRITON_INTERPRET is
# on, the compiled kernels where a CUDA GPU is; a run skips the other (collected, never run).
TARGETS = [
    pytest.param(Target("cpu"), id="cpu", marks=pytest.mark.interpreter),
    pytest.param(Target("cuda"), id="cuda", marks=pytest.mark.gpu),
]


def _parametrized_by_the_test(metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return True
    return False


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    # last, so the target ends each test's id: test_x[<its own parameters>-cpu]; a test with a
    # parameter of its own called device (a CLI argument) keeps it
    if "device" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "device"):
        metafunc.parametrize("device", TARGETS, indirect=True)


@pytest.fixture
def device(request) -> Target:
    """The target a kernel-against-twin test runs on, one test per target: ``device.name`` is the
    torch device of its inputs, ``device.bound(kind, bound)`` how close kernel and twin are there
    (tests/helpers.py). A case marked ``gpu`` (GPU-sized shapes) runs on the cuda target alone;
    ``device.needs(recipe)`` skips what the GPU cannot run."""
    return request.param


def pytest_collection_modifyitems(config, items):
    from lowbit_attn.core import triton_support

    pinned = pinned_codegen()
    skip_codegen = pytest.mark.skip(
        reason=f"a schedule Triton {triton_support.PINNED}'s code generation gives (the GPU "
        f"machines' Triton), not Triton {triton_support.installed_version()}'s")
    from lowbit_attn.tools import triton_compat

    aot_here = triton_support.series() in triton_compat.WRITTEN_FOR
    skip_aot = pytest.mark.skip(
        reason=f"the ahead-of-time and launch tooling reads internals of Triton "
        f"{', '.join(triton_compat.WRITTEN_FOR)}, not of Triton {triton_support.installed_version()}")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (Triton on CPU tensors)")
    skip_sized = pytest.mark.skip(reason="a GPU-sized case: the cuda target's alone")
    for item in items:
        target = item.callspec.params.get("device") if hasattr(item, "callspec") else None
        target = target if isinstance(target, Target) else None  # (test_cli's own device strings)
        if target is not None and not target.interpreted and "interpreter" in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: a test that takes `device` gets the "
                                    "interpreter mark from its cpu target, not a mark of its own")
        if target is not None and target.interpreted and "gpu" in item.keywords:
            item.add_marker(skip_sized)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)
        if "pinned_codegen" in item.keywords and not pinned:
            item.add_marker(skip_codegen)
        if ("aot" in item.keywords or "triton_internals" in item.keywords) and not aot_here:
            item.add_marker(skip_aot)


@pytest.fixture(autouse=True)
def seeded_generators():
    """Every test starts from the same global random state, whatever ran before it: a test that
    draws from ``torch.randn`` without a generator sees the same inputs alone and in the suite."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """Fresh ``torch.empty`` memory is NaN (or -128 for int8): reading what a kernel did not write
    fails loudly instead of passing by luck."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return poison(empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", poisoned_empty_like)


@pytest.fixture(autouse=True)
def admission_verdicts(monkeypatch, tmp_path_factory):
    """Admission verdicts (``gluon_check.verdict_dir``) go to a folder of this test's own, not to
    Triton's cache directory: a test's stand-in verdict never reaches another test or a later
    run, and each test that checks a kernel sees no verdict stored."""
    from lowbit_attn.inference import gluon_check

    folder = str(tmp_path_factory.mktemp("verdicts"))
    monkeypatch.setattr(gluon_check, "verdict_dir", lambda: folder)


@pytest.fixture
def triton_backend(monkeypatch):
    """Route the public API to the Triton kernels (interpreted on CPU tensors)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")

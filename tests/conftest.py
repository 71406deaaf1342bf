"""Test set-up: the Triton interpreter on CPU-only machines (set before triton is imported), the
markers, a NaN-poisoned allocator and a shared closeness check."""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (Triton on CPU tensors)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.int8:
        t.fill_(-128)  # never produced by the quantizers, which clamp to ±127
    elif t.dtype == torch.uint8:
        t.fill_(0xFF)  # packed FP4 (-6, -6) or an E8M0 NaN scale: loud in bit comparisons
    return t


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """Fresh ``torch.empty`` memory is NaN (or -128 for int8): reading what a kernel did not write
    fails loudly instead of passing by luck."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return _poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return _poison(empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", poisoned_empty_like)


@pytest.fixture
def triton_backend(monkeypatch):
    """Route the public API to the Triton kernels (interpreted on CPU tensors)."""
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "triton")


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.setenv("LOWBIT_ATTN_BACKEND", "reference")

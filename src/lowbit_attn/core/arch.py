"""Which GPU architecture and which backend serve a call.

``LOWBIT_ATTN_ARCH`` (``sm_80``, ``sm_89``, ``sm_90a``, ``sm_100a``, ``sm_120a``) overrides the probed
architecture, so recipes can be chosen and kernels compiled for a chip that is not present.
``LOWBIT_ATTN_BACKEND`` picks the implementation: ``auto`` (Triton on a GPU, the PyTorch reference on
a CPU), ``triton`` (also on a CPU, through ``TRITON_INTERPRET=1``) or ``reference``.
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import torch

from lowbit_attn.core import triton_support
from lowbit_attn.core.triton_support import triton_installed

BACKENDS = ("auto", "triton", "reference")


def parse_arch(arch: str) -> tuple[int, int]:
    """``"sm_90a"`` → ``(9, 0)``; ``"sm_120a"`` → ``(12, 0)``."""
    match = re.fullmatch(r"sm_(\d+)(\d)a?", arch.strip())
    if not match:
        raise ValueError(f"architecture must look like 'sm_90a' or 'sm_120a', got {arch!r}")
    return int(match.group(1)), int(match.group(2))


def arch_name(capability: tuple[int, int]) -> str:
    major, minor = capability
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


@functools.lru_cache(maxsize=None)
def get_capability() -> tuple[int, int] | None:
    """The CUDA capability that kernels target: ``LOWBIT_ATTN_ARCH`` if set, else the current GPU's,
    else ``None`` (no GPU)."""
    override = os.environ.get("LOWBIT_ATTN_ARCH")
    if override:
        return parse_arch(override)
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()
    return None


def get_arch() -> str | None:
    cap = get_capability()
    return None if cap is None else arch_name(cap)


def native_fp4(capability: tuple[int, int] | None) -> bool:
    """Whether FP4 attention runs on block-scaled FP4 tensor cores: Blackwell (sm_100 and newer,
    ``tcgen05.mma`` / ``mma.sync … block_scale``). Elsewhere the same kernel unpacks FP4 to bf16."""
    return capability is not None and capability >= (10, 0)


def fp4_pipeline_qk(capability: tuple[int, int] | None) -> bool:
    """Whether the native FP4 attention issues the next key block's Q·Kᵀ before this block's
    softmax: on sm_120 (``mma.sync`` block-scaled products, which ptxas interleaves with the
    softmax's ALU work). sm_100 keeps the serial loop (its products go through tensor memory)."""
    return native_fp4(capability) and capability[0] >= 12


def tensor_memory(capability: tuple[int, int] | None) -> bool:
    """Whether Triton's MMAs accumulate in tensor memory (``tcgen05``: sm_100 family). Triton 3.6
    cannot lower a tile's reduction to a scalar there when the tile comes from such MMAs (its
    tensor-memory layout pass fails), so the kernels keep that reduction two-dimensional."""
    return capability is not None and 10 <= capability[0] < 12


def fp4_mode(device_type: str, backend: str, capability: tuple[int, int] | None) -> str:
    """How FP4 recipes run for a call: ``"native"`` (FP4 tensor cores), ``"emulated"`` (the same
    Triton kernel computing the identical function through bf16 or fp32 products) or
    ``"reference"`` (the PyTorch twin)."""
    if backend != "triton":
        return "reference"
    if device_type == "cuda" and native_fp4(capability) and not interpreter_enabled():
        return "native"
    return "emulated"


# os.environ's own table, read directly: os.environ.get costs ~1 µs a name (it encodes the name)
ENV = os.environ._data
_INTERPRET = os.environ.encodekey("TRITON_INTERPRET")
_OFF = (os.environ.encodevalue(""), os.environ.encodevalue("0"))


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET`` set to anything but ``""`` or ``"0"`` (read from :data:`ENV`: a host
    path asks on every call)."""
    return ENV.get(_INTERPRET, _OFF[1]) not in _OFF


def graph_capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured in a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def no_triton(what: str) -> str:
    """``what`` needs Triton, and why it cannot have it."""
    reason = triton_support.triton_import_error()
    if reason in (None, "not installed"):
        return (f"{what} needs Triton, which is not installed (Triton publishes wheels for Linux "
                "on x86_64 and aarch64 only: `pip install triton` there)")
    return f"{what} needs Triton, which is {reason}"


@functools.lru_cache(maxsize=None)
def _warn_no_triton() -> None:
    """Once per process: CUDA tensors without Triton run the reference path."""
    warnings.warn(no_triton("lowbit_attn's kernels") + "; CUDA tensors run the "
                  "PyTorch reference path instead (the recipe's numerics, not its speed)",
                  stacklevel=4)


def traceable(cached):
    """``cached`` (a ``functools`` cache), or under ``torch.compile`` the function it wraps:
    Dynamo traces the function either way, and warns once per process where it meets the
    cache."""
    return cached.__wrapped__ if torch.compiler.is_compiling() else cached


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for tensors on ``device``."""
    choice = os.environ.get("LOWBIT_ATTN_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"LOWBIT_ATTN_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "reference" or device.type == "meta":  # meta: shapes only, no kernel to run
        return "reference"
    if not traceable(triton_installed)():
        if choice == "triton":
            raise RuntimeError(no_triton("LOWBIT_ATTN_BACKEND=triton"))
        if device.type == "cuda":
            _warn_no_triton()
        return "reference"
    if device.type == "cuda":
        return "triton"
    if choice == "triton":
        if not interpreter_enabled():
            raise RuntimeError(
                "LOWBIT_ATTN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before "
                "triton is imported"
            )
        return "triton"
    return "reference"

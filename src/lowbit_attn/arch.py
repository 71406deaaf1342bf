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

import torch

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


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for tensors on ``device``."""
    choice = os.environ.get("LOWBIT_ATTN_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"LOWBIT_ATTN_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "reference":
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

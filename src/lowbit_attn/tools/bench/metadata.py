"""What a result was measured on: device, versions, source revision, date, host, command."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import shlex
import socket
import sys
from pathlib import Path

import torch

from lowbit_attn.core.arch import arch_name, backend_for


def _versions() -> dict:
    import importlib.metadata as md

    import triton

    from lowbit_attn import __version__

    def dist(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cudnn = None
    with contextlib.suppress(Exception):
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "lowbit_attn": __version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "sageattention": dist("sageattention"),
    }


def device_metadata(device: str) -> dict:
    if device == "cuda":
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        cap = torch.cuda.get_device_capability(idx)
        return {
            "device": "cuda",
            "device_name": torch.cuda.get_device_name(idx),
            "capability": list(cap),
            "arch": arch_name(cap),
            "sm_count": props.multi_processor_count,
            "total_memory_gib": round(props.total_memory / 2**30, 1),
        }
    cpu = platform.processor() or platform.machine() or "unknown"
    return {
        "device": "cpu",
        "device_name": f"CPU ({cpu}, {os.cpu_count()} cores)",
        "capability": None,
        "arch": None,
        "sm_count": None,
        "total_memory_gib": None,
    }


def checkout_root() -> Path | None:
    """The source checkout the package runs from (``src/lowbit_attn`` beside ``pyproject.toml``
    and ``benchmarks/``), or None for an installed package (whose ``parents`` are the
    environment's, perhaps inside another project's repository)."""
    root = Path(__file__).resolve().parents[4]
    if (root / "pyproject.toml").is_file() and (root / "benchmarks").is_dir():
        return root
    return None


def _git_revision() -> str | None:
    """``<commit>`` or ``<commit>+dirty`` of the source checkout, when there is one."""
    import subprocess

    root = checkout_root()
    if root is None:
        return None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True, timeout=10)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def make_metadata(*, device: str, mode: str, protocol: dict, argv: list[str] | None = None) -> dict:
    now = dt.datetime.now(dt.timezone.utc)
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("LOWBIT_ATTN_", "TRITON_")) or k == "CUDA_VISIBLE_DEVICES"}
    meta = {
        "schema": 1,
        "mode": mode,
        **device_metadata(device),
        "date_utc": now.isoformat(timespec="seconds"),
        "date": now.strftime("%Y-%m-%d"),
        "hostname": socket.gethostname(),
        "command": shlex.join(sys.argv if argv is None else argv),
        "versions": _versions(),
        "git": _git_revision(),
        "backend": backend_for(torch.device(device)),
        "environment": env,
        "protocol": protocol,
    }
    return meta

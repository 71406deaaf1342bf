"""`make check-resolve`: the package's dependencies beside each supported torch resolve without
changing that torch, and Triton resolves to the series that torch pins
(``lowbit_attn.core.triton_support.TORCH_TRITON``).

uv resolves from the index's metadata alone (PEP 658 files, or range requests into a wheel's
directory): no torch, Triton or CUDA wheel is downloaded. Each torch is resolved for Linux x86_64
and aarch64 (Triton wheels exist for both) and for Windows and macOS, where the package must ask
for no Triton at all. On aarch64 torch 2.8 to 2.10 pin no Triton (their wheels there are CPU-only):
then the one resolved must only lie in the package's range.

Usage: python .ci/check_resolve.py UV [TORCH_VERSION ...]
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The module alone (it imports neither torch nor Triton), not the package.
_spec = importlib.util.spec_from_file_location(
    "triton_support", ROOT / "src" / "lowbit_attn" / "core" / "triton_support.py")
triton_support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triton_support)
TORCH_TRITON, series = triton_support.TORCH_TRITON, triton_support.series

# The newest patch release of each supported torch.
TORCHES = ("2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")
LINUX = ("x86_64-manylinux_2_28", "aarch64-manylinux_2_28")
ELSEWHERE = ("x86_64-pc-windows-msvc", "aarch64-apple-darwin")
PYTHON = "3.11"
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)\s*(?:#\s*via\s+(.*))?$")


def resolve(uv: str, torch: str, platform: str) -> dict[str, tuple[str, str]]:
    """``{name: (version, via)}`` of the resolution of the package beside ``torch==<torch>``."""
    with tempfile.NamedTemporaryFile("w", suffix=".in") as pin:
        pin.write(f"torch=={torch}\n")
        pin.flush()
        done = subprocess.run(
            [uv, "pip", "compile", "--quiet", "--annotation-style", "line", "--python-version",
             PYTHON, "--python-platform", platform, str(ROOT / "pyproject.toml"), pin.name],
            capture_output=True, text=True,
            env={**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0"})  # torch 2.12 on: macOS 14
    if done.returncode != 0:
        raise SystemExit(f"torch=={torch} on {platform}: no resolution\n{done.stderr}")
    found = {}
    for line in done.stdout.splitlines():
        match = PIN.match(line.strip())
        if match:
            found[match[1].lower()] = (match[2], match[3] or "")
    return found


def check(uv: str, torch: str, platform: str) -> str:
    found = resolve(uv, torch, platform)
    where = f"torch=={torch} on {platform}"
    if found.get("torch", ("",))[0] != torch:
        raise SystemExit(f"{where}: torch changed to {found.get('torch')}")
    triton = found.get("triton")
    if platform in ELSEWHERE:
        if triton is not None:
            raise SystemExit(f"{where}: Triton {triton[0]} asked for where it has no wheels")
        return "no triton"
    if triton is None:
        raise SystemExit(f"{where}: no Triton resolved")
    version, via = triton
    want = TORCH_TRITON[series(torch)]
    if "torch" in via:  # torch itself pins it: ours must admit exactly that one
        if series(version) != want:
            raise SystemExit(f"{where}: Triton {version}, torch pins {want}.x")
    elif not (3, 4) <= tuple(int(x) for x in series(version).split(".")) < (3, 10):
        raise SystemExit(f"{where}: Triton {version} outside the package's range")
    return f"triton {version}" + ("" if "torch" in via else " (torch pins none here)")


def main(argv: list[str]) -> int:
    uv, torches = argv[0], argv[1:] or TORCHES
    missing = {series(t) for t in torches} - set(TORCH_TRITON)
    if missing:
        raise SystemExit(f"no Triton series recorded for torch {sorted(missing)}")
    unchecked = set(TORCH_TRITON) - {series(t) for t in TORCHES}
    if unchecked:
        raise SystemExit(f"TORCHES names no release of torch {sorted(unchecked)}")
    start = time.monotonic()
    for torch in torches:
        results = [f"{p.split('-')[0]}-{p.split('-')[-1]}: {check(uv, torch, p)}"
                   for p in LINUX + ELSEWHERE]
        print(f"torch {torch:<7} " + "; ".join(results))
    print(f"resolved {len(torches)} torch releases x {len(LINUX + ELSEWHERE)} platforms from "
          f"metadata in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What an opt-in sm90 kernel's admission check costs a first call (issue 43), on the GPU:

    python benchmarks/probes/admission_time.py fwd|bwd OUT.json

The check exactly as a call runs it (``gluon_check.isolated``: a child process on the same GPU,
the kernel's ``self_check`` over its ``CASES``), timed twice: ``cold``, with an empty Triton
cache of its own (every compile paid: what the first process on a fresh machine pays), then
``warm`` (the same cache, now filled: what every later process pays; the child's start, imports
and launches). Writes ``{"kernel", "cases", "cold": {"s", "verdict"}, "warm": {...}, "device",
"date_utc", "command"}`` to OUT.json, after each measurement (a run cut short keeps the first).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import lowbit_attn  # noqa: F401
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    kind, out = argv
    from lowbit_attn.inference import gluon_check

    if kind == "fwd":
        from lowbit_attn.inference import sm90_check as check
    else:
        from lowbit_attn.training import sm90_check as check
    device = torch.device("cuda", 0)
    result = {"kernel": check.KERNEL, "cases": [str(c) for c in check.CASES],
              "device": torch.cuda.get_device_name(device),
              "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["python", *sys.argv])}
    cache = tempfile.mkdtemp(prefix="admission-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache  # the child inherits it: its own, empty, cache
    for when in ("cold", "warm"):
        t0 = time.perf_counter()
        verdict = gluon_check.isolated(device, check.self_check)
        result[when] = {"s": round(time.perf_counter() - t0, 3), "verdict": verdict}
        print(f"{check.KERNEL} admission check, {when} Triton cache: {result[when]['s']} s, "
              f"verdict {verdict!r}", file=sys.stderr, flush=True)
        Path(out).write_text(json.dumps(result, indent=1))
    return 0 if result["cold"]["verdict"] is None and result["warm"]["verdict"] is None else 1


if __name__ == "__main__":
    sys.exit(main())

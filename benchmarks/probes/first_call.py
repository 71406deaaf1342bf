"""The first call of a new shape on a cold Triton cache, with the kernels compiled one after
another (``LOWBIT_ATTN_COMPILE=serial``, the default) and side by side (``parallel``): issue 43's
"first call ≤ 2 s" bar. Each case runs in a process of its own with an empty
``TRITON_CACHE_DIR``, so that every kernel compiles: the package's import, the CUDA context, the
first ``attention()`` call (synchronized) and the second, each timed. Cases most decisive first
(D = 128 and 64 compiled side by side, then one after another); the JSON is rewritten after each.

    python benchmarks/probes/first_call.py OUTDIR [--dims 128,64] [--modes parallel,serial]
        [--caches cold,warm] [--cpu [--ahead]]

Writes ``OUTDIR/first-<gpu>-<date>.json`` and ``.md`` (read by ``stage_summary.py``). ``--cpu``:
the same on a machine without a GPU, CPU tensors under the stand-in launches of
``tools/bench/host.py`` with each kernel compiled for real for sm_90a (``compile=True``): the
compiles' share of a first call on this CPU, nothing launched (the name says ``cpu-sm_90a``);
with ``--ahead`` the child starts ``triton_support.hash_ahead`` after the import, as the import
itself does on a GPU build of torch. ``--caches``: ``cold`` (the default) and or ``warm``: each
warm case's cache filled first by a process of its own at another length (:data:`FILL_TOKENS`),
then measured: the first call of a new shape in a later process on a machine that has run the
package before (rows ``"cache": "warm"``, no bar). ``--warm`` is ``--caches warm`` (before
2026-12-01 its filling process ran the measured length itself: NOTES §25's warm rows).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BAR_S = 2.0  # issue 43: the first call of a new shape
SHAPE = (2, 16, 4096)  # batch, heads, tokens (D from --dims): compiles do not depend on them
FILL_TOKENS = 1024  # a warm case's filling process: another length, the same specializations
CHILD_TIMEOUT_S = 120


def child(d: int, cpu: bool, start_ahead: bool = False, tokens: int = SHAPE[2]) -> dict:
    """One case, in this (fresh) process, at ``tokens`` tokens."""
    t0 = time.perf_counter()
    import torch

    import lowbit_attn

    imported = time.perf_counter() - t0
    from lowbit_attn.core import triton_support

    if start_ahead:
        triton_support.hash_ahead()
    ahead = any(t.name == triton_support.HASH_THREAD for t in threading.enumerate())
    t0 = time.perf_counter()
    b, h, n = *SHAPE[:2], tokens
    device = "cpu" if cpu else "cuda"
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float16, device=device) for _ in range(3))
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    sync()
    context = time.perf_counter() - t0
    times = []
    if cpu:
        from lowbit_attn.tools.bench.host import stubbed_launches

        launches = stubbed_launches((9, 0), compile=True)
    else:
        launches = contextlib.nullcontext()
    with launches:
        for _ in range(2):
            t0 = time.perf_counter()
            lowbit_attn.attention(q, k, v)
            sync()
            times.append(time.perf_counter() - t0)
    name = "cpu-sm_90a" if cpu else torch.cuda.get_device_name()
    # Triton's own key, hashed again here: what a first call would wait for without hash_ahead
    module = triton_support.key_module()
    t0 = time.perf_counter()
    if module is not None:
        module.triton_key.__wrapped__()
    return {"import_s": imported, "context_s": context, "first_call_s": times[0],
            "second_call_s": times[1], "device_name": name, "torch": torch.__version__,
            "triton": __import__("triton").__version__, "hash_ahead": ahead,
            "triton_key_s": time.perf_counter() - t0 if module is not None else None}


def run_case(d: int, mode: str, cpu: bool, ahead: bool = False, warm: bool = False) -> dict:
    row = {"d": d, "mode": mode, "shape": list(SHAPE), "cache": "warm" if warm else "cold"}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "LOWBIT_ATTN_COMPILE": mode}
        env.pop("TRITON_INTERPRET", None)  # compiled kernels
        command = ([sys.executable, __file__, "--child", str(d)] + (["--cpu"] if cpu else [])
                   + (["--ahead"] if ahead else []))
        fill = [command + ["--tokens", str(FILL_TOKENS)]] if warm else []
        try:  # warm: the first process fills the cache at another length
            for argv in [*fill, command]:
                done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                      timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {**row, "status": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        return {**row, "status": "failed", "error": done.stderr[-2000:]}
    return {**row, "status": "ok", **json.loads(lines[-1].removeprefix("RESULT "))}


def table(rows: list[dict]) -> str:
    lines = ["| D | LOWBIT_ATTN_COMPILE | cache | first call s | second call s | import s "
             "| CUDA context s | Triton's key s (hashed ahead) | ≤ 2 s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cache = r.get("cache", "cold")
        if r["status"] != "ok":
            lines.append(f"| {r['d']} | {r['mode']} | {cache} | {r['status']} | | | | | |")
            continue
        met = "yes" if r["first_call_s"] <= BAR_S else "no"
        met = met if cache == "cold" else "—"
        key = r.get("triton_key_s")
        key = "—" if key is None else f"{key:.2f} ({'yes' if r.get('hash_ahead') else 'no'})"
        lines.append(f"| {r['d']} | {r['mode']} | {cache} | {r['first_call_s']:.2f} | "
                     f"{r['second_call_s']:.4f} | {r['import_s']:.2f} | {r['context_s']:.2f} | "
                     f"{key} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?", default=".")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--modes", default="parallel,serial")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--ahead", action="store_true")
    parser.add_argument("--caches", default="cold")
    parser.add_argument("--warm", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=SHAPE[2], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.cpu, args.ahead, args.tokens)),
              flush=True)
        return 0
    caches = ["warm"] if args.warm else args.caches.split(",")
    if not set(caches) <= {"cold", "warm"}:
        parser.error(f"--caches: cold and/or warm, got {args.caches!r}")
    rows: list[dict] = []
    date = dt.date.today().isoformat()
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    cases = [(cache, mode, int(d)) for cache in caches for mode in args.modes.split(",")
             for d in args.dims.split(",")]
    for cache, mode, d in cases:
        rows.append(run_case(d, mode, args.cpu, args.ahead, cache == "warm"))
        gpu = next((r["device_name"] for r in rows if "device_name" in r), "unknown")
        stem = out / f"first-{gpu.lower().replace(' ', '-')}-{date}"
        data = {"device_name": gpu, "date": date, "command": " ".join(sys.argv),
                "bar_s": BAR_S, "rows": rows}
        stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
        stem.with_suffix(".md").write_text(table(rows))
        print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the 8-bit forward's preparation spends its time, launch by launch, against its floor
(issue 43; the H200 of 2026-11-29 measured the two launches at 2.0 ms for N = 16k, D = 128,
B·H = 64, against a 0.42 ms floor, and 60 % of the GPU time at N = 1k; the tilings the H200 of
2026-11-30 measured fastest replaced them, NOTES §27):

    python benchmarks/probes/prep_speed.py OUT.json            # a GPU
    python benchmarks/probes/prep_speed.py OUT.json --smoke    # any machine: one tiny shape

Per shape (bf16 Q, K, V ``[B, H, N, D]``; the default recipe ``qk_int8_pv_fp8``: K smoothed,
per-token scales, FP8 V), each timed with ``triton.testing.do_bench`` (on a CPU, ``--smoke``, one
wall-clock call):

- ``stats``: the statistics launch as a call makes it (Q's amax, K's mean and amax, V's amax);
  ``torch stats``: the same statistics by PyTorch reductions;
- ``quantize``: the quantizing launch as a call makes it (K and Q to INT8, V to E4M3), then each
  part alone (``K``, ``Q``, ``V``: which part is slow);
- ``copy``: a device-to-device copy of Q, K and V, the card's bandwidth as this run sees it.

Each row: ms, bytes read and written, GB/s, and the floor (the bytes at the copy's bandwidth).
Writes ``{"rows", "device", "date_utc", "command"}`` to OUT.json after every row, and a table
beside it (OUT.md).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import prepare
from lowbit_attn.quant import int8 as quant

SHAPES = [(2, 32, 16384, 128), (16, 32, 1024, 128), (2, 32, 16384, 64), (16, 32, 1024, 64)]
SMOKE_SHAPES = [(1, 2, 80, 64)]

def timer(smoke: bool):
    if smoke:
        def wall(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return wall
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=50)


def requests(q, k, v):
    """The statistics and quantization requests a call of the default recipe makes at these
    inputs (``prepare.stats_requests`` and ``prepare.quant_args``: Q's, K's and V's statistics,
    K smoothed, Q and K balanced, V to E4M3)."""
    recipe = get_recipe("qk_int8_pv_fp8")
    wanted = prepare.stats_requests(q, k, v, recipe)
    stats = [quant.StatsRequest(*wanted[name]) for name in wanted]
    found = dict(zip(wanted, quant.channel_stats_many(*stats)))
    k_args, q_args, v_args = prepare.quant_args(recipe, q.shape[-1] ** -0.5, found)
    return (stats, quant.Int8Request(k, **k_args), quant.Int8Request(q, **q_args),
            quant.VRequest(v, **v_args))


def main(argv: list[str]) -> None:
    out, smoke = Path(argv[0]), "--smoke" in argv
    out.parent.mkdir(parents=True, exist_ok=True)
    device = "cpu" if smoke else "cuda"
    bench = timer(smoke)
    doc = {"rows": [], "device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
           "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/probes/prep_speed.py " + " ".join(argv)}

    def save():
        out.write_text(json.dumps(doc, indent=1))
        lines = [f"# {doc['device']}; {doc['date_utc']}; command: {doc['command']}", "",
                 "| B,H,N,D | launch | ms | MB read+written | GB/s | floor ms | × floor |",
                 "|---|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['shape']} | {r['name']} | {r['ms']:.4f} | {r['mb']:.0f} | "
                         f"{r['gbs']:.0f} | {r.get('floor_ms', float('nan')):.4f} | "
                         f"{r.get('x_floor', float('nan')):.1f} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    for shape in SMOKE_SHAPES if smoke else SHAPES:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
                   for _ in range(3))
        k = k + 3 * torch.randn(shape[-1], device=device, generator=g).to(torch.bfloat16)
        stats, k_req, q_req, v_req = requests(q, k, v)
        elem = q.numel()
        copy_ms = bench(lambda: (q.clone(), k.clone(), v.clone()))
        bandwidth = 2 * 3 * elem * 2 / (copy_ms * 1e-3)  # bytes per second, read and written

        def row(name, fn, nbytes):
            try:
                ms = bench(fn)
            except Exception as exc:  # noqa: BLE001 - a launch that fails is a row too
                doc["rows"].append({"shape": list(shape), "name": name,
                                    "error": f"{type(exc).__name__}: {exc}"[:300],
                                    "ms": float("nan"), "mb": nbytes / 1e6, "gbs": float("nan")})
            else:
                floor = nbytes / bandwidth * 1e3
                doc["rows"].append({"shape": list(shape), "name": name, "ms": ms,
                                    "mb": nbytes / 1e6, "gbs": nbytes / (ms * 1e-3) / 1e9,
                                    "floor_ms": floor, "x_floor": ms / floor})
            save()

        row("copy Q, K, V", lambda: (q.clone(), k.clone(), v.clone()), 2 * 3 * elem * 2)
        stats_bytes = len(stats) * elem * 2  # each tensor read once
        row("stats", lambda: quant.channel_stats_many(*stats), stats_bytes)
        row("torch stats", lambda: (q.float().abs().amax(dim=2), k.float().mean(dim=2),
                                    k.float().aminmax(dim=2), v.float().abs().amax(dim=2)),
            stats_bytes)
        # read bf16, write one byte per element (scales are small)
        row("quantize K, Q, V", lambda: quant.quantize(k_req, v_req, q=q_req), 3 * elem * 3)
        row("quantize K", lambda: quant.quantize(k_req), elem * 3)
        row("quantize Q", lambda: quant.quantize(q=q_req), elem * 3)
        row("quantize V", lambda: quant.quantize(None, v_req), elem * 3)
    save()
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python
"""Video sparse attention benchmark: forward + backward of ``lowbit_attn.video_sparse_attention``
at several sparsities against SDPA cuDNN dense attention, and the fine kernel's FLOP rate (counting
only the tiles it computes), bf16, with peak memory; forward only (inference) for the 16-bit and
the 8-bit (``qk_int8_pv_fp8``) fine stage against the dense cuDNN forward. Rows ``…[sm90]``:
the backward on the Gluon loops for Hopper (``LOWBIT_ATTN_BWD_KERNEL=sm90``; the Triton kernels
elsewhere).

    python benchmarks/bench_vsa.py                  # T=16, H=W=48 (36,864 tokens), D=128, a GPU
    python benchmarks/bench_vsa.py --video 8,32,32 --out DIR

Sparsity s keeps topk = (1 - s)·n_tiles key tiles per query tile. The fine stage's operations:
4·N·(topk·64)·D per head forward (×3.5 forward + backward, as for dense attention). Without CUDA it
times the PyTorch path on a tiny grid and says so.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

try:
    import lowbit_attn
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import lowbit_attn
from lowbit_attn.vsa import interface as vsa
from lowbit_attn.tools.bench.calls import await_admission
from lowbit_attn.tools.bench.metadata import make_metadata
from lowbit_attn.tools.bench.save import save_script_results
from lowbit_attn.tools.bench.tables import status_table
from lowbit_attn.tools.bench.timers import peak_extra_mib, timer_for
from lowbit_attn.vsa.tiles import tile_layout


def fwd_bwd(fn, leaves, do):
    def step():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(do)

    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--video", default="16,48,48")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sparsities", default="0.5,0.75,0.875,0.95")
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    video = tuple(int(x) for x in args.video.split(","))
    heads, d = args.heads, args.d
    if not cuda:
        print("NO CUDA: timing the PyTorch path on a (4, 8, 8) grid (not a kernel benchmark)",
              file=sys.stderr)
        video, heads, d = (4, 8, 8), 2, 64
    n = math.prod(video)
    layout = tile_layout(video, (4, 4, 4))
    timer = timer_for(cuda)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, generator=g, device=device, dtype=torch.bfloat16)
                   for _ in range(4))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dense_ops = 4.0 * heads * n * n * d
    rows = []
    meta = make_metadata(device=device, mode="vsa",
                         protocol={"video": video, "heads": heads, "d": d, "tile": (4, 4, 4)})

    def save(complete=False):  # after every row: a run cut short keeps what it measured
        table = render(rows)
        save_script_results(args.out, "vsa", {**meta, "rows": rows, "complete": complete}, table)
        return table

    def record(name, step, ops, *, passes="fwd+bwd", **extra):
        try:
            mib = peak_extra_mib(step, cuda)
            ms = timer(step)
            rows.append({"method": name, "passes": passes, "ms": ms, "tops": ops / ms * 1e-9,
                         "peak_extra_mib": mib, "status": "ok", **extra})
        except Exception as exc:  # noqa: BLE001 - a failing method is a row, not a crash
            rows.append({"method": name, "passes": passes,
                         "status": f"error: {type(exc).__name__}: {exc}"[:300], **extra})
        print(rows[-1], file=sys.stderr, flush=True)
        save()

    def cudnn(a, b, c):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if cuda else SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(a, b, c)

    record("sdpa_cudnn_dense", fwd_bwd(cudnn, leaves, do), dense_ops * 3.5)
    with torch.no_grad():
        record("sdpa_cudnn_dense", lambda: cudnn(q, k, v), dense_ops, passes="fwd")
    for s in (float(x) for x in args.sparsities.split(",")):
        topk = max(1, round((1 - s) * layout.n_tiles))
        fine_ops = 4.0 * heads * n * topk * 64 * d

        def full(a, b, c, topk=topk):
            return vsa.video_sparse_attention(a, b, c, video_shape=video, topk=topk,
                                              gate_coarse=torch.ones((), device=device))

        try:
            _, idx, _ = vsa.coarse(q, k, v, video_shape=video, topk=topk)
        except Exception as exc:  # noqa: BLE001 - this sparsity's rows are lost, not the run
            rows.append({"method": "vsa", "sparsity": s, "topk": topk,
                         "status": f"error in coarse: {type(exc).__name__}: {exc}"[:300]})
            save()
            continue

        def fine(a, b, c, idx=idx):
            return vsa.fine(a, b, c, video_shape=video, tile_indices=idx)

        for kernel, tag in (("triton", ""), ("sm90", "[sm90]")):
            os.environ["LOWBIT_ATTN_BWD_KERNEL"] = kernel
            waited = {}
            try:  # sm90: the first call starts the admission check; the rows measure what runs
                fwd_bwd(full, leaves, do)()
                await_admission(waited)
            except Exception as exc:  # noqa: BLE001 - the rows below record their own errors
                waited["warmup_error"] = f"{type(exc).__name__}: {exc}"[:200]
            record(f"vsa{tag}", fwd_bwd(full, leaves, do), fine_ops * 3.5, sparsity=s, topk=topk,
                   **waited)
            record(f"vsa_fine_only{tag}", fwd_bwd(fine, leaves, do), fine_ops * 3.5, sparsity=s,
                   topk=topk)
        os.environ.pop("LOWBIT_ATTN_BWD_KERNEL")
        with torch.no_grad():
            for recipe in ("exact", "qk_int8_pv_fp8"):
                record(f"vsa_fine_only[{recipe}]",
                       lambda recipe=recipe: vsa.fine(q, k, v, video_shape=video, tile_indices=idx,
                                                      recipe=recipe),
                       fine_ops, passes="fwd", sparsity=s, topk=topk)
    print(save(complete=True))
    return 0 if all(r["status"] == "ok" for r in rows if r["method"].startswith("vsa")) else 1


def render(rows: list[dict]) -> str:
    """One line per row, with × SDPA cuDNN dense for the same passes."""
    dense = {r["passes"]: r for r in rows if r["method"] == "sdpa_cudnn_dense" and r["status"] == "ok"}

    def cells(r):
        base = dense.get(r["passes"])
        speed = f"{base['ms'] / r['ms']:.2f}" if base else "—"
        mem = "" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
        return [f"{r['ms']:.3f}", f"{r['tops']:.0f}", speed, mem]

    return status_table(
        ["method", "passes", "sparsity", "topk", "ms", "TOP/s (computed tiles)", "× cuDNN dense",
         "peak MiB"], rows,
        lambda r: [r["method"], r["passes"], str(r.get("sparsity", "")), str(r.get("topk", ""))],
        cells,
    )


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Hopper speed benchmark of the INT8/FP8 forward: every kernel variant of the autotuner, Q quantized
in the kernel or in a pass, and the two stages apart, against SDPA cuDNN bf16, public call end to
end, with each output checked against SDPA flash fp16 (cosine, relative L1).

    python benchmarks/bench_hopper.py                 # D=128,64; N=1k,8k,16k; causal and not (a GPU)
    python benchmarks/bench_hopper.py --quick         # D=128; N=1k,16k
    python benchmarks/bench_hopper.py --out DIR --time-budget 500

Rows per (D, N, causal): ``sdpa_cudnn_bf16``; ``ours`` (``qk_int8_pv_fp8`` as users call it:
autotuned, the default options); ``ours
block_k=128`` (128-key blocks: fewer instructions per score, NOTES §10); ``ours cfg=…`` (the
autotuner's candidates one at a time: warps, stages, plain or pipelined loop); ``prepare`` and
``attention`` (the two stages of ``ours`` timed apart). The last table says, per
configuration, where ``ours`` stands against the issue's bars (1.25× cuDNN at D=128, N ≥ 8k;
1.15× at D=64, N ≥ 8k; 1.0× at N=1k). Without CUDA it runs the same rows at a tiny size on whatever backend the
environment selects (the Triton interpreter in the tests) and says so. JSON and markdown.
``bench_forward.py`` times the one-warpgroup Gluon forward (``LOWBIT_ATTN_KERNEL=sm90``, what
``LOWBIT_ATTN_KERNEL=gluon`` runs on Hopper).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

try:
    import lowbit_attn
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import lowbit_attn
from lowbit_attn.integrations.sdpa import TORCH_SDPA
from lowbit_attn.tools.bench.calls import autotune_choice, reference_output
from lowbit_attn.tools.bench.command import parse_seqlens
from lowbit_attn.tools.bench.flops import tops
from lowbit_attn.tools.bench.measure import compare
from lowbit_attn.tools.bench.metadata import make_metadata
from lowbit_attn.tools.bench.protocol import BATCH, HEADS, MIN_COSINE, make_inputs
from lowbit_attn.tools.bench.save import save_script_results
from lowbit_attn.tools.bench.tables import seqlen_label
from lowbit_attn.tools.bench.timers import timer_for
from lowbit_attn.core.arch import backend_for
from lowbit_attn.inference import kernel_int8 as attn_fwd_int8
from lowbit_attn.core.triton_helpers import LaunchConfig, configs_for, triton_configs
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.core.recipes import get_recipe

RECIPE = "qk_int8_pv_fp8"
# The bars: × cuDNN at N ≥ 8k ("long") and at N = 1k ("short", stated for D=128).
BARS = {(128, "long"): 1.25, (64, "long"): 1.15, (128, "short"): 1.0}


def bar_for(d: int, n: int) -> float | None:
    if n >= 8192:
        return BARS.get((d, "long"))
    if n <= 1024:
        return BARS.get((d, "short"))
    return None


@contextlib.contextmanager
def forced(config):
    """The attention kernel's autotuner restricted to one candidate: a ``LaunchConfig``, or a
    ``triton.Config`` it chose before (``None``: all of them)."""
    tuner = attn_fwd_int8._attn_fwd_int8
    saved, saved_cache = tuner.configs, dict(tuner.cache)
    if config is not None:
        tuner.configs = (triton_configs({"interpreter": [config]}, None)
                         if isinstance(config, LaunchConfig) else [config])
    tuner.cache.clear()
    try:
        yield
    finally:
        tuner.configs = saved
        tuner.cache.clear()
        tuner.cache.update(saved_cache)


def candidates(cuda: bool, d: int) -> list[LaunchConfig]:
    if cuda:
        cap = torch.cuda.get_device_capability()
        return [c for c in configs_for(attn_fwd_int8.CONFIGS, cap)
                if attn_fwd_int8.fits(c.num_warps, d) and c not in attn_fwd_int8.TRIALS]
    plain = attn_fwd_int8.CONFIGS["interpreter"][0]
    return [plain, LaunchConfig(plain.num_warps, plain.num_stages, (("PIPELINE", True),))]


def describe(c: LaunchConfig) -> str:
    loop = "pipelined" if c.kwargs.get("PIPELINE") else "plain"
    return f"{c.num_warps}w{c.num_stages}s-{loop}"


def stage_fns(q, k, v, causal, recipe=None, window=None):
    """``(prepare, attention)``: the two stages of the public call on the Triton kernel, as
    ``inference.op.run`` runs them; ``window``: ``(left, right)`` keys seen around each query, as
    ``attention(window=)`` (causal: right 0)."""
    recipe = recipe or get_recipe(RECIPE)
    scale = q.shape[-1] ** -0.5

    def prepare():
        return quantize_qkv(q, k, v, recipe, scale, need_lse_shift=False, backend="triton")

    qz = prepare()
    out = torch.empty_like(q)

    extra = {}
    if window is not None:
        from lowbit_attn.core.variants import Variant

        extra["variant"] = Variant(left=window[0], right=window[1])

    def attention():
        attn_fwd_int8.attention(qz, out=out, pv=recipe.pv, granularity=recipe.granularity,
                                block_q=recipe.block_q, block_k=recipe.block_k,
                                causal_offset=0 if causal else None, return_lse=False, **extra)
        return out

    return prepare, attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="D=128 and N=1k,16k only")
    ap.add_argument("--dims", default="128,64", help="in this order (the D=128 bars first)")
    ap.add_argument("--seqlens", default="1k,8k,16k", help="in this order")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; configurations not started by then are recorded as skipped")
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dims = [128] if args.quick else [int(x) for x in args.dims.split(",")]
    seqlens = [1024, 16384] if args.quick else parse_seqlens(args.seqlens)
    batch, heads = args.batch, args.heads
    if not cuda:
        print("NO CUDA: tiny sizes on the CPU (not a kernel benchmark)", file=sys.stderr)
        dims, seqlens, batch, heads = [64], [160], 1, 2
    triton_path = backend_for(torch.device(device)) == "triton"
    timer = timer_for(cuda)
    start = time.monotonic()
    rows: list[dict] = []

    def record(base: dict, name: str, fn, ref=None, **extra):
        kind = "sdpa" if name.startswith("sdpa") else "ours"
        row = {**base, "method": name, "kind": kind, "label": name, **extra}
        try:
            out = fn()
            if ref is not None:
                row.update(compare(out, ref))
                row["check"] = "pass" if row["cosine"] >= MIN_COSINE else "FAIL"
            del out
            row["ms"] = float(timer(fn))
            row["tops"] = tops(base["B"], base["H"], base["N"], base["D"], base["causal"],
                               row["ms"])
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a failing method is a row, not a crash
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print({k: row[k] for k in row if k not in ("max_abs_err",)}, file=sys.stderr, flush=True)

    kind = "hopper"
    meta = make_metadata(device=device, mode=kind, protocol={
        "recipe": RECIPE, "batch": batch, "heads": heads, "dims": dims, "seqlens": seqlens,
        "inputs": "fp16 q, k, v (bf16 copies for SDPA); k += 4·N(0,1) per channel",
        "B": batch, "H": heads,
    })

    def save(complete: bool) -> str:
        """JSON and markdown of the rows so far (after every configuration: a run stopped by a
        timeout keeps what it measured)."""
        table = render(rows)
        save_script_results(args.out, kind, {**meta, "rows": rows, "complete": complete}, table)
        return table

    for d in dims:
        for n in seqlens:
            for causal in (False, True):
                base = {"B": batch, "H": heads, "N": n, "D": d, "causal": causal}
                if args.time_budget is not None and time.monotonic() - start > args.time_budget:
                    rows.append({**base, "method": "*", "kind": "skipped", "status": "skipped"})
                    continue
                if rows:
                    save(complete=False)
                q, k, v = make_inputs(batch, heads, n, d, device=device)
                ref, _ = reference_output(q, k, v, causal)
                qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))

                def cudnn():
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if cuda else SDPBackend.MATH):
                        return TORCH_SDPA(qb, kb, vb, is_causal=causal)

                def ours():
                    return lowbit_attn.attention(q, k, v, recipe=RECIPE, is_causal=causal)

                record(base, "sdpa_cudnn_bf16", cudnn, ref)
                with forced(None):
                    record(base, "ours", ours, ref)
                    rows[-1]["autotune"] = autotune_choice()
                if not triton_path:
                    continue
                wide = get_recipe(RECIPE).replace(block_k=128)  # per-token: any key block fits
                record(base, "ours block_k=128", lambda: lowbit_attn.attention(
                    q, k, v, recipe=wide, is_causal=causal), ref)
                rows[-1]["autotune"] = autotune_choice()
                for config in candidates(cuda, d):
                    with forced(config):
                        record(base, f"ours cfg={describe(config)}", ours, ref)
                with forced(None):
                    prepare, attention = stage_fns(q, k, v, causal)
                    record(base, "prepare", prepare)
                    record(base, "attention", attention, ref)
                del q, k, v, qb, kb, vb, ref
                if cuda:
                    torch.cuda.empty_cache()

    table = save(complete=True)
    print(table)
    ok = all(r["status"] in ("ok", "skipped") and r.get("check", "pass") == "pass" for r in rows)
    return 0 if ok else 1


def render(rows: list[dict]) -> str:
    """Every row, then per configuration ``ours`` against cuDNN and the bar."""
    cudnn = {(r["D"], r["N"], r["causal"]): r for r in rows
             if r["method"] == "sdpa_cudnn_bf16" and r["status"] == "ok"}
    lines = ["| D | N | causal | method | ms | TOP/s | × cuDNN | cosine | rel L1 | autotune |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['D']} | {seqlen_label(r['N'])} | {'yes' if r['causal'] else 'no'} | "
                f"{r['method']} |")
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | | | | |")
            continue
        base = cudnn.get((r["D"], r["N"], r["causal"]))
        speed = f"{base['ms'] / r['ms']:.2f}" if base else "—"
        cos = f"{r['cosine']:.5f}" if "cosine" in r else ""
        rel = f"{r['rel_l1']:.4f}" if "rel_l1" in r else ""
        lines.append(f"{head} {r['ms']:.3f} | {r['tops']:.0f} | {speed} | {cos} | {rel} | "
                     f"{r.get('autotune') or ''} |")
    lines += ["", "| D | N | causal | method | × cuDNN | bar | met |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] != "ours" or r["status"] != "ok":
            continue
        base = cudnn.get((r["D"], r["N"], r["causal"]))
        bar = bar_for(r["D"], r["N"])
        if base is None:
            continue
        speed = base["ms"] / r["ms"]
        met = "—" if bar is None else ("yes" if speed >= bar else "no")
        lines.append(f"| {r['D']} | {seqlen_label(r['N'])} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['method']} | {speed:.2f} | {bar or '—'} | {met} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

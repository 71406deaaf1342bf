#!/usr/bin/env python
"""Training attention benchmark: forward + backward of ``lowbit_attn.trainable_attention`` against
SDPA flash (FlashAttention-2) and SDPA cuDNN, bf16, with peak memory and the gradients' accuracy
checked in the same run.

    python benchmarks/bench_train.py                 # D=64,128; N=1k..16k; causal and not (a GPU)
    python benchmarks/bench_train.py --quick         # D=128, N=4k,16k
    python benchmarks/bench_train.py --out DIR ...   # JSON + markdown table (+ chart) into DIR

Inputs are channel-biased (K += 4·N(0,1) per channel) as in the inference benchmark; tokens per
call are fixed (batch = 16k/N) and heads = 2048/D. TOP/s count 4·N²·D per head for the forward
and 2.5× that for the backward (halved when causal), as FlashAttention does. Accuracy: cosine of
the output and of dQ, dK, dV against float32 SDPA (memory-efficient backend) of the same bf16
inputs, on the first batch element. Without CUDA it times the CPU reference at a tiny size and
says so (not a kernel benchmark).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

try:
    import lowbit_attn
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import lowbit_attn
from lowbit_attn.tools.bench.calls import await_admission, environment
from lowbit_attn.tools.bench.metadata import make_metadata
from lowbit_attn.tools.bench.protocol import make_inputs
from lowbit_attn.tools.bench.save import save_script_results
from lowbit_attn.tools.bench.timers import peak_extra_mib, timer_for
from lowbit_attn.core.metrics import errors

TOKENS = 16384
WIDTH = 2048
PER_ROW = lowbit_attn.TRAIN_RECIPES["sagebwd_int8"].replace(backward_granularity="per_row")


def sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def ours(**kw):
    def fn(q, k, v, causal):
        return lowbit_attn.trainable_attention(q, k, v, is_causal=causal, **kw)

    return fn


METHODS = {
    "sdpa_flash": sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": sdpa("CUDNN_ATTENTION"),
    "sagebwd_int8": ours(),
    # the Gluon loops for Hopper (LOWBIT_ATTN_BWD_KERNEL=sm90, the default there; the Triton
    # kernels elsewhere; the rows without _sm90 run the Triton backward), and
    # P and dS per row (TrainRecipe.backward_granularity) on either backward
    "sagebwd_int8_sm90": ours(),
    "sagebwd_int8_per_row": ours(recipe=PER_ROW),
    "sagebwd_int8_per_row_sm90": ours(recipe=PER_ROW),
    "sagebwd_int8_atomic_dq": ours(),
    "sagebwd_dp_int8": ours(keep_16bit=()),
    "ours_exact_16bit": ours(recipe="exact"),
}


# The backward each row runs, named (LOWBIT_ATTN_BWD_KERNEL: its default is the sm90 loops on
# Hopper, so the Triton backward's rows say so), and dQ added by the dK/dV kernel instead of its
# own kernel (LOWBIT_ATTN_TRAIN_DQ; lowbit_attn.core.options)
_TRITON = {"LOWBIT_ATTN_BWD_KERNEL": "triton"}
ENVIRONMENT = {"sagebwd_int8": _TRITON, "sagebwd_int8_per_row": _TRITON,
               "sagebwd_dp_int8": _TRITON, "ours_exact_16bit": _TRITON,
               "sagebwd_int8_atomic_dq": {"LOWBIT_ATTN_TRAIN_DQ": "atomic", **_TRITON},
               "sagebwd_int8_sm90": {"LOWBIT_ATTN_BWD_KERNEL": "sm90"},
               "sagebwd_int8_per_row_sm90": {"LOWBIT_ATTN_BWD_KERNEL": "sm90"}}


def train_ops(batch, heads, n, d, causal) -> float:
    return 4.0 * batch * heads * n * n * d * 3.5 * (0.5 if causal else 1.0)


def measure(name, fn, q, k, v, do, causal, timer, cuda):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        for x in leaves:
            x.grad = None
        fn(*leaves, causal).backward(do)

    row = {"method": name}
    try:
        step()  # an opt-in backward's first call starts its admission check: wait for the verdict
        await_admission(row)  # so that what follows measures the admitted kernel
        mib = peak_extra_mib(step, cuda)
        if mib is not None:
            row["peak_extra_mib"] = mib
        row["ms"] = timer(step)
        with torch.no_grad():
            row["fwd_ms"] = timer(lambda: fn(*leaves, causal))
        row["status"] = "ok"
        row["grads"] = [leaves[0].grad, leaves[1].grad, leaves[2].grad]
    except Exception as exc:  # noqa: BLE001 - a failing method is a row, not a crash
        row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def reference(q, k, v, do, causal):
    """float32 SDPA of the first batch element: (out, dq, dk, dv)."""
    leaves = [x[:1].float().detach().requires_grad_() for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(_ref_backends()):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    return (out, *torch.autograd.grad(out, leaves, do[:1].float()))


def _ref_backends():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def run(dims, ns, causals, methods, *, device, timer, deadline=None, after=None):
    """The rows of every (D, causal, N) configuration in that order; ``deadline``: a
    ``time.monotonic()`` past which configurations are recorded as skipped instead of started;
    ``after(rows)`` runs after each configuration (the partial save)."""
    cuda = device == "cuda"
    rows = []
    for d in dims:
        for causal in causals:
            for n in ns:
                batch, heads = max(1, TOKENS // n), WIDTH // d
                if deadline is not None and time.monotonic() > deadline:
                    rows.append(dict(method="*", status="skipped: time budget", d=d, n=n,
                                     causal=causal, batch=batch, heads=heads))
                    continue
                if not cuda:
                    batch, heads = 1, 2
                q, k, v = make_inputs(batch, heads, n, d, device=device, dtype=torch.bfloat16)
                do = torch.randn_like(q)
                try:
                    ref = reference(q, k, v, do, causal)
                except Exception as exc:  # noqa: BLE001 - the rows are timed without a check
                    ref = f"reference failed: {type(exc).__name__}: {exc}"[:200]
                for name in methods:
                    with environment(**ENVIRONMENT.get(name, {})):
                        row = measure(name, METHODS[name], q, k, v, do, causal, timer, cuda)
                    row.update(d=d, n=n, causal=causal, batch=batch, heads=heads)
                    if row["status"] == "ok":
                        row["tops"] = train_ops(batch, heads, n, d, causal) / row["ms"] * 1e-9
                        grads = row.pop("grads")
                        try:
                            if isinstance(ref, str):
                                raise RuntimeError(ref)
                            with torch.no_grad():
                                out = METHODS[name](q[:1], k[:1], v[:1], causal)
                            got = [out] + [g[:1] for g in grads]
                            row["cosine"] = {t: errors(a.float(), b.float()).cosine for t, a, b
                                             in zip(("out", "dq", "dk", "dv"), got, ref)}
                        except Exception as exc:  # noqa: BLE001 - the timing stands
                            row["check_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    rows.append(row)
                    print(_line(row), file=sys.stderr, flush=True)
                del q, k, v, do, ref
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                if after is not None:
                    after(rows)
    return rows


def _line(r) -> str:
    head = f"D={r['d']} N={r['n']} {'causal' if r['causal'] else 'full  '} {r['method']:17}"
    if r["status"] != "ok":
        return f"{head} {r['status']}"
    cos = " ".join(f"{t}={c:.5f}" for t, c in r["cosine"].items())
    mem = f" peak+{r['peak_extra_mib']:.0f}MiB" if "peak_extra_mib" in r else ""
    return f"{head} {r['ms']:8.3f} ms {r['tops']:6.1f} TOP/s{mem}  {cos}"


def markdown(rows) -> str:
    """One line per (D, causal, N): TOP/s per method and our speedups over flash and cuDNN."""
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "*"]  # *: skipped
    head = ["D", "causal", "N"] + methods + ["sagebwd / flash", "sagebwd / cuDNN", "dQ cos (sagebwd)",
                                            "sm90 / flash", "sm90 / cuDNN"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["d"], r["causal"], r["n"]) for r in rows))
    for key in keys:
        by = {r["method"]: r for r in rows if (r["d"], r["causal"], r["n"]) == key}
        cells = [str(key[0]), "yes" if key[1] else "no", str(key[2])]
        cells += [f"{by[m]['tops']:.0f}" if m in by and by[m]["status"] == "ok" else "—" for m in methods]
        s = by.get("sagebwd_int8", {})
        for base in ("sdpa_flash", "sdpa_cudnn"):
            b = by.get(base, {})
            ok = s.get("status") == "ok" and b.get("status") == "ok"
            cells.append(f"{b['ms'] / s['ms']:.2f}×" if ok else "—")
        cells.append(f"{s['cosine']['dq']:.4f}" if s.get("status") == "ok" else "—")
        s = by.get("sagebwd_int8_sm90", {})
        for base in ("sdpa_flash", "sdpa_cudnn"):
            b = by.get(base, {})
            ok = s.get("status") == "ok" and b.get("status") == "ok"
            cells.append(f"{b['ms'] / s['ms']:.2f}×" if ok else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--causal", choices=("both", "no", "yes"), default="both",
                    help="not causal, then causal (both); or one of them")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; configurations not started by then are recorded as skipped")
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args(argv)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dims = [128] if args.quick else [int(x) for x in args.dims.split(",")]
    ns = [4096, 16384] if args.quick else [int(x) for x in args.ns.split(",")]
    if not cuda:
        print("NO CUDA: timing the CPU reference at N=128 (not a kernel benchmark)", file=sys.stderr)
        ns, dims = [128], dims[:1]
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {sorted(METHODS)}")
    timer = timer_for(cuda)
    meta = make_metadata(device=device, mode="train", protocol={"tokens": TOKENS, "width": WIDTH})
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]

    def save(rows, complete=False):  # after every configuration: a run cut short keeps them
        table = markdown(rows)
        save_script_results(args.out, "train", {**meta, "rows": rows, "complete": complete},
                            table)
        return table

    deadline = None if args.time_budget is None else start + args.time_budget
    rows = run(dims, ns, causals, methods, device=device, timer=timer, deadline=deadline,
               after=save)
    print(save(rows, complete=True))
    return 0 if all(r["status"] in ("ok", "skipped: time budget") for r in rows
                    if not r["method"].startswith("sdpa")) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Forward and gradient accuracy of the trainable attention against float64 autograd of exact
attention, on the input families of the 8-bit study, with the published dP-in-INT8 ablation.

    python experiments/sagebwd/grad_accuracy.py [--n 2048] [--d 128] [--dtype bf16] [--json out.json]
    python experiments/sagebwd/grad_accuracy.py --families normal --qk-scales 1,4,10,30 \
        --variants sagebwd_int8,qk_16bit      # how peaked rows cost the INT8 Q·Kᵀ

``--qk-scales``: Q and K multiplied by each factor (the scores by its square: sharper rows).
``--softcaps``: each logit softcap (``trainable_attention(softcap=)``, in the reference too);
``none`` is no cap.

Runs the CPU reference of the numerics (what the kernels compute, to rounding).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import lowbit_attn
from lowbit_attn.tools.inputs import FAMILIES
from lowbit_attn.core.metrics import errors

VARIANTS = {
    "sagebwd_int8": {},
    "per_row": {"recipe": lowbit_attn.TRAIN_RECIPES["sagebwd_int8"].replace(
        backward_granularity="per_row")},
    "dp_int8": {"keep_16bit": ()},
    "qk_16bit": {"keep_16bit": ("qk", "dp")},
    "no_smooth_k": {"smooth_k": False},
    "smooth_q": {"smooth_q": True},
    "balance_qk": {"balance_qk": True},
    "exact_16bit": {"recipe": "exact"},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def gradients(q, k, v, do, causal, fn, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, is_causal=causal, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def exact(q, k, v, *, is_causal, softcap=None):
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                enable_gqa=True)
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = softcap * torch.tanh(s / softcap)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def measure(family, n, d, heads, dtype, causal, seed, variants=tuple(VARIANTS), qk_scale=1.0,
            softcap=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = FAMILIES[family](g, 1, heads, heads, n, n, d, dtype)
    q, k = (x * qk_scale for x in (q, k))
    do = torch.randn(q.shape, generator=g).to(dtype)
    ref = gradients(*(x.double() for x in (q, k, v, do)), causal, exact, softcap=softcap)
    rows = {}
    for name in variants:
        kw = VARIANTS[name] | ({} if softcap is None else {"softcap": softcap})
        got = gradients(q, k, v, do, causal, lowbit_attn.trainable_attention, **kw)
        rows[name] = {
            t: vars(errors(a, b)) for t, a, b in zip(("out", "dq", "dk", "dv"), got, ref)
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--families", default="channel_bias_k,normal,outliers,peaked,flat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--qk-scales", default="1")
    ap.add_argument("--softcaps", default="none")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {"config": vars(args), "date": time.strftime("%Y-%m-%d"), "rows": []}
    caps = [None if c == "none" else float(c) for c in args.softcaps.split(",")]
    print(f"{'family':15} {'x':>4} {'cap':>5} {'causal':6} {'variant':13} "
          + " ".join(f"{t:>16}" for t in ("out", "dq", "dk", "dv")))
    for family in args.families.split(","):
        for qk_scale in map(float, args.qk_scales.split(",")):
            for cap in caps:
                for causal in (False, True):
                    rows = measure(family, args.n, args.d, args.heads, DTYPES[args.dtype], causal,
                                   args.seed, args.variants.split(","), qk_scale, cap)
                    for name, r in rows.items():
                        results["rows"].append({"family": family, "qk_scale": qk_scale,
                                                "softcap": cap, "causal": causal, "variant": name,
                                                **r})
                        cells = " ".join(f"{r[t]['cosine']:.5f}/{r[t]['rel_l1']:.4f}"
                                         for t in ("out", "dq", "dk", "dv"))
                        print(f"{family:15} {qk_scale:4g} {str(cap):>5} {str(causal):6} {name:13} "
                              f"{cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

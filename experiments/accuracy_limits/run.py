"""Where the 8-bit recipes fall short of PyTorch's SDPA: finite inputs built to hit one stage each
(Q/K balancing, per-block INT8 scales, E4M3 P̃), cosine against float64 exact attention next to
PyTorch's SDPA in the inputs' dtype. CPU twin (the kernels' numerics), B = 1, 2 heads, N = 256,
D = 128, fp16, seed 0.

    python experiments/accuracy_limits/run.py        # prints the table of README.md (~5 s)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lowbit_attn
from lowbit_attn.inference.naive import exact_attention

FP16 = lowbit_attn.get_recipe("qk_int8_pv_fp16")
FP8 = lowbit_attn.get_recipe("qk_int8_pv_fp8")
RECIPES = {
    "`qk_int8_pv_fp16`": FP16,
    "…`per_token`": FP16.replace(granularity="per_token"),
    "`qk_int8_pv_fp8`": FP8,
    "…`smooth_v`": FP8.replace(smooth_v=True),
}


def cases():
    """``(name, q, k, v)``, fp16 ``[1, 2, 256, 128]``."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 2, 256, 128, generator=g) for _ in range(3)]
    d = base[0].shape[-1]

    def edit(fn):
        q, k, v = (x.clone() for x in base)
        fn(q, k, v)
        return tuple(x.half() for x in (q, k, v))

    def outlier_q_zero_k(m):
        def fn(q, k, v):
            q[..., 0] *= m
            k[..., 0] = 0.0
        return fn

    def massive_key(m, v_scale):
        def fn(q, k, v):
            k[:, :, 0] *= m
            v[:, :, 0] *= v_scale
        return fn

    def sink(nats):
        def fn(q, k, v):  # key 0 scores `nats` above the rest, its value 0
            q[..., 0] = 4.0
            k[..., 0] = 0.0
            k[:, :, 0, 0] = nats * d**0.5 / 4.0
            v[:, :, 0] = 0.0
        return fn

    def massive_query(m):
        def fn(q, k, v):
            q[:, :, 5] *= m
        return fn

    yield "ordinary (N(0,1))", *edit(lambda q, k, v: None)
    yield "Q channel ×30, K's channel 0", *edit(outlier_q_zero_k(30))
    yield "Q channel ×100, K's channel 0", *edit(outlier_q_zero_k(100))
    yield "key 0 ×100, its V ×0.01", *edit(massive_key(100, 0.01))
    yield "key 0 ×1000, its V ×0.01", *edit(massive_key(1000, 0.01))
    yield "key 0 ×1000", *edit(massive_key(1000, 1.0))
    yield "query 5 ×100", *edit(massive_query(100))
    yield "key 0 +13 nats above the rest, its V 0", *edit(sink(13))
    yield "key 0 +15 nats above the rest, its V 0", *edit(sink(15))


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def main() -> None:
    print("| input (fp16) | SDPA fp16 | " + " | ".join(RECIPES) + " | max LSE error, "
          "`qk_int8_pv_fp16` |")
    print("|---|---|" + "---|" * len(RECIPES) + "---|")
    for name, q, k, v in cases():
        want, want_lse = exact_attention(q.double(), k.double(), v.double(),
                                         scale=q.shape[-1] ** -0.5)
        cells = [cosine(F.scaled_dot_product_attention(q.float(), k.float(), v.float()).half(),
                        want)]
        cells += [cosine(lowbit_attn.attention(q, k, v, recipe=r), want) for r in RECIPES.values()]
        _, lse = lowbit_attn.attention(q, k, v, recipe=FP16, return_lse=True)
        lse_error = float((lse.double() - want_lse).abs().max())
        print(f"| {name} | " + " | ".join(f"{c:.4f}" for c in cells) + f" | {lse_error:.3f} |")


if __name__ == "__main__":
    main()

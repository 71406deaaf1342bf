"""GPU probe: the Hopper Gluon forward (ping-pong) against the Triton INT8 kernel, kernels alone
on the same operands, B=4, H=32, N=16k, D=128, 64- and 128-key blocks. Needs sm_90. Its H100 run
(2026-11-25, benchmarks/results/h100-2026-11-25-gpu-run.md) also timed an asynchronous Gluon
schedule, deleted since (benchmarks/NOTES.md §11)."""
import torch
from triton.testing import do_bench
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.inference import kernel_int8_gluon as kg, kernel_int8 as ki
torch.manual_seed(0)
B, H, N, D = 4, 32, 16384, 128
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
flops = 4 * B * H * N * N * D
for causal in (False, True):
    for bk in (64, 128):
        r = get_recipe("qk_int8_pv_fp8").replace(block_k=bk)
        qz = quantize_qkv(q, k, v, r, D ** -0.5, need_lse_shift=False, backend="triton")
        out = torch.empty_like(q)
        kw = dict(out=out, pv=r.pv, granularity=r.granularity, block_q=r.block_q, block_k=bk, causal_offset=0 if causal else None, return_lse=False)
        runs = {"triton": lambda: ki.attention(qz, **kw), "pingpong": lambda: kg.attention(qz, **kw)}
        ref = None
        for name, fn in runs.items():
            fn(); torch.cuda.synchronize()
            o = out.float().clone()
            if ref is None: ref = o
            cos = torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item()
            ms = do_bench(fn)
            f = flops / (2 if causal else 1)
            print(f"causal={causal} keys={bk} {name}: {ms:.3f} ms {f / ms / 1e9:.0f} TOP/s cos-vs-triton {cos:.6f}", flush=True)

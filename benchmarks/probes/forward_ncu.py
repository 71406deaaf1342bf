"""One launch of the one-warpgroup Hopper forward (D=128, N=16k, B×H=2×32, per-thread scales,
not causal) after a warm-up, for ``ncu`` to profile (``run_on_gpu.sh forward``: its stall
reasons and issue statistics beside the sweep's times).

    ncu --clock-control none -k regex:_attn_fwd_sm90 -s 1 -c 1 --section WarpStateStats \\
        --section SchedulerStats --section Occupancy python benchmarks/probes/forward_ncu.py
"""

from __future__ import annotations

import sys

import torch

from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import kernel_int8_sm90
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.tools.bench.protocol import make_inputs


def main(argv=None) -> int:
    granularity = (argv or sys.argv[1:] or ["per_thread"])[0]
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity=granularity, block_k=128)
    q, k, v = make_inputs(2, 32, 16384, 128, device="cuda")
    qz = quantize_qkv(q, k, v, recipe, 128 ** -0.5, need_lse_shift=False, backend="triton",
                      permute_v=True)
    out = torch.empty_like(q)
    for _ in range(2):  # the first compiles (skipped by ncu's -s 1), the second is profiled
        kernel_int8_sm90.attention(qz, out=out, pv="fp8", granularity=granularity, block_q=64,
                                   block_k=128, causal_offset=None, return_lse=False)
    torch.cuda.synchronize()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

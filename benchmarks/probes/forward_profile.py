"""Where one end-to-end 8-bit forward spends its GPU time, launch by launch (torch.profiler):

    python benchmarks/probes/forward_profile.py OUT.txt B H N D [causal|full ...]

The file's first lines name the device, the date and the command. For each mask named (default
``full``), one call of ``lowbit_attn.attention`` on bf16 inputs after
two warm-up calls, its CUDA kernels' times appended to OUT.txt as torch.profiler's table (the
channel statistics, the quantization and the attention kernel, each against the others). The
kernel is the one the process's placement variables choose (``LOWBIT_ATTN_KERNEL`` and the rest,
read before the first call).
"""

from __future__ import annotations

import datetime as dt
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lowbit_attn


def main(argv: list[str]) -> None:
    out, dims, masks = argv[0], [int(x) for x in argv[1:5]], argv[5:] or ["full"]
    q, k, v = (torch.randn(*dims, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with open(out, "a") as f:
        f.write(f"# {torch.cuda.get_device_name()}; "
                f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}; command: "
                f"python benchmarks/probes/forward_profile.py {' '.join(argv)}\n")
        for mask in masks:
            def call():
                return lowbit_attn.attention(q, k, v, is_causal=mask == "causal")

            call(), call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            f.write(f"## B,H,N,D = {dims} {mask}\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8) + "\n")
            f.flush()


if __name__ == "__main__":
    main(sys.argv[1:])

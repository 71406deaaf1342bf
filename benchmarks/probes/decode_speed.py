"""GPU probe for the KV-cache decode step (issue 17): where its time goes and which launch is
best. Needs a CUDA GPU; `bash benchmarks/run_on_gpu.sh decode` runs it after bench_decode.py.

Per (N, batch), D = 128, 8 KV heads, GQA 4:1, 64-token pages, fp16:
- SDPA fp16 and our public call: ``do_bench`` (GPU time), host µs to enqueue one call, and the
  wall time per call of a back-to-back loop (``tools.bench.timers.loop_timings``);
- the host time of the parts: the public call by its launch plan and by Triton's launch path
  (``LOWBIT_ATTN_LAUNCH=triton``), the launcher ``kernel_decode.attention``, one split launch,
  one merge launch;
- the launcher's GPU time over pages per split × pipeline stages × the 168-register cap.

The version of 2026-11-25 (results in benchmarks/results/h100-2026-11-25-gpu-run.md) timed the
kernel before its full pages were pipelined; it is in git history (2c98832).
"""
import itertools
import os
import sys

import torch
from triton.testing import do_bench

import lowbit_attn
from lowbit_attn.kvcache import kernel_decode as kd
from lowbit_attn.tools.bench.timers import loop_timings

CONFIGS = [(1024, 1), (8192, 1), (32768, 1), (131072, 1), (8192, 16), (32768, 16)]


def setup(n, batch, hkv=8, group=4, d=128, page=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(batch, hkv, n, d, device="cuda", generator=g).half()
    v = torch.randn(batch, hkv, n, d, device="cuda", generator=g).half()
    q = torch.randn(batch, hkv * group, 1, d, device="cuda", generator=g).half()
    cache = lowbit_attn.QuantizedKVCache(1, batch, hkv, d, max_tokens=n, page_size=page,
                                         dtype=torch.float16, device="cuda")
    cache.append(0, k, v)
    return q, k, v, cache


def host_us(fn):
    return loop_timings(fn, True)[0]


def main():
    with torch.no_grad():
        for n, batch in CONFIGS:
            probe(n, batch)
            torch.cuda.empty_cache()
    return 0


def probe(n, batch):
    q, k, v, cache = setup(n, batch)
    layer, recipe, scale = cache.layers[0], cache.recipe, 128 ** -0.5
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ours = lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0)
    launcher = lambda: kd.attention(q, layer, recipe, scale=scale)
    os.environ["LOWBIT_ATTN_LAUNCH"] = "plan"  # the default, said explicitly
    for name, fn in (("sdpa", sdpa), ("ours", ours)):
        h, loop = loop_timings(fn, True)
        print(f"N={n} B={batch} {name}: do_bench {do_bench(fn) * 1e3:.1f} us, host "
              f"{h:.1f} us, loop {loop * 1e3:.1f} us", flush=True)
    os.environ["LOWBIT_ATTN_LAUNCH"] = "triton"  # the public call without its launch plan
    triton_path = host_us(ours)
    os.environ["LOWBIT_ATTN_LAUNCH"] = "plan"
    split, merge = kd._decode_split_kernel, kd._decode_merge_kernel
    launches = {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(**kw):
                launches[self.kernel] = (grid, kw)
                return self.kernel[grid](**kw)
            return launch

    kd._decode_split_kernel, kd._decode_merge_kernel = Recorder(split), Recorder(merge)
    launcher()
    kd._decode_split_kernel, kd._decode_merge_kernel = split, merge
    parts = {"public call (plan)": host_us(ours), "public call (Triton's launch path)": triton_path,
             "launcher": host_us(launcher)}
    for kernel, (grid, kw) in launches.items():
        parts[f"{kernel.fn.__name__} launch"] = host_us(lambda: kernel[grid](**kw))
    print("  host µs: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)

    best = None
    stages0, launch0 = kd.STAGES, kd.split_launch
    for pps, stages, cap in itertools.product((1, 2, 4, 8, 16), (3, 5, 7), (True, False)):
        kd.STAGES = stages
        if not cap:
            kd.split_launch = lambda r, d, o: (launch0(r, d, o)[0], {
                k: v for k, v in launch0(r, d, o)[1].items() if k != "maxnreg"})
        try:
            t = do_bench(lambda: kd.attention(q, layer, recipe, scale=scale,
                                              pages_per_split=pps)) * 1e3
        except Exception as exc:  # noqa: BLE001 - a failing launch is a line
            print(f"  fail pps={pps} stages={stages} cap={cap}: {exc!r}"[:200])
            continue
        finally:
            kd.STAGES, kd.split_launch = stages0, launch0
        best = min(best or (t, pps, stages, cap), (t, pps, stages, cap))
        print(f"  pps={pps} stages={stages} cap={cap}: {t:.1f} us", flush=True)
    print(f"  BEST {best[0]:.1f} us: pps={best[1]} stages={best[2]} cap={best[3]}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())

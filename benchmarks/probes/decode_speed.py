"""GPU probe (H100 run of 2026-11-25, benchmarks/results/h100-2026-11-25-gpu-run.md): the decode
step of the 8-bit KV cache end to end, its launcher, and the split kernel alone over launch
parameters, against SDPA fp16. Needs a CUDA GPU."""
import itertools

import torch
import lowbit_attn
from lowbit_attn.kvcache import kernel_decode as kd
from triton.testing import do_bench
from lowbit_attn.core.operands import LOG2E
from lowbit_attn.core.triton_helpers import next_pow2, strides

def setup(n, batch, hkv=8, group=4, d=128, page=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(batch, hkv, n, d, device="cuda", generator=g).half()
    v = torch.randn(batch, hkv, n, d, device="cuda", generator=g).half()
    q = torch.randn(batch, hkv * group, 1, d, device="cuda", generator=g).half()
    cache = lowbit_attn.QuantizedKVCache(1, batch, hkv, d, max_tokens=n, page_size=page, dtype=torch.float16, device="cuda")
    cache.append(0, k, v)
    return q, k, v, cache

def split_only(q, layer, recipe, pps, warps, stages):
    bsz, hq, n, d = q.shape; hkv = layer.k.shape[1]; group = hq // hkv; page = layer.page_size
    max_pages = -(-max(layer.host_lengths) // page); ns = max(1, -(-max_pages // pps))
    block_r = next_pow2(group * n, 16); block_d = next_pow2(d, 32)
    on = {"device": q.device, "dtype": torch.float32}
    wacc = torch.empty((bsz, hkv, ns, block_r, d), **on); wm = torch.empty((bsz, hkv, ns, block_r), **on); wl = torch.empty_like(wm)
    def go():
        kd._decode_split_kernel[(bsz, hkv, ns)](
            Q=q, AQ=layer.q_amax, AK=layer.k_amax, K=layer.k, KS=layer.k_scale, V=layer.v, VS=layer.v_scale, VO=layer.v_open,
            BT=layer.block_table, LEN=layer.lengths, WACC=wacc, WM=wm, WL=wl,
            q_strides=strides(q, 4), amax_strides=layer.q_amax.stride()[:2], k_strides=strides(layer.k, 4),
            ks_strides=strides(layer.k_scale, 3), v_strides=strides(layer.v, 4), vs_strides=strides(layer.v_scale, 3),
            vo_strides=strides(layer.v_open, 4), bt_strides=strides(layer.block_table, 2), wacc_strides=strides(wacc, 5),
            wml_strides=strides(wm, 4), qk_multiplier=d ** -0.5 * LOG2E, N=n, GROUP=group, D=d,
            pages_per_split=pps, PAGE=page, PV_FP8=True, EXACT_FP8=False, OPEN_MODE=0, EMU_FP32=False,
            BLOCK_R=block_r, BLOCK_P=next_pow2(page, 32), BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    return go

for n, batch in [(1024, 1), (8192, 1), (32768, 1), (8192, 16), (32768, 16)]:
    q, k, v, cache = setup(n, batch)
    layer = cache.layers[0]
    sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    e2e = do_bench(lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0))
    kern = do_bench(lambda: kd.attention(q, layer, cache.recipe, scale=128 ** -0.5))
    print(f"N={n} B={batch}: sdpa {sdpa*1e3:.1f} us, e2e {e2e*1e3:.1f} us, kd.attention {kern*1e3:.1f} us", flush=True)
    best = None
    for pps, warps, stages in itertools.product((2, 4, 8, 16), (4, 8), (1, 2, 3)):
        try:
            t = do_bench(split_only(q, layer, cache.recipe, pps, warps, stages))
        except Exception as e:
            print("  fail", pps, warps, stages, type(e).__name__, str(e)[:100]); continue
        if best is None or t < best[0]: best = (t, pps, warps, stages)
        print(f"  split pps={pps} w={warps} s={stages}: {t*1e3:.1f} us", flush=True)
    print(f"  BEST {best[0]*1e3:.1f} us pps={best[1]} w={best[2]} s={best[3]}", flush=True)
    torch.cuda.empty_cache()

"""GPU probe for the trainable attention (issue 28): where the forward + backward's time goes.
Needs a CUDA GPU; `bash benchmarks/run_on_gpu.sh train` runs it after bench_train.py.

Per (N, causal), B = 2, H = 16, D = 128, bf16, ``sagebwd_int8``:
- the card's ceilings, measured first: INT8 ``torch._int_mm`` and a bf16 matmul (8192³);
- each launch of one forward + backward alone (the quantizations, the forward, the Δ pass, dK/dV,
  dQ), timed by ``do_bench`` with the autotuner's pick, beside its floor (its tensor-core work
  over the measured ceilings: NOTES §8's count) and, for the kernels with candidates, every
  candidate forced (warps × stages);
- each compiled variant's facts from the GPU's own compile: registers, spills, and its wgmma
  forms (N < 64 marked);
- the backward on the Gluon loops for Hopper (``LOWBIT_ATTN_BWD_KERNEL=sm90``,
  ``training/kernel_bwd_sm90.py``) whole and launch by launch against the same floors, with P
  and dS per tile (the recipe's) and per row (``backward_granularity="per_row"``, whole: on the
  Triton kernels and on the sm90 loops).

``--quick`` (``run_on_gpu.sh decide2``, ~1 minute): N = 16k non-causal only, no forced
candidates, P and dS per tile only: where the default training call's time goes on Hopper.
"""
import re
import sys

import torch
from triton.testing import do_bench

from lowbit_attn.core.recipes import resolve_train
from lowbit_attn.training import kernel_bwd, kernel_fwd
from lowbit_attn.training.prepare import prepare, prepare_grad

CONFIGS = [(4096, False), (16384, False), (4096, True)]
QUICK_CONFIGS = [(16384, False)]
B, H, D = 2, 16, 128
# matmuls per launch, in units u = 2·N²·D per head: (INT8, 16-bit) (NOTES §8)
WORK = {"_train_fwd_kernel": (2, 0), "_train_dq_kernel/delta": (1, 1), "_train_dkdv_kernel": (3, 1),
        "_train_dq_kernel": (2, 1), "_dq_sm90_kernel/delta": (1, 1), "_dkdv_sm90_kernel": (3, 1),
        "_dq_sm90_kernel": (2, 1)}
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m64n(\d+)k\d+\.\w+\.\w+\.\w+)")


def ceilings() -> tuple[float, float]:
    """(INT8 TOP/s, bf16 TFLOP/s) of 8192³ matmuls on this card."""
    n = 8192
    a8 = torch.randint(-127, 127, (n, n), dtype=torch.int8, device="cuda")
    b8 = torch.randint(-127, 127, (n, n), dtype=torch.int8, device="cuda").t()
    a16, b16 = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    int8 = 2 * n**3 / (do_bench(lambda: torch._int_mm(a8, b8)) * 1e-3) / 1e12
    bf16 = 2 * n**3 / (do_bench(lambda: a16 @ b16) * 1e-3) / 1e12
    return int8, bf16


def compiled_facts(kernel) -> list[str]:
    """Registers, spills and wgmma forms of each variant the JIT function compiled."""
    jit = kernel
    while hasattr(jit, "fn") and not hasattr(jit, "device_caches"):
        jit = jit.fn
    lines = []
    for compiled in jit.device_caches[torch.cuda.current_device()][0].values():
        forms = {}
        for form, n in WGMMA.findall(compiled.asm.get("ptx", "")):
            forms[form + (" (N < 64)" if int(n) < 64 else "")] = forms.get(form, 0) + 1
        meta = compiled.metadata
        lines.append(f"    {meta.num_warps} warps, {meta.num_stages} stages: {compiled.n_regs} "
                     f"registers, {compiled.n_spills} spills; wgmma {forms or 'none'}")
    return lines


def name_of(kernel, kwargs) -> str:
    jit = kernel
    while hasattr(jit, "fn"):
        jit = jit.fn
    return jit.__name__ + ("/delta" if kwargs.get("DELTA_PASS") else "")


def probe(n: int, causal: bool, int8_peak: float, bf16_peak: float, quick: bool = False) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(4))
    recipe, scale = resolve_train("sagebwd_int8"), D ** -0.5
    offset = 0 if causal else None
    ops = prepare(q, k, v, recipe, scale, "triton")
    out = torch.empty_like(q)
    lse = kernel_fwd.forward(ops, out=out, causal_offset=offset)
    grad = prepare_grad(do, recipe, "triton")
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    u = 2 * n * n * D * B * H * (0.5 if causal else 1.0)
    print(f"N={n} causal={causal}: u = {u / 1e12:.3f} T ops; whole calls:", flush=True)
    for what, fn in (("prepare (Q, K, V quantized)", lambda: prepare(q, k, v, recipe, scale,
                                                                    "triton")),
                     ("prepare_grad (dO)", lambda: prepare_grad(do, recipe, "triton")),
                     ("forward kernel", lambda: kernel_fwd.forward(ops, out=out,
                                                                   causal_offset=offset)),
                     ("backward kernels", lambda: kernel_bwd.backward(
                         ops, grad, lse, dq, dk, dv, causal_offset=offset, softmax_scale=scale,
                         mode="recompute"))):
        print(f"  {what}: {do_bench(fn) * 1e3:.1f} us", flush=True)
    grid, kwargs = kernel_fwd.launch_args(ops, out, lse, offset)
    launches = [(kernel_fwd._train_fwd, grid, kwargs)] + kernel_bwd.launch_args(
        ops, grad, lse, dq, dk, dv, causal_offset=offset, softmax_scale=scale, mode="recompute")
    for kernel, grid, kwargs in launches:
        name = name_of(kernel, kwargs)
        t = do_bench(lambda: kernel[grid](**kwargs)) * 1e-3
        floor = floor_of(name, u, int8_peak, bf16_peak)
        best = getattr(kernel, "best_config", None)
        print(f"  {name}: {t * 1e6:.1f} us, floor {floor * 1e6:.1f} us "
              f"({floor / t:.0%} of the tensor-core floor); autotuner: {best}", flush=True)
        configs = getattr(kernel, "configs", [])
        for config in configs if len(configs) > 1 and not quick else []:
            try:
                ct = do_bench(lambda: kernel.fn[grid](**kwargs, **config.all_kwargs()))
                print(f"    forced {config}: {ct * 1e3:.1f} us", flush=True)
            except Exception as exc:  # noqa: BLE001 - a failing candidate is a line
                print(f"    forced {config}: failed {exc!r}"[:200], flush=True)
        print("\n".join(compiled_facts(kernel)), flush=True)
    sm90(ops, grad, lse, dq, dk, dv, offset, scale, recipe, q, k, v, do, u, int8_peak, bf16_peak,
         granularities=("per_tile",) if quick else ("per_tile", "per_row"))


def floor_of(name: str, u: float, int8_peak: float, bf16_peak: float) -> float:
    i8, b16 = WORK.get(name, (0, 0))
    return i8 * u / (int8_peak * 1e12) + b16 * u / (bf16_peak * 1e12)


def sm90(ops, grad, lse, dq, dk, dv, offset, scale, recipe, q, k, v, do, u, int8_peak,
         bf16_peak, granularities=("per_tile", "per_row")) -> None:
    """The backward on the sm90 loops, whole (per tile and per row, beside the Triton kernels)
    and launch by launch (the recipe's granularity)."""
    from lowbit_attn.core import triton_support

    for granularity in granularities:
        r = recipe.replace(backward_granularity=granularity)
        ops_g, grad_g = prepare(q, k, v, r, scale, "triton"), prepare_grad(do, r, "triton")
        for kernel in ("triton", "sm90"):
            t = do_bench(lambda: kernel_bwd.backward(
                ops_g, grad_g, lse, dq, dk, dv, causal_offset=offset, softmax_scale=scale,
                mode="recompute", kernel=kernel)) * 1e3
            print(f"  backward, P and dS {granularity}, {kernel} kernels: {t:.1f} us", flush=True)
    if torch.cuda.get_device_capability() != (9, 0) or not triton_support.gluon_available("hopper"):
        print("  (the sm90 loops need sm_90 and Gluon's Hopper API: the Triton kernels ran)")
        return
    from lowbit_attn.training import kernel_bwd_sm90

    for name, launch in kernel_bwd_sm90.launches(ops, grad, lse, dq, dk, dv,
                                                 causal_offset=offset, softmax_scale=scale):
        t = do_bench(launch) * 1e-3
        floor = floor_of(name, u, int8_peak, bf16_peak)
        print(f"  {name}: {t * 1e6:.1f} us, floor {floor * 1e6:.1f} us "
              f"({floor / t:.0%} of the tensor-core floor)", flush=True)
    for kernel in (kernel_bwd_sm90._dkdv_sm90_kernel, kernel_bwd_sm90._dq_sm90_kernel):
        print("\n".join(compiled_facts(kernel)), flush=True)


def main(argv=None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("train_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    int8_peak, bf16_peak = ceilings()
    print(f"ceilings: INT8 {int8_peak:.0f} TOP/s, bf16 {bf16_peak:.0f} TFLOP/s (8192^3)",
          flush=True)
    for n, causal in QUICK_CONFIGS if quick else CONFIGS:
        probe(n, causal, int8_peak, bf16_peak, quick)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

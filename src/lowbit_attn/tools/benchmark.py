"""Attention benchmark: :func:`lowbit_attn.attention` against PyTorch SDPA (FlashAttention-2 and
cuDNN backends) and SageAttention 1.0.6, following the protocol of DESIGN.md.

Protocol: ``triton.testing.do_bench(fn, return_mode="median")``; B=4, H=32, D ∈ {64, 128},
N ∈ {1k, 2k, 4k, 8k, 16k, 32k}, causal and not; TOP/s = 4·B·H·N²·D / t, halved when causal. Our
rows time the public call end to end (quantization included); baselines run in the same process on
the same inputs. Before a method is timed its output is compared with an SDPA reference on the same
inputs (cosine similarity; a failed check shows as ``✗`` in every table), and its peak extra memory
is recorded. Configurations that run out of memory or that a backend does not support are recorded
with the reason and skipped.

Results are a dict ``{"metadata": {...}, "rows": [...], "complete": bool}`` written as
``<gpu-slug>-<YYYY-MM-DD>.json``, a markdown table ``.md`` and a bar chart ``.png`` (matplotlib is
optional). Without CUDA, ``bench`` times the PyTorch reference at a tiny size instead and says so;
those are not kernel benchmarks.

Entry points: :func:`add_arguments` / :func:`cli_main` (the ``lowbit-attn bench`` subcommand),
:func:`main` (``python benchmarks/bench_attention.py``), :func:`run_benchmark` (library use).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from lowbit_attn.core import checks
from lowbit_attn.integrations.sdpa import TORCH_SDPA
from lowbit_attn.core.arch import arch_name, backend_for
from lowbit_attn.core.recipes import RECIPES, Recipe, resolve
from lowbit_attn.tools.args import head_dim_arg, positive_int, ranged

BATCH = 4
HEADS = 32
DIMS = (64, 128)
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_DIMS = (128,)
QUICK_SEQLENS = (1024, 4096, 16384)
OUR_RECIPES = ("qk_int8_pv_fp8", "qk_int8_pv_fp16")
BASELINES = ("flash", "cudnn", "sage")
# A sanity check that catches broken kernels, not a statement of recipe quality: on these inputs the
# FP8 recipe's own error is cosine ≈ 0.9993 at every N (E4M3 keeps ~3.6% rms relative error and the
# output's size shrinks with N as fast as its error does); the fp16-P·V recipe reaches ≈ 0.99993.
MIN_COSINE = 0.998
# FP4 recipes' own error on these inputs is cosine ≈ 0.982 (NVFP4) / 0.973 (MXFP4) at N=4096
# (experiments/fp4_accuracy): their check is scaled by the same margin.
FP4_MIN_COSINE = 0.95
K_BIAS = 4.0  # k += K_BIAS·N(0, 1) per (batch, head, channel): the outlier channels of real models
SAGE_VERSION = "1.0.6"

# The bar of the issue: end-to-end speed over SDPA cuDNN (bf16), by sequence length.
TARGETS = ((8192, 1.25), (1024, 1.0))
CUDNN_KEY = "sdpa_cudnn_bf16"
FLASH_KEY = "sdpa_flash_fp16"
SAGE_KEY = "sageattn_fp16"

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
STATUSES = ("ok", "oom", "unsupported", "error", "skipped")
ROW_FIELDS = (
    "method", "label", "kind", "recipe", "dtype", "B", "H", "N", "D", "causal", "status", "reason",
    "time_ms", "tops", "cosine", "rel_l1", "max_abs_err", "nonfinite", "check", "reference",
    "peak_extra_mib", "model_bytes", "gbps", "autotune",
)


# --------------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class Method:
    """One timed implementation.

    Attributes:
        key: stable id used in the JSON and the tables.
        label: column header.
        kind: ``"ours"`` (public call), ``"stage"`` (one stage of our call: ``backend`` is
            ``"prepare"`` or ``"attention"``), ``"sdpa"`` (``backend`` names the SDPBackend),
            ``"sage"`` or ``"cpu_reference"`` (our public call on a CPU).
        dtype: input dtype, ``"fp16"`` or ``"bf16"``.
        recipe: our recipe name (ours, stage, cpu_reference).
        backend: SDPA backend or stage name.
    """

    key: str
    label: str
    kind: str
    dtype: str = "fp16"
    recipe: str | None = None
    backend: str | None = None


def _recipe_tag(name: str) -> str:
    tags = {"qk_int8_pv_fp8": "fp8", "qk_int8_pv_fp16": "fp16", "qk_fp4_pv_fp4": "nvfp4",
            "qk_mxfp4_pv_mxfp4": "mxfp4"}
    return tags.get(name, name)


def select_methods(
    recipes: Iterable[str] = OUR_RECIPES,
    baselines: Iterable[str] = BASELINES,
    *,
    bf16: bool = True,
    breakdown: bool = True,
) -> list[Method]:
    """The methods of a GPU run, in table order: our recipes (fp16 inputs, plus bf16 inputs for the
    FP8 recipe), the baselines, then the stage timings of each recipe (quantization only,
    attention kernel only)."""
    recipes, baselines = list(recipes), list(baselines)
    for r in recipes:
        if r != "auto" and r not in RECIPES:
            raise ValueError(f"unknown recipe {r!r}; expected 'auto' or one of {sorted(RECIPES)}")
        if r == "exact":
            raise ValueError(
                "recipe 'exact' runs the PyTorch reference (it materialises N×N scores), not a "
                "kernel; benchmark it with SDPA instead"
            )
    for b in baselines:
        if b not in BASELINES:
            raise ValueError(f"unknown baseline {b!r}; expected some of {BASELINES} or 'none'")
    methods: list[Method] = []
    for r in recipes:
        tag = _recipe_tag(r)
        methods.append(Method(f"ours_{tag}", f"ours {r}", "ours", "fp16", recipe=r))
        if bf16 and r == "qk_int8_pv_fp8":
            methods.append(Method(f"ours_{tag}_bf16", f"ours {r} (bf16)", "ours", "bf16", recipe=r))
    if "flash" in baselines:
        methods.append(
            Method(FLASH_KEY, "SDPA flash fp16", "sdpa", "fp16", backend="FLASH_ATTENTION")
        )
    if "cudnn" in baselines:
        methods.append(
            Method(CUDNN_KEY, "SDPA cuDNN bf16", "sdpa", "bf16", backend="CUDNN_ATTENTION")
        )
        methods.append(
            Method("sdpa_cudnn_fp16", "SDPA cuDNN fp16", "sdpa", "fp16", backend="CUDNN_ATTENTION")
        )
    if "sage" in baselines:
        methods.append(Method(SAGE_KEY, f"SageAttention {SAGE_VERSION} fp16", "sage", "fp16"))
    if breakdown:
        for r in recipes:
            tag = _recipe_tag(r)
            methods.append(Method(f"ours_{tag}_prepare", f"ours {r}: quantization only", "stage",
                                  "fp16", recipe=r, backend="prepare"))
            methods.append(Method(f"ours_{tag}_attn", f"ours {r}: attention kernel only", "stage",
                                  "fp16", recipe=r, backend="attention"))
    return methods


def cpu_methods(recipes: Iterable[str] = OUR_RECIPES) -> list[Method]:
    """Our public call on CPU tensors (the PyTorch reference) for each recipe and the exact one."""
    names = [r for r in recipes if r != "exact"] + ["exact"]
    return [
        Method(f"cpu_{_recipe_tag(r)}", f"reference {r} (CPU)", "cpu_reference", "fp16", recipe=r)
        for r in names
    ]


# --------------------------------------------------------------------------------------------------
# Arithmetic


def attention_ops(batch: int, heads: int, n: int, d: int, causal: bool) -> float:
    """Operations of one attention forward by the protocol: ``4·B·H·N²·D``, halved when causal."""
    ops = 4.0 * batch * heads * n * n * d
    return ops / 2 if causal else ops


def tops(batch: int, heads: int, n: int, d: int, causal: bool, time_ms: float) -> float:
    """TOP/s (10¹² operations per second) of one forward that took ``time_ms`` milliseconds."""
    return attention_ops(batch, heads, n, d, causal) / (time_ms * 1e-3) / 1e12


def quantization_bytes(
    recipe: Recipe, elems_q: int, elems_kv: int, in_bytes: int = 2, *, q_in_kernel: bool = False,
    kv_stats_in_program: bool = False,
) -> int | None:
    """HBM bytes the quantization passes of ``prepare.quantize_qkv`` move, counted from its code.

    Passes: channel statistics of K (smoothing / balancing), of Q (balancing) and of V (FP8 scale),
    each reading its tensor (one launch for all three); INT8 quantization of K and V's conversion
    (one launch: read in_bytes, write 1 byte per element, or 2 for fp16 V); INT8 quantization of Q
    only when the attention kernel does not quantize it (``q_in_kernel`` false). With
    ``kv_stats_in_program`` K's and V's statistics are taken by the launch that quantizes them,
    whose second read is counted as an L2 hit (no HBM bytes). The ``[B, H, D]`` statistics are
    negligible. ``None`` with Q smoothing (its ΔS pass is not modelled).
    """
    if recipe.is_exact or recipe.smooth_q:
        return None
    total = 0
    kv_stats_read = 0 if kv_stats_in_program else in_bytes * elems_kv
    if recipe.smooth_k or recipe.balance_qk:
        total += kv_stats_read
    if recipe.balance_qk:
        total += in_bytes * elems_q
    total += (in_bytes + 1) * elems_kv
    if not q_in_kernel:
        total += (in_bytes + 1) * elems_q
    if recipe.pv == "fp8" or recipe.smooth_v:
        total += kv_stats_read
    total += (in_bytes + (1 if recipe.pv == "fp8" else 2)) * elems_kv
    return total


def attention_bytes(recipe: Recipe, elems_q: int, elems_kv: int, out_bytes: int = 2, *,
                    in_bytes: int = 2, q_in_kernel: bool = False) -> int:
    """HBM bytes of the attention kernel when K/V tiles are reused from L2: read Q (16-bit when the
    kernel quantizes it, else INT8), INT8 K, V (1 byte FP8 or 2 bytes fp16) once, write O."""
    q_bytes = in_bytes if q_in_kernel else 1
    return (q_bytes * elems_q + elems_kv + (1 if recipe.pv == "fp8" else 2) * elems_kv
            + out_bytes * elems_q)


# --------------------------------------------------------------------------------------------------
# Running one method


class Unsupported(Exception):
    """The backend cannot run this configuration (recorded, not an error)."""


def make_inputs(batch, heads, n, d, *, device, dtype=torch.float16, seed=0, bias=K_BIAS):
    """``q, k, v ~ N(0, 1)`` HND, with ``k += bias·N(0, 1)`` per (batch, head, channel)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, d)
    q = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k += bias * torch.randn((batch, heads, 1, d), generator=g, device=device, dtype=dtype)
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return q, k, v


def compare(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 25) -> dict:
    """Cosine similarity, relative L1, max |error| and count of non-finite outputs, in float64 by
    chunks (the outputs reach 2³⁰ elements)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    a, b = out.reshape(-1), ref.reshape(-1)
    dot = aa = bb = l1 = ref_l1 = 0.0
    max_err = 0.0
    nonfinite = 0
    for i in range(0, a.numel(), chunk):
        x, y = a[i : i + chunk].double(), b[i : i + chunk].double()
        nonfinite += int((~torch.isfinite(x)).sum())
        dot += float(torch.dot(x, y))
        aa += float(torch.dot(x, x))
        bb += float(torch.dot(y, y))
        diff = (x - y).abs()
        l1 += float(diff.sum())
        ref_l1 += float(y.abs().sum())
        max_err = max(max_err, float(diff.max())) if diff.numel() else max_err
    cos = dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else float("nan")
    if nonfinite:
        cos = float("nan")
    return {
        "cosine": cos,
        "rel_l1": l1 / ref_l1 if ref_l1 > 0 else float("nan"),
        "max_abs_err": max_err,
        "nonfinite": nonfinite,
    }


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


def reference_output(q, k, v, causal: bool) -> tuple[torch.Tensor, str]:
    """The reference every method is checked against, on the same input values: on a GPU SDPA
    flash in fp16 (bf16 inputs convert to fp16 exactly at these magnitudes; memory-efficient and
    math backends as fallbacks), on a CPU SDPA math in fp32."""
    from torch.nn.attention import sdpa_kernel

    if q.device.type != "cuda":
        with sdpa_kernel([_sdpa_backend("MATH")]):
            out = TORCH_SDPA(q.float(), k.float(), v.float(), is_causal=causal)
        return out, "sdpa_math_fp32"
    x = [t.to(torch.float16) for t in (q, k, v)]
    errors = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([_sdpa_backend(name)]):
                    out = TORCH_SDPA(*x, is_causal=causal)
            return out, f"sdpa_{name.split('_')[0].lower()}_fp16"
        except RuntimeError as exc:  # no kernel for this case, or OOM of the math backend
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            errors.append(f"{name}: {first_line(exc)}")
    raise Unsupported("no SDPA reference could run: " + "; ".join(errors))


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``"<ExceptionType>: <first line of its message>"``, at most ``limit`` characters."""
    text = str(exc).strip().splitlines()
    msg = f"{type(exc).__name__}: {text[0] if text else ''}"
    return msg[:limit]


def _sdpa_fn(method: Method, q, k, v, causal):
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backend(method.backend)

    def fn():
        return TORCH_SDPA(q, k, v, is_causal=causal)

    return fn, (lambda: sdpa_kernel([backend]))


def _sage_fn(method: Method, q, k, v, causal):
    if q.device.type != "cuda":
        raise Unsupported("sageattention needs CUDA tensors")
    if q.shape[-1] not in (64, 96, 128):
        raise Unsupported(f"sageattention supports head dims 64, 96, 128 (got {q.shape[-1]})")
    try:
        from sageattention import sageattn
    except ImportError as exc:
        raise Unsupported(
            f"sageattention is not importable ({first_line(exc)}); install "
            f"sageattention=={SAGE_VERSION} (carry "
            f"wheels/sageattention-{SAGE_VERSION}-py3-none-any.whl)"
        ) from None
    # sageattn smooths K in place (k -= mean): give it its own copy; after the first call the copy
    # has zero mean, so later calls compute the same function on the same values.
    k_own = k.clone()

    def fn():
        return sageattn(q, k_own, v, tensor_layout="HND", is_causal=causal)

    return fn, contextlib.nullcontext


def _ours_fn(method: Method, q, k, v, causal):
    from lowbit_attn.inference import attention

    def fn():
        return attention(q, k, v, is_causal=causal, recipe=method.recipe)

    return fn, contextlib.nullcontext


def _stage_fn(method: Method, q, k, v, causal):
    """Our call split in its two stages, as ``inference.op.run`` does on the Triton backend."""
    if backend_for(q.device) != "triton":
        raise Unsupported("stage timings need the Triton backend (a CUDA GPU, or "
                          "LOWBIT_ATTN_BACKEND=triton with TRITON_INTERPRET=1)")
    from lowbit_attn.core.options import KernelOptions
    from lowbit_attn.inference import kernel_fp4 as attn_fwd_fp4, kernel_int8 as attn_fwd_int8
    from lowbit_attn.inference.prepare import quantize_qkv, quantize_qkv_fp4

    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    r = resolve(method.recipe, cap)
    scale = q.shape[-1] ** -0.5
    options = KernelOptions.from_env()
    if r.is_fp4:
        def prepare():
            return quantize_qkv_fp4(q, k, v, r, scale, need_lse_shift=False, backend="triton")
    else:
        def prepare():
            return quantize_qkv(q, k, v, r, scale, need_lse_shift=False, backend="triton",
                                q_in_kernel=options.q_in_kernel,
                                kv_stats_in_program=options.kv_stats_in_program)

    if method.backend == "prepare":
        return prepare, contextlib.nullcontext
    qz = prepare()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    offset = 0 if causal else None

    def attend():
        if r.is_fp4:
            attn_fwd_fp4.attention(
                qz, out=out, head_dim=q.shape[-1], block_q=r.block_q, block_k=r.block_k,
                causal_offset=offset, two_level=r.two_level_p, return_lse=False,
            )
        else:
            attn_fwd_int8.attention(
                qz, out=out, pv=r.pv, granularity=r.granularity, block_q=r.block_q,
                block_k=r.block_k, causal_offset=offset, return_lse=False,
            )
        return out

    return attend, contextlib.nullcontext


BUILDERS = {
    "ours": _ours_fn,
    "cpu_reference": _ours_fn,
    "stage": _stage_fn,
    "sdpa": _sdpa_fn,
    "sage": _sage_fn,
}


def autotune_choice() -> str | None:
    """The config the INT8 attention kernel's autotuner chose last (``None`` when unknown)."""
    try:
        from lowbit_attn.inference import kernel_int8 as attn_fwd_int8

        best = getattr(attn_fwd_int8._attn_fwd_int8, "best_config", None)
        return None if best is None else str(best)
    except Exception:  # diagnostic only; the kernel module may change
        return None


def _call_checked(fn, ctx):
    """First call; SDPA's "no kernel" refusals become :class:`Unsupported` with its reasons."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with ctx():
                out = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return out
        except RuntimeError as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            msg = str(exc)
            if "No available kernel" in msg or "No viable backend" in msg:
                reasons = []
                for w in caught:
                    text = " ".join(str(w.message).split())
                    if text not in reasons:
                        reasons.append(text)
                detail = "; ".join(reasons) or first_line(exc)
                raise Unsupported(detail[:600]) from None
            raise


def new_row(method: Method, batch, heads, n, d, causal) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(
        method=method.key, label=method.label, kind=method.kind, recipe=method.recipe,
        dtype=method.dtype, B=batch, H=heads, N=n, D=d, causal=causal, status="skipped",
    )
    return row


def measure_method(method, inputs, refs, row, *, timer, min_cosine, causal):
    """Check ``method`` against the reference, record its peak extra memory (CUDA) and time it,
    filling ``row``; ``inputs(dtype)`` gives q, k, v and ``refs`` caches the references by dtype."""
    q, k, v = inputs(method.dtype)
    fn, ctx = BUILDERS[method.kind](method, q, k, v, causal)
    cuda = q.device.type == "cuda"
    out = _call_checked(fn, ctx)
    if method.kind != "sdpa" and method.kind != "sage" and backend_for(q.device) == "triton" \
            and not (method.kind == "stage" and method.backend == "prepare"):
        row["autotune"] = autotune_choice()
    if not (method.kind == "stage" and method.backend == "prepare"):
        if method.dtype not in refs:
            refs[method.dtype] = reference_output(q, k, v, causal)
        ref, ref_name = refs[method.dtype]
        row.update(compare(out, ref))
        row["reference"] = ref_name
        fp4 = method.recipe is not None and method.recipe in RECIPES and RECIPES[method.recipe].is_fp4
        ok = row["nonfinite"] == 0 and row["cosine"] >= (min(min_cosine, FP4_MIN_COSINE) if fp4
                                                         else min_cosine)
        row["check"] = "pass" if ok else "FAIL"
    del out
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx():
            out = fn()
        torch.cuda.synchronize()
        row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        del out
    with ctx():
        t_ms = float(timer(fn))
    row["time_ms"] = t_ms
    b, h, n, d = row["B"], row["H"], row["N"], row["D"]
    if method.kind == "stage" and method.backend == "prepare":
        cap = torch.cuda.get_device_capability(q.device) if cuda else None
        from lowbit_attn.core.options import KernelOptions

        options = KernelOptions.from_env()
        nbytes = quantization_bytes(resolve(method.recipe, cap), b * h * n * d, b * h * n * d,
                                    in_bytes=q.element_size(), q_in_kernel=options.q_in_kernel,
                                    kv_stats_in_program=options.kv_stats_in_program)
        if nbytes is not None:
            row["model_bytes"] = nbytes
            row["gbps"] = nbytes / (t_ms * 1e-3) / 1e9
    else:
        row["tops"] = tops(b, h, n, d, causal, t_ms)
    row["status"] = "ok"


def cuda_timer(warmup_ms: float, rep_ms: float) -> Callable:
    """``fn → ms``: Triton's ``do_bench`` median."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def cpu_timer(reps: int = 5, warmup: int = 1) -> Callable:
    """``fn → ms``: median of ``reps`` wall-clock calls after ``warmup`` calls."""
    def timer(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return timer


def timer_for(cuda: bool, *, warmup_ms: float = 25, rep_ms: float = 100) -> Callable:
    """A timer ``fn → ms`` for the benchmark scripts: Triton's ``do_bench`` median on a GPU, one
    wall-clock run on a CPU (whose numbers only show that the script works)."""
    return cuda_timer(warmup_ms, rep_ms) if cuda else cpu_timer(reps=1, warmup=0)


def peak_extra_mib(step: Callable, cuda: bool) -> float | None:
    """Peak memory that one more ``step()`` allocates beyond what is live before it (MiB), after
    one warm-up run; ``None`` without CUDA."""
    step()
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def free_memory(cuda: bool) -> None:
    """Collect garbage and, on CUDA, return cached blocks to the driver."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# The run


def _versions() -> dict:
    import importlib.metadata as md

    import triton

    from lowbit_attn import __version__

    def dist(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cudnn = None
    with contextlib.suppress(Exception):
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "lowbit_attn": __version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "sageattention": dist("sageattention"),
    }


def device_metadata(device: str) -> dict:
    if device == "cuda":
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        cap = torch.cuda.get_device_capability(idx)
        return {
            "device": "cuda",
            "device_name": torch.cuda.get_device_name(idx),
            "capability": list(cap),
            "arch": arch_name(cap),
            "sm_count": props.multi_processor_count,
            "total_memory_gib": round(props.total_memory / 2**30, 1),
        }
    cpu = platform.processor() or platform.machine() or "unknown"
    return {
        "device": "cpu",
        "device_name": f"CPU ({cpu}, {os.cpu_count()} cores)",
        "capability": None,
        "arch": None,
        "sm_count": None,
        "total_memory_gib": None,
    }


def _git_revision() -> str | None:
    """``<commit>`` or ``<commit>+dirty`` of the source checkout, when there is one."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True, timeout=10)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def make_metadata(*, device: str, mode: str, protocol: dict, argv: list[str] | None = None) -> dict:
    now = dt.datetime.now(dt.timezone.utc)
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("LOWBIT_ATTN_", "TRITON_")) or k == "CUDA_VISIBLE_DEVICES"}
    meta = {
        "schema": 1,
        "mode": mode,
        **device_metadata(device),
        "date_utc": now.isoformat(timespec="seconds"),
        "date": now.strftime("%Y-%m-%d"),
        "hostname": socket.gethostname(),
        "command": shlex.join(sys.argv if argv is None else argv),
        "versions": _versions(),
        "git": _git_revision(),
        "backend": backend_for(torch.device(device)),
        "environment": env,
        "protocol": protocol,
    }
    return meta


def run_benchmark(
    *,
    dims: Iterable[int] = DIMS,
    seqlens: Iterable[int] = SEQLENS,
    causal_values: Iterable[bool] = (False, True),
    batch: int = BATCH,
    heads: int = HEADS,
    methods: list[Method] | None = None,
    device: str | None = None,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    cpu_reps: int = 5,
    min_cosine: float = MIN_COSINE,
    seed: int = 0,
    time_budget_s: float | None = None,
    mode: str | None = None,
    on_config_done: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> dict:
    """Check and time every method on every configuration; returns the results dict.

    On CUDA the timer is ``triton.testing.do_bench(return_mode="median")``; on a CPU a median of
    ``cpu_reps`` wall-clock calls. ``time_budget_s`` stops starting new measurements once spent (the
    rest are recorded as skipped); ``on_config_done`` receives the partial results after each
    configuration (used to save them as the run goes).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    dims, seqlens, causal_values = list(dims), list(seqlens), list(causal_values)
    methods = list(methods) if methods is not None else select_methods()
    timer = cuda_timer(warmup_ms, rep_ms) if cuda else cpu_timer(cpu_reps)
    protocol = {
        "B": batch, "H": heads, "dims": dims, "seqlens": seqlens, "causal": causal_values,
        "layout": "HND",
        "timer": (f"triton.testing.do_bench(fn, warmup={warmup_ms}, rep={rep_ms}, "
                  "return_mode='median')" if cuda else f"median of {cpu_reps} wall-clock calls"),
        "tops": "4*B*H*N^2*D / t, halved when causal",
        "timed": "the public call lowbit_attn.attention(q, k, v, is_causal=..., recipe=...) end "
                 "to end, quantization included (stage rows: quantize_qkv alone, attention "
                 "kernel alone)",
        "inputs": f"q, k, v ~ N(0,1) HND, k += {K_BIAS}*N(0,1) per (batch, head, channel), "
                  f"seed {seed}",
        "check": f"cosine similarity vs the reference on the same inputs >= {min_cosine}, "
                 "no NaN/Inf",
        "methods": [m.__dict__ for m in methods],
    }
    results = {
        "metadata": make_metadata(device=device, mode=mode or ("gpu" if cuda else "cpu"),
                                  protocol=protocol),
        "rows": [],
        "complete": False,
    }
    configs = [(d, causal, n) for d in dims for causal in causal_values for n in seqlens]
    start = time.monotonic()
    bar = _progress(len(configs) * len(methods), progress)
    try:
        for d, causal, n in configs:
            rows = [new_row(m, batch, heads, n, d, causal) for m in methods]
            _run_config(rows, methods, batch, heads, n, d, causal, device=device, seed=seed,
                        timer=timer, min_cosine=min_cosine, start=start,
                        time_budget_s=time_budget_s, bar=bar)
            results["rows"].extend(rows)
            if on_config_done is not None:
                on_config_done(results)
    finally:
        if bar is not None:
            bar.close()
    results["complete"] = True
    results["metadata"]["elapsed_s"] = round(time.monotonic() - start, 1)
    return results


def _run_config(rows, methods, batch, heads, n, d, causal, *, device, seed, timer, min_cosine,
                start, time_budget_s, bar):
    cuda = device == "cuda"
    cache: dict[str, tuple] = {}
    refs: dict[str, tuple] = {}

    def inputs(dtype: str):
        if dtype not in cache:
            if "fp16" not in cache:
                cache["fp16"] = make_inputs(batch, heads, n, d, device=device, seed=seed)
            if dtype != "fp16":
                cache[dtype] = tuple(x.to(DTYPES[dtype]) for x in cache["fp16"])
        return cache[dtype]

    for method, row in zip(methods, rows):
        if bar is not None:
            bar.set_description(f"D={d} N={n} {'causal' if causal else 'full'} {method.key}")
        if time_budget_s is not None and time.monotonic() - start >= time_budget_s:
            row.update(status="skipped", reason=f"time budget of {time_budget_s:.0f} s spent")
        else:
            try:
                measure_method(method, inputs, refs, row, timer=timer, min_cosine=min_cosine,
                               causal=causal)
            except torch.cuda.OutOfMemoryError as exc:
                row.update(status="oom", reason=first_line(exc))
            except Unsupported as exc:
                row.update(status="unsupported", reason=str(exc))
            except Exception as exc:  # recorded in the row; one failing method must not end the run
                row.update(status="error", reason=first_line(exc),
                           detail=traceback.format_exc(limit=6)[-2000:])
            finally:
                free_memory(cuda)
        if bar is not None:
            bar.update(1)
        else:
            _log_row(row)
    cache.clear()
    refs.clear()
    free_memory(cuda)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=False)


def _log_row(row: dict) -> None:
    what = f"D={row['D']} N={row['N']} causal={row['causal']} {row['method']}"
    if row["status"] == "ok":
        extra = f"{row['time_ms']:.3f} ms"
        if row["tops"] is not None:
            extra += f", {row['tops']:.0f} TOP/s"
        if row["cosine"] is not None:
            extra += f", cos {row['cosine']:.6f} {row['check']}"
    else:
        extra = f"{row['status']}: {row['reason']}"
    print(f"  {what}: {extra}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Reporting


def save_script_results(outs: Iterable[str], kind: str, results: dict, table: str) -> None:
    """``<kind>-<device>-<date>.json`` (``results``: metadata and rows) and ``.md`` (``table``) in
    each directory of ``outs`` (created if needed): what the benchmark scripts save."""
    for out in outs:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        stem = f"{kind}-{slug(results['device_name'])}-{results['date']}"
        (path / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
        (path / f"{stem}.md").write_text(table + "\n")


def slug(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def results_stem(results: dict) -> str:
    meta = results["metadata"]
    if meta.get("device") == "cuda":
        name = slug(meta.get("device_name", "gpu"))
    else:
        name = "cpu-reference"
    stem = f"{name}-{meta.get('date', 'undated')}"
    if meta.get("quick"):
        stem += "-quick"
    return stem


def config_keys(rows):
    """``(D, causal, N)`` of each configuration in ``rows``, in order of appearance."""
    seen = []
    for r in rows:
        key = (r["D"], r["causal"], r["N"])
        if key not in seen:
            seen.append(key)
    return seen


def row_index(rows):
    """``{(method, D, causal, N): row}``."""
    return {(r["method"], r["D"], r["causal"], r["N"]): r for r in rows}


def columns(rows, kinds):
    """``(method, label)`` of the methods of ``kinds`` in ``rows``, in order of appearance."""
    cols = []
    for r in rows:
        if r["kind"] in kinds and (r["method"], r["label"]) not in cols:
            cols.append((r["method"], r["label"]))
    return cols


def seqlen_label(n: int) -> str:
    """``4096`` → ``"4k"``; lengths that are not a multiple of 1024 as they are."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _cfg_name(r: dict) -> str:
    return f"D={r['D']} N={seqlen_label(r['N'])} {'causal' if r['causal'] else 'non-causal'}"


def _fmt_tops(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _cell_tops(r: dict | None) -> str:
    if r is None:
        return ""
    st = r["status"]
    if st != "ok":
        return {"oom": "oom", "unsupported": "n/a", "error": "err", "skipped": "—"}.get(st, st)
    if r["kind"] == "cpu_reference" or r.get("tops") is None:
        text = f"{r['time_ms']:.3f} ms"
    else:
        text = _fmt_tops(r["tops"])
    return text + (" ✗" if r.get("check") == "FAIL" else "")


def speedup(ours: dict | None, base: dict | None) -> float | None:
    """``t_base / t_ours`` when both ran."""
    if not ours or not base or ours["status"] != "ok" or base["status"] != "ok":
        return None
    return base["time_ms"] / ours["time_ms"]


def _cell_speedup(ours, base) -> str:
    s = speedup(ours, base)
    if s is None:
        return "—"
    return f"{s:.2f}×" + (" ✗" if ours.get("check") == "FAIL" else "")


def target_for(n: int) -> float | None:
    """The issue's bar over SDPA cuDNN bf16: ≥1.25× at N ≥ 8k, ≥1.0× at N = 1k (none between)."""
    if n >= TARGETS[0][0]:
        return TARGETS[0][1]
    if n <= TARGETS[1][0]:
        return TARGETS[1][1]
    return None


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def _cfg_cells(d, causal, n):
    return [str(d), "yes" if causal else "no", seqlen_label(n)]


def render_markdown(results: dict) -> str:
    """The results as markdown: throughput, speedups, stage breakdown, accuracy and memory, and
    every skipped or failed measurement with its reason."""
    meta, rows = results["metadata"], results["rows"]
    idx = row_index(rows)
    configs = config_keys(rows)
    v = meta.get("versions", {})
    proto = meta.get("protocol", {})
    cpu = meta.get("device") != "cuda"
    out = [f"# lowbit_attn attention benchmark — {meta.get('device_name', '?')}"
           + (f" ({meta['arch']})" if meta.get("arch") else ""), ""]
    if cpu:
        out += ["**CPU reference timings of the PyTorch reference at a tiny size, not kernel "
                "benchmarks.**", ""]
    if not results.get("complete", True):
        out += ["**Partial results: the run did not finish.**", ""]
    out += [
        f"- date (UTC): {meta.get('date_utc')}; host: {meta.get('hostname')}; source: "
        f"{meta.get('git') or 'not a git checkout'}",
        f"- versions: torch {v.get('torch')}, triton {v.get('triton')}, lowbit_attn "
        f"{v.get('lowbit_attn')}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, sageattention "
        f"{v.get('sageattention')}",
        f"- command: `{meta.get('command')}`",
        f"- B={proto.get('B')}, H={proto.get('H')}, layout HND; timer: {proto.get('timer')}",
        f"- TOP/s = {proto.get('tops')}; timed: {proto.get('timed')}",
        f"- inputs: {proto.get('inputs')}; check: {proto.get('check')} (✗ = failed)",
        "",
    ]
    main_cols = columns(rows, ("ours", "sdpa", "sage", "cpu_reference"))
    ours_cols = columns(rows, ("ours", "cpu_reference"))
    out += ["## Throughput (TOP/s)", ""]
    body = [_cfg_cells(*c) + [_cell_tops(idx.get((m, *c))) for m, _ in main_cols] for c in configs]
    out += _table(["D", "causal", "N"] + [lbl for _, lbl in main_cols], body) + [""]

    bases = [(k, lbl) for k, lbl in (
        (CUDNN_KEY, "cuDNN bf16"), (FLASH_KEY, "flash"), (SAGE_KEY, "sage")
    ) if any(r["method"] == k for r in rows)]
    if ours_cols and bases:
        pairs = []  # (our key, baseline key, header): every recipe vs cuDNN bf16, the first vs all
        for i, (m, olbl) in enumerate(ours_cols):
            for k, blbl in bases:
                if i == 0 or k == CUDNN_KEY:
                    pairs.append((m, k, f"{olbl} ÷ {blbl}"))
        has_cudnn = any(k == CUDNN_KEY for k, _ in bases)
        out += ["## Speedup of ours (t_baseline / t_ours)", ""]
        header = ["D", "causal", "N"] + [h for _, _, h in pairs]
        header += ["target ÷ cuDNN bf16"] if has_cudnn else []
        body = []
        for c in configs:
            cells = _cfg_cells(*c)
            cells += [_cell_speedup(idx.get((m, *c)), idx.get((k, *c))) for m, k, _ in pairs]
            if has_cudnn:
                t = target_for(c[2])
                cells.append("—" if t is None else f"≥ {t:.2f}×")
            body.append(cells)
        out += _table(header, body) + [""]

    stage_cols = columns(rows, ("stage",))
    if stage_cols:
        out += ["## Where the time goes (ms; quantization passes and attention kernel alone)", ""]
        header = ["D", "causal", "N"]
        cols = []
        for m, lbl in ours_cols:
            if any(s.startswith(m + "_") for s, _ in stage_cols):
                cols.append((m, f"{lbl}: end to end"))
        cols += stage_cols
        body = []
        for c in configs:
            cells = _cfg_cells(*c)
            for m, _ in cols:
                r = idx.get((m, *c))
                if r is None or r["status"] != "ok":
                    cells.append(_cell_tops(r) if r else "")
                else:
                    text = f"{r['time_ms']:.3f}"
                    if r.get("gbps") is not None:
                        text += f" ({r['gbps']:.0f} GB/s)"
                    elif r["kind"] == "stage" and r.get("tops") is not None:
                        text += f" ({_fmt_tops(r['tops'])} TOP/s)"
                    cells.append(text + (" ✗" if r.get("check") == "FAIL" else ""))
            body.append(cells)
        out += _table(header + [lbl for _, lbl in cols], body) + [""]

    acc_cols = main_cols + [c for c in stage_cols if not c[0].endswith("_prepare")]
    out += ["## Accuracy (cosine similarity vs reference) and peak extra memory (MiB)", ""]
    body = []
    for c in configs:
        cells = _cfg_cells(*c)
        for m, _ in acc_cols:
            r = idx.get((m, *c))
            if r is None or r.get("cosine") is None:
                cells.append("—" if r is None or r["status"] == "ok" else _cell_tops(r))
                continue
            text = f"{r['cosine']:.6f}" + (" ✗" if r.get("check") == "FAIL" else "")
            if r.get("peak_extra_mib") is not None:
                text += f" / {r['peak_extra_mib']:.0f}"
            cells.append(text)
        body.append(cells)
    out += _table(["D", "causal", "N"] + [lbl for _, lbl in acc_cols], body) + [""]
    refs = sorted({r["reference"] for r in rows if r.get("reference")})
    if refs:
        out += [f"Reference: {', '.join(refs)} on the same input values.", ""]

    failed = [r for r in rows if r["status"] == "ok" and r.get("check") == "FAIL"]
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            groups.setdefault((r["label"], r["status"], r.get("reason")), []).append(_cfg_name(r))
    if failed or groups:
        out += ["## Not measured, or failed", ""]
        for r in failed:
            out.append(f"- {r['label']}, {_cfg_name(r)}: **check failed** — cosine "
                       f"{r['cosine']:.6f}, non-finite {r['nonfinite']}, rel L1 {r['rel_l1']:.4g}")
        for (label, status, reason), where in groups.items():
            out.append(f"- {label}, {', '.join(where)}: **{status}** — {reason}")
        out.append("")
    return "\n".join(out)


def render_short_table(results: dict) -> str:
    """One line per configuration: TOP/s of our recipes and the baselines, the first recipe's
    speedup over cuDNN bf16 against the target, the worst cosine of our rows and the check."""
    rows = results["rows"]
    idx = row_index(rows)
    cols = columns(rows, ("ours", "sdpa", "sage", "cpu_reference"))
    ours = columns(rows, ("ours", "cpu_reference"))
    has_cudnn = any(r["method"] == CUDNN_KEY for r in rows)
    header = ["D", "causal", "N"] + [lbl.replace("qk_int8_pv_", "") for _, lbl in cols]
    if ours and has_cudnn:
        header += [f"{ours[0][1].replace('qk_int8_pv_', '')} ÷ cuDNN bf16", "target"]
    header += ["min cos (ours)", "check"]
    body = []
    for c in config_keys(rows):
        cells = _cfg_cells(*c) + [_cell_tops(idx.get((m, *c))) for m, _ in cols]
        if ours and has_cudnn:
            first = idx.get((ours[0][0], *c))
            s = speedup(first, idx.get((CUDNN_KEY, *c)))
            t = target_for(c[2])
            cells.append("—" if s is None else f"{s:.2f}×")
            if t is None or s is None:
                cells.append("—" if t is None else f"≥{t:.2f}")
            else:
                cells.append(f"≥{t:.2f} {'met' if s >= t else 'MISSED'}")
        mine = [r for r in rows if (r["D"], r["causal"], r["N"]) == c
                and r["kind"] in ("ours", "cpu_reference", "stage")]
        coss = [r["cosine"] for r in mine if r.get("cosine") is not None]
        cells.append(f"{min(coss):.6f}" if coss else "—")
        failed = [r for r in mine if r.get("check") == "FAIL" or r["status"] == "error"]
        cells.append("FAIL: " + ", ".join(r["method"] for r in failed) if failed else
                     ("pass" if coss else "—"))
        body.append(cells)
    return "\n".join(_table(header, body))


def plot_results(results: dict, path: str | os.PathLike) -> Path | None:
    """Grouped bars of TOP/s per method, one panel per (D, causal). Returns the path, or None (with
    a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib, then "
              "python benchmarks/plot.py RESULTS.json)", file=sys.stderr)
        return None
    rows = results["rows"]
    meta = results["metadata"]
    idx = row_index(rows)
    cols = columns(rows, ("ours", "sdpa", "sage", "cpu_reference"))
    configs = config_keys(rows)
    dims = sorted({c[0] for c in configs})
    causals = sorted({c[1] for c in configs})
    fig, axes = plt.subplots(len(dims), len(causals), squeeze=False,
                             figsize=(max(9.0, 6.5 * len(causals)), 3.8 * len(dims)))
    width = 0.8 / max(1, len(cols))
    for i, d in enumerate(dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            ns = [c[2] for c in configs if c[0] == d and c[1] == causal]
            for m_i, (m, lbl) in enumerate(cols):
                xs, ys, hatches = [], [], []
                for x, n in enumerate(ns):
                    r = idx.get((m, d, causal, n))
                    if r and r["status"] == "ok" and r.get("tops") is not None:
                        xs.append(x + (m_i - (len(cols) - 1) / 2) * width)
                        ys.append(r["tops"])
                        hatches.append("xx" if r.get("check") == "FAIL" else "")
                bars = ax.bar(xs, ys, width, label=lbl)
                for bar, h in zip(bars, hatches):
                    bar.set_hatch(h)
            ax.set_xticks(range(len(ns)))
            ax.set_xticklabels([seqlen_label(n) for n in ns])
            ax.set_xlabel("N")
            ax.set_ylabel("TOP/s")
            ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    kind = "CPU reference timings (not kernel benchmarks)" if meta.get("device") != "cuda" else \
        "end to end, quantization included; hatched = failed accuracy check"
    proto = meta.get("protocol", {})
    fig.suptitle(f"{meta.get('device_name')}, {meta.get('date')}, B={proto.get('B')}, "
                 f"H={proto.get('H')}\n{kind}", fontsize="medium")
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(4, max(1, len(labels))), fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _json_default(x):
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_results(results: dict, out_dir: str | os.PathLike, *, plot: bool = True) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (with ``plot``) ``<stem>.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(results)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    paths[1].write_text(render_markdown(results) + "\n")
    if plot:
        png = plot_results(results, out_dir / f"{stem}.png")
        if png is not None:
            paths.append(png)
    return paths


# --------------------------------------------------------------------------------------------------
# Command line


def _split(text: str) -> list[str]:
    return [t for t in re.split(r"[,\s]+", text.strip()) if t]


def parse_dims(text: str) -> list[int]:
    """``"64,128"`` → ``[64, 128]``, each a head dim the attention functions take."""
    return [head_dim_arg(t) for t in _split(text)]


def parse_seqlens(text: str) -> list[int]:
    """``"1k,4k,16384"`` → ``[1024, 4096, 16384]``."""
    out = []
    for t in _split(text):
        m = re.fullmatch(r"(\d+)([kK]?)", t)
        if not m or int(m.group(1)) == 0:
            raise argparse.ArgumentTypeError(
                f"sequence lengths look like 1k,4k,16384 (positive); got {t!r}")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out


def parse_names(text: str) -> list[str]:
    names = _split(text)
    return [] if names == ["none"] else names


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``lowbit-attn bench``."""
    parser.add_argument("--dims", type=parse_dims, default=None,
                        help="head dims, comma-separated (default 64,128; --quick: 128)")
    parser.add_argument("--seqlens", type=parse_seqlens, default=None,
                        help="sequence lengths, e.g. 1k,4k,16k (default 1k,2k,4k,8k,16k,32k; "
                             "--quick: 1k,4k,16k)")
    parser.add_argument("--batch", type=positive_int, default=BATCH,
                        help=f"batch size (default {BATCH})")
    parser.add_argument("--heads", type=positive_int, default=HEADS,
                        help=f"heads (default {HEADS})")
    parser.add_argument("--causal", choices=("yes", "no", "both"), default="both",
                        help="causal masks, non-causal, or both (default)")
    parser.add_argument("--recipes", type=parse_names, default=list(OUR_RECIPES),
                        help="our recipes, comma-separated (default qk_int8_pv_fp8,qk_int8_pv_fp16;"
                             " the first is the one compared in the short table)")
    parser.add_argument("--baselines", type=parse_names, default=list(BASELINES),
                        help="some of flash,cudnn,sage, or none (default all)")
    parser.add_argument("--no-bf16", action="store_true",
                        help="leave out our bf16-input row of the FP8 recipe")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="leave out the quantization-only and attention-only timings")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: D=128, N=1k,4k,16k (unless --dims/--seqlens given)")
    parser.add_argument("--out", action="append", metavar="DIR", default=None,
                        help="write results here (repeatable; default on a GPU: benchmarks/results;"
                             " on a CPU nothing is written unless given)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG chart")
    parser.add_argument("--warmup", type=ranged(float, 0), default=25.0,
                        help="do_bench warmup in ms")
    parser.add_argument("--rep", type=ranged(float, 0), default=100.0,
                        help="do_bench repetition time in ms")
    parser.add_argument("--min-cosine", type=ranged(float, -1, 1), default=MIN_COSINE,
                        help=f"accuracy check threshold (default {MIN_COSINE})")
    parser.add_argument("--time-budget", type=ranged(float, 0), default=None, metavar="SECONDS",
                        help="stop starting measurements after this long; the rest are recorded "
                             "as skipped (results are saved after every configuration)")
    parser.add_argument("--seed", type=ranged(int, 0, 2**64 - 1), default=0, help="input seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def default_results_dir() -> Path:
    """``benchmarks/results`` of the source checkout when running from one, else of the cwd."""
    here = Path(__file__).resolve()
    for root in here.parents[1:4]:
        if (root / "benchmarks").is_dir() and (root / "pyproject.toml").is_file():
            return root / "benchmarks" / "results"
    return Path("benchmarks") / "results"


def _failures(results: dict) -> list[dict]:
    return [r for r in results["rows"] if r["kind"] in ("ours", "cpu_reference", "stage")
            and (r.get("check") == "FAIL" or r["status"] == "error")]


def cli_main(args: argparse.Namespace) -> int:
    """Run ``lowbit-attn bench``; returns the exit status (1 when one of our rows failed its check
    or raised, 2 on bad options)."""
    causal_values = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    try:
        if not args.recipes and not args.baselines:
            raise ValueError("nothing to run: no recipes and no baselines")
        for name in args.recipes:
            for d in args.dims or ():  # the default dims fit every recipe
                if name in RECIPES:
                    checks.recipe_fits(RECIPES[name], d)
        if torch.cuda.is_available():
            methods = select_methods(args.recipes, args.baselines, bf16=not args.no_bf16,
                                     breakdown=not args.no_breakdown)
        else:
            for r in args.recipes:
                if r != "auto" and r not in RECIPES:
                    raise ValueError(f"unknown recipe {r!r}; expected one of {sorted(RECIPES)}")
            methods = cpu_methods(args.recipes)
    except ValueError as exc:
        print(f"lowbit-attn bench: error: {exc}", file=sys.stderr)
        return 2
    plot = not args.no_plot
    if not torch.cuda.is_available():
        return _cli_cpu(args, methods, causal_values, plot)

    dims = args.dims or list(QUICK_DIMS if args.quick else DIMS)
    seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    out_dirs = [Path(p) for p in (args.out or [default_results_dir()])]

    def save(partial):
        partial["metadata"]["quick"] = bool(args.quick)
        for o in out_dirs:
            write_results(partial, o, plot=False)

    print(f"lowbit-attn bench on {torch.cuda.get_device_name()}: D={dims}, N={seqlens}, "
          f"causal={args.causal}, B={args.batch}, H={args.heads}, "
          f"{len(methods)} methods", file=sys.stderr)
    results = run_benchmark(
        dims=dims, seqlens=seqlens, causal_values=causal_values, batch=args.batch,
        heads=args.heads, methods=methods, device="cuda", warmup_ms=args.warmup, rep_ms=args.rep,
        min_cosine=args.min_cosine, seed=args.seed, time_budget_s=args.time_budget,
        on_config_done=save, progress=not args.no_progress,
    )
    results["metadata"]["quick"] = bool(args.quick)
    written = []
    for o in out_dirs:
        written += write_results(results, o, plot=plot)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return _finish(results)


def _cli_cpu(args, methods, causal_values, plot) -> int:
    b, h, n, d = 1, 2, 256, 64
    backend = backend_for(torch.device("cpu"))
    what = ("the PyTorch reference" if backend == "reference"
            else "the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
    print(
        f"No CUDA device: timing {what} on the CPU at B={b}, H={h}, N={n}, D={d} for "
        f"{', '.join(m.recipe for m in methods)}.\nThese are CPU reference timings, NOT kernel "
        "benchmarks; the protocol of DESIGN.md needs a CUDA GPU (run `lowbit-attn bench` there).",
        file=sys.stderr,
    )
    results = run_benchmark(
        dims=[d], seqlens=[n], causal_values=causal_values, batch=b, heads=h, methods=methods,
        device="cpu", min_cosine=args.min_cosine, seed=args.seed, mode="cpu-reference",
        progress=False,
    )
    for o in args.out or []:
        for p in write_results(results, o, plot=plot):
            print(f"wrote {p}", file=sys.stderr)
    print("CPU reference timings (ms per call; not kernel benchmarks):")
    for r in results["rows"]:
        if r["status"] == "ok":
            print(f"  {r['label']:<40} causal={str(r['causal']):<5} {r['time_ms']:9.3f} ms  "
                  f"cos {r['cosine']:.6f} {r['check']}")
        else:
            print(f"  {r['label']:<40} causal={str(r['causal']):<5} {r['status']}: {r['reason']}")
    return _finish(results)


def _finish(results: dict) -> int:
    failed = _failures(results)
    for r in failed:
        why = (f"check failed (cosine {r['cosine']})" if r.get("check") == "FAIL"
               else f"{r['status']}: {r['reason']}")
        print(f"FAILED {r['method']} D={r['D']} N={r['N']} causal={r['causal']}: {why}",
              file=sys.stderr)
    print()
    print(render_short_table(results))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lowbit-attn bench",
        description="Time lowbit_attn.attention against SDPA (flash, cuDNN) and SageAttention.",
    )
    add_arguments(parser)
    return cli_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

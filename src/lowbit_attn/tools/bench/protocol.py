"""The benchmark protocol of DESIGN.md: the configurations, the methods timed, their inputs and the
bars they are held to.

``triton.testing.do_bench(fn, return_mode="median")``; B=4, H=32, D ∈ {64, 128},
N ∈ {1k, 2k, 4k, 8k, 16k, 32k}, causal and not; TOP/s = 4·B·H·N²·D / t, halved when causal. Our
rows time the public call end to end (quantization included); baselines run in the same process on
the same inputs. Before a method is timed its output is compared with an SDPA reference on the same
inputs (cosine similarity; a failed check shows as ``✗`` in every table), and its peak extra memory
is recorded. Configurations that run out of memory or that a backend does not support are recorded
with the reason and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from lowbit_attn.core.recipes import RECIPES


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


def make_inputs(batch, heads, n, d, *, device, dtype=torch.float16, seed=0, bias=K_BIAS):
    """``q, k, v ~ N(0, 1)`` HND, with ``k += bias·N(0, 1)`` per (batch, head, channel)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, d)
    q = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k += bias * torch.randn((batch, heads, 1, d), generator=g, device=device, dtype=dtype)
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return q, k, v


def target_for(n: int) -> float | None:
    """The issue's bar over SDPA cuDNN bf16: ≥1.25× at N ≥ 8k, ≥1.0× at N = 1k (none between)."""
    if n >= TARGETS[0][0]:
        return TARGETS[0][1]
    if n <= TARGETS[1][0]:
        return TARGETS[1][1]
    return None

"""The FP4 attention forward a call on the Triton path runs under ``LOWBIT_ATTN_KERNEL=gluon``: the
Gluon forward for Blackwell (:mod:`~lowbit_attn.inference.kernel_fp4_gluon`, sm_100a) where it
applies and has passed a check on this device, the Triton FP4 kernel
(:mod:`~lowbit_attn.inference.kernel_fp4`) everywhere else, without error. The admit / refuse /
warn-once / fall-back logic is :mod:`~lowbit_attn.inference.gluon_check`'s (its :func:`admit`,
:func:`run_cases`, :func:`compare_outputs`, :func:`dispatch`); this module holds what is FP4's.

The Gluon FP4 forward has been compiled ahead of time and run on the CPU model
(``tools/gluon_cpu.py``) only: no GPU able to run sm_100a code has run it. A call uses it only
where

1. :func:`applies`: CUDA tensors on a device of capability 10.x (Blackwell datacenter parts; the
   kernel is written for sm_100a, and whether Triton builds and loads it on another 10.x part is
   for the check to find out), compiled kernels (not the Triton interpreter: on a CPU the option
   changes nothing);
2. it has passed the check :func:`self_check` (its verdict on disk, else run in the background
   from the first call on, ``gluon_check.admit``) against the Triton FP4 kernel on the small inputs of :data:`CASES` (partial query and key
   blocks, causal with a diagonal off the block grid and with tiles that see no key, GQA, LSE
   with K's shift, ΔS, V's channel mean, NVFP4 and MXFP4, two-level and one-level P̃); a mismatch or any exception warns once, naming the reason, and the
   Triton FP4 kernel runs for the rest of the process on that device; no check during a CUDA
   graph capture (as ``gluon_check``);
3. the Gluon launcher takes the call: it raises ``ValueError`` before launching anything for what
   it does not cover (head dims other than 128, ``block_q`` ≠ 128, ``block_k`` ≠ 64, operands
   TMA cannot read); such a call runs the Triton kernel. Packed sequences reach it one sequence
   at a time (the FP4 path has no packed kernel). A call it fails to compile refuses it for the
   rest of the process, with one warning (as ``gluon_check``).

Tolerances of the check: on a GPU the compiled Triton FP4 kernel is held to cosine ``0.9999`` of
the twin on the same quantized operands, with no bound on the largest difference (tests/helpers.py
``ON_CUDA "fp4 out"``, which widens test_fp4_attention.py's interpreter bound: exp2 and fp32 sums
that differ in the last bits move P̃ values across E2M1 rounding boundaries, steps of 1/6 to 1/3
of a group's largest value), its LSE within ``1e-3 + 1e-5·|LSE|`` (``ON_CUDA "lse"`` widened by
that test's ``rtol 1e-5``); tests/test_gpu.py holds the Gluon FP4 forward to the same. Two kernels
that both meet these bounds differ by at most twice them: cosine ``cos(2·arccos 0.9999) = 0.9996``
(``arccos 0.9999 = 1.414e-2`` rad) and LSE ``2e-3 + 2e-5·|LSE|``. A layout or indexing mistake
(a scale tile in the wrong atom, a row or a key block out of place) moves whole rows or tiles and
lands far outside that: one wrong row of the 400 in the smallest case alone takes the cosine to
about 0.998.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference import gluon_check, kernel_fp4
from lowbit_attn.inference.prepare import quantize_qkv_fp4

CAPABILITY_MAJOR = 10  # sm_100a
KERNEL = "fp4"  # its key among gluon_check's verdicts
CHECK_COSINE = math.cos(2 * math.acos(0.9999))  # 0.99960
CHECK_LSE_ATOL = 2e-3  # 2 × 1e-3
CHECK_LSE_RTOL = 2e-5  # 2 × 1e-5
RECIPES = {"nvfp4": "qk_fp4_pv_fp4", "mxfp4": "qk_mxfp4_pv_mxfp4"}


@dataclass(frozen=True)
class Case:
    """One input of the check: ``[b, hq, nq, d]`` queries against ``[b, hkv, nk, d]`` keys and
    values with the recipe of ``fmt`` (its defaults: ΔS, K smoothed, 128-row query blocks and
    64-key blocks), causal (aligned bottom-right, or ``offset``) or not, with LSE (and K's LSE
    shift) or not, two-level P̃ or not, V smoothed (its channel mean) or not."""

    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    fmt: str
    causal: bool
    lse: bool
    two_level: bool = True
    smooth_v: bool = False
    offset: int | None = None
    d: int = 128

    def __str__(self) -> str:
        flags = (" causal" if self.causal else "") + (" lse" if self.lse else "")
        flags += "" if self.two_level else " one-level"
        flags += " vmean" if self.smooth_v else ""
        flags += "" if self.offset is None else f" offset {self.offset}"
        return (f"{self.fmt} B{self.b} Nq{self.nq} Nk{self.nk} H{self.hq}:{self.hkv} "
                f"D{self.d}{flags}")

    @property
    def causal_offset(self) -> int | None:
        if not self.causal:
            return None
        return self.nk - self.nq if self.offset is None else self.offset


# Every row and key count leaves a partial block; GQA and MQA; causal bottom-right with rows and
# whole query tiles that see no key (Nq300-Nk100) and with an offset of its own; both formats,
# both P̃ modes; LSE with K's shift; V's channel mean; ΔS throughout (the recipes' default).
CASES = (
    Case(1, 2, 2, 200, 200, "nvfp4", causal=False, lse=False),
    Case(1, 4, 2, 300, 333, "nvfp4", causal=True, lse=True),
    Case(2, 2, 1, 130, 257, "mxfp4", causal=True, lse=True),
    Case(1, 2, 1, 129, 300, "mxfp4", causal=False, lse=True, two_level=False, smooth_v=True),
    Case(1, 2, 1, 300, 100, "nvfp4", causal=True, lse=True, two_level=False),
    Case(1, 2, 1, 150, 170, "nvfp4", causal=True, lse=True, smooth_v=True, offset=0),
)


def applies(device: torch.device) -> bool:
    """Whether the Gluon FP4 forward can run on ``device`` at all (see the module docstring,
    1)."""
    return (device.type == "cuda" and not interpreter_enabled()
            and torch.cuda.get_device_capability(device)[0] == CAPABILITY_MAJOR)


def verdict(device: torch.device) -> str | None:
    """``None`` if the Gluon FP4 forward was admitted on ``device`` in this process, else why not
    (``"not checked"`` before the first check)."""
    return gluon_check.verdict(device, KERNEL)


def admitted(device: torch.device) -> bool:
    """Whether the Gluon FP4 forward has passed its check on ``device``: its verdict on disk, or
    the check started in the background at the first call in this process (a failure warns
    once)."""
    return gluon_check.admit(device, KERNEL, gluon_check.checker(device, self_check),
                             "LOWBIT_ATTN_KERNEL=gluon: the Gluon FP4 attention forward (sm_100a)",
                             "the Triton FP4 kernel")


def self_check(device: torch.device) -> str | None:
    """Run :data:`CASES` through both kernels on ``device``: ``None`` if every output (and LSE)
    agrees within the module's tolerances, else the first reason it does not."""
    return gluon_check.run_cases(device, CASES, lambda case: _compare(case, device))


def _compare(case: Case, device: torch.device) -> str | None:
    g = torch.Generator(device=device).manual_seed(case.b * 10**6 + case.nq * 1000 + case.nk)
    q = torch.randn(case.b, case.hq, case.nq, case.d, generator=g, device=device)
    k = torch.randn(case.b, case.hkv, case.nk, case.d, generator=g, device=device)
    k += 4 * torch.randn(case.b, case.hkv, 1, case.d, generator=g, device=device)  # channel bias
    v = torch.randn(case.b, case.hkv, case.nk, case.d, generator=g, device=device)
    v += torch.randn(case.b, case.hkv, 1, case.d, generator=g, device=device)
    q, k, v = (x.to(torch.float16) for x in (q, k, v))
    recipe = get_recipe(RECIPES[case.fmt]).replace(two_level_p=case.two_level,
                                                   smooth_v=case.smooth_v)
    qz = quantize_qkv_fp4(q, k, v, recipe, case.d**-0.5, need_lse_shift=case.lse,
                          backend="triton")
    kw = dict(head_dim=case.d, block_q=recipe.block_q, block_k=recipe.block_k,
              causal_offset=case.causal_offset, two_level=recipe.two_level_p,
              return_lse=case.lse)
    from lowbit_attn.inference import kernel_fp4_gluon  # an import failure is a reason too

    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    want_lse = kernel_fp4.attention(qz, out=want, **kw)
    got_lse = kernel_fp4_gluon.attention(qz, out=got, **kw)
    return gluon_check.compare_outputs(got, want, got_lse, want_lse if case.lse else None,
                                       atol=None, cosine=CHECK_COSINE, lse_atol=CHECK_LSE_ATOL,
                                       lse_rtol=CHECK_LSE_RTOL)


def attention(qz, *, out: torch.Tensor, head_dim: int, block_q: int, block_k: int,
              causal_offset: int | None, two_level: bool,
              return_lse: bool) -> torch.Tensor | None:
    """``kernel_fp4.attention``'s arguments and result, run by the Gluon FP4 forward where it
    applies, is admitted on ``out``'s device and takes the call, else by the Triton FP4
    kernel."""
    kw = dict(out=out, head_dim=head_dim, block_q=block_q, block_k=block_k,
              causal_offset=causal_offset, two_level=two_level, return_lse=return_lse)

    def gluon():
        from lowbit_attn.inference import kernel_fp4_gluon

        return kernel_fp4_gluon.attention(qz, **kw)

    return gluon_check.dispatch(out.device, KERNEL, applies, admitted, gluon,
                                lambda: kernel_fp4.attention(qz, **kw))


__all__ = ["CASES", "Case", "admitted", "applies", "attention", "self_check", "verdict"]

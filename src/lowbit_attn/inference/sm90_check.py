"""The INT8 attention forward a call on the Triton path runs under ``LOWBIT_ATTN_KERNEL=sm90``: the
one-warpgroup Hopper forward (:mod:`~lowbit_attn.inference.kernel_int8_sm90`) where it applies and
has passed a check on this device, the Triton kernel (:mod:`~lowbit_attn.inference.kernel_int8`,
which reads the same permuted V) everywhere else, without error. The admit / refuse / warn-once /
fall-back logic is :mod:`~lowbit_attn.inference.gluon_check`'s (its :func:`admit`,
:func:`run_cases`, :func:`compare_outputs`, :func:`dispatch`); this module holds what is this
kernel's.

No GPU has run this kernel yet (it is compiled ahead of time and run on the CPU model,
``tools/gluon_cpu.py``, only), so it is opt-in and earns its place on each machine. A call uses
it only where

1. :func:`wanted`: the call is one the kernel covers, decided before quantization (V's keys are
   then stored permuted for it): dense, INT8 Q·Kᵀ with per-token or per-thread scales, FP8 or
   fp16 P·V, 128-key blocks, no ΔS, D = 64 or 128 (and no softcap:
   ``op.kernel`` sends windows, chunks and sinks here, softcap to the Triton kernel);
2. :func:`applies`: CUDA tensors on a device of capability 9.0, compiled kernels (on a CPU the
   option changes nothing: Triton has no Gluon interpreter);
3. it has passed the check :func:`self_check` (its verdict stored on disk for this device,
   driver, software and source, else run in the background from the first call on, the Triton
   kernel running meanwhile: :func:`~lowbit_attn.inference.gluon_check.admit`) against the
   Triton kernel on :data:`CASES` (partial blocks, key counts not a multiple of 16,
   query and key counts that are multiples of 128 and of 16, one query, one key, grids of 512
   programs, causal, GQA, LSE, per-thread and per-token scales, FP8 and fp16 P·V, both head
   dims, a causal window with sinks), in a process of its own (:mod:`~lowbit_attn.inference.gluon_check`'s ``isolated``); a mismatch, a crash or any exception warns once, naming the reason, and
   the Triton kernel runs for the rest of the process on that device; no check during a CUDA
   graph capture;
4. the launcher takes the call (it raises ``ValueError`` before launching anything otherwise;
   the Triton kernel then runs) and compiles it (a compile error refuses the kernel for the rest
   of the process, with one warning: ``gluon_check.refuse``; this call and later ones run the
   Triton kernel).

Tolerances of the check: on a GPU the compiled Triton kernel is held within ``atol 4e-3`` and
cosine ``0.99999`` of the twin on the same FP8 P·V operands (unit-variance V; the kernel test's
bound for an exp2 that moves one E4M3 P̃ across a rounding boundary, widened by tests/helpers.py
``ON_CUDA "int8 out fp8"``), its LSE within ``1e-3``; tests/test_gpu.py holds this kernel to the
same. The fp16 P·V cases are held to the same bounds (looser than that recipe needs: they are
there to catch layout and indexing mistakes, not last bits). Two kernels that both meet that
bound differ by at most twice it (triangle inequality; for the cosine, angles add:
``arccos 0.99999 = 4.47e-3`` rad, twice that is cosine ``0.99996``).
"""

from __future__ import annotations

import torch

from lowbit_attn.core.recipes import Recipe, get_recipe
from lowbit_attn.core.variants import PLAIN, Variant
from lowbit_attn.inference import gluon_check, kernel_int8
from lowbit_attn.inference.gluon_check import Case
from lowbit_attn.inference.prepare import quantize_qkv

KERNEL = "sm90"  # its key among gluon_check's verdicts
CHECK_ATOL = 8e-3  # 2 × 4e-3: max |sm90 - Triton| of the outputs
CHECK_COSINE = 0.99996  # cos(2·arccos 0.99999)
CHECK_LSE_ATOL = 2e-3  # 2 × 1e-3
BLOCK_N = 128  # kernel_int8_sm90.BLOCK_N (that module imports Gluon: not imported here)
HEAD_DIMS = (64, 128)
GRANULARITIES = ("per_token", "per_thread")

# Key counts off the 16-key groups of permuted V; D 64 and 128; GQA; causal with a diagonal off
# the block grid; LSE with K's shift; both granularities; fp16 P·V. Then what users run (issue 43):
# query and key counts multiples of 128 and of 16 only (Triton's divisibility-16 specialization,
# the unmasked tiles), one query (decode), one key, and grids of 512 programs (B·Hq = 32 at
# N = 1024, 16 query tiles each: ≥ 3 programs per SM of an H100's 132, so programs share SMs
# at the occupancy each head dim has), causal and not, both head dims, GQA.
CASES = (
    Case(1, 2, 2, 200, 200, 64, BLOCK_N, causal=False, lse=False, granularity="per_thread"),
    Case(1, 4, 2, 300, 333, 128, BLOCK_N, causal=True, lse=True, granularity="per_thread"),
    Case(2, 2, 1, 130, 257, 128, BLOCK_N, causal=True, lse=False),
    Case(1, 2, 1, 129, 301, 64, BLOCK_N, causal=False, lse=True),
    Case(1, 4, 2, 200, 260, 128, BLOCK_N, causal=True, lse=True, granularity="per_thread",
         pv="fp16"),
    Case(1, 2, 2, 70, 90, 128, BLOCK_N, causal=False, lse=True, pv="fp16"),
    Case(4, 8, 2, 1024, 1024, 64, BLOCK_N, causal=False, lse=False, granularity="per_thread"),
    Case(2, 16, 4, 1024, 1024, 128, BLOCK_N, causal=True, lse=True),
    Case(1, 4, 1, 256, 512, 128, BLOCK_N, causal=False, lse=False, granularity="per_thread"),
    Case(1, 4, 2, 144, 208, 64, BLOCK_N, causal=True, lse=True),
    Case(2, 4, 1, 1, 384, 128, BLOCK_N, causal=True, lse=True, granularity="per_thread"),
    Case(1, 4, 2, 96, 1, 64, BLOCK_N, causal=False, lse=True, granularity="per_thread"),
    # issue 44: a causal window over several key blocks (blocks skipped, edges masked, whole
    # ones between) with sinks, K's shift and LSE
    Case(1, 4, 2, 200, 700, 128, BLOCK_N, causal=True, lse=True, granularity="per_thread",
         window=(299, 0), sinks=True),
)


def wanted(recipe: Recipe, head_dim: int, *, packed: bool) -> bool:
    """Whether the kernel covers a call with ``recipe`` (module docstring, 1)."""
    return (recipe.qk == "int8" and recipe.pv in ("fp8", "fp16")
            and recipe.granularity in GRANULARITIES and recipe.block_k == BLOCK_N
            and not recipe.smooth_q and head_dim in HEAD_DIMS and not packed)


def applies(device: torch.device) -> bool:
    """Whether the kernel can run on ``device`` at all (module docstring, 2)."""
    return gluon_check.applies(device)


def verdict(device: torch.device) -> str | None:
    """``None`` if the kernel was admitted on ``device`` in this process, else why not
    (``"not checked"`` before the first check)."""
    return gluon_check.verdict(device, KERNEL)


def admitted(device: torch.device) -> bool:
    """Whether the kernel has passed its check on ``device``: its verdict on disk, or the check
    started in the background at the first call in this process (``gluon_check.admit``; a
    failure warns once)."""
    return gluon_check.admit(device, KERNEL, gluon_check.checker(device, self_check),
                             "LOWBIT_ATTN_KERNEL=sm90: the one-warpgroup Hopper attention "
                             "forward", "the Triton kernel")


def self_check(device: torch.device) -> str | None:
    """Run :data:`CASES` through both kernels on ``device``: ``None`` if every output (and LSE)
    agrees within the tolerances, else the first reason it does not."""
    return gluon_check.run_cases(device, CASES, lambda case: _compare(case, device))


def _compare(case: Case, device: torch.device) -> str | None:
    q, k, v, offset = gluon_check.case_inputs(case, device)
    recipe = get_recipe(f"qk_int8_pv_{case.pv}").replace(block_k=case.block_k,
                                                         granularity=case.granularity)
    qz = quantize_qkv(q, k, v, recipe, case.d**-0.5, need_lse_shift=case.lse or case.sinks,
                      backend="triton",
                      permute_v=case.pv == "fp8")
    variant, sinks = gluon_check.case_variant(case, device)
    kw = dict(pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
              block_k=case.block_k, causal_offset=offset, return_lse=case.lse, variant=variant,
              sinks=sinks)
    from lowbit_attn.inference import kernel_int8_sm90  # an import failure is a reason too

    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    want_lse = kernel_int8.attention(qz, out=want, **kw)
    got_lse = kernel_int8_sm90.attention(qz, out=got, **kw)
    return gluon_check.compare_outputs(
        got, want, got_lse, want_lse if case.lse else None, atol=CHECK_ATOL, cosine=CHECK_COSINE,
        lse_atol=CHECK_LSE_ATOL)


def attention(qz, *, out: torch.Tensor, pv: str, granularity: str, block_q: int, block_k: int,
              causal_offset: int | None, return_lse: bool, seqs_q=None, seqs_k=None,
              variant: Variant = PLAIN, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """``kernel_int8.attention``'s arguments and result, run by the one-warpgroup forward where it
    applies, is admitted on ``out``'s device and takes the call, else by the Triton kernel
    (``variant``: a window, chunk and sinks; softcap is refused by the launcher, the Triton kernel
    then runs it)."""
    kw = dict(out=out, pv=pv, granularity=granularity, block_q=block_q, block_k=block_k,
              causal_offset=causal_offset, return_lse=return_lse, variant=variant, sinks=sinks)

    def gluon():
        from lowbit_attn.inference import kernel_int8_sm90

        return kernel_int8_sm90.attention(qz, seqs_q=seqs_q, seqs_k=seqs_k, **kw)

    return gluon_check.dispatch(out.device, KERNEL, applies, admitted, gluon,
                                lambda: kernel_int8.attention(qz, seqs_q=seqs_q, seqs_k=seqs_k,
                                                              **kw))


__all__ = ["CASES", "CHECK_ATOL", "CHECK_COSINE", "CHECK_LSE_ATOL", "KERNEL", "admitted", "applies",
           "attention", "self_check", "verdict", "wanted"]

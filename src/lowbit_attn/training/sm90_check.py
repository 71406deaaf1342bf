"""Which backward a training call runs under ``LOWBIT_ATTN_BWD_KERNEL=sm90`` (and its default on
Hopper, where an H200 measured them faster on every row): the Gluon loops for
Hopper (:mod:`~lowbit_attn.training.kernel_bwd_sm90`) where they apply and have passed a check on
this device, the Triton backward kernels everywhere else, without error. The trainable attention
and video sparse attention's fine stage share the loops, the check and its verdict.

A wrong layout on a GPU would give wrong gradients without an error (they passed their GPU tests
and this check on an H200, 2026-11-29; other Hopper parts, drivers and Tritons are another
matter), so they earn their place on each machine, by the forward's machinery
(:mod:`~lowbit_attn.inference.gluon_check`: :func:`admit`'s one verdict per process, device and
kernel, stored on disk, the check in the background (the Triton backward runs until it passes),
its warning once, no check started during a CUDA graph capture; :func:`isolated`'s process of
its own; :func:`run_cases`; :func:`compare_outputs`). A call takes the loops only where

1. the option asks for them and :func:`applies`: CUDA tensors on a device of capability 9.0,
   compiled kernels (on a CPU the option changes nothing);
2. they have passed the check :func:`self_check` (its verdict on disk, else run in the
   background from the first call on):
   dQ, dK and dV of :data:`CASES` (D 64 and 128, causal and not, GQA, P and dS per tile and per
   row, query and key counts that are multiples of 128, of 16 only and of neither, one query;
   and one video sparse attention case with a partial tile) against the Triton backward on the
   same operands; a mismatch, a crash or any exception warns once, naming the reason, and the
   Triton backward runs for the rest of the process on that device;
3. the loops take the call (``kernel_bwd_sm90.refusal`` / ``vsa_refusal`` is None; otherwise the
   Triton kernels run, as before).

Tolerances: on a GPU the Triton backward is held to cosine ``0.9999`` of the twin
(tests/helpers.py ``ON_CUDA "train grad"``), the sm90 loops to ``0.99999``
(tests/test_gpu.py); two results within those differ by at most the sum of the angles:
cosine ``cos(arccos 0.9999 + arccos 0.99999) = 0.99983``. One wrong row of dK in the smallest
case's 130 keys takes the cosine to about 0.992.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from lowbit_attn.core.measured import kernel_choice
from lowbit_attn.core.recipes import resolve_train
from lowbit_attn.core.triton_helpers import family
from lowbit_attn.inference import gluon_check
from lowbit_attn.inference.gluon_check import Case

KERNEL = "sm90-bwd"  # its key among gluon_check's verdicts
T = TypeVar("T")
CHECK_COSINE = math.cos(math.acos(0.9999) + math.acos(0.99999))  # 0.99983


@dataclass(frozen=True)
class VsaCase:
    """Video sparse attention's fine stage: ``[b, hq, tiles, 64, d]`` query tiles against
    ``[b, hkv, tiles, 64, d]`` key tiles, ``topk`` key tiles per query tile, the last tile holding
    ``last`` tokens."""

    b: int
    hq: int
    hkv: int
    tiles: int
    topk: int
    d: int
    last: int

    def __str__(self) -> str:
        return (f"video sparse B{self.b} tiles {self.tiles} (last {self.last}) top {self.topk} "
                f"H{self.hq}:{self.hkv} D{self.d}")


# The trainable attention: Case's granularity is the backward's (P and dS per tile or per row);
# block_k and lse are not used. Multiples of 128 (the loops' 128-key and 128-query programs, no
# masked tile), of 16 only, of neither; one query; causal diagonals off the 64-row grid; GQA.
CASES = (
    Case(1, 4, 2, 256, 256, 128, 64, causal=False, lse=False, granularity="per_tile"),
    Case(1, 2, 1, 200, 333, 64, 64, causal=True, lse=False, granularity="per_row"),
    Case(2, 4, 4, 144, 208, 128, 64, causal=True, lse=False, granularity="per_row"),
    Case(1, 4, 2, 512, 384, 64, 64, causal=False, lse=False, granularity="per_row"),
    Case(1, 2, 2, 1, 130, 64, 64, causal=True, lse=False, granularity="per_tile"),
    VsaCase(1, 4, 2, 4, 2, 128, last=40),
)


# Whether the loops can run on a device at all (module docstring, 1): the Hopper forwards' test.
applies = gluon_check.applies
# ``verdict(device)``: None if the loops were admitted on ``device`` in this process, else why not.
verdict = functools.partial(gluon_check.verdict, kernel=KERNEL)


def admitted(device: torch.device) -> bool:
    """Whether the loops have passed their check on ``device``: its verdict on disk, or the check
    started in the background at the first call in this process (a failure warns once)."""
    return gluon_check.admit(device, KERNEL, gluon_check.checker(device, self_check),
                             "LOWBIT_ATTN_BWD_KERNEL (sm90, Hopper's default): the Gluon backward "
                             "loops for Hopper",
                             "the Triton backward")


def run_backward(device: torch.device, bwd_kernel: str, backward: Callable[[str], T]) -> T:
    """``backward(kernel)`` with the ``kernel`` :func:`kernel_for` picks. Where the loops fail to
    compile the call (one of :data:`~lowbit_attn.inference.gluon_check.COMPILE_ERRORS`, raised
    before a launch: a specialization the check did not cover), they are refused on ``device``
    for the rest of this process with one warning (``gluon_check.refuse``) and
    ``backward("triton")`` runs: the Triton backward writes every gradient again. (Where the
    loops refused the call and the Triton backward itself fails to compile, the retry raises
    that error to the caller, after the same warning.)"""
    kernel = kernel_for(device, bwd_kernel)
    try:
        return backward(kernel)
    except gluon_check.COMPILE_ERRORS as error:
        if kernel != "sm90":
            raise
        gluon_check.refuse(device, KERNEL, error)
    return backward("triton")


def kernel_for(device: torch.device, bwd_kernel: str) -> str:
    """The ``kernel`` argument of the backward launchers for a call on ``device`` under
    ``LOWBIT_ATTN_BWD_KERNEL=bwd_kernel`` (``measured``: the kernel ``core.measured`` names for
    the device's architecture): ``"sm90"`` only where the loops apply and are admitted (the
    check starts here, in the background), else ``"triton"``."""
    if bwd_kernel == "triton" or not applies(device):
        return "triton"
    if bwd_kernel == "measured":
        capability = torch.cuda.get_device_capability(device)
        bwd_kernel = kernel_choice("bwd_kernel", family(capability)) or "triton"
    if bwd_kernel == "sm90" and admitted(device):
        return "sm90"
    return "triton"


def self_check(device: torch.device) -> str | None:
    """Run :data:`CASES` through the loops and the Triton backward on ``device``: ``None`` if
    every gradient agrees within :data:`CHECK_COSINE`, else the first reason it does not."""
    return gluon_check.run_cases(device, CASES, lambda case: _compare(case, device))


def _gradients(got, want, names=("dq", "dk", "dv")) -> str | None:
    for name, a, b in zip(names, got, want):
        reason = gluon_check.compare_outputs(a, b, None, None, atol=None, cosine=CHECK_COSINE,
                                             lse_atol=0.0)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _compare(case, device: torch.device) -> str | None:
    from lowbit_attn.training import kernel_bwd_sm90  # an import failure is a reason too

    kernel_bwd_sm90.check_version()  # a Triton the loops are not written for is a reason
    if isinstance(case, VsaCase):
        return _compare_vsa(case, device, kernel_bwd_sm90)
    from lowbit_attn.training import kernel_bwd, kernel_fwd
    from lowbit_attn.training.prepare import prepare, prepare_grad

    q, k, v, offset = gluon_check.case_inputs(case, device)
    g = torch.Generator(device=device).manual_seed(case.nq * 7 + case.nk)
    do = torch.randn(q.shape, generator=g, device=device).to(q.dtype)
    recipe = resolve_train("sagebwd_int8").replace(backward_granularity=case.granularity)
    scale = case.d**-0.5
    ops = prepare(q, k, v, recipe, scale, "triton")
    grad = prepare_grad(do, recipe, "triton")
    refused = kernel_bwd_sm90.refusal(ops, grad, "recompute")
    if refused is not None:
        return f"refused by the loops: {refused}"
    lse = kernel_fwd.forward(ops, out=torch.empty_like(q), causal_offset=offset)
    want = tuple(torch.empty_like(x) for x in (q, k, v))
    got = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    kernel_bwd.backward(ops, grad, lse, *want, causal_offset=offset, softmax_scale=scale,
                        mode="recompute", kernel="triton")
    kernel_bwd_sm90.backward(ops, grad, lse, *got, causal_offset=offset, softmax_scale=scale)
    return _gradients(got, want)


def _compare_vsa(case: VsaCase, device: torch.device, kernel_bwd_sm90) -> str | None:
    from lowbit_attn.vsa import kernel_fine

    g = torch.Generator(device=device).manual_seed(case.tiles * 100 + case.d)
    ts = kernel_bwd_sm90.BQ
    counts = torch.full((case.tiles,), ts, dtype=torch.int32, device=device)
    counts[-1] = case.last
    filled = (torch.arange(ts, device=device) < counts[:, None])[..., None]  # [nt, TS, 1]

    def tiles(h):
        x = torch.randn(case.b, h, case.tiles, ts, case.d, generator=g, device=device)
        return (x * filled).to(torch.bfloat16).contiguous()

    qt, kt, vt, dot = tiles(case.hq), tiles(case.hkv), tiles(case.hkv), tiles(case.hq)
    idx = torch.rand(case.b, case.hq, case.tiles, case.tiles, generator=g, device=device)
    idx = idx.topk(case.topk, dim=-1).indices.sort(-1).values.to(torch.int32).contiguous()
    refused = kernel_bwd_sm90.vsa_refusal(qt, case.d)
    if refused is not None:
        return f"refused by the loops: {refused}"
    scale = case.d**-0.5
    ot, lse = kernel_fine.forward(qt, kt, vt, idx, counts, scale=scale)
    want = kernel_fine.backward(qt, kt, vt, ot, lse, dot, idx, counts, scale=scale,
                                kernel="triton")
    got = kernel_fine.backward(qt, kt, vt, ot, lse, dot, idx, counts, scale=scale,
                               kernel="sm90")
    return _gradients(got, want)


__all__ = ["CASES", "CHECK_COSINE", "KERNEL", "VsaCase", "admitted", "applies", "kernel_for", "run_backward",
           "self_check", "verdict"]

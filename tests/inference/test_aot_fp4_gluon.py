"""CPU gates of the Gluon FP4 forward for Blackwell (``inference/kernel_fp4_gluon.py``), compiled
ahead of time for sm_100a (Triton 3.6.0, its bundled ptxas and cuobjdump). No GPU has run
it; its numbers and barrier protocol are checked on the CPU (test_gluon_fp4_schedule.py).

Measured 2026-11-25, NVFP4 (``qk_fp4_pv_fp4`` without ΔS), D=128, BLOCK_M=128, BLOCK_N=64, with
LSE, non-causal (causal and MXFP4: the same but for the loop counts given):

- with the recipes' defaults (ΔS added to every key block's scores, K's LSE shift in the
  epilogue; measured 2026-11-25 after ΔS was added): NVFP4 **1168** per tile (18.3 per score),
  causal 1168 and 1597 in the masked loop (1239 non-causal); MXFP4 985, causal 989 / 1422
  (1060). The ΔS row costs +135 (NVFP4) / +134 (MXFP4) per tile: 16 more ``LDG.128`` (the
  block's 64 fp32 values, the same for every row), an ``FMUL`` and ``FADD`` per score where
  the FMA-folded form had one ``FFMA`` (``s·mult + ΔS`` is rounded as ``kernel_fp4`` rounds
  it, then ``exp2(s − shift)``). Still 255 registers (``setmaxnreg`` 256/48), no spills. The
  Triton kernel's 773 (below) is with ΔS too. The counts without ΔS below are unchanged
  (the ``no-ds`` variants).
- registers: ``setmaxnreg`` gives the softmax partition (default, 4 warps) 256 and the loader
  and MMA warps 48 each (ptxas reports 255, the ceiling); no spills (24 per worker spilled
  116 B in the loader). Shared memory 35468 B; tensor memory: one 512-column allocation.
- the softmax partition's key-block loop: **1033 instructions per tile**, 128×64 scores over 128
  threads = 64 per thread: **16.1 per score** (its first version: 1110, 17.3); causal 1034, and
  1470 in the masked (diagonal) loop. MXFP4 (``qk_mxfp4_pv_mxfp4``, E8M0 scales: no E4M3
  rounding, no ``div_rn`` by 6): 851 (13.3 per score), causal 853 / 1293; shared memory
  33772 B. Today's Triton kernel on sm_100a (8 warps, BLOCK_N=64, 32 scores per thread): 773
  per tile, 24.2 per score. The loop holds the O correction of the previous block (``O·α +
  PV·s1`` over 128 columns: 128 FMUL + 128 FFMA and tensor-memory loads/stores in 64-column
  slices), which the Triton kernel does in registers, and 12 partition barriers (``BAR.SYNC``,
  one after each tensor-memory store and before each mbarrier arrive).
- ``MUFU.EX2``: 66 per tile (64 scores, α, s1); ``F2FP.SATFINITE.E2M1`` 32 (one per 2 scores).
- the MMA warp's loop: 88 instructions per key block (MXFP4 83), 3 ``UTCOMMA`` (2 for S, 128
  channels; 1 for P̃·V, 64 keys), 1 ``UTCCP`` (V's scales; MXFP4: none), waits on mbarriers
  only.
- between an MMA's enabling arrive and the softmax's wait for it (in the loop, across one
  iteration): P̃(j)·V(j) ~1038 instructions (P̃'s arrive to the correction's wait a step later),
  S(j+1) = Q·K(j+1)ᵀ ~1056 (K(j+1)'s scales published at the step's start to the next step's
  wait); every exp2 of the step runs in both spans.

Also measured: ``tcgen05_copy`` of a scale tile compiles for ``[128, 4|8|16]`` and fails ("Failed
to find a valid layout") for ``[64, ·]`` and ``[128, 2]``: K's scales (64 keys) and MXFP4 V's
(2 columns) are stored from registers by the softmax partition. BLOCK_N=128 is refused: 2×128
columns of S plus O and PV fill the 512 columns of tensor memory before the scales.
"""

from __future__ import annotations

import re

import pytest
import torch

from lowbit_attn.core.operands import QuantizedFP4
from helpers import require_gluon
require_gluon("blackwell")  # before importing Gluon code

from lowbit_attn.inference import kernel_fp4_gluon
from lowbit_attn.tools import aot, fp4_gates, sass

pytestmark = pytest.mark.aot

KERNEL = "_attn_fwd_fp4_gluon_kernel"
MMA = {"qk_fp4_pv_fp4": "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X",
       "qk_mxfp4_pv_mxfp4": "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X"}
E2M1_CVT = "cvt.rn.satfinite.e2m1x2.f32"
# the softmax loop's instructions per tile, the measured counts plus 5 %: with the recipes'
# defaults (ΔS, LSE shift) 1168 NVFP4, 985-989 MXFP4; without ΔS 1033-1034 NVFP4, 851-853 MXFP4
LOOP_BOUND = {("qk_fp4_pv_fp4", True): 1227, ("qk_mxfp4_pv_mxfp4", True): 1039,
              ("qk_fp4_pv_fp4", False): 1086, ("qk_mxfp4_pv_mxfp4", False): 896}
TRITON_LOOP = 773  # kernel_fp4 on sm_100a NVFP4 with ΔS, 32 scores per thread (test_aot_fp4)
VARIANTS = [(recipe, causal, ds) for recipe in MMA for causal in (False, True)
            for ds in (True, False)]
IDS = [f"{recipe}-{'causal' if causal else 'full'}-{'defaults' if ds else 'no-ds'}"
       for recipe, causal, ds in VARIANTS]


@pytest.fixture(scope="module", params=VARIANTS, ids=IDS)
def variant(request) -> tuple[str, bool, bool]:
    """(recipe, causal, the recipe's defaults: ΔS and the LSE shift; else neither)."""
    return request.param


@pytest.fixture(scope="module")
def report(variant) -> aot.KernelReport:
    recipe, causal, ds = variant
    smooth = None if ds else False
    launch = aot.record_fp4_gluon_launch(recipe=recipe, block_k=64, causal=causal,
                                         return_lse=True, smooth_q=smooth, smooth_k=smooth)
    return aot.compile_launch(launch, "sm_100a")  # cached per specialization


@pytest.fixture(scope="module")
def softmax_loop(report) -> list[str]:
    """The softmax partition's unmasked key-block loop: the first innermost loop with exp2s
    (the masked tail's comes second)."""
    loops = sass.key_block_loops(sass.disassemble(report.cubin), mma="MUFU.EX2")
    assert len(loops) == 2, [len(b) for b in loops]
    return loops[0]


def describe(r: aot.KernelReport) -> str:
    return (f"{r.kernel} {r.constexprs}: {r.registers} registers, spills {r.spill_stores}/"
            f"{r.spill_loads} B, warnings {r.ptxas_warnings}, error {r.error}")


def test_compiles_without_spills(report, variant):
    assert report.ok and report.kernel == KERNEL, describe(report)
    ds = variant[2]
    assert (report.constexprs["HAS_DS"], report.constexprs["HAS_LSH"]) == (ds, ds), describe(report)
    assert report.spill_stores == 0 and report.spill_loads == 0, describe(report)
    assert report.ptxas_warnings == (), describe(report)
    regs = {int(x, 16) for _, i in sass.disassemble(report.cubin)
            for x in re.findall(r"USETMAXREG\.\S+ (?:UP\d, )?(0x[0-9a-f]+)", i)}
    assert regs == {48, 256}, regs  # workers down to 48, the softmax up to 256


def test_both_products_are_block_scaled_fp4_tcgen05(report, variant):
    mma = MMA[variant[0]]
    assert report.instructions.get(mma, 0) >= 4, report.instructions  # 2 per product (K=64)
    ops = sass.opcode_counts([t for _, t in sass.disassemble(report.cubin)])
    assert ops.get("UTCOMMA", 0) >= 4 and ops.get("UTCCP", 0) >= 1, ops


def test_p_is_rounded_by_the_hardware_conversion(report, softmax_loop):
    assert report.ptx.count(E2M1_CVT) >= 64 * 2 // 4 * 2, report.ptx.count(E2M1_CVT)
    f2fp = [t for t in softmax_loop if t.startswith("F2FP.SATFINITE.E2M1")]
    assert len(f2fp) == 32, len(f2fp)  # 64 scores per thread, two per instruction


def test_softmax_loop_instruction_budget(softmax_loop, variant):
    """Per tile and per score against the Triton kernel (24.2 per score)."""
    assert len(softmax_loop) <= LOOP_BOUND[variant[0], variant[2]], len(softmax_loop)
    assert len(softmax_loop) / 64 < TRITON_LOOP / 32
    assert sum(t.startswith("MUFU.EX2") for t in softmax_loop) == 66
    assert not any(t.startswith(("LDL", "STL")) for t in softmax_loop)


def test_products_run_under_a_whole_softmax_step(softmax_loop):
    """Arrives in program order: K(j+1)'s scales (S(j+1) may be issued), S(j) read, P̃(j)
    written (P̃(j)·V(j) may be issued), PV(j−1) read; waits: S(j), PV(j−1). Each product is
    waited for one step after the arrive that lets it start, with every exp2 in between."""
    body = softmax_loop
    spans = fp4_gates.product_spans(body)
    assert spans is not None, [t for t in body if t.startswith("SYNCS")]
    assert spans["ks_ready"] < spans["s_wait"] < spans["p_ready"] < spans["pv_wait"]
    n = len(body)
    assert min(spans["qk_span"], spans["pv_span"]) >= 0.95 * n, (spans, n)
    ex2 = [i for i, t in enumerate(body) if t.startswith("MUFU.EX2")]
    assert all(spans["s_wait"] < i < spans["p_ready"] for i in ex2)  # under both products


def _operands(fmt="nvfp4", d=128, n=256, v_keys=256):
    group = 32 if fmt == "mxfp4" else 16
    u8 = dict(dtype=torch.uint8)
    g = torch.ones(1, 2) if fmt == "nvfp4" else None
    return QuantizedFP4(
        fmt=fmt, q=torch.zeros(1, 2, n, d // 2, **u8),
        q_scale=torch.zeros(1, 2, n, d // group, **u8),
        k=torch.zeros(1, 2, n, d // 2, **u8), k_scale=torch.zeros(1, 2, n, d // group, **u8),
        v=torch.zeros(1, 2, d, v_keys // 2, **u8),
        v_scale=torch.zeros(1, 2, d, v_keys // group, **u8), qk_multiplier=0.1,
        q_global=g, k_global=g, v_global=g)


@pytest.mark.parametrize("change,match", [
    (dict(block_k=128), "block_k"),
    (dict(block_q=64), "block_q"),
    (dict(head_dim=64), "head dim"),
    (dict(qz=_operands("bf16")), "fmt"),
    (dict(qz=_operands(d=64)), "head dim"),
])
def test_launcher_refuses_what_it_does_not_cover(change, match):
    args = dict(qz=_operands(), out=torch.zeros(1, 2, 256, 128, dtype=torch.float16),
                head_dim=128, block_q=128, block_k=64, causal_offset=None, two_level=True,
                return_lse=False)
    args.update(change)
    qz = args.pop("qz")
    with pytest.raises(ValueError, match=match):
        kernel_fp4_gluon.attention(qz, **args)

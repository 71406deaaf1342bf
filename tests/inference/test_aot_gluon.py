"""CPU gates of the Gluon Hopper forward (``inference/kernel_int8_gluon.py``), compiled ahead of
time for sm_90a: one loader warp and two consumer warpgroups, each consumer's loop keeping its
softmax under its previous block's P·V. Measured 2026-11-25 (Triton 3.6.0, its bundled ptxas and
cuobjdump), per token, FP8 P·V, with LSE, 1024 tokens; per consumer 64 rows over 128 threads (per
score: instructions per tile over 64·keys/128 scores):

| D   | keys | spills B (full / causal) | consumer 0 / 1 main loop per tile (per score) | exp2 under P·V |
|-----|------|--------------------------|-----------------------------------------------|----------------|
| 64  | 64   | 0 / 0                    | 373 / 366 (11.66 / 11.44)                     | 33 of 34       |
| 64  | 128  | 0 / 0                    | 608 / 603 (9.50 / 9.42)                       | 65 of 66       |
| 128 | 64   | 0 / 0                    | 406 / 405 (12.69 / 12.66)                     | 33 of 34       |
| 128 | 128  | 64 / 184                 | 652 / 647 (10.19 / 10.11), causal 660 / 651   | 64-65 of 66    |

``setmaxnreg`` (SASS ``USETMAXREG``): the loader 24 registers, the consumers 240, from the
launch's 168. At D=128 with 128-key blocks the consumers need more than their 240 registers, and
ptxas spills: 1 local load per iteration in each consumer's unmasked loop non-causal, 9 and 3
causal (packed sequences 100-104 B, 1000 tokens 72 / 228 B). The gates hold those to their
measured values; every other variant spills nothing.
"""

from __future__ import annotations

import re

import pytest

from helpers import pinned_codegen, require_gluon

require_gluon("hopper")  # before importing Gluon code

from lowbit_attn.inference import kernel_int8_gluon
from lowbit_attn.tools import aot, sass

pytestmark = pytest.mark.aot

KERNEL = "_attn_fwd_int8_pingpong_kernel"
INT8_WGMMA = "wgmma.mma_async.sync.aligned.m64n{n}k32.s32.s8.s8"
FP8_WGMMA = "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3"
VARIANTS = [(d, block_k, causal) for d in (64, 128) for block_k in (64, 128)
            for causal in (False, True)]
IDS = [f"D{d}-k{block_k}-{'causal' if causal else 'full'}" for d, block_k, causal in VARIANTS]

# exp2 under each consumer's P·V in its unmasked loop (measured 64-65 of 66 and 33 of 34, less a
# margin), and instructions between that wgmma's issue and its wait (measured 506-524, 274-278).
MIN_EXP2_UNDER_PV = {64: 32, 128: 60}
MIN_SPAN = {64: 250, 128: 480}
# Spilled bytes stored and local loads/stores in a consumer's unmasked loop, D=128/128 keys only:
# the measured values (table above) are the bounds.
SPILL_BOUND = {False: (72, 1), True: (228, 9)}
VARLEN_SPILL_BOUND = 104


def report(d, block_k, causal, **kw) -> aot.KernelReport:
    launch = aot.record_gluon_launch(head_dim=d, block_k=block_k, causal=causal, return_lse=True,
                                     **kw)
    return aot.compile_launch(launch, "sm_90a")  # cached per specialization


def consumers(r: aot.KernelReport) -> list[list[str]]:
    """Each consumer's unmasked key-block loop: the kernel's loops are consumer 0's unmasked and
    masked ones, then consumer 1's."""
    bodies = sass.key_block_loops(sass.disassemble(r.cubin))
    assert len(bodies) == 4, [len(b) for b in bodies]
    return [bodies[0], bodies[2]]


def local_memory(body: list[str]) -> int:
    return sum(i.startswith(("LDL", "STL")) for i in body)


def describe(r: aot.KernelReport) -> str:
    return (f"{r.kernel} {r.constexprs}: spills {r.spill_stores}/{r.spill_loads} B, warnings "
            f"{r.ptxas_warnings}, error {r.error}")


@pytest.mark.parametrize("d,block_k,causal", VARIANTS, ids=IDS)
def test_compiles_with_three_partitions_and_no_serialization(d, block_k, causal):
    r = report(d, block_k, causal)
    assert r.ok and r.kernel == KERNEL, describe(r)
    assert r.instructions.get(INT8_WGMMA.format(n=block_k), 0) > 0, r.instructions
    assert r.instructions.get(FP8_WGMMA.format(n=d), 0) > 0, r.instructions
    assert r.ptxas_warnings == (), describe(r)  # no C7514 (a wgmma serialized)
    # The launch's budget, then setmaxnreg: the loader down to 24, the consumers up to 240.
    assert r.registers == 168, describe(r)
    regs = {int(x, 16) for _, i in sass.disassemble(r.cubin)
            for x in re.findall(r"USETMAXREG\.\S+ (?:UP\d, )?(0x[0-9a-f]+)", i)}
    assert {24, 240} <= regs, regs


@pytest.mark.parametrize("d,block_k,causal", VARIANTS, ids=IDS)
def test_each_consumer_keeps_its_softmax_under_its_pv(d, block_k, causal):
    """Each consumer runs the asynchronous loop: every exp2 but the rescale factor's between its
    P·V wgmma's issue and its wait; none under its own Q·Kᵀ (the softmax needs those scores)."""
    for body in consumers(report(d, block_k, causal)):
        pv = sass.exp2_under_mma(body, "QGMMA")
        qk = sass.exp2_under_mma(body, "IGMMA")
        assert pv.total == qk.total == 64 * block_k // 128 + 2  # scores + 2 rescale factors
        assert pv.under >= MIN_EXP2_UNDER_PV[block_k], pv
        assert pv.span >= MIN_SPAN[block_k], pv
        assert qk.under == 0, qk


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d,block_k,causal", VARIANTS, ids=IDS)
def test_spills_only_where_measured(d, block_k, causal):
    r = report(d, block_k, causal)
    if (d, block_k) != (128, 128):
        assert r.spill_stores == 0 and r.spill_loads == 0, describe(r)
        return
    stored, in_loop = SPILL_BOUND[causal]
    assert r.spill_stores <= stored, describe(r)
    assert max(local_memory(b) for b in consumers(r)) <= in_loop, describe(r)


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_instructions_per_score(causal):
    """D=128, 128 keys: issue 16's budget, 10.5 per score, in each consumer (10.11-10.31
    measured)."""
    for body in consumers(report(128, 128, causal)):
        assert len(body) / 64 <= 10.5, len(body)


@pytest.mark.parametrize("d,block_k", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_varlen_and_per_block_variants_compile(d, block_k):
    """Packed sequences (causal) and per-block scales: compiled, no warning, the schedule kept;
    spills as the dense variants'."""
    for r in (report(d, block_k, True, varlen=True),
              report(d, block_k, False, granularity="per_block")):
        assert r.ok and r.kernel == KERNEL and r.ptxas_warnings == (), describe(r)
        bound = VARLEN_SPILL_BOUND if (d, block_k) == (128, 128) and r.constexprs["VARLEN"] else 0
        assert r.spill_stores <= bound or not pinned_codegen(), describe(r)
        for body in consumers(r):
            assert sass.exp2_under_mma(body, "QGMMA").under >= MIN_EXP2_UNDER_PV[block_k]


@pytest.mark.parametrize("d,block_k,causal", VARIANTS, ids=IDS)
def test_fp16_pv_variant(d, block_k, causal):
    """``qk_int8_pv_fp16`` (per-block scales): fp16 P̃·V wgmma, the softmax under it in each
    consumer, no local memory in the loops; spills none but D=128/128 keys causal, 4 B outside
    the loops (measured 2026-11-25)."""
    r = report(d, block_k, causal, granularity="per_block", pv="fp16")
    assert r.ok and r.kernel == KERNEL and r.ptxas_warnings == (), describe(r)
    assert r.instructions.get(f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16", 0) > 0
    assert r.spill_stores <= (4 if (d, block_k, causal) == (128, 128, True) else 0), describe(r)
    for body in consumers(r):
        pv = sass.exp2_under_mma(body, "HGMMA")
        assert pv.under >= MIN_EXP2_UNDER_PV[block_k] and local_memory(body) == 0, pv


def test_the_triton_version_is_pinned():
    kernel_int8_gluon.check_version()
    for version in ("3.6.1+git1a2b3c", "3.8.0", "3.9.0"):
        kernel_int8_gluon.check_version(version)
    for version in ("3.5.1", "3.7.0", "3.10.0", "3.60.0"):
        with pytest.raises(RuntimeError, match=rf"Hopper API of Triton 3\.6\.x, 3\.8\.x, "
                                               rf"3\.9\.x, found Triton {version}"):
            kernel_int8_gluon.check_version(version)


def test_the_tma_load_is_the_installed_tritons():
    """Triton 3.9 renamed Gluon's TMA load (``async_load``; ``async_copy_global_to_shared``
    before, which 3.9 keeps only to raise): ``gluon_blocks.tma_load`` calls the installed one."""
    from lowbit_attn.core import triton_support

    assert [triton_support.tma_load_renamed(v) for v in ("3.6.0", "3.8.1", "3.9.0", "3.10.0")] \
        == [False, False, True, True]


def test_retiring_wait_counts_groups_committed_since():
    """Groups complete in order: Q·Kᵀ (issued first) is retired by ``wait(1)``, P·V by
    ``wait(0)``."""
    body = ["IGMMA.64x64x32.S8.S8 R88, gdesc[UR12], RZ, !UPT",
            "IGMMA.64x64x32.S8.S8 R88, gdesc[UR16], R88, gsb0",
            "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR36], R24, gsb0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1",
            "MUFU.EX2 R1, R1",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "MUFU.EX2 R2, R2"]
    assert sass.retiring_wait(body, 1) == 3
    assert sass.retiring_wait(body, 2) == 5
    assert sass.exp2_under_mma(body, "QGMMA") == sass.Exp2Placement(0, 1, 1, span=2)
    assert sass.exp2_under_mma(body, "IGMMA") == sass.Exp2Placement(0, 0, 2, span=2)

"""CPU gates of the one-warpgroup Hopper forward (``inference/kernel_int8_sm90.py``), compiled
ahead of time for sm_90a: ``tools/sm90_gates.py``'s gate (P̃·V a wgmma whose A operand comes from
registers, no shared-memory store in the main loop, no spills, at most 8.0 instructions per score,
at least 2 CTAs per SM) for the per-thread FP8 kernel, and what every variant compiles to.
Numbers measured 2026-11-28 (Triton 3.6.0, its bundled ptxas 12.8), 64×128 tiles, 4 warps, with
LSE, K single-buffered (``k_stages=1``):

| D   | scales | P·V  | regs (full/causal) | shared (B) | main loop per tile (per score) | CTAs |
|-----|--------|------|--------------------|------------|--------------------------------|------|
| 128 | thread | FP8  | 174 / 207          | 41000      | 506 / 504 (7.91 / 7.88)        | 2    |
| 128 | token  | FP8  | 231 / 245          | 41512      | 577 / 577 (9.02)               | 2    |
| 64  | thread | FP8  | 144 / 167          | 20520      | 472 / 471 (7.38 / 7.36)        | 3    |
| 64  | token  | FP8  | 168 / 168          | 21032      | 544 / 546 (8.50 / 8.53)        | 3    |
| 128 | thread | fp16 | 190                | 57384      | 509 (7.95)                     | 2    |

``poly_exp2`` (per thread, FP8; one group of 8 key columns in ``share`` takes a polynomial exp2
on the FMA pipe, about 8.2 instructions each in place of one MUFU):

| D   | share | regs | main loop per tile (per score) | MUFU.EX2 per tile | CTAs |
|-----|-------|------|--------------------------------|-------------------|------|
| 64  | 16    | 147  | 505 (7.89)                     | 62                | 3    |
| 64  | 8     | 148  | 537 (8.39)                     | 58                | 3    |
| 64  | 2     | 128  | 729 (11.39)                    | 34                | 4    |
| 128 | 16    | 179  | 538 (8.41)                     | 62                | 2    |
| 128 | 8     | 175  | 571 (8.92)                     | 58                | 2    |

Issue 43's 64-bit row offsets (in the epilogue, none in a loop) moved some main loops by ptxas's
allocation (``benchmarks/NOTES.md`` §19): per-thread FP8 D=128 508 (7.94), per-token FP8 D=64
547 / 555, ``poly_exp2`` 16 at D=128 540.

Two K buffers (``k_stages=2``, K(j+2) requested with V(j+1)): +16 to +18 instructions per tile,
+16 KB (D=128). ``maxnreg=168`` (3 CTAs per SM at D=128) spills 16 to 24 B per thread per
thread-scale variant, 216 to 328 B per token.
"""

from __future__ import annotations

import pytest

from helpers import pinned_codegen, require_gluon

require_gluon("hopper")  # before importing Gluon code

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from lowbit_attn.inference import kernel_int8_sm90
from lowbit_attn.tools import aot, sass, sm90_gates

pytestmark = pytest.mark.aot

INT8_WGMMA = "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8"
PV_WGMMA = {"fp8": "wgmma.mma_async.sync.aligned.m64n{d}k32.f32.e4m3.e4m3",
            "fp16": "wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16"}

VARIANTS = [(d, granularity, pv, causal) for d in (64, 128)
            for granularity in kernel_int8_sm90.GRANULARITIES for pv in ("fp8", "fp16")
            for causal in (False, True)]
IDS = [f"D{d}-{g}-{pv}-{'causal' if c else 'full'}" for d, g, pv, c in VARIANTS]


@pytest.fixture(scope="module")
def compiled():
    cache: dict[tuple, aot.KernelReport] = {}

    def get(d: int, granularity: str = "per_thread", pv: str = "fp8", causal: bool = False,
            seq_len: int = 1024, **launcher) -> aot.KernelReport:
        key = (d, granularity, pv, causal, seq_len, tuple(sorted(launcher.items())))
        if key not in cache:
            launch = aot.record_sm90_launch(head_dim=d, causal=causal, return_lse=True,
                                            seq_len=seq_len, granularity=granularity, pv=pv,
                                            **launcher)
            cache[key] = aot.compile_launch(launch, "sm_90a")
        return cache[key]

    return get


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_per_thread_fp8_kernel_passes_its_gate(compiled, causal):
    r = compiled(128, causal=causal)
    gates = sm90_gates.gates(r)
    failed = [name for name, ok in gates["checks"].items() if not ok]
    assert gates["passes"], f"{failed}: {gates}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_per_thread_fp8_loop_keeps_p_in_registers(compiled, causal):
    """What holds on every Triton the kernel compiles on (3.9's code generation spends 38 more
    instructions per tile: 8.50 per score, over the pinned Triton's gate)."""
    gates = sm90_gates.gates(compiled(128, causal=causal))
    assert gates["pv_from_registers"] is True and gates["shared_stores"] == 0
    assert gates["local_memory"] == 0
    assert gates["exp2"] == 66  # 64 scores and 2 rescale factors per thread and tile


@pytest.mark.parametrize("d,granularity,pv,causal", VARIANTS, ids=IDS)
def test_every_variant_compiles_with_pv_from_registers_and_no_spills(compiled, d, granularity,
                                                                     pv, causal):
    r = compiled(d, granularity, pv, causal)
    assert r.ok, r.error
    assert r.instructions.get(INT8_WGMMA) and r.instructions.get(PV_WGMMA[pv].format(d=d)), \
        r.instructions
    assert sm90_gates.pv_from_registers(r.ptx) is True
    assert not r.ptxas_warnings, r.ptxas_warnings
    if pinned_codegen():
        assert r.spills == 0
        assert sm90_gates.gates(r)["ctas_per_sm"] >= 2


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d,limit", [(128, 7.95), (64, 7.40)])
def test_instructions_per_score_regression(compiled, d, limit):
    """The per-thread FP8 main loop at its measured count (module docstring), a rounding's
    margin above."""
    assert sm90_gates.gates(compiled(d))["per_score"] <= limit


@pytest.mark.pinned_codegen
def test_two_k_buffers_and_the_register_cap_are_candidates_that_compile(compiled):
    """The GPU sweep's other candidates: two K buffers (no spills), and ``maxnreg=168`` for 3
    CTAs per SM at D=128 (small spills: a trade only a GPU can judge)."""
    two = compiled(128, k_stages=2)
    assert two.spills == 0 and two.shared_memory > compiled(128).shared_memory
    capped = compiled(128, maxnreg=168)
    assert capped.registers <= 168 and sm90_gates.gates(capped)["ctas_per_sm"] == 3
    assert capped.spills <= 64


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("share", [16, 8, 2])
def test_the_polynomial_exp2_moves_exp2s_off_the_mufu_and_nothing_else(compiled, d, share):
    """``poly_exp2``: 64/share fewer ``MUFU.EX2`` per thread and tile, P̃ still from registers,
    no shared-memory store and no local memory (the groups are split and merged in registers)."""
    gates = sm90_gates.gates(compiled(d, poly_exp2=share))
    assert gates["exp2"] == 66 - 64 // share
    assert gates["pv_from_registers"] is True and gates["shared_stores"] == 0
    assert gates["local_memory"] == 0


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d,share,limit", [(64, 16, 7.90), (64, 8, 8.40), (128, 16, 8.45)])
def test_the_polynomial_exp2s_cost(compiled, d, share, limit):
    """About 8 instructions per exp2 moved (module docstring); the occupancy of the plain kernel
    kept."""
    r = compiled(d, poly_exp2=share)
    gates = sm90_gates.gates(r)
    assert gates["per_score"] <= limit and r.spills == 0
    assert gates["ctas_per_sm"] == sm90_gates.gates(compiled(d))["ctas_per_sm"]


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("seq_len", [1000, 683])
def test_lengths_not_a_multiple_of_16_keep_the_gate(compiled, seq_len):
    assert sm90_gates.gates(compiled(128, seq_len=seq_len))["passes"]


@pytest.mark.parametrize("d,granularity,pv,causal", VARIANTS, ids=IDS)
def test_no_variant_writes_an_a_register_in_flight(compiled, d, granularity, pv, causal):
    """P̃·V's register A operand is not in its wait's dependencies (Triton's 8-bit wait refuses
    it): nothing but the compiled code shows that P̃ is not overwritten under the tensor cores
    (``sass.a_register_hazards``: per loop 4 such wgmma with FP8 P̃, 8 with fp16)."""
    a = sm90_gates.gates(compiled(d, granularity, pv, causal))["a_register"]
    assert a["wgmma"] == (8 if pv == "fp8" else 16) and not a["hazards"], a


@pytest.mark.parametrize("options", [{"k_stages": 2}, {"poly_exp2": 16}], ids=["k2", "poly16"])
def test_no_option_writes_an_a_register_in_flight(compiled, options):
    a = sm90_gates.gates(compiled(128, **options))["a_register"]
    assert a["wgmma"] == 8 and not a["hazards"], a


@gluon.jit
def _products(X, B, O, n, A_FIRST: gl.constexpr):
    """``O = Σᵢ (Xᵢ² + 1) @ B`` (``Xᵢ [64, 16]`` fp32, ``B [16, 64]`` fp16): each product a
    wgmma with its A operand in registers, waited for one pass later. ``A_FIRST``: the next
    pass computes its A before waiting for the last product (Triton reuses A's registers, so
    the compiled loop writes them under the tensor cores); else after."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 64, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rb = gl.arange(0, 16, layout=gl.SliceLayout(1, blocked))
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, blocked))
    b_smem = gl.allocate_shared_memory(gl.float16, [16, 64], b_layout,
                                       gl.load(B + rb[:, None] * 64 + cb[None, :]))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, acc_layout))
    out_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, acc_layout))
    acc = gl.zeros([64, 64], gl.float32, layout=acc_layout)
    zero = gl.zeros([64, 64], gl.float32, layout=acc_layout)
    x = gl.load(X + rows[:, None] * 16 + cols[None, :])
    a = gl.convert_layout((x * x + 1.0).to(gl.float16), a_layout)
    last = warpgroup_mma(a, b_smem, zero, use_acc=False, is_async=True)
    for i in range(1, n):
        if A_FIRST:
            x = gl.load(X + i * 1024 + rows[:, None] * 16 + cols[None, :])
            a = gl.convert_layout((x * x + 1.0).to(gl.float16), a_layout)
            acc += warpgroup_mma_wait(0, deps=[last])
        else:
            acc += warpgroup_mma_wait(0, deps=[last])
            x = gl.load(X + i * 1024 + rows[:, None] * 16 + cols[None, :])
            a = gl.convert_layout((x * x + 1.0).to(gl.float16), a_layout)
        last = warpgroup_mma(a, b_smem, zero, use_acc=False, is_async=True)
    acc += warpgroup_mma_wait(0, deps=[last])
    gl.store(O + rows[:, None] * 64 + out_cols[None, :], acc)


@pytest.mark.parametrize("a_first", [True, False], ids=["next-A-then-wait", "wait-then-next-A"])
def test_the_check_catches_a_compiled_loop_that_reuses_a_in_flight(a_first):
    """A loop that computes the next A before waiting for the product reading the last one
    compiles, with Triton 3.6, to SASS writing A's registers under the tensor cores (the wait is
    Triton's, at the source's place): the gate must see it; waiting first is clean."""
    launch = aot.Launch(kernel=_products, args=(), kwargs=dict(
        X=torch.zeros(8 * 1024), B=torch.zeros(1024, dtype=torch.float16), O=torch.zeros(4096),
        n=8, A_FIRST=a_first, num_warps=4))
    report = aot.compile_launch(launch, "sm_90a")
    assert report.ok, report.error
    found = sass.a_register_hazards(sass.listing(report.cubin))
    assert found.wgmma == 2, found.line()
    if a_first and not pinned_codegen():
        # Triton 3.9 compiles this loop without the overlap (nothing to catch); the hand-written
        # SASS of tests/tools/test_sass_hazards.py checks the gate on every version.
        return
    assert found.ok != a_first, found.line()


@pytest.mark.parametrize("registers,shared,want", [
    (174, 41000, 2), (168, 41000, 3), (128, 20520, 4), (255, 41000, 2), (64, 20520, 8),
    (168, 80000, 2), (32, 1000, 16),
])
def test_ctas_per_sm(registers, shared, want):
    """Registers (per warp in units of 256 of 64 Ki), shared memory (228 KiB, 1 KiB reserved per
    CTA) and threads (2048) each bound the count."""
    assert sm90_gates.ctas_per_sm(registers, shared) == want


def test_pv_from_registers_reads_the_a_operand():
    pv = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
    pv += ",".join(f"%f{i}" for i in range(64)) + "}, "
    regs = pv + "{%r1,%r2,%r3,%r4}, %rd5, p, 1, 1, 1;"
    smem = pv + "%rd4, %rd5, p, 1, 1, 0, 1;"
    qk = "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%r9}, %rd4, %rd5, p;"
    assert sm90_gates.pv_from_registers(regs + "\n" + qk) is True
    assert sm90_gates.pv_from_registers(regs + "\n" + smem) is False
    assert sm90_gates.pv_from_registers(qk) is None


def _loops(report) -> list[int]:
    """Instructions per tile of each key-block loop, in program order (FP8 P·V)."""
    listing = sass.listing(report.cubin)
    return [len(body) for body in sass.key_block_loops([(a, t) for a, _, t in listing],
                                                       mma="QGMMA")]


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d,granularity,max_regs", [
    (64, "per_thread", 168), (128, "per_thread", 229), (64, "per_token", 219),
    (128, "per_token", 231)])
def test_a_window_with_sinks_costs_at_its_edges(compiled, d, granularity, max_regs):
    """Issue 44 (NOTES §20): a causal (511, 0) window with sinks compiles three key-block loops
    (left edge, whole blocks, diagonal): the whole blocks within 17 instructions per tile of the
    plain loop, each edge (two limits per row) within 1.35× the causal diagonal's loop, no
    spills. Sinks add nothing to a loop: causal with sinks compiles the causal kernel's loops
    and registers."""
    from lowbit_attn.core.variants import Variant

    sinks = torch.zeros(2)
    windowed = aot.compile_launch(aot.record_sm90_launch(
        head_dim=d, return_lse=True, granularity=granularity,
        variant=Variant(left=511, right=0, sinks=True), sinks=sinks), "sm_90a")
    sunk = aot.compile_launch(aot.record_sm90_launch(
        head_dim=d, causal=True, return_lse=True, granularity=granularity,
        variant=Variant(right=0, sinks=True), sinks=sinks), "sm_90a")
    causal = compiled(d, granularity, causal=True)
    edge, whole, diagonal = _loops(windowed)
    plain_loop, causal_diagonal = _loops(causal)
    assert whole <= plain_loop + 17, (whole, plain_loop)
    assert max(edge, diagonal) <= 1.35 * causal_diagonal, (edge, diagonal, causal_diagonal)
    assert windowed.spills == 0 and windowed.registers <= max_regs, windowed.registers
    assert _loops(sunk) == [plain_loop, causal_diagonal]
    assert sunk.registers == causal.registers and sunk.spills == 0


@pytest.mark.parametrize("nk", [1, 2, 17])
@pytest.mark.parametrize("granularity", kernel_int8_sm90.GRANULARITIES)
def test_one_key_packs_p_from_what_it_computed(granularity, nk):
    """The one-key failure (H200, 2026-11-30: NaN rows at Nq 96, Nk 1, D 64): NK = 1 compiled
    as a constant folded P̃'s masked columns into one value, and ptxas 12.8 packed its E4M3 bytes
    with a register it never wrote (``sass.stale_merges``). NK is not specialized now: the one-key
    launch compiles the kernel every other key count runs."""
    r = aot.compile_launch(aot.record_sm90_launch(head_dim=64, seq_len=96, seq_len_k=nk,
                                                  return_lse=True, granularity=granularity),
                           "sm_90a")
    assert r.ok, r.error
    assert sass.stale_merges(sass.listing(r.cubin)) == []


def test_query_and_key_counts_are_not_specialized():
    params = {p.name: p for p in kernel_int8_sm90._attn_fwd_sm90_kernel.params}
    assert params["NK"].do_not_specialize and params["NQ"].do_not_specialize


def test_the_triton_version_is_pinned():
    kernel_int8_sm90.check_version()
    for version in ("3.6.1+git1a2b3c", "3.8.0", "3.9.0"):
        kernel_int8_sm90.check_version(version)
    for version in ("3.5.1", "3.7.0", "3.10.0", "3.60.0"):
        with pytest.raises(RuntimeError, match=rf"Hopper API of Triton 3\.6\.x, 3\.8\.x, "
                                               rf"3\.9\.x, found Triton {version}"):
            kernel_int8_sm90.check_version(version)


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

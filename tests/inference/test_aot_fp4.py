"""The FP4 attention kernel compiled ahead of time on a CPU machine: native block-scaled FP4
tensor-core instructions on Blackwell, the bf16 emulation on Hopper, and the quantizers.

What Triton 3.6 emits for ``_attn_fwd_fp4_kernel`` (BLOCK_M=128, BLOCK_N=64, D=128):

| target  | NVFP4 (``qk_fp4_pv_fp4``)                                   | MXFP4 (``qk_mxfp4_pv_mxfp4``)        |
|---------|-------------------------------------------------------------|--------------------------------------|
| sm_100a | tcgen05.mma kind::mxf4nvf4.block_scale.scale_vec::4X        | tcgen05.mma kind::mxf4 … ::2X        |
| sm_120a | mma.sync m16n8k64 kind::mxf4nvf4 … scale_vec::4X … ue4m3    | … scale_vec::2X … ue8m0              |
| sm_90a  | wgmma bf16 (operands unpacked and scaled: emulation)        | the same                             |
"""

from __future__ import annotations

import pytest

from lowbit_attn.tools import aot

pytestmark = pytest.mark.aot

ATTENTION = "_attn_fwd_fp4_kernel"
SM100 = {
    "qk_fp4_pv_fp4": "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X",
    "qk_mxfp4_pv_mxfp4": "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X",
}
SM120 = {
    "qk_fp4_pv_fp4": "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X"
                     ".f32.e2m1.e2m1.f32.ue4m3",
    "qk_mxfp4_pv_mxfp4": "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale"
                         ".scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0",
}
BF16_WGMMA = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"


def scale_vec_spelling(form: str) -> str:
    """A block-scaled MMA as Triton 3.6 spells it: Triton 3.9 names the elements each scale
    covers (``block16``, ``block32``) where 3.6 names the scales per 64-element K step
    (``scale_vec::4X``, ``scale_vec::2X``): the same instruction."""
    return form.replace(".block16", ".scale_vec::4X").replace(".block32", ".scale_vec::2X")
RECIPES = list(SM100)


@pytest.fixture(scope="module")
def compiled():
    cache: dict[tuple, list[aot.KernelReport]] = {}

    def get(recipe: str, arch: str, causal: bool = False) -> list[aot.KernelReport]:
        key = (recipe, arch, causal)
        if key not in cache:
            cache[key] = aot.compile_recipe(recipe, arch, head_dim=128, causal=causal,
                                            return_lse=True)
        return cache[key]

    return get


def attention_report(reports):
    (report,) = [r for r in reports if r.kernel == ATTENTION]
    return report


def describe(r: aot.KernelReport) -> str:
    return (f"{r.kernel} on {r.arch} {r.variant}: {r.registers} registers, spills {r.spills} B, "
            f"instructions {r.instructions}, error {r.error}")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm100_runs_both_products_on_tcgen05_block_scaled_fp4(compiled, recipe, causal):
    r = attention_report(compiled(recipe, "sm_100a", causal))
    assert r.ok, describe(r)
    assert r.constexprs["NATIVE_FP4"] is True and r.constexprs["NV"] == (recipe == "qk_fp4_pv_fp4")
    assert set(map(scale_vec_spelling, r.instructions)) == {SM100[recipe]}, describe(r)
    assert r.spills == 0, describe(r)


@pytest.mark.parametrize("recipe", RECIPES)
def test_sm120_runs_both_products_on_mma_sync_block_scaled_fp4(compiled, recipe):
    r = attention_report(compiled(recipe, "sm_120a"))
    assert r.ok, describe(r)
    assert set(map(scale_vec_spelling, r.instructions)) == {SM120[recipe]}, describe(r)
    assert r.spills == 0, describe(r)


# The key-block loop of the native kernels (BLOCK_M=128, BLOCK_N=64, D=128, 8 warps: 32 scores per
# thread per tile; non-causal), instructions per thread per tile, measured 2026-11-25 (Triton 3.6's
# ptxas and cuobjdump) before and after P̃'s E2M1 rounding moved from fp32 arithmetic (~20 operations
# per value) to the hardware conversion (``quant.fp4.e2m1_pack``: one F2FP per two values), and
# after sm_120a's loop issued Q·Kᵀ one key block ahead (``PIPELINE_QK``; sm_100a stays serial):
#                       arithmetic   cvt.rn.satfinite.e2m1x2   Q·Kᵀ one block ahead
#   sm_100a  NVFP4         1225          773                       (serial)
#            MXFP4         1074          644                       (serial)
#   sm_120a  NVFP4         2196         1457                       1531
#            MXFP4         1644          925                       1009
# The bars: the measured counts plus 5 %.
KEY_LOOP_BUDGET = {("sm_100a", "qk_fp4_pv_fp4"): 812, ("sm_100a", "qk_mxfp4_pv_mxfp4"): 676,
                   ("sm_120a", "qk_fp4_pv_fp4"): 1608, ("sm_120a", "qk_mxfp4_pv_mxfp4"): 1060}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ["sm_100a", "sm_120a"])
def test_native_kernels_round_p_to_e2m1_with_the_hardware_conversion(compiled, arch, recipe):
    """P̃'s E2M1 codes come from ``cvt.rn.satfinite.e2m1x2.f32`` (SASS ``F2FP…E2M1``), 16 per
    thread per tile (two values each), and the key-block loop stays within its budget."""
    from lowbit_attn.tools import sass

    r = attention_report(compiled(recipe, arch))
    assert r.ok, describe(r)
    assert r.ptx.count("cvt.rn.satfinite.e2m1x2.f32") > 0
    instructions = sass.disassemble(r.cubin)
    body = (sass.key_block_loops(instructions, mma="UTCOMMA") if arch == "sm_100a"
            else sass.loops(instructions))[0]
    conversions = [op for op in body if op.startswith("F2FP") and "E2M1" in op]
    assert len(conversions) == 16, conversions
    assert len(body) <= KEY_LOOP_BUDGET[arch, recipe], len(body)


# sm_120a with Q·Kᵀ one key block ahead, measured 2026-11-25 (serial in brackets): the key loop's
# instructions per thread per tile, and among the next block's 16 Q·Kᵀ OMMAs (first to last) this
# block's MUFU.EX2 and all instructions; 255 registers, no spills. Causal MXFP4 stays serial (it
# spills pipelined: 16 B).
#                      instructions    MUFU.EX2   all between
#   NVFP4   full       1531 (1457)     16 (0)     268 (136)
#           causal     1529 (1431)     17 (0)     267 (134)
#   MXFP4   full       1009 (925)      36 (0)     334 (83)
# The bars: instructions plus 5 %, exp2s less a quarter.
PIPELINED = [("qk_fp4_pv_fp4", False), ("qk_fp4_pv_fp4", True), ("qk_mxfp4_pv_mxfp4", False)]
PIPELINED_LOOP_BUDGET = {PIPELINED[0]: 1608, PIPELINED[1]: 1606, PIPELINED[2]: 1060}
PIPELINED_MIN_EXP2 = {PIPELINED[0]: 12, PIPELINED[1]: 12, PIPELINED[2]: 27}


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("recipe,causal", PIPELINED, ids=["nvfp4-full", "nvfp4-causal",
                                                           "mxfp4-full"])
def test_sm120_issues_the_next_qk_among_the_softmax(compiled, recipe, causal):
    from lowbit_attn.tools import sass

    r = attention_report(compiled(recipe, "sm_120a", causal))
    assert r.ok and r.constexprs["PIPELINE_QK"] is True, describe(r)
    assert r.spills == 0 and r.registers <= 255, describe(r)
    body = sass.loops(sass.disassemble(r.cubin))[0]
    assert len(body) <= PIPELINED_LOOP_BUDGET[recipe, causal], len(body)
    placed = sass.qk_interleave(body)
    assert (placed.qk, placed.pv) == (16, 16), placed
    assert placed.exp2 >= PIPELINED_MIN_EXP2[recipe, causal], placed


def test_serial_loops_issue_no_exp2_among_the_qk(compiled, monkeypatch):
    """The comparison: sm_120a's serial loops (``PIPELINE_QK`` off; causal MXFP4 always) wait for
    Q·Kᵀ before the first exp2. sm_100a keeps the serial loop (Triton 3.6 fails to compile the
    pipelined one there: NVWS ``InsertTmemAref`` assertion)."""
    from lowbit_attn.tools import sass

    def first_loop(r):
        assert r.ok and r.spills == 0, describe(r)
        return sass.qk_interleave(sass.loops(sass.disassemble(r.cubin))[0])

    placed = first_loop(attention_report(compiled("qk_mxfp4_pv_mxfp4", "sm_120a", True)))
    assert (placed.qk, placed.pv, placed.exp2, placed.f2fp) == (16, 16, 0, 0), placed
    monkeypatch.setitem(aot.GPU_CONSTEXPRS, "PIPELINE_QK", lambda capability: False)
    for recipe in RECIPES:
        placed = first_loop(attention_report(aot.compile_recipe(recipe, "sm_120a", head_dim=128,
                                                                return_lse=True)))
        assert (placed.qk, placed.pv, placed.exp2, placed.f2fp) == (16, 16, 0, 0), placed
    monkeypatch.undo()
    assert aot.GPU_CONSTEXPRS["PIPELINE_QK"]((10, 0)) is False


@pytest.mark.parametrize("recipe", RECIPES)
def test_hopper_emulates_through_bf16_wgmma_without_spills(compiled, recipe):
    """Triton 3.6 cannot compile an NVFP4 ``dot_scaled`` for sm_90: the kernel unpacks instead."""
    r = attention_report(compiled(recipe, "sm_90a"))
    assert r.ok, describe(r)
    assert r.constexprs["NATIVE_FP4"] is False and r.constexprs["EMU_FP32"] is False
    assert r.instructions.get(BF16_WGMMA, 0) > 0, describe(r)
    assert all(form.startswith("wgmma") and "bf16" in form for form in r.instructions), describe(r)
    assert r.spills == 0, describe(r)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_120a"])
def test_fp4_quantizers_compile_without_spills(compiled, arch):
    reports = compiled("qk_fp4_pv_fp4", arch)
    kernels = {r.kernel for r in reports}
    assert {"_quantize_fp4_kernel", "_delta_s_kernel", "_channel_stats_kernel"} <= kernels
    for r in reports:
        assert r.ok, describe(r)
        if r.kernel != ATTENTION:
            assert r.instructions == {} and r.spills == 0, describe(r)


def test_inspect_cli_shows_the_native_instruction(capsys):
    from lowbit_attn.tools.cli import main

    assert main(["inspect", "--arch", "sm_120a", "--recipe", "qk_fp4_pv_fp4"]) == 0
    assert "kind::mxf4nvf4.block_scale" in capsys.readouterr().out


def test_inspect_prints_the_fp4_gates(capsys):
    """``inspect`` adds ``tools/fp4_gates.py``'s lines: the Triton kernel's key-block loop on
    sm_100a, and with ``--kernel gluon`` the Gluon forward's softmax loop and products in flight."""
    from lowbit_attn.core import triton_support
    from lowbit_attn.tools.cli import main

    assert main(["inspect", "--arch", "sm_100a", "--recipe", "qk_fp4_pv_fp4"]) == 0
    out = capsys.readouterr().out
    assert "key-block loop" in out and "16 E2M1 conversions" in out, out
    if not triton_support.gluon_available("blackwell"):
        return  # --kernel gluon refuses in a line (tools/test_cli.py)
    assert main(["inspect", "--arch", "sm_100a", "--recipe", "qk_fp4_pv_fp4", "--kernel",
                 "gluon"]) == 0
    out = capsys.readouterr().out
    assert "softmax partition" in out and "products in flight" in out and "UTCOMMA" in out, out
    with pytest.raises(SystemExit):
        main(["inspect", "--arch", "sm_120a", "--recipe", "qk_fp4_pv_fp4", "--kernel", "gluon"])

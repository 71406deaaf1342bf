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
    assert set(r.instructions) == {SM100[recipe]}, describe(r)
    assert r.spills == 0, describe(r)


@pytest.mark.parametrize("recipe", RECIPES)
def test_sm120_runs_both_products_on_mma_sync_block_scaled_fp4(compiled, recipe):
    r = attention_report(compiled(recipe, "sm_120a"))
    assert r.ok, describe(r)
    assert set(r.instructions) == {SM120[recipe]}, describe(r)
    assert r.spills == 0, describe(r)


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

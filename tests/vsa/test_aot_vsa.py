"""The video sparse attention fine-stage kernels compiled ahead of time for sm_90a on the CPU: all
three products of each 16-bit kernel on ``wgmma`` (bf16, fp32 accumulation); the 8-bit forward's
Q·Kᵀ on INT8 ``wgmma`` (s32 accumulation) and its P̃·V on FP8 ``wgmma``.

Triton 3.6, 64-token tiles, first sm_90 config (4 warps, 2 stages), ptxas -v (registers, spilled
bytes): D=64 forward 149/0, dQ 158/0, dK/dV 227/0; D=128 forward 246/0, dQ 254/0, dK/dV 255/44;
8-bit forward D=64 204/0, D=128 242/0.
"""

from __future__ import annotations

import pytest

from lowbit_attn.tools import aot

pytestmark = pytest.mark.aot

BF16_WGMMA = "f32.bf16.bf16"


@pytest.mark.parametrize("d", [64, 128])
def test_fine_stage_kernels_use_wgmma(d):
    rs = {r.kernel: r for r in aot.compile_vsa("sm_90a", d)}
    assert set(rs) == {"_vsa_fwd_kernel", "_vsa_dq_kernel", "_vsa_dkdv_kernel", "_tile_kernel",
                       "_untile_kernel"}
    for name in ("_tile_kernel", "_untile_kernel"):
        assert rs.pop(name).ok
    for name, r in rs.items():
        assert r.ok and r.error is None, (name, r.error)
        forms = [f for f in r.instructions if f.startswith("wgmma") and f.endswith(BF16_WGMMA)]
        assert forms, (name, r.instructions)
        assert not any(f.startswith("mma.sync") for f in r.instructions), (name, r.instructions)
        assert r.registers is not None and r.registers <= 255
    print({name: (r.registers, r.spill_stores) for name, r in rs.items()})


@pytest.mark.parametrize("d", [64, 128])
def test_8bit_fine_forward_uses_int8_and_fp8_wgmma(d):
    rs = {r.kernel: r for r in aot.compile_vsa("sm_90a", d, recipe="qk_int8_pv_fp8")}
    r = rs["_vsa_fwd_kernel"]
    assert r.ok and r.error is None, r.error
    wgmma = {".".join(f.split(".")[-3:]) for f in r.instructions
             if f.startswith("wgmma")}
    assert wgmma == {"s32.s8.s8", "f32.e4m3.e4m3"}, r.instructions
    assert all(x.ok for x in rs.values()) and r.spill_stores == 0


@pytest.mark.parametrize("d", [64, 128])
def test_8bit_fine_forward_loads_its_tiles_ahead(d):
    """The 8-bit fine forward's key-tile loop brings K, V and K's scales by ``cp.async``
    (``LDGSTS``); its only synchronous global loads (``LDG``) are the tile's index and count.
    (2026-11-28: with V's loads masked by the key tile's count, along V's slot-contiguous E4M3
    layout, they were single bytes through registers: 66 ``LDG`` and 4 ``STS`` per iteration at
    D = 128, 1055 instructions per thread; 2 and 670 without that mask.)"""
    from lowbit_attn.tools import sass

    (r,) = [r for r in aot.compile_vsa("sm_90a", d, recipe="qk_int8_pv_fp8")
            if r.kernel == "_vsa_fwd_kernel"]
    assert r.ok and r.spill_stores == 0, (r.error, r.spill_stores)
    body = sass.loops(sass.disassemble(r.cubin))[0]
    ops = [line.split()[0] for line in body]
    assert sum(op.startswith("LDG.") for op in ops) <= 2, sorted(set(ops))
    width = {"128": 16, "64": 8, "32": 4}  # bytes per thread of an LDGSTS (4 without a suffix)
    copied = sum(width.get(op.rsplit(".", 1)[-1], 4) for op in ops if op.startswith("LDGSTS"))
    assert copied >= 2 * 64 * d // (32 * r.num_warps), (copied, sorted(set(ops)))  # K and V tiles
    assert not any(op.startswith(("STS", "LDL", "STL")) for op in ops), sorted(set(ops))


@pytest.mark.parametrize("d", [64, 128])
def test_the_backward_on_the_sm90_loops_passes_the_gate(d):
    """``LOWBIT_ATTN_BWD_KERNEL=sm90``: the fine stage's backward on the trainable attention's
    Gluon loops (``training/kernel_bwd_sm90.py``, one warpgroup per 64-token tile, 16-bit),
    through the launch path: no spills (D = 128: 247 registers, where the Triton dK/dV kernel
    spills 44 B), every product m64n64, issue at most 1.5x the tensor cycles per tile (D = 128:
    dK/dV 403 instructions, 0.32x; dQ 338, 0.35x)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from helpers import pinned_codegen
    from lowbit_attn.core import triton_support
    from lowbit_attn.tools import bwd_gates

    if not triton_support.gluon_available("hopper"):
        pytest.skip(triton_support.gluon_refusal("hopper", "the Gluon backward"))
    rs = {r.kernel: r for r in aot.compile_vsa("sm_90a", d, bwd_kernel="sm90")}
    assert {"_dkdv_sm90_kernel", "_dq_sm90_kernel"} <= set(rs)
    assert "_vsa_dkdv_kernel" not in rs and "_vsa_dq_kernel" not in rs
    for name in bwd_gates.KERNELS:
        r = rs[name]
        g = bwd_gates.gates(r)
        assert r.ok and r.spills == 0 and not g["narrow"], (name, r.error, g)
        assert not g["a_register"]["hazards"], (name, g["a_register"])
        assert r.num_warps == 4 and r.constexprs["SPARSE"] and not r.constexprs["INT8"]
        assert g["passes"] or not pinned_codegen(), (name, g)

"""CPU gates of the Gluon backward loops for Hopper (``training/kernel_bwd_sm90.py``), compiled
ahead of time for sm_90a through the trainable attention's own launch path
(``LOWBIT_ATTN_BWD_KERNEL=sm90``, P and dS per tile and per row): ``tools/bwd_gates.py``'s
gate (no spills, every product a wgmma of N >= 64, issue cycles at most 1.5x the tensor cycles
per tile of the main loop). Measured 2026-11-28 (Triton 3.6.0, ptxas 12.8), bf16, non-causal,
registers, main loop instructions per thread per tile, issue / tensor cycles:

| kernel (tile)            | D=64 per tile   | D=64 per row    | D=128 per tile   | D=128 per row    |
|--------------------------|-----------------|-----------------|------------------|------------------|
| dK/dV (128 keys x 64 q)  | 169, 803, 1.40  | 166, 798, 1.39  | 243, 1039, 0.90  | 202, 1041, 0.91  |
| dQ (128 q x 64 keys)     | 139, 509, 1.17  | 127, 513, 1.18  | 179, 586, 0.67   | 172, 589, 0.67   |
| Δ pass (128 q x 64 keys) | 92, 260, 0.87   | 92, 260, 0.87   | 96, 258, 0.43    | 96, 258, 0.43    |

Causal, D = 128: dK/dV 255 registers per tile, 252 per row (no spills). At D = 128 the dK/dV
kernel keeps dV's and dK's channels 64-127 in shared memory (with all four 64-channel halves in
registers it spilled: NOTES §8).
"""

from __future__ import annotations

import pytest

from helpers import pinned_codegen, require_gluon

require_gluon("hopper")  # before importing Gluon code

from lowbit_attn.core.recipes import SAGEBWD_INT8
from lowbit_attn.tools import aot, bwd_gates

pytestmark = pytest.mark.aot

GRANULARITIES = ("per_tile", "per_row")
INT8_WGMMA = "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8"
BF16_WGMMA = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(d, causal=False, granularity="per_tile"):
        if (d, causal, granularity) not in cache:
            recipe = SAGEBWD_INT8.replace(backward_granularity=granularity)
            rs = aot.compile_train(recipe, "sm_90a", d, causal=causal, bwd_kernel="sm90")
            cache[d, causal, granularity] = {
                r.kernel + ("/delta" if r.constexprs.get("DELTA_PASS") else ""): r for r in rs}
        return cache[d, causal, granularity]

    return get


NAMES = ("_dkdv_sm90_kernel", "_dq_sm90_kernel", "_dq_sm90_kernel/delta")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_backward_runs_on_the_sm90_loops(reports, d, causal, granularity):
    """The launch path takes them (the Triton backward kernels are not launched), and every
    product is the wgmma the design says: m64n64, INT8 for the scores, dV, dK and dQ, bf16 for
    dP, 8 warps (two consumer warpgroups)."""
    rs = reports(d, causal, granularity)
    assert set(NAMES) <= set(rs) and "_train_dkdv_kernel" not in rs and "_train_dq_kernel" not in rs
    for name in NAMES:
        r = rs[name]
        assert r.ok, (name, r.error)
        assert r.num_warps == 8 and set(r.instructions) == {INT8_WGMMA, BF16_WGMMA}, (
            name, r.instructions)


@pytest.mark.pinned_codegen
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_every_loop_passes_its_gate(reports, d, causal, granularity):
    for name in NAMES:
        r = reports(d, causal, granularity)[name]
        g = bwd_gates.gates(r)
        assert g["passes"], (name, r.registers, r.spills, g)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_no_kernel_writes_an_a_register_in_flight(reports, d, causal, granularity):
    """Pᵀ, dSᵀ (dK/dV) and dS (dQ), the register A operands, are not overwritten under the
    tensor cores (``sass.a_register_hazards``, the whole kernel; on every Triton)."""
    wgmma = {}
    for name in NAMES:
        a = bwd_gates.gates(reports(d, causal, granularity)[name])["a_register"]
        assert not a["hazards"], (name, a)
        wgmma[name] = a["wgmma"]
    assert wgmma["_dkdv_sm90_kernel"] > 0 and wgmma["_dq_sm90_kernel"] > 0, wgmma


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_no_spills_and_no_local_memory_on_any_triton(reports, d, granularity):
    """What holds on every Triton the kernels compile on (the instruction counts are the pinned
    Triton's)."""
    for name in NAMES:
        r = reports(d, granularity=granularity)[name]
        g = bwd_gates.gates(r)
        assert r.spills == 0 and g["local_memory"] == 0 and not g["narrow"], (name, g)


def test_the_dkdv_loop_keeps_p_and_ds_in_registers(reports):
    """Pᵀ and dSᵀ are the register A operands of dV and dK (the PTX names a register list
    where a shared-memory descriptor would be), quantized without a conversion instruction
    (``RNE_S8X4_PTX``: FFMA and PRMT), and their per-row amax is a NaN-propagating max."""
    import re

    from lowbit_attn.tools import sass

    r = reports(128, granularity="per_row")["_dkdv_sm90_kernel"]
    products = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.s32\.s8\.s8\s+\{[^}]*\},"
                          r"\s*(\S)", r.ptx)
    assert products.count("{") >= 4  # dV's and dK's two halves of D: A from registers
    body = min(sass.key_block_loops(sass.disassemble(r.cubin)), key=len)
    ops = sass.opcode_counts(body)
    assert ops.get("F2I", 0) == 0 and ops.get("PRMT", 0) == 48, ops  # 2 x 8 registers x 3
    assert any(t.startswith("FMNMX.NAN") for t in body)


def test_no_kernel_argument_is_n_by_n():
    n, d = 2048, 64
    launches = aot.record_train_launches("sagebwd_int8", head_dim=d, seq_len=n, bwd_kernel="sm90")
    sizes = [x.numel() for launch in launches for x in launch.tensors()]
    assert max(sizes) / 2 <= 3 * n * d  # [1, 2, N, D] inputs; LD holds 3 planes of N floats


def test_inspect_prints_the_gates(capsys):
    from lowbit_attn.tools.cli import main

    code = main(["inspect", "--arch", "sm_90a", "--recipe", "sagebwd_int8", "--kernel", "sm90",
                 "--head-dim", "64", "--dtype", "bfloat16"])
    text = capsys.readouterr().out
    assert code == 0 and "P and dS per tile" in text
    assert "_dkdv_sm90_kernel" in text and "issue" in text and "tensor" in text
    assert "gate: 7 of 7 kernels pass" in text or not pinned_codegen(), text[-400:]
    assert "A-register hazard: none (" in text

"""Trainable attention kernels compiled ahead of time on the CPU: on sm_90a every INT8 matmul of
SageBwd (forward Q·Kᵀ and P̃·V; backward Q·Kᵀ recompute, Pᵀ·dO, dSᵀ·Q, dS·K) is a
``wgmma … s32.s8.s8`` and dP = dO·Vᵀ a bf16 ``wgmma``.

What Triton 3.6 emits (bf16 inputs, first sm_90 config, ptxas -v):

| kernel | D=64 | D=128 |
|---|---|---|
| _train_fwd_kernel (8 warps) | 128 registers | 235 registers |
| _train_dkdv_kernel (8 warps) | 220 registers | 255 registers, 32 B spilled |
| _train_dq_kernel (8 warps) | 148 registers | 184 registers |
"""

from __future__ import annotations

import pytest

from lowbit_attn import aot

pytestmark = pytest.mark.aot

INT8_WGMMA = "s32.s8.s8"
BF16_WGMMA = "f32.bf16.bf16"


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(recipe, d, causal=False):
        if (recipe, d, causal) not in cache:
            cache[recipe, d, causal] = {r.kernel: r for r in aot.compile_train(recipe, "sm_90a", d, causal=causal)}
        return cache[recipe, d, causal]

    return get


def _int8_wgmma(r) -> int:
    return sum(n for form, n in r.instructions.items()
               if form.startswith("wgmma") and form.endswith(INT8_WGMMA))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sagebwd_matmuls_are_int8_wgmma_on_hopper(reports, d, causal):
    rs = reports("sagebwd_int8", d, causal)
    assert {"_train_fwd_kernel", "_train_dkdv_kernel", "_train_dq_kernel", "_delta_kernel",
            "_quantize_int8_kernel"} <= set(rs)
    for name in ("_train_fwd_kernel", "_train_dkdv_kernel", "_train_dq_kernel"):
        r = rs[name]
        assert r.ok and r.error is None, (name, r.error)
        assert _int8_wgmma(r) > 0, (name, r.instructions)
        assert not any(form.startswith("mma.sync") for form in r.instructions), (name, r.instructions)
    assert not any(f.endswith(BF16_WGMMA) for f in rs["_train_fwd_kernel"].instructions)
    for name in ("_train_dkdv_kernel", "_train_dq_kernel"):  # dP = dO·Vᵀ stays 16-bit
        assert any(f.startswith("wgmma") and f.endswith(BF16_WGMMA) for f in rs[name].instructions), (
            name, rs[name].instructions)
    for name in ("_train_fwd_kernel", "_train_dq_kernel"):
        assert rs[name].spill_stores == 0, (name, rs[name].spill_stores)
    assert rs["_train_dkdv_kernel"].spill_stores <= (0 if d == 64 else 64)


def test_dp_in_int8_makes_every_backward_product_int8(reports):
    rs = reports("sagebwd_int8", 128)
    base = _int8_wgmma(rs["_train_dq_kernel"])
    from lowbit_attn.recipes import SAGEBWD_INT8
    from lowbit_attn.quantized import TRAIN_MATMULS

    rs8 = {r.kernel: r for r in aot.compile_train(
        SAGEBWD_INT8.replace(int8=frozenset(TRAIN_MATMULS)), "sm_90a", 128)}
    for name in ("_train_dkdv_kernel", "_train_dq_kernel"):
        assert not any("bf16" in form for form in rs8[name].instructions), rs8[name].instructions
    assert _int8_wgmma(rs8["_train_dq_kernel"]) > base

"""The Gluon Blackwell FP4 forward (``inference/kernel_fp4_gluon.py``) executed on the CPU by
``lowbit_attn.tools.gluon_cpu``: the kernel's own code (loader, MMA and softmax partitions under
the model's three interleavings), launched by its own launcher, with tensor memory,
``tcgen05_mma_scaled``, ``tcgen05_copy``, TMA and mbarriers modelled, against the FP4 twin
``inference.naive.fp4_attention`` bit for bit.

Both sides take products and row sums in float64 rounded once (``canonical_reductions``); the
block-scaled product of the model dequantizes the E2M1 bytes and the E4M3/E8M0 group scales as
the MMA reads them, the E2M1 conversion of P̃ (inline PTX) is the twin's ``e2m1_code``, and the
model's ``fma`` rounds twice: ``s·mult`` then ``+ (log2 peak − block max)``, the twin's order (it
rounds ``s·mult`` and subtracts the rounded ``block max − log2 peak``: the same bits). On a GPU the
FMA is fused (one rounding): that difference is the one this check cannot see. With ΔS the kernel
rounds ``s·mult``, adds ΔS and subtracts the shift, as the twin does (no FMA).
``test_the_check_catches`` breaks the kernel's protocol and numerics in known ways and expects each
break to be caught."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import (Bound, assert_bits, assert_caught, assert_within, mutant, mutation_params,
                     one_torch_thread, schedule_outcome)
from helpers import causal_offset_of as offset_of
from lowbit_attn.core.recipes import get_recipe
import helpers
helpers.require_gluon("blackwell", "cpu_model")  # before importing Gluon code

from lowbit_attn.inference import gluon_fp4_blocks as fb
from lowbit_attn.inference import kernel_fp4_gluon as kf
from lowbit_attn.inference.naive import fp4_attention
from lowbit_attn.inference.prepare import quantize_qkv_fp4
from lowbit_attn.tools import gluon_cpu

KERNEL = kf._attn_fwd_fp4_gluon_kernel
RECIPE = {"nvfp4": "qk_fp4_pv_fp4", "mxfp4": "qk_mxfp4_pv_mxfp4"}
BLOCK_K = 64
D = 128


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


# (B, Hq, Hkv, Nq, Nk, causal offset or None for "nk - nq" when causal, V smoothed): partial query
# and key blocks, 4-5 key blocks (each K/V stage, S buffer and scale buffer reused twice), GQA and
# MQA, decode; causal: rows that see no key beside rows that do (Nq200-Nk90), whole tiles that see
# none (Nq300-Nk40: no key block at all), an offset other than the bottom-right one.
SHAPES = [
    pytest.param(1, 2, 2, 130, 200, None, False, id="B1-H2-Nq130-Nk200"),
    pytest.param(2, 4, 2, 77, 300, None, True, id="B2-GQA4:2-Nq77-Nk300-vmean"),
    pytest.param(1, 1, 1, 200, 90, None, False, id="B1-Nq200-Nk90"),
    pytest.param(1, 1, 1, 300, 40, None, False, id="B1-Nq300-Nk40-keyless-tiles"),
    pytest.param(1, 2, 1, 150, 100, 0, True, id="B1-MQA2:1-Nq150-Nk100-offset0-vmean"),
    pytest.param(1, 1, 1, 1, 257, None, False, id="B1-decode-Nq1-Nk257"),
]


def operands(b, hq, hkv, nq, nk, fmt, smooth_v=False, smooth_q=False, lse_shift=False):
    """FP4 operands, K smoothed; with ``smooth_q`` ΔS (per 128-row query block, the kernel's
    BLOCK_M), with ``lse_shift`` K's LSE shift (the recipes' defaults with ``return_lse``)."""
    g = torch.Generator().manual_seed(nq + 7 * nk + hq)
    q = torch.randn(b, hq, nq, D, generator=g)
    k = torch.randn(b, hkv, nk, D, generator=g) + 4 * torch.randn(b, hkv, 1, D, generator=g)
    v = torch.randn(b, hkv, nk, D, generator=g) + torch.randn(b, hkv, 1, D, generator=g)
    recipe = get_recipe(RECIPE[fmt]).replace(block_q=kf.BLOCK_M, block_k=BLOCK_K,
                                             smooth_q=smooth_q, smooth_k=True, smooth_v=smooth_v)
    return quantize_qkv_fp4(q, k, v, recipe, D**-0.5, need_lse_shift=lse_shift,
                            backend="reference")


def twin(qz, causal_offset, two_level):
    with gluon_cpu.canonical_reductions():
        return fp4_attention(qz, head_dim=D, block_q=kf.BLOCK_M, block_k=BLOCK_K,
                             causal_offset=causal_offset, two_level=two_level)


def gluon_on_cpu(qz, causal_offset, two_level, schedule="lazy", out=None, **options):
    """``kernel_fp4_gluon.attention`` (launcher and kernel) with the kernel run by the model:
    ``(out, lse, trace)``."""
    if out is None:
        out = torch.empty(qz.q.shape[:3] + (D,), dtype=torch.float32)  # NaN-poisoned (conftest)
    with gluon_cpu.kernel_on_cpu(kf, "_attn_fwd_fp4_gluon_kernel", schedule=schedule,
                                 **options) as cpu:
        lse = kf.attention(qz, out=out, head_dim=D, block_q=kf.BLOCK_M, block_k=BLOCK_K,
                           causal_offset=causal_offset, two_level=two_level, return_lse=True)
    return out, lse, cpu.trace


@pytest.mark.parametrize("b,hq,hkv,nq,nk,offset,smooth_v", SHAPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("two_level", [True, False], ids=["two-level", "one-level"])
def test_gluon_fp4_equals_the_twin_bit_for_bit_under_each_schedule(b, hq, hkv, nq, nk, offset,
                                                                   smooth_v, fmt, causal,
                                                                   two_level):
    qz = operands(b, hq, hkv, nq, nk, fmt, smooth_v)
    co = offset_of(nq, nk, causal, offset)
    want, want_lse = twin(qz, co, two_level)
    for schedule in gluon_cpu.SCHEDULES:
        got, got_lse, _ = gluon_on_cpu(qz, co, two_level, schedule)
        assert_bits(got, want, f"out ({schedule})")
        assert_bits(got_lse, want_lse, f"lse ({schedule})")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,offset,smooth_v", SHAPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_fp4_with_delta_s_and_lse_shift_equals_the_twin(b, hq, hkv, nq, nk, offset,
                                                              smooth_v, fmt, causal):
    """The recipes' defaults: ΔS added to each key block's scores (``s·mult + ΔS`` as
    ``kernel_fp4``, no FMA folding) and K's LSE shift added to the LSE, under each schedule."""
    qz = operands(b, hq, hkv, nq, nk, fmt, smooth_v, smooth_q=True, lse_shift=True)
    assert qz.delta_s is not None and qz.lse_shift is not None
    co = offset_of(nq, nk, causal, offset)
    two_level = nq % 2 == 0  # both modes over the shapes
    want, want_lse = twin(qz, co, two_level)
    for schedule in gluon_cpu.SCHEDULES:
        got, got_lse, _ = gluon_on_cpu(qz, co, two_level, schedule)
        assert_bits(got, want, f"out ({schedule})")
        assert_bits(got_lse, want_lse, f"lse ({schedule})")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,offset,smooth_v", SHAPES[:3])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fused_fma_stays_within_the_fp4_kernels_bound(b, hq, hkv, nq, nk, offset, smooth_v, fmt):
    """With the GPU's fused ``fma`` (one rounding) an exp2 argument moves by an ulp now and then,
    which can carry a P̃ value across an E2M1 rounding boundary: the bound the Triton FP4 kernel
    is held to against the same twin for that reason (test_fp4_attention.py)."""
    qz = operands(b, hq, hkv, nq, nk, fmt, smooth_v)
    co = offset_of(nq, nk, True, offset)
    want, want_lse = twin(qz, co, True)
    got, got_lse, _ = gluon_on_cpu(qz, co, True, numerics=gluon_cpu.Numerics(fused_fma=True))
    assert_within(got, want, Bound(atol=5e-3, cos=0.99999), name="out")
    assert_within(got_lse, want_lse, Bound(atol=1e-5, rtol=1e-5), name="lse")


def test_the_shapes_cover_the_schedule():
    """Over three of the shapes above, every branch runs: both key-block loops in both mask modes,
    each barrier phase, every tcgen05 operation (V's scales by ``tcgen05_copy`` for NVFP4 and from
    registers for MXFP4), programs without key blocks, zero fill past the end of K."""
    events, calls = {}, set()
    for i in (0, 3, 5):
        b, hq, hkv, nq, nk, offset, smooth_v = SHAPES[i].values
        for fmt, causal in itertools.product(("nvfp4", "mxfp4"), (False, True)):
            qz = operands(b, hq, hkv, nq, nk, fmt, smooth_v)
            *_, trace = gluon_on_cpu(qz, offset_of(nq, nk, causal, offset), True)
            for k, n in trace.events.items():
                events[k] = events.get(k, 0) + n
            calls |= {(name, dict(flags).get("MASKED"), dict(flags).get("IS_CAUSAL"),
                       dict(flags).get("NV")) for name, flags in trace.calls}
    for masked, causal, nv in itertools.product((False, True), repeat=3):
        assert ("_softmax_step", masked, causal, nv) in calls, (masked, causal, nv)
    assert events["wait phase 0"] and events["wait phase 1"], events
    assert events["tcgen05_mma_scaled completed"] == events["tcgen05_mma_scaled"] > 0, events
    assert events["tcgen05_copy completed"] == events["tcgen05_copy"] > 0, events
    assert events["tma zero-filled elements"], events


def test_every_gluon_name_the_kernel_uses_is_modelled():
    used, modeled = gluon_cpu.referenced_names(KERNEL), gluon_cpu.modeled_names()
    missing = {ns: sorted(names - modeled[ns]) for ns, names in used.items() if names - modeled[ns]}
    assert not missing, f"used by the kernel, not modelled by tools/gluon_cpu.py: {missing}"
    assert {"tcgen05_mma_scaled", "tcgen05_copy", "allocate_tensor_memory",
            "fence_async_shared"} <= used["functions"]
    assert {"wait", "expect", "arrive"} <= used["mbarrier"]
    assert {"make_tensor_descriptor", "async_copy_global_to_shared"} <= used["tma"]
    assert {"warp_specialize", "inline_asm_elementwise"} <= used["gl"]


# (id, function, old, new, what must happen: "hang", "race", "error" (another ScheduleError),
# "wrong" numbers, or "any" of these). A softmax partition that skips a wait runs ahead and
# completes a barrier's phase the other partitions have not waited for yet (ks_ready, pv_free): a
# hang in the model as on the GPU. The MMA warp's wait for ``s_free`` is not among the breaks: it
# is implied by ``ks_ready`` (the softmax publishes K(j)'s scales at the start of step j−1, after
# it read S(j−2) in step j−2), and the model's happens-before check agrees that dropping it is
# harmless.
MUTATIONS = [
    ("S-read-before-s_ready", kf._softmax_step,
     "mbarrier.wait(s_ready.index(stage), (j // 2) & 1)",
     "mbarrier.wait(s_ready.index(stage), (j // 2) & 1, pred=False)", "hang"),
    ("PV-read-before-pv_ready", fb.correct, "mbarrier.wait(pv_ready, i & 1)",
     "mbarrier.wait(pv_ready, i & 1, pred=False)", "hang"),
    ("s_free-wrong-parity", kf._mma, "mbarrier.wait(s_free.index(stage), phase ^ 1)",
     "mbarrier.wait(s_free.index(stage), phase)", "hang"),
    ("loader-ignores-kv_empty", kf._loader,
     "mbarrier.wait(kv_empty.index(stage), ((j // 2) & 1) ^ 1)",
     "mbarrier.wait(kv_empty.index(stage), ((j // 2) & 1) ^ 1, pred=False)", "any"),
    ("S(1)-into-S[0]", kf._mma, "s_tmem.index(1),", "s_tmem.index(0),", "race"),
    ("P̃-into-the-buffer-in-use", kf._softmax_step, "p_smem.index(stage).store(packed)",
     "p_smem.index(1 - stage).store(packed)", "race"),
    ("stage-1-released-as-stage-0", kf._issue_pv, "pv_ready, kv_empty.index(1), COPY_SCALES",
     "pv_ready, kv_empty.index(0), COPY_SCALES", "any"),
    ("PV-released-after-its-first-slice", fb.correct, "if k == D // O_SLICE - 1:", "if k == 0:",
     "race"),
    ("no-fence-before-P̃-handoff", kf._softmax_step,
     "fence_async_shared()\n    mbarrier.arrive(p_ready", "mbarrier.arrive(p_ready", "race"),
    ("MMA-ignores-ks_ready", kf._mma, "mbarrier.wait(ks_ready.index(stage), phase)",
     "mbarrier.wait(ks_ready.index(stage), phase, pred=False)", "race"),
    # ΔS and the LSE shift (the third case has both)
    ("ΔS-dropped", kf._softmax_step, "True, MASKED, IS_CAUSAL)", "False, MASKED, IS_CAUSAL)",
     "wrong"),
    ("LSE-shift-dropped", fb.epilogue, "offs_ms < nq, HAS_LSH)", "offs_ms < nq, False)",
     "wrong"),
    ("P̃-nibbles-swapped", fb.quantize_p, "[lo, hi]", "[hi, lo]", "wrong"),
    # Q's scale tile in tensor memory stays poisoned (NaN E4M3, E8M0 255)
    ("Q-scales-never-copied", kf._mma, "tcgen05_copy(qs_smem, qs_tmem)", "pass", "wrong"),
]
MUTATION_CASES = [  # (shape, format, causal offset, two_level, ΔS and LSE shift)
    ((1, 2, 1, 130, 300), "nvfp4", None, True, False),
    ((1, 1, 1, 200, 190), "mxfp4", 0, False, False),
    ((1, 1, 1, 150, 140), "nvfp4", 10, True, True),
]


def outcome(jit, old, new) -> str:
    """How the check answers the mutated kernel over ``MUTATION_CASES``, each under the three
    schedules: the first failure's kind, or "passes"."""
    broken = {jit.fn: mutant(jit, old, new)}

    def each():
        for (shape, fmt, co, two_level, smooth) in MUTATION_CASES:
            qz = operands(*shape, fmt, smooth_q=smooth, lse_shift=smooth)
            want, want_lse = twin(qz, co, two_level)
            for schedule in gluon_cpu.SCHEDULES:
                got, got_lse, _ = gluon_on_cpu(qz, co, two_level, schedule, overrides=broken)
                yield [(got, want), (got_lse, want_lse)]

    return schedule_outcome(each())


@pytest.mark.parametrize("jit,old,new,expected", mutation_params(MUTATIONS))
def test_the_check_catches(jit, old, new, expected):
    assert_caught(outcome(jit, old, new), expected)


def test_the_unmutated_kernel_passes_the_mutation_cases():
    assert outcome(kf._mma, "phase ^ 1)", "phase ^ 1)") == "passes"


def test_a_program_without_key_blocks_leaves_no_tcgen05_copy_in_flight():
    """The bug the model found: with no key block (a causal tile that sees no key) the MMA warp
    copied Q's scales to tensor memory and exited with the copy never completed (nothing waits
    for a ``tcgen05.cp`` but a later product's barrier)."""
    qz = operands(1, 1, 1, 300, 40, "nvfp4")
    broken = {kf._mma.fn: mutant(kf._mma, "    if n_blocks > 0:\n        tcgen05_copy",
                                 "    if True:\n        tcgen05_copy")}
    with pytest.raises(gluon_cpu.ScheduleError, match="tcgen05_copy"):
        gluon_on_cpu(qz, 40 - 300, True, overrides=broken)


def test_output_rows_past_2_31_elements():
    """An output view whose rows 121 on start past 2^31 elements (``helpers.wide_rows``): its
    row offsets must be computed in 64 bits (the model raises ``gluon_cpu.Overflow`` on an int32
    one), and the rows land where the view says."""
    qz = operands(1, 1, 1, 130, 130, "nvfp4")
    want, want_lse = twin(qz, None, True)
    out = helpers.wide_rows((1, 1, 130, D), torch.float16)
    _, lse, _ = gluon_on_cpu(qz, None, True, out=out)
    assert_bits(out.float(), want.half().float(), "out")
    assert_bits(lse, want_lse, "lse")


def test_key_scales_spanning_2_31_bytes_are_refused():
    """``gluon_fp4_blocks.key_scales`` addresses K's scales in int32 (int64 there spills):
    the launcher refuses scales whose tokens span 2^31 bytes or more, before launching."""
    import dataclasses

    qz = operands(1, 1, 1, 130, 130, "nvfp4")
    wide = helpers.wide_rows(tuple(qz.k_scale.shape), qz.k_scale.dtype)
    with pytest.raises(ValueError, match="k_scale's tokens must span fewer than 2"):
        gluon_on_cpu(dataclasses.replace(qz, k_scale=wide), None, True)

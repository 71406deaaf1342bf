"""The one-warpgroup Hopper forward (``inference/kernel_int8_sm90.py``) executed on the CPU by
``lowbit_attn.tools.gluon_cpu``: the kernel's own code, launched by its own launcher, with shared
memory, TMA, mbarriers and wgmma modelled sequentially, against the twin
``inference.naive.quantized_attention`` bit for bit.

Both sides take fp32 products and row sums in float64 rounded once (``canonical_reductions``), and
the model's ``fma`` rounds twice as the twin's ``s - m`` does; everything else (per-thread and
per-token scales, masks, offsets, the permuted V and P̃'s register operand, E4M3 rounding, the
epilogue and LSE) is compared exactly. ``test_the_check_catches`` breaks the kernel's source in
known ways and expects each break to be caught."""

from __future__ import annotations

import pytest
import torch

from helpers import (Bound, assert_bits, assert_caught, assert_within, mutant, mutation_params,
                     one_torch_thread, schedule_outcome)
from helpers import causal_offset_of as offset_of
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.core.variants import PLAIN, Variant
import helpers
helpers.require_gluon("hopper", "cpu_model")  # before importing Gluon code

from lowbit_attn.inference import gluon_blocks as gb
from lowbit_attn.inference import kernel_int8_sm90 as k90
from lowbit_attn.inference.naive import exact_attention, quantized_attention
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.tools import gluon_cpu

KERNEL = k90._attn_fwd_sm90_kernel

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

# helpers.SM90_SHAPES (partial blocks, GQA, MQA, offsets at and past the diagonal) with, between
# them, decode, enough key blocks to reuse each buffer, and query tiles that see no key.
SHAPES = [
    *helpers.SM90_SHAPES[:3],
    pytest.param(1, 1, 1, 1, 257, 128, None, id="B1-decode-Nq1-Nk257-D128"),
    pytest.param(1, 2, 1, 150, 523, 64, None, id="B1-GQA2:1-Nq150-Nk523-D64"),
    pytest.param(1, 1, 1, 200, 40, 64, None, id="B1-Nq200-Nk40-D64-keyless-tiles"),
    *helpers.SM90_SHAPES[3:],
]
CASES = [pytest.param(g, pv, id=f"{g}-{pv}")
         for g, pv in (("per_thread", "fp8"), ("per_token", "fp8"), ("per_thread", "fp16"),
                       ("per_token", "fp16"))]


def inputs(b, hq, hkv, nq, nk, d):
    """Seeded fp32 Q, K (channel-biased) and V."""
    g = torch.Generator().manual_seed(nq + 7 * nk + d)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g) + 4 * torch.randn(b, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    return q, k, v


def operands(b, hq, hkv, nq, nk, d, granularity="per_thread", pv="fp8", dtype=torch.float32):
    q, k, v = inputs(b, hq, hkv, nq, nk, d)
    recipe = get_recipe(f"qk_int8_pv_{pv}").replace(granularity=granularity, block_k=k90.BLOCK_N)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference",
                      permute_v=pv == "fp8")
    if pv == "fp8":  # stored [B, H, D, N'] as the quantization kernel stores it
        qz.v = qz.v.transpose(-1, -2).contiguous().transpose(-1, -2)
    return recipe, qz


def twin(recipe, qz, causal_offset, poly=0, variant=PLAIN, sinks=None):
    with gluon_cpu.canonical_reductions():
        return quantized_attention(qz, pv=recipe.pv, granularity=recipe.granularity,
                                   block_q=recipe.block_q, block_k=recipe.block_k,
                                   causal_offset=causal_offset, poly_share=poly,
                                   variant=variant, sinks=sinks)


def on_cpu(recipe, qz, causal_offset, k_stages=k90.K_STAGES, poly=0, variant=PLAIN,
           sinks=None, **options):
    """``kernel_int8_sm90.attention`` (launcher and kernel) with the kernel run by the model:
    ``(out, lse, trace)``."""
    out = torch.empty(qz.q.shape, dtype=torch.float32)  # NaN-poisoned (conftest)
    with gluon_cpu.kernel_on_cpu(k90, "_attn_fwd_sm90_kernel", **options) as cpu:
        lse = k90.attention(qz, out=out, pv=recipe.pv, granularity=recipe.granularity,
                            block_q=recipe.block_q, block_k=recipe.block_k,
                            causal_offset=causal_offset, return_lse=True, k_stages=k_stages,
                            poly_exp2=poly, variant=variant, sinks=sinks)
    return out, lse, cpu.trace


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", SHAPES)
@pytest.mark.parametrize("granularity,pv", CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("k_stages", [1, 2], ids=["k1", "k2"])
def test_sm90_kernel_equals_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, offset, granularity, pv,
                                                 causal, k_stages):
    recipe, qz = operands(b, hq, hkv, nq, nk, d, granularity, pv)
    co = offset_of(nq, nk, causal, offset)
    want, want_lse = twin(recipe, qz, co)
    got, got_lse, _ = on_cpu(recipe, qz, co, k_stages)
    assert_bits(got, want, "out")
    assert_bits(got_lse, want_lse, "lse")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", [SHAPES[i] for i in (1, 2, 4, 5, 7)])
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("poly", [2, 16])
def test_the_polynomial_exp2_equals_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, offset, pv, causal,
                                                         poly):
    """``poly_exp2``: the key groups the twin gives the polynomial (``naive.poly_columns``) are
    the kernel's, and it computes them as the twin does; and it changes the result where a key
    takes it."""
    recipe, qz = operands(b, hq, hkv, nq, nk, d, "per_thread", pv)
    co = offset_of(nq, nk, causal, offset)
    want, want_lse = twin(recipe, qz, co, poly)
    got, got_lse, _ = on_cpu(recipe, qz, co, poly=poly)
    assert_bits(got, want, "out")
    assert_bits(got_lse, want_lse, "lse")
    if nk > 8 * (poly - 1):  # some key takes the polynomial
        plain, _ = twin(recipe, qz, co)
        assert not torch.equal(got, plain)


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", SHAPES[:5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_fma_stays_within_the_triton_kernels_bound(b, hq, hkv, nq, nk, d, offset, causal):
    """With the GPU's fused ``fma`` (one rounding) the exp2 argument moves by an ulp now and then:
    the same bound as the Triton kernel against the twin (test_attention_kernel.py)."""
    recipe, qz = operands(b, hq, hkv, nq, nk, d)
    co = offset_of(nq, nk, causal, offset)
    want, want_lse = twin(recipe, qz, co)
    got, got_lse, _ = on_cpu(recipe, qz, co, numerics=gluon_cpu.Numerics(fused_fma=True))
    assert_within(got, want, Bound(atol=4e-3, cos=0.999999), name="out")
    assert_within(got_lse, want_lse, Bound(atol=1e-5, rtol=1e-5), name="lse")


# The LLM variants the kernel takes (issue 44): (B, Hq, Hkv, Nq, Nk, D, window, chunk, sinks);
# causal windows (W - 1, 0) with whole blocks inside them and blocks skipped before them, a
# two-sided window, a chunk off the block grid, all three with Nq > Nk (rows that see no key),
# decode, GQA.
VARIANT_SHAPES = [
    pytest.param(1, 2, 1, 150, 523, 64, (255, 0), None, False, id="GQA2:1-Nq150-Nk523-D64-win255"),
    pytest.param(2, 4, 2, 77, 400, 128, (99, 0), None, True,
                 id="B2-GQA4:2-Nq77-Nk400-D128-win99-sinks"),
    pytest.param(1, 2, 2, 130, 300, 64, (200, 70), None, True, id="Nq130-Nk300-D64-win200:70-sinks"),
    pytest.param(1, 2, 1, 200, 333, 128, (-1, 0), 100, False, id="Nq200-Nk333-D128-chunk100"),
    pytest.param(1, 2, 1, 200, 90, 64, (30, 10), 64, True, id="Nq200-Nk90-D64-win30:10-chunk64-sinks"),
    pytest.param(1, 3, 1, 1, 700, 128, (383, 0), None, True, id="decode-Nk700-D128-win383-sinks"),
]


def variant_of(window, chunk, sinks, hq):
    """The :class:`Variant` and sink logits (seeded) of a :data:`VARIANT_SHAPES` entry."""
    variant = Variant(left=window[0], right=window[1], chunk=chunk or 0, sinks=sinks)
    logits = torch.randn(hq, generator=torch.Generator().manual_seed(hq)) * 2 if sinks else None
    return variant, logits


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,window,chunk,sinks", VARIANT_SHAPES)
@pytest.mark.parametrize("granularity,pv", CASES)
def test_windows_chunks_and_sinks_equal_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, window,
                                                             chunk, sinks, granularity, pv):
    """The window's or chunk's key blocks (``window_block_bounds``, masked at both ends) and the
    sink's epilogue term: the twin visits every key block with the variant's mask, the kernel
    only those the range holds; a block wholly masked changes nothing, so they agree exactly."""
    recipe, qz = operands(b, hq, hkv, nq, nk, d, granularity, pv)
    variant, logits = variant_of(window, chunk, sinks, hq)
    want, want_lse = twin(recipe, qz, None, variant=variant, sinks=logits)
    got, got_lse, trace = on_cpu(recipe, qz, None, variant=variant, sinks=logits)
    assert_bits(got, want, "out")
    assert_bits(got_lse, want_lse, "lse")


@pytest.mark.parametrize("k_stages", [1, 2], ids=["k1", "k2"])
def test_a_window_visits_its_key_blocks_only(k_stages):
    """Blocks before the window are neither loaded nor computed: over 10 key blocks a 64-row
    query tile with a 300-key causal window visits 3, the middle one unmasked."""
    recipe, qz = operands(1, 1, 1, 64, 1280, 64)
    variant = Variant(left=299, right=0)
    want, want_lse = twin(recipe, qz, None, variant=variant)
    got, got_lse, trace = on_cpu(recipe, qz, None, k_stages, variant=variant)
    assert_bits(got, want, "out")
    assert_bits(got_lse, want_lse, "lse")
    steps = {dict(flags)["MASKED"]: n for (name, flags), n in trace.calls.items()
             if name == "_step"}
    assert steps == {True: 2, False: 1}, steps


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,window,chunk,sinks", VARIANT_SHAPES)
@pytest.mark.parametrize("pv,atol", [("fp16", 0.05), ("fp8", 0.15)])
def test_windows_chunks_and_sinks_against_float64(b, hq, hkv, nq, nk, d, window, chunk, sinks,
                                                  pv, atol):
    """The kernel against float64 exact attention with the variant (``exact_attention``),
    within the recipes' bounds of test_llm_variants.py; rows that see no key give 0."""
    recipe, qz = operands(b, hq, hkv, nq, nk, d, "per_thread", pv)
    variant, logits = variant_of(window, chunk, sinks, hq)
    got, got_lse, _ = on_cpu(recipe, qz, None, variant=variant, sinks=logits)
    q, k, v = inputs(b, hq, hkv, nq, nk, d)
    want, want_lse = exact_attention(q, k, v, scale=d**-0.5, variant=variant, sinks=logits)
    assert (got.double() - want).abs().max() <= atol * max(1.0, want.abs().max().item())
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), seen)
    assert (got_lse.double() - want_lse)[seen].abs().max() <= 4 * atol


def test_softcap_is_refused_before_launch():
    recipe, qz = operands(1, 2, 2, 70, 70, 64)
    with pytest.raises(ValueError, match="softcap is not supported by the sm90 kernel"):
        k90.attention(qz, out=torch.empty(qz.q.shape), pv="fp8", granularity="per_thread",
                      block_q=64, block_k=128, causal_offset=None, return_lse=False,
                      variant=Variant(softcap=5.0))


def test_the_shapes_cover_the_schedule():
    """Over three of the shapes above, every branch of the schedule runs: both loops in both mask
    modes, each barrier in both phases, predicated-off loads, zero fill past the end."""
    events, calls = {}, set()
    for i in (3, 4, 5):  # decode, GQA over five key blocks, keyless tiles
        b, hq, hkv, nq, nk, d, offset = SHAPES[i].values
        for causal in (False, True):
            recipe, qz = operands(b, hq, hkv, nq, nk, d)
            *_, trace = on_cpu(recipe, qz, offset_of(nq, nk, causal, offset))
            for k, n in trace.events.items():
                events[k] = events.get(k, 0) + n
            calls |= {(name, dict(flags).get("MASKED"), dict(flags).get("IS_CAUSAL"))
                      for name, flags in trace.calls}
    for masked in (False, True):
        for causal in (False, True):
            assert ("_step", masked, causal) in calls, (masked, causal)
    assert events["wait phase 0"] and events["wait phase 1"], events
    assert events["tma skipped"] and events["tma zero-filled elements"], events


def test_every_gluon_name_the_kernel_uses_is_modelled():
    used, modeled = gluon_cpu.referenced_names(KERNEL), gluon_cpu.modeled_names()
    missing = {ns: sorted(names - modeled[ns]) for ns, names in used.items() if names - modeled[ns]}
    assert not missing, f"used by the kernel, not modelled by tools/gluon_cpu.py: {missing}"
    assert {"warpgroup_mma", "warpgroup_mma_wait"} <= used["functions"]
    assert {"wait", "expect"} <= used["mbarrier"]
    assert {"async_copy_global_to_shared", "async_load"} & used["tma"]  # the TMA load, by Triton


# (id, function, old, new, what must happen: "hang", "race", "error" (another ScheduleError),
# "wrong" numbers, or "any" of these)
MUTATIONS = [
    ("K(j+1)-never-loaded", k90._step, "more_k = j + 1 < n_blocks", "more_k = False", "hang"),
    ("K(j+1)-before-QK-retires", k90._step,
     "s_int = warpgroup_mma_wait(0, deps=[s_tok])\n    if K_STAGES == 1:",
     "if K_STAGES == 1:", "any"),
    ("V-phase-off", k90._step, "mbarrier.wait(v_bar, j & 1)", "mbarrier.wait(v_bar, 0)", "any"),
    ("V(j+1)-one-block-late", k90._step, "v_box(blk + 1, BN", "v_box(blk + 2, BN", "wrong"),
    ("P̃-not-permuted", gb.a_fragment_order, "(0, 1, 3, 2, 4)", "(0, 1, 2, 3, 4)", "wrong"),
    ("per-thread-K-group-of-the-next-block", k90._step, "ks = gl.load(ks_ptr)",
     "ks = gl.load(ks_ptr + 4)", "any"),
    ("per-thread-Q-group-r+8", KERNEL, "thread_group(rows_t, 2)", "thread_group(rows_t + 8, 2)",
     "any"),
    ("causal-limit-off-by-one", gb.softmax_block, "nk - 1) - causal_offset",
     "nk) - causal_offset", "wrong"),
    ("unmasked-loop-one-too-far", KERNEL, "range(n_lo, n_full)", "range(n_lo, n_full + 1)",
     "any"),
    ("V-descriptor-unpadded", gb.descriptors,
     "v_keys = gl.maximum(gl.cdiv(nk, 16) * 16, _V_MIN_KEYS)", "v_keys = nk", "wrong"),
    ("Q-box-at-64-rows-of-the-next-tile", KERNEL, "[pid_m * BM, 0], q_bar",
     "[pid_m * BM + BM, 0], q_bar", "wrong"),
]
MUTATION_CASES = [  # (shape, granularity, causal offset)
    ((1, 2, 1, 150, 523, 64), "per_thread", 373),
    ((2, 4, 2, 77, 200, 64), "per_thread", None),
    ((1, 2, 2, 150, 100, 128), "per_thread", 0),
]


def outcome(jit, old, new, granularity=None, **options) -> str:
    """How the check answers the mutated kernel over ``MUTATION_CASES`` (with the launcher's
    ``options``, and another ``granularity`` if given): the first failure's kind, or "passes"."""
    def each():
        for shape, case_granularity, co in MUTATION_CASES:
            recipe, qz = operands(*shape, granularity or case_granularity)
            want, want_lse = twin(recipe, qz, co, **options)
            got, got_lse, _ = on_cpu(recipe, qz, co, **options,
                                     overrides={jit.fn: mutant(jit, old, new)})
            yield [(got, want), (got_lse, want_lse)]

    return schedule_outcome(each())


@pytest.mark.parametrize("jit,old,new,expected", mutation_params(MUTATIONS))
def test_the_check_catches(jit, old, new, expected):
    assert_caught(outcome(jit, old, new), expected)


# The options' pieces, each with what it is checked under (the polynomial exp2 with one group in
# two on it; same outcomes as above)
POLY = dict(poly=2)
OPTION_MUTATIONS = [
    ("poly-on-the-even-groups", gb._mixed_exp2, "return _merge(gl.exp2(e1), o1)",
     "return _merge(o1, gl.exp2(e1))", "wrong", POLY),
    ("poly-unclamped", gb.poly_exp2, "x = max_nan(x, -127.0)", "x = x", "wrong", POLY),
    ("poly-rounding-constant-off-by-one", gb.poly_exp2, "f = x - (r - _EXP2_ROUND)",
     "f = x - (r - _EXP2_ROUND + 1.0)", "wrong", POLY),
]


@pytest.mark.parametrize("jit,old,new,expected,options", mutation_params(OPTION_MUTATIONS))
def test_the_check_catches_in_the_options(jit, old, new, expected, options):
    assert_caught(outcome(jit, old, new, **options), expected)


def test_the_unmutated_kernel_passes_the_mutation_cases():
    assert outcome(k90._step, "more_v = j + 1", "more_v = j + 1") == "passes"


@pytest.mark.parametrize("change, message", [
    (dict(block_k=64), "block_k must be 128"),
    (dict(granularity="per_block"), "granularity must be one of"),
    (dict(k_stages=3), "k_stages must be 1 or 2"),
    (dict(poly_exp2=3), "poly_exp2 must be 0 or one of"),
    (dict(poly_exp2=8, granularity="per_token"), "poly_exp2 needs granularity 'per_thread'"),
])
def test_out_of_scope_calls_are_refused_before_launch(change, message):
    recipe, qz = operands(1, 2, 2, 70, 70, 64)
    kw = dict(out=torch.empty(qz.q.shape), pv="fp8", granularity="per_thread", block_q=64,
              block_k=128, causal_offset=None, return_lse=False)
    kw.update(change)
    with pytest.raises(ValueError, match=message):
        k90.attention(qz, **kw)


def test_unpermuted_fp8_v_is_refused():
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_k=128)
    q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
    qz = quantize_qkv(q, k, v, recipe, 0.125, need_lse_shift=False, backend="reference")
    with pytest.raises(ValueError, match="permuted"):
        k90.attention(qz, out=torch.empty(q.shape), pv="fp8", granularity="per_thread",
                      block_q=64, block_k=128, causal_offset=None, return_lse=False)


@pytest.mark.parametrize("granularity,pv", CASES[:2])
def test_output_rows_past_2_31_elements(granularity, pv):
    """An output view whose rows 121 on start past 2^31 elements (an NHD output of H·D = 4096 at
    N >= 524288 tokens): its row offsets must be computed in 64 bits (the model raises
    ``gluon_cpu.Overflow`` on an int32 one), and the rows land where the view says."""
    recipe, qz = operands(1, 2, 2, 130, 130, 64, granularity, pv)
    want, want_lse = twin(recipe, qz, None)
    out = helpers.wide_rows((1, 2, 130, 64), torch.float16)
    with gluon_cpu.kernel_on_cpu(k90, "_attn_fwd_sm90_kernel"):
        lse = k90.attention(qz, out=out, pv=recipe.pv, granularity=recipe.granularity,
                            block_q=recipe.block_q, block_k=recipe.block_k, causal_offset=None,
                            return_lse=True)
    assert_bits(out.float(), want.half().float(), "out")
    assert_bits(lse, want_lse, "lse")

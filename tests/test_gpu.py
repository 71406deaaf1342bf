"""Compiled kernels on a CUDA GPU (skipped without one): what the interpreter cannot check.

The kernels against their PyTorch twins are not checked here: the interpreter tests' own parameter
lists run on the cuda target of the ``device`` fixture (tests/conftest.py, with test_gpu.py's
former tolerances in tests/helpers.py and its GPU-sized shapes as parameters marked ``gpu``), so a
GPU run exercises exactly what the CPU checks. What stays has no interpreter counterpart:

- every autotuning candidate forced alone: the interpreter has one launch configuration;
- the issue's accuracy bars at N = 4096 on the compiled kernels (INT8, FP4, trainable): the CPU
  holds the twins to them (tests/tools/test_accuracy.py, tests/training/test_trainable.py), the
  kernels at that size are far too slow for the interpreter;
- offsets past 2^31 elements: a 4 GiB buffer, and int32 wrap-around in compiled pointer arithmetic;
- CUDA graph capture (no host synchronisation) and inductor's fullgraph compile around the compiled
  kernels: CUDA machinery the interpreter does not have.
"""

from __future__ import annotations

import pytest
import torch

import lowbit_attn
from helpers import Target, channel_biased
from lowbit_attn.inference.prepare import quantize_qkv
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference.naive import exact_attention, quantized_attention

pytestmark = pytest.mark.gpu

RECIPES = ["qk_int8_pv_fp16", "qk_int8_pv_fp8"]
CUDA = Target("cuda")


def _gpu_candidates():
    from lowbit_attn.inference import kernel_int8 as attn_fwd_int8
    from lowbit_attn.core.triton_helpers import configs_for

    if not torch.cuda.is_available():
        return []
    return configs_for(attn_fwd_int8.CONFIGS, torch.cuda.get_device_capability())


CANDIDATE_CASES = [
    pytest.param(name, granularity, 128, id=f"{name}-{granularity}-D128")
    for name in RECIPES for granularity in ("per_block", "per_token")
] + [pytest.param("qk_int8_pv_fp8", "per_token", 64, id="qk_int8_pv_fp8-per_token-D64")] + [
    pytest.param(name, granularity, 256, id=f"{name}-{granularity}-D256")  # halves of a block
    for name, granularity in (("qk_int8_pv_fp8", "per_token"), ("qk_int8_pv_fp16", "per_block"))
]


@pytest.mark.parametrize("name,granularity,d", CANDIDATE_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_autotuning_candidate_matches_the_reference(name, granularity, d, causal,
                                                         monkeypatch):
    """Each candidate the autotuner may pick (plain and pipelined loops, every stage count, the
    trials that ``LOWBIT_ATTN_AUTOTUNE=all`` lets through), forced alone, against the reference on
    the same quantized operands."""
    from lowbit_attn.inference import kernel_int8 as attn_fwd_int8
    from lowbit_attn.core.triton_helpers import triton_configs

    CUDA.needs(name)
    recipe = get_recipe(name).replace(granularity=granularity)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 700, d), (2, 4, 1100, d), seed=d + 1,
                                                 dtype=torch.float16))
    offset = 400 if causal else None
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="reference")
    want, _ = quantized_attention(qz, pv=recipe.pv, granularity=granularity,
                                  block_q=recipe.block_q, block_k=recipe.block_k,
                                  causal_offset=offset)
    monkeypatch.setenv("LOWBIT_ATTN_AUTOTUNE", "all")
    tuner = attn_fwd_int8._attn_fwd_int8
    saved = tuner.configs
    try:
        for config in _gpu_candidates():
            if not attn_fwd_int8.fits(config.num_warps, d, recipe.block_k,
                                      bool(config.kwargs.get("PIPELINE")),
                                      config.kwargs.get("M_SPLIT", 1), recipe.block_q,
                                      config.num_stages):
                continue
            tuner.configs = triton_configs({"interpreter": [config]}, None)
            tuner.cache.clear()
            got = torch.empty(q.shape, device="cuda", dtype=torch.float32)
            attn_fwd_int8.attention(qz, out=got, pv=recipe.pv, granularity=granularity,
                                    block_q=recipe.block_q, block_k=recipe.block_k,
                                    causal_offset=offset, return_lse=False)
            assert lowbit_attn.errors(got, want).cosine > 0.99999, config
    finally:
        tuner.configs = saved
        tuner.cache.clear()


# --- the one-warpgroup sm_90a forward (LOWBIT_ATTN_KERNEL=sm90) -----------------------------------


def _needs_sm90():
    """Skip unless the one-warpgroup forward can run here (compute capability 9.0, a Triton whose
    Gluon it is written for); its module."""
    import importlib

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-warpgroup forward is written for sm_90a (compute capability 9.0)")
    try:
        return importlib.import_module("lowbit_attn.inference.kernel_int8_sm90")
    except RuntimeError as exc:  # triton_support.GluonUnavailable: another Triton
        pytest.skip(str(exc))


@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("granularity", ["per_thread", "per_token"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pv,k_stages", [("fp8", 1), ("fp8", 2), ("fp16", 1)],
                         ids=["fp8-k1", "fp8-k2", "fp16-k1"])
def test_sm90_forward_matches_the_reference(d, granularity, causal, pv, k_stages):
    """The one-warpgroup forward against the twin on the same quantized operands (the Triton
    pass's, E4M3 V permuted), GPU-sized: many query and key blocks, key counts off the 16-key
    groups, GQA 8:4, a causal diagonal off the block grid; within the compiled Triton kernel's
    own bounds (tests/helpers.py ON_CUDA)."""
    from helpers import ON_CUDA, Bound, assert_within

    kernel_int8_sm90 = _needs_sm90()
    recipe = get_recipe(f"qk_int8_pv_{pv}").replace(granularity=granularity, block_k=128)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 700, d), (2, 4, 1101, d), seed=d + 7,
                                                 dtype=torch.float16))
    offset = 401 if causal else None
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="triton",
                      permute_v=pv == "fp8")
    want, want_lse = quantized_attention(qz, pv=recipe.pv, granularity=granularity,
                                         block_q=recipe.block_q, block_k=128,
                                         causal_offset=offset)
    got = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.float32)
    got_lse = kernel_int8_sm90.attention(qz, out=got, pv=recipe.pv, granularity=granularity,
                                         block_q=recipe.block_q, block_k=128,
                                         causal_offset=offset, return_lse=True,
                                         k_stages=k_stages)
    out_bound = ON_CUDA[f"int8 out {pv}"].widened(Bound(atol=4e-3, cos=0.999999))
    assert_within(got, want.float(), out_bound, name="out")
    assert_within(got_lse, want_lse.float(), ON_CUDA["lse"], name="lse")


def test_sm90_forward_with_three_programs_per_sm_matches_the_reference():
    """``maxnreg=168`` (3 programs per SM at D=128, a few bytes spilled): the same values."""
    kernel_int8_sm90 = _needs_sm90()
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_k=128)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 700, 128), (2, 4, 1101, 128), seed=5,
                                                 dtype=torch.float16))
    qz = quantize_qkv(q, k, v, recipe, 128**-0.5, need_lse_shift=False, backend="triton",
                      permute_v=True)
    kw = dict(pv="fp8", granularity="per_thread", block_q=64, block_k=128, causal_offset=None,
              return_lse=False)
    want, got = (torch.empty(q.shape, device="cuda") for _ in range(2))
    kernel_int8_sm90.attention(qz, out=want, **kw)
    kernel_int8_sm90.attention(qz, out=got, maxnreg=168, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("d,granularity,causal,options", [
    (64, "per_thread", False, dict(poly_share=16)), (64, "per_thread", True, dict(poly_share=16)),
    (128, "per_thread", False, dict(poly_share=2)), (128, "per_thread", True, dict(poly_share=4)),
], ids=["D64-poly16-full", "D64-poly16-causal", "D128-poly2-full", "D128-poly4-causal"])
def test_sm90_numerical_options_match_their_twin(d, granularity, causal, options):
    """``poly_exp2``: against the twin with the same option (``quantized_attention(poly_share=)``),
    within the bounds of the plain kernel's test (four compiles: the sweep's time is short)."""
    from helpers import ON_CUDA, Bound, assert_within

    kernel_int8_sm90 = _needs_sm90()
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity=granularity, block_k=128)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 700, d), (2, 4, 1101, d), seed=d + 3,
                                                 dtype=torch.float16))
    offset = 401 if causal else None
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="triton",
                      permute_v=True)
    want, want_lse = quantized_attention(qz, pv="fp8", granularity=granularity, block_q=64,
                                         block_k=128, causal_offset=offset, **options)
    got = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.float32)
    got_lse = kernel_int8_sm90.attention(qz, out=got, pv="fp8", granularity=granularity,
                                         block_q=64, block_k=128, causal_offset=offset,
                                         return_lse=True,
                                         poly_exp2=options["poly_share"])
    out_bound = ON_CUDA["int8 out fp8"].widened(Bound(atol=4e-3, cos=0.999999))
    assert_within(got, want.float(), out_bound, name="out")
    assert_within(got_lse, want_lse.float(), ON_CUDA["lse"], name="lse")


@pytest.mark.parametrize("d,granularity,window,chunk", [
    (128, "per_thread", (511, 0), 0), (64, "per_token", (300, 90), 0), (128, "per_token", (-1, 0), 256),
], ids=["D128-thread-win511-causal", "D64-token-win300:90", "D128-token-chunk256"])
def test_sm90_windows_and_sinks_match_their_twin(d, granularity, window, chunk):
    """Issue 44: a window or chunk (key-block ranges, edges masked) with sinks (one epilogue term)
    against the twin with the same variant, within the plain kernel's bounds."""
    from helpers import ON_CUDA, Bound, assert_within
    from lowbit_attn.core.variants import Variant

    kernel_int8_sm90 = _needs_sm90()
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity=granularity, block_k=128)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 700, d), (2, 4, 1101, d), seed=d + 11,
                                                 dtype=torch.float16))
    variant = Variant(left=window[0], right=window[1], chunk=chunk, sinks=True)
    sinks = torch.randn(8, device="cuda") * 2
    qz = quantize_qkv(q, k, v, recipe, d**-0.5, need_lse_shift=True, backend="triton",
                      permute_v=True)
    want, want_lse = quantized_attention(qz, pv="fp8", granularity=granularity, block_q=64,
                                         block_k=128, causal_offset=None, variant=variant,
                                         sinks=sinks)
    got = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.float32)
    got_lse = kernel_int8_sm90.attention(qz, out=got, pv="fp8", granularity=granularity,
                                         block_q=64, block_k=128, causal_offset=None,
                                         return_lse=True, variant=variant, sinks=sinks)
    out_bound = ON_CUDA["int8 out fp8"].widened(Bound(atol=4e-3, cos=0.999999))
    assert_within(got, want.float(), out_bound, name="out")
    assert_within(got_lse, want_lse.float(), ON_CUDA["lse"], name="lse")


@pytest.mark.parametrize("granularity", ["per_thread", "per_token"])
def test_sm90_opt_in_passes_its_check_and_runs_in_the_public_call(monkeypatch, granularity):
    """``LOWBIT_ATTN_KERNEL=sm90``: the first call starts the check against the Triton kernel in
    the background; once it passes (no warning) calls run the kernel, with E4M3 V permuted,
    within the check's bounds of the default call's."""
    import warnings

    from lowbit_attn.inference import gluon_check, sm90_check

    kernel_int8_sm90 = _needs_sm90()
    monkeypatch.setattr(gluon_check, "_verdicts", {})
    ran = []
    launcher = kernel_int8_sm90.attention
    monkeypatch.setattr(kernel_int8_sm90, "attention",
                        lambda qz, **kw: ran.append(qz.v_permuted) or launcher(qz, **kw))
    recipe = get_recipe("qk_int8_pv_fp8").replace(granularity=granularity, block_k=128)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 2000, 128), (2, 4, 2000, 128), seed=3,
                                                 dtype=torch.float16))
    want = lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", "sm90")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LOWBIT_ATTN_KERNEL")
        lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True)  # starts the check
        gluon_check.wait_for_admission()
        outs = [lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=True) for _ in range(4)]
    assert sm90_check.verdict(q.device) is None
    # the check ran in a process of its own; the first two calls through the launcher, later ones
    # may replay its launches (core/plans.py)
    assert len(ran) >= 2 and all(ran)
    for got in outs:
        assert float((got.float() - want.float()).abs().max()) <= sm90_check.CHECK_ATOL
        assert lowbit_attn.errors(got, want).cosine >= sm90_check.CHECK_COSINE
        assert torch.equal(got, outs[0])


def _sm90_cases():
    from lowbit_attn.inference import sm90_check
    from lowbit_attn.inference.gluon_check import Case

    # Around the case the H200 failed on 2026-11-29 (B1 Nq96 Nk1 H4:2 D64 per_thread: outputs not
    # finite): fewer keys than one 16-key group and than one 128-key block, either scale
    # granularity, either P·V, one query block, no smoothing's shift; one window says which.
    near = [Case(1, 4, 2, 96, nk, 64, 128, causal=False, lse=False, granularity=g, pv=pv)
            for nk, g, pv in [(1, "per_token", "fp8"), (1, "per_thread", "fp16"),
                              (2, "per_thread", "fp8"), (15, "per_thread", "fp8"),
                              (16, "per_thread", "fp8"), (17, "per_thread", "fp8"),
                              (112, "per_thread", "fp8"), (113, "per_thread", "fp8"),
                              (1, "per_thread", "fp8")]]
    near.append(Case(1, 2, 2, 64, 1, 128, 128, causal=False, lse=True, granularity="per_thread"))
    return [pytest.param(c, id=f"check-{c}") for c in sm90_check.CASES] + \
        [pytest.param(c, id=f"near-{c}") for c in near]


@pytest.mark.parametrize("case", _sm90_cases())
def test_sm90_forward_each_case(case):
    """Each case of the admission check on its own, and cases near the one the H200 failed: a
    window reports every case that fails and where (the check itself stops at the first)."""
    from lowbit_attn.inference import sm90_check

    _needs_sm90()
    reason = sm90_check._compare(case, torch.device("cuda", torch.cuda.current_device()))
    assert reason is None, f"{case}: {reason}"


@pytest.mark.parametrize("nk", [1, 2, 17])
@pytest.mark.parametrize("granularity", ["per_thread", "per_token"])
def test_sm90_operands_at_few_keys_are_the_twins(nk, granularity):
    """What the sm90 forward reads at the key counts around the H200's one-key failure
    (2026-11-29), quantized on the GPU (Triton, whose launches compile a key count of 1 as a
    constant) and by the PyTorch twin on the CPU, from the same fp16 inputs: every operand finite
    (permuted V's padding too), V's E4M3 bytes and scales the twin's, Q's and K's INT8 values
    within one step and their scales within rounding (K's mean: sums in another order)."""
    from lowbit_attn.inference import gluon_check
    from lowbit_attn.inference.gluon_check import Case

    case = Case(1, 4, 2, 96, nk, 64, 128, causal=False, lse=True, granularity=granularity)
    q, k, v, _ = gluon_check.case_inputs(case, torch.device("cuda"))
    recipe = get_recipe("qk_int8_pv_fp8").replace(block_k=128, granularity=granularity)
    got, want = (quantize_qkv(*(x.to(dev) for x in (q, k, v)), recipe, 64**-0.5,
                              need_lse_shift=True, backend=backend, permute_v=True)
                 for dev, backend in (("cuda", "triton"), ("cpu", "reference")))
    for name in ("q", "q_scale", "k", "k_scale", "v", "v_scale", "lse_shift"):
        g, w = getattr(got, name).cpu(), getattr(want, name)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        bad = (~torch.isfinite(g.float())).nonzero()
        assert len(bad) == 0, f"{name}: {len(bad)} not finite, first at {bad[:8].tolist()}"
        if name == "v":
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), name
        elif g.dtype == torch.int8:
            assert int((g.int() - w.int()).abs().max()) <= 1, name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


def test_sm90_forward_admission_check_passes():
    """The admission check in this process, every case of ``sm90_check.CASES`` (issue 43's: counts
    that are multiples of 128 and of 16, one query, one key, grids of 512 programs, both head
    dims, causal and not, GQA): the kernel agrees with the Triton kernel. Its time is printed
    (``benchmarks/probes/admission_time.py`` times it as a call runs it)."""
    import time

    from lowbit_attn.inference import sm90_check

    _needs_sm90()
    t0 = time.perf_counter()
    reason = sm90_check.self_check(torch.device("cuda", torch.cuda.current_device()))
    print(f"sm90 forward admission check: {time.perf_counter() - t0:.2f} s in this process")
    assert reason is None, reason


# --- the Gluon sm_100a FP4 forward (LOWBIT_ATTN_KERNEL=gluon, FP4 recipes) ----------------------


def _needs_gluon_fp4():
    """Skip unless the Gluon FP4 forward can run here (compute capability 10.x, a Triton whose
    Gluon it is written for); its module."""
    import importlib

    if torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("the Gluon FP4 forward is written for sm_100a (compute capability 10.x)")
    try:
        return importlib.import_module("lowbit_attn.inference.kernel_fp4_gluon")
    except RuntimeError as exc:  # triton_support.GluonUnavailable: another Triton
        pytest.skip(str(exc))


@pytest.mark.parametrize("recipe", ["qk_fp4_pv_fp4", "qk_mxfp4_pv_mxfp4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("two_level", [True, False], ids=["two-level", "one-level"])
def test_gluon_fp4_forward_matches_the_reference(recipe, causal, two_level):
    """The Gluon FP4 forward against the twin on the same quantized operands (the recipes'
    defaults: ΔS, K smoothed with its LSE shift), GPU-sized: many query and key blocks, partial
    ones at both ends, GQA 8:4, a causal diagonal off the block grid; within the compiled Triton
    FP4 kernel's own bounds (tests/inference/test_fp4_attention.py's, widened by tests/helpers.py
    ON_CUDA). Run on the CPU model only before (tests/inference/test_gluon_fp4_schedule.py)."""
    from helpers import ON_CUDA, Bound, assert_within
    from lowbit_attn.inference.naive import fp4_attention
    from lowbit_attn.inference.prepare import quantize_qkv_fp4

    kernel_fp4_gluon = _needs_gluon_fp4()
    r = get_recipe(recipe).replace(two_level_p=two_level)
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 700, 128), (2, 4, 1100, 128), seed=5,
                                                 dtype=torch.float16))
    offset = 400 if causal else None
    qz = quantize_qkv_fp4(q, k, v, r, 128**-0.5, need_lse_shift=True, backend="triton")
    want, want_lse = fp4_attention(qz, head_dim=128, block_q=r.block_q, block_k=r.block_k,
                                   causal_offset=offset, two_level=two_level)
    got = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.float32)
    got_lse = kernel_fp4_gluon.attention(qz, out=got, head_dim=128, block_q=r.block_q,
                                         block_k=r.block_k, causal_offset=offset,
                                         two_level=two_level, return_lse=True)
    assert_within(got, want, ON_CUDA["fp4 out"].widened(Bound(atol=5e-3, cos=0.99999)),
                  name="out")
    assert_within(got_lse, want_lse, ON_CUDA["lse"].widened(Bound(atol=1e-5, rtol=1e-5)),
                  name="lse")


def test_gluon_fp4_opt_in_passes_its_check_and_runs_in_the_public_call(monkeypatch):
    """``LOWBIT_ATTN_KERNEL=gluon`` with an FP4 recipe: the first call starts the check of the
    Gluon FP4 forward against the Triton FP4 kernel in the background; once it passes (no
    warning) calls run it, within the check's cosine of the default call's."""
    import warnings

    from lowbit_attn.inference import gluon_check, gluon_fp4_check

    kernel_fp4_gluon = _needs_gluon_fp4()
    monkeypatch.setattr(gluon_check, "_verdicts", {})
    ran = []
    launcher = kernel_fp4_gluon.attention
    monkeypatch.setattr(kernel_fp4_gluon, "attention",
                        lambda qz, **kw: ran.append(qz.q.shape) or launcher(qz, **kw))
    q, k, v = (x.cuda() for x in channel_biased((2, 8, 2000, 128), (2, 4, 2000, 128), seed=3,
                                                 dtype=torch.float16))
    call = dict(recipe="qk_fp4_pv_fp4", is_causal=True, return_lse=True)
    want, want_lse = lowbit_attn.attention(q, k, v, **call)
    monkeypatch.setenv("LOWBIT_ATTN_KERNEL", "gluon")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LOWBIT_ATTN_KERNEL")
        lowbit_attn.attention(q, k, v, **call)  # starts the check, runs the Triton kernel
        gluon_check.wait_for_admission()
        got, got_lse = lowbit_attn.attention(q, k, v, **call)
    assert gluon_fp4_check.verdict(q.device) is None
    assert len(ran) == 1  # the check ran in a process of its own
    assert gluon_check.compare_outputs(
        got, want, got_lse, want_lse, atol=None, cosine=gluon_fp4_check.CHECK_COSINE,
        lse_atol=gluon_fp4_check.CHECK_LSE_ATOL, lse_rtol=gluon_fp4_check.CHECK_LSE_RTOL) is None


@pytest.mark.parametrize("name,cos,l1", [
    pytest.param("qk_int8_pv_fp16", 0.9999, 0.015, id="fp16-bar"),
    # E4M3 P̃·V caps this input near 0.9993 (SageAttention2's own code: 0.99930 / 0.0376)
    pytest.param("qk_int8_pv_fp8", 0.99903, 0.0453, id="fp8-at-the-measured-level"),
])
def test_issue_accuracy_bars_on_the_gpu(name, cos, l1):
    CUDA.needs(name)
    q, k, v = (x.cuda() for x in channel_biased((1, 4, 4096, 128), (1, 4, 4096, 128), seed=0,
                                                 dtype=torch.float16))
    out = lowbit_attn.attention(q, k, v, recipe=name)
    ref, _ = exact_attention(q, k, v, scale=128**-0.5)
    e = lowbit_attn.errors(out, ref)
    assert e.cosine >= cos and e.rel_l1 <= l1, e


def test_offsets_past_two_to_the_31_elements():
    """A batch stride over 2^31 elements (a view into a 4 GiB buffer): int32 offsets would wrap."""
    stride_b = 2**31 + 4096
    storage = torch.randn(stride_b + 128 * 64 + 5000, device="cuda", dtype=torch.float16)
    q = torch.as_strided(storage, (2, 1, 128, 64), (stride_b, 128 * 64, 64, 1))
    k = torch.as_strided(storage[1000:], (2, 1, 128, 64), (stride_b, 128 * 64, 64, 1))
    v = torch.as_strided(storage[5000:], (2, 1, 128, 64), (stride_b, 128 * 64, 64, 1))
    for name in RECIPES:
        if name == "qk_int8_pv_fp8" and torch.cuda.get_device_capability() < (8, 9):
            continue
        out = lowbit_attn.attention(q, k, v, recipe=name)
        ref, _ = exact_attention(q, k, v, scale=64**-0.5)
        assert lowbit_attn.errors(out[1], ref[1]).cosine > 0.999, name


def test_fp4_public_call_meets_the_channel_biased_bar():
    q, k, v = (x.cuda() for x in channel_biased((1, 2, 4096, 128), (1, 2, 4096, 128), seed=0,
                                                 dtype=torch.float16))
    want, _ = exact_attention(q, k, v, scale=128**-0.5)
    nv = lowbit_attn.errors(lowbit_attn.attention(q, k, v, recipe="qk_fp4_pv_fp4"), want)
    mx = lowbit_attn.errors(lowbit_attn.attention(q, k, v, recipe="qk_mxfp4_pv_mxfp4"), want)
    assert nv.cosine >= 0.975 and nv.cosine > mx.cosine, (nv, mx)


# --- trainable attention (SageBwd) ---------------------------------------------------------------


def test_trainable_public_call_meets_the_bars_on_the_gpu():
    from lowbit_attn.tools.inputs import FAMILIES
    from lowbit_attn.core.metrics import errors

    g = torch.Generator().manual_seed(0)
    q, k, v = (x.cuda() for x in FAMILIES["channel_bias_k"](g, 1, 4, 4, 4096, 4096, 128,
                                                             torch.bfloat16))
    do = torch.randn_like(q)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = lowbit_attn.trainable_attention(*leaves)
    got = (out, *torch.autograd.grad(out, leaves, do))
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*exact)
    want = (ref, *torch.autograd.grad(ref, exact, do.double()))
    cos = [errors(a, b).cosine for a, b in zip(got, want)]
    assert cos[0] >= 0.999 and cos[3] >= 0.995 and min(cos[1], cos[2]) >= 0.9977, cos


# --- the Gluon backward loops for Hopper (LOWBIT_ATTN_BWD_KERNEL=sm90) ----------------------------


def _needs_sm90_loops():
    """Skip unless the Gluon backward loops can run here (the forward's :func:`_needs_sm90` is
    another function: one name for both made every forward test get this one's ``None``)."""
    from lowbit_attn.core import triton_support

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward loops run on sm_90 only")
    if not triton_support.gluon_available("hopper"):
        pytest.skip(triton_support.gluon_refusal("hopper", "the Gluon backward"))


@pytest.mark.parametrize("shape, causal", [((2, 8, 4, 700, 900, 128), True),
                                           ((2, 8, 4, 700, 900, 64), False),
                                           ((1, 4, 4, 4096, 4096, 128), False)],
                         ids=["D128-causal-GQA", "D64-full-GQA", "D128-N4k"])
@pytest.mark.parametrize("granularity", ["per_tile", "per_row"])
def test_trainable_sm90_backward_matches_the_twin(monkeypatch, shape, causal, granularity):
    """The sm90 loops (Δ, dK/dV, dQ) on the GPU against the twin computed on the same operands
    (P and dS per tile and per row); the CPU model checks the same code bit for bit."""
    from lowbit_attn.core.recipes import resolve_train
    from lowbit_attn.training import kernel_bwd, kernel_bwd_sm90, naive as ref
    from lowbit_attn.training.prepare import prepare, prepare_grad
    from helpers import Bound, assert_within

    _needs_sm90_loops()
    b, hq, hkv, nq, nk, d = shape
    q, k, v = channel_biased((b, hq, nq, d), (b, hkv, nk, d), seed=6, dtype=torch.bfloat16,
                             device="cuda")
    do = torch.randn_like(q)
    r = resolve_train("sagebwd_int8").replace(backward_granularity=granularity)
    offset = nk - nq if causal else None
    ops = prepare(q, k, v, r, d ** -0.5, "triton")
    grad = prepare_grad(do, r, "triton")
    assert kernel_bwd_sm90.refusal(ops, grad, "recompute") is None
    _, lse = ref.forward(ops, causal_offset=offset)
    want = ref.backward(ops, grad, lse, causal_offset=offset, softmax_scale=d ** -0.5)
    got = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    kernel_bwd.backward(ops, grad, lse, *got, causal_offset=offset, softmax_scale=d ** -0.5,
                        mode="recompute", kernel="sm90")
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert_within(a.float(), e, Bound(rel_l2=5e-3, cos=0.99999), name=name)


def test_trainable_sm90_public_call_meets_the_bars(monkeypatch):
    from lowbit_attn.core.metrics import errors
    from lowbit_attn.tools.inputs import FAMILIES

    _needs_sm90_loops()
    monkeypatch.setenv("LOWBIT_ATTN_BWD_KERNEL", "sm90")
    g = torch.Generator().manual_seed(0)
    q, k, v = (x.cuda() for x in FAMILIES["channel_bias_k"](g, 1, 4, 4, 4096, 4096, 128,
                                                             torch.bfloat16))
    do = torch.randn_like(q)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    _admitted_after(lambda: torch.autograd.grad(
        lowbit_attn.trainable_attention(*leaves, is_causal=True), leaves, do))
    out = lowbit_attn.trainable_attention(*leaves, is_causal=True)
    got = (out, *torch.autograd.grad(out, leaves, do))
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=True)
    want = (ref, *torch.autograd.grad(ref, exact, do.double()))
    cos = [errors(a, b).cosine for a, b in zip(got, want)]
    assert cos[0] >= 0.999 and cos[3] >= 0.995 and min(cos[1], cos[2]) >= 0.9977, cos


def test_sm90_backward_admission_check_passes():
    """The backward's admission check in this process (``training/sm90_check.py``: dQ, dK, dV of
    every case against the Triton backward, the video sparse case among them); its time is
    printed."""
    import time

    from lowbit_attn.training import sm90_check

    _needs_sm90_loops()
    t0 = time.perf_counter()
    reason = sm90_check.self_check(torch.device("cuda", torch.cuda.current_device()))
    print(f"sm90 backward admission check: {time.perf_counter() - t0:.2f} s in this process")
    assert reason is None, reason


def test_sm90_backward_opt_in_passes_its_check_in_the_public_call(monkeypatch):
    """``LOWBIT_ATTN_BWD_KERNEL=sm90``: the first backward starts the check in a process of its
    own and runs the Triton backward; once it passes (no warning) backwards take the loops."""
    import warnings

    from lowbit_attn.inference import gluon_check
    from lowbit_attn.training import kernel_bwd_sm90, sm90_check

    _needs_sm90_loops()
    monkeypatch.setattr(gluon_check, "_verdicts", {})
    ran = []
    loops = kernel_bwd_sm90.backward
    monkeypatch.setattr(kernel_bwd_sm90, "backward",
                        lambda *a, **kw: ran.append(1) or loops(*a, **kw))
    monkeypatch.setenv("LOWBIT_ATTN_BWD_KERNEL", "sm90")
    q, k, v = channel_biased((1, 8, 1024, 128), (1, 4, 1024, 128), seed=9, dtype=torch.bfloat16,
                             device="cuda")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LOWBIT_ATTN_BWD_KERNEL")
        for _ in range(2):  # the check started (the Triton backward), then the loops
            out = lowbit_attn.trainable_attention(*leaves, is_causal=True)
            torch.autograd.grad(out, leaves, torch.randn_like(out))
            assert ran == [] or sm90_check.verdict(q.device) is None
            gluon_check.wait_for_admission()
    assert sm90_check.verdict(q.device) is None and ran == [1]


def _admitted_after(call):
    """``call()`` once (an opt-in kernel's first call starts its admission check), then wait for
    the verdict: what follows runs the kernel it admits."""
    from lowbit_attn.inference import gluon_check

    call()
    gluon_check.wait_for_admission()


def test_video_sparse_sm90_backward_matches_the_triton_one(monkeypatch):
    _needs_sm90_loops()
    q, k, v = (torch.randn(1, 4, 8 * 16 * 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    do = torch.randn_like(q)
    grads = []
    for kernel in ("triton", "sm90"):
        monkeypatch.setenv("LOWBIT_ATTN_BWD_KERNEL", kernel)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def call():
            out = lowbit_attn.video_sparse_attention(*leaves, video_shape=(8, 16, 16), topk=0.25)
            return torch.autograd.grad(out, leaves, do)

        if kernel == "sm90":
            _admitted_after(call)
        grads.append(call())
    from lowbit_attn.core.metrics import errors

    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert errors(a.float(), b.float()).cosine > 0.9999, name


# --- video sparse attention -------------------------------------------------------------------


# --- CUDA graphs: no host synchronisation on the GPU path -----------------------------------------


def _graph_replays_like_eager(fn, *inputs):
    """Capture ``fn(*inputs)`` in a CUDA graph (after a warm-up that fills the autotuning caches),
    replay it on new values copied into the same inputs, compare with an eager call."""
    fn(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    for x in inputs:
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(*inputs))


@pytest.mark.parametrize("recipe", ["qk_int8_pv_fp8", "qk_int8_pv_fp16"])
def test_attention_and_patched_sdpa_capture_in_cuda_graphs(recipe):
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    _graph_replays_like_eager(
        lambda a, b, c: lowbit_attn.attention(a, b, c, is_causal=True, recipe=recipe), q, k, v)
    with torch.no_grad(), lowbit_attn.patch_sdpa(recipe):
        _graph_replays_like_eager(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v)


def test_video_sparse_attention_captures_in_cuda_graphs():
    q, k, v = (torch.randn(1, 4, 8 * 16 * 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    with torch.no_grad():
        for recipe in ("exact", "qk_int8_pv_fp8"):
            _graph_replays_like_eager(
                lambda a, b, c: lowbit_attn.video_sparse_attention(
                    a, b, c, video_shape=(8, 16, 16), topk=0.25, recipe=recipe), q, k, v)


def test_public_functions_compile_fullgraph_with_inductor_on_the_gpu():
    """The custom ops under torch.compile's default backend on the GPU: forward of the inference
    functions, forward and backward of the trainable ones, no graph break (fullgraph)."""
    import torch.nn.functional as F

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 4, 8 * 8 * 8, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))

    def infer(a, b, c):
        x = lowbit_attn.attention(a, b, c, is_causal=True)
        y = lowbit_attn.video_sparse_attention(a, b, c, video_shape=(8, 8, 8), topk=0.25,
                                               recipe="qk_int8_pv_fp8")
        return x + y

    def train(a, b, c):
        x = lowbit_attn.trainable_attention(a, b, c, is_causal=True)
        y = lowbit_attn.video_sparse_attention(a, b, c, video_shape=(8, 8, 8), topk=0.25)
        return (x.float() + y.float()).square().mean()

    with torch.no_grad():
        eager = infer(q, k, v)
        compiled = torch.compile(infer, fullgraph=True)(q, k, v)
    assert lowbit_attn.errors(compiled.float(), eager.float()).cosine > 0.9999
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    grads_eager = torch.autograd.grad(train(*leaves), leaves)
    grads_compiled = torch.autograd.grad(torch.compile(train, fullgraph=True)(*leaves), leaves)
    for e, c in zip(grads_eager, grads_compiled):
        assert lowbit_attn.errors(c.float(), e.float()).cosine > 0.9999
    with torch.no_grad(), lowbit_attn.patch_sdpa("qk_int8_pv_fp8"):
        f = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
        assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))

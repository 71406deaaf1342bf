"""The Gluon backward for Hopper (``training/kernel_bwd_sm90.py``: the Δ pass, the dK/dV loop
and the dQ loop) executed on the CPU by ``lowbit_attn.tools.gluon_cpu``: the kernels' own code,
launched by their own launchers through ``kernel_bwd.backward(kernel="sm90")``, with shared
memory, TMA, mbarriers and wgmma modelled sequentially, against the twin
``training.naive.backward`` (``backward_granularity="per_row"``) bit for bit.

Both sides take fp32 products and row sums in float64 rounded once (``canonical_reductions``),
the model's ``fma`` rounds twice as the twin's ``s·c - lse`` does; everything else (the per-row
INT8 quantization of P and dS in the A fragments' order, the permuted token-major B operands,
each product's int32 tile times its scales, the masks, GQA, the balancing, the epilogues) is
compared exactly. ``test_the_check_catches`` breaks the kernels' source in known ways and
expects each break to be caught."""

from __future__ import annotations

import pytest
import torch

from helpers import (assert_bits, assert_caught, mutant, mutation_params, one_torch_thread,
                     schedule_outcome)
from helpers import causal_offset_of as offset_of
import helpers
helpers.require_gluon("hopper", "cpu_model")  # before importing Gluon code

from lowbit_attn.core.options import DQ_MODES
from lowbit_attn.core.recipes import resolve_train
from lowbit_attn.training import kernel_bwd, kernel_bwd_sm90 as k90, naive as ref
from lowbit_attn.training.prepare import prepare, prepare_grad
from lowbit_attn.tools import gluon_cpu

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

KERNELS = ("_dkdv_sm90_kernel", "_dq_sm90_kernel")

# helpers.SM90_SHAPES (partial tiles, GQA, MQA, offsets at and past the diagonal; one key block
# and several) with, between them, enough tiles to reuse each stage and rows that see no key.
SHAPES = [
    *helpers.SM90_SHAPES[:3],
    pytest.param(1, 2, 1, 150, 300, 128, None, id="B1-GQA2:1-Nq150-Nk300-D128"),
    pytest.param(1, 1, 1, 200, 40, 64, None, id="B1-Nq200-Nk40-D64-keyless-rows"),
    *helpers.SM90_SHAPES[3:],
]


def operands(b, hq, hkv, nq, nk, d, *, causal_offset=None, balance=False,
             dtype=torch.bfloat16, granularity="per_row", negative=False):
    """``(ops, grad, lse, scale)`` for a SageBwd backward with P and dS per ``granularity``,
    prepared by the twin; ``negative``: scores below 0 (Q against K's channel bias, K not
    smoothed), so that a key past the end (its score 0) would have the tile's largest P."""
    g = torch.Generator().manual_seed(nq + 7 * nk + d)
    bias = 3 * torch.randn(b, hkv, 1, d, generator=g)
    q = torch.randn(b, hq, nq, d, generator=g)
    if negative:
        q = q - bias.repeat_interleave(hq // hkv, 1)
    q = q.to(dtype)
    k = (torch.randn(b, hkv, nk, d, generator=g) + bias).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    do = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    recipe = resolve_train("sagebwd_int8", balance_qk=balance, smooth_k=not negative).replace(
        backward_granularity=granularity)
    scale = d ** -0.5
    ops = prepare(q, k, v, recipe, scale, "reference")
    grad = prepare_grad(do, recipe, "reference")
    _, lse = ref.forward(ops, causal_offset=causal_offset)
    return ops, grad, lse, scale


def twin(ops, grad, lse, scale, causal_offset):
    with gluon_cpu.canonical_reductions():
        return ref.backward(ops, grad, lse, causal_offset=causal_offset, softmax_scale=scale)


def on_cpu(ops, grad, lse, scale, causal_offset, overrides=None, empty=torch.empty):
    """``kernel_bwd.backward(kernel="sm90")`` with both kernels run by the model:
    ``(dq, dk, dv), traces``; ``empty(shape)`` allocates the gradients."""
    b, hq, nq, d = ops.q.shape
    hkv, nk = ops.k.shape[1], ops.k.shape[2]
    got = (empty((b, hq, nq, d)), empty((b, hkv, nk, d)), empty((b, hkv, nk, d)))
    with gluon_cpu.kernel_on_cpu(k90, KERNELS[0], overrides=overrides) as dkdv, \
            gluon_cpu.kernel_on_cpu(k90, KERNELS[1], overrides=overrides) as dq:
        kernel_bwd.backward(ops, grad, lse, *got, causal_offset=causal_offset,
                            softmax_scale=scale, mode="recompute", kernel="sm90")
    return got, (dkdv.trace, dq.trace)


def check_bits(shape, causal_offset, **kw):
    ops, grad, lse, scale = operands(*shape, causal_offset=causal_offset, **kw)
    want = twin(ops, grad, lse, scale, causal_offset)
    got, _ = on_cpu(ops, grad, lse, scale, causal_offset)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_bits(g, w, name)


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,offset", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("granularity", ["per_row", "per_tile"])
def test_backward_equals_the_twin_bit_for_bit(b, hq, hkv, nq, nk, d, offset, causal,
                                              granularity):
    check_bits((b, hq, hkv, nq, nk, d), offset_of(nq, nk, causal, offset),
               granularity=granularity)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_balancing_and_both_dtypes(dtype):
    check_bits((1, 4, 2, 70, 90, 64), 20, balance=True, dtype=dtype)


def test_the_shapes_cover_the_schedule():
    """Over three of the shapes, every branch of both loops runs: masked and unmasked tiles,
    each load barrier in both phases, predicated-off loads, zero fill past the end."""
    events, calls = {}, set()
    for i in (1, 3, 6):
        b, hq, hkv, nq, nk, d, offset = SHAPES[i].values
        for causal in (False, True):
            co = offset_of(nq, nk, causal, offset)
            _, traces = on_cpu(*operands(b, hq, hkv, nq, nk, d, causal_offset=co), co)
            for trace in traces:
                for k, n in trace.events.items():
                    events[k] = events.get(k, 0) + n
                calls |= {(name, dict(flags).get("MASKED"), dict(flags).get("DELTA_PASS"))
                          for name, flags in trace.calls}
    for step in ("_dkdv_step", "_dq_step"):
        for masked in (False, True):
            assert any(c[0] == step and c[1] == masked for c in calls), (step, masked)
    assert ("_dq_step", False, True) in calls and ("_dq_step", False, False) in calls
    assert events["wait phase 0"] and events["wait phase 1"], events
    assert events["tma skipped"] and events["tma zero-filled elements"], events


def test_every_gluon_name_the_kernels_use_is_modelled():
    modeled = gluon_cpu.modeled_names()
    for name in KERNELS:
        used = gluon_cpu.referenced_names(getattr(k90, name))
        missing = {ns: sorted(n - modeled[ns]) for ns, n in used.items() if n - modeled[ns]}
        assert not missing, f"{name} uses, tools/gluon_cpu.py does not model: {missing}"


# (id, function, old, new, what must happen: "hang", "race", "error" (another ScheduleError),
# "wrong" numbers, or "any" of these)
MUTATIONS = [
    ("next-query-tile-never-loaded", k90._dkdv_step, "_load_tile(nxt, more,",
     "_load_tile(nxt, False,", "hang"),
    ("tile-phase-off", k90._scores_and_dp, "(i >> 1) & 1)", "0)", "any"),
    ("prefetch-into-the-stage-in-use", k90._dkdv_step, "_load_tile(nxt, more, 1 - stage",
     "_load_tile(nxt, more, stage", "race"),
    ("P-not-permuted", k90.a_fragment_order, "(0, 1, 3, 2, 4)", "(0, 1, 2, 3, 4)", "wrong"),
    ("per-row-amax-drops-NaN-and-sign", k90.quantize_rows, "gl.reduce(gl.abs(x), 1, max_nan)",
     "gl.max(x, 1)", "any"),
    ("dV-scale-of-dK", k90._dkdv_step, "ps * gl.load(scales + 1)", "ps * gl.load(scales + 2)",
     "wrong"),
    ("causal-diagonal-off-by-one", k90._dkdv_step, "<= gl.expand_dims(queries, 0) + shift",
     "< gl.expand_dims(queries, 0) + shift", "wrong"),
    ("first-unmasked-tile-one-early", k90._dkdv_sm90_kernel,
     "gl.cdiv(gl.maximum(last_key - causal_offset, 0), _BQ)",
     "gl.maximum(last_key - causal_offset, 0) // _BQ", "wrong"),
    ("dQ-keys-past-the-end-seen", k90._dq_step, "seen = gl.expand_dims(keys < nk, 0)\n"
     "            if IS_CAUSAL", "seen = gl.expand_dims(keys >= 0, 0)\n            if IS_CAUSAL",
     "wrong"),
    ("dQ-key-scale-of-the-next-tile", k90._dq_step, "gl.load(KDQS + kt * sksn)",
     "gl.load(KDQS + (kt + 1) * sksn)", "any"),
    ("delta-not-written", k90._dq_sm90_kernel, "* sdn, delta_acc, mask=valid",
     "* sdn, delta_acc * 0.0, mask=valid", "wrong"),
    ("parked-channels-not-stored-back", k90._dkdv_step, "            more_k.store(",
     "            more_k.load(", "any"),
    ("per-tile-keys-past-the-end-seen", k90._dkdv_step, "layout=c_rows.type.layout) < n_keys",
     "layout=c_rows.type.layout) >= 0", "any"),
    ("per-tile-dQ-rows-past-the-end-seen", k90._dq_sm90_kernel,
     'mask=valid, other=float("inf"))', "mask=valid, other=0.0)", "wrong"),
]
MUTATION_CASES = [  # (shape, causal offset, options)
    ((1, 2, 1, 150, 300, 128), 150, {}),
    ((2, 4, 2, 77, 200, 64), None, {}),
    ((1, 2, 1, 150, 300, 64), None, dict(granularity="per_tile", negative=True)),
]


def outcome(jit, old, new) -> str:
    """How the check answers the mutated kernel over ``MUTATION_CASES``: the first failure's
    kind, or "passes"."""
    def each():
        for shape, co, kw in MUTATION_CASES:
            ops, grad, lse, scale = operands(*shape, causal_offset=co, **kw)
            want = twin(ops, grad, lse, scale, co)
            got, _ = on_cpu(ops, grad, lse, scale, co, overrides={jit.fn: mutant(jit, old, new)})
            yield list(zip(got, want))

    return schedule_outcome(each())


@pytest.mark.parametrize("jit,old,new,expected", mutation_params(MUTATIONS))
def test_the_check_catches(jit, old, new, expected):
    assert_caught(outcome(jit, old, new), expected)


def test_the_unmutated_kernels_pass_the_mutation_cases():
    assert outcome(k90._dq_step, "stage = j & 1", "stage = j & 1") == "passes"


@pytest.mark.parametrize("change, reason", [
    (dict(mode="atomic"), "dQ by 'atomic'"),
    (dict(int8=("dp",)), "INT8 matmuls"),
    (dict(smooth_q=True), "Q smoothing"),
    (dict(d=32), "head dim 32"),
    (dict(n=0), "no queries"),
])
def test_what_the_kernels_do_not_cover_goes_to_the_triton_ones(change, reason):
    recipe = resolve_train("sagebwd_int8", smooth_q=change.get("smooth_q")).replace(
        backward_granularity=change.get("granularity", "per_row"))
    if "int8" in change:
        recipe = recipe.replace(int8=recipe.int8 | set(change["int8"]))
    d = change.get("d", 64)
    x = torch.randn(1, 2, change.get("n", 70), d).to(torch.float16)
    ops = prepare(x, x, x, recipe, d ** -0.5, "reference")
    grad = prepare_grad(x, recipe, "reference")
    assert reason in k90.refusal(ops, grad, change.get("mode", DQ_MODES[0]))


def test_permuted_token_major_is_v_key_order_per_group_of_16():
    from lowbit_attn.core.operands import V_KEY_ORDER

    x = torch.arange(2 * 37 * 3, dtype=torch.int32).view(1, 2, 37, 3)
    t = k90.permuted_token_major(x)
    assert t.shape == (1, 2, 3, 48) and t.is_contiguous()
    for pos in range(48):
        token = pos // 16 * 16 + V_KEY_ORDER[pos % 16]
        want = x[0, :, token] if token < 37 else torch.zeros(2, 3, dtype=torch.int32)
        assert torch.equal(t[0, :, :, pos], want), pos


def test_gradient_rows_past_2_31_elements():
    """dQ, dK and dV views whose rows 121 on start past 2^31 elements (``helpers.wide_rows``):
    their row offsets must be computed in 64 bits (the model raises ``gluon_cpu.Overflow`` on an
    int32 one), and the rows land where the views say."""
    ops, grad, lse, scale = operands(1, 2, 2, 130, 130, 64)
    want = twin(ops, grad, lse, scale, None)
    got, _ = on_cpu(ops, grad, lse, scale, None,
                    empty=lambda shape: helpers.wide_rows(shape, torch.float16))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_bits(g.float(), w.half().float(), name)

"""P and dS quantized per row of each backward product's output (``TrainRecipe.
backward_granularity="per_row"``): the twin's scales on hand-built tiles, the Triton helper
against the twin bit for bit (interpreted), and the kernels against the twin."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import assert_bits, channel_biased
from lowbit_attn.core.operands import TILE_AMAX_FLOOR
from lowbit_attn.core.recipes import resolve_train
from lowbit_attn.core.triton_helpers import quantize_tile
from lowbit_attn.training import naive as ref

T = 64


def _tile(rows):
    """A 64×64 tile whose first rows are ``rows`` (lists, padded with zeros)."""
    x = torch.zeros(T, T)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return x


def test_per_row_scales_are_each_rows_own():
    """A row's amax over the contracted dimension, 1/127 of it; halves go to even (exact
    product); zero rows take the floor; NaN poisons its row's scale only, Inf gives Inf."""
    x = _tile([[127.0, 2.5, -2.5, 3.5, 0.5], [1.0, -0.25], [], [float("nan"), 1.0],
               [float("inf"), 3.0]])
    values, scales = ref.quantize_tiles(x.T.clone(), True, torch.float16, "per_row", "query")
    # contract over queries: the output's rows are keys, the columns of x.T
    assert scales.shape == (1, T)
    assert scales[0, 0] == 1.0 and torch.equal(values[:5, 0], torch.tensor([127.0, 2, -2, 4, 0]))
    assert scales[0, 1] == torch.tensor(1.0) * (1 / 127)
    assert torch.equal(values[:2, 1], torch.tensor([127.0, -32]))  # -0.25·127 = -31.75
    assert scales[0, 2] == TILE_AMAX_FLOOR * (1 / 127) and not values[:, 2].any()
    assert scales[0, 3].isnan() and scales[0, 4].isinf() and not values[:, 3:5].any()
    assert torch.equal(scales[0, 5:], torch.full((T - 5,), TILE_AMAX_FLOOR * (1 / 127)))
    by_query, s = ref.quantize_tiles(x, True, torch.float16, "per_row", "key")
    assert s.shape == (T, 1) and torch.equal(by_query, values.T)
    assert_bits(s[:, 0], scales[0], "scales")


def test_per_tile_is_one_scale_for_every_row():
    x = torch.randn(100, 70)
    values, scales = ref.quantize_tiles(x, True, torch.float16, "per_tile", "query")
    assert scales.shape == (2, 70)
    for qb, kb in ((0, 0), (0, 1), (1, 0), (1, 1)):
        tile = scales[qb, kb * T: (kb + 1) * T]
        assert torch.all(tile == tile[0])
        want = x[qb * T:(qb + 1) * T, kb * T:(kb + 1) * T].abs().max() * (1 / 127)
        assert tile[0] == want


@triton.jit
def _quantize_kernel(X, V, S, PER_ROW: tl.constexpr, AXIS: tl.constexpr):
    offs = tl.arange(0, 64)
    x = tl.load(X + offs[:, None] * 64 + offs[None, :])
    v, s = quantize_tile(x, True, V, PER_ROW=PER_ROW, AXIS=AXIS)
    tl.store(V + offs[:, None] * 64 + offs[None, :], v)
    tl.store(S + offs[:, None] + offs[None, :] * 0, s + tl.zeros([64, 64], tl.float32),
             mask=offs[None, :] == 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("axis", [0, 1], ids=["by-key", "by-query"])
def test_the_triton_helper_equals_the_twin(axis):
    """``core.triton_helpers.quantize_tile(PER_ROW=True)`` against the twin, bit for bit, on
    hand-built ties and on random rows of many magnitudes, halves of the step included (the
    interpreter's ``fma`` rounds the product before adding: these rows' steps are powers of two,
    so that the products are exact, as a GPU's fused one always is)."""
    g = torch.Generator().manual_seed(0)
    step = torch.exp2(torch.randint(-20, 20, (T, 1), generator=g).float())
    x = torch.randint(-254, 255, (T, T), generator=g) / 2 * step
    x[:, 7] = 127 * step[:, 0]
    x[:3] = _tile([[127.0, 2.5, -2.5, 3.5, -0.5], [], [float("nan"), 1.0]])[:3]
    x = x if axis == 1 else x.T.contiguous()
    values, scales = torch.empty(T, T, dtype=torch.int8), torch.empty(T)
    _quantize_kernel[(1,)](x, values, scales, PER_ROW=True, AXIS=axis)
    want_v, want_s = ref.quantize_tiles(x if axis == 1 else x.T, True, torch.float16, "per_row",
                                        "key")
    want_v = want_v if axis == 1 else want_v.T
    assert_bits(values.float(), want_v, "values")
    assert_bits(scales, want_s[:, 0], "scales")


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["recompute", "atomic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_kernels_match_the_twin(triton_backend, mode, causal):
    from lowbit_attn.training import kernel_bwd
    from lowbit_attn.training.prepare import prepare, prepare_grad
    from lowbit_attn.core.metrics import errors

    q, k, v = channel_biased((1, 4, 100, 64), (1, 2, 90, 64), seed=3, dtype=torch.float16)
    do = torch.randn(q.shape).to(torch.float16)
    r = resolve_train("sagebwd_int8").replace(backward_granularity="per_row")
    ops = prepare(q, k, v, r, 0.125, "reference")
    grad = prepare_grad(do, r, "reference")
    offset = -10 if causal else None
    _, lse = ref.forward(ops, causal_offset=offset)
    want = ref.backward(ops, grad, lse, causal_offset=offset, softmax_scale=0.125)
    got = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    kernel_bwd.backward(ops, grad, lse, *got, causal_offset=offset, softmax_scale=0.125, mode=mode)
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert errors(a.float(), e).cosine > 0.999999, name
        assert float((a.float() - e).abs().max()) <= 2e-3 * float(e.abs().max()), name

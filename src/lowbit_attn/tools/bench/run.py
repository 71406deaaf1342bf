"""The run: every method on every configuration, checked and timed, into a results dict."""

from __future__ import annotations

import sys
import time
import traceback
from typing import Callable, Iterable

import torch

from lowbit_attn.tools.bench.calls import Unsupported, first_line
from lowbit_attn.tools.bench.measure import measure_method, new_row
from lowbit_attn.tools.bench.metadata import make_metadata
from lowbit_attn.tools.bench.protocol import (
    BATCH, DIMS, DTYPES, HEADS, K_BIAS, MIN_COSINE, SEQLENS, Method, make_inputs, select_methods,
)
from lowbit_attn.tools.bench.timers import cpu_timer, cuda_timer, free_memory


def run_benchmark(
    *,
    dims: Iterable[int] = DIMS,
    seqlens: Iterable[int] = SEQLENS,
    causal_values: Iterable[bool] = (False, True),
    batch: int = BATCH,
    heads: int = HEADS,
    methods: list[Method] | None = None,
    device: str | None = None,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    cpu_reps: int = 5,
    min_cosine: float = MIN_COSINE,
    seed: int = 0,
    time_budget_s: float | None = None,
    mode: str | None = None,
    on_config_done: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> dict:
    """Check and time every method on every configuration; returns the results dict.

    On CUDA the timer is ``triton.testing.do_bench(return_mode="median")``; on a CPU a median of
    ``cpu_reps`` wall-clock calls. ``time_budget_s`` stops starting new measurements once spent (the
    rest are recorded as skipped); ``on_config_done`` receives the partial results after each
    configuration (used to save them as the run goes).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    dims, seqlens, causal_values = list(dims), list(seqlens), list(causal_values)
    methods = list(methods) if methods is not None else select_methods()
    timer = cuda_timer(warmup_ms, rep_ms) if cuda else cpu_timer(cpu_reps)
    protocol = {
        "B": batch, "H": heads, "dims": dims, "seqlens": seqlens, "causal": causal_values,
        "layout": "HND",
        "timer": (f"triton.testing.do_bench(fn, warmup={warmup_ms}, rep={rep_ms}, "
                  "return_mode='median')" if cuda else f"median of {cpu_reps} wall-clock calls"),
        "tops": "4*B*H*N^2*D / t, halved when causal",
        "timed": "the public call lowbit_attn.attention(q, k, v, is_causal=..., recipe=...) end "
                 "to end, quantization included (stage rows: quantize_qkv alone, attention "
                 "kernel alone)",
        "inputs": f"q, k, v ~ N(0,1) HND, k += {K_BIAS}*N(0,1) per (batch, head, channel), "
                  f"seed {seed}",
        "check": f"cosine similarity vs the reference on the same inputs >= {min_cosine}, "
                 "no NaN/Inf",
        "methods": [m.__dict__ for m in methods],
    }
    results = {
        "metadata": make_metadata(device=device, mode=mode or ("gpu" if cuda else "cpu"),
                                  protocol=protocol),
        "rows": [],
        "complete": False,
    }
    configs = [(d, causal, n) for d in dims for causal in causal_values for n in seqlens]
    start = time.monotonic()
    bar = _progress(len(configs) * len(methods), progress)
    try:
        for d, causal, n in configs:
            rows = [new_row(m, batch, heads, n, d, causal) for m in methods]
            _run_config(rows, methods, batch, heads, n, d, causal, device=device, seed=seed,
                        timer=timer, min_cosine=min_cosine, start=start,
                        time_budget_s=time_budget_s, bar=bar)
            results["rows"].extend(rows)
            if on_config_done is not None:
                on_config_done(results)
    finally:
        if bar is not None:
            bar.close()
    results["complete"] = True
    results["metadata"]["elapsed_s"] = round(time.monotonic() - start, 1)
    return results


def _run_config(rows, methods, batch, heads, n, d, causal, *, device, seed, timer, min_cosine,
                start, time_budget_s, bar):
    cuda = device == "cuda"
    cache: dict[str, tuple] = {}
    refs: dict[str, tuple] = {}

    def inputs(dtype: str):
        if dtype not in cache:
            if "fp16" not in cache:
                cache["fp16"] = make_inputs(batch, heads, n, d, device=device, seed=seed)
            if dtype != "fp16":
                cache[dtype] = tuple(x.to(DTYPES[dtype]) for x in cache["fp16"])
        return cache[dtype]

    for method, row in zip(methods, rows):
        if bar is not None:
            bar.set_description(f"D={d} N={n} {'causal' if causal else 'full'} {method.key}")
        if time_budget_s is not None and time.monotonic() - start >= time_budget_s:
            row.update(status="skipped", reason=f"time budget of {time_budget_s:.0f} s spent")
        else:
            try:
                measure_method(method, inputs, refs, row, timer=timer, min_cosine=min_cosine,
                               causal=causal)
            except torch.cuda.OutOfMemoryError as exc:
                row.update(status="oom", reason=first_line(exc))
            except Unsupported as exc:
                row.update(status="unsupported", reason=str(exc))
            except Exception as exc:  # recorded in the row; one failing method must not end the run
                row.update(status="error", reason=first_line(exc),
                           detail=traceback.format_exc(limit=6)[-2000:])
            finally:
                free_memory(cuda)
        if bar is not None:
            bar.update(1)
        else:
            _log_row(row)
    cache.clear()
    refs.clear()
    free_memory(cuda)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=False)


def _log_row(row: dict) -> None:
    what = f"D={row['D']} N={row['N']} causal={row['causal']} {row['method']}"
    if row["status"] == "ok":
        extra = f"{row['time_ms']:.3f} ms"
        if row["tops"] is not None:
            extra += f", {row['tops']:.0f} TOP/s"
        if row["cosine"] is not None:
            extra += f", cos {row['cosine']:.6f} {row['check']}"
    else:
        extra = f"{row['status']}: {row['reason']}"
    print(f"  {what}: {extra}", file=sys.stderr, flush=True)

#!/usr/bin/env python
"""Decode benchmark: one generation step (one query token per sequence) against the 8-bit paged KV
cache (``lowbit_attn.attention_with_kv_cache``, split-KV kernel) and against SDPA on an fp16 cache
of the same tokens, with the bytes each reads and the floor at the card's measured copy bandwidth
(benchmarks/NOTES.md §13).

    python benchmarks/bench_decode.py                      # a GPU: N = 1k..128k, batch 1 and 16
    python benchmarks/bench_decode.py --seqlens 1k,8k --batches 1 --out DIR
    python benchmarks/bench_decode.py --host               # host µs per eager call (any machine)

Per configuration (D = 128, Hkv = 8 KV heads, GQA 4:1 and 8:1, 64-token pages, fp16): the cache
is filled once (not timed), then each method's step is timed: ``ms`` by ``do_bench`` (the GPU's
time: up to ~90 µs of host time hides under its L2 flush), ``host µs`` the time to enqueue one
call, ``loop ms`` the wall time per call of 100 back-to-back calls (a decode loop without CUDA
graphs: the larger of host and GPU); ``cosine`` compares each output with exact attention in
float64 on the same fp16 tokens. Two more rows per configuration time a whole decode step by the
loop: ``sdpa_fp16+write`` (the new token written into a preallocated fp16 cache, then SDPA) and
``kv_int8_fp8+append`` (the new token appended to the 8-bit cache, then our attention); on a
GPU, the same two replayed by CUDA graphs (``… (graph)``: ``lowbit_attn.DecodeStep`` for ours).
Our rows launch through Triton's own path (``LOWBIT_ATTN_LAUNCH=triton``), and on a GPU again
with launch plans, the default (``kv_int8_fp8 plan``, ``kv_int8_fp8+append plan``: each launch
replayed by its launch plan; ``plan_replayed`` says whether the plan was replayed, not turned
off by its first-use check). Without CUDA it times the PyTorch reference on a tiny size and says so.

With ``--window W`` (issue 44: "decode with a 4096 window at N = 32k costs what N = 4096 costs
within 20 %"), each configuration with N > W + 1 adds two rows: ``kv_int8_fp8 window W``, one
query against a sliding-window layer (``QuantizedKVCache(window=W)``) that was given all N tokens
in appends of at most ``WINDOW_APPEND`` (and W) tokens, so it holds its window and what one
append brings, and
``kv_int8_fp8 last W+1``, a full layer given only the W + 1 tokens the window sees: the cost the
window should have. Both are checked against exact attention over those W + 1 tokens.

With ``--splits P,...`` (issue 43: how the decode kernel splits a sequence, measured per
architecture), each configuration times only SDPA fp16 and the launcher
(``kvcache.kernel_decode.attention``: the split and merge launches) with ``P`` pages per split
(``kv_int8_fp8 split P``; ``production`` marks the current default's) and, with ``--parts
S,...``, with each sequence's pages in ``S`` splits (``kv_int8_fp8 parts S``), saved as
``splits-*``. The split that wins every row becomes the architecture's entry in
``core/measured.py`` ``DECODE_SPLITS``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import lowbit_attn
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import lowbit_attn
from lowbit_attn.core.metrics import cosine_similarity
from lowbit_attn.tools.bench.calls import environment
from lowbit_attn.tools.bench.command import parse_seqlens
from lowbit_attn.tools.bench.metadata import make_metadata
from lowbit_attn.tools.bench.save import save_script_results
from lowbit_attn.tools.bench.tables import seqlen_label, status_table
from lowbit_attn.tools.bench.timers import loop_timings, timer_for

COPY_BANDWIDTH = 3.0e12  # bytes/s, the measured H100 copy bandwidth (NOTES §1): the CPU's stand-in


def copy_bandwidth(timer) -> float:
    """Bytes per second of a 1 GiB device-to-device copy on this GPU (read and write counted):
    the floor's bandwidth, the card's own (an H200 copies at ~4.3 TB/s, an H100 at ~3.0)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)
KV_HEADS, HEAD_DIM, PAGE = 8, 128, 64
WINDOW_APPEND = 4096  # most tokens per append to a sliding-window layer (they size its pool)
STEP_CALLS = 100  # calls of a whole step's loop


def fp16_bytes(batch: int, n: int, kv_heads: int, d: int) -> int:
    """What an fp16 decode step reads: K and V, 2 bytes each."""
    return 2 * batch * n * kv_heads * d * 2


def cache_bytes(batch: int, n: int, kv_heads: int, d: int, page: int) -> int:
    """What a step reads from the 8-bit cache: K INT8 and V E4M3 of the full pages and their
    scales (K per token, V per channel and page), the open page's V in fp16 and its K."""
    full = n // page * page
    per_head = (n * d + full * d + 4 * n + (n // page) * d * 4 + (n - full) * d * 2)
    return batch * kv_heads * per_head


def exact(q, k, v) -> torch.Tensor:
    """Exact attention of one query token per sequence, float64, GQA by repeating K/V heads."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    s = q.double() @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", help="default 1k,8k,32k,128k (--host: 8k)")
    ap.add_argument("--batches", help="default 1,16 (--host: 16)")
    ap.add_argument("--groups", help="query heads per KV head, default 4,8 (--host: 4)")
    ap.add_argument("--out", action="append", default=[])
    ap.add_argument("--window", type=int,
                    help="also time a sliding-window layer of this many tokens against a full "
                         "layer of the tokens it sees (module docstring; 64 without CUDA)")
    ap.add_argument("--splits", help="pages per split to time, e.g. 1,2,4,8,16 (module "
                                     "docstring): only these rows and SDPA's")
    ap.add_argument("--parts", help="with --splits: also each sequence in this many splits, "
                                    "e.g. 32,64,128")
    ap.add_argument("--host", action="store_true",
                    help="only the host path: µs per eager decode call and one-token append "
                         "(N = 8k, batch 16, GQA 4:1 unless given; without a GPU, through "
                         "Triton's launch path with the launches stubbed)")
    ap.add_argument("--host-arch", default="sm_90", help="--host without a GPU: the architecture")
    ap.add_argument("--host-profile", action="store_true",
                    help="--host: also print the functions that take the host time")
    args = ap.parse_args(argv)
    defaults = ("8k", "16", "4") if args.host else ("1k,8k,32k,128k", "1,16", "4,8")
    seqlens = parse_seqlens(args.seqlens or defaults[0])
    batches = [int(b) for b in (args.batches or defaults[1]).split(",")]
    groups = [int(g) for g in (args.groups or defaults[2]).split(",")]
    if args.host:
        return host_main(args, seqlens, batches, groups)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    kv_heads, d, page = KV_HEADS, HEAD_DIM, PAGE
    if not cuda:
        print("NO CUDA: timing the PyTorch reference at N=200, batch 2, 2 KV heads, D=64 (not a "
              "kernel benchmark)", file=sys.stderr)
        seqlens, batches, groups, kv_heads, d, page = [200], [2], [2], 2, 64, 16
        window = None if args.window is None else 64
    else:
        window = args.window
    timer = timer_for(cuda)
    bandwidth = copy_bandwidth(timer) if cuda else COPY_BANDWIDTH
    print(f"floor: the copy bandwidth, {bandwidth / 1e12:.2f} TB/s"
          f"{' (measured)' if cuda else ' (the H100s, not measured here)'}", file=sys.stderr)
    splits = None
    if args.splits:  # (pages per split, parts) candidates
        splits = [(int(p), 0) for p in args.splits.split(",")]
        splits += [(1, int(p)) for p in (args.parts or "").split(",") if p]
    kind = "decode" if splits is None else "splits"
    meta = make_metadata(device=device, mode=kind,
                         protocol={"kv_heads": kv_heads, "d": d, "page": page,
                                   "bandwidth_floor": bandwidth})
    rows = []

    def save(more=()):  # after every row: a run cut short keeps what it measured
        table = render([*rows, *more])
        save_script_results(args.out, kind, {**meta, "rows": [*rows, *more]}, table)
        return table

    for batch in batches:  # the bars' batch (1) first
        for n in seqlens:
            for group in groups:
                config_rows = []
                try:
                    configuration(n, batch, group, kv_heads, d, page, device, timer, bandwidth,
                                  window, rows=config_rows, on_row=save, splits=splits)
                except Exception as exc:  # noqa: BLE001 - the next configurations still run
                    config_rows.append({"N": n, "batch": batch, "gqa": f"{group}:1",
                                        "method": "*", "status": "error outside a row: "
                                        f"{type(exc).__name__}: {exc}"[:300]})
                rows += config_rows
                table = save()
    print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


HOST_BARS = (30.0, 20.0)  # host µs of an eager read and of an eager one-token append (issue 29)


def host_main(args, seqlens, batches, groups) -> int:
    """``--host``: ``decode_host_us=`` and ``append_host_us=`` per configuration, against the
    bars."""
    from lowbit_attn.tools.bench import host

    configs = [dict(n=n, batch=b, kv_heads=KV_HEADS, group=g, d=HEAD_DIM, page=PAGE)
               for n in seqlens for b in batches for g in groups]
    rows = host.measure_decode(configs, arch=args.host_arch, profile=args.host_profile)
    print(host.render_decode(rows))
    for r in rows:
        ok = r["decode"]["host_us"] <= HOST_BARS[0] and r["append"]["host_us"] <= HOST_BARS[1]
        print(f"{'meets' if ok else 'misses'} the bars (decode_host_us <= {HOST_BARS[0]:g}, "
              f"append_host_us <= {HOST_BARS[1]:g}): N={r['N']} batch={r['batch']} "
              f"GQA {r['group']}:1")
    return 0


def configuration(n, batch, group, kv_heads, d, page, device, timer, bandwidth,
                  window=None, *, rows=None, on_row=None, splits=None) -> list[dict]:
    """The rows of one (N, batch, GQA) configuration: SDPA on fp16 K/V, then the 8-bit cache
    (and with ``window``, a sliding-window layer and the full one it should cost as), appended
    to ``rows`` (a new list by default) and returned; ``on_row(rows)`` after each row. With
    ``splits`` (``(pages per split, parts)`` pairs), SDPA and the launcher at each of them only
    (:func:`split_rows`)."""
    base = {"N": n, "batch": batch, "gqa": f"{group}:1"}
    g = torch.Generator(device=device).manual_seed(n + batch + group)
    shape = (batch, kv_heads, n, d)
    k = (torch.randn(shape, generator=g, device=device)
         + 2 * torch.randn(batch, kv_heads, 1, d, generator=g, device=device)).half()
    v = torch.randn(shape, generator=g, device=device).half()
    q = torch.randn(batch, kv_heads * group, 1, d, generator=g, device=device).half()
    want = exact(q, k, v)
    rows = [] if rows is None else rows

    def row_of(method, measure):
        """The row of ``method`` (``measure()``'s fields, or the error it raised): appended,
        printed, passed to ``on_row``, returned."""
        try:
            rows.append({**base, "method": method, **measure(), "status": "ok"})
        except Exception as exc:  # noqa: BLE001 - a failing method is a row, not a crash
            rows.append({**base, "method": method,
                         "status": f"error: {type(exc).__name__}: {exc}"[:300]})
        print(rows[-1], file=sys.stderr, flush=True)
        if on_row is not None:
            on_row(rows)
        return rows[-1]

    def record(method, step, nbytes, want=want):
        def measure():
            out = step()
            ms = timer(step)
            host_us, loop_ms = loop_timings(step, device == "cuda",
                                            calls=100 if device == "cuda" else 2)
            return {"ms": ms, "bytes": nbytes, "floor_ms": nbytes / bandwidth * 1e3,
                    "tb_per_s": nbytes / ms * 1e-9, "cosine": cosine_similarity(out, want),
                    "host_us": host_us, "loop_ms": loop_ms}
        return row_of(method, measure)

    def record_step(method, step, *, build=None):
        """A whole decode step, the new token stored then attended: timed by the loop alone (each
        call of ours appends, so do_bench's thousands of calls would grow the cache); the first
        call's output is checked. ``build``: the step is ``build(step)`` (a CUDA graph of it)."""
        def measure():
            run = step if build is None else build(step)
            out = run()
            host_us, loop_ms = loop_timings(run, device == "cuda",
                                            calls=STEP_CALLS if device == "cuda" else 2)
            return {"cosine": cosine_similarity(out, want), "host_us": host_us,
                    "loop_ms": loop_ms}
        return row_of(method, measure)

    # our rows launch through Triton's own path (plans are the default since 2026-11-30), the
    # rows named "plan" replay their launch plans
    with torch.no_grad(), environment(LOWBIT_ATTN_LAUNCH="triton"):
        record("sdpa_fp16", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, enable_gqa=True), fp16_bytes(batch, n, kv_heads, d))
        cache = lowbit_attn.QuantizedKVCache(1, batch, kv_heads, d, max_tokens=n, page_size=page,
                                             dtype=torch.float16, device=device)
        cache.append(0, k, v)
        if splits is not None:
            split_rows(record, q, cache, splits, cache_bytes(batch, n, kv_heads, d, page))
            return rows
        record("kv_int8_fp8", lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0),
               cache_bytes(batch, n, kv_heads, d, page))
        rows[-1]["cache_nbytes"] = cache.nbytes()
        if device == "cuda":  # the same read replayed by its launch plan
            with environment(LOWBIT_ATTN_LAUNCH="plan"):
                read = planned_calls(lambda: lowbit_attn.attention_with_kv_cache(q, cache, 0))
                row = record("kv_int8_fp8 plan", read, cache_bytes(batch, n, kv_heads, d, page))
                row["plan_replayed"] = replays(cache, q)
        del cache
        if window is not None and window + 1 < n:
            window_rows(record, q, k, v, window, page)
        # whole steps: SDPA over a preallocated fp16 cache whose last slot is rewritten; ours
        # from the first n - 1 tokens, appending the last one (again at every call: the cache
        # grows by the loop's calls, ≤ STEP_CALLS + 2 tokens)
        k_buf, v_buf = k.clone(), v.clone()
        k_new, v_new = k[:, :, -1:].clone(), v[:, :, -1:].clone()

        def sdpa_step():
            k_buf[:, :, -1:].copy_(k_new)
            v_buf[:, :, -1:].copy_(v_new)
            return torch.nn.functional.scaled_dot_product_attention(q, k_buf, v_buf,
                                                                    enable_gqa=True)

        record_step("sdpa_fp16+write", sdpa_step)
        if device == "cuda":  # the same step replayed by a CUDA graph: no host time per step
            record_step("sdpa_fp16+write (graph)", sdpa_step,
                        build=lambda step: graphed(step, lambda: None))
        k_buf = v_buf = None  # freed before the 8-bit cache is built
        cache = lowbit_attn.QuantizedKVCache(1, batch, kv_heads, d, max_tokens=n + STEP_CALLS + 2,
                                             page_size=page, dtype=torch.float16, device=device)
        if n > 1:
            cache.append(0, k[:, :, :-1], v[:, :, :-1])

        def cache_step():
            cache.append(0, k_new, v_new)
            return lowbit_attn.attention_with_kv_cache(q, cache, 0)

        record_step("kv_int8_fp8+append", cache_step)
        if device == "cuda":  # ours replayed by a CUDA graph (lowbit_attn.DecodeStep)
            del cache

            def graphed_decode_step(_):
                cache = lowbit_attn.QuantizedKVCache(
                    1, batch, kv_heads, d, max_tokens=n + STEP_CALLS + 8, page_size=page,
                    dtype=torch.float16, device=device)
                if n > 1:
                    cache.append(0, k[:, :, :-1], v[:, :, :-1])
                step = lowbit_attn.DecodeStep(cache, 0, heads=q.shape[1], steps=STEP_CALLS + 6)
                return graphed(lambda: step.run(q, k_new, v_new), lambda: step.out)

            record_step("kv_int8_fp8+append (graph)", None, build=graphed_decode_step)
            # the eager step again, each launch replayed by its plan: a fresh cache, since the
            # step appends at every call
            cache = lowbit_attn.QuantizedKVCache(
                1, batch, kv_heads, d, max_tokens=n + STEP_CALLS + 8, page_size=page,
                dtype=torch.float16, device=device)
            if n > 1:
                cache.append(0, k[:, :, :-1], v[:, :, :-1])
            with environment(LOWBIT_ATTN_LAUNCH="plan"):
                record_step("kv_int8_fp8+append plan", planned_calls(cache_step))
                rows[-1]["plan_replayed"] = replays(cache, q)
    return rows


def planned_calls(step):
    """``step`` after the three calls that give its configuration a plan under
    ``LOWBIT_ATTN_LAUNCH=plan`` (the first runs normally, the second is captured, the third
    checks the plan once against a normal call: ``lowbit_attn.core.plans``), so that the
    timings see replays only."""
    for _ in range(3):
        step()
    return step


def replays(cache, q) -> bool:
    """Whether a read of layer 0 of ``cache`` by ``q`` would replay a plan now (a plan captured
    and checked, plans not turned off): a row timed with ``LOWBIT_ATTN_LAUNCH=plan`` says so,
    since a failed check sends every launch the normal way."""
    from lowbit_attn.kvcache import planned

    key = planned.read_key(q, cache, 0, None, False)
    return key is not None and cache.plans.ready(key) is not None


def split_rows(record, q, cache, splits, nbytes) -> None:
    """Record, for each ``(P, S)`` of ``splits``, layer 0 of ``cache`` read by ``q`` through the
    launcher (the split and merge launches, no checks) with ``P`` pages per split (``S`` 0:
    ``kv_int8_fp8 split P``) or each sequence's pages in ``S`` splits (``kv_int8_fp8 parts S``),
    with ``record(method, step, nbytes)``; each row says its split (``split_label``), the
    default's ``production``."""
    from lowbit_attn.kvcache import kernel_decode

    layer, recipe, scale = cache.layers[0], cache.recipe, q.shape[-1] ** -0.5
    default = kernel_decode.split_for(layer.page_size)
    for pps, parts in splits:
        method = f"kv_int8_fp8 parts {parts}" if parts else f"kv_int8_fp8 split {pps}"
        row = record(method, lambda pps=pps, parts=parts: kernel_decode.attention(
            q, layer, recipe, scale=scale, pages_per_split=pps, parts=parts)[0], nbytes)
        label = f"{parts} parts" if parts else f"{pps * layer.page_size} keys per split"
        row.update(pages_per_split=pps, parts=parts, split_label=label,
                   production=parts == default[1] and (parts > 0 or pps == default[0]))


def window_rows(record, q, k, v, window, page) -> None:
    """Record ``kv_int8_fp8 window W`` and ``kv_int8_fp8 last W+1`` (module docstring) with
    ``record(method, step, nbytes, want)``, which returns the row; the window's row gets the
    layer's memory (``cache_nbytes``: its window, not the N tokens)."""
    batch, kv_heads, n, d = k.shape
    seen = window + 1
    want = exact(q, k[:, :, -seen:], v[:, :, -seen:])
    append = min(WINDOW_APPEND, window, n)
    local = lowbit_attn.QuantizedKVCache(1, batch, kv_heads, d, max_tokens=n, page_size=page,
                                         dtype=k.dtype, device=k.device, window=window,
                                         max_append=append)
    for start in range(0, n, append):
        local.append(0, k[:, :, start:start + append], v[:, :, start:start + append])
    nbytes = cache_bytes(batch, seen, kv_heads, d, page)
    row = record(f"kv_int8_fp8 window {window}",
                 lambda: lowbit_attn.attention_with_kv_cache(q, local, 0), nbytes, want)
    row["cache_nbytes"] = local.nbytes()
    del local
    last = lowbit_attn.QuantizedKVCache(1, batch, kv_heads, d, max_tokens=seen, page_size=page,
                                        dtype=k.dtype, device=k.device)
    last.append(0, k[:, :, -seen:], v[:, :, -seen:])
    record(f"kv_int8_fp8 last {seen}", lambda: lowbit_attn.attention_with_kv_cache(q, last, 0),
           nbytes, want)


def graphed(step, output):
    """``step`` run once eagerly on a side stream (its first output kept: the one checked), then
    captured in a CUDA graph; returns a callable that replays it and gives the first output at
    its first call, ``output()`` after."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = step().clone()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    calls = []

    def replay():
        graph.replay()
        calls.append(None)
        return first if len(calls) == 1 else output()

    return replay


def render(rows: list[dict]) -> str:
    """Every row, with its speed against the same configuration's SDPA fp16 row of the same
    kind (attention alone, a whole step, a whole step replayed by a CUDA graph)."""
    def kind(method):  # the attention alone, a whole step, or a whole step in a CUDA graph
        return "+" in method, "(graph)" in method

    sdpa = {(r["N"], r["batch"], r["gqa"], kind(r["method"])): r for r in rows
            if r["method"].startswith("sdpa_fp16") and r["status"] == "ok"}

    def cells(r):
        ref = sdpa.get((r["N"], r["batch"], r["gqa"], kind(r["method"])))
        if "ms" in r:
            speed = f"{ref['ms'] / r['ms']:.2f}" if ref else "—"
            gpu = [f"{r['ms']:.4f}", f"{r['floor_ms']:.4f}", f"{r['tb_per_s']:.2f}", speed]
        else:
            gpu = ["—"] * 4
        loop_speed = f"{ref['loop_ms'] / r['loop_ms']:.2f}" if ref and "loop_ms" in ref else "—"
        loop = [f"{r['host_us']:.1f}", f"{r['loop_ms']:.4f}"] if "loop_ms" in r else ["—"] * 2
        return gpu + loop + [loop_speed, f"{r['cosine']:.5f}"]

    return status_table(
        ["N", "batch", "GQA", "method", "ms", "floor ms", "TB/s", "× SDPA fp16", "host µs",
         "loop ms", "× SDPA fp16 (loop)", "cosine"], rows,
        lambda r: [seqlen_label(r["N"]), str(r["batch"]), str(r["gqa"]), r["method"]], cells,
    )


if __name__ == "__main__":
    sys.exit(main())

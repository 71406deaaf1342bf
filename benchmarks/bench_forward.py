#!/usr/bin/env python
"""The 8-bit forward's candidates on Hopper in one sweep (issue 36): the one-warpgroup Gluon
kernel (``LOWBIT_ATTN_KERNEL=sm90``) at each of its options and the Triton kernel, against SDPA
cuDNN and flash and SageAttention 1.0.6; kernel alone and end to end; per-token and per-thread
scales.

    python benchmarks/bench_forward.py --out DIR --time-budget 330      # a GPU
    python benchmarks/bench_forward.py --quick                           # D=128, N=1k,16k
    python benchmarks/bench_forward.py --decide --out DIR --time-budget 150   # run_on_gpu.sh decide

Without CUDA it runs the same rows at a tiny size (D=64, N=160, B×H=1×2) on the backend the
environment selects (the Triton interpreter in the tests), SDPA on its math backend, the sm90
kernel-alone rows skipped, and says so: a check of the script, not a benchmark.

Configurations, most decisive first (each saved as soon as it is measured, so a run cut short
keeps what it measured): D ∈ {128, 64} × N ∈ {16k, 1k, 4k} × causal or not, with B×H = 2×32 at
16k, 8×32 at 4k, 16×32 at 1k (issue 36's table). Inputs: fp16 q, k, v ~ N(0, 1), k += 4·N(0, 1)
per channel (bf16 copies for SDPA). TOP/s = 4·B·H·N²·D / t, halved when causal.

Rows (``e2e``: the public call, quantization included; ``kernel``: the attention launch alone on
operands quantized once):

- ``sdpa cudnn``, ``sdpa flash`` (bf16), ``sage 1.0.6`` (fp16, its Triton kernels);
- ``e2e triton token``: ``qk_int8_pv_fp8`` as users call it, on the Triton kernel
  (``LOWBIT_ATTN_KERNEL=triton``, what every ``triton`` row sets: the default, ``measured``,
  may name another forward; the candidate ``core.measured`` names where it has one, else
  autotuned; the note: which);
  ``tuned triton token`` (not in ``--decide``): the same under ``LOWBIT_ATTN_AUTOTUNE=all``, the
  kernel's earlier choices forgotten, so the note says what the autotuner picks here (the
  evidence for the next ``core.measured`` entry);
- ``e2e sm90 token`` / ``e2e sm90 thread``: ``LOWBIT_ATTN_KERNEL=sm90`` with the recipe's
  per-token or per-thread scales and 128-key blocks (the row's ``note``: ``admitted`` or why
  not); ``e2e triton thread``: per-thread scales on the Triton kernel (the SageAttention shim's
  default);
- ``kernel triton token`` (default blocks), ``kernel triton thread`` (64×128 tiles);
- ``kernel sm90 thread``, ``… k2`` (two K buffers), ``… r168`` (``maxnreg=168``: 3 programs per
  SM), ``kernel sm90 token``, ``… token r168``, and ``kernel sm90 fp16 thread``
  (``qk_int8_pv_fp16``);
- ``prepare permuted``: the quantization stage that the sm90 rows take;
- at D = 64 only, last: ``kernel sm90 thread poly16`` / ``poly8`` (one key group in 16 or 8
  takes its exp2 on the FMA pipe: ``poly_exp2``).

``--decide`` (issue 43): first one configuration per bar (D=128 N=16k, N=1k at B×H=16×32,
D=64 N=16k, N=1k; causal D=128 N=16k, issue 44's window), then N=8k (B×H=4×32) at D=128 and 64
and causal D=64 N=16k; only the rows that decide: SDPA cuDNN, e2e sm90 thread and token, kernel
sm90 thread and token, e2e Triton, SageAttention, ``e2e sm90 thread plan`` (with
``LOWBIT_ATTN_LAUNCH=plan``: the host path launch plans would save; not counted in the bars,
which are the default launch path's); after each bar's first configuration (before the
second ones), the kernel's variants alone at D=128 N=16k (``… thread k2``, ``… thread r168``,
``… token r168``: the kernel bar takes the fastest ``kernel sm90`` row), at D=128 N=16k causal
the sm90 kernel's window and register cap, then the Triton kernel alone on its first trial
candidate (``kernel triton token causal m64``, ``… win512 m64``: 64-row programs, two per SM);
last, ``tuned triton token win512`` at D=128 N=16k causal (the
windowed call autotuned, against ``e2e triton token win512``, which runs the candidate measured
without a window).

Every output is checked against exact attention in float64 on batch 0, heads 0–1 (cosine,
relative L1); a row under cosine 0.998 fails. Each row records ``first_call_s``: the wall time
of its method's first call of that shape (compiles and autotuning included; for the first sm90
row of the process, the admission check started in the background, which that call does not
wait for). The ``e2e sm90`` rows then wait for the check's verdict, at most 90 s
(``admission_wait_s`` and ``admission``: ``tools.bench.calls.await_admission``), and check and
time the kernel that runs then. The table and the
JSON (``bars``) end with issue 43's bars beside the values: the sm90 kernel alone ≥ 850 TOP/s at D=128 N=16k, end to end ≥ 1.15×
SDPA cuDNN at D=128 N ≥ 8k, ≥ 1.0× at D=64, ≥ 0.9× at N=1k, cosine ≥ 0.9992, first call ≤ 2 s. Writes ``forward-<gpu>-<date>.json`` and ``.md``
into each ``--out``; the markdown ends with the bars of issue 36 against the best sm90 row.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

try:
    import lowbit_attn
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import lowbit_attn
from bench_hopper import forced, stage_fns
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.inference.naive import exact_attention
from lowbit_attn.integrations.sdpa import TORCH_SDPA
from lowbit_attn.tools.bench.calls import autotune_choice, await_admission, environment
from lowbit_attn.tools.bench.flops import tops
from lowbit_attn.tools.bench.measure import compare
from lowbit_attn.tools.bench.metadata import make_metadata
from lowbit_attn.tools.bench.protocol import make_inputs
from lowbit_attn.tools.bench.save import save_script_results
from lowbit_attn.tools.bench.tables import seqlen_label
from lowbit_attn.tools.bench.timers import timer_for

MIN_COSINE = 0.998  # a broken kernel, not the recipe's error (~0.9993 on these inputs)
BATCH_HEADS = {1024: (16, 32), 4096: (8, 32), 8192: (4, 32), 16384: (2, 32)}
CONFIGS = [(128, 16384, False), (128, 1024, False), (64, 16384, False), (64, 1024, False),
           (128, 16384, True), (128, 4096, False), (64, 4096, False), (128, 1024, True),
           (64, 16384, True), (128, 4096, True), (64, 4096, True), (64, 1024, True)]
TOKEN = get_recipe("qk_int8_pv_fp8").replace(block_k=128)
THREAD = get_recipe("qk_int8_pv_fp8").replace(granularity="per_thread", block_q=64, block_k=128)
THREAD_FP16 = get_recipe("qk_int8_pv_fp16").replace(granularity="per_thread", block_q=64,
                                                    block_k=128)
# --decide (run_on_gpu.sh decide, issues 43 and 44): the configurations that decide, each bar's
# first (D=128 N=16k, N=1k at B×H=512, the same at D=64, causal D=128 N=16k for issue 44's
# window) before any bar's second (N=8k, causal D=64), and only the rows that decide: a run cut
# short by its budget still has a row for every bar.
DECIDE_CONFIGS = [(128, 16384, False), (128, 1024, False), (64, 16384, False), (64, 1024, False),
                  (128, 16384, True), (128, 8192, False), (64, 8192, False), (64, 16384, True)]
# The candidates' passes (the kernel's variants, the window on it, the Triton kernel's trial)
# run after each bar's first configuration and before its second, which two runs have measured
# already (on 2026-11-30 the sweep's budget ended before the passes after the last one).
DECIDE_FIRST = 5
DECIDE_ROWS = ("sdpa cudnn", "e2e sm90 thread", "e2e sm90 token", "kernel sm90 thread",
               "kernel sm90 token", "e2e triton token", "sage 1.0.6", "e2e sm90 thread plan",
               "e2e sm90 thread win512", "e2e triton thread win512", "e2e triton token win512",
               "kernel triton token causal", "kernel triton token win512",
               "kernel sm90 thread k2", "kernel sm90 thread r168", "kernel sm90 token r168",
               "kernel sm90 thread win512", "kernel triton token causal m64",
               "kernel triton token win512 m64", "tuned triton token win512")
# The one-warpgroup kernel's variants (NOTES §17: two K buffers; 168 registers, 3 programs per
# SM), alone at the kernel bar's configuration, after each bar's first configuration.
KERNEL_VARIANTS = [("kernel sm90 thread k2", THREAD, {"k_stages": 2}),
                   ("kernel sm90 thread r168", THREAD, {"maxnreg": 168}),
                   ("kernel sm90 token r168", TOKEN, {"maxnreg": 168})]
DECIDE_VARIANTS = (128, 16384, False)
# --decide's very last row, at D=128 N=16k causal: the windowed default call autotuned
# (LOWBIT_ATTN_AUTOTUNE=all), against its "e2e triton token win512" row, which runs the candidate
# measured without a window (core.measured.SAME_TILES): whether that inference holds.
DECIDE_WINDOW_TUNED = (128, 16384, True)
# Issue 44's bar: a 512-token causal window over N=16k runs >= 8x faster than full causal (the
# "win512" rows of the causal configurations against "e2e sm90 thread", and the default path's
# "e2e triton token win512" against "e2e triton token"; TOP/s counted as causal).
WINDOW = (511, 0)
# Then at D=128 N=16k causal the sm90 kernel alone (its "kernel sm90 thread" row there the full
# causal one) with issue 44's window: whether a window costs in proportion on it, where 64-row
# programs, 2 per SM, hide one's prologue under another's loop; and with the 168-register cap,
# which won the kernel bar's row (NOTES §29), where causal compiles spill more.
CAUSAL_VARIANTS = [("kernel sm90 thread win512", THREAD, {"window": WINDOW}),
                   ("kernel sm90 thread r168", THREAD, {"maxnreg": 168})]
DECIDE_CAUSAL_VARIANTS = (128, 16384, True)
# Then, there too, the Triton kernel alone on its first trial candidate (kernel_int8.TRIALS:
# 64-row programs on one warpgroup, two per SM), full causal (checked: no GPU has run it) and
# windowed, against "kernel triton token causal" and "… win512" (NOTES §30).
TRIAL_ROWS = [("kernel triton token causal m64", None), ("kernel triton token win512 m64", WINDOW)]
# Issues 36 and 43's GPU bars: (D, N range, causal) → × SDPA cuDNN end to end.
BARS = [(128, (8192, None), False, 1.15), (64, (8192, None), False, 1.0),
        (64, (1024, 1024), False, 0.9), (128, (1024, 1024), False, 0.9)]
SM90_E2E = ("e2e sm90 thread", "e2e sm90 token")  # the bars' rows: Triton's launch path (default)
KERNEL_BAR = 850.0  # TOP/s of the sm90 kernel alone at D=128, N=16k, not causal (issue 43)
COSINE_BAR = 0.9992  # end to end against exact attention (issue 43)
FIRST_CALL_BAR = 2.0  # seconds: the first call of a new shape, compiles included (issue 43)
WINDOW_BAR = 8.0  # a 512-token window over N=16k against full causal (issue 44)


def tuned(fn):
    """``fn`` under ``LOWBIT_ATTN_AUTOTUNE=all``, with the INT8 attention kernel's earlier
    choices forgotten now (its autotuner's cache), so that its first call times every
    candidate."""
    from lowbit_attn.inference import kernel_int8

    kernel_int8._attn_fwd_int8.cache.clear()

    def call():
        with environment(LOWBIT_ATTN_AUTOTUNE="all"):
            return fn()
    return call


def sm90_launcher(**options):
    from lowbit_attn.inference import kernel_int8_sm90

    return functools.partial(kernel_int8_sm90.attention, **options)


def permuted_stages(q, k, v, causal, recipe, launcher, window=None):
    """``(prepare, attention)`` of a call whose V is quantized permuted (the sm90 kernel's
    operands), as ``inference.op.kernel`` runs them under ``LOWBIT_ATTN_KERNEL=sm90``;
    ``window``: ``(left, right)``, as ``attention(window=)``."""
    from lowbit_attn.core.variants import PLAIN, Variant
    from lowbit_attn.inference.prepare import quantize_qkv

    scale = q.shape[-1] ** -0.5

    def prepare():
        return quantize_qkv(q, k, v, recipe, scale, need_lse_shift=False, backend="triton",
                            permute_v=recipe.pv == "fp8")

    qz = prepare()
    out = torch.empty_like(q)
    variant = PLAIN if window is None else Variant(left=window[0], right=window[1])

    def attention():
        launcher(qz, out=out, pv=recipe.pv, granularity=recipe.granularity,
                 block_q=recipe.block_q, block_k=recipe.block_k,
                 causal_offset=0 if causal else None, return_lse=False, variant=variant)
        return out

    return prepare, attention


def sm90_rows(base, q, k, v, causal, record, gluon_ok: str | None, rows) -> None:
    """The one-warpgroup kernel alone, one row per ``(name, recipe, launcher options)`` of
    ``rows`` (skipped, saying why, where the Gluon kernel cannot run); an option ``window`` is
    the call's (that row unchecked against exact attention without it)."""
    for name, recipe, options in rows:
        if gluon_ok is not None:
            record(base, name, None, skip=gluon_ok)
            continue
        options = dict(options)
        window = options.pop("window", None)
        record(base, name, None, check=window is None,
               note=None if window is None else f"window {window}: time against kernel sm90 "
                                                f"thread causal",
               build=lambda recipe=recipe, options=options, window=window: permuted_stages(
                   q, k, v, causal, recipe, sm90_launcher(**options), window)[1])


def trial_rows(base, q, k, v, causal, record, gluon_ok: str | None) -> None:
    """:data:`TRIAL_ROWS`: the attention launch alone with the autotuner held to
    ``kernel_int8.TRIALS[0]`` (``LOWBIT_ATTN_AUTOTUNE=all``, which lets a trial through)."""
    from lowbit_attn.inference import kernel_int8

    for name, window in TRIAL_ROWS:
        with forced(kernel_int8.TRIALS[0]), environment(LOWBIT_ATTN_AUTOTUNE="all"):
            record(base, name, stage_fns(q, k, v, causal, window=window)[1],
                   check=window is None, note=lambda window=window: f"{autotune_choice()}" + (
                       "" if window is None else f"; window {window}: time against kernel "
                                                 f"triton token causal (m64)"))


def tuned_window_row(base, q, k, v, causal, record, gluon_ok: str | None) -> None:
    """``tuned triton token win512``: the default recipe's windowed call on the Triton kernel
    under ``LOWBIT_ATTN_AUTOTUNE=all`` (the note: the autotuner's choice)."""
    def call():
        with environment(LOWBIT_ATTN_KERNEL="triton"):
            return lowbit_attn.attention(q, k, v, recipe="qk_int8_pv_fp8", is_causal=causal,
                                         window=WINDOW)

    record(base, "tuned triton token win512", tuned(call), check=False,
           note=lambda: f"window {WINDOW}, LOWBIT_ATTN_AUTOTUNE=all: {autotune_choice()}")


def rows_of_config(base, q, k, v, causal, record, gluon_ok: str | None,
                   decide: bool = False) -> None:
    """Every row of one configuration (module docstring), most decisive first; ``gluon_ok``:
    ``None`` where the sm90 kernel can run, else why its kernel-alone rows are skipped;
    ``decide``: only :data:`DECIDE_ROWS`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lowbit_attn.inference import sm90_check

    cuda = q.device.type == "cuda"
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend if cuda else SDPBackend.MATH):
                return TORCH_SDPA(qb, kb, vb, is_causal=causal)
        return fn

    sm90 = functools.partial(sm90_rows, base, q, k, v, causal, record, gluon_ok)

    def ours(recipe, kernel="triton", launch=None, **variant):  # the rows name their kernel
        def fn():
            with environment(LOWBIT_ATTN_KERNEL=kernel, LOWBIT_ATTN_LAUNCH=launch):
                return lowbit_attn.attention(q, k, v, recipe=recipe, is_causal=causal, **variant)
        return fn

    record(base, "sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))
    for name, recipe in (("e2e sm90 thread", THREAD), ("e2e sm90 token", TOKEN)):
        record(base, name, ours(recipe, "sm90"),
               note=lambda: sm90_check.verdict(q.device) or "admitted", admission=True)
    if decide:
        sm90([("kernel sm90 thread", THREAD, {}), ("kernel sm90 token", TOKEN, {})])
        record(base, "e2e triton token", ours("qk_int8_pv_fp8"), note=autotune_choice)
        record(base, "sage 1.0.6", sage(q, k, v, causal))
        record(base, "e2e sm90 thread plan", ours(THREAD, "sm90", "plan"))
        if causal:  # issue 44: a 512-token window, sm90 and Triton, against full causal above
            for name, kernel in (("e2e sm90 thread win512", "sm90"),
                                 ("e2e triton thread win512", "triton")):
                record(base, name, ours(THREAD, kernel, window=WINDOW), check=False,
                       note=lambda kernel=kernel: f"window {WINDOW}: time against e2e sm90 "
                       f"thread" + (f"; {autotune_choice()}" if kernel == "triton" else ""))
            record(base, "e2e triton token win512", ours("qk_int8_pv_fp8", window=WINDOW),
                   check=False, note=lambda: f"window {WINDOW}: time against e2e triton token; "
                                             f"{autotune_choice()}")
            # the attention kernel alone, full causal and windowed: what a window saves where
            # the quantization (the same for any window) is not counted
            record(base, "kernel triton token causal", stage_fns(q, k, v, causal)[1],
                   note=autotune_choice)
            record(base, "kernel triton token win512",
                   stage_fns(q, k, v, causal, window=WINDOW)[1], check=False,
                   note=lambda: f"window {WINDOW}: time against kernel triton token causal")
        return
    record(base, "e2e triton token", ours("qk_int8_pv_fp8"), note=autotune_choice)
    record(base, "tuned triton token", tuned(ours("qk_int8_pv_fp8")), note=autotune_choice)
    record(base, "sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION))
    record(base, "sage 1.0.6", sage(q, k, v, causal))
    sm90([("kernel sm90 thread", THREAD, {}), *KERNEL_VARIANTS[:2],
          ("kernel sm90 token", TOKEN, {}), *KERNEL_VARIANTS[2:],
          ("kernel sm90 fp16 thread", THREAD_FP16, {})])
    record(base, "kernel triton token", stage_fns(q, k, v, causal)[1], note=autotune_choice)
    record(base, "kernel triton thread", stage_fns(q, k, v, causal, THREAD)[1],
           note=autotune_choice)
    record(base, "e2e triton thread", ours(THREAD))
    record(base, "prepare permuted", permuted_stages(q, k, v, causal, THREAD, sm90_launcher())[0],
           check=False)
    if q.shape[-1] == 64:  # where the MUFU binds (NOTES §17); last, the least likely to decide
        sm90([("kernel sm90 thread poly16", THREAD, {"poly_exp2": 16}),
              ("kernel sm90 thread poly8", THREAD, {"poly_exp2": 8})])


def compiled_facts() -> list[dict]:
    """What the GPU's own compiles of the one-warpgroup kernel came to: per variant its constexprs
    and launch options (the JIT's cache key, abridged), registers, spilled bytes and shared
    memory, as the driver loaded them."""
    try:
        from lowbit_attn.inference import kernel_int8_sm90
    except ImportError:
        return []
    facts = []
    try:
        kernels = [item for caches in kernel_int8_sm90._attn_fwd_sm90_kernel.device_caches.values()
                   for item in caches[0].items()]
    except Exception as exc:  # noqa: BLE001 - Triton's JIT cache is internal: a diagnostic only
        return [{"constexprs": f"JIT cache unread: {type(exc).__name__}: {exc}"[:200],
                 "maxnreg": None, "registers": None, "spills": None, "shared": None}]
    for key, kernel in kernels:
        try:
            kernel._init_handles()
            names = kernel.src.fn.arg_names
            constants = {names[k[0]]: v for k, v in kernel.src.constants.items()
                         if len(k) == 1 and names[k[0]].isupper()}
            facts.append({"constexprs": constants,
                          "maxnreg": getattr(kernel.metadata, "maxnreg", None),
                          "registers": kernel.n_regs, "spills": kernel.n_spills,
                          "shared": kernel.metadata.shared})
        except Exception as exc:  # noqa: BLE001 - a diagnostic: never stops the sweep
            facts.append({"constexprs": str(key)[-200:], "maxnreg": None,
                          "registers": f"unread: {type(exc).__name__}", "spills": None,
                          "shared": None})
    return facts


def sage(q, k, v, causal):
    """SageAttention 1.0.6's call (``None`` when it is not installed: the row says so)."""
    try:
        from sageattention import sageattn
    except ImportError:
        return None
    k_own = k.clone()  # it smooths K in place

    def fn():
        return sageattn(q, k_own, v, tensor_layout="HND", is_causal=causal)

    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="D=128, N=1k and 16k, not causal")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; configurations not started by then are recorded as skipped")
    ap.add_argument("--decide", action="store_true",
                    help="the decisive configurations and rows only (run_on_gpu.sh decide)")
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    configs = [c for c in CONFIGS if not args.quick or (c[0] == 128 and not c[2] and c[1] != 4096)]
    if args.decide:
        configs = DECIDE_CONFIGS
    batch_heads = BATCH_HEADS
    if not cuda:
        print("NO CUDA: tiny sizes on the CPU (not a kernel benchmark)", file=sys.stderr)
        configs, batch_heads = [(64, 160, False), (64, 160, True)], {160: (1, 2)}
    timer = timer_for(cuda)
    start = time.monotonic()
    rows: list[dict] = []
    gluon_ok = gluon_available()

    def record(base: dict, name: str, fn, *, note=None, skip: str | None = None, check=True,
               admission=False, build=None):
        """One row: ``fn`` (or what ``build()`` returns, built inside the row's ``try``) checked
        and timed; an exception is the row's status, never the sweep's end."""
        row = {**base, "method": name}
        exact = row.pop("exact")
        if (fn is None and build is None) or skip is not None:
            row.update(status="skipped", reason=skip or "not installed")
            rows.append(row)
            return
        try:
            if build is not None:
                fn = build()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()  # this method's first call of this shape: compiles and autotuning included
            if cuda:
                torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            if admission:  # the check runs in the background: measure the kernel it admits
                await_admission(row)
                del out
                out = fn()
            if check:
                row.update(compare(out[:1, :2], exact))
                row["check"] = "pass" if row["cosine"] >= MIN_COSINE else "FAIL"
            del out
            row["ms"] = float(timer(fn))
            row["tops"] = tops(base["B"], base["H"], base["N"], base["D"], base["causal"],
                               row["ms"])
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a failing method is a row, not a crash
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        if note is not None:
            try:
                row["note"] = note() if callable(note) else note
            except Exception as exc:  # noqa: BLE001 - the row stands without its note
                row["note"] = f"note failed: {type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        print({k: v for k, v in row.items() if k != "max_abs_err"}, file=sys.stderr, flush=True)

    meta = make_metadata(device=device, mode="forward", protocol={
        "configs": configs, "batch_heads": batch_heads,
        "inputs": "fp16 q, k, v ~ N(0,1); k += 4·N(0,1) per channel (bf16 copies for SDPA)",
        "check": "cosine against float64 exact attention, batch 0, heads 0-1",
    })

    def save(complete: bool) -> str:
        facts = compiled_facts() if cuda else []
        table = render(rows) + render_bars(bars(rows)) + render_facts(facts)
        save_script_results(args.out, "forward", {**meta, "rows": rows, "compiled": facts,
                                                   "bars": bars(rows), "complete": complete},
                            table)
        return table

    passes = [(config, functools.partial(rows_of_config, decide=args.decide))
              for config in configs]
    if args.decide:  # the candidates after each bar's first configuration, before its second
        # (on a CPU, after both tiny ones: the sm90 rows skipped, the script checked)
        causal_config = DECIDE_CAUSAL_VARIANTS if cuda else next(c for c in configs if c[2])
        passes[DECIDE_FIRST:DECIDE_FIRST] = [
            (DECIDE_VARIANTS if cuda else configs[0],
             functools.partial(sm90_rows, rows=KERNEL_VARIANTS)),
            (causal_config, functools.partial(sm90_rows, rows=CAUSAL_VARIANTS)),
            (causal_config, trial_rows)]
        passes.append((DECIDE_WINDOW_TUNED if cuda else causal_config, tuned_window_row))
    for (d, n, causal), rows_fn in passes:
        b, h = batch_heads[n]
        base = {"B": b, "H": h, "N": n, "D": d, "causal": causal}
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            rows.append({**base, "method": "*", "status": "skipped", "reason": "time budget"})
            continue
        q, k, v = make_inputs(b, h, n, d, device=device)
        exact, _ = exact_attention(q[:1, :2], k[:1, :2], v[:1, :2], scale=d ** -0.5,
                                   causal_offset=0 if causal else None)
        rows_fn({**base, "exact": exact}, q, k, v, causal, record, gluon_ok)
        del q, k, v, exact
        if cuda:
            torch.cuda.empty_cache()
        save(complete=False)
    print(save(complete=True))
    return 0 if all(r["status"] in ("ok", "skipped") and r.get("check", "pass") == "pass"
                    for r in rows) else 1


def gluon_available() -> str | None:
    """``None`` if the one-warpgroup Gluon kernel (sm90) can run here, else why not."""
    from lowbit_attn.core import triton_support
    from lowbit_attn.inference import gluon_check

    if not triton_support.gluon_available("hopper"):
        return triton_support.gluon_refusal("hopper", "the Gluon forward")
    if not (torch.cuda.is_available() and gluon_check.applies(torch.device("cuda"))):
        return "needs a capability 9.0 GPU"
    return None


def render_facts(facts: list[dict]) -> str:
    """The compiled variants' registers, spills and shared memory, after the tables."""
    if not facts:
        return ""
    lines = ["", "| sm90 variant (GPU's compile) | maxnreg | registers | spills (B) | shared (B) |",
             "|---|---|---|---|---|"]
    for f in facts:
        lines.append(f"| {f['constexprs']} | {f['maxnreg']} | {f['registers']} | {f['spills']} | "
                     f"{f['shared']} |")
    return "\n".join(lines)


def bars(rows: list[dict]) -> list[dict]:
    """Issue 43's forward bars beside the measured values (``met``: True, False, or None where the
    rows are missing): the sm90 kernel alone at D=128 N=16k, each end-to-end × cuDNN bar (the
    fastest ``e2e sm90`` row), the worst end-to-end sm90 cosine, the slowest first call of an
    end-to-end row of ours (a new shape: compiles, autotuning and the sm90 check included where
    that row's call was the process's first); whether the admitted sm90 forward beats the
    default path end to end on every configuration; issue 44's window against full causal."""
    ok = [r for r in rows if r["status"] == "ok"]

    def bar(name, value, target, higher=True):
        met = None if value is None else (value >= target if higher else value <= target)
        return {"bar": name, "value": value, "target": target, "met": met}

    kernel = [r["tops"] for r in ok if r["method"].startswith("kernel sm90")
              and (r["D"], r["N"], r["causal"]) == (128, 16384, False)]
    out = [bar("kernel alone TOP/s, D=128 N=16k", max(kernel, default=None), KERNEL_BAR)]
    cudnn = {(r["D"], r["N"], r["causal"]): r["ms"] for r in ok if r["method"] == "sdpa cudnn"}
    for d, (lo, hi), causal, target in BARS:
        speeds = [cudnn[(r["D"], r["N"], r["causal"])] / r["ms"] for r in ok
                  if r["method"] in SM90_E2E and r["D"] == d and r["causal"] == causal
                  and r["N"] >= lo and (hi is None or r["N"] <= hi)
                  and (r["D"], r["N"], r["causal"]) in cudnn]
        span = f"N>={seqlen_label(lo)}" if hi is None else f"N={seqlen_label(lo)}"
        out.append(bar(f"e2e x SDPA cuDNN, D={d} {span}{' causal' if causal else ''} (worst N)",
                       min(speeds, default=None), target))
    cosines = [r["cosine"] for r in ok if r["method"] in SM90_E2E and "cosine" in r]
    out.append(bar("e2e sm90 cosine (worst)", min(cosines, default=None), COSINE_BAR))
    first = [r["first_call_s"] for r in ok
             if r["method"].startswith("e2e") and "first_call_s" in r]
    out.append(bar("first call of a new shape, s (slowest e2e row)", max(first, default=None),
                   FIRST_CALL_BAR, higher=False))
    # What makes the sm90 forward Hopper's default (core/measured.py KERNEL_CHOICES): its best
    # admitted e2e row against the default path's on every configuration that has both.
    by_config: dict = {}
    for r in ok:
        by_config.setdefault((r["D"], r["N"], r["causal"]), {})[r["method"]] = r
    wins = []
    for methods in by_config.values():
        sm90 = [r["ms"] for name, r in methods.items()
                if name in SM90_E2E and r.get("note") == "admitted"]
        if sm90 and "e2e triton token" in methods:
            wins.append(methods["e2e triton token"]["ms"] / min(sm90))
    out.append(bar("admitted e2e sm90 x e2e triton token (worst configuration)",
                   min(wins, default=None), 1.0))
    # Issue 44: a 512-token window against full causal at D=128 N=16k, end to end (the bar) and
    # the kernels alone (where the preparation, the same for any window, is not counted)
    causal = by_config.get((128, 16384, True), {})
    for what, full, windowed in (("e2e triton token", "e2e triton token",
                                  "e2e triton token win512"),
                                 ("kernel alone, triton token", "kernel triton token causal",
                                  "kernel triton token win512"),
                                 ("kernel alone, sm90 thread", "kernel sm90 thread",
                                  "kernel sm90 thread win512"),
                                 ("kernel alone, triton token m64",
                                  ("kernel triton token causal", "kernel triton token causal m64"),
                                  "kernel triton token win512 m64")):
        fulls = [causal[name]["ms"] for name in ((full,) if isinstance(full, str) else full)
                 if name in causal]  # the m64 window against the faster full causal kernel
        speedup = (min(fulls) / causal[windowed]["ms"]
                   if fulls and windowed in causal else None)
        out.append(bar(f"window 512 x full causal, {what}, D=128 N=16k (issue 44)", speedup,
                       WINDOW_BAR))
    return out


def render_bars(found: list[dict]) -> str:
    lines = ["", "| bar (issues 43, 44) | value | target | met |", "|---|---|---|---|"]
    for b in found:
        value = "—" if b["value"] is None else f"{b['value']:.4g}"
        met = {True: "yes", False: "no", None: "—"}[b["met"]]
        lines.append(f"| {b['bar']} | {value} | {b['target']} | {met} |")
    return "\n".join(lines)


def render(rows: list[dict]) -> str:
    """Every row with × cuDNN, then issue 36's bars against the fastest end-to-end sm90 row."""
    cudnn = {(r["D"], r["N"], r["causal"]): r for r in rows
             if r["method"] == "sdpa cudnn" and r["status"] == "ok"}
    lines = ["| D | N | causal | B×H | method | ms | TOP/s | × cuDNN | cosine | rel L1 | first call s "
             "| note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['D']} | {seqlen_label(r['N'])} | {'yes' if r['causal'] else 'no'} | "
                f"{r['B']}×{r['H']} | {r['method']} |")
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} {r.get('reason', '')} | | | | | | |")
            continue
        base = cudnn.get((r["D"], r["N"], r["causal"]))
        speed = f"{base['ms'] / r['ms']:.2f}" if base else "—"
        cos = f"{r['cosine']:.5f}" if "cosine" in r else ""
        rel = f"{r['rel_l1']:.4f}" if "rel_l1" in r else ""
        first = f"{r['first_call_s']:.2f}" if "first_call_s" in r else ""
        lines.append(f"{head} {r['ms']:.3f} | {r['tops']:.0f} | {speed} | {cos} | {rel} | "
                     f"{first} | {r.get('note') or ''} |")
    lines += ["", "| D | N | causal | best sm90 e2e | × cuDNN | bar | met | × SageAttention |",
              "|---|---|---|---|---|---|---|---|"]
    for (d, n, causal), base in cudnn.items():
        ours = [r for r in rows if (r["D"], r["N"], r["causal"]) == (d, n, causal)
                and r["method"] in SM90_E2E and r["status"] == "ok"]
        sage_row = next((r for r in rows if (r["D"], r["N"], r["causal"]) == (d, n, causal)
                         and r["method"] == "sage 1.0.6" and r["status"] == "ok"), None)
        if not ours:
            continue
        best = min(ours, key=lambda r: r["ms"])
        bar = next((x for dd, (lo, hi), c, x in BARS
                    if dd == d and c == causal and n >= lo and (hi is None or n <= hi)), None)
        speed = base["ms"] / best["ms"]
        met = "—" if bar is None else ("yes" if speed >= bar else "no")
        vs_sage = f"{sage_row['ms'] / best['ms']:.2f}" if sage_row else "—"
        lines.append(f"| {d} | {seqlen_label(n)} | {'yes' if causal else 'no'} | "
                     f"{best['method']} | {speed:.2f} | {bar or '—'} | {met} | {vs_sage} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

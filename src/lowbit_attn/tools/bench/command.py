"""``lowbit-attn bench`` (and ``python -m lowbit_attn.tools.bench``): options, the GPU run and the
CPU reference timings, the files written, the short table and the exit status."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from lowbit_attn.core import checks
from lowbit_attn.core.arch import backend_for, parse_arch
from lowbit_attn.core.recipes import RECIPES, resolve
from lowbit_attn.tools.args import head_dim_arg, output_dir, positive_int, ranged
from lowbit_attn.tools.bench.protocol import (
    BASELINES, BATCH, DIMS, HEADS, MIN_COSINE, OUR_RECIPES, QUICK_DIMS, QUICK_SEQLENS, SEQLENS,
    cpu_methods, select_methods,
)
from lowbit_attn.tools.bench.metadata import checkout_root
from lowbit_attn.tools.bench.run import run_benchmark
from lowbit_attn.tools.bench.save import write_results
from lowbit_attn.tools.bench.tables import render_short_table


def _split(text: str) -> list[str]:
    return [t for t in re.split(r"[,\s]+", text.strip()) if t]


def parse_dims(text: str) -> list[int]:
    """``"64,128"`` → ``[64, 128]``, each a head dim the attention functions take."""
    return [head_dim_arg(t) for t in _split(text)]


def parse_seqlens(text: str) -> list[int]:
    """``"1k,4k,16384"`` → ``[1024, 4096, 16384]``."""
    out = []
    for t in _split(text):
        m = re.fullmatch(r"(\d+)([kK]?)", t)
        n = int(m.group(1)) * (1024 if m.group(2) else 1) if m else 0
        if not 0 < n < 2**31:
            raise argparse.ArgumentTypeError(
                f"sequence lengths look like 1k,4k,16384 (positive, below 2**31); got {t!r}")
        out.append(n)
    return out


def parse_names(text: str) -> list[str]:
    names = _split(text)
    if not names:  # "" would run nothing of ours without saying so
        raise argparse.ArgumentTypeError(f"expected comma-separated names, or none; got {text!r}")
    return [] if names == ["none"] else names


def parse_baselines(text: str) -> list[str]:
    """``"flash,cudnn"`` (some of :data:`BASELINES`) or ``"none"``."""
    names = parse_names(text)
    unknown = [n for n in names if n not in BASELINES]
    if unknown or not _split(text):
        raise argparse.ArgumentTypeError(
            f"expected some of {','.join(BASELINES)}, or none; got {text!r}")
    return names


# A CPU run's sizes where the options leave them (the protocol's would take minutes per call there)
CPU_SIZE = {"batch": 1, "heads": 2, "dims": [64], "seqlens": [256]}


def host_arch_arg(text: str) -> str:
    """argparse type for ``--host-arch``: an architecture as ``LOWBIT_ATTN_ARCH`` takes it."""
    from lowbit_attn.core.arch import parse_arch

    try:
        parse_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``lowbit-attn bench``."""
    parser.add_argument("--dims", type=parse_dims, default=None,
                        help="head dims, comma-separated (default 64,128; --quick: 128)")
    parser.add_argument("--seqlens", type=parse_seqlens, default=None,
                        help="sequence lengths, e.g. 1k,4k,16k (default 1k,2k,4k,8k,16k,32k; "
                             "--quick: 1k,4k,16k)")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help=f"batch size (default {BATCH}; on a CPU {CPU_SIZE['batch']})")
    parser.add_argument("--heads", type=positive_int, default=None,
                        help=f"heads (default {HEADS}; on a CPU {CPU_SIZE['heads']})")
    parser.add_argument("--causal", choices=("yes", "no", "both"), default="both",
                        help="causal masks, non-causal, or both (default)")
    parser.add_argument("--recipes", type=parse_names, default=list(OUR_RECIPES),
                        help="our recipes, comma-separated (default qk_int8_pv_fp8,qk_int8_pv_fp16;"
                             " the first is the one compared in the short table)")
    parser.add_argument("--baselines", type=parse_baselines, default=list(BASELINES),
                        help="some of flash,cudnn,sage, or none (default all)")
    parser.add_argument("--no-bf16", action="store_true",
                        help="leave out our bf16-input row of the FP8 recipe")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="leave out the quantization-only and attention-only timings")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: D=128, N=1k,4k,16k (unless --dims/--seqlens given)")
    parser.add_argument("--out", action="append", metavar="DIR", default=None, type=output_dir,
                        help="write results here (repeatable; default on a GPU: benchmarks/results;"
                             " on a CPU nothing is written unless given)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG chart")
    parser.add_argument("--warmup", type=ranged(float, 0), default=25.0,
                        help="do_bench warmup in ms")
    parser.add_argument("--rep", type=ranged(float, 0), default=100.0,
                        help="do_bench repetition time in ms")
    parser.add_argument("--min-cosine", type=ranged(float, -1, 1), default=MIN_COSINE,
                        help=f"accuracy check threshold (default {MIN_COSINE})")
    parser.add_argument("--time-budget", type=ranged(float, 0), default=None, metavar="SECONDS",
                        help="stop starting measurements after this long; the rest are recorded "
                             "as skipped (results are saved after every configuration)")
    parser.add_argument("--seed", type=ranged(int, 0, 2**64 - 1), default=0, help="input seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--host", action="store_true",
                        help="time the host path of one call (µs to enqueue it) and count its "
                             "launches instead; without a GPU, Triton's launch path runs with "
                             "the launches stubbed (default D=128, N=1k, non-causal)")
    parser.add_argument("--host-arch", default=None, type=host_arch_arg,
                        help="--host without a GPU: the architecture the call is prepared for "
                             "(default sm_90)")
    parser.add_argument("--host-profile", action="store_true",
                        help="--host: also print the functions that take the host time")
    return parser


def default_results_dir() -> Path:
    """``benchmarks/results`` of the source checkout when running from one, else of the cwd."""
    root = checkout_root()
    return (Path("benchmarks") if root is None else root / "benchmarks") / "results"


def _failures(results: dict) -> list[dict]:
    return [r for r in results["rows"] if r["kind"] in ("ours", "cpu_reference", "stage")
            and (r.get("check") == "FAIL" or r["status"] == "error")]


def cli_main(args: argparse.Namespace) -> int:
    """Run ``lowbit-attn bench``; returns the exit status (1 when one of our rows failed its check
    or raised, 2 on bad options)."""
    causal_values = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    try:
        if not args.recipes and not args.baselines:
            raise ValueError("nothing to run: no recipes and no baselines")
        if not args.host and (args.host_arch is not None or args.host_profile):
            raise ValueError("--host-arch and --host-profile go with --host")
        for name in args.recipes:
            for d in args.dims or ():  # the default dims fit every recipe
                if name in RECIPES:
                    checks.recipe_fits(RECIPES[name], d)
        if torch.cuda.is_available():
            methods = select_methods(args.recipes, args.baselines, bf16=not args.no_bf16,
                                     breakdown=not args.no_breakdown)
        else:
            for r in args.recipes:
                if r != "auto" and r not in RECIPES:
                    raise ValueError(f"unknown recipe {r!r}; expected one of {sorted(RECIPES)}")
            methods = cpu_methods(args.recipes)
    except ValueError as exc:
        print(f"lowbit-attn bench: error: {exc}", file=sys.stderr)
        return 2
    if args.host:
        return _cli_host(args, causal_values)
    plot = not args.no_plot
    if not torch.cuda.is_available():
        return _cli_cpu(args, methods, causal_values, plot)

    dims = args.dims or list(QUICK_DIMS if args.quick else DIMS)
    seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    batch, heads = args.batch or BATCH, args.heads or HEADS
    out_dirs = [Path(p) for p in (args.out or [default_results_dir()])]

    def save(partial):
        partial["metadata"]["quick"] = bool(args.quick)
        for o in out_dirs:
            write_results(partial, o, plot=False)

    print(f"lowbit-attn bench on {torch.cuda.get_device_name()}: D={dims}, N={seqlens}, "
          f"causal={args.causal}, B={batch}, H={heads}, "
          f"{len(methods)} methods", file=sys.stderr)
    results = run_benchmark(
        dims=dims, seqlens=seqlens, causal_values=causal_values, batch=batch,
        heads=heads, methods=methods, device="cuda", warmup_ms=args.warmup, rep_ms=args.rep,
        min_cosine=args.min_cosine, seed=args.seed, time_budget_s=args.time_budget,
        on_config_done=save, progress=not args.no_progress,
    )
    results["metadata"]["quick"] = bool(args.quick)
    written = []
    for o in out_dirs:
        written += write_results(results, o, plot=plot)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return _finish(results)


HOST_BARS = (25.0, 3)  # host µs and launches per call (issue 27)


def _cli_host(args, causal_values) -> int:
    from lowbit_attn.tools.bench import host

    if not args.recipes:
        print("lowbit-attn bench: error: --host times our recipes; none given", file=sys.stderr)
        return 2
    if "exact" in args.recipes and not torch.cuda.is_available():
        print("lowbit-attn bench: error: --host without a GPU times the kernels' launch path; "
              "recipe 'exact' has no kernel on a CPU (it runs PyTorch there)", file=sys.stderr)
        return 2
    arch = args.host_arch or "sm_90"
    if not torch.cuda.is_available():
        capability = parse_arch(arch)
        try:  # the recipes that architecture can run, as a call there checks them
            for r in args.recipes:
                checks.recipe_runs_here(resolve(r, capability), torch.device("cuda"), capability,
                                        target=f"--host-arch {arch}")
        except ValueError as exc:
            print(f"lowbit-attn bench: error: {exc}", file=sys.stderr)
            return 2
    configs = [dict(recipe=r, b=args.batch or BATCH, h=args.heads or HEADS, n=n, d=d, causal=c)
               for r in args.recipes for d in args.dims or [128]
               for n in args.seqlens or [1024] for c in (causal_values if args.causal != "both"
                                                         else [False])]
    rows = host.measure(configs, arch=arch, profile=args.host_profile)
    print(host.render(rows))
    us, launches = HOST_BARS
    for r in rows:
        ok = r["host_us"] <= us and r["launches"] <= launches
        print(f"{'meets' if ok else 'misses'} the bars (host_us <= {us:g}, launches <= "
              f"{launches}): {r['recipe']} D={r['D']} N={r['N']} causal={r['causal']}")
    return 0


def _cli_cpu(args, methods, causal_values, plot) -> int:
    b, h = args.batch or CPU_SIZE["batch"], args.heads or CPU_SIZE["heads"]
    dims, seqlens = args.dims or CPU_SIZE["dims"], args.seqlens or CPU_SIZE["seqlens"]
    backend = backend_for(torch.device("cpu"))
    what = ("the PyTorch reference" if backend == "reference"
            else "the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
    print(
        f"No CUDA device: timing {what} on the CPU at B={b}, H={h}, N={seqlens}, D={dims} for "
        f"{', '.join(m.recipe for m in methods)}.\nThese are CPU reference timings, NOT kernel "
        "benchmarks; the benchmark protocol needs a CUDA GPU (run `lowbit-attn bench` there).",
        file=sys.stderr,
    )
    results = run_benchmark(
        dims=dims, seqlens=seqlens, causal_values=causal_values, batch=b, heads=h,
        methods=methods, device="cpu", min_cosine=args.min_cosine, seed=args.seed,
        time_budget_s=args.time_budget, mode="cpu-reference", progress=False,
    )
    for o in args.out or []:
        for p in write_results(results, o, plot=plot):
            print(f"wrote {p}", file=sys.stderr)
    print("CPU reference timings (ms per call; not kernel benchmarks):")
    for r in results["rows"]:
        if r["status"] == "ok":
            print(f"  {r['label']:<40} causal={str(r['causal']):<5} {r['time_ms']:9.3f} ms  "
                  f"cos {r['cosine']:.6f} {r['check']}")
        else:
            print(f"  {r['label']:<40} causal={str(r['causal']):<5} {r['status']}: {r['reason']}")
    return _finish(results)


def _finish(results: dict) -> int:
    failed = _failures(results)
    for r in failed:
        why = (f"check failed (cosine {r['cosine']})" if r.get("check") == "FAIL"
               else f"{r['status']}: {r['reason']}")
        print(f"FAILED {r['method']} D={r['D']} N={r['N']} causal={r['causal']}: {why}",
              file=sys.stderr)
    print()
    print(render_short_table(results))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lowbit-attn bench",
        description="Time lowbit_attn.attention against SDPA (flash, cuDNN) and SageAttention.",
    )
    add_arguments(parser)
    return cli_main(parser.parse_args(argv))

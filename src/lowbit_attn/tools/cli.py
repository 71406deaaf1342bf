"""The ``lowbit-attn`` command.

Subcommands:
    inspect   compile a recipe's kernels for a GPU target (no GPU needed) and show their tensor-core
              instructions, registers and spills
    doctor    versions, the GPU, the environment switches, and how each recipe would run here
    accuracy  error of each recipe against exact attention (``lowbit_attn.tools.accuracy``)
    bench     speed of each recipe and the baselines (``lowbit_attn.tools.bench``)

Only the chosen subcommand's dependencies are imported: ``lowbit-attn --help`` stays instant.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import platform
import re
import sys
from typing import Callable, Sequence

from lowbit_attn.core.arch import native_fp4
from lowbit_attn.core.checks import MAX_HEAD_DIM
from lowbit_attn.tools.args import UsageError, head_dim_arg, output_dir, ranged

# Subcommands implemented in other modules: name → (module, help). Each module exports
# ``add_arguments(parser)`` and ``cli_main(args) -> int``.
EXTERNAL = {
    "accuracy": ("lowbit_attn.tools.accuracy", "error of each recipe against exact attention"),
    "bench": ("lowbit_attn.tools.bench", "speed of each recipe and the baselines"),
}
ENV_VARS = ("LOWBIT_ATTN_ARCH", "LOWBIT_ATTN_BACKEND", "LOWBIT_ATTN_TRAIN_DQ", "LOWBIT_ATTN_BWD_KERNEL", "LOWBIT_ATTN_KERNEL",
            "LOWBIT_ATTN_AUTOTUNE", "LOWBIT_ATTN_LAUNCH", "LOWBIT_ATTN_CACHE", "TRITON_INTERPRET")
DTYPES = ("float16", "bfloat16", "float32")
# core.options.KERNELS but measured, spelled out: --help imports nothing heavy
KERNELS = ("triton", "gluon", "sm90")
# The targets of ``lowbit_attn.tools.aot.ARCHS``, spelled out so that ``--help`` imports nothing heavy.
ARCH_HELP = "sm_80, sm_86, sm_89, sm_90a, sm_100a or sm_120a"


# ---------------------------------------------------------------------------------------------
# inspect


def _arch_arg(value: str) -> str:
    """argparse type for ``--arch``: normalized (``sm_90`` → ``sm_90a``) or a usage error."""
    from lowbit_attn.tools.aot import normalize_arch

    try:
        return normalize_arch(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_inspect(sub) -> None:
    from lowbit_attn.core.recipes import RECIPES, SAGEBWD_INT8

    p = sub.add_parser(
        "inspect", help="compile a recipe's kernels for a GPU target and show what they use",
        description="Compile, on this machine, the kernels one attention call with RECIPE "
        "launches, for ARCH, and print each kernel's tensor-core instructions (from the PTX) and "
        "its registers and spills (from ptxas -v).",
    )
    p.add_argument("--arch", required=True, type=_arch_arg, metavar="ARCH",
                   help=f"GPU target: {ARCH_HELP}")
    names = [*RECIPES, SAGEBWD_INT8.name, VSA, *KV_RECIPES]
    p.add_argument("--recipe", default="auto", choices=["auto", *names], metavar="NAME",
                   help=f"one of {', '.join(names)} ({SAGEBWD_INT8.name}: the trainable "
                   f"attention's forward and backward; {VSA}: video sparse attention's fine stage, "
                   "its tiling, 16-bit forward and backward and 8-bit forward; "
                   f"{' and '.join(KV_RECIPES)}: one query's read of the quantized KV cache, the "
                   "split and merge kernels), or 'auto' (the default: what ARCH gets by default)")
    p.add_argument("--head-dim", type=head_dim_arg, default=128,
                   help=f"head dim D, 1 to {MAX_HEAD_DIM} (default 128)")
    p.add_argument("--causal", action="store_true", help="the causal variant")
    p.add_argument("--varlen", action="store_true",
                   help="the packed-sequence call (attention_varlen) of an inference recipe")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="input dtype")
    p.add_argument("--return-lse", action="store_true", help="include what return_lse=True adds")
    p.add_argument("--config", type=ranged(int, 0), default=0,
                   help="which autotuning config of ARCH's family to compile, of those the "
                   "autotuner may pick for the call (its prune filter, keyed by head dim; "
                   "default 0)")
    p.add_argument("--kernel", choices=KERNELS, default="triton",
                   help="triton (default): every kernel of one call; gluon: with an INT8 "
                   "recipe as sm90, with an FP4 recipe the Gluon FP4 forward for sm_100a "
                   "(D 128) with its gates (the softmax partition's loop, how long each product "
                   "runs under it, the MMA warp); sm90: the one-warpgroup forward for sm_90a "
                   "(qk_int8_pv_fp8 or qk_int8_pv_fp16, D 64 or 128, 128-key blocks) with "
                   "per-thread and per-token scales, each with its gate (P̃·V from registers, no "
                   "shared-memory store in the loop, no spills, at most 8.0 instructions per "
                   "score, at least 2 CTAs per SM); with --recipe sagebwd_int8 or vsa, sm90 also "
                   "means the Gluon backward loops for sm_90a (LOWBIT_ATTN_BWD_KERNEL=sm90), "
                   "each with its issue and tensor cycles per tile")
    p.add_argument("--window", type=_window_arg, metavar="LEFT,RIGHT",
                   help="an inference recipe's sliding window (attention's window=, -1 for an "
                   "unbounded side)")
    p.add_argument("--chunk", type=ranged(int, 1), help="chunked local attention (chunk=)")
    p.add_argument("--softcap", type=ranged(float, 0.0), help="logit soft-capping (softcap=)")
    p.add_argument("--sinks", action="store_true", help="one sink logit per head (sinks=)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("--ptx-dir", metavar="DIR", type=output_dir,
                   help="also write each kernel's PTX into DIR")
    p.set_defaults(handler=functools.partial(_inspect, parser=p))


VSA = "vsa"  # inspect's name for the video sparse attention kernels
KV_RECIPES = ("kv_int8_fp8", "kv_int8_int8")  # kvcache.recipes.KV_RECIPES, spelled out
WIDE_N = 64  # the gate of the training and VSA kernels: no spills, every product a wgmma this wide


def _gate_line(report) -> str:
    """The training/VSA gate of one kernel: no spills, every tensor-core product a wgmma of
    N ≥ :data:`WIDE_N` (issues 28 and 30)."""
    narrow = report.narrow_products(WIDE_N)
    misses = []
    if report.spills:
        misses.append(f"spills {report.spills} B")
    if narrow:
        misses.append("narrower products: " + ", ".join(
            f"{report.instructions[f]} x {f.removeprefix('wgmma.mma_async.sync.aligned.')}"
            for f in narrow))
    verdict = "passes" if report.ok and not misses else "misses"
    return (f"  gate          {verdict} (no spills, every product a wgmma of N >= {WIDE_N})"
            + (f": {'; '.join(misses)}" if misses else ""))


def _format_report(report) -> list[str]:
    lines = [f"{report.kernel}  [{report.variant}]",
             f"  launch        {report.num_warps} warps, {report.num_stages} stages"]
    if report.error is not None:
        lines.append(f"  error         {_last_line(report.error)}")
    if report.registers is not None:
        lines.append(
            f"  registers     {report.registers}; spills {report.spill_stores} B stored, "
            f"{report.spill_loads} B loaded; stack frame {report.stack_frame} B; "
            f"shared memory {report.shared_memory} B"
        )
    if report.ptx:
        if report.instructions:
            lines.append("  tensor cores")
            lines += [f"    {count:3d} x {form}" for form, count in report.instructions.items()]
        else:
            lines.append("  tensor cores  none")
    loops = _attention_loops(report)
    if loops:
        lines.append("  key loops     " + "; ".join(
            f"{per_score:.2f} per score ({per_tile} per tile)" for per_tile, per_score in loops)
            + " (instructions per thread, in program order)")
    return lines


def _attention_loops(report) -> list[tuple[int, float]]:
    """The INT8 attention kernel's key-block loops (:func:`lowbit_attn.tools.sass.attention_loops`);
    none for other kernels, or where no cubin or disassembler is at hand."""
    from lowbit_attn.tools import sass

    c = report.constexprs
    if report.kernel != "_attn_fwd_int8_kernel" or not report.ok or not report.cubin:
        return []
    try:
        return sass.attention_loops(report.cubin, block_m=c["BLOCK_M"], block_n=c["BLOCK_N"],
                                    num_warps=report.num_warps)
    except (OSError, RuntimeError):  # no cuobjdump: the other lines still stand
        return []


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _write_ptx(reports, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for i, r in enumerate(reports):
        if r.ptx:
            with open(os.path.join(directory, f"{i:02d}_{r.kernel}_{r.arch}.ptx"), "w") as f:
                f.write(r.ptx)


def _inspect(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    import torch
    import triton

    from lowbit_attn.tools import aot
    from lowbit_attn.core.arch import parse_arch
    from lowbit_attn.core.recipes import resolve

    from lowbit_attn.core import checks, triton_support
    from lowbit_attn.core.recipes import RECIPES, TRAIN_RECIPES
    from lowbit_attn.tools import fp4_gates

    variant_given = (args.window, args.chunk, args.softcap, args.sinks) != (None,) * 3 + (False,)
    if variant_given and (args.kernel != "triton" or args.recipe not in (*RECIPES, "auto")
                          or args.recipe == "exact"):
        parser.error(f"--window, --chunk, --softcap, --sinks: the Triton kernels of an inference "
                     f"recipe only, got --recipe {args.recipe} --kernel {args.kernel}")
    if args.recipe in KV_RECIPES:
        return _inspect_decode(args, parser)
    if args.varlen and (args.kernel != "triton" or args.recipe == VSA
                        or args.recipe in TRAIN_RECIPES and args.recipe not in RECIPES):
        parser.error(f"--varlen: the Triton kernels of an inference recipe only, got --recipe "
                     f"{args.recipe} --kernel {args.kernel}")
    if args.kernel == "sm90" and args.recipe in (VSA, *TRAIN_RECIPES):
        if not triton_support.gluon_available("hopper"):
            parser.error(triton_support.gluon_refusal("hopper", "--kernel sm90"))
        return _inspect_bwd_sm90(args, parser)
    if args.kernel != "triton":
        fp4 = _fp4_recipe(args)
        api = "hopper" if fp4 is None else "blackwell"
        if not triton_support.gluon_available(api):
            parser.error(triton_support.gluon_refusal(api, f"--kernel {args.kernel}"))
        if fp4 is not None:
            return _inspect_gluon_fp4(args, parser, fp4)
        return _inspect_sm90(args, parser)  # gluon: Hopper's Gluon forward is the sm90 one
    gated = False  # the training and VSA kernels get the wide-wgmma gate's line
    try:
        if args.recipe == VSA:
            name, reports = VSA, _compile_vsa(args, parser)
            gated = True
        elif args.recipe in TRAIN_RECIPES and args.recipe not in RECIPES:  # "exact" is both
            recipe = TRAIN_RECIPES[args.recipe]
            name, gated = recipe.name, True
            reports = aot.compile_train(recipe, args.arch, head_dim=args.head_dim,
                                        causal=args.causal, dtype=getattr(torch, args.dtype),
                                        config=args.config)
        else:
            recipe = resolve(args.recipe, parse_arch(args.arch))
            checks.recipe_runs_here(recipe, torch.device("cuda"), parse_arch(args.arch),
                                    target=f"--arch {args.arch}")
            name = recipe.name
            reports = aot.compile_recipe(
                recipe, args.arch, head_dim=args.head_dim, causal=args.causal,
                dtype=getattr(torch, args.dtype), return_lse=args.return_lse, config=args.config,
                varlen=args.varlen, variant=_variant(args),
            )
    except ValueError as exc:
        parser.error(str(exc))
    if args.ptx_dir:
        _write_ptx(reports, args.ptx_dir)
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2, default=str))
    else:
        mode = ("causal" if args.causal else "non-causal") + (", varlen" if args.varlen else "")
        print(f"{name} for {args.arch} (head dim {args.head_dim}, {mode}, {args.dtype}); "
              f"Triton {triton.__version__}, ptxas {aot.ptxas_version(args.arch)}")
        if not reports:
            print(f"recipe {name!r} launches no Triton kernel (PyTorch computes it)")
        for r in reports:
            print()
            print("\n".join(_format_report(r) + ([_gate_line(r)] if gated else [])
                            + fp4_gates.format_gates(r, fp4_gates.triton_gates(r))))
        if gated:
            passed = sum(_gate_line(r).startswith("  gate          passes") for r in reports)
            print(f"\ngate: {passed} of {len(reports)} kernels pass (no spills, every product a "
                  f"wgmma of N >= {WIDE_N})")
    return 1 if any(not r.ok for r in reports) else 0


def _window_arg(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two ints), got {text!r}") from None
    return left, right


def _variant(args: argparse.Namespace):
    """The :class:`~lowbit_attn.core.variants.Variant` of inspect's --window, --chunk, --softcap
    and --sinks, validated as the public calls validate them."""
    import torch

    from lowbit_attn.core import variants

    try:
        return variants.check(is_causal=args.causal, window=args.window, softcap=args.softcap,
                              chunk=args.chunk, sinks=torch.zeros(2) if args.sinks else None,
                              hq=2, device=torch.device("cpu"))
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def _inspect_decode(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``inspect --recipe kv_int8_fp8|kv_int8_int8``: the kernels of one query's read of the
    quantized KV cache (``kvcache/kernel_decode.py``: split, merge), GQA 8, 64-token pages, a
    ``--dtype`` cache."""
    import torch

    from lowbit_attn.tools import aot

    for flag in ("causal", "varlen", "return_lse"):
        if getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')}: the KV cache's read has no such variant")
    if args.kernel != "triton" or args.config != 0:
        parser.error(f"--recipe {args.recipe}: the Triton kernels, one launch configuration each")
    reports = aot.compile_decode(args.recipe, args.arch, head_dim=args.head_dim,
                                 dtype=getattr(torch, args.dtype))
    heading = (f"{args.recipe} for {args.arch}, the KV cache's read (head dim {args.head_dim}, "
               f"one query, GQA 8, {args.dtype} cache)")
    return _show_gated(args, heading, reports, [None] * len(reports), [""] * len(reports),
                       lambda report, gates: [])


def _compile_vsa(args: argparse.Namespace, parser: argparse.ArgumentParser,
                 bwd_kernel: str = "triton") -> list:
    """``inspect --recipe vsa``: the fine stage's kernels, 16-bit forward and backward (on
    ``bwd_kernel``) with the tiling, then the 8-bit forward (``qk_int8_pv_fp8``) with its own;
    each specialization once."""
    import torch

    from lowbit_attn.tools import aot

    if args.causal:
        parser.error("--causal: video sparse attention is not causal")
    if args.dtype not in ("float16", "bfloat16"):
        parser.error(f"--dtype {args.dtype}: the video sparse attention kernels take float16 or "
                     "bfloat16")
    dtype = getattr(torch, args.dtype)
    reports, seen = [], set()
    for recipe in ("exact", "qk_int8_pv_fp8"):
        for r in aot.compile_vsa(args.arch, args.head_dim, dtype, args.config, recipe=recipe,
                                 bwd_kernel=bwd_kernel):
            if (r.kernel, r.variant) not in seen:
                seen.add((r.kernel, r.variant))
                reports.append(r)
    return reports


def _fp4_recipe(args: argparse.Namespace):
    """The FP4 recipe ``--recipe`` names on ``--arch``, or ``None``."""
    from lowbit_attn.core.arch import parse_arch
    from lowbit_attn.core.recipes import RECIPES, resolve

    if not (args.recipe == "auto" or args.recipe in RECIPES):
        return None
    recipe = resolve(args.recipe, parse_arch(args.arch))
    return recipe if recipe.qk in ("nvfp4", "mxfp4") else None


def _gluon_fp4_scope_error(args: argparse.Namespace) -> str | None:
    """Why ``--kernel gluon`` cannot compile the Gluon FP4 forward as asked, or ``None``."""
    if args.kernel != "gluon":
        return f"--kernel {args.kernel}: the FP4 recipes have one Gluon forward, --kernel gluon"
    if args.arch != "sm_100a":
        return f"--kernel gluon: the Gluon FP4 forward is written for sm_100a only, got --arch {args.arch}"
    if args.head_dim != 128:
        return f"--kernel gluon: the Gluon FP4 forward takes head dim 128, got --head-dim {args.head_dim}"
    if args.config != 0:
        return f"--kernel gluon: the Gluon FP4 forward has one launch configuration, got --config {args.config}"
    return None


def _inspect_gluon_fp4(args: argparse.Namespace, parser: argparse.ArgumentParser, recipe) -> int:
    """``inspect --kernel gluon`` with an FP4 recipe: the Blackwell Gluon forward (64-key
    blocks) with its gates (``tools/fp4_gates.py``)."""
    import torch
    import triton

    from lowbit_attn.tools import aot, fp4_gates

    error = _gluon_fp4_scope_error(args)
    if error is not None:
        parser.error(error)
    report = aot.compile_launch(aot.record_fp4_gluon_launch(
        recipe=recipe.name, head_dim=args.head_dim, block_k=64, causal=args.causal,
        return_lse=args.return_lse, dtype=getattr(torch, args.dtype)), args.arch)
    gates = fp4_gates.gluon_gates(report)
    if args.ptx_dir:
        _write_ptx([report], args.ptx_dir)
    if args.json:
        print(json.dumps([{**report.as_dict(), "gates": gates}], indent=2, default=str))
    else:
        mode = "causal" if args.causal else "non-causal"
        print(f"{recipe.name} for {args.arch}, Gluon FP4 forward (head dim {args.head_dim}, "
              f"{mode}, {args.dtype}, 64-key blocks); Triton {triton.__version__}, ptxas "
              f"{aot.ptxas_version(args.arch)}")
        print()
        print("\n".join(_format_report(report) + fp4_gates.format_gates(report, gates)))
    return 0 if report.ok else 1


def _gluon_scope_error(args: argparse.Namespace) -> str | None:
    """Why ``--kernel gluon`` (or ``sm90``) cannot compile what the other options ask for, or
    ``None``."""
    from lowbit_attn.core.arch import parse_arch
    from lowbit_attn.core.recipes import QK_INT8_PV_FP8, QK_INT8_PV_FP16, RECIPES, resolve
    from lowbit_attn.inference.sm90_check import HEAD_DIMS

    if args.arch != "sm_90a":
        return (f"--kernel {args.kernel}: the Gluon forward is written for sm_90a only, got --arch "
                f"{args.arch}")
    inference = args.recipe == "auto" or args.recipe in RECIPES  # not the trainable recipes
    recipe = resolve(args.recipe, parse_arch(args.arch)) if inference else None
    if recipe not in (QK_INT8_PV_FP8, QK_INT8_PV_FP16):
        return (f"--kernel {args.kernel}: the Gluon forward runs the {QK_INT8_PV_FP8.name} and "
                f"{QK_INT8_PV_FP16.name} recipes only, got --recipe {args.recipe}")
    if args.head_dim not in HEAD_DIMS:
        return (f"--kernel {args.kernel}: the Gluon forward takes head dim 64 or 128, got --head-dim "
                f"{args.head_dim}")
    if args.config != 0:
        return (f"--kernel {args.kernel}: the Gluon forward has one launch configuration, got --config "
                f"{args.config}")
    return None


def _show_gated(args: argparse.Namespace, heading: str, reports: list, gates: list, titles: list,
                format_gates) -> int:
    """Print compiled reports with their gates (``--json``, ``--ptx-dir`` as asked): ``heading``
    (followed by Triton's and ptxas's versions), then each report under its title (``""``: none)
    with ``format_gates(report, gates)``'s lines; exit code 1 if one did not compile."""
    import triton

    from lowbit_attn.tools import aot

    if args.ptx_dir:
        _write_ptx(reports, args.ptx_dir)
    if args.json:
        print(json.dumps([{**r.as_dict(), "gates": g} for r, g in zip(reports, gates)], indent=2,
                         default=str))
    else:
        print(f"{heading}; Triton {triton.__version__}, ptxas {aot.ptxas_version(args.arch)}")
        for title, r, g in zip(titles, reports, gates):
            print(f"\n{title}" if title else "")
            print("\n".join(_format_report(r) + format_gates(r, g)))
    return 1 if any(not r.ok for r in reports) else 0


def _inspect_sm90(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``inspect --kernel sm90`` (or ``gluon``) with an INT8 recipe: the one-warpgroup Hopper
    forward with per-thread and per-token scales, each with its gate (``tools/sm90_gates.py``)."""
    import torch

    from lowbit_attn.core.arch import parse_arch
    from lowbit_attn.core.recipes import resolve
    from lowbit_attn.inference.kernel_int8_sm90 import GRANULARITIES
    from lowbit_attn.tools import aot, sm90_gates

    error = _gluon_scope_error(args)
    if error is not None:
        parser.error(error)
    recipe = resolve(args.recipe, parse_arch(args.arch))
    reports = [aot.compile_launch(aot.record_sm90_launch(
        head_dim=args.head_dim, causal=args.causal, return_lse=args.return_lse,
        dtype=getattr(torch, args.dtype), pv=recipe.pv, granularity=granularity), args.arch)
        for granularity in GRANULARITIES]
    mode = "causal" if args.causal else "non-causal"
    heading = (f"{recipe.name} for {args.arch}, one-warpgroup Gluon forward (head dim "
               f"{args.head_dim}, 128-key blocks, {mode}, {args.dtype})")
    return _show_gated(args, heading, reports, [sm90_gates.gates(r) for r in reports],
                       [f"{g} scales" for g in GRANULARITIES], sm90_gates.format_gates)


def _inspect_bwd_sm90(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``inspect --kernel sm90`` with ``--recipe sagebwd_int8`` or ``--recipe vsa``: every kernel
    of one call with
    the Gluon backward loops for Hopper (``LOWBIT_ATTN_BWD_KERNEL=sm90``), each with the
    training/VSA gate, and the loops' issue and tensor cycles per tile (``tools/bwd_gates.py``)."""
    import torch

    from lowbit_attn.core.recipes import TRAIN_RECIPES
    from lowbit_attn.tools import aot, bwd_gates

    if args.arch != "sm_90a":
        parser.error(f"--kernel sm90: the Gluon backward is written for sm_90a, got --arch {args.arch}")
    if args.head_dim not in (64, 128):
        parser.error(f"--kernel sm90: the Gluon backward takes head dim 64 or 128, got "
                     f"--head-dim {args.head_dim}")
    if args.dtype not in ("float16", "bfloat16"):
        parser.error(f"--dtype {args.dtype}: the backward kernels take float16 or bfloat16")
    mode = "causal" if args.causal else "non-causal"
    dtype = getattr(torch, args.dtype)
    if args.recipe == VSA:
        reports = _compile_vsa(args, parser, bwd_kernel="sm90")
        heading = f"{VSA} fine stage for {args.arch}, Gluon backward (head dim {args.head_dim}, "
    else:
        recipe = TRAIN_RECIPES[args.recipe]
        reports = aot.compile_train(recipe, args.arch, head_dim=args.head_dim, causal=args.causal,
                                    dtype=dtype, config=args.config, bwd_kernel="sm90")
        heading = (f"{recipe.name} (P and dS {recipe.backward_granularity.replace('_', ' ')}) for "
                   f"{args.arch}, Gluon backward "
                   f"(head dim {args.head_dim}, {mode}, ")
    gates = [bwd_gates.gates(r) if r.kernel in bwd_gates.KERNELS else None for r in reports]
    code = _show_gated(args, heading + f"{args.dtype})", reports, gates, [""] * len(reports),
                       lambda r, g: [_gate_line(r)] + bwd_gates.format_gates(r, g))
    if not args.json:
        passed = sum(_gate_line(r).startswith("  gate          passes")
                     and (g is None or g["passes"]) for r, g in zip(reports, gates))
        print(f"\ngate: {passed} of {len(reports)} kernels pass (no spills, every product a "
              f"wgmma of N >= {WIDE_N}; the backward loops: issue <= "
              f"{bwd_gates.MAX_ISSUE_RATIO}x tensor cycles per tile)")
    return code


# ---------------------------------------------------------------------------------------------
# doctor


# What the Triton versions in play can express for FP4 (AOT compiles with 3.6; DESIGN.md for 3.9).
FP4_SUPPORT = (
    "native: tl.dot_scaled with NVFP4's E4M3 group-16 scales and MXFP4's E8M0 group-32 scales",
    "  compiles to tcgen05.mma ... block_scale (sm_100) and mma.sync ... kind::mxf4nvf4 (sm_120)",
    "  with Triton 3.6 (lowbit-attn inspect --arch sm_120a --recipe qk_fp4_pv_fp4)",
    "emulated: before sm_100 (Triton 3.6 cannot compile an NVFP4 dot_scaled for sm_90) and under",
    "  the interpreter (no dot_scaled), the kernel unpacks FP4 and applies the scales itself:",
    "  the same function, exact products, no FP4 speed-up",
)


def recipe_status(recipe, device_type: str, capability, backend: str) -> str:
    """How ``recipe`` runs for tensors on ``device_type`` (``"cuda"``/``"cpu"``):

    ``"reference"`` (PyTorch: the exact recipe, the reference backend, CPU tensors by default),
    ``"interpreter"`` (Triton kernels on the CPU under ``TRITON_INTERPRET=1``), ``"native"``
    (Triton kernels on tensor cores: INT8 needs sm_80+, FP8 P·V sm_89+, FP4 sm_100+), ``"emulated"``
    (FP4 recipes before sm_100: the same kernel, FP4 unpacked to bf16), ``"unsupported (...)"``
    (a GPU without them: Triton 3.6 cannot compile the kernel) or ``"no GPU"``.
    """
    if device_type == "cuda" and capability is None:
        return "no GPU"
    if recipe.is_exact or backend == "reference":
        return "reference"
    if device_type == "cpu":
        return "interpreter (FP4 emulated)" if recipe.is_fp4 else "interpreter"
    if recipe.is_fp4 and tuple(capability) >= (8, 0):
        return "native (FP4 tensor cores)" if native_fp4(capability) else "emulated (bf16 MMA)"
    need = (8, 9) if recipe.pv == "fp8" else (8, 0)
    if tuple(capability) >= need:
        return "native"
    return f"unsupported (needs sm_{need[0]}{need[1]}+)"


def _optional_version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        return "not installed" if isinstance(exc, ModuleNotFoundError) else f"broken ({exc})"
    return str(getattr(mod, "__version__", "installed"))


def _gpu_lines(torch) -> tuple[list[tuple[str, str]], tuple[int, int] | None]:
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001 - a broken driver is a finding, not a crash
        return [("CUDA", f"error: {exc}")], None
    if not available:
        return [("CUDA", "not available"), ("GPU", "none")], None
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    return [("CUDA", f"available (torch built with CUDA {torch.version.cuda})"),
            ("GPU", f"{name}, capability {cap[0]}.{cap[1]}")], cap


def _backend(arch_mod, device_type: str) -> str:
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # no Triton: the triton line says so, without a traceback
            warnings.simplefilter("ignore", UserWarning)
            return arch_mod.backend_for(torch.device(device_type))
    except (ValueError, RuntimeError) as exc:
        return f"error: {exc}"


def _env_value(name: str, has_triton: bool) -> str:
    """A variable's value for doctor, ``(unset)``, or the value and the error a call that reads it
    will raise (LOWBIT_ATTN_ARCH's has its own line, ``target arch``; LOWBIT_ATTN_BACKEND's the
    backend lines)."""
    from lowbit_attn.core import options

    value = os.environ.get(name)
    if value is None:
        return "(unset)"
    choices = {variable: modes for variable, modes in options.VARIABLES.values()}
    if name == "LOWBIT_ATTN_AUTOTUNE" and has_triton:
        from lowbit_attn.core.triton_helpers import AUTOTUNE

        choices[name] = AUTOTUNE
    if name in choices and value not in choices[name]:
        return f"{value}  (error: must be one of {', '.join(choices[name])})"
    return value


def _doctor(args: argparse.Namespace) -> int:
    import torch

    from lowbit_attn import __version__
    from lowbit_attn.core import arch as arch_mod, triton_support
    from lowbit_attn.core.recipes import RECIPES, auto_recipe

    has_triton = triton_support.triton_installed()
    why = triton_support.triton_import_error()
    triton_row = (triton_support.installed_version() if has_triton else
                  "not installed (wheels for Linux only): every call runs the reference path"
                  if why == "not installed" else f"{why}: every call runs the reference path")
    rows = [("lowbit_attn", __version__), ("python", platform.python_version()),
            ("torch", torch.__version__), ("triton", triton_row)]
    gpu_rows, physical = _gpu_lines(torch)
    rows += gpu_rows
    try:
        target = arch_mod.get_capability()
        rows.append(("target arch", arch_mod.arch_name(target) if target else "none"))
    except ValueError as exc:
        target = None
        rows.append(("target arch", f"error: {exc}"))
    rows += [(name, _env_value(name, has_triton)) for name in ENV_VARS]
    backends = {d: _backend(arch_mod, d) for d in ("cuda", "cpu")}
    rows += [("CUDA tensors", backends["cuda"]), ("CPU tensors", backends["cpu"])]
    width = max(len(k) for k, _ in rows) + 2
    for key, value in rows:
        print(f"{key:<{width}}{value}")

    if has_triton:
        print(f"\non Triton {triton_support.installed_version()}")
        for part, status in triton_support.parts():
            print(f"  {part:<38}{status}")

    print("\nrecipes (CUDA tensors / CPU tensors)")
    cuda_cap = target if physical is not None else None  # the target arch, on a real GPU only
    for name, recipe in RECIPES.items():
        cuda = recipe_status(recipe, "cuda", cuda_cap, backends["cuda"])
        cpu = recipe_status(recipe, "cpu", None, backends["cpu"])
        print(f"  {name:<18}{cuda} / {cpu}")
    on_cuda = auto_recipe(cuda_cap).name if cuda_cap is not None else "no GPU"
    print(f"  {'auto':<18}{on_cuda} / {auto_recipe(None).name}")

    mode = arch_mod.fp4_mode("cuda" if cuda_cap is not None else "cpu",
                             backends["cuda" if cuda_cap is not None else "cpu"], cuda_cap)
    print(f"\nFP4 (qk_fp4_pv_fp4, qk_mxfp4_pv_mxfp4) here: {mode}")
    for line in FP4_SUPPORT:
        print(f"  {line}")

    print("\noptional")
    for module in ("sageattention", "matplotlib"):
        print(f"  {module:<18}{_optional_version(module)}")
    return 0


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="versions, GPU, environment and how each recipe runs here",
                       description="Report versions, the GPU, the LOWBIT_ATTN_*/TRITON_INTERPRET "
                       "switches, the backend of CUDA and CPU tensors and how each recipe runs.")
    p.set_defaults(handler=_doctor)


# ---------------------------------------------------------------------------------------------
# accuracy / bench (other modules)


def _external_handler(module, parser: argparse.ArgumentParser) -> Callable:
    def handler(args: argparse.Namespace) -> int:
        try:
            result = module.cli_main(args)
        except UsageError as exc:
            parser.error(str(exc))
        return int(result or 0)

    return handler


def _import_external(name: str):
    """The module behind subcommand ``name``; raises ``ImportError`` with a readable message."""
    module_name = EXTERNAL[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"lowbit-attn {name}: cannot import {module_name} ({exc})") from exc
    for attr in ("add_arguments", "cli_main"):
        if not callable(getattr(module, attr, None)):
            raise ImportError(f"lowbit-attn {name}: {module_name} has no {attr}()")
    return module


def _add_external(sub, name: str, chosen: str | None) -> None:
    """Add subcommand ``name``; its module is imported (and its options defined) only when it is
    the subcommand being run."""
    module_name, help_text = EXTERNAL[name]
    p = sub.add_parser(name, help=help_text, description=f"{help_text} ({module_name})")
    if name == chosen:
        module = _import_external(name)
        module.add_arguments(p)
        p.set_defaults(handler=_external_handler(module, p))


# ---------------------------------------------------------------------------------------------


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The ``lowbit-attn`` parser; ``argv`` tells which external subcommand to load options for."""
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="lowbit-attn",
        description="Low-bit attention for PyTorch: inspect the kernels a recipe compiles to, "
        "check this machine, measure accuracy and speed.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_inspect(sub)
    _add_doctor(sub)
    for name in EXTERNAL:
        _add_external(sub, name, chosen)
    return parser


def _joined_negative_pairs(argv: list[str]) -> list[str]:
    """``--window -1,0`` as ``--window=-1,0``: argparse reads a value that starts with ``-`` and
    is not one number as an option."""
    out = []
    for arg in argv:
        if out and out[-1] == "--window" and re.fullmatch(r"-\d+,\s*-?\d+", arg):
            out[-1] = f"--window={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lowbit-attn``; returns the exit status (0 on success)."""
    argv = _joined_negative_pairs(list(sys.argv[1:] if argv is None else argv))
    try:
        parser = build_parser(argv)
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

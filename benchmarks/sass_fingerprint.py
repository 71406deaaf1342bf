"""Fingerprints of every kernel the package compiles, to show that a refactor leaves the compiled
code alone: for each architecture, recipe, head dim, causal and LSE variant (and the trainable and
VSA kernels), the registers, spills, shared memory and SASS opcode histogram (ahead of time, on
the CPU).

    python benchmarks/sass_fingerprint.py record before.json     # on the old tree (PYTHONPATH)
    python benchmarks/sass_fingerprint.py record after.json
    python benchmarks/sass_fingerprint.py compare before.json after.json

About 25 minutes for ~1,200 specializations on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

ARCHS = ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a")
RECIPES = ("qk_int8_pv_fp16", "qk_int8_pv_fp8", "qk_fp4_pv_fp4", "qk_mxfp4_pv_mxfp4")
# opcodes whose counts say what a kernel computes (the rest load parameters, move and pad)
WORK = ("HMMA", "IMMA", "QGMMA", "IGMMA", "HGMMA", "UTCQMMA", "UTCIMMA", "UTCHMMA", "UTCOMMA",
        "MUFU", "FFMA", "FMUL", "FADD", "LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR")


def _opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
    return re.split(r"[\s.]", text)[0]


def record(path: str) -> None:
    from lowbit_attn.tools import aot, sass

    out = {}

    def add(tag, reports):
        for r in reports:
            key = f"{tag}|{r.kernel}|{json.dumps(r.constexprs, sort_keys=True, default=str)}"
            ins = sass.disassemble(r.cubin) if r.cubin else []
            out[key] = dict(registers=r.registers, spills=r.spills, smem=r.shared_memory,
                            instructions=len(ins) if ins else None, error=(r.error or "")[:200],
                            opcodes=dict(collections.Counter(_opcode(t) for _, t in ins)))

    for arch in ARCHS:
        for recipe in RECIPES:
            for d in (64, 128):
                for causal in (False, True):
                    for lse in (False, True):
                        add(f"{arch}|{recipe}|{d}|{causal}|{lse}", aot.compile_recipe(
                            recipe, arch, head_dim=d, causal=causal, return_lse=lse))
        for d in (64, 128):
            for causal in (False, True):
                add(f"{arch}|train|{d}|{causal}", aot.compile_train(arch=arch, head_dim=d,
                                                                      causal=causal))
            add(f"{arch}|vsa|{d}", aot.compile_vsa(arch=arch, head_dim=d))
        print(arch, len(out), file=sys.stderr, flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)


def compare(before_path: str, after_path: str) -> int:
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    if set(before) != set(after):
        print(f"different specializations: {len(set(before) ^ set(after))}")
    per_arch = collections.defaultdict(collections.Counter)
    changed_work = []
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        c = per_arch[key.split("|")[0]]
        c["kernels"] += 1
        if a["error"] or b["error"]:
            c["failed before"] += bool(a["error"])
            c["failed after"] += bool(b["error"])
            continue
        for field in ("registers", "spills", "smem", "instructions"):
            c[f"{field} changed"] += a[field] != b[field]
        c["instructions +/-"] += abs(a["instructions"] - b["instructions"])
        c["registers up"] += b["registers"] > a["registers"]
        work = {op: (a["opcodes"].get(op, 0), b["opcodes"].get(op, 0)) for op in WORK
                if a["opcodes"].get(op, 0) != b["opcodes"].get(op, 0)}
        if work:
            changed_work.append((key, work))
    for arch, c in sorted(per_arch.items()):
        print(arch, ", ".join(f"{k}: {v}" for k, v in c.items()))
    print(f"kernels whose work opcodes ({', '.join(WORK)}) changed: {len(changed_work)}")
    for key, work in changed_work[:20]:
        print(" ", key[:120], work)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("out")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())

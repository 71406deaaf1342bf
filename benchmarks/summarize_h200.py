#!/usr/bin/env python
"""Write ``summary.md`` of a raw results folder: the tables and the ratios that README.md and
``docs/`` cite, computed from the raw files, so every figure there has one source.

    python benchmarks/summarize_h200.py [benchmarks/results/h200-2026-11-27]

Reads ``e2e.json`` (dense forward and training, end to end), ``train.log``
(``benchmarks/bench_train.py``), ``decode-*.md`` (``benchmarks/bench_decode.py``) and ``vsa.md``
(``benchmarks/bench_vsa.py``); the folder's ``README.md`` says device, date and commands.
``tests/test_readme.py`` checks that the summary is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "h200-2026-11-27"

FORWARD = [  # (method in e2e.json, column title)
    ("sdpa_cudnn", "SDPA cuDNN"),
    ("sdpa_flash", "SDPA flash"),
    ("ours_auto", "ours auto (FP8 P·V)"),
    ("ours_int8_fp16", "ours INT8, fp16 P·V"),
    ("ours_gluon_pingpong", "Gluon ping-pong"),
    ("sageattn_1.0.6", "SageAttention 1.0.6"),
]
TRAIN_LINE = re.compile(r"D=(\d+) N=(\d+) (full|causal)\s+(\S+)\s+([\d.]+) ms\s+([\d.]+) TOP/s")


def _n(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _range(values: list[float], digits: int) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def forward(rows: list[dict]) -> list[str]:
    configs = list(dict.fromkeys((r["B"], r["H"], r["N"], r["D"], r["causal"])
                                 for r in rows if not r["method"].startswith("train_")))
    tops = {(r["B"], r["H"], r["N"], r["D"], r["causal"], r["method"]): r["TOPS"] for r in rows}
    out = ["## Dense forward (e2e.json)", "",
           "End to end (quantization and host path included), fp16, `do_bench`; TOP/s = "
           "4·B·H·N²·D / t, halved when causal:", "",
           "| B×H, N, D, causal | " + " | ".join(t for _, t in FORWARD) + " |",
           "|---" * (len(FORWARD) + 1) + "|"]
    for b, h, n, d, causal in configs:
        cells = [f"{tops[(b, h, n, d, causal, m)]:.0f}" for m, _ in FORWARD]
        out.append(f"| {b}×{h}, {_n(n)}, {d}, {'yes' if causal else 'no'} | "
                   + " | ".join(cells) + " |")
    out += ["", "## Dense forward against SDPA cuDNN (e2e.json)", "",
            "| B×H, N, D, causal | auto ÷ cuDNN | INT8 fp16 P·V ÷ cuDNN | faster of ours |",
            "|---|---|---|---|"]
    auto_ratio, fp16_ratio, fp16_wins = [], [], 0
    for b, h, n, d, causal in configs:
        cudnn = tops[(b, h, n, d, causal, "sdpa_cudnn")]
        a, f = tops[(b, h, n, d, causal, "ours_auto")], tops[(b, h, n, d, causal, "ours_int8_fp16")]
        auto_ratio.append(a / cudnn)
        fp16_ratio.append(f / cudnn)
        fp16_wins += f > a
        out.append(f"| {b}×{h}, {_n(n)}, {d}, {'yes' if causal else 'no'} | {a / cudnn:.2f}× | "
                   f"{f / cudnn:.2f}× | {'INT8 fp16 P·V' if f > a else 'auto'} |")
    out += ["", f"`auto` end to end: {_range(auto_ratio, 2)}× SDPA cuDNN; `qk_int8_pv_fp16`: "
            f"{_range(fp16_ratio, 2)}×; `qk_int8_pv_fp16` faster than `auto` in {fp16_wins} of "
            f"{len(configs)} rows.", ""]
    return out


def training(rows: list[dict], log: str) -> list[str]:
    runs = [(int(d), int(n), kind, method, ms, float(t))
            for d, n, kind, method, ms, t in TRAIN_LINE.findall(log)]
    out = ["## Training, forward + backward (train.log, e2e.json)", "",
           "`benchmarks/bench_train.py --quick`, bf16; TOP/s with a 3.5× FLOP factor:", "",
           "| D, N, mask | method | ms | TOP/s | ÷ SDPA cuDNN |", "|---|---|---|---|---|"]
    cudnn = {(d, n, k): t for d, n, k, m, _, t in runs if m == "sdpa_cudnn"}
    ours, ratios, exact, flash = [], [], [], []
    for d, n, kind, method, ms, t in runs:
        ratio = t / cudnn[(d, n, kind)]
        out.append(f"| {d}, {_n(n)}, {kind} | {method} | {ms} | {t} | {ratio:.2f}× |")
        if kind == "full" and method.startswith("sagebwd"):
            ours.append(t)
        if method.startswith("sagebwd"):
            ratios.append(ratio)
        if kind == "full" and method == "ours_exact_16bit":
            exact.append(t)
        if kind == "full" and method == "sdpa_flash":
            flash.append(t)
    full_cudnn = [t for (d, n, k), t in cudnn.items() if k == "full"]
    out += ["", f"Without a mask: SageBwd {_range(ours, 0)} TOP/s, our 16-bit kernels "
            f"{_range(exact, 0)}, SDPA flash {_range(flash, 0)}, SDPA cuDNN {_range(full_cudnn, 0)}; "
            f"SageBwd ÷ SDPA cuDNN {_range(ratios, 2)}× (every row above).", ""]
    train = [r for r in rows if r["method"].startswith("train_")]
    if train:
        out += ["e2e.json, B=2 H=16 N=8k D=128 bf16:", "",
                "| causal | method | ms | TOP/s | ÷ SDPA cuDNN |", "|---|---|---|---|---|"]
        for r in train:
            base = next(x["TOPS"] for x in train
                        if x["causal"] == r["causal"] and x["method"] == "train_sdpa_cudnn")
            out.append(f"| {'yes' if r['causal'] else 'no'} | {r['method']} | {r['ms']} | "
                       f"{r['TOPS']} | {r['TOPS'] / base:.2f}× |")
        out.append("")
    return out


def _table(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def decode(text: str) -> list[str]:
    rows = [r for r in _table(text) if r["method"] == "kv_int8_fp8"]
    out = ["## Decode, one step against the 8-bit cache (decode-*.md)", ""]
    for batch in sorted({r["batch"] for r in rows}, key=int):
        mine = [r for r in rows if r["batch"] == batch]
        out.append(f"Batch {batch}: {_range([float(r['× SDPA fp16']) for r in mine], 2)}× SDPA "
                   f"fp16, {_range([float(r['TB/s']) for r in mine], 2)} TB/s "
                   f"(N = {', '.join(r['N'] for r in mine)}).")
    return out + [""]


def vsa(text: str) -> list[str]:
    rows = _table(text)
    out = ["## Video sparse attention (vsa.md)", ""]
    for r in rows:
        if r["method"] == "vsa" and r["passes"] == "fwd+bwd":
            out.append(f"Sparsity {float(r['sparsity']) * 100:g} %: {r['× cuDNN dense']}× SDPA "
                       f"cuDNN dense, forward + backward; computed tiles at {r['TOP/s (computed tiles)']} TOP/s.")
    return out + [""]


def summary(folder: Path) -> str:
    e2e = json.loads((folder / "e2e.json").read_text())
    rows, date = e2e["rows"], re.search(r"\d{4}-\d{2}-\d{2}", folder.name)
    out = [f"# {e2e['device']}, {date.group(0) if date else folder.name}: summary", "",
           f"Written by `python benchmarks/summarize_h200.py {folder.relative_to(folder.parents[2])}` "
           "from the raw files beside it (their device, date and commands: `README.md` here). "
           "Do not edit by hand.", ""]
    out += forward(rows)
    if (folder / "train.log").is_file():
        out += training(rows, (folder / "train.log").read_text())
    for path in sorted(folder.glob("decode-*.md")):
        out += decode(path.read_text())
    if (folder / "vsa.md").is_file():
        out += vsa((folder / "vsa.md").read_text())
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", default=DEFAULT)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when summary.md differs from what would be written")
    args = parser.parse_args(argv)
    folder = args.folder.resolve()
    text = summary(folder)
    target = folder / "summary.md"
    if args.check:
        return 0 if target.is_file() and target.read_text() == text else 1
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The summary of a ``run_on_gpu.sh decide`` / ``decide2`` run (issue 43): one JSON and one
markdown file in OUTDIR, ``<stage>.json`` and ``<stage>.md``, with the device, the date, the
command, each step's limit, time and exit status, issues 43's and 44's bars beside the measured values,
the admission checks' timings, and the benchmark scripts' own results (their JSON embedded,
their tables appended: the files that come back from the device machine are few). Rewritten
after every step, so a run cut short still leaves it. No torch import: it runs in a second.

    python benchmarks/probes/stage_summary.py STAGE OUTDIR STEPS.tsv COMMAND [RESULT_DIR ...]

STEPS.tsv: one line per step, ``name<TAB>limit s<TAB>started at s<TAB>took s<TAB>exit status``
(``skipped`` for a step with no time left); ``admission-*.json`` (benchmarks/probes/
admission_time.py) and ``{forward,train,vsa,decode,splits,prep,first}-*.json`` / ``.md`` are
read from the RESULT_DIRs, the newest of each kind.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

FIRST_CALL_BAR = 2.0  # s: what admission adds to a first call (issue 43)
TRAIN_BAR = 1.0  # × SDPA flash, forward + backward, D=128, N ≥ 4k
DECODE_BAR = 1.0  # × SDPA (fp16 K/V), one decode step, batch 1, N = 8k and 32k
WINDOW_BAR = 1.2  # a sliding-window layer's step ÷ a full layer of what it sees (issue 44)
KINDS = ("forward", "train", "vsa", "decode", "splits", "prep", "first")


def _bar(name, value, target, higher=True) -> dict:
    met = None if value is None else (value >= target if higher else value <= target)
    return {"bar": name, "value": value, "target": target, "met": met}


def first_bars(data: dict) -> list[dict]:
    """Each case of ``first_call.py``: a cold first call per head dim and LOWBIT_ATTN_COMPILE
    (its warm rows, a new shape in a later process, have no bar)."""
    return [_bar(f"first call of a new shape, cold Triton cache, D={r['d']}, "
                 f"LOWBIT_ATTN_COMPILE={r['mode']}, s", r.get("first_call_s"), FIRST_CALL_BAR,
                 higher=False)
            for r in data.get("rows", []) if r.get("cache", "cold") == "cold"]


def train_bars(data: dict) -> list[dict]:
    """Each of our methods' worst ``SDPA flash ms / ours ms`` over D=128, N ≥ 4k, causal or not."""
    ok = [r for r in data.get("rows", []) if r.get("status") == "ok"]
    flash = {(r["n"], r["causal"]): r["ms"] for r in ok
             if r["method"] == "sdpa_flash" and r["d"] == 128}
    ours = sorted({r["method"] for r in ok if not r["method"].startswith("sdpa")})
    out = []
    for method in ours:
        speeds = [flash[(r["n"], r["causal"])] / r["ms"] for r in ok if r["method"] == method
                  and r["d"] == 128 and r["n"] >= 4096 and (r["n"], r["causal"]) in flash]
        out.append(_bar(f"training {method} x SDPA flash, D=128 N>=4k (worst)",
                        min(speeds, default=None), TRAIN_BAR))
    return out


def decode_bars(data: dict) -> list[dict]:
    """Per N of 8k and 32k at batch 1: the worst (over GQA) ``SDPA ms / ours ms`` of the
    attention alone (the rows timed by ``do_bench``: ``ms``; not the whole steps, timed by their
    loop only, nor the sliding-window rows); the same for the read replayed by its launch plan
    (``kv_int8_fp8 plan``, the default's time once the plan GPU tests pass; a row whose plan was
    not replayed is left out). Then issue 44's: per N and batch with ``kv_int8_fp8 window W``
    rows, the worst (over GQA) ``window ms / last W+1 ms``."""
    ok = [r for r in data.get("rows", []) if r.get("status") == "ok" and "ms" in r
          and r.get("plan_replayed", True)]
    out = []
    for method, how in (("kv_int8_fp8", ""), ("kv_int8_fp8 plan", ", LOWBIT_ATTN_LAUNCH=plan")):
        for n in (8192, 32768):
            speeds = []
            for gqa in sorted({r["gqa"] for r in ok if r["N"] == n and r["batch"] == 1}):
                same = [r for r in ok if (r["N"], r["batch"], r["gqa"]) == (n, 1, gqa)]
                sdpa = [r["ms"] for r in same if r["method"] == "sdpa_fp16"]
                ours = [r["ms"] for r in same if r["method"] == method]
                if sdpa and ours:
                    speeds.append(min(sdpa) / min(ours))
            out.append(_bar(f"decode batch 1 N={n // 1024}k x SDPA (worst GQA){how}",
                            min(speeds, default=None), DECODE_BAR))
    windowed = {}
    for r in ok:
        if r["method"].startswith("kv_int8_fp8 window "):
            seen = int(r["method"].rsplit(" ", 1)[1]) + 1
            last = [x["ms"] for x in ok if x["method"] == f"kv_int8_fp8 last {seen}"
                    and (x["N"], x["batch"], x["gqa"]) == (r["N"], r["batch"], r["gqa"])]
            if last:
                key = (r["method"].rsplit(" ", 1)[1], r["N"], r["batch"])
                windowed[key] = max(windowed.get(key, 0.0), r["ms"] / last[0])
    for (window, n, batch), ratio in sorted(windowed.items(), key=lambda x: (x[0][1], x[0][2])):
        out.append(_bar(f"decode window {window} at N={n // 1024}k batch {batch} ÷ its last "
                        f"{int(window) + 1} tokens alone (worst GQA)", ratio, WINDOW_BAR,
                        higher=False))
    return out


def split_rows(data: dict) -> list[dict]:
    """Per (N, batch, GQA) of ``bench_decode.py --splits``: the production split's ms and × SDPA
    fp16, the fastest candidate's split (keys per split, or parts), ms and × production; then
    the split fastest on every row, if one is (no target: it becomes the architecture's
    ``DECODE_SPLITS`` entry, NOTES §13d)."""
    ok = [r for r in data.get("rows", []) if r.get("status") == "ok" and "ms" in r]
    out, winners = [], []
    for config in dict.fromkeys((r["N"], r["batch"], r["gqa"]) for r in ok):
        here = [r for r in ok if (r["N"], r["batch"], r["gqa"]) == config]
        tried = [r for r in here if "split_label" in r]
        if not tried:
            continue
        name = f"decode split, N={config[0] // 1024}k batch {config[1]} GQA {config[2]}"
        sdpa = [r["ms"] for r in here if r["method"] == "sdpa_fp16"]
        made = [r for r in tried if r.get("production")]
        if made:
            speed = f", {sdpa[0] / made[0]['ms']:.2f}x SDPA" if sdpa else ""
            out.append({"bar": f"{name}: production ({made[0]['split_label']}) ms{speed}",
                        "value": made[0]["ms"], "target": None, "met": None})
        best = min(tried, key=lambda r: r["ms"])
        winners.append(best["split_label"])
        gain = f", {made[0]['ms'] / best['ms']:.2f}x production" if made else ""
        speed = f", {sdpa[0] / best['ms']:.2f}x SDPA" if sdpa else ""
        out.append({"bar": f"{name}: fastest, {best['split_label']}, ms{gain}{speed}",
                    "value": best["ms"], "target": None, "met": None})
    if winners:
        every = winners[0] if len(set(winners)) == 1 else "none"
        out.append({"bar": f"decode split fastest on every row: {every}",
                    "value": None, "target": None, "met": None})
    return out


def prep_rows(data: dict) -> list[dict]:
    """Per shape of ``prep_speed.py``: each launch's ms (statistics, quantizing), with × its floor.
    No target: issue 43's end-to-end bars hold them."""
    timed = [r for r in data.get("rows", []) if "error" not in r and r.get("ms") == r.get("ms")]
    return [{"bar": f"{r['name']} {r['shape']}: ms "
                    f"(x its floor {r.get('x_floor', float('nan')):.1f})",
             "value": r["ms"], "target": None, "met": None}
            for r in timed if r["name"] in ("stats", "quantize K, Q, V")]


def admission_bars(data: dict) -> list[dict]:
    """A first call's admission with no verdict and a later process's stored-verdict read
    (``first_call``, ``disk``): the 2 s bar. The check's own time, cold and warm, off the
    critical path: reported, no bar (benchmarks/probes/admission_time.py)."""
    out = []
    for when, what in (("first_call", "first call with no verdict"),
                       ("disk", "later process, verdict on disk")):
        got = data.get(when)
        out.append(_bar(f"{data.get('kernel')} admission, {what}, s",
                        None if got is None else got["s"], FIRST_CALL_BAR, higher=False))
    for when in ("cold", "warm"):
        got = data.get(when)
        verdict = "not run" if got is None else (got["verdict"] or "admitted")
        out.append({"bar": f"{data.get('kernel')} check itself (in the background), {when} "
                           f"Triton cache, s ({verdict})",
                    "value": None if got is None else got["s"], "target": None, "met": None})
    return out


def newest(dirs: list[Path], pattern: str) -> Path | None:
    found = [p for d in dirs for p in d.glob(pattern)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def summarize(stage: str, outdir: Path, steps_file: Path, command: str,
              dirs: list[Path]) -> dict:
    steps = []
    if steps_file.exists():
        for line in steps_file.read_text().splitlines():
            name, limit, started, took, rc = (line.split("\t") + [""] * 5)[:5]
            steps.append({"step": name, "limit_s": limit, "started_s": started, "took_s": took,
                          "exit": rc})
    summary = {"stage": stage, "command": command,
               "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "device": None, "steps": steps, "bars": [], "admission": [], "results": {}}
    tables = []
    for path in sorted({p for d in dirs for p in d.glob("admission-*.json")}):
        data = json.loads(path.read_text())
        summary["admission"].append(data)
        summary["bars"] += admission_bars(data)
        summary["device"] = summary["device"] or data.get("device")
    for kind in KINDS:
        path = newest(dirs, f"{kind}-*.json")
        if path is None:
            continue
        data = json.loads(path.read_text())
        summary["results"][kind] = data
        summary["device"] = summary["device"] or data.get("device_name")
        summary["bars"] += {"forward": lambda x: x.get("bars", []), "train": train_bars,
                            "decode": decode_bars, "splits": split_rows, "vsa": lambda x: [],
                            "prep": prep_rows, "first": first_bars}[kind](data)
        table = path.with_suffix(".md")
        if table.exists():
            tables.append(f"## {kind} ({path.name}{'' if data.get('complete', True) else ', partial'})"
                          f"\n\n{table.read_text()}")
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{stage}.json").write_text(json.dumps(summary, indent=1, default=str))
    lines = [f"# run_on_gpu.sh {stage}", "",
             f"Device: {summary['device'] or 'unknown'}; {summary['date_utc']}; command: "
             f"`{command}`", "", "| step | limit s | started at s | took s | exit |",
             "|---|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['limit_s']} | {s['started_s']} | {s['took_s']} | {s['exit']} |"
              for s in steps]
    lines += ["", "| bar (issues 43, 44) | value | target | met |", "|---|---|---|---|"]
    for b in summary["bars"]:
        value = "—" if b["value"] is None else f"{b['value']:.4g}"
        met = {True: "yes", False: "no", None: "—"}[b["met"]]
        target = "—" if b["target"] is None else b["target"]
        lines.append(f"| {b['bar']} | {value} | {target} | {met} |")
    (outdir / f"{stage}.md").write_text("\n".join(lines + [""] + tables) + "\n")
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stage, outdir, steps, command, *dirs = argv
    summarize(stage, Path(outdir), Path(steps), command, [Path(d) for d in dirs])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The results as markdown tables: throughput, speedups, stage breakdown, accuracy and memory, what
was not measured; and the short table the command prints."""

from __future__ import annotations

from lowbit_attn.tools.bench.protocol import CUDNN_KEY, FLASH_KEY, SAGE_KEY, target_for


def config_keys(rows):
    """``(D, causal, N)`` of each configuration in ``rows``, in order of appearance."""
    seen = []
    for r in rows:
        key = (r["D"], r["causal"], r["N"])
        if key not in seen:
            seen.append(key)
    return seen


def row_index(rows):
    """``{(method, D, causal, N): row}``."""
    return {(r["method"], r["D"], r["causal"], r["N"]): r for r in rows}


def columns(rows, kinds):
    """``(method, label)`` of the methods of ``kinds`` in ``rows``, in order of appearance."""
    cols = []
    for r in rows:
        if r["kind"] in kinds and (r["method"], r["label"]) not in cols:
            cols.append((r["method"], r["label"]))
    return cols


def seqlen_label(n: int) -> str:
    """``4096`` → ``"4k"``; lengths that are not a multiple of 1024 as they are."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _cfg_name(r: dict) -> str:
    return f"D={r['D']} N={seqlen_label(r['N'])} {'causal' if r['causal'] else 'non-causal'}"


def _fmt_tops(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _cell_tops(r: dict | None) -> str:
    if r is None:
        return ""
    st = r["status"]
    if st != "ok":
        return {"oom": "oom", "unsupported": "n/a", "error": "err", "skipped": "—"}.get(st, st)
    if r["kind"] == "cpu_reference" or r.get("tops") is None:
        text = f"{r['time_ms']:.3f} ms"
    else:
        text = _fmt_tops(r["tops"])
    return text + (" ✗" if r.get("check") == "FAIL" else "")


def speedup(ours: dict | None, base: dict | None) -> float | None:
    """``t_base / t_ours`` when both ran."""
    if not ours or not base or ours["status"] != "ok" or base["status"] != "ok":
        return None
    return base["time_ms"] / ours["time_ms"]


def _cell_speedup(ours, base) -> str:
    s = speedup(ours, base)
    if s is None:
        return "—"
    return f"{s:.2f}×" + (" ✗" if ours.get("check") == "FAIL" else "")


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def status_table(header: list[str], rows, key_cells, cells) -> str:
    """A markdown table with one line per row: ``key_cells(r)``, the cells that name the row, then
    ``cells(r)`` for a row that ran (status ``"ok"``), else its status and empty cells."""
    lines = _table(header, [])
    for r in rows:
        key = key_cells(r)
        if r["status"] != "ok":
            lines.append("| " + " | ".join(key + [r["status"]]) + " |"
                         + " |" * (len(header) - len(key) - 1))
        else:
            lines.append("| " + " | ".join(key + cells(r)) + " |")
    return "\n".join(lines)


def _cfg_cells(d, causal, n):
    return [str(d), "yes" if causal else "no", seqlen_label(n)]


def render_markdown(results: dict) -> str:
    """The results as markdown: throughput, speedups, stage breakdown, accuracy and memory, and
    every skipped or failed measurement with its reason."""
    meta, rows = results["metadata"], results["rows"]
    idx = row_index(rows)
    configs = config_keys(rows)
    v = meta.get("versions", {})
    proto = meta.get("protocol", {})
    cpu = meta.get("device") != "cuda"
    out = [f"# lowbit_attn attention benchmark — {meta.get('device_name', '?')}"
           + (f" ({meta['arch']})" if meta.get("arch") else ""), ""]
    if cpu:
        out += ["**CPU reference timings of the PyTorch reference at a tiny size, not kernel "
                "benchmarks.**", ""]
    if not results.get("complete", True):
        out += ["**Partial results: the run did not finish.**", ""]
    out += [
        f"- date (UTC): {meta.get('date_utc')}; host: {meta.get('hostname')}; source: "
        f"{meta.get('git') or 'not a git checkout'}",
        f"- versions: torch {v.get('torch')}, triton {v.get('triton')}, lowbit_attn "
        f"{v.get('lowbit_attn')}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, sageattention "
        f"{v.get('sageattention')}",
        f"- command: `{meta.get('command')}`",
        f"- B={proto.get('B')}, H={proto.get('H')}, layout HND; timer: {proto.get('timer')}",
        f"- TOP/s = {proto.get('tops')}; timed: {proto.get('timed')}",
        f"- inputs: {proto.get('inputs')}; check: {proto.get('check')} (✗ = failed)",
        "",
    ]
    main_cols = columns(rows, ("ours", "sdpa", "sage", "cpu_reference"))
    ours_cols = columns(rows, ("ours", "cpu_reference"))
    out += ["## Throughput (TOP/s)", ""]
    body = [_cfg_cells(*c) + [_cell_tops(idx.get((m, *c))) for m, _ in main_cols] for c in configs]
    out += _table(["D", "causal", "N"] + [lbl for _, lbl in main_cols], body) + [""]

    bases = [(k, lbl) for k, lbl in (
        (CUDNN_KEY, "cuDNN bf16"), (FLASH_KEY, "flash"), (SAGE_KEY, "sage")
    ) if any(r["method"] == k for r in rows)]
    if ours_cols and bases:
        pairs = []  # (our key, baseline key, header): every recipe vs cuDNN bf16, the first vs all
        for i, (m, olbl) in enumerate(ours_cols):
            for k, blbl in bases:
                if i == 0 or k == CUDNN_KEY:
                    pairs.append((m, k, f"{olbl} ÷ {blbl}"))
        has_cudnn = any(k == CUDNN_KEY for k, _ in bases)
        out += ["## Speedup of ours (t_baseline / t_ours)", ""]
        header = ["D", "causal", "N"] + [h for _, _, h in pairs]
        header += ["target ÷ cuDNN bf16"] if has_cudnn else []
        body = []
        for c in configs:
            cells = _cfg_cells(*c)
            cells += [_cell_speedup(idx.get((m, *c)), idx.get((k, *c))) for m, k, _ in pairs]
            if has_cudnn:
                t = target_for(c[2])
                cells.append("—" if t is None else f"≥ {t:.2f}×")
            body.append(cells)
        out += _table(header, body) + [""]

    stage_cols = columns(rows, ("stage",))
    if stage_cols:
        out += ["## Where the time goes (ms; quantization passes and attention kernel alone)", ""]
        header = ["D", "causal", "N"]
        cols = []
        for m, lbl in ours_cols:
            if any(s.startswith(m + "_") for s, _ in stage_cols):
                cols.append((m, f"{lbl}: end to end"))
        cols += stage_cols
        body = []
        for c in configs:
            cells = _cfg_cells(*c)
            for m, _ in cols:
                r = idx.get((m, *c))
                if r is None or r["status"] != "ok":
                    cells.append(_cell_tops(r) if r else "")
                else:
                    text = f"{r['time_ms']:.3f}"
                    if r.get("gbps") is not None:
                        text += f" ({r['gbps']:.0f} GB/s)"
                    elif r["kind"] == "stage" and r.get("tops") is not None:
                        text += f" ({_fmt_tops(r['tops'])} TOP/s)"
                    cells.append(text + (" ✗" if r.get("check") == "FAIL" else ""))
            body.append(cells)
        out += _table(header + [lbl for _, lbl in cols], body) + [""]

    acc_cols = main_cols + [c for c in stage_cols if not c[0].endswith("_prepare")]
    out += ["## Accuracy (cosine similarity vs reference) and peak extra memory (MiB)", ""]
    body = []
    for c in configs:
        cells = _cfg_cells(*c)
        for m, _ in acc_cols:
            r = idx.get((m, *c))
            if r is None or r.get("cosine") is None:
                cells.append("—" if r is None or r["status"] == "ok" else _cell_tops(r))
                continue
            text = f"{r['cosine']:.6f}" + (" ✗" if r.get("check") == "FAIL" else "")
            if r.get("peak_extra_mib") is not None:
                text += f" / {r['peak_extra_mib']:.0f}"
            cells.append(text)
        body.append(cells)
    out += _table(["D", "causal", "N"] + [lbl for _, lbl in acc_cols], body) + [""]
    refs = sorted({r["reference"] for r in rows if r.get("reference")})
    if refs:
        out += [f"Reference: {', '.join(refs)} on the same input values.", ""]

    failed = [r for r in rows if r["status"] == "ok" and r.get("check") == "FAIL"]
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            groups.setdefault((r["label"], r["status"], r.get("reason")), []).append(_cfg_name(r))
    if failed or groups:
        out += ["## Not measured, or failed", ""]
        for r in failed:
            out.append(f"- {r['label']}, {_cfg_name(r)}: **check failed** — cosine "
                       f"{r['cosine']:.6f}, non-finite {r['nonfinite']}, rel L1 {r['rel_l1']:.4g}")
        for (label, status, reason), where in groups.items():
            out.append(f"- {label}, {', '.join(where)}: **{status}** — {reason}")
        out.append("")
    return "\n".join(out)


def render_short_table(results: dict) -> str:
    """One line per configuration: TOP/s of our recipes and the baselines, the first recipe's
    speedup over cuDNN bf16 against the target, the worst cosine of our rows and the check."""
    rows = results["rows"]
    idx = row_index(rows)
    cols = columns(rows, ("ours", "sdpa", "sage", "cpu_reference"))
    ours = columns(rows, ("ours", "cpu_reference"))
    has_cudnn = any(r["method"] == CUDNN_KEY for r in rows)
    header = ["D", "causal", "N"] + [lbl.replace("qk_int8_pv_", "") for _, lbl in cols]
    if ours and has_cudnn:
        header += [f"{ours[0][1].replace('qk_int8_pv_', '')} ÷ cuDNN bf16", "target"]
    header += ["min cos (ours)", "check"]
    body = []
    for c in config_keys(rows):
        cells = _cfg_cells(*c) + [_cell_tops(idx.get((m, *c))) for m, _ in cols]
        if ours and has_cudnn:
            first = idx.get((ours[0][0], *c))
            s = speedup(first, idx.get((CUDNN_KEY, *c)))
            t = target_for(c[2])
            cells.append("—" if s is None else f"{s:.2f}×")
            if t is None or s is None:
                cells.append("—" if t is None else f"≥{t:.2f}")
            else:
                cells.append(f"≥{t:.2f} {'met' if s >= t else 'MISSED'}")
        mine = [r for r in rows if (r["D"], r["causal"], r["N"]) == c
                and r["kind"] in ("ours", "cpu_reference", "stage")]
        coss = [r["cosine"] for r in mine if r.get("cosine") is not None]
        cells.append(f"{min(coss):.6f}" if coss else "—")
        failed = [r for r in mine if r.get("check") == "FAIL" or r["status"] == "error"]
        cells.append("FAIL: " + ", ".join(r["method"] for r in failed) if failed else
                     ("pass" if coss else "—"))
        body.append(cells)
    return "\n".join(_table(header, body))

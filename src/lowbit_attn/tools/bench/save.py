"""Results files: ``<gpu-slug>-<YYYY-MM-DD>.json`` (``{"metadata": {...}, "rows": [...],
"complete": bool}``), the markdown tables ``.md`` and the chart ``.png``; and what the benchmark
scripts save."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

import torch

from lowbit_attn.tools.bench.plots import plot_results
from lowbit_attn.tools.bench.tables import render_markdown


def save_script_results(outs: Iterable[str], kind: str, results: dict, table: str) -> None:
    """``<kind>-<device>-<date>.json`` (``results``: metadata and rows) and ``.md`` (``table``) in
    each directory of ``outs`` (created if needed): what the benchmark scripts save."""
    for out in outs:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        stem = f"{kind}-{slug(results['device_name'])}-{results['date']}"
        (path / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
        (path / f"{stem}.md").write_text(provenance(results) + "\n\n" + table + "\n")


def provenance(results: dict) -> str:
    """The lines a saved table starts with: the device, the date and the command that produced
    it, with the software's versions and the source's revision (from ``make_metadata``)."""
    v = results.get("versions", {})
    return (f"{results.get('mode', 'benchmark')} on {results.get('device_name', 'unknown')}, "
            f"{results.get('date_utc', results.get('date', 'undated'))}\n\n"
            f"Command: `{results.get('command', '?')}` (source {results.get('git') or 'unknown'}; "
            f"torch {v.get('torch', '?')}, Triton {v.get('triton', '?')})")


def slug(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def results_stem(results: dict) -> str:
    meta = results["metadata"]
    if meta.get("device") == "cuda":
        name = slug(meta.get("device_name", "gpu"))
    else:
        name = "cpu-reference"
    stem = f"{name}-{meta.get('date', 'undated')}"
    if meta.get("quick"):
        stem += "-quick"
    return stem


def _json_default(x):
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_results(results: dict, out_dir: str | os.PathLike, *, plot: bool = True) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (with ``plot``) ``<stem>.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(results)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    paths[1].write_text(render_markdown(results) + "\n")
    if plot:
        png = plot_results(results, out_dir / f"{stem}.png")
        if png is not None:
            paths.append(png)
    return paths

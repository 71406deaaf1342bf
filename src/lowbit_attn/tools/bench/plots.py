"""The results as a bar chart (matplotlib, imported when a chart is drawn; optional)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lowbit_attn.tools.bench.tables import columns, config_keys, row_index, seqlen_label


def plot_results(results: dict, path: str | os.PathLike) -> Path | None:
    """Grouped bars of TOP/s per method, one panel per (D, causal). Returns the path, or None (with
    a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib, then "
              "python benchmarks/plot.py RESULTS.json)", file=sys.stderr)
        return None
    rows = results["rows"]
    meta = results["metadata"]
    idx = row_index(rows)
    cols = columns(rows, ("ours", "sdpa", "sage", "cpu_reference"))
    configs = config_keys(rows)
    dims = sorted({c[0] for c in configs})
    causals = sorted({c[1] for c in configs})
    fig, axes = plt.subplots(len(dims), len(causals), squeeze=False,
                             figsize=(max(9.0, 6.5 * len(causals)), 3.8 * len(dims)))
    width = 0.8 / max(1, len(cols))
    for i, d in enumerate(dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            ns = [c[2] for c in configs if c[0] == d and c[1] == causal]
            for m_i, (m, lbl) in enumerate(cols):
                xs, ys, hatches = [], [], []
                for x, n in enumerate(ns):
                    r = idx.get((m, d, causal, n))
                    if r and r["status"] == "ok" and r.get("tops") is not None:
                        xs.append(x + (m_i - (len(cols) - 1) / 2) * width)
                        ys.append(r["tops"])
                        hatches.append("xx" if r.get("check") == "FAIL" else "")
                bars = ax.bar(xs, ys, width, label=lbl)
                for bar, h in zip(bars, hatches):
                    bar.set_hatch(h)
            ax.set_xticks(range(len(ns)))
            ax.set_xticklabels([seqlen_label(n) for n in ns])
            ax.set_xlabel("N")
            ax.set_ylabel("TOP/s")
            ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    kind = "CPU reference timings (not kernel benchmarks)" if meta.get("device") != "cuda" else \
        "end to end, quantization included; hatched = failed accuracy check"
    proto = meta.get("protocol", {})
    fig.suptitle(f"{meta.get('device_name')}, {meta.get('date')}, B={proto.get('B')}, "
                 f"H={proto.get('H')}\n{kind}", fontsize="medium")
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(4, max(1, len(labels))), fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path

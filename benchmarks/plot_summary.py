#!/usr/bin/env python
"""Draw one markdown table of a results summary as grouped bars (TOP/s per configuration).

    python benchmarks/plot_summary.py benchmarks/results/h200-2026-11-27/summary.md \\
        --section "Dense forward" -o benchmarks/results/h200-2026-11-27/summary.png

The table is the first one under the ``## `` heading that contains ``--section``: its first column
names the configurations, every other column is one method, each cell a number. The chart's title
is the file's first line and the heading.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def read_table(text: str, section: str) -> tuple[str, list[str], list[list[str]]]:
    """``(heading, header cells, body rows)`` of the first table under the heading naming
    ``section``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("## ") and section in line), None)
    if start is None:
        raise SystemExit(f"no '## ' heading contains {section!r}")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    if len(rows) < 3:
        raise SystemExit(f"no table under {lines[start]!r}")
    return lines[start][3:], rows[0], rows[2:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="a results markdown file")
    parser.add_argument("--section", required=True, help="text of the table's '## ' heading")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG path")
    args = parser.parse_args(argv)
    text = args.summary.read_text()
    heading, header, body = read_table(text, args.section)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = header[1:]
    fig, ax = plt.subplots(figsize=(9, 0.8 * len(body) + 1.8))
    height = 0.8 / len(methods)
    for m, method in enumerate(methods):
        ys = [i + (m - (len(methods) - 1) / 2) * height for i in range(len(body))]
        ax.barh(ys, [float(row[m + 1]) for row in body], height, label=method)
    ax.set_yticks(range(len(body)))
    ax.set_yticklabels([row[0] for row in body])
    ax.invert_yaxis()
    ax.set_xlabel("TOP/s (higher is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{text.splitlines()[0].lstrip('# ')}\n{heading}", fontsize="medium")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    # the provenance under the chart: the summary's own line naming its command, and this one's
    written = next((line for line in text.splitlines() if line.startswith("Written by")), "")
    caption = [written.split(" from the raw files")[0].replace("`", ""),
               f"Drawn by python benchmarks/plot_summary.py {args.summary} --section \"{args.section}\" "
               f"-o {args.output}"]
    fig.text(0.01, -0.01, "\n".join(c for c in caption if c), fontsize="x-small", va="top")
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=100, bbox_inches="tight")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

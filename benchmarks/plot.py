#!/usr/bin/env python
"""Redraw the chart (and, with --markdown, the tables) of a results JSON that ``lowbit-attn bench``
wrote (``--out DIR``; the other benchmarks' files have their own tables).

    lowbit-attn bench --quick --out runs/
    python benchmarks/plot.py runs/RESULTS.json -o chart.png --markdown

The chart is drawn from the JSON alone (no GPU needed): grouped bars of TOP/s per method, one panel
per (head dim, causal); bars of methods that failed the accuracy check are hatched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    from lowbit_attn.tools.bench.plots import plot_results
    from lowbit_attn.tools.bench.tables import render_markdown
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from lowbit_attn.tools.bench.plots import plot_results
    from lowbit_attn.tools.bench.tables import render_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results JSON written by lowbit-attn bench")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="PNG path (default: next to the JSON, same name)")
    parser.add_argument("--markdown", action="store_true",
                        help="also rewrite the markdown tables next to the PNG")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    if not isinstance(results, dict) or not {"metadata", "rows"} <= set(results):
        parser.error(f"{args.results} is not a results file of lowbit-attn bench (it has no "
                     "'metadata' and 'rows'; the other benchmarks write their own tables)")
    png = args.output or args.results.with_suffix(".png")
    if args.markdown:
        md = png.with_suffix(".md")
        md.write_text(render_markdown(results) + "\n")
        print(f"wrote {md}")
    path = plot_results(results, png)
    if path is None:
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

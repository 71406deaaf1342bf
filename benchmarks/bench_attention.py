#!/usr/bin/env python
"""Attention benchmark of DESIGN.md ("Benchmark protocol"): lowbit_attn.attention against SDPA
(flash, cuDNN) and SageAttention 1.0.6, correctness-checked, written to benchmarks/results/.

    python benchmarks/bench_attention.py              # the full protocol (a CUDA GPU)
    python benchmarks/bench_attention.py --quick      # D=128, N=1k,4k,16k
    python benchmarks/bench_attention.py --help

The same as ``lowbit-attn bench``; the code is :mod:`lowbit_attn.tools.bench`. Without CUDA it
times the PyTorch reference at a tiny size and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from lowbit_attn.tools.bench import main
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from lowbit_attn.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())

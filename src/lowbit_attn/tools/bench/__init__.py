"""Attention benchmark: :func:`lowbit_attn.attention` against PyTorch SDPA (FlashAttention-2 and
cuDNN backends) and SageAttention 1.0.6, following the protocol of DESIGN.md.

Read top to bottom: ``protocol`` (configurations, methods, inputs, bars) → ``flops`` (operations
and bytes, TOP/s) → ``calls`` (what each method calls, the SDPA reference) → ``timers`` →
``measure`` (one method on one configuration) → ``metadata`` → ``run`` (the whole grid) →
``tables`` (markdown) → ``plots`` (matplotlib, optional) → ``save`` (JSON, markdown, PNG files) →
``command`` (``lowbit-attn bench``). Without CUDA, ``bench`` times the PyTorch reference at a tiny
size instead and says so; those are not kernel benchmarks.

Entry points: :func:`add_arguments` / :func:`cli_main` (the ``lowbit-attn bench`` subcommand),
:func:`main` (``python -m lowbit_attn.tools.bench``, ``python benchmarks/bench_attention.py``),
:func:`run_benchmark` (library use).
"""

from lowbit_attn.tools.bench.command import add_arguments, cli_main, main
from lowbit_attn.tools.bench.run import run_benchmark

__all__ = ["add_arguments", "cli_main", "main", "run_benchmark"]

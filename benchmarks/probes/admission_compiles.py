"""How many compiles each admission check asks for (issue 43; benchmarks/NOTES.md §18), on a CPU:

    python benchmarks/probes/admission_compiles.py fwd|bwd

Every case of the check's ``CASES`` through its own comparison, with Triton's launch path
stubbed (``tools/bench/host.stubbed_launches``: a launch compiles nothing and runs nothing, one
stub per new specialization) and ``LOWBIT_ATTN_AUTOTUNE=first`` (as the check's child process
runs); prints the specializations per kernel. The comparisons themselves fail (nothing ran):
only the count is meant.
"""

from __future__ import annotations

import collections
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["LOWBIT_ATTN_AUTOTUNE"] = "first"  # before the kernels are imported

import torch  # noqa: E402
from triton.runtime import jit  # noqa: E402

from lowbit_attn.tools.bench import host  # noqa: E402


def main(argv=None) -> int:
    (kind,) = sys.argv[1:] if argv is None else argv
    counts: collections.Counter = collections.Counter()
    with host.stubbed_launches((9, 0)):
        stub = jit.JITFunction._do_compile

        def counting(self, *args, **kwargs):
            counts[self.fn.__name__] += 1
            return stub(self, *args, **kwargs)

        jit.JITFunction._do_compile = counting
        try:
            if kind == "fwd":
                from lowbit_attn.inference import sm90_check as check
            else:
                from lowbit_attn.training import sm90_check as check
            for case in check.CASES:
                try:
                    check._compare(case, torch.device("cpu"))
                except Exception as exc:  # noqa: BLE001 - nothing ran: only the compiles count
                    print(f"{case}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        finally:
            jit.JITFunction._do_compile = stub
    for name, n in sorted(counts.items()):
        print(f"{n:3d} {name}")
    print(f"{sum(counts.values())} compiles for {len(check.CASES)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())

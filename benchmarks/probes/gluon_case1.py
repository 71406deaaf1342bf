"""GPU probe (H100 run of 2026-11-25): one case of the Gluon first-use check (gluon_check.CASES),
by schedule and index, in a process of its own: `python3 gluon_case1.py async 3`."""
import sys, torch
from lowbit_attn.inference import gluon_check as gc
schedule, i = sys.argv[1], int(sys.argv[2])
case = gc.CASES[i]
try:
    r = gc._compare(case, torch.device("cuda", 0), schedule)
    torch.cuda.synchronize()
    print(f"{schedule} case {i} {case}: {r}", flush=True)
except Exception as e:
    print(f"{schedule} case {i} {case}: EXC {type(e).__name__} {str(e)[:120]}", flush=True)

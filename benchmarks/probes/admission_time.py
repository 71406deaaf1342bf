"""What an opt-in kernel's admission check costs a first call (issue 43):

    python benchmarks/probes/admission_time.py fwd|bwd OUT.json     # a GPU: the sm90 checks
    python benchmarks/probes/admission_time.py stub OUT.json        # any machine: a stub check

A call does not wait for the check (``gluon_check.admit``): it reads the verdict stored on disk,
or starts the check in a child process and runs the Triton kernel. On a GPU, with an empty Triton
cache of its own (so an empty folder of verdicts), four times:

- ``first_call``: the first call's admission with no verdict anywhere (the key, a file read that
  finds nothing, the child's spawn): what a first call adds to the Triton kernel's own time;
- ``cold``: from that start to the verdict (``wait_for_admission``): the check itself, every
  compile paid, off the critical path;
- ``disk``: a later process's first call (this process's verdicts forgotten): the stored
  verdict read back;
- ``warm``: the check once more, blocking (``gluon_check.isolated``), Triton's cache now full:
  what a check costs where a verdict is missing but the compiles are cached.

``stub`` times ``first_call`` and ``disk`` on any machine with the GPU's facts made up and a
check that passes at once (the child's spawn is real; its work is off the critical path anyway).
Writes ``{"kernel", "cases", "first_call": {"s", "admitted"}, "cold": {"s", "verdict"},
"disk": {...}, "warm": {...}, "device", "date_utc", "command"}`` to OUT.json after each
measurement (a run cut short keeps what it measured). The verdict is then copied into the Triton
cache the next steps use (``shared_to``), as a user's later process would read it: the benchmarks
after this probe in ``run_on_gpu.sh`` do not pay for the check again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import lowbit_attn  # noqa: F401
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def stub_check(device, *args):
    """The stub's check, which passes (run in the child, which imports this file as
    ``admission_time``)."""


def _stub():
    """``(device, admitted)`` for the stub: a made-up Hopper GPU on whatever this machine is."""
    from lowbit_attn.inference import gluon_check

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p)
    from admission_time import stub_check as check  # the child imports it by this name

    gluon_check.graph_capturing = lambda device: False
    gluon_check._device_facts = lambda device: {"device": "stub", "capability": [9, 0],
                                                "driver": None, "cuda": torch.version.cuda}
    device = torch.device("cuda", 0)
    return device, lambda d: gluon_check.admit(d, "stub", gluon_check.checker(d, check),
                                               "the stub", "the Triton kernel")


def share_verdicts(cache: str | None) -> str:
    """Copy the verdicts this probe stored (``gluon_check.verdict_dir()`` under its own
    ``TRITON_CACHE_DIR``) to where the next processes read them: ``verdict_dir()`` under
    ``TRITON_CACHE_DIR`` as it was (``cache``; None: unset, Triton's default). Returns that
    folder."""
    from lowbit_attn.inference import gluon_check

    own = Path(gluon_check.verdict_dir())
    mine = os.environ.pop("TRITON_CACHE_DIR")
    if cache is not None:
        os.environ["TRITON_CACHE_DIR"] = cache
    try:
        target = Path(gluon_check.verdict_dir())
    finally:
        os.environ["TRITON_CACHE_DIR"] = mine
    target.mkdir(parents=True, exist_ok=True)
    for verdict in own.glob("*"):
        shutil.copy2(verdict, target / verdict.name)
    return str(target)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    kind, out = argv
    shared = os.environ.get("TRITON_CACHE_DIR")
    cache = tempfile.mkdtemp(prefix="admission-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache  # its own, empty, cache (the child inherits it)
    from lowbit_attn.inference import gluon_check

    if kind == "stub":
        device, admitted = _stub()
        result = {"kernel": "stub", "cases": [], "device": f"stub on {os.uname().machine}"}
    else:
        if kind == "fwd":
            from lowbit_attn.inference import sm90_check as check
        else:
            from lowbit_attn.training import sm90_check as check
        device, admitted = torch.device("cuda", 0), check.admitted
        torch.empty(1, device=device)  # CUDA initialized, as at a user's first call
        result = {"kernel": check.KERNEL, "cases": [str(c) for c in check.CASES],
                  "device": torch.cuda.get_device_name(device)}
    result.update(date_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  command=shlex.join(["python", *sys.argv]))

    def done(when, **fields):
        result[when] = fields
        print(f"{result['kernel']} admission, {when}: {fields}", file=sys.stderr, flush=True)
        Path(out).write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    started = admitted(device)
    done("first_call", s=round(time.perf_counter() - t0, 4), admitted=started)
    (verdict,) = gluon_check.wait_for_admission().values()
    done("cold", s=round(time.perf_counter() - t0, 3), verdict=verdict,
         shared_to=share_verdicts(shared))
    gluon_check._verdicts.clear()  # a later process: nothing in memory, the verdict on disk
    t1 = time.perf_counter()
    took = admitted(device)
    done("disk", s=round(time.perf_counter() - t1, 4), admitted=took)
    if kind != "stub":
        t2 = time.perf_counter()
        verdict = gluon_check.isolated(device, check.self_check)
        done("warm", s=round(time.perf_counter() - t2, 3), verdict=verdict)
    return 0 if result["cold"]["verdict"] is None and result["disk"]["admitted"] else 1


if __name__ == "__main__":
    sys.exit(main())

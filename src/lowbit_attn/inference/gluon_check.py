"""The INT8 attention forward a call on the Triton path runs under ``LOWBIT_ATTN_KERNEL=gluon``:
the Gluon forward for Hopper (:mod:`~lowbit_attn.inference.kernel_int8_gluon`, the ping-pong
schedule) where it applies and has passed a check on this device, the Triton kernel
(:mod:`~lowbit_attn.inference.kernel_int8`) everywhere else, without error.

The Gluon forward has run on one GPU (an H100, 2026-11-25), so it is opt-in and earns its place
on each machine. A call uses it only where

1. :func:`applies`: CUDA tensors on a device of capability 9.0 (sm_90a, the only target it is
   written for), compiled kernels (not the Triton interpreter: Triton has no Gluon interpreter, so
   on a CPU the option changes nothing);
2. it has passed the check :func:`self_check` against the Triton kernel on the small inputs of
   :data:`CASES` (partial blocks, causal, GQA, LSE, both key blocks, per-block scales, fp16
   P·V) on a device like this one, with this driver, software and source (:func:`admit`): the
   verdict stored on disk by an earlier process (:func:`verdict_dir`), else the check started
   at the first call that gets here, in a process of its own (:func:`isolated`: a kernel that
   faults would leave the caller's CUDA context unusable) and in the background: calls run the
   Triton kernel until its verdict is in (:func:`wait_for_admission` waits for it). A mismatch,
   a crash or any exception (the module failing to import, the Triton version pin of
   ``kernel_int8_gluon.check_version``, a compile or launch error) warns once, naming the
   reason, and the Triton kernel runs for the rest of the process on that device. A call made
   while a CUDA graph is being captured or ``torch.compile`` traces starts nothing: it runs the
   Triton kernel, and the check waits for a call outside;
3. the Gluon launcher takes the call: it raises ``ValueError`` before launching anything for what
   it does not cover (D other than 64 and 128, ΔS, operands TMA cannot
   read); such a call runs the Triton kernel (and a call it fails to compile, before any launch,
   refuses it for the rest of the process with one warning: :func:`refuse`). Per-block scales
   and fp16 P·V are covered, and so is each in :data:`CASES`. Packed (varlen) calls run the
   Triton kernel: on an H100 (2026-11-25) the kernel raised "an illegal instruction was
   encountered" on the packed
   case the check had (``(1, 37), (77, 77), (260, 301)`` tokens, D=64), while the six dense
   cases agreed with the Triton kernel. Their indexing is right on the CPU model
   (tests/inference/test_gluon_schedule.py), which does not model TMA's alignment rules: the
   per-token scale vectors of a sequence starting at token 37 begin 148 bytes in, not on the
   16 bytes a TMA descriptor's base needs, the likely cause (not yet confirmed).

Tolerances of the check: on a GPU the compiled Triton kernel is held within ``atol 4e-3`` and
cosine ``0.99999`` of the twin on the same FP8 P·V operands (unit-variance V; the kernel test's
bound for an exp2 that moves one E4M3 P̃ across a rounding boundary, widened by tests/helpers.py
``ON_CUDA "int8 out fp8"``), its LSE within ``1e-3``; tests/test_gpu.py holds the Gluon forward to
the same. The fp16 P·V case is held to the same bounds (looser than that recipe needs: they are
there to catch layout and indexing mistakes, not last bits). Two kernels that both meet that bound differ by at most twice it (triangle inequality;
for the cosine, angles add: ``arccos 0.99999 = 4.47e-3`` rad, twice that is cosine ``0.99996``). A
layout or indexing mistake moves whole rows or tiles and lands far outside these bounds.

The admit / refuse / warn-once / fall-back machinery is shared with the Gluon FP4 forward for
sm_100a (:mod:`~lowbit_attn.inference.gluon_fp4_check`), the one-warpgroup Hopper forward
(:mod:`~lowbit_attn.inference.sm90_check`) and the Hopper backward loops
(:mod:`~lowbit_attn.training.sm90_check`): :func:`admit` (one verdict per process,
device and kernel; stored on disk for later processes; the check in the background, so a first
call pays a file read or a process's spawn, never the check; none started during a capture),
:func:`wait_for_admission`, :func:`run_cases` (any exception is a reason),
:func:`compare_outputs` and :func:`dispatch` (the launcher's ``ValueError`` → the Triton kernel;
a failure to compile a call the check did not cover → the Triton kernels for the rest of the
process, with one warning: :func:`refuse`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from lowbit_attn.core.arch import graph_capturing, interpreter_enabled
from lowbit_attn.core.metrics import cosine_similarity
from lowbit_attn.core.operands import Seqs
from lowbit_attn.core.recipes import get_recipe
from lowbit_attn.core.variants import Variant
from lowbit_attn.inference import kernel_int8
from lowbit_attn.inference.prepare import quantize_qkv

CAPABILITY = (9, 0)  # sm_90a
KERNEL = "gluon"  # the Gluon Hopper forward's key among the verdicts
CHECK_ATOL = 8e-3  # 2 × 4e-3: max |Gluon - Triton| of the outputs
CHECK_COSINE = 0.99996  # cos(2·arccos 0.99999)
CHECK_LSE_ATOL = 2e-3  # 2 × 1e-3


@dataclass(frozen=True)
class Case:
    """One input of the check: ``[b, hq, nq, d]`` queries against ``[b, hkv, nk, d]`` keys and
    values, ``block_k`` keys per block, causal (aligned bottom-right) or not, with LSE or not,
    scales per token or per block. With ``lengths`` (``(nq, nk)`` per sequence) the sequences are
    packed ``[total, H, D]`` instead (``b``, ``nq`` and ``nk`` then only seed the inputs)."""

    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    block_k: int
    causal: bool
    lse: bool
    granularity: str = "per_token"
    lengths: tuple[tuple[int, int], ...] = ()
    pv: str = "fp8"
    window: tuple[int, int] | None = None
    sinks: bool = False

    def __str__(self) -> str:
        flags = (" causal" if self.causal else "") + (" lse" if self.lse else "")
        flags += "" if self.window is None else f" window {self.window}"
        flags += " sinks" if self.sinks else ""
        flags += "" if self.granularity == "per_token" else f" {self.granularity}"
        flags += "" if self.pv == "fp8" else f" pv {self.pv}"
        shape = (f"packed {list(self.lengths)}" if self.lengths
                 else f"B{self.b} Nq{self.nq} Nk{self.nk}")
        return f"{shape} H{self.hq}:{self.hkv} D{self.d} keys {self.block_k}{flags}"


# Every row count and key count leaves a partial block; D 64 and 128, both key blocks, GQA, causal
# with a diagonal that is not the block grid's, LSE with the K-smoothing shift; per-block scales;
# packed sequences (one token, a partial tile, several tiles; bases not 16-aligned).
CASES = (
    Case(1, 2, 2, 200, 200, 64, 64, causal=False, lse=False),
    Case(1, 4, 2, 300, 333, 128, 64, causal=True, lse=True),
    Case(2, 2, 1, 130, 257, 128, 128, causal=True, lse=False),
    Case(1, 2, 1, 129, 300, 64, 128, causal=False, lse=True),
    Case(1, 2, 1, 150, 170, 128, 64, causal=True, lse=True, granularity="per_block"),
    Case(1, 4, 2, 200, 260, 128, 128, causal=True, lse=True, granularity="per_block", pv="fp16"),
)

_lock = threading.Lock()
# (process id, device index, kernel) → None (admitted), why not, or the check under way (a
# _Pending); a forked child checks again. The kernel: the Gluon Hopper forward's KERNEL or another
# Gluon forward's name ("fp4", gluon_fp4_check; "sm90", "sm90-bwd").
_verdicts: dict[tuple[int, int | None, str], object] = {}
RUNNING = "its check is running"  # verdict() while the check runs in the background


def applies(device: torch.device) -> bool:
    """Whether the Gluon forward can run on ``device`` at all (see the module docstring, 1)."""
    return (device.type == "cuda" and not interpreter_enabled()
            and torch.cuda.get_device_capability(device) == CAPABILITY)


def _key(device: torch.device, kernel: str) -> tuple[int, int | None, str]:
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return os.getpid(), index, kernel


def verdict(device: torch.device, kernel: str = KERNEL) -> str | None:
    """``None`` if ``kernel`` (a key of the verdicts; by default the Gluon Hopper forward's) was
    admitted on ``device`` in this process, else why not (``"not checked"`` before the first
    check, :data:`RUNNING` while it runs)."""
    key = _key(device, kernel)
    with _lock:
        state = _verdicts.get(key, "not checked")
        if isinstance(state, _Pending):
            state = _settle(key, state, block=False)
        return RUNNING if isinstance(state, _Pending) else state


def admitted(device: torch.device) -> bool:
    """Whether the Gluon forward has passed its check on ``device``: the verdict on disk, or the
    check started in the background at the first call in this process (:func:`admit`)."""
    return admit(device, KERNEL, checker(device, self_check),
                 "LOWBIT_ATTN_KERNEL=gluon: the Gluon attention forward (sm_90a)",
                 "the Triton kernel")


def admit(device: torch.device, kernel: str, check: Checker, what: str, triton: str) -> bool:
    """Whether ``kernel`` (a key of the verdicts) is admitted on ``device`` now, never waiting
    for a check (issue 43: a first call pays ≤ 2 s).

    The first call in this process (outside a CUDA graph capture or ``torch.compile`` tracing:
    none starts a process there) reads the verdict stored on disk for this machine, kernel,
    software and sources (:meth:`Checker.where`, in :func:`verdict_dir`); without one it starts ``check`` in the
    background (:meth:`Checker.start`: a child process on a CUDA device) and answers ``False``.
    Later calls poll the check (a non-blocking ``waitpid``) and answer ``False`` until its
    verdict is in, then the verdict, stored on disk for later processes. A failure warns once
    (``what`` failed its check against ``triton``…). :func:`wait_for_admission` blocks until
    every check started is decided."""
    key = _key(device, kernel)
    with _lock:
        state = _verdicts.get(key, _MISSING)
        if state is _MISSING:
            if graph_capturing(device) or torch.compiler.is_compiling():
                return False  # nothing started in a capture or a trace: the next call outside
            path, record = check.where(kernel)
            found, reason = load_verdict(path, record)
            if found:
                state = _settle(key, _Pending(_Done(reason), what, triton, device, None),
                                block=False)
            else:
                state = _settle(key, _Pending(check.start(path, record), what, triton, device,
                                              (path, record)), block=False)
        elif isinstance(state, _Pending):
            state = _settle(key, state, block=False)
        return state is None


def wait_for_admission(timeout: float | None = None) -> dict[str, str | None]:
    """Block until every admission check started in this process has its verdict (at most
    ``timeout`` seconds, then leave the rest running), and return each kernel's verdict in this
    process: ``{kernel: None (admitted) or why not}``, keys ``"<kernel>@<device index>"``.

    Calls after it take the admitted kernels: what the GPU tests and benchmarks call after a
    first call, so that they measure the kernel that later calls run, and what a user wanting
    one kernel throughout a run calls after a warm-up call (before it, results may come from the
    Triton kernel, then from the admitted one: the two agree within the check's bounds)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        for key, state in list(_verdicts.items()):
            if isinstance(state, _Pending) and key[0] == os.getpid():
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                _settle(key, state, block=True, timeout=left)
        return {f"{kernel}@{index}": (RUNNING if isinstance(state, _Pending) else state)
                for (pid, index, kernel), state in _verdicts.items() if pid == os.getpid()}


_MISSING = object()


class _Done:
    """A check whose verdict is known already (read from disk, or run in this process)."""

    def __init__(self, reason: str | None):
        self.reason = reason

    def result(self, block: bool, timeout: float | None = None) -> tuple[bool, str | None]:
        return True, self.reason


@dataclass
class _Pending:
    """A verdict not yet recorded: the running check, what its warning says, and where its
    verdict goes on disk (``None``: it came from there)."""

    run: object  # _Done or _Child: result(block, timeout) → (done, reason)
    what: str
    triton: str
    device: torch.device
    store: tuple[str, dict] | None


def _settle(key, pending: _Pending, *, block: bool, timeout: float | None = None):
    """Poll (or wait for) ``pending``; once done, record its verdict, store it on disk (a check
    that ran), warn once if it failed. The state now under ``key``. Called with the lock held."""
    done, reason = pending.run.result(block, timeout)
    if not done:
        _verdicts[key] = pending
        return pending
    _verdicts[key] = reason
    if pending.store is not None:
        store_verdict(*pending.store, reason)
    if reason is not None:
        warnings.warn(
            f"{pending.what} failed its check against {pending.triton} on {pending.device} "
            f"({reason}); the Triton kernel runs instead for the rest of this process",
            RuntimeWarning, stacklevel=4)
    return reason


# --- the verdict on disk ------------------------------------------------------------------------

VERDICTS = "lowbit_attn-admission"  # the folder of verdicts inside Triton's cache directory


def verdict_dir() -> str:
    """Where verdicts are stored: a folder inside Triton's cache directory (``TRITON_CACHE_DIR``,
    by default ``~/.triton/cache``), beside the compiled kernels they vouch for: emptying that
    cache empties both."""
    try:
        from triton import knobs

        base = knobs.cache.dir
    except (ImportError, AttributeError):  # a Triton without knobs
        base = (os.environ.get("TRITON_CACHE_DIR")
                or os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    return os.path.join(base, VERDICTS)


@functools.cache
def _sources_digest() -> str:
    """SHA-256 of every Python file of the package (paths and contents): the checked kernels,
    what they import (Gluon blocks, quantization, the Triton reference kernels) and the checks
    themselves, with no hand-kept list to go stale. Once per process (~1 MB, a few ms)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _driver_version() -> int | None:
    """The CUDA driver's version (``cuDriverGetVersion``), or ``None`` where it cannot be read."""
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def _device_facts(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": device.type}
    return {"device": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "driver": _driver_version(), "cuda": torch.version.cuda}


def load_verdict(path: str, record: dict) -> tuple[bool, str | None]:
    """``(True, verdict)`` stored at ``path`` for exactly ``record``; ``(False, None)`` when there
    is none, or it cannot be read, is not JSON or is for another record (the check runs again)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False, None
    if not isinstance(data, dict) or data.get("record") != record:
        return False, None
    reason = data.get("verdict")
    if reason is not None and not isinstance(reason, str):
        return False, None
    return True, reason


def lasting(reason: str | None) -> bool:
    """Whether a verdict says something about the kernel rather than about the moment: a check
    that ran out of time or memory, a child that could not start or was killed by a signal from
    outside (an interrupt, a job's end), is not stored and runs again in the next process."""
    if reason is None:
        return True
    killed = tuple(f"its check's process exited with code -{sig}:" for sig in (1, 2, 9, 15))
    return not (reason.startswith(("its check did not finish", "its check could not start",
                                   *killed))
                or "OutOfMemoryError" in reason)


def store_verdict(path: str, record: dict, reason: str | None) -> None:
    """Store ``reason`` for ``record`` at ``path`` (if :func:`lasting`): written to a temporary
    file beside it and renamed over it, so a reader sees the old file or the new one, never half
    of one, and processes that store the same verdict at once are harmless. A folder that cannot
    be written keeps the verdict in memory only."""
    if not lasting(reason):
        return
    folder = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"record": record, "verdict": reason,
                       "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                      f, indent=1)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


# --- running a check ----------------------------------------------------------------------------

# Seconds a check's own process may take (its compiles included) before the kernel is refused.
CHECK_TIMEOUT = 600


@dataclass(frozen=True)
class Checker:
    """``check(device, *args)`` (a module-level function returning ``None`` or a reason) as
    :func:`admit` runs it: on a CUDA device in a child process (:func:`isolated`), started
    without waiting; elsewhere (the tests' stand-ins on a CPU) in this process, at once.
    Calling it runs the check and returns its verdict."""

    device: torch.device
    check: Callable[..., str | None]
    args: tuple[str, ...] = ()

    def __call__(self) -> str | None:
        return self.start().result(block=True)[1]

    def where(self, kernel: str) -> tuple[str, dict]:
        """``(path, record)`` of this check's verdict on disk: the record holds everything that
        could change the answer (device, driver and CUDA, torch, Triton, this package's version
        and sources, the check, its arguments and its cases); the file name, its hash."""
        module = sys.modules.get(self.check.__module__)
        cases = repr(getattr(module, "CASES", None))
        record = {"kernel": kernel, "check": f"{self.check.__module__}.{self.check.__qualname__}",
                  "args": list(self.args), **_device_facts(self.device),
                  "torch": torch.__version__, "triton": triton.__version__,
                  "lowbit_attn": getattr(sys.modules.get("lowbit_attn"), "__version__", None),
                  "cases": hashlib.sha256(cases.encode()).hexdigest(),
                  "sources": _sources_digest()}
        name = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]
        return os.path.join(verdict_dir(), f"{kernel}-{name}.json"), record

    def start(self, path: str | None = None, record: dict | None = None):
        """The check under way (``result(block, timeout)`` → ``(done, reason)``); a child
        process stores its verdict at ``path`` itself, so that it is kept even if this process
        ends first."""
        if self.device.type != "cuda":
            return _Done(self.check(self.device, *self.args))
        try:
            return _Child(self.device, self.check, self.args, path, record)
        except OSError as exc:  # no process could be started (not stored: the next one tries)
            return _Done(f"its check could not start: {exc}"[:500])


def checker(device: torch.device, check: Callable[..., str | None], *args: str) -> Checker:
    """What :func:`admit` runs for ``check(device, *args)`` (:class:`Checker`)."""
    return Checker(device, check, args)


class _Child:
    """``check(device, *args)`` running in a child Python process on the same GPU (see
    :func:`isolated`), polled without blocking."""

    def __init__(self, device, check, args, path: str | None, record: dict | None):
        index = _key(device, "")[1]
        code = (f"import json, torch\nfrom {check.__module__} import {check.__name__} as check\n"
                f"reason = check(torch.device('cuda', {index}), *{args!r})\n")
        if path is not None:  # stored by the child: kept if the caller ends first
            code += ("from lowbit_attn.inference.gluon_check import store_verdict\n"
                     f"store_verdict({path!r}, json.loads({json.dumps(record)!r}), reason)\n")
        code += "print('VERDICT ' + json.dumps(reason), flush=True)\n"
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        # the child's output, read once it exits, closed by _finish
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
        self.started = time.monotonic()
        self.timeout = CHECK_TIMEOUT
        self.reason: str | None = None
        self.done = False
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=self.out,
            stderr=self.err, env={**os.environ, "PYTHONPATH": pythonpath,
                                  "LOWBIT_ATTN_AUTOTUNE": "first"})

    def result(self, block: bool, timeout: float | None = None) -> tuple[bool, str | None]:
        if self.done:
            return True, self.reason
        left = self.timeout - (time.monotonic() - self.started)
        if not block:
            code = self.proc.poll()
        else:
            wait = left if timeout is None else min(left, timeout)
            try:
                code = self.proc.wait(timeout=max(wait, 0.0))
            except subprocess.TimeoutExpired:
                code = None
        if code is None:
            if time.monotonic() - self.started < self.timeout:
                return False, None
            self.proc.kill()
            self.proc.wait()
            return self._finish(f"its check did not finish in {self.timeout} s")
        return self._finish(self._verdict(code))

    def _verdict(self, code: int) -> str | None:
        for name in ("out", "err"):
            getattr(self, name).seek(0)
        out = self.out.read().decode(errors="replace")
        for line in reversed(out.splitlines()):
            if line.startswith("VERDICT "):
                return json.loads(line[len("VERDICT "):])
        err = self.err.read().decode(errors="replace")
        last = (err.strip().splitlines() or ["no output"])[-1]
        return f"its check's process exited with code {code}: {last}"[:500]

    def _finish(self, reason: str | None) -> tuple[bool, str | None]:
        self.done, self.reason = True, reason
        self.out.close()
        self.err.close()
        return True, reason


def isolated(device: torch.device, check: Callable[..., str | None], *args: str) -> str | None:
    """``check(device, *args)`` (a module-level function returning ``None`` or a reason) run in a
    child Python process on the same GPU, waited for, its verdict returned here (nothing stored).

    A kernel that faults (an illegal instruction, an illegal address) leaves the CUDA context of
    its process unusable: a check run in the caller's process would take the caller down with it,
    and no fallback could run (H100, 2026-11-25: the Gluon Hopper forward raised "an illegal
    instruction was encountered" on packed sequences inside the check, and every later CUDA call
    of that process failed). A child
    that crashes, hangs past :data:`CHECK_TIMEOUT` or prints no verdict refuses the kernel with
    that as the reason. The child finds this package where the caller did; its compiles land in
    Triton's cache, so the caller's own first launch of the checked kernel compiles nothing new.
    The child gives each autotuned Triton kernel (the reference side) its first candidate alone
    (``LOWBIT_ATTN_AUTOTUNE=first``): one compile per case, not one per candidate."""
    return _Child(device, check, args, None, None).result(block=True)[1]


def self_check(device: torch.device) -> str | None:
    """Run :data:`CASES` through both kernels on ``device``: ``None`` if every output (and LSE)
    agrees within the module's tolerances, else the first reason it does not (a mismatch, or the
    exception raised)."""
    return run_cases(device, CASES, lambda case: _compare(case, device))


def run_cases(device: torch.device, cases, compare: Callable[[object], str | None]) -> str | None:
    """``compare(case)`` for each case on ``device`` (no grad): the first reason, naming its case,
    or the exception one raised (any exception: a kernel that fails to import, compile or launch
    is refused with its reason), else ``None``."""
    try:
        guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with torch.no_grad(), guard:
            for case in cases:
                reason = compare(case)
                if reason is not None:
                    return f"{case}: {reason}"
    except Exception as exc:  # noqa: BLE001 - any failure keeps the Triton kernel, with its reason
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
    return None


def compare_outputs(got: torch.Tensor, want: torch.Tensor, got_lse, want_lse, *,
                    atol: float | None, cosine: float, lse_atol: float,
                    lse_rtol: float = 0.0) -> str | None:
    """Why the Gluon output (and LSE, when ``want_lse`` is given) is not within the bounds of the
    Triton kernel's, or ``None``: every output finite and written, ``max |got − want| ≤ atol``
    (unless ``None``), cosine ``≥ cosine``, ``|LSE| ≤ lse_atol + lse_rtol·|want LSE|`` (equal
    LSEs, -inf of rows that saw no key included, differ by 0)."""
    if not bool(torch.isfinite(got).all()):
        bad = ~torch.isfinite(got)
        # the Triton kernel's at the same places: a shared cause (the quantized operands) or not
        theirs = ~torch.isfinite(want)
        return (f"{int(bad.sum())} outputs not finite or not written{_where(bad)}; "
                f"the Triton kernel's: {int(theirs.sum())} not finite, "
                f"{int((bad & theirs).sum())} of them at the same places")
    err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    if atol is not None and err > atol:
        return f"max |gluon - triton| = {err:.3g} > {atol}"
    cos = cosine_similarity(got, want)
    if not cos >= cosine:
        return f"cosine {cos:.6f} < {cosine}"
    if want_lse is not None:  # rows that saw no key: -inf on both sides, no difference
        diff = torch.where(got_lse == want_lse, 0.0, (got_lse - want_lse).abs())
        excess = diff - lse_rtol * want_lse.abs()
        lse_err = float(diff.max())
        if not float(excess.max()) <= lse_atol:
            return (f"max |LSE gluon - triton| = {lse_err:.3g} > {lse_atol}"
                    + (f" + {lse_rtol}·|LSE|" if lse_rtol else ""))
    return None


def _where(bad: torch.Tensor) -> str:
    """Where the ``True`` elements of ``bad`` are, index by index: ``" at [dim: n values, first
    ..]"`` (what a GPU run's reason should say for the next run to find the cause: a column of
    every row, whole rows, one head, ...)."""
    idx = bad.nonzero()
    parts = []
    for dim in range(idx.shape[1]):
        values = torch.unique(idx[:, dim]).tolist()
        shown = ",".join(map(str, values[:6])) + (",…" if len(values) > 6 else "")
        parts.append(f"{len(values)} of {bad.shape[dim]} ({shown})")
    return f" at indices {'; '.join(parts)}" if parts else ""


# What a kernel call raises while it compiles, before anything is launched: Triton's
# CompilationError, OutOfResources (registers, shared memory) and PTXASError. A fault after a
# launch (an illegal address) is not among them: it leaves the CUDA context unusable.
COMPILE_ERRORS = (triton.errors.TritonError,)


def refuse(device: torch.device, kernel: str, error: BaseException) -> None:
    """Refuse ``kernel`` on ``device`` for the rest of this process after ``error`` (one of
    :data:`COMPILE_ERRORS`: a call its check did not cover failed to compile), warning once: its
    later calls, and this one, run the Triton kernels. The verdict on disk is left as it is (a
    new specialization, not the checked ones, failed)."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    with _lock:
        _verdicts[_key(device, kernel)] = f"{type(error).__name__} on a later call: {first_line}"
    warnings.warn(
        f"the Gluon kernel {kernel!r}, admitted on {device}, failed to compile a call its check "
        f"did not cover ({type(error).__name__}: {first_line}); the Triton kernels run instead "
        f"for the rest of this process", RuntimeWarning, stacklevel=3)


def dispatch(device: torch.device, kernel: str, applies_here: Callable[[torch.device], bool],
             admitted_here: Callable[[torch.device], bool], gluon: Callable[[], object],
             triton: Callable[[], object]):
    """``gluon()`` where it applies on ``device`` and ``kernel`` (its key among the verdicts) is
    admitted there, unless it raises ``ValueError`` (refused before launching: not a case it
    covers) or fails to compile (:data:`COMPILE_ERRORS`: :func:`refuse`); ``triton()``
    otherwise."""
    if applies_here(device) and admitted_here(device):
        try:
            return gluon()
        except ValueError:
            pass
        except COMPILE_ERRORS as error:
            refuse(device, kernel, error)
    return triton()


def case_variant(case: Case, device: torch.device) -> tuple:
    """``(variant, sinks)`` of a :class:`Case`: its window (``right`` 0 when causal) and, with
    ``sinks``, seeded ``[hq]`` fp32 sink logits on ``device``."""
    left, right = case.window if case.window is not None else (-1, -1)
    variant = Variant(left=left, right=0 if case.causal else right, sinks=case.sinks)
    if not variant.windowed:
        variant = Variant(sinks=case.sinks)  # causal or not: causal_offset says
    sinks = None
    if case.sinks:
        g = torch.Generator(device=device).manual_seed(case.hq)
        sinks = 2 * torch.randn(case.hq, generator=g, device=device)
    return variant, sinks


def case_inputs(case: Case, device: torch.device) -> tuple:
    """``(q, k, v, seqs, causal_offset)`` of a :class:`Case`: fp16 inputs with channel-biased K
    (dense ``[B, H, N, D]``, or packed ``[total, H, D]`` with ``seqs`` holding ``seqs_q`` and
    ``seqs_k``), seeded by the case's sizes."""
    g = torch.Generator(device=device).manual_seed(case.b * 10**6 + case.nq * 1000 + case.nk)
    rows = ([(1, nq, nk) for nq, nk in case.lengths] if case.lengths
            else [(case.b, case.nq, case.nk)])
    parts = []
    for b, nq, nk in rows:
        q = torch.randn(b, case.hq, nq, case.d, generator=g, device=device)
        k = torch.randn(b, case.hkv, nk, case.d, generator=g, device=device)
        k += 4 * torch.randn(b, case.hkv, 1, case.d, generator=g, device=device)  # channel bias
        v = torch.randn(b, case.hkv, nk, case.d, generator=g, device=device)
        parts.append(tuple(x.to(torch.float16) for x in (q, k, v)))
    seqs = {}
    if case.lengths:  # packed [total, H, D]; each sequence causal bottom-right
        q, k, v = (torch.cat([p[i][0].transpose(0, 1) for p in parts]) for i in range(3))
        for name, n in (("seqs_q", [nq for nq, _ in case.lengths]),
                        ("seqs_k", [nk for _, nk in case.lengths])):
            cu = torch.tensor([0, *n], device=device).cumsum(0).to(torch.int32)
            seqs[name] = Seqs(len(n), max(max(n), 1), cu)
        offset = 0 if case.causal else None
    else:
        q, k, v = parts[0]
        offset = case.nk - case.nq if case.causal else None
    return q, k, v, seqs, offset


def _compare(case: Case, device: torch.device) -> str | None:
    q, k, v, seqs, offset = case_inputs(case, device)
    recipe = get_recipe(f"qk_int8_pv_{case.pv}").replace(block_k=case.block_k,
                                                         granularity=case.granularity)
    qz = quantize_qkv(q, k, v, recipe, case.d**-0.5, need_lse_shift=case.lse, backend="triton",
                      **seqs)
    kw = dict(pv=recipe.pv, granularity=recipe.granularity, block_q=recipe.block_q,
              block_k=case.block_k, causal_offset=offset, return_lse=case.lse, **seqs)
    from lowbit_attn.inference import kernel_int8_gluon  # an import failure is a reason too

    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    want_lse = kernel_int8.attention(qz, out=want, **kw)
    got_lse = kernel_int8_gluon.attention(qz, out=got, **kw)
    return compare_outputs(got, want, got_lse, want_lse if case.lse else None, atol=CHECK_ATOL,
                           cosine=CHECK_COSINE, lse_atol=CHECK_LSE_ATOL)


def attention(qz, *, out: torch.Tensor, pv: str, granularity: str, block_q: int, block_k: int,
              causal_offset: int | None, return_lse: bool, seqs_q=None,
              seqs_k=None) -> torch.Tensor | None:
    """``kernel_int8.attention``'s arguments and result, run by the Gluon forward where it
    applies, is admitted on ``out``'s device and takes the call, else by the Triton kernel."""
    kw = dict(out=out, pv=pv, granularity=granularity, block_q=block_q, block_k=block_k,
              causal_offset=causal_offset, return_lse=return_lse, seqs_q=seqs_q, seqs_k=seqs_k)
    if seqs_q is not None:  # packed: the kernel faults on an H100 (module docstring, 3)
        return kernel_int8.attention(qz, **kw)

    def gluon():
        from lowbit_attn.inference import kernel_int8_gluon

        return kernel_int8_gluon.attention(qz, **kw)

    return dispatch(out.device, KERNEL, applies, admitted, gluon,
                    lambda: kernel_int8.attention(qz, **kw))


__all__ = ["CASES", "KERNEL", "RUNNING", "Case", "Checker", "admit", "admitted", "applies",
           "attention", "case_inputs", "checker", "compare_outputs", "dispatch", "isolated", "load_verdict",
           "refuse", "run_cases", "self_check", "store_verdict", "verdict", "verdict_dir",
           "wait_for_admission"]

"""When an opt-in Gluon kernel runs instead of the Triton kernels: the admission machinery the
Gluon kernels share (the one-warpgroup Hopper forward, :mod:`~lowbit_attn.inference.sm90_check`;
the Blackwell FP4 forward, :mod:`~lowbit_attn.inference.gluon_fp4_check`; the Hopper backward
loops, :mod:`~lowbit_attn.training.sm90_check`). Each of those modules holds its kernel's own
part (where it applies, its check's cases and tolerances); a call takes the Gluon kernel only
where

1. it applies (:func:`applies` for Hopper: CUDA tensors on a device of capability 9.0, compiled
   kernels, not the Triton interpreter: Triton has no Gluon interpreter, so on a CPU the options
   change nothing);
2. the kernel has passed its check against the Triton kernels on a device like this one, with
   this driver, software and source (:func:`admit`): the verdict stored on disk by an earlier
   process (:func:`verdict_dir`), else the check started at the first call that gets here, in a
   process of its own (:func:`isolated`: a kernel that faults would leave the caller's CUDA
   context unusable) and in the background, so that a first call pays a file read or a
   process's spawn, never the check: calls run the Triton kernels until its verdict is in
   (:func:`wait_for_admission` waits for it). A mismatch, a crash or any exception (a module
   failing to import, a Triton version pin, a compile or launch error: :func:`run_cases`) warns
   once, naming the reason, and the Triton kernels run for the rest of the process on that
   device. A call made while a CUDA graph is being captured or ``torch.compile`` traces starts
   nothing: it runs the Triton kernels, and the check waits for a call outside;
3. the Gluon launcher takes the call (:func:`dispatch`): it raises ``ValueError`` before launching
   anything for what it does not cover, and such a call runs the Triton kernels; a call it fails
   to compile, before any launch, refuses the kernel for the rest of the process with one warning
   (:func:`refuse`).

:func:`compare_outputs` holds a Gluon kernel's outputs to the Triton kernel's bounds: a layout or
indexing mistake moves whole rows or tiles and lands far outside them.

The Gluon ping-pong Hopper forward this module first admitted is deleted (2026-12-01, by the
H200 rows of 2026-11-27: end to end it was slower than the Triton kernels on every row;
``benchmarks/NOTES.md`` §28).
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
from lowbit_attn.core.variants import Variant

CAPABILITY = (9, 0)  # sm_90a, the Hopper kernels


@dataclass(frozen=True)
class Case:
    """One input of a check: ``[b, hq, nq, d]`` queries against ``[b, hkv, nk, d]`` keys and
    values, ``block_k`` keys per block, causal (aligned bottom-right) or not, with LSE or not,
    the scales' granularity, P·V's type, a window and sinks."""

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
    pv: str = "fp8"
    window: tuple[int, int] | None = None
    sinks: bool = False

    def __str__(self) -> str:
        flags = (" causal" if self.causal else "") + (" lse" if self.lse else "")
        flags += "" if self.window is None else f" window {self.window}"
        flags += " sinks" if self.sinks else ""
        flags += "" if self.granularity == "per_token" else f" {self.granularity}"
        flags += "" if self.pv == "fp8" else f" pv {self.pv}"
        return f"B{self.b} Nq{self.nq} Nk{self.nk} H{self.hq}:{self.hkv} D{self.d} keys {self.block_k}{flags}"


_lock = threading.Lock()
# (process id, device index, kernel) → None (admitted), why not, or the check under way (a
# _Pending); a forked child checks again. The kernel: its checking module's KERNEL ("sm90",
# "sm90-bwd", "fp4").
_verdicts: dict[tuple[int, int | None, str], object] = {}
RUNNING = "its check is running"  # verdict() while the check runs in the background


def applies(device: torch.device) -> bool:
    """Whether a Hopper Gluon kernel can run on ``device`` at all (module docstring, 1)."""
    return (device.type == "cuda" and not interpreter_enabled()
            and torch.cuda.get_device_capability(device) == CAPABILITY)


def _key(device: torch.device, kernel: str) -> tuple[int, int | None, str]:
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return os.getpid(), index, kernel


def verdict(device: torch.device, kernel: str) -> str | None:
    """``None`` if ``kernel`` (a key of the verdicts) was
    admitted on ``device`` in this process, else why not (``"not checked"`` before the first
    check, :data:`RUNNING` while it runs)."""
    key = _key(device, kernel)
    with _lock:
        state = _verdicts.get(key, "not checked")
        if isinstance(state, _Pending):
            state = _settle(key, state, block=False)
        return RUNNING if isinstance(state, _Pending) else state


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
    """``(q, k, v, causal_offset)`` of a :class:`Case`: fp16 ``[B, H, N, D]`` inputs with
    channel-biased K, seeded by the case's sizes."""
    g = torch.Generator(device=device).manual_seed(case.b * 10**6 + case.nq * 1000 + case.nk)
    q = torch.randn(case.b, case.hq, case.nq, case.d, generator=g, device=device)
    k = torch.randn(case.b, case.hkv, case.nk, case.d, generator=g, device=device)
    k += 4 * torch.randn(case.b, case.hkv, 1, case.d, generator=g, device=device)  # channel bias
    v = torch.randn(case.b, case.hkv, case.nk, case.d, generator=g, device=device)
    q, k, v = (x.to(torch.float16) for x in (q, k, v))
    return q, k, v, case.nk - case.nq if case.causal else None


__all__ = ["CAPABILITY", "COMPILE_ERRORS", "RUNNING", "Case", "Checker", "admit", "applies",
           "case_inputs", "case_variant", "checker", "compare_outputs", "dispatch", "isolated",
           "load_verdict", "refuse", "run_cases", "store_verdict", "verdict", "verdict_dir",
           "wait_for_admission"]

"""Which Triton releases the package runs on, and what each enables: the runtime's one place for
what differs between Triton versions.

- The Triton kernels (``triton.language``) run on every series of :data:`TESTED` (CI runs the suite
  on the pinned one, the oldest and the newest). The metadata admits the Triton that each torch
  of :data:`TORCH_TRITON` pins, on Linux only (Triton has no other wheels): without Triton
  (:func:`triton_installed`) every call runs the PyTorch reference path.
- The Gluon kernels use an API that changes with each release. Each Gluon module names the series
  it compiles on (:data:`GLUON_SERIES`, by API: ``"hopper"`` or ``"blackwell"``) and calls
  :func:`require_gluon` before it imports Gluon, so on another Triton importing it raises
  :class:`GluonUnavailable` (an ``ImportError`` whose one line names both versions), never an
  ``ImportError`` from deep in Triton. They run on a GPU only after the first-use check
  (``inference.gluon_check``) has admitted them.
- :func:`patch_interpreter` fixes what the Triton interpreter gets wrong on some releases, so the
  kernels compute the same under ``TRITON_INTERPRET=1`` on each of them.
- :func:`hash_ahead` computes Triton's own cache key (a hash of its library, once per process) in
  a thread from the package's import on, where each release keeps it (:func:`key_module`).

:mod:`lowbit_attn.tools.triton_compat` keeps the ahead-of-time tooling's reads of Triton internals.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading

# The series the suite runs on: all the metadata admits, 3.4 up to 3.9 (the Triton of every torch
# from 2.8 to 2.15, below)
TESTED = ("3.4", "3.5", "3.6", "3.7", "3.8", "3.9")
PINNED = "3.6"  # the series `make test` installs and the GPU machines run
OLDEST = "3.4"  # the oldest the metadata admits (`make test-oldest`)
# The Triton series each torch release's CUDA wheels pin (torch's own requirement on Linux x86_64;
# on aarch64 from torch 2.11): the metadata admits all of them, so pip never changes a user's
# torch to satisfy ours. `make check-resolve` checks each pair against the package index.
TORCH_TRITON = {"2.8": "3.4", "2.9": "3.5", "2.10": "3.6", "2.11": "3.6", "2.12": "3.7",
                "2.13": "3.7", "2.14": "3.8", "2.15": "3.9"}

# Gluon's API by the modules that use it: the series each compiles against (none on 3.4, 3.5 or
# 3.7: there the Gluon modules refuse to import and their tests skip). The Hopper kernels
# (kernel_int8_sm90, kernel_bwd_sm90, gluon_blocks: wgmma, TMA, warp specialization,
# mbarriers) compile on 3.6, 3.8 and 3.9 (3.9 renamed the TMA load: gluon_blocks.tma_load calls
# the installed one). The Blackwell FP4 forward needs 3.6's tensor-memory layout function
# (get_tmem_reg_layout), which 3.8 dropped. The CPU model of Gluon kernels (tools.gluon_cpu, for
# the tests) reads Gluon's internals of 3.6, 3.8 and 3.9 (on 3.8 and 3.9 the Hopper kernels only).
GLUON_SERIES = {
    "hopper": ("3.6", "3.8", "3.9"),
    "blackwell": ("3.6",),
    "cpu_model": ("3.6", "3.8", "3.9"),
}


def tma_load_renamed(version: str | None = None) -> bool:
    """Whether Gluon's TMA load is ``tma.async_load`` (Triton 3.9 on) rather than
    ``tma.async_copy_global_to_shared``."""
    major, minor = (int(x) for x in series(version).split("."))
    return (major, minor) >= (3, 9)


def series(version: str | None = None) -> str:
    """``"3.6"`` for Triton 3.6.0, 3.6.1 or 3.6.0+git…; ``version`` defaults to the installed
    Triton's."""
    version = installed_version() if version is None else version
    return ".".join(version.split("+")[0].split(".")[:2])


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    """Why Triton cannot be imported (``"not installed"``, or what its import raised), or None
    where it can."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        if getattr(exc, "name", None) == "triton":  # not a module of a broken install
            return "not installed"
        reason = f"installed, but its import raised {type(exc).__name__}: {exc}"
        interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if getattr(exc, "name", None) == "numpy" and interpreting:
            reason += " (Triton's interpreter, TRITON_INTERPRET=1, needs numpy: pip install numpy)"
        return reason
    return None


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    """Whether Triton can be imported. Triton publishes Linux wheels only (x86_64, aarch64), and
    the package's metadata asks for it on Linux alone: elsewhere every call runs the PyTorch
    reference path (:func:`lowbit_attn.core.arch.backend_for`); why not:
    :func:`triton_import_error`. (Its own import: ``torch.compile`` traces this function's body,
    where another cached function would warn.)"""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def installed_version() -> str:
    import triton

    return triton.__version__


def check_triton_series(accepted: str | tuple[str, ...], message: str,
                        version: str | None = None) -> None:
    """``RuntimeError(message)`` unless ``version`` (default: the installed Triton's) is of one of
    the release series ``accepted`` (``"3.6"``: 3.6.0, 3.6.1+git…); ``message`` may name
    ``{series}`` (the accepted ones: ``3.6.x``, or ``3.6.x, 3.9.x``) and ``{version}``. For code
    that reads APIs which change between Triton releases."""
    accepted = (accepted,) if isinstance(accepted, str) else tuple(accepted)
    version = installed_version() if version is None else version
    if series(version) not in accepted:
        raise RuntimeError(message.format(series=_names(accepted), version=version))


def _names(accepted: tuple[str, ...]) -> str:
    return ", ".join(f"{s}.x" for s in accepted)


class GluonUnavailable(ImportError, RuntimeError):
    """A Gluon module imported, or a Gluon kernel launched, on a Triton whose Gluon API it was not
    written for (an ``ImportError`` at import, a ``RuntimeError`` at launch)."""


def gluon_available(api: str, version: str | None = None) -> bool:
    """Whether Gluon modules of ``api`` (a key of :data:`GLUON_SERIES`) compile on ``version``
    (default: the installed Triton)."""
    return series(version) in GLUON_SERIES[api]


def gluon_refusal(api: str, what: str, version: str | None = None) -> str:
    """One line: ``what`` needs another Triton, naming the series it is written for and the one
    installed."""
    version = installed_version() if version is None else version
    return (f"{what} is written for Gluon's {api.capitalize()} API of Triton "
            f"{_names(GLUON_SERIES[api])}, found Triton {version}: install one of those to use it")


def require_gluon(api: str, what: str, version: str | None = None) -> None:
    """:class:`GluonUnavailable` with :func:`gluon_refusal`'s line unless :func:`gluon_available`.
    A Gluon module calls it before importing Gluon."""
    if not gluon_available(api, version):
        raise GluonUnavailable(gluon_refusal(api, what, version))


def parts(version: str | None = None) -> list[tuple[str, str]]:
    """What the installed Triton (or ``version``) enables, as ``(part, status)`` rows for
    ``lowbit-attn doctor``."""
    version = installed_version() if version is None else version
    tested = series(version) in TESTED
    rows = [("Triton kernels", "tested on this series" if tested else
             f"untested on Triton {version} (tested: {_names(TESTED)})")]
    for api, label in (("hopper", "Gluon INT8 forward (sm_90a, opt-in)"),
                       ("blackwell", "Gluon FP4 forward (sm_100a, opt-in)")):
        rows.append((label, "available, admitted by its first-use check" if
                     gluon_available(api, version) else
                     "unavailable: needs Triton " + _names(GLUON_SERIES[api])))
    return rows


# ---------------------------------------------------------------------------------------------
# the interpreter


def _boolean_mask(mask):
    """The mask handle with boolean data: Triton's interpreter types a comparison of scalars by
    its operands (``page >= 0`` on an int64 ``page`` gives int64 data), so such a comparison
    splatted into a block and combined with ``&`` reaches ``load``/``store`` as integers, which
    Triton 3.9's interpreter refuses (``mask has unsupported dtype``). Nonzero is true, as on a
    GPU."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    if mask.data.dtype == np.bool_:
        return mask
    return TensorHandle(mask.data.astype(np.bool_), mask.dtype)


def fma_fp32(x, y, z):
    """``x·y + z`` of fp32 arrays rounded once to fp32, as a GPU's fused multiply-add: the product
    is exact in fp64, the sum is rounded to odd there (its error from a two-sum), and 53 bits ≥
    2·24 + 2 make the final rounding to fp32 correct. NaN and Inf as IEEE gives them."""
    import numpy as np

    x, y, z = np.broadcast_arrays(*(np.asarray(t, dtype=np.float64) for t in (x, y, z)))
    p = x * y
    s = p + z
    bp = s - z
    err = (p - bp) + (z - (s - bp))
    even = (s.view(np.int64) & 1) == 0
    with np.errstate(invalid="ignore"):
        s = np.where((err != 0) & even & np.isfinite(s),
                     np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    with np.errstate(over="ignore"):
        return s.astype(np.float32)


@functools.lru_cache(maxsize=None)
def patch_interpreter() -> None:
    """Make the interpreter's masked loads and stores take integer masks (see
    :func:`_boolean_mask`), and its fp32 ``fma`` round once (:func:`fma_fp32`; Triton 3.4 to 3.6
    multiply and then add, two roundings, which a kernel that takes a division's residual by an
    ``fma`` cannot survive); once per process, on every Triton (a no-op for boolean masks and
    where ``fma`` already rounds once)."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    fma = InterpreterBuilder.create_fma

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        return load(self, ptrs, _boolean_mask(mask), other, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, _boolean_mask(mask), *args, **kwargs)

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return fma(self, x, y, z)
        return TensorHandle(fma_fp32(x.data, y.data, z.data), z.dtype.scalar)

    InterpreterBuilder.create_masked_load = create_masked_load
    InterpreterBuilder.create_masked_store = create_masked_store
    InterpreterBuilder.create_fma = create_fma


# Where Triton's compile path finds ``triton_key``: 3.4 defines it in the compiler, later
# releases in the cache module (each calls it by its module's global name).
KEY_MODULES = ("triton.runtime.cache", "triton.compiler.compiler")
HASH_THREAD = "lowbit_attn-triton-key"
# How long a compile waits for the hashing thread before it hashes too (~0.4 s is the usual
# whole; the bound only keeps a caller that holds a lock the thread needs from waiting forever).
HASH_WAIT_S = 10.0


def key_module():
    """The module of :data:`KEY_MODULES` that defines the ``triton_key`` its compile path calls
    (an ``lru_cache`` of no arguments), or ``None`` (no such function on this Triton)."""
    for name in KEY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found = getattr(module, "triton_key", None)
        if getattr(found, "__module__", None) == name and hasattr(found, "cache_info"):
            return module
    return None


def hash_ahead_wanted(interpreter: bool) -> bool:
    """Whether the package's import starts :func:`hash_ahead`: Triton installed, not its
    interpreter (``interpreter``: ``arch.interpreter_enabled()``; it compiles nothing), and a
    torch built for a GPU (CUDA or ROCm: elsewhere Triton compiles only for the ahead-of-time
    tools)."""
    import torch

    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    return gpu_build and not interpreter and triton_installed()


def hash_ahead(module=None) -> threading.Thread | None:
    """Compute Triton's own cache key in a daemon thread, and return the thread (``None`` where
    there is nothing to do: no :func:`key_module`, or the key already computed).

    Every process's first compile, and its first read of a compiled kernel from Triton's cache,
    computes ``triton_key()``: a SHA-256 of Triton's ~400 MB library and its sources (0.35–0.45 s
    on this project's 2-core CPU, Triton 3.6: most of a first call's time when the kernels are
    cached, 0.49 s). Started at the package's import, it runs while the caller loads a model or
    creates its CUDA context (the hash releases the GIL). Until it is done the module's
    ``triton_key`` is a stand-in that waits for it and returns the same cached value, so that a
    compile started meanwhile (or several, side by side) waits for the rest rather than hashing
    again (at most :data:`HASH_WAIT_S`); then the stand-in is gone. A process forked meanwhile
    gets the function back and computes the key itself. If the hash raises, the first compile
    computes it again and raises there. ``module``: where ``triton_key`` lives (default
    :func:`key_module`)."""
    module = module if module is not None else key_module()
    if module is None:
        return None
    original = module.triton_key
    if original.cache_info().currsize:
        return None
    done = threading.Event()
    parent = os.getpid()

    def stand_in():
        if os.getpid() == parent:  # a forked child has no hashing thread to wait for
            done.wait(HASH_WAIT_S)
        return original()

    stand_in.__wrapped__ = original
    stand_in.cache_info, stand_in.cache_clear = original.cache_info, original.cache_clear

    def restore():
        if module.triton_key is stand_in:
            module.triton_key = original

    def run():
        try:
            original()
        except Exception:  # noqa: BLE001 - computed again, and raised, by the first compile
            pass
        finally:
            restore()
            done.set()

    module.triton_key = stand_in
    os.register_at_fork(after_in_child=restore)
    thread = threading.Thread(target=run, name=HASH_THREAD, daemon=True)
    thread.start()
    return thread


__all__ = [
    "GLUON_SERIES", "GluonUnavailable", "HASH_THREAD", "HASH_WAIT_S", "KEY_MODULES", "OLDEST",
    "PINNED", "TESTED", "TORCH_TRITON", "check_triton_series", "fma_fp32",
    "gluon_available", "gluon_refusal", "hash_ahead", "hash_ahead_wanted", "key_module", "parts",
    "patch_interpreter", "require_gluon", "series", "triton_installed",
]

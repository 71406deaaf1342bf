"""What the ahead-of-time tooling needs from Triton's internals, in one place, for the Triton
series :data:`WRITTEN_FOR` names.

Under ``TRITON_INTERPRET=1`` (the test suite sets it), ``triton.jit`` returns interpreter objects,
and the interpreter patches ``triton.language`` while a kernel runs. Triton 3.6 undoes the patches
of a kernel's own globals but not those made when a kernel calls a ``triton.language`` ``@jit``
function (``tl.max``, ``tl.sum``): ``tl.core``'s builtins stay patched afterwards, and the methods
of ``tl.tensor`` resolve names through ``tl.core``. It also copies its module globals into every
module whose functions it runs (inert). So, to compile in such a process, kernels are rebuilt as
``JITFunction`` s (:func:`as_jit_function`) and ``tl.core`` is put back in its pristine state for
the duration of each compilation (:func:`compiler_mode`). Both read private interpreter state that
changes between Triton releases: they refuse, with a ``RuntimeError`` naming the versions, to run
on another Triton. The runtime package never imports this module.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from typing import Any, Callable

import torch
from triton.runtime.jit import JITFunction

from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.triton_support import check_triton_series

WRITTEN_FOR = ("3.6", "3.8", "3.9")  # the Triton series whose interpreter internals it reads
_LANGUAGE_LOCK = threading.RLock()


def check_version(version: str | None = None) -> None:
    """``RuntimeError`` unless ``version`` (default: the installed Triton's) is of the
    :data:`WRITTEN_FOR` series."""
    check_triton_series(
        WRITTEN_FOR, "ahead-of-time compilation under TRITON_INTERPRET=1 reads internals of Triton "
        "{series}, found Triton {version}: install one of those or compile in a process "
        "without TRITON_INTERPRET=1", version)


def submit_compile(mode, key, build: Callable, keep: Callable):
    """A compile submitted to Triton's ``AsyncCompileMode`` ``mode`` as its own JIT path does:
    ``build()`` in the mode's threads, ``keep(kernel)`` when it is collected; the placeholder
    it returns stands for the kernel. Triton 3.9's ``submit`` also takes a clean-up step for a
    failed compile (nothing to clean here)."""
    if len(inspect.signature(mode.submit).parameters) >= 4:
        return mode.submit(key, build, keep, lambda placeholder: None)
    return mode.submit(key, build, keep)


def pointer_type(dtype: torch.dtype) -> str:
    """Triton's signature type of a pointer to ``dtype`` elements, e.g. ``"*fp16"``."""
    from triton._utils import type_canonicalisation_dict

    return "*" + type_canonicalisation_dict[str(dtype).split(".")[-1]]


def ptxas_tool(capability: int) -> str:
    """The path of the ``ptxas`` Triton assembles for ``capability`` (``90`` for sm_90a) with: its
    own choice between the wheel's ``ptxas`` and ``ptxas-blackwell``, which moved between
    releases, with the ``TRITON_PTXAS*`` overrides."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(capability).path


@contextlib.contextmanager
def compiler_mode():
    """Compile as on a GPU machine even under ``TRITON_INTERPRET=1``: the interpret knob off and
    ``tl.core`` pristine, for the block only."""
    if not interpreter_enabled():
        yield
        return
    check_version()
    # Imported with the knob still on: gluon's standard library asserts, at import, that its
    # triton functions are JITFunctions unless interpreting.
    import triton.compiler.code_generator  # noqa: F401

    with _LANGUAGE_LOCK, _pristine_language(), triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        yield


def _made_by_interpreter(value) -> bool:
    """A replacement the interpreter patched in (its own ``@jit`` objects do not count)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(value, InterpretedFunction):
        return False
    func = getattr(value, "func", value)  # functools.partial
    return getattr(func, "__module__", None) == "triton.runtime.interpreter"


_UNKNOWN = object()


def _pristine(module: types.ModuleType, name: str, value):
    """What ``module.name`` holds in a process that never interpreted a kernel, or ``_UNKNOWN``
    when that cannot be told. ``tl.core`` names that ``tl`` also binds are the same objects there
    (and ``tl`` is restored after each run); a ``_patch_attr`` wrapper keeps its builtin as the
    ``member`` keyword default."""
    import triton.language as tl
    from triton.runtime import interpreter

    if module is tl.core and name in vars(tl) and not name.startswith("__") and name != "math":
        if not _made_by_interpreter(vars(tl)[name]):
            return vars(tl)[name]
    if not _made_by_interpreter(value) or vars(interpreter).get(name) is value:
        return value
    return (getattr(value, "__kwdefaults__", None) or {}).get("member", _UNKNOWN)


def _language_leftovers() -> list[str]:
    """``triton.language`` names still holding interpreter patches that cannot be undone."""
    import triton.language as tl

    spaces = [("tl", tl), ("tl.core", tl.core), ("tl.math", tl.math), ("tl.tensor", tl.tensor),
              ("tl.dtype", tl.dtype)]
    return [f"{where}.{name}" for where, space in spaces for name, value in vars(space).items()
            if _pristine(space, name, value) is _UNKNOWN]


@contextlib.contextmanager
def _pristine_language():
    """``tl.core`` without the interpreter's leftover patches while the block runs; put back as it
    was afterwards. Raises ``RuntimeError`` naming what cannot be undone."""
    import triton.language as tl

    saved = {}
    for name, value in list(vars(tl.core).items()):
        clean = _pristine(tl.core, name, value)
        if clean is not _UNKNOWN and clean is not value:
            saved[name] = value
            setattr(tl.core, name, clean)
    try:
        leftovers = _language_leftovers()
        if leftovers:
            raise RuntimeError(
                "cannot compile ahead of time in this process: the Triton interpreter left "
                f"triton.language patched ({', '.join(leftovers[:5])}); run it in a process "
                "without TRITON_INTERPRET=1"
            )
        yield
    finally:
        for name, value in saved.items():
            setattr(tl.core, name, value)


# Language modules whose ``@jit`` functions a kernel may reach: Triton's and Gluon's (Gluon's
# ``gl.sum``, ``gl.max``… are Gluon functions over ``triton.language.standard``'s code).
_LANGUAGE_MODULES = ("triton.language", "triton.experimental.gluon.language")


def _rebuild(obj, memo: dict[int, Any]):
    """``obj`` with interpreter functions turned back into ``JITFunction`` s, recursively through
    their globals and through the language modules (shadow copies holding the rebuilt ``tl.sum``,
    ``tl.max``…); a Gluon ``JITFunction`` (``gluon.jit`` makes one even under the interpreter) is
    cloned the same way, so that the helpers it calls are rebuilt too; anything else unchanged."""
    from triton.runtime.interpreter import InterpretedFunction

    key = id(obj)
    if key in memo:
        return memo[key]
    gluon = isinstance(obj, JITFunction) and obj.is_gluon()
    if isinstance(obj, InterpretedFunction) or gluon:
        fn = obj.fn
        scope: dict[str, Any] = {}
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        for attr in ("__qualname__", "__module__", "__doc__", "__kwdefaults__", "__annotations__"):
            setattr(clone, attr, getattr(fn, attr))
        if gluon:
            jit = type(obj)(clone, version=obj.version, do_not_specialize=obj.do_not_specialize,
                            do_not_specialize_on_alignment=obj.do_not_specialize_on_alignment,
                            debug=obj.debug, noinline=obj.noinline, repr=obj._repr,
                            launch_metadata=obj.launch_metadata)
        else:
            jit = JITFunction(clone, **obj.kwargs)
        memo[key] = jit
        scope.update({name: _rebuild(value, memo) for name, value in fn.__globals__.items()})
        return jit
    if isinstance(obj, types.ModuleType) and obj.__name__.startswith(_LANGUAGE_MODULES):
        shadow = types.ModuleType(obj.__name__, obj.__doc__)
        memo[key] = shadow
        for name, value in vars(obj).items():
            clean = _pristine(obj, name, value)
            setattr(shadow, name, _rebuild(value if clean is _UNKNOWN else clean, memo))
        return shadow
    return obj


_REBUILT: dict[int, Any] = {}


def as_jit_function(obj) -> JITFunction:
    """The ``JITFunction`` for a ``@triton.jit`` or ``@gluon.jit`` kernel, also when it was defined
    under ``TRITON_INTERPRET=1`` (then rebuilt once and cached: a Triton kernel is an interpreter
    function, a Gluon kernel calls some; ``RuntimeError`` on a Triton this was not written
    for)."""
    if isinstance(obj, JITFunction) and not (obj.is_gluon() and interpreter_enabled()):
        return obj
    check_version()
    with _LANGUAGE_LOCK:
        jit = _rebuild(obj, _REBUILT)
    if not isinstance(jit, JITFunction):
        raise TypeError(f"expected a @triton.jit function, got {type(obj).__name__}")
    return jit

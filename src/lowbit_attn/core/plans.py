"""Launch plans: the Triton launches of one call, recorded once per configuration and replayed.

Triton's own launch path binds and specializes every argument of every launch on every call (~30
µs of host time per launch), and our launchers build their argument lists each time too. For a
call whose configuration (shapes, strides, dtypes, options: the caller's ``key``) was seen before,
a plan replays the same launches of the same compiled kernels directly, pointers as integers
(:mod:`lowbit_attn.core.plan_launches`: what is recorded, what a capture refuses, and what
Triton reads at each launch that a replay follows).

A :class:`Table` holds the plans of one kind of call by key: a key's first call runs normally
(compiling and autotuning what it needs), its second is captured, and from the third on the
caller replays the plan before any check, since the key holds everything they looked at. The
first plan of each kernel signature in a table is checked once before it is replayed (its
key's third call: :mod:`lowbit_attn.core.plan_check`); a failed check, or an exception in it,
turns plans off in the process, with one warning. ``LOWBIT_ATTN_LAUNCH``
(:class:`~lowbit_attn.core.options.KernelOptions`' ``launch``): ``plan`` (the default since
their GPU tests passed on an H200, 2026-11-30) or ``triton`` (every launch through Triton's own
path). Plans apply to eager calls (see
:func:`eager`) on the Triton backend outside the interpreter, while no Triton launch hook is
set.

A table made with ``dry_pass`` (``attention()``'s) gives a key's first call, under
``LOWBIT_ATTN_COMPILE=parallel``, a dry pass first: its launches compile side by side in threads
and nothing runs (:func:`~lowbit_attn.core.plan_launches.compile_ahead`), so that a new shape
waits for its slowest compile rather than for the sum of them.

``tests/test_launch_plans.py``, ``tests/inference/test_plans.py`` and
``tests/kvcache/test_planned.py`` compare replays launch by launch with Triton's path under
stand-in launches.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from lowbit_attn.core import arch
from lowbit_attn.core.arch import ENV
from lowbit_attn.core.options import KernelOptions, env_names
from lowbit_attn.core.plan_check import check
from lowbit_attn.core.plan_launches import Plan, capture, compile_ahead, launch_state, replay

# What else a call's checks and launches read: the environment (Triton's launch path reads
# TRITON_FPSAN_HOMOMORPHIC_CASTS, from 3.9, at every launch), every placement variable among it
# (a replay then implies the values a checked call had: the calls read them only without one).
ENV_KEY = ("LOWBIT_ATTN_LAUNCH", "LOWBIT_ATTN_BACKEND", "LOWBIT_ATTN_ARCH", "LOWBIT_ATTN_KERNEL", "LOWBIT_ATTN_TRAIN_DQ", "LOWBIT_ATTN_BWD_KERNEL", "TRITON_INTERPRET",
           "TRITON_FPSAN_HOMOMORPHIC_CASTS")
MAX_PLANS = 256  # keys a table remembers; it starts over past them
MISSING = object()  # what Table.replay gives for a key without a plan

_ENV_NAMES = env_names(ENV_KEY)
_SEEN = "seen"  # a key's state after its first call
_off: list[str] = []  # why plans are off in this process, if they are
_off_lock = threading.Lock()


@dataclass(frozen=True)
class Unchecked:
    """A key's state between its capture and its first-use check: the plan, not yet replayed."""

    plan: Plan


def eager(*tensors) -> bool:
    """Whether a call on ``tensors`` runs eagerly on plain tensors: nothing traces it
    (``torch.compile``, ``torch.jit.trace``), wraps it (a dispatch or function mode, a functorch
    transform, a tensor subclass, a forward-mode AD level) or records it (a CUDA graph capture on
    their device)."""
    return (not torch.compiler.is_compiling()
            and not torch.jit.is_tracing()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active()
            and torch.autograd.forward_ad._current_level < 0
            and all(x.__class__ is torch.Tensor for x in tensors)
            and not arch.graph_capturing(tensors[0].device))


def tensor_key(x: torch.Tensor) -> tuple:
    """What a call's checks and launches read of a tensor argument (its address modulo 16
    included: Triton specializes on it)."""
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, x.requires_grad)


def shared_memory(inputs: tuple[torch.Tensor, ...]) -> tuple:
    """Which inputs share memory with which earlier ones, and how far apart they start
    (``(i, j, bytes)``): part of a plan's key, since a plan addresses an input from the first
    input it shared memory with when captured."""
    owners = [x.untyped_storage().data_ptr() for x in inputs]
    return tuple((i, j, inputs[j].data_ptr() - inputs[i].data_ptr())
                 for j in range(1, len(inputs)) for i in range(j) if owners[i] == owners[j])


def env_key() -> tuple:
    """The environment variables of :data:`ENV_KEY`, as they are now."""
    return tuple(map(ENV.get, _ENV_NAMES))


def plannable(backend: str) -> bool:
    """Whether a call on ``backend`` may be captured (or checked) now: ``LOWBIT_ATTN_LAUNCH=plan``
    (read with the other options: ``ValueError`` naming a variable set to no mode of its own)."""
    return (KernelOptions.from_env().launch_plans and not _off and backend == "triton"
            and not arch.interpreter_enabled() and launch_state() is not None)


def _turn_off(why: str) -> None:
    """Plans off in every table of the process, with one warning."""
    with _off_lock:
        if _off:
            return
        _off.append(why)
    warnings.warn(f"lowbit_attn: launch plans are off in this process: {why}; every launch goes "
                  "through Triton's launch path (as with LOWBIT_ATTN_LAUNCH=triton)",
                  RuntimeWarning, stacklevel=4)


def ahead(backend: str) -> bool:
    """Whether a key's first call on ``backend`` compiles its kernels side by side first:
    ``LOWBIT_ATTN_COMPILE=parallel``, compiled kernels (not the interpreter)."""
    return (KernelOptions.from_env().compile_ahead and backend == "triton"
            and not arch.interpreter_enabled())


class Table:
    """The plans of one kind of call, by key (a key holds everything the call's checks and
    launches read). The first plan of each kernel signature is checked before its first replay
    (:func:`~lowbit_attn.core.plan_check.check`); a failure turns plans off in the process.
    ``dry_pass``: a key's first call may run first as a dry pass that compiles its kernels side
    by side (:func:`ahead`; for calls that change nothing but through PyTorch and Triton)."""

    def __init__(self, *, dry_pass: bool = False) -> None:
        self._dry_pass = dry_pass
        self._table: dict = {}
        self._checked: set = set()  # the kernel signatures whose first replay passed its check

    def ready(self, key) -> Plan | None:
        """The plan :meth:`replay` would replay for ``key`` now (a checked plan, plans not
        turned off, Triton's launch state the captured one), or None."""
        plan = self._table.get(key)
        if plan.__class__ is not Plan or _off or launch_state() != plan.state:
            return None
        return plan

    def replay(self, key, inputs: tuple[torch.Tensor, ...]):
        """The outputs of the plan of ``key`` run on ``inputs``, or :data:`MISSING`."""
        plan = self.ready(key)
        return MISSING if plan is None else replay(plan, inputs)

    def call(self, key, fn: Callable, inputs: tuple[torch.Tensor, ...], backend: str):
        """``fn()`` (the call of ``key`` on ``inputs``, on ``backend``), after its dry pass on
        the key's first call (when :func:`ahead`), captured into a plan on the key's second
        call, and checked on its third when its kernels were not yet."""
        state = self._table.get(key)
        if state is None:
            if len(self._table) >= MAX_PLANS:
                self._table.clear()
            self._table[key] = _SEEN
            if self._dry_pass and ahead(backend):
                compile_ahead(fn)
            return fn()
        if not plannable(backend):
            return fn()
        if state is _SEEN:
            result, plan = capture(fn, inputs)
            checked = isinstance(plan, Plan) and plan.signature in self._checked
            self._table[key] = plan if checked or isinstance(plan, str) else Unchecked(plan)
            return result
        if state.__class__ is Unchecked and launch_state() == state.plan.state:
            result, why = check(state.plan, fn, inputs)
            if why is None:
                self._checked.add(state.plan.signature)
                self._table[key] = state.plan
            else:
                names = ", ".join(launch.name for launch in state.plan.launches)
                self._table[key] = f"its first replay failed its check: {why}"
                _turn_off(f"the first replay of {names} did not do what the normal call did "
                          f"({why})")
            return result
        return fn()

    def state(self, key) -> object:
        """``None``, ``"seen"``, an :class:`Unchecked` plan, a :class:`Plan`, or the reason the
        key gets none."""
        return self._table.get(key)

    def clear(self) -> None:
        self._table.clear()
        self._checked.clear()


def reset() -> None:
    """Forget a failed check that turned plans off (tests)."""
    with _off_lock:
        _off.clear()

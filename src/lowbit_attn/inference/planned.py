"""The eager path of :func:`lowbit_attn.attention`: launch plans per configuration.

A call in eager mode (not traced or compiled, plain tensors, no dispatch or function mode, no
functorch transform) gets a key: everything its checks and its launches depend on. The first call
of a key runs normally (compiling and autotuning what it needs); the second is captured
(:func:`lowbit_attn.core.plans.capture`); from the third on, ``attention()`` replays the plan
before any check, since the key holds everything they looked at. Calls that are not eager go
through the custom op, as before.

``LOWBIT_ATTN_LAUNCH``: ``plan`` (default) or ``triton`` (every launch through Triton's own
path). Plans apply to the Triton backend outside the interpreter, when no Triton launch hook is
set; on each device the first replay is compared bit for bit with the normal call, and a
mismatch turns plans off for the process with a warning.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
from triton.runtime import jit

from lowbit_attn.core import plans
from lowbit_attn.core.arch import interpreter_enabled
from lowbit_attn.core.counters import count_call

LAUNCH_MODES = ("plan", "triton")
# What else a call's checks and launches read: the environment.
ENV_KEY = ("LOWBIT_ATTN_LAUNCH", "LOWBIT_ATTN_BACKEND", "LOWBIT_ATTN_ARCH", "LOWBIT_ATTN_Q_QUANT",
           "LOWBIT_ATTN_KV_STATS", "LOWBIT_ATTN_KERNEL", "TRITON_INTERPRET")
MAX_PLANS = 256  # keys remembered; the table starts over past it

# os.environ's own table, read directly: os.environ.get costs ~1 µs a name (it encodes the name)
_ENV = os.environ._data
_ENV_NAMES = tuple(map(os.environ.encodekey, ENV_KEY))

_SEEN = "seen"  # a key's state after its first call
_table: dict = {}
_verified: set = set()  # devices whose first replay matched the normal call
_off: list[str] = []  # why plans are off in this process, if they are


def eager(*tensors) -> bool:
    """Whether a call on ``tensors`` runs eagerly on plain tensors (nothing traces or wraps it)."""
    return (not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active()
            and all(x.__class__ is torch.Tensor for x in tensors))


def _tensor_key(x: torch.Tensor) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, x.requires_grad)


def key(q, k, v, is_causal, scale, layout, recipe, return_lse) -> tuple | None:
    """The plan key of an ``attention()`` call, or ``None`` when it gets none (not eager, or an
    argument of an unusual kind: the checks will say what is wrong with it)."""
    if not (eager(q, k, v) and is_causal.__class__ is bool and return_lse.__class__ is bool
            and (scale is None or scale.__class__ is float) and layout.__class__ is str
            and (recipe.__class__ is str or getattr(recipe, "__hash__", None) is not None)):
        return None
    return (_tensor_key(q), _tensor_key(k), _tensor_key(v), plans.shared_memory((q, k, v)),
            torch.is_grad_enabled(), is_causal, scale, layout, recipe, return_lse,
            tuple(map(_ENV.get, _ENV_NAMES)))


def _stream() -> int:
    driver = jit.driver.active
    return driver.get_current_stream(driver.get_current_device())


def replay(key: tuple | None, inputs: tuple[torch.Tensor, ...]):
    """The outputs of the plan of ``key`` run on ``inputs``, or ``None`` when there is none."""
    plan = _table.get(key)
    if plan.__class__ is not plans.Plan:
        return None
    count_call("attention")
    return plans.replay(plan, inputs, inputs[0].device, _stream())


def _plannable(backend: str) -> bool:
    mode = os.environ.get("LOWBIT_ATTN_LAUNCH", LAUNCH_MODES[0])
    if mode not in LAUNCH_MODES:
        raise ValueError(f"LOWBIT_ATTN_LAUNCH must be one of {LAUNCH_MODES}, got {mode!r}")
    return (mode == "plan" and not _off and backend == "triton"
            and not interpreter_enabled() and not plans.launch_hooks_set())


def call(key: tuple, fn: Callable, inputs: tuple[torch.Tensor, ...], backend: str):
    """``fn()`` (the call of ``key`` on ``inputs``, on ``backend``), captured into a plan on the
    key's second call."""
    state = _table.get(key)
    device = inputs[0].device
    if state is None:
        if len(_table) >= MAX_PLANS:
            _table.clear()
        _table[key] = _SEEN
        return fn()
    if state != _SEEN or not _plannable(backend):
        return fn()
    result, plan = plans.capture(fn, inputs)
    if isinstance(plan, str):
        _table[key] = plan
        return result
    if device.type == "cuda" and device not in _verified:
        if not plans.first_use_ok(result, plans.replay(plan, inputs, device, _stream())):
            _off.append(f"the first replay on {device} differed from the normal call")
            warnings.warn(f"lowbit_attn: launch plans are off in this process: {_off[0]}",
                          RuntimeWarning, stacklevel=3)
            _table[key] = _off[0]
            return result
        _verified.add(device)
    _table[key] = plan
    return result


def state(key: tuple) -> object:
    """What the table holds for ``key``: ``None``, ``"seen"``, a :class:`~lowbit_attn.core.plans.
    Plan`, or the reason the key gets none (for tests and ``bench --host``)."""
    return _table.get(key)


def clear() -> None:
    """Forget every plan (and a mismatch that turned them off)."""
    _table.clear()
    _verified.clear()
    _off.clear()

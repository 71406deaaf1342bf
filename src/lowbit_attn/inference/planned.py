"""The eager path of :func:`lowbit_attn.attention`: launch plans per configuration
(:mod:`lowbit_attn.core.plans`).

A call in eager mode (not traced, compiled or captured in a CUDA graph, plain tensors, no
dispatch or function mode, no functorch transform: ``plans.eager``) gets a key: everything its
checks and its launches depend on. The first call of a key runs normally (under
``LOWBIT_ATTN_COMPILE=parallel`` after a dry pass that compiles its kernels side by side); the
second is captured; from the third on, ``attention()`` replays the plan before any check (from
the fourth when the third checks the plan's kernels: once per kernel signature). Calls that are not eager
go through the custom op, as before.
"""

from __future__ import annotations

from typing import Callable

import torch

from lowbit_attn.core import plans
from lowbit_attn.core.counters import count_call

_table = plans.Table(dry_pass=True)  # a call changes nothing but its outputs


def _plain_value(x) -> bool:
    """None, an int or float, or a tuple of two ints: a variant argument that can key a plan."""
    if x is None or x.__class__ in (int, float):
        return True
    return x.__class__ is tuple and len(x) == 2 and all(e.__class__ is int for e in x)


def key(q, k, v, is_causal, scale, layout, recipe, return_lse, extras=(None, None, None),
        sinks=None) -> tuple | None:
    """The plan key of an ``attention()`` call, or ``None`` when it gets none (not eager, an
    argument of an unusual kind: the checks will say what is wrong with it, or ``sinks``: a
    tensor the plan would not see). ``extras``: ``(window, softcap, chunk)``."""
    # eager first: under torch.compile an argument may be a traced number, which the other
    # tests would not read without a graph break
    if sinks is not None or not plans.eager(q, k, v) or not all(_plain_value(x) for x in extras):
        return None
    if not (is_causal.__class__ is bool and return_lse.__class__ is bool
            and (scale is None or scale.__class__ is float) and layout.__class__ is str
            and (recipe.__class__ is str or getattr(recipe, "__hash__", None) is not None)):
        return None
    tensor_key = plans.tensor_key
    return (tensor_key(q), tensor_key(k), tensor_key(v), plans.shared_memory((q, k, v)),
            torch.is_grad_enabled(), is_causal, scale, layout, recipe, return_lse, extras,
            plans.env_key())


def replay(key: tuple | None, inputs: tuple[torch.Tensor, ...]):
    """The outputs of the plan of ``key`` run on ``inputs``, or ``None`` when there is none."""
    found = _table.replay(key, inputs)
    if found is plans.MISSING:
        return None
    count_call("attention")
    return found


def call(key: tuple, fn: Callable, inputs: tuple[torch.Tensor, ...], backend: str):
    """``fn()`` (the call of ``key`` on ``inputs``, on ``backend``), captured into a plan on the
    key's second call."""
    return _table.call(key, fn, inputs, backend)


def state(key: tuple) -> object:
    """What the table holds for ``key``: ``None``, ``"seen"``, a plan awaiting its first-use check
    (:class:`~lowbit_attn.core.plans.Unchecked`), a :class:`~lowbit_attn.core.plans.Plan`, or the
    reason the key gets none (for tests and ``bench --host``)."""
    return _table.state(key)


def clear() -> None:
    """Forget every plan and checked kernel signature (and a failed check that turned plans
    off)."""
    _table.clear()
    plans.reset()

"""The first-use check of a launch plan (:mod:`lowbit_attn.core.plans` runs it once per table and
kernel signature): the call made normally, against the plan replayed on copies of its inputs.

A replay on the captured call's own inputs could not show a pointer taken as a value (it would
point at the right place by chance), and a workspace that happens to hold the normal call's
bytes could hide a buffer the replay never writes. So :func:`check`

- copies every input's memory to fresh buffers (other addresses, the same alignment modulo 16
  bytes, inputs that share memory still sharing it), before the call;
- makes the call normally, every allocation it makes filled with :data:`POISON` bytes;
- replays the plan on the copies, its outputs and workspace filled with the same bytes;
- compares, byte for byte, the outputs and every input's memory afterwards (a call may write
  its inputs: a KV-cache append writes the cache).
"""

from __future__ import annotations

from typing import Callable

import torch

from lowbit_attn.core.plan_launches import ALLOCATING_OPS, POISON, Plan, replay


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def copies(inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], list]:
    """Each input viewed in a fresh copy of its storage (one copy per storage), at an address
    with the original's remainder modulo 16 (Triton specializes on it); and the pairs (a
    storage's bytes, its copy's)."""
    made: dict[int, tuple[torch.Tensor, int]] = {}  # storage → (room for its copy, the shift)
    pairs, out = [], []
    for x in inputs:
        storage = x.untyped_storage()
        if storage.data_ptr() not in made:
            room = torch.empty(storage.nbytes() + 16, dtype=torch.uint8, device=x.device)
            shift = (storage.data_ptr() - room.data_ptr()) % 16
            pairs.append((_bytes(storage), room[shift:shift + storage.nbytes()]))
            pairs[-1][1].copy_(pairs[-1][0])
            made[storage.data_ptr()] = room, shift
        room, shift = made[storage.data_ptr()]
        start = shift + x.storage_offset() * x.element_size()
        if start % x.element_size():
            raise ValueError(f"input {len(out)}'s storage is not aligned to its elements")
        out.append(torch.empty(0, dtype=x.dtype, device=x.device).set_(
            room.untyped_storage(), start // x.element_size(), x.shape, x.stride()))
    return tuple(out), pairs


def _poisoned_allocations():
    """A dispatch mode that fills every allocation with :data:`POISON` bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Poisoned(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ALLOCATING_OPS:
                result.untyped_storage().fill_(POISON)
            return result

    return Poisoned()


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else () if result is None else (result,)


def differences(normal, replayed, memory: list) -> str | None:
    """Why a replay (``replayed``, on copies of the inputs) did not do what the normal call did
    (``normal``), or None: each output, and each input storage against its copy (``memory``,
    from :func:`copies`), byte for byte (NaN included)."""
    normal, replayed = _as_tuple(normal), _as_tuple(replayed)
    if len(normal) != len(replayed):
        return f"it returned {len(replayed)} outputs, the normal call {len(normal)}"
    for i, (a, b) in enumerate(zip(normal, replayed)):
        if (a.shape != b.shape or a.dtype != b.dtype
                or not torch.equal(_bytes(a.untyped_storage()), _bytes(b.untyped_storage()))):
            return f"its output {i} differs from the normal call's"
    for i, (a, b) in enumerate(memory):
        if not torch.equal(a, b):
            return f"the memory of its input storage {i} differs from the normal call's afterwards"
    return None


def _reason(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def check(plan: Plan, fn: Callable, inputs: tuple[torch.Tensor, ...]) -> tuple[object, str | None]:
    """``(fn(), None)`` when a replay of ``plan`` on copies of ``inputs`` does what the call
    ``fn()`` does to ``inputs`` (see the module docstring), else ``(fn(), why not)``: a
    difference, or an exception raised by the check (one ``fn()`` raises propagates, as it
    would without plans). ``fn()`` runs once, normally; its result is the one returned."""
    try:
        replayed_inputs, memory = copies(inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of the check is a reason
        return fn(), _reason(exc)
    with _poisoned_allocations():
        result = fn()
    try:
        replayed = replay(plan, replayed_inputs, poison=True)
        return result, differences(result, replayed, memory)
    except Exception as exc:  # noqa: BLE001
        return result, _reason(exc)

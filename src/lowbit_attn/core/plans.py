"""Launch plans: the Triton launches of one call, recorded once per configuration and replayed.

Triton's own launch path binds and specializes every argument of every launch on every call (~30
µs of host time per launch), and our launchers build their argument lists each time too. For a
call whose configuration (shapes, strides, dtypes, options: the caller's ``key``) was seen before,
a plan replays the same launches of the same compiled kernels directly:

- :func:`capture` runs the call once while it records each launch: the compiled kernel, the
  grid and the bound arguments, each tensor argument as a base and an offset (an input, an
  output, or an intermediate buffer). It refuses a call that runs any PyTorch operation other than
  allocations and views (a replay would skip it) or has no launch.
- :func:`replay` allocates the outputs and one workspace for every intermediate buffer, and
  launches each kernel with pointers as integers (Triton's launchers take them so): no binder,
  no per-call PyTorch operation but the allocations.

A :class:`Table` holds the plans of one kind of call by key: a key's first call runs normally
(compiling and autotuning what it needs), its second is captured, and from the third on the
caller replays the plan before any check, since the key holds everything they looked at.
``LOWBIT_ATTN_LAUNCH``: ``plan`` (default) or ``triton`` (every launch through Triton's own
path). Plans apply to the Triton backend outside the interpreter, when no Triton launch hook is
set.

Only the arguments differ from what Triton's path passes (integers for tensors); the kernels,
grids and every other value are the recorded ones. ``tests/inference/test_plans.py`` checks this
launch by launch with Triton's path under stand-in launches; the first replay on each device is
compared bit for bit with the normal call (:func:`first_use_ok`).
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

ALIGN = 256  # bytes between the workspace's buffers
# ATen operations that allocate or view and launch nothing on a GPU.
NO_KERNEL_OPS = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view",
    "reshape", "_reshape_alias", "transpose", "permute", "t", "slice", "select", "unsqueeze",
    "squeeze", "expand", "as_strided", "alias", "detach", "split", "unbind", "lift_fresh",
})

_lock = threading.Lock()


@dataclass(frozen=True)
class Launch:
    """One recorded launch: ``launcher(gx, gy, gz, stream, function, metadata, None, None, None,
    *args)`` with ``args[i] = bases[b] + offset`` (or its element ``j`` when ``j >= 0``: a tensor
    inside a tuple argument) for each ``(i, j, b, offset)`` of ``pointers`` (bases: the inputs,
    then the outputs, then the workspace)."""

    name: str
    launcher: Callable
    grid: tuple[int, int, int]
    function: object
    metadata: object
    args: tuple
    pointers: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class Plan:
    """The launches of one configuration, the outputs' shapes and dtypes, and the workspace size."""

    launches: tuple[Launch, ...]
    outputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    workspace_bytes: int


def _kernel_ops_mode(found: list[str]):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL_OPS:
                found.append(name)
            return func(*args, **(kwargs or {}))

    return Ops()


def _recorded_runs(records: list):
    """``JITFunction.run`` that also notes each launch's kernel, arguments and compiled kernel."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run
    thread = threading.get_ident()

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not warmup and threading.get_ident() == thread:  # not another thread's launches
            records.append((self, args, kwargs, grid, kernel))
        return kernel

    return original, run


def capture(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> tuple[object, Plan | str]:
    """``(fn(), its plan)``, or ``(fn(), why not)`` when the call cannot be replayed. ``fn``
    returns a tensor, a tuple of tensors (the outputs) or None (no output), and reads no tensor
    but ``inputs`` and buffers it allocates. Inputs that share memory are addressed from the
    first of them: the caller's key must hold their distances (:func:`shared_memory`)."""
    from triton.runtime import jit

    records: list = []
    ops: list[str] = []
    with _lock:
        original, recording = _recorded_runs(records)
        jit.JITFunction.run = recording
        try:
            with _kernel_ops_mode(ops):
                result = fn()
        finally:
            jit.JITFunction.run = original
    if ops:
        return result, f"the call runs PyTorch operations {sorted(set(ops))}"
    if not records:
        return result, "the call launches no Triton kernel"
    outputs = result if isinstance(result, tuple) else () if result is None else (result,)
    bases = [x.data_ptr() for x in inputs] + [x.data_ptr() for x in outputs]
    owners = [x.untyped_storage().data_ptr() for x in (*inputs, *outputs)]
    slots: dict[int, int] = {}  # an intermediate's storage → its offset in the workspace
    sizes: dict[int, int] = {}
    launches = []
    for jit_fn, args, kwargs, grid, kernel in records:
        binder = jit_fn.device_caches[jit.driver.active.get_current_device()][4]
        bound = binder(*args, **kwargs)[0]
        if callable(grid):
            grid = grid(bound)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        values, pointers = [], []

        def pointer(value, i, j):
            storage = value.untyped_storage().data_ptr()
            if storage in owners:  # an input or output: relative to it
                b = owners.index(storage)
                return (i, j, b, value.data_ptr() - bases[b])
            # an intermediate: relative to its storage, in the workspace
            sizes[storage] = max(sizes.get(storage, 0), value.untyped_storage().nbytes())
            slots.setdefault(storage, len(slots))
            return (i, j, -1 - slots[storage], value.data_ptr() - storage)

        for i, value in enumerate(bound.values()):
            if isinstance(value, torch.Tensor):
                pointers.append(pointer(value, i, -1))
                value = None
            elif isinstance(value, tuple) and any(isinstance(x, torch.Tensor) for x in value):
                pointers += [pointer(x, i, j) for j, x in enumerate(value)
                             if isinstance(x, torch.Tensor)]
                value = tuple(None if isinstance(x, torch.Tensor) else x for x in value)
            values.append(value)
        launches.append(Launch(jit_fn.fn.__name__, kernel.run, grid, kernel.function,
                               kernel.packed_metadata, tuple(values), tuple(pointers)))
    # workspace offsets, each intermediate ALIGN-aligned
    offsets, total = {}, 0
    for storage, slot in slots.items():
        offsets[slot] = total
        total += -(-sizes[storage] // ALIGN) * ALIGN
    first_workspace = len(bases)
    fixed = []
    for launch in launches:
        pointers = tuple(
            (i, j, b, off) if b >= 0 else (i, j, first_workspace, offsets[-1 - b] + off)
            for i, j, b, off in launch.pointers
        )
        fixed.append(Launch(launch.name, launch.launcher, launch.grid, launch.function,
                            launch.metadata, launch.args, pointers))
    plan = Plan(tuple(fixed), tuple((tuple(x.shape), x.dtype) for x in outputs), total)
    return result, plan


def replay(plan: Plan, inputs: tuple[torch.Tensor, ...], device: torch.device, stream: int):
    """The outputs of ``plan`` run on ``inputs`` (the same configuration as when captured), its
    launches enqueued on ``stream``: a tensor, or a tuple when the captured call returned one, or
    None when it returned None."""
    outputs = tuple(torch.empty(shape, dtype=dtype, device=device)
                    for shape, dtype in plan.outputs)
    bases = [x.data_ptr() for x in inputs] + [x.data_ptr() for x in outputs]
    workspace = None
    if plan.workspace_bytes:
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device)
        bases.append(workspace.data_ptr())
    for launch in plan.launches:
        args = list(launch.args)
        for i, j, b, off in launch.pointers:
            if j < 0:
                args[i] = bases[b] + off
            else:  # inside a tuple argument
                args[i] = (*args[i][:j], bases[b] + off, *args[i][j + 1:])
        gx, gy, gz = launch.grid
        launch.launcher(gx, gy, gz, stream, launch.function, launch.metadata, None, None, None,
                        *args)
    del workspace  # freed after the launches are enqueued (stream-ordered, as any tensor)
    return outputs if len(outputs) > 1 else outputs[0] if outputs else None


def shared_memory(inputs: tuple[torch.Tensor, ...]) -> tuple:
    """Which inputs share memory, and how far apart they start: part of a plan's key."""
    owners = [x.untyped_storage().data_ptr() for x in inputs]
    return tuple((j, inputs[j].data_ptr() - inputs[i].data_ptr())
                 for j in range(1, len(inputs)) for i in range(j) if owners[i] == owners[j])


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook (a profiler's) is set: then every launch goes Triton's way.
    Triton holds its hooks in chains (an empty chain is no hook)."""
    from triton import knobs

    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def first_use_ok(normal, replayed) -> bool:
    """Whether a replay's outputs equal the normal call's bit for bit (the kernels are
    deterministic)."""
    normal = normal if isinstance(normal, tuple) else (normal,)
    replayed = replayed if isinstance(replayed, tuple) else (replayed,)
    return all(a.shape == b.shape and a.dtype == b.dtype
               and torch.equal(a.view(torch.uint8) if a.numel() else a,
                               b.view(torch.uint8) if b.numel() else b)
               for a, b in zip(normal, replayed))


# ---------------------------------------------------------------------------------------------
# tables of plans, by key

LAUNCH_MODES = ("plan", "triton")
# What else a call's checks and launches read: the environment.
ENV_KEY = ("LOWBIT_ATTN_LAUNCH", "LOWBIT_ATTN_BACKEND", "LOWBIT_ATTN_ARCH", "LOWBIT_ATTN_Q_QUANT",
           "LOWBIT_ATTN_KV_STATS", "LOWBIT_ATTN_KERNEL", "TRITON_INTERPRET")
MAX_PLANS = 256  # keys a table remembers; it starts over past them
MISSING = object()  # what Table.replay gives for a key without a plan

# os.environ's own table, read directly: os.environ.get costs ~1 µs a name (it encodes the name)
_ENV = os.environ._data
_ENV_NAMES = tuple(map(os.environ.encodekey, ENV_KEY))
_SEEN = "seen"  # a key's state after its first call
_verified: set = set()  # devices whose first replay matched the normal call
_off: list[str] = []  # why plans are off in this process, if they are


def eager(*tensors) -> bool:
    """Whether a call on ``tensors`` runs eagerly on plain tensors (nothing traces or wraps it)."""
    return (not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active()
            and all(x.__class__ is torch.Tensor for x in tensors))


def tensor_key(x: torch.Tensor) -> tuple:
    """What a call's checks and launches read of a tensor argument (its address modulo 16
    included: Triton specializes on it)."""
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, x.requires_grad)


def env_key() -> tuple:
    """The environment variables of :data:`ENV_KEY`, as they are now."""
    return tuple(map(_ENV.get, _ENV_NAMES))


def _stream() -> int:
    from triton.runtime import jit

    driver = jit.driver.active
    return driver.get_current_stream(driver.get_current_device())


def plannable(backend: str) -> bool:
    """Whether a call on ``backend`` may be captured now."""
    from lowbit_attn.core.arch import interpreter_enabled

    mode = os.environ.get("LOWBIT_ATTN_LAUNCH", LAUNCH_MODES[0])
    if mode not in LAUNCH_MODES:
        raise ValueError(f"LOWBIT_ATTN_LAUNCH must be one of {LAUNCH_MODES}, got {mode!r}")
    return (mode == "plan" and not _off and backend == "triton"
            and not interpreter_enabled() and not launch_hooks_set())


class Table:
    """The plans of one kind of call, by key (a key holds everything the call's checks and
    launches read). On each device the first replay of a call with outputs is compared bit for
    bit with the normal call (:func:`first_use_ok`); a mismatch turns plans off for the process,
    in every table, with a warning. A call without outputs (a KV-cache append) cannot be
    replayed twice to compare: its launches are checked against Triton's path by the tests, and
    the replay mechanism by the first comparison on the device."""

    def __init__(self) -> None:
        self._table: dict = {}

    def has_plan(self, key) -> bool:
        """Whether :meth:`replay` would replay ``key`` now (a plan, and plans not turned off)."""
        return self._table.get(key).__class__ is Plan and not _off

    def replay(self, key, inputs: tuple[torch.Tensor, ...]):
        """The outputs of the plan of ``key`` run on ``inputs``, or :data:`MISSING`."""
        plan = self._table.get(key)
        if plan.__class__ is not Plan or _off:
            return MISSING
        return replay(plan, inputs, inputs[0].device, _stream())

    def call(self, key, fn: Callable, inputs: tuple[torch.Tensor, ...], backend: str):
        """``fn()`` (the call of ``key`` on ``inputs``, on ``backend``), captured into a plan on
        the key's second call."""
        state = self._table.get(key)
        if state is None:
            if len(self._table) >= MAX_PLANS:
                self._table.clear()
            self._table[key] = _SEEN
            return fn()
        if state != _SEEN or not plannable(backend):
            return fn()
        result, plan = capture(fn, inputs)
        if isinstance(plan, str):
            self._table[key] = plan
            return result
        device = inputs[0].device
        if device.type == "cuda" and device not in _verified and result is not None:
            if not first_use_ok(result, replay(plan, inputs, device, _stream())):
                _off.append(f"the first replay on {device} differed from the normal call")
                warnings.warn(f"lowbit_attn: launch plans are off in this process: {_off[0]}",
                              RuntimeWarning, stacklevel=3)
                self._table[key] = _off[0]
                return result
            _verified.add(device)
        self._table[key] = plan
        return result

    def state(self, key) -> object:
        """``None``, ``"seen"``, a :class:`Plan`, or the reason the key gets none."""
        return self._table.get(key)

    def clear(self) -> None:
        self._table.clear()


def reset() -> None:
    """Forget which devices were verified, and a mismatch that turned plans off (tests)."""
    _verified.clear()
    _off.clear()

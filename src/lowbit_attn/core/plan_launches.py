"""Launch plans, the mechanism: the Triton launches of one call recorded (:func:`capture`) and
replayed (:func:`replay`). The tables of plans by key, and when a call gets one, are
:mod:`lowbit_attn.core.plans`.

Triton's launch path binds and specializes every argument of every launch on every call (~30
µs of host time per launch). A plan keeps what that path produced for one configuration (the
compiled kernel, the grid, the bound arguments, each tensor argument as a base and an offset:
an input, an output, or an intermediate buffer) and launches the same compiled kernels with
pointers as integers. Besides the arguments, a launch through Triton's path reads:

- the current device (whose compiled kernels and stream it uses), Triton's ``debug`` and
  instrumentation knobs (which compiled kernel), and its launch hooks: a plan holds the
  :func:`launch_state` it was captured in and is replayed only in that state;
- the allocator of Triton's global scratch (kernels that make TMA descriptors on the device ask
  it at each launch): a replay launches such a kernel under the allocator its launch saw.

The same wrapping of Triton's launch path gives a call's dry pass (:func:`compile_ahead`): its
launches compile side by side instead of one after another, and launch nothing.

What a replay assumes of the call is asserted at capture, which refuses the call otherwise: it
runs no PyTorch operation but allocations and views; each launch is on the device and stream
current at the start, through Triton's JIT path with no pre-run hook, and needs no profiling
scratch; a tensor argument is an input's memory, an output's, or memory the call allocated
(replayed as one workspace); outputs are fresh, contiguous tensors that fill their storage.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

try:
    from triton import knobs
    from triton.runtime import _allocation, autotuner, jit
except ImportError:  # no Triton (it has Linux wheels only): every call runs the reference path,
    knobs = _allocation = autotuner = jit = None  # so no plan ever holds a Triton launch

ALIGN = 256  # bytes between the workspace's buffers
# ATen operations that allocate or view and launch nothing on a GPU.
ALLOCATING_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty",
                            "new_empty_strided"})
NO_KERNEL_OPS = ALLOCATING_OPS | frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "permute", "t", "slice",
    "select", "unsqueeze", "squeeze", "expand", "as_strided", "alias", "detach", "split",
    "unbind", "lift_fresh",
})
POISON = 0xFF  # the byte a checked replay's outputs and workspace are filled with (NaN, -1)


@dataclass(frozen=True)
class Launch:
    """One recorded launch: ``launcher(gx, gy, gz, stream, function, metadata, None, None, None,
    *args)`` with ``args[i] = bases[b] + offset`` (or its element ``j`` when ``j >= 0``: a tensor
    inside a tuple argument) for each ``(i, j, b, offset)`` of ``pointers`` (bases: the inputs,
    then the outputs, then the workspace); under ``allocator`` (Triton's scratch allocator) when
    the kernel needs global scratch."""

    name: str
    launcher: Callable
    grid: tuple[int, int, int]
    function: object
    metadata: object
    args: tuple
    pointers: tuple[tuple[int, int, int, int], ...]
    allocator: object = None


@dataclass(frozen=True)
class Plan:
    """The launches of one configuration, the outputs' shapes and dtypes, the workspace size,
    and the :func:`launch_state` it replays in."""

    launches: tuple[Launch, ...]
    outputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    workspace_bytes: int
    state: tuple

    @property
    def signature(self) -> tuple:
        """The compiled kernels it launches, in order (what its first-use check covers)."""
        return tuple((launch.name, launch.function) for launch in self.launches)


def launch_state() -> tuple | None:
    """What Triton's launch path reads at every launch besides the arguments: ``(current
    device, debug knob, instrumentation mode)``; None while a hook would see each launch (a
    profiler's launch hooks, a compiler-stage inspection hook): then launches go Triton's way."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # Triton keeps hooks in chains
            return None
    if getattr(runtime, "add_stages_inspection_hook", None) is not None:
        return None
    return (jit.driver.active.get_current_device(), runtime.debug,
            knobs.compilation.instrumentation_mode)


# ---------------------------------------------------------------------------------------------
# recording

_recording = threading.local()  # .records: the launches the thread's capture notes, or None
_lock = threading.Lock()  # held only to wrap or unwrap JITFunction.run, never across a call
_captures = [0]  # captures in progress in any thread (JITFunction.run is wrapped while > 0)
_original_run: list = []  # JITFunction.run, then Autotuner.run, while wrapped


def _recorded_run(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` that also notes, for the thread capturing, each launch: the kernel,
    its arguments, the compiled kernel, and the device, stream and scratch allocator it saw; in
    a thread's dry pass (:func:`compile_ahead`) a launch only compiles (Triton's ``warmup``)."""
    if getattr(_recording, "ahead", False):
        return _original_run[0](self, *args, grid=grid, warmup=True, **kwargs)
    kernel = _original_run[0](self, *args, grid=grid, warmup=warmup, **kwargs)
    records = getattr(_recording, "records", None)
    if records is not None and not warmup:
        driver = jit.driver.active
        device = driver.get_current_device()
        records.append((self, args, kwargs, grid, kernel, device,
                        driver.get_current_stream(device), _allocation._allocator.get()))
    return kernel


class _NotTimed(Exception):
    """What a dry pass's stand-in for the autotuner's timing raises."""


def _on_disk(tuner, key: tuple, kept: list):
    """The candidate an autotuner that keeps its timings on disk (``cache_results``: the
    package's ``triton_helpers.tuned``) chose for ``key`` among ``kept`` in an earlier process,
    now also its choice in memory; ``None`` where it has none (nothing is timed)."""
    if not getattr(tuner, "cache_results", False):
        return None

    def not_timed():
        raise _NotTimed

    try:
        tuner.check_disk_cache(key, kept, not_timed)
    except _NotTimed:
        return None
    return tuner.cache.get(key)


def _tuner_run(self, *args, **kwargs):
    """``Autotuner.run``, which in a thread's dry pass (:func:`compile_ahead`) times nothing and
    keeps nothing: it compiles the candidate it keeps for a key it has timed (in this process or,
    on disk, an earlier one), or else every candidate its prune filter keeps (those its real
    call will time)."""
    if not getattr(_recording, "ahead", False):
        return _original_run[1](self, *args, **kwargs)
    self.nargs = dict(zip(self.arg_names, args))
    try:
        configs = self.configs
        if len(configs) > 1:  # the autotuner's own key, as Triton 3.6 and 3.9 compute it
            named = {k: v for k, v in {**self.nargs, **kwargs}.items() if k in self.arg_names}
            key = tuple([named[k] for k in self.keys if k in named]
                        + [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])
            chosen = self.cache.get(key)
            if chosen is None:
                configs = self.prune_configs(kwargs)
                chosen = _on_disk(self, key, configs)
            configs = [chosen] if chosen is not None else configs
        for config in configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())
    finally:
        self.nargs = None


def _wrap(step: int) -> None:
    """One more capture or dry pass in progress (``step`` 1) or one fewer (-1):
    ``JITFunction.run`` and ``Autotuner.run`` are wrapped from the first to the last."""
    with _lock:
        if step > 0 and _captures[0] == 0:
            _original_run[:] = [jit.JITFunction.run, autotuner.Autotuner.run]
            jit.JITFunction.run = _recorded_run
            autotuner.Autotuner.run = _tuner_run
        _captures[0] += step
        if _captures[0] == 0:
            jit.JITFunction.run, autotuner.Autotuner.run = _original_run


def _dispatch_mode(handle: Callable):
    """A dispatch mode that hands each operation to ``handle(op, run)`` (``run()`` runs it),
    not wrapped against Dynamo (PyTorch's default, whose first use imports Dynamo: ~1 s):
    these modes are entered by eager calls only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return handle(func, lambda: func(*args, **(kwargs or {})))

    return Mode()


def _watched_ops(ops: list[str], allocated: set[int]):
    """A dispatch mode that notes the operations of a call other than allocations and views
    (``ops``) and the storage of each allocation (``allocated``)."""

    def note(func, run):
        name = func.overloadpacket.__name__
        result = run()
        if name in ALLOCATING_OPS:
            allocated.add(result.untyped_storage().data_ptr())
        elif name not in NO_KERNEL_OPS:
            ops.append(name)
        return result

    return _dispatch_mode(note)


def _busy() -> bool:
    """Whether this thread is inside a capture or a dry pass already."""
    return getattr(_recording, "records", None) is not None or getattr(_recording, "ahead", False)


def capture(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> tuple[object, Plan | str]:
    """``(fn(), its plan)``, or ``(fn(), why not)`` when the call cannot be replayed. ``fn``
    returns a tensor, a tuple of tensors (the outputs) or None (no output), and reads no tensor
    but ``inputs`` and buffers it allocates. Inputs that share memory are addressed from the
    first of them: the caller's key must say which share with which, and how far apart."""
    if _busy():  # inside another call's capture (or dry pass)
        return fn(), "the call runs inside another captured call"
    state = launch_state()
    records: list = []
    ops: list[str] = []
    allocated: set[int] = set()
    _wrap(+1)
    _recording.records = records
    try:
        with _watched_ops(ops, allocated):
            result = fn()
    finally:
        _recording.records = None
        _wrap(-1)
    outputs = result if isinstance(result, tuple) else () if result is None else (result,)
    try:
        why = _refusal(state, records, ops, allocated, inputs, outputs)
        return result, why or _plan(state, records, inputs, outputs, allocated)
    except Exception as exc:  # noqa: BLE001 - the call ran; only its plan is given up
        return result, f"recording its launches raised {type(exc).__name__}: {exc}"


def _refusal(state, records, ops, allocated, inputs, outputs) -> str | None:
    """Why the recorded call cannot be replayed, or None."""
    if ops:
        return f"the call runs PyTorch operations {sorted(set(ops))}"
    if not records:
        return "the call launches no Triton kernel"
    if state is None or launch_state() != state:
        return "a launch hook, the device or Triton's knobs changed during the call"
    stream = jit.driver.active.get_current_stream(state[0])
    for jit_fn, _, _, _, kernel, device, launch_stream, _ in records:
        name = jit_fn.fn.__name__
        if (device, launch_stream) != (state[0], stream):
            return f"{name} was launched on another device or stream"
        if getattr(jit_fn, "pre_run_hooks", None):
            return f"{name} has pre-run hooks"
        if getattr(kernel.metadata, "profile_scratch_size", 0):
            return f"{name} needs profiling scratch (instrumentation)"
    owners = {x.untyped_storage().data_ptr() for x in inputs}
    for i, x in enumerate(outputs):
        storage = x.untyped_storage() if isinstance(x, torch.Tensor) else None
        if (storage is None or not x.is_contiguous() or x.storage_offset()
                or x.numel() * x.element_size() != storage.nbytes()
                or storage.data_ptr() not in allocated
                or (x.numel() and storage.data_ptr() in owners)):
            return f"output {i} is not a fresh contiguous tensor that fills its storage"
        owners.add(storage.data_ptr())
    return None


def _memory_like(value) -> bool:
    """Whether ``value`` holds memory a replay could not address: an object with a ``data_ptr``
    other than a tensor, a descriptor with a tensor ``base``, or a tensor inside a nested tuple."""
    if isinstance(value, tuple):
        return any(isinstance(x, torch.Tensor) or _memory_like(x) for x in value)
    return hasattr(value, "data_ptr") or isinstance(getattr(value, "base", None), torch.Tensor)


def _plan(state, records, inputs, outputs, allocated: set[int]) -> Plan | str:
    """The plan of the recorded launches, or why there is none."""
    bases = [x.data_ptr() for x in inputs] + [x.data_ptr() for x in outputs]
    owners = [x.untyped_storage().data_ptr() for x in (*inputs, *outputs)]
    sizes: dict[int, int] = {}  # an intermediate's storage → its bytes (dicts keep order)
    launches = []
    for jit_fn, args, kwargs, grid, kernel, device, _, allocator in records:
        name = jit_fn.fn.__name__
        bound = jit_fn.device_caches[device][4](*args, **kwargs)[0]
        grid = tuple(grid(bound) if callable(grid) else grid)
        values, pointers = [], []
        for i, value in enumerate(bound.values()):
            in_tuple = isinstance(value, tuple)
            parts = list(value) if in_tuple else [value]
            for j, part in enumerate(parts):
                if not isinstance(part, torch.Tensor):
                    if _memory_like(part):
                        return f"{name} takes memory a plan cannot address: {type(part).__name__}"
                    continue
                storage = part.untyped_storage().data_ptr()
                if storage in owners:  # an input's or output's memory: relative to its base
                    b = owners.index(storage)
                    offset = part.data_ptr() - bases[b]
                elif storage in allocated:  # the call's own: a buffer of the workspace
                    sizes[storage] = max(sizes.get(storage, 0), part.untyped_storage().nbytes())
                    b, offset = -1 - list(sizes).index(storage), part.data_ptr() - storage
                else:
                    return (f"{name} reads a tensor that is neither an input nor an output and "
                            "was allocated before the call")
                pointers.append((i, j if in_tuple else -1, b, offset))
                parts[j] = None
            values.append(tuple(parts) if in_tuple else parts[0])
        scratch = getattr(kernel.metadata, "global_scratch_size", 0)
        launches.append(Launch(name, kernel.run, grid + (1,) * (3 - len(grid)), kernel.function,
                               kernel.packed_metadata, tuple(values), tuple(pointers),
                               allocator if scratch else None))
    # the workspace: each intermediate at an ALIGN-aligned offset
    offsets, total = [], 0
    for size in sizes.values():
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    workspace = len(bases)
    launches = [
        Launch(launch.name, launch.launcher, launch.grid, launch.function, launch.metadata,
               launch.args, tuple((i, j, b, off) if b >= 0 else (i, j, workspace,
                                                                  offsets[-1 - b] + off)
                                  for i, j, b, off in launch.pointers), launch.allocator)
        for launch in launches
    ]
    return Plan(tuple(launches), tuple((tuple(x.shape), x.dtype) for x in outputs), total, state)


# ---------------------------------------------------------------------------------------------
# compiling ahead

COMPILE_THREADS = 8  # at most; a call launches 2 to 4 kernels
_pool: list = []  # the thread pool compiles go to, made on first use
_pool_lock = threading.Lock()


class _NotAhead(BaseException):
    """What stops a dry pass at a PyTorch operation (a ``BaseException``, so that no ``except
    Exception`` of the call takes it for a failure of its own: a launcher falling back, a kernel
    refused for the process)."""


def _only_allocations():
    """A dispatch mode that runs allocations, views and the package's own operators (whose
    insides it sees in turn) and stops the pass at any other operation, before it runs: in a
    dry pass no launch wrote what it would read."""

    def check(func, run):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL_OPS and func.namespace != "lowbit_attn":
            raise _NotAhead(name)
        return run()

    return _dispatch_mode(check)


def _executor():
    from concurrent.futures import ThreadPoolExecutor

    with _pool_lock:
        if not _pool:
            _pool.append(ThreadPoolExecutor(COMPILE_THREADS,
                                            thread_name_prefix="lowbit_attn-compile"))
        return _pool[0]


def compile_ahead(fn: Callable) -> str | None:
    """Compile the Triton kernels ``fn()`` launches side by side, launching nothing: ``fn`` runs
    once as a dry pass in which each Triton launch of this thread submits its kernel's compile
    to a pool of threads (Triton's ``AsyncCompileMode``; a kernel already compiled is taken as
    it is) and PyTorch runs allocations and views only; the compiles are awaited before it
    returns (one that fails is left for the real call to report). The pass stops at the first
    other PyTorch operation, before it runs, and at any exception; what it submitted until then
    is compiled all the same. An autotuner times nothing in the pass: it compiles every
    candidate its real call will time, side by side (:func:`_tuner_run`). ``fn`` must change
    nothing but through PyTorch and Triton (no host-side state of its own). Returns None, or why
    the pass stopped early."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without it (3.4 has none; 3.6 and 3.9 have it)
        return "this Triton has no asynchronous compiles"
    if _busy():
        return "the call runs inside another captured call"
    why = None
    _wrap(+1)
    _recording.ahead = True
    try:
        with AsyncCompileMode(_executor(), ignore_errors=True):
            try:
                with _only_allocations():
                    fn()
            except _NotAhead as stop:
                why = f"the call runs the PyTorch operation {stop}"
            except Exception as exc:  # noqa: BLE001 - the real call raises it, if it is real
                why = f"the dry pass raised {type(exc).__name__}: {exc}"
    except RuntimeError as exc:  # another AsyncCompileMode active in this thread
        why = str(exc)
    finally:
        _recording.ahead = False
        _wrap(-1)
    return why


# ---------------------------------------------------------------------------------------------
# replaying


def replay(plan: Plan, inputs: tuple[torch.Tensor, ...], *, poison: bool = False):
    """The outputs of ``plan`` run on ``inputs`` (the same configuration as when captured, in
    its :func:`launch_state`), its launches enqueued on the current stream: a tensor, or a tuple
    when the captured call returned one, or None when it returned None. ``poison``: the outputs
    and the workspace are filled with :data:`POISON` first (the first-use check)."""
    device = inputs[0].device
    stream = jit.driver.active.get_current_stream(plan.state[0])
    outputs = tuple(torch.empty(shape, dtype=dtype, device=device)
                    for shape, dtype in plan.outputs)
    bases = [x.data_ptr() for x in inputs] + [x.data_ptr() for x in outputs]
    workspace = None
    if plan.workspace_bytes:
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device)
        bases.append(workspace.data_ptr())
    if poison:
        for x in (*outputs, *([workspace] if workspace is not None else [])):
            x.untyped_storage().fill_(POISON)
    for launch in plan.launches:
        args = list(launch.args)
        for i, j, b, off in launch.pointers:
            if j < 0:
                args[i] = bases[b] + off
            else:  # inside a tuple argument
                args[i] = (*args[i][:j], bases[b] + off, *args[i][j + 1:])
        gx, gy, gz = launch.grid
        # a kernel that needs global scratch takes it from the allocator its launch saw
        token = None if launch.allocator is None else _allocation._allocator.set(launch.allocator)
        try:
            launch.launcher(gx, gy, gz, stream, launch.function, launch.metadata, None, None,
                            None, *args)
        finally:
            if token is not None:
                _allocation._allocator.reset(token)
    del workspace  # freed after the launches are enqueued (stream-ordered, as any tensor)
    return outputs if len(outputs) > 1 else outputs[0] if outputs else None

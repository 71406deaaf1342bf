"""``lowbit-attn bench --host``: the host time of one public :func:`lowbit_attn.attention` call (the
time to enqueue its GPU work) and the kernels it launches.

On a GPU the real call is timed, the clock stopped before the synchronization. Without one the
call runs Triton's own launch path (the argument binder, specialization, the kernel cache lookup)
under a stand-in driver: each kernel is "compiled" to a stub once, and its launches do nothing. This
runs in a child process that sees the GPU architecture ``--host-arch`` (``LOWBIT_ATTN_ARCH``: the
kernels' launch configurations and the recipe ``auto`` are the GPU's), with glibc's allocator told
to keep freed blocks (as CUDA's caching allocator does), so that ``torch.empty`` costs what it
costs on a GPU rather than an ``mmap``. What it cannot include: the driver's own launch call
(cuLaunchKernelEx, ~2 µs each, on top).

``launches`` counts the Triton kernels of one call plus the ATen operations that would run a
kernel on a GPU (all but allocations and views).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Callable

import torch

from lowbit_attn.core.plan_launches import NO_KERNEL_OPS

HOST_CALLS = 100  # calls per timed round
HOST_ROUNDS = 7  # rounds; the median is reported


# ---------------------------------------------------------------------------------------------
# the stand-in driver (no GPU)

_STUB_DEVICE = -1  # the device key of the stand-in's kernel caches; no real device has it
_STUB_STREAM = 7  # the stand-in's stream handle (any int a launcher takes)


class _StubKernel:
    """What Triton's launch path gets in place of a kernel compiled for one device: a handle of
    its own (``function``) and packed metadata naming it. ``run`` does what Triton's launcher
    does around the launch itself (it asks Triton's allocator for the global scratch the kernel
    needs, ``metadata.global_scratch_size`` bytes a program, and calls the launch hooks it is
    given) and notes the launch: ``(the stub, the launcher's arguments)``."""

    def __init__(self, name: str, sink: list, device: int, scratch: int) -> None:
        self.thread = threading.current_thread().name  # where it was "compiled"
        self._name = name
        self._sink = sink
        self.function = id(self)  # a handle no other stub has
        self.packed_metadata = (name, device)
        self.metadata = SimpleNamespace(global_scratch_size=scratch, global_scratch_align=128,
                                        profile_scratch_size=0, profile_scratch_align=1)
        self.scratch_calls = 0  # how many launches took scratch from Triton's allocator

    def launch_metadata(self, grid, stream, *args):
        return None

    @property
    def name(self) -> str:
        return self._name

    def run(self, *args):
        from triton.runtime import _allocation

        gx, gy, gz, stream, _, _, metadata, enter, leave = args[:9]
        if self.metadata.global_scratch_size:
            size = gx * gy * gz * self.metadata.global_scratch_size
            _allocation._allocator.get()(size, self.metadata.global_scratch_align, stream)
            self.scratch_calls += 1
        if enter is not None:
            enter(metadata)
        self._sink.append((self, args))
        if leave is not None:
            leave(metadata)


class _StubDriver:
    """Triton's driver interface, as far as ``JITFunction.run`` uses it, for a GPU of ``target``;
    ``device`` and ``stream`` are the current device and its current stream (a test may set
    them: each device gets kernels of its own)."""

    def __init__(self, target) -> None:
        self._target = target
        self.device = _STUB_DEVICE
        self.stream = _STUB_STREAM

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return self.stream

    def get_current_target(self):
        return self._target

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def stubbed_launches(capability: tuple[int, int], scratch: dict[str, int] | None = None, *,
                     compile: bool = False):
    """Within the block, every Triton kernel launch goes through Triton's launch path to a stub
    that does nothing but note ``(the stub, the launcher's arguments)`` in the yielded list (the
    stub's ``name`` is the kernel's; ``scratch``: the kernels, by name, that need global scratch,
    and how many bytes a program; ``thread``: the thread that built it, a pool's under Triton's
    asynchronous compiles, as Triton's own compiles); autotuners time no candidate (they take
    the first) and keep nothing on disk, and the inference op and the KV cache take their
    Triton paths on CPU tensors.
    ``compile``: each stub is built after a real compile of its kernel for ``capability``
    (Triton's cache applies; the compiled kernel is not kept), so that the block takes a
    compile's time. The stand-in driver is ``triton.runtime.driver.active`` meanwhile.
    Everything is restored on exit."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import autotuner, jit

    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:  # a Triton without asynchronous compiles (3.4)
        active_mode = None

    from lowbit_attn.inference import op
    from lowbit_attn.kvcache import cache, interface
    from lowbit_attn.tools import triton_compat

    chosen = (op, interface, cache)  # the modules that choose a backend per call
    sink: list[tuple] = []
    compiled: list = []

    def stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        name = self.fn.__name__
        compiled.append((self, device))

        def build():
            if compile:
                target = self.device_caches[device][2]
                self.compile(self.ASTSource(self, signature, constexprs, attrs), target=target,
                             options=options.__dict__)
            return _StubKernel(name, sink, device, (scratch or {}).get(name, 0))

        def keep(kernel):
            self.device_caches[device][0][key] = kernel

        mode = None if active_mode is None else active_mode.get()
        if mode is not None:  # as Triton's own: built in the mode's threads, kept on its exit
            return triton_compat.submit_compile(mode, (name, key, device), build, keep)
        kernel = build()
        keep(kernel)
        return kernel

    saved = (jit.JITFunction._do_compile, autotuner.Autotuner._bench,
             autotuner.Autotuner.check_disk_cache)
    saved_backends = [m.backend_for for m in chosen]
    previous_driver = jit.driver._active  # None until a driver was asked for
    jit.driver.set_active(_StubDriver(GPUTarget("cuda", capability[0] * 10 + capability[1], 32)))
    jit.JITFunction._do_compile = stub_compile
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]
    # these timings are not kept on disk (a GPU's later processes would take them)
    autotuner.Autotuner.check_disk_cache = lambda self, key, configs, bench: bench() or False
    for module in chosen:
        module.backend_for = lambda device: "triton"
    try:
        yield sink
    finally:
        (jit.JITFunction._do_compile, autotuner.Autotuner._bench,
         autotuner.Autotuner.check_disk_cache) = saved
        for module, backend_for in zip(chosen, saved_backends):
            module.backend_for = backend_for
        jit.driver.set_active(previous_driver)
        for fn, device in compiled:
            fn.device_caches.pop(device, None)


def count_kernel_ops(fn: Callable) -> dict[str, int]:
    """``{aten op: count}`` of the operations of one ``fn()`` that would launch a GPU kernel: those
    that neither only allocate or view nor run another such operation (a profile of the call, so
    that it takes its usual path)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    found: dict[str, int] = {}

    def launches(event) -> bool:
        inner = [launches(c) for c in event.cpu_children]  # every subtree visited once
        name = event.name.removeprefix("aten::")
        if any(inner) or not event.name.startswith("aten::") or name in NO_KERNEL_OPS:
            return any(inner)
        found[name] = found.get(name, 0) + 1
        return True

    for event in prof.events():
        if event.cpu_parent is None:
            launches(event)
    return found


def gpu_kernels(fn: Callable) -> list[str]:
    """The names of the GPU kernels one ``fn()`` runs (a CUDA profile)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def time_host(fn: Callable, sync: Callable = lambda: None) -> float:
    """Median over rounds of the host µs per call of ``HOST_CALLS`` back-to-back calls (the clock
    stopped before ``sync``), after one untimed round: the steady state, past a launch plan's
    capture and first-use check (whose copies leave the stand-in's host heap unsettled for a
    few hundred calls: a few calls of 1–4 ms)."""
    for _ in range(HOST_CALLS):
        fn()
    sync()
    rounds = []
    for _ in range(HOST_ROUNDS):
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        rounds.append((time.perf_counter() - t0) / HOST_CALLS * 1e6)
        sync()
    return statistics.median(rounds)


def profile_lines(fn: Callable, top: int = 15) -> list[str]:
    """The ``top`` functions by own time over ``HOST_CALLS`` calls of ``fn``, µs per call."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(HOST_CALLS):
        fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    lines = []
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        where = f"{os.path.basename(path)}:{line}" if line else path
        lines.append(f"  {own / HOST_CALLS * 1e6:7.2f} µs own {cum / HOST_CALLS * 1e6:8.2f} cum "
                     f"{ncalls / HOST_CALLS:5.1f}×  {name} ({where})")
    return lines


# ---------------------------------------------------------------------------------------------
# one configuration


def _call(recipe: str, b: int, h: int, n: int, d: int, causal: bool, device: str) -> Callable:
    import lowbit_attn

    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float16, device=device) for _ in range(3))
    return lambda: lowbit_attn.attention(q, k, v, is_causal=causal, recipe=recipe)


def measure_config(recipe: str, b: int, h: int, n: int, d: int, causal: bool, *,
                   profile: bool = False) -> dict:
    """One configuration's row: ``host_us``, ``launches`` (with the kernels and ops by name) and,
    with ``profile``, the profile's lines. On a CPU it must run in a process that imported
    nothing of :mod:`lowbit_attn` before the architecture was set (see :func:`run_child`)."""
    cuda = torch.cuda.is_available()
    row = dict(recipe=recipe, B=b, H=h, N=n, D=d, causal=causal,
               mode="gpu" if cuda else "stubbed launches")
    if cuda:
        fn = _call(recipe, b, h, n, d, causal, "cuda")
        host_us = time_host(fn, torch.cuda.synchronize)
        kernels = gpu_kernels(fn)
        ops: dict[str, int] = {}
        lines = profile_lines(fn) if profile else []
    else:
        from lowbit_attn.core.arch import get_capability

        with stubbed_launches(get_capability() or (9, 0)) as kernels:
            fn = _call(recipe, b, h, n, d, causal, "cpu")
            host_us = time_host(fn)
            kernels.clear()
            ops = count_kernel_ops(fn)
            kernels = [stub.name for stub, _ in kernels]
            lines = profile_lines(fn) if profile else []
    row.update(host_us=round(host_us, 2), launches=len(kernels) + sum(ops.values()),
               kernels=list(kernels), ops=ops, profile=lines)
    return row


# ---------------------------------------------------------------------------------------------
# a decode step against the 8-bit KV cache


def _stubbed_or_gpu(fn: Callable, sink: list | None, profile: bool) -> dict:
    """``host_us``, ``launches``, ``kernels``, ``ops`` and ``profile`` of ``fn`` (already run once),
    on a GPU (``sink`` None) or under the stand-in driver whose launches go to ``sink``."""
    if sink is None:
        host_us = time_host(fn, torch.cuda.synchronize)
        kernels, ops = gpu_kernels(fn), {}
    else:
        host_us = time_host(fn)
        sink.clear()
        ops = count_kernel_ops(fn)
        kernels = [stub.name for stub, _ in sink]
    return dict(host_us=round(host_us, 2), launches=len(kernels) + sum(ops.values()),
                kernels=kernels, ops=ops, profile=profile_lines(fn) if profile else [])


def measure_decode_config(n: int, batch: int, kv_heads: int, group: int, d: int, page: int, *,
                          profile: bool = False) -> dict:
    """The host path of a decode step on a cache of ``n`` tokens per sequence: an eager
    :func:`lowbit_attn.attention_with_kv_cache` of one query token (``decode``), and an eager
    one-token :meth:`~lowbit_attn.QuantizedKVCache.append` (``append``; the timed appends grow the
    cache by ~800 tokens, taking a page every ``page`` of them). The cache's contents are not
    read on the host: without a GPU they are never written (the launches are stubs)."""
    import lowbit_attn

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    row = dict(N=n, batch=batch, kv_heads=kv_heads, group=group, D=d, page=page,
               mode="gpu" if cuda else "stubbed launches")
    calls = HOST_CALLS * (HOST_ROUNDS + 3)  # the appends of the timing, warm-ups and profile
    sink = None  # the stand-in driver's launches, without a GPU
    with contextlib.ExitStack() as stack:
        if not cuda:
            from lowbit_attn.core.arch import get_capability

            sink = stack.enter_context(stubbed_launches(get_capability() or (9, 0)))
        cache = lowbit_attn.QuantizedKVCache(1, batch, kv_heads, d, max_tokens=n + calls,
                                             page_size=page, device=device)
        prompt = torch.zeros(batch, kv_heads, n, d, dtype=torch.float16, device=device)
        cache.append(0, prompt, prompt)
        del prompt
        q = torch.randn(batch, kv_heads * group, 1, d, dtype=torch.float16, device=device)
        k, v = (torch.randn(batch, kv_heads, 1, d, dtype=torch.float16, device=device)
                for _ in range(2))

        def decode():
            return lowbit_attn.attention_with_kv_cache(q, cache, 0)

        def append():
            cache.append(0, k, v)

        decode()
        row["decode"] = _stubbed_or_gpu(decode, sink, profile)
        append()
        row["append"] = _stubbed_or_gpu(append, sink, profile)
    return row


def measure_decode(configs: list[dict], *, arch: str = "sm_90",
                   profile: bool = False) -> list[dict]:
    """The rows of ``configs`` (dicts of :func:`measure_decode_config`'s arguments), as
    :func:`measure`."""
    if torch.cuda.is_available():
        return [measure_decode_config(**c, profile=profile) for c in configs]
    return run_child(configs, arch, profile, job="decode")


def render_decode(rows: list[dict]) -> str:
    """``decode_host_us=… append_host_us=…`` per row, the launches, and the profiles."""
    lines = []
    for r in rows:
        de, ap = r["decode"], r["append"]
        lines.append(f"N={r['N']} batch={r['batch']} kv_heads={r['kv_heads']} GQA {r['group']}:1 "
                     f"D={r['D']} page={r['page']} ({r['mode']}): decode_host_us={de['host_us']:.1f} "
                     f"append_host_us={ap['host_us']:.1f} decode_launches={de['launches']} "
                     f"append_launches={ap['launches']}")
        for what, m in (("decode", de), ("append", ap)):
            ops = ", ".join(f"{k}×{v}" for k, v in sorted(m["ops"].items()))
            lines.append(f"  {what}: kernels {', '.join(m['kernels']) or '—'}; torch ops "
                         f"{ops or '—'}")
            lines.extend(m["profile"])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the child process


def run_child(configs: list[dict], arch: str, profile: bool, job: str = "attention") -> list[dict]:
    """:func:`measure_config` (``job="attention"``) or :func:`measure_decode_config`
    (``"decode"``) of each configuration in a fresh Python process that sees ``arch`` and no
    Triton interpreter (the CPU's way; see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOWBIT_ATTN_ARCH=arch, MALLOC_MMAP_THRESHOLD_=str(2**30),
               MALLOC_TRIM_THRESHOLD_=str(2**31), MALLOC_TOP_PAD_=str(2**28))
    payload = json.dumps({"job": job, "configs": configs, "profile": profile})
    done = subprocess.run([sys.executable, "-m", "lowbit_attn.tools.bench.host", payload],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the host-path child process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(configs: list[dict], *, arch: str = "sm_90", profile: bool = False) -> list[dict]:
    """The rows of ``configs`` (dicts of :func:`measure_config`'s arguments): in this process on a
    GPU, in a child process without one."""
    if torch.cuda.is_available():
        return [measure_config(**c, profile=profile) for c in configs]
    return run_child(configs, arch, profile)


def render(rows: list[dict], *, max_us: float | None = None, max_launches: int | None = None) -> str:
    """One line per row (``host_us=… launches=…``), the kernels and ops launched, and the
    profile lines when there are any."""
    lines = []
    for r in rows:
        lines.append(
            f"{r['recipe']} B={r['B']} H={r['H']} N={r['N']} D={r['D']} causal={r['causal']} "
            f"({r['mode']}): host_us={r['host_us']:.1f} launches={r['launches']}"
        )
        ops = ", ".join(f"{k}×{v}" for k, v in sorted(r["ops"].items()))
        lines.append(f"  kernels: {', '.join(r['kernels']) or '—'}; torch ops: {ops or '—'}")
        lines.extend(r["profile"])
    return "\n".join(lines)


def _child_main(payload: str) -> None:
    job = json.loads(payload)
    measure_one = measure_decode_config if job["job"] == "decode" else measure_config
    rows = [measure_one(**c, profile=job["profile"]) for c in job["configs"]]
    print(json.dumps(rows))


if __name__ == "__main__":
    _child_main(sys.argv[1])

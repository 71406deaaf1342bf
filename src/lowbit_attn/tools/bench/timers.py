"""Timers ``fn → ms`` (Triton's ``do_bench`` on a GPU, wall clock on a CPU) and memory helpers."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch


def cuda_timer(warmup_ms: float, rep_ms: float) -> Callable:
    """``fn → ms``: Triton's ``do_bench`` median."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def cpu_timer(reps: int = 5, warmup: int = 1) -> Callable:
    """``fn → ms``: median of ``reps`` wall-clock calls after ``warmup`` calls."""
    def timer(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return timer


def loop_timings(fn: Callable, cuda: bool, calls: int = 100) -> tuple[float, float]:
    """``(host µs, loop ms)`` per call of ``calls`` back-to-back calls, after one warm-up: the host
    time to enqueue one (the clock stopped before the synchronization), and the wall time per call
    of the whole loop, synchronized at its end: what a decode loop without CUDA graphs takes per
    step, the larger of the host's time and the GPU's. On a CPU both are the wall time."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e3


def timer_for(cuda: bool, *, warmup_ms: float = 25, rep_ms: float = 100) -> Callable:
    """A timer ``fn → ms`` for the benchmark scripts: Triton's ``do_bench`` median on a GPU, one
    wall-clock run on a CPU (whose numbers only show that the script works)."""
    return cuda_timer(warmup_ms, rep_ms) if cuda else cpu_timer(reps=1, warmup=0)


def peak_extra_mib(step: Callable, cuda: bool) -> float | None:
    """Peak memory that one more ``step()`` allocates beyond what is live before it (MiB), after
    one warm-up run; ``None`` without CUDA."""
    step()
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def free_memory(cuda: bool) -> None:
    """Collect garbage and, on CUDA, return cached blocks to the driver."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

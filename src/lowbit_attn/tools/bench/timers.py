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

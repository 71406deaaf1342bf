"""``lowbit_attn.tools.gluon_cpu``'s model of ``gl.warp_specialize`` on a toy Gluon kernel written
here: a loader partition (1 warp) TMA-loads tiles ``X_t`` ``[K, N]`` into a two-stage ring
(``ready`` / ``empty`` barriers, ``empty`` released by both consumers), and two consumer
partitions (the default one and a worker, 4 warps each) accumulate ``A_c @ X_t`` over the tiles
for their own 64 rows of ``A``, passing a turn back and forth through two barriers (ping-pong).

The kernel must give the torch result bit for bit under every schedule the model tries, and
known breaks of the protocol must be caught: a loader that does not wait for the ring slot, a
consumer waiting the wrong parity, the ``empty`` barrier counting one arrival, a consumer that
never hands the turn back."""

from __future__ import annotations

import inspect
import textwrap
import __future__

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from lowbit_attn.tools import gluon_cpu

BM = gl.constexpr(64)  # rows of A per consumer
K = gl.constexpr(32)  # A's columns, X's tile rows
N = gl.constexpr(32)  # X's columns
TILE_BYTES = gl.constexpr(K.value * N.value * 2)  # one fp16 tile of X


@gluon.jit
def _load_tiles(x_desc, x_smem, ready, empty, n_tiles):
    for t in range(n_tiles):
        stage = t % 2
        # the slot is free once both consumers released tile t - 2 (the first pass waits
        # parity 1 of a fresh barrier: it returns at once)
        mbarrier.wait(empty.index(stage), ((t // 2) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), TILE_BYTES)
        tma.async_copy_global_to_shared(x_desc, [t * K, 0], ready.index(stage),
                                        x_smem.index(stage))


@gluon.jit
def _consume(a_smem, x_smem, ready, empty, my_turn, other_turn, n_tiles,
             GOES_FIRST: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, N, 16])
    acc = gl.zeros([BM, N], gl.float32, acc_layout)
    for t in range(n_tiles):
        stage = t % 2
        mbarrier.wait(ready.index(stage), (t // 2) & 1)
        # ping-pong: the consumer that goes first passes its first wait (parity 1) at once
        mbarrier.wait(my_turn, (t & 1) ^ GOES_FIRST)
        tok = warpgroup_mma(a_smem, x_smem.index(stage), acc, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        acc = warpgroup_mma_wait(0, deps=[tok])
        mbarrier.arrive(empty.index(stage), count=1)
    return acc


@gluon.jit
def _store_rows(out_ptr, acc, row0):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, N, 16])
    rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, N, gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


@gluon.jit
def _consumer_a(a_smem, x_smem, ready, empty, turns, n_tiles):
    return _consume(a_smem, x_smem, ready, empty, turns.index(0), turns.index(1), n_tiles, 1)


@gluon.jit
def _consumer_b(a_smem, x_smem, ready, empty, turns, out_ptr, n_tiles):
    acc = _consume(a_smem, x_smem, ready, empty, turns.index(1), turns.index(0), n_tiles, 0)
    _store_rows(out_ptr, acc, BM)


@gluon.jit
def toy_kernel(A, X, OUT, n_tiles):
    """``OUT[c*64:(c+1)*64] = sum_t A[c*64:(c+1)*64] @ X[t*K:(t+1)*K]`` (fp16 in, fp32 out)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, K], gl.float16)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, N], gl.float16)
    a_desc = tma.make_tensor_descriptor(A, [2 * BM, K], [K, 1], [BM, K], a_layout)
    x_desc = tma.make_tensor_descriptor(X, [n_tiles * K, N], [N, 1], [K, N], x_layout)
    a_smem = gl.allocate_shared_memory(gl.float16, [2, BM, K], a_layout)
    x_smem = gl.allocate_shared_memory(gl.float16, [2, K, N], x_layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(a_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(turns.index(i), count=1)
    mbarrier.expect(a_bar, 2 * BM * K * 2)
    tma.async_copy_global_to_shared(a_desc, [0, 0], a_bar, a_smem.index(0))
    tma.async_copy_global_to_shared(a_desc, [BM, 0], a_bar, a_smem.index(1))
    mbarrier.wait(a_bar, 0)
    acc = gl.warp_specialize([
        (_consumer_a, (a_smem.index(0), x_smem, ready, empty, turns, n_tiles)),
        (_consumer_b, (a_smem.index(1), x_smem, ready, empty, turns, OUT, n_tiles)),
        (_load_tiles, (x_desc, x_smem, ready, empty, n_tiles)),
    ], [4, 1], [232, 40])
    _store_rows(OUT, acc, 0)
    mbarrier.invalidate(a_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(turns.index(i))


def operands(n_tiles):
    g = torch.Generator().manual_seed(n_tiles)
    a = torch.randn(2 * BM.value, K.value, generator=g).half()
    x = torch.randn(n_tiles * K.value, N.value, generator=g).half()
    return a, x


def reference(a, x, n_tiles):
    """The kernel's sum, as the model's wgmma computes each step: float64, rounded once to fp32."""
    acc = torch.zeros(a.shape[0], N.value, dtype=torch.float32)
    for t in range(n_tiles):
        tile = x[t * K.value:(t + 1) * K.value]
        acc = (a.double() @ tile.double() + acc.double()).float()
    return acc


def run(n_tiles, schedule, overrides=None):
    """``(OUT, trace)`` of the toy kernel on the model."""
    a, x = operands(n_tiles)
    out = torch.full((2 * BM.value, N.value), float("nan"))
    cpu = gluon_cpu.CpuKernel(toy_kernel, schedule=schedule, overrides=overrides)
    cpu[(1,)](A=a, X=x, OUT=out, n_tiles=n_tiles, num_warps=4)
    return out, cpu.trace


@pytest.mark.parametrize("n_tiles", [1, 2, 5], ids=lambda n: f"tiles{n}")
@pytest.mark.parametrize("schedule", gluon_cpu.SCHEDULES)
def test_the_toy_kernel_equals_torch_under_every_schedule(n_tiles, schedule):
    out, trace = run(n_tiles, schedule)
    a, x = operands(n_tiles)
    assert torch.equal(out, reference(a, x, n_tiles))
    assert trace.events["partition switches"] > 0, trace.events
    assert trace.calls[("_load_tiles", ())] == 1 and trace.calls[("_consume", (("GOES_FIRST", 1),))] == 1


def test_the_schedules_interleave_differently():
    switches = {s: run(5, s)[1].events["partition switches"] for s in gluon_cpu.SCHEDULES}
    assert switches["eager"] > switches["lazy"], switches


def test_every_gluon_name_the_toy_uses_is_modelled():
    used, modeled = gluon_cpu.referenced_names(toy_kernel), gluon_cpu.modeled_names()
    missing = {ns: sorted(names - modeled[ns]) for ns, names in used.items() if names - modeled[ns]}
    assert not missing, missing
    assert {"warp_specialize", "num_warps"} <= used["gl"]
    assert {"arrive", "wait", "expect"} <= used["mbarrier"]


def mutant(jit, old: str, new: str):
    """A plain-Python copy of ``jit``'s function with ``old`` (present exactly once) replaced."""
    py = jit.fn
    src = textwrap.dedent(inspect.getsource(py))
    assert src.count(old) == 1, f"{py.__name__} no longer holds {old!r} once"
    lines = src.replace(old, new).splitlines()
    while lines[0].startswith("@"):
        lines.pop(0)
    ns = dict(py.__globals__)
    exec(compile("\n".join(lines), f"<{py.__name__}, mutated>", "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns[py.__name__]


def outcome(schedule, jit, old, new, n_tiles=5) -> tuple[str, str]:
    """``(kind, message)``: "hang", "race", "error" (another ScheduleError), "wrong" or
    "passes"."""
    a, x = operands(n_tiles)
    try:
        out, _ = run(n_tiles, schedule, {jit.fn: mutant(jit, old, new)})
    except gluon_cpu.Hang as e:
        return "hang", str(e)
    except gluon_cpu.Race as e:
        return "race", str(e)
    except gluon_cpu.ScheduleError as e:
        return "error", str(e)
    return ("passes" if torch.equal(out, reference(a, x, n_tiles)) else "wrong"), ""


def test_the_unmutated_toy_passes_through_the_mutation_path():
    for schedule in gluon_cpu.SCHEDULES:
        assert outcome(schedule, toy_kernel, "count=2)", "count=2)")[0] == "passes"

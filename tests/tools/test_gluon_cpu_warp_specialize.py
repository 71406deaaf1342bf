"""``lowbit_attn.tools.gluon_cpu``'s model of ``gl.warp_specialize`` on a toy Gluon kernel written
here: a loader partition (1 warp) TMA-loads tiles ``X_t`` ``[K, N]`` into a two-stage ring
(``ready`` / ``empty`` barriers, ``empty`` released by both consumers), and two consumer
partitions (the default one and a worker, 4 warps each) accumulate ``A_c @ X_t`` over the tiles
for their own 64 rows of ``A``, passing a turn back and forth through two barriers (ping-pong).

The kernel must give the torch result bit for bit under every schedule the model tries, and
known breaks of the protocol must be caught: a loader that does not wait for the ring slot, a
consumer waiting the wrong parity, the ``empty`` barrier counting one arrival, a consumer that
never hands the turn back, a consumer that frees the slot before its wgmma retires. A second toy
has a worker stage a tile through registers into shared memory for the default partition's wgmma
(fence and barrier across partitions)."""

from __future__ import annotations


import pytest
import torch
from helpers import require_gluon
require_gluon("cpu_model")  # before importing Gluon code

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from helpers import mutant
from lowbit_attn.inference.gluon_blocks import tma_load  # the installed Triton's TMA load
from lowbit_attn.tools import gluon_cpu
from lowbit_attn.tools.triton_compat import compiler_mode

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
        tma_load(x_desc, [t * K, 0], ready.index(stage), x_smem.index(stage))


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
    acc = _consume(a_smem, x_smem, ready, empty, turns.index(0), turns.index(1), n_tiles, 1)
    return (acc,)  # Triton 3.6: the default partition returns a tuple


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
    tma_load(a_desc, [0, 0], a_bar, a_smem.index(0))
    tma_load(a_desc, [BM, 0], a_bar, a_smem.index(1))
    mbarrier.wait(a_bar, 0)
    results = gl.warp_specialize([
        (_consumer_a, (a_smem.index(0), x_smem, ready, empty, turns, n_tiles)),
        (_consumer_b, (a_smem.index(1), x_smem, ready, empty, turns, OUT, n_tiles)),
        (_load_tiles, (x_desc, x_smem, ready, empty, n_tiles)),
    ], [4, 1], [232, 40])
    _store_rows(OUT, results[0], 0)
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
    assert trace.calls[("_load_tiles", ())] == 1
    assert trace.calls[("_consume", (("GOES_FIRST", 0),))] == 1


def test_the_schedules_interleave_differently():
    switches = {s: run(5, s)[1].events["partition switches"] for s in gluon_cpu.SCHEDULES}
    assert switches["eager"] > switches["lazy"], switches


def test_every_gluon_name_the_toy_uses_is_modelled():
    used, modeled = gluon_cpu.referenced_names(toy_kernel), gluon_cpu.modeled_names()
    missing = {ns: sorted(names - modeled[ns]) for ns, names in used.items() if names - modeled[ns]}
    assert not missing, missing
    assert {"warp_specialize", "num_warps"} <= used["gl"]
    assert {"arrive", "wait", "expect"} <= used["mbarrier"]


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


# (id, function, old, new, what each schedule must report): "hang", "race", "error" (another
# ScheduleError), "wrong" numbers
MUTATIONS = [
    ("loader-skips-the-empty-wait", _load_tiles,
     "        mbarrier.wait(empty.index(stage), ((t // 2) & 1) ^ 1)\n", "",
     # lazy: the loader runs ahead and arms ready[0] twice in one phase
     {"lazy": "error", "eager": "race", "reverse": "error"}),
    ("consumer-waits-ready-on-the-wrong-parity", _consume,
     "mbarrier.wait(ready.index(stage), (t // 2) & 1)",
     "mbarrier.wait(ready.index(stage), ((t // 2) & 1) ^ 1)",
     # lazy: the consumers read the poisoned ring first and the loader's parity-1 wait on a
     # barrier that has already completed phase 0 never returns
     {"lazy": "hang", "eager": "race", "reverse": "race"}),
    ("empty-counts-one-arrival", toy_kernel, "mbarrier.init(empty.index(i), count=2)",
     "mbarrier.init(empty.index(i), count=1)",
     # each consumer's arrival completes a phase: the loader refills a slot too early, or (lazy)
     # counts phases two at a time and misses the parity it waits for
     {"lazy": "hang", "eager": "race", "reverse": "race"}),
    ("consumer-frees-the-slot-before-its-wgmma-retires", _consume,
     "        acc = warpgroup_mma_wait(0, deps=[tok])\n"
     "        mbarrier.arrive(empty.index(stage), count=1)",
     "        mbarrier.arrive(empty.index(stage), count=1)\n"
     "        acc = warpgroup_mma_wait(0, deps=[tok])",
     # the happens-before check: caught whatever the interleaving
     {"lazy": "race", "eager": "race", "reverse": "race"}),
]


@pytest.mark.parametrize("schedule", gluon_cpu.SCHEDULES)
@pytest.mark.parametrize("jit,old,new,expected", [m[1:] for m in MUTATIONS],
                         ids=[m[0] for m in MUTATIONS])
def test_the_model_catches(jit, old, new, expected, schedule):
    got, message = outcome(schedule, jit, old, new)
    assert got == expected[schedule], (got, message)


@pytest.mark.parametrize("schedule", gluon_cpu.SCHEDULES)
def test_a_consumer_that_never_hands_the_turn_over_hangs_naming_every_partition(schedule):
    got, message = outcome(schedule, _consume, "mbarrier.arrive(other_turn, count=1)",
                           "mbarrier.arrive(other_turn, count=1, pred=GOES_FIRST == 0)")
    assert got == "hang", (got, message)
    assert "every partition is blocked" in message, message
    for name in ("default (_consumer_a)", "worker 0 (_consumer_b)", "worker 1 (_load_tiles)"):
        assert name in message, message
    assert "blocked in wait(" in message, message


def test_an_error_in_a_worker_names_it_and_stops_the_program():
    broken = {_consumer_b.fn: mutant(_consumer_b, "_store_rows(out_ptr, acc, BM)",
                                     "_store_rows(out_ptr, acc, BM)\n    assert False, 'boom'")}
    with pytest.raises(AssertionError, match="boom") as info:
        run(2, "lazy", broken)
    assert any("worker 0 (_consumer_b)" in note for note in info.value.__notes__)


def test_a_default_partition_returning_a_bare_tensor_is_refused():
    broken = {_consumer_a.fn: mutant(_consumer_a, "return (acc,)", "return acc")}
    with pytest.raises(gluon_cpu.ScheduleError, match="tuple"):
        run(1, "lazy", broken)


def second_region(barrier: str) -> dict:
    """The toy kernel, its default partition's result dropped, then a second region: a worker
    stages ``X[:K]`` into ring slot 0 for the default partition's ``A[:64] @ X[:K]`` (rows 0-63
    of ``OUT``), signalling ``barrier``."""
    fresh = "" if barrier == "a_bar" else f"""\
    {barrier} = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init({barrier}, count=1)
"""
    return {toy_kernel.fn: mutant(toy_kernel, "    _store_rows(OUT, results[0], 0)\n", fresh + f"""\
    results = gl.warp_specialize([
        (_multiply_staged, (a_smem.index(0), x_smem.index(0), {barrier})),
        (_stage_tile, (X, x_smem.index(0), {barrier})),
    ], [4], [232])
    _store_rows(OUT, results[0], 0)
""")}


def test_two_warp_specialize_regions_in_one_program():
    """The default partition is the program's own: after a first region it runs a second."""
    twice = second_region("staged")
    a, x = operands(2)
    for schedule in gluon_cpu.SCHEDULES:
        out, _ = run(2, schedule, twice)  # rows 0-63: the second region's A[:64] @ X[:K]
        assert torch.equal(out[:BM.value], reference(a[:BM.value], x, 1)), schedule
        assert torch.equal(out[BM.value:], reference(a, x, 2)[BM.value:]), schedule


@pytest.mark.parametrize("schedule,expected", [("lazy", "race"), ("eager", "hang"),
                                               ("reverse", "hang")])
def test_a_reused_barrier_whose_phase_0_completed_is_caught(schedule, expected):
    """``a_bar`` completed phase 0 before the region: the default partition's ``wait(a_bar, 0)``
    returns at once (a race with the worker's store) or, if the worker arrived first (phase 1
    done), waits for a phase 0 that never comes."""
    try:
        run(2, schedule, second_region("a_bar"))
    except gluon_cpu.Race:
        got = "race"
    except gluon_cpu.Hang:
        got = "hang"
    else:
        got = "passes"
    assert got == expected


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule"):
        gluon_cpu.CpuKernel(toy_kernel, schedule="random")


# A worker stages a tile of X through registers into shared memory; the default partition waits
# for it and multiplies A's first 64 rows by it.


@gluon.jit
def _stage_tile(src_ptr, p_smem, p_bar):
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, K, gl.SliceLayout(1, layout))
    cols = gl.arange(0, N, gl.SliceLayout(0, layout))
    p_smem.store(gl.load(src_ptr + rows[:, None] * N + cols[None, :]))
    fence_async_shared()
    mbarrier.arrive(p_bar, count=1)


@gluon.jit
def _multiply_staged(a_smem, p_smem, p_bar):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, N, 16])
    mbarrier.wait(p_bar, 0)
    acc = warpgroup_mma(a_smem, p_smem, gl.zeros([BM, N], gl.float32, acc_layout), use_acc=False)
    return (acc,)


@gluon.jit
def staged_kernel(A, X, OUT):
    """``OUT = A[:64] @ X[:K]`` with ``X``'s tile staged by a worker partition."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, K], gl.float16)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, N], gl.float16)
    a_desc = tma.make_tensor_descriptor(A, [2 * BM, K], [K, 1], [BM, K], a_layout)
    a_smem = gl.allocate_shared_memory(gl.float16, [BM, K], a_layout)
    p_smem = gl.allocate_shared_memory(gl.float16, [K, N], p_layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(a_bar, count=1)
    mbarrier.init(p_bar, count=1)
    mbarrier.expect(a_bar, BM * K * 2)
    tma_load(a_desc, [0, 0], a_bar, a_smem)
    mbarrier.wait(a_bar, 0)
    results = gl.warp_specialize([
        (_multiply_staged, (a_smem, p_smem, p_bar)),
        (_stage_tile, (X, p_smem, p_bar)),
    ], [4], [232])
    _store_rows(OUT, results[0], 0)
    mbarrier.invalidate(a_bar)
    mbarrier.invalidate(p_bar)


def staged_outcome(schedule, jit=None, old="", new="") -> tuple[str, str]:
    a, x = operands(1)
    out = torch.full((BM.value, N.value), float("nan"))
    overrides = {jit.fn: mutant(jit, old, new)} if jit is not None else None
    try:
        gluon_cpu.CpuKernel(staged_kernel, schedule=schedule, overrides=overrides)[(1,)](
            A=a, X=x, OUT=out, num_warps=4)
    except gluon_cpu.Race as e:
        return "race", str(e)
    except gluon_cpu.ScheduleError as e:
        return "error", str(e)
    return ("passes" if torch.equal(out, reference(a[:BM.value], x, 1)) else "wrong"), ""


@pytest.mark.parametrize("schedule", gluon_cpu.SCHEDULES)
def test_a_tile_staged_by_a_worker_reaches_the_default_partitions_wgmma(schedule):
    assert staged_outcome(schedule) == ("passes", "")


@pytest.mark.parametrize("schedule", gluon_cpu.SCHEDULES)
def test_a_store_the_storing_partition_did_not_fence_is_a_race(schedule):
    got, message = staged_outcome(schedule, _stage_tile, "    fence_async_shared()\n", "")
    assert got == "race", (got, message)
    assert "stored by worker 0 (_stage_tile) without fence_async_shared" in message, message


@pytest.mark.parametrize("schedule", gluon_cpu.SCHEDULES)
def test_a_wgmma_not_ordered_after_another_partitions_store_is_a_race(schedule):
    """The default partition skips the wait: whichever runs first, the check sees the store and
    the wgmma unordered."""
    got, message = staged_outcome(schedule, _multiply_staged, "    mbarrier.wait(p_bar, 0)\n", "")
    assert got == "race", (got, message)
    assert "no barrier in between" in message, message


@pytest.mark.aot
@pytest.mark.parametrize("kernel,signature", [
    (toy_kernel, {"A": "*fp16", "X": "*fp16", "OUT": "*fp32", "n_tiles": "i32"}),
    (staged_kernel, {"A": "*fp16", "X": "*fp16", "OUT": "*fp32"}),
], ids=["toy", "staged"])
def test_the_toy_kernels_compile_for_sm_90a(kernel, signature):
    """The toys are real Gluon: Triton lowers them to PTX with wgmma (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn=kernel, signature=signature, constexprs={}, attrs={})
    with compiler_mode():
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "wgmma.mma_async" in compiled.asm["ptx"]

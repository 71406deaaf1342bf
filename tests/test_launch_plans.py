"""The launch-plan mechanism (``core/plans.py``) on small stand-in kernels whose launches do
their work on the CPU: a plan replays exactly what Triton's launch path would launch (kernels,
grid, stream, compiled function, arguments), or is not taken; its first use per table and
kernel signature is checked at other addresses, with a poisoned workspace, and a failure or an
exception turns plans off with one warning while the call returns the normal result.

Each scenario runs in one child process without ``TRITON_INTERPRET``, under the stand-in driver
of ``tools/bench/host.py``; the stand-in's launches of the kernels below also run their effect
(pure Python on the CPU memory their pointers, tensors or integers, point at).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the stand-in driver of tools/bench/host.py reads Triton internals (skipped elsewhere)
pytestmark = pytest.mark.triton_internals

KERNELS = r'''
import triton
import triton.language as tl


@triton.jit
def produce(X, W, n, BLOCK: tl.constexpr):  # W = 2·X
    pass


@triton.jit
def consume(W, Y, n, BLOCK: tl.constexpr):  # Y = W + 1
    pass


@triton.jit
def copy(X, Y, n, BLOCK: tl.constexpr):  # Y = X
    pass


@triton.jit
def scratchy(X, Y, n, BLOCK: tl.constexpr):  # Y = X, with global scratch (as TMA descriptors)
    pass


@triton.jit
def to_address(X, y_address, n, BLOCK: tl.constexpr):  # Y = X, Y given as an address
    pass


@triton.jit
def fragile(X, Y, n, BLOCK: tl.constexpr):  # Y = X; its launcher rejects an integer X
    pass


@triton.jit
def peek(W, Y, n, BLOCK: tl.constexpr):  # Y = W + 1, the bits of W noted
    pass
'''

CHILD = r'''
import contextvars, ctypes, json, os, sys, threading, time, warnings
sys.path[:0] = [os.environ["PLAN_KERNELS"], os.environ["LOWBIT_ATTN_TESTS"]]
import torch
import triton
from triton import knobs
from triton.runtime import jit
import plan_kernels as K
from helpers import print_scenarios
from lowbit_attn.core import plans
from lowbit_attn.tools.bench import host

N = 8  # floats per tensor


def floats(x):
    return (ctypes.c_float * N).from_address(x if isinstance(x, int) else x.data_ptr())


def copy_into(x, y, f=lambda a: a):
    src, dst = floats(x), floats(y)
    for i in range(N):
        dst[i] = f(src[i])


def fragile(x, y, *_):
    if isinstance(x, int):
        raise RuntimeError("the launcher takes no integer for X")
    copy_into(x, y)


EFFECTS = {  # pure Python: no PyTorch operation inside a launch
    "produce": lambda x, w, *_: copy_into(x, w, lambda a: 2 * a),
    "consume": lambda w, y, *_: copy_into(w, y, lambda a: a + 1),
    "copy": lambda x, y, *_: copy_into(x, y),
    "scratchy": lambda x, y, *_: copy_into(x, y),
    "to_address": lambda x, y, *_: copy_into(x, y),
    "fragile": fragile,
}
stub_run = host._StubKernel.run


def run_with_effect(self, *args):
    stub_run(self, *args)
    EFFECTS[self.name](*args[9:])


host._StubKernel.run = run_with_effect
x = torch.arange(N, dtype=torch.float32) + 0.5


def planned(table, key, fn, inputs):
    """A call as the library's planned paths make it: the plan's replay, else the table's call."""
    found = table.replay(key, inputs)
    return table.call(key, fn, inputs, "triton") if found is plans.MISSING else found


def two_steps():
    w = torch.empty(N)
    K.produce[(1,)](x, w, N, BLOCK=8)
    y = torch.empty(N)
    K.consume[(1,)](w, y, N, BLOCK=8)
    return y


def one_copy():
    y = torch.empty(N)
    K.copy[(1,)](x, y, N, BLOCK=8)
    return y


def calls(table, key, fn, sink, n=5):
    """n calls of fn through table: per call, the launches and whether the result is right."""
    want = fn()
    rows = []
    for _ in range(n):
        sink.clear()
        got = planned(table, key, fn, (x,))
        rows.append([len(sink), bool(torch.equal(got, want))])
    return rows


def scratch(sink):
    """A kernel that needs Triton's scratch allocator, set in a copy of the caller's context
    (as the Gluon forwards do)."""
    asked = []

    def allocator(size, align, stream):
        asked.append(size)
        return torch.empty(size, dtype=torch.int8)

    def fn():
        y = torch.empty(N)

        def launch():
            triton.set_allocator(allocator)
            K.scratchy[(2,)](x, y, N, BLOCK=8)

        contextvars.copy_context().run(launch)
        return y

    table = plans.Table()
    rows = calls(table, "k", fn, sink)
    stubs = [s for s, _ in sink]
    return {"rows": rows, "asked": len(asked), "state": type(table.state("k")).__name__,
            "scratch_launches": sum(s.scratch_calls for s in set(stubs)),
            "last_replayed": isinstance(sink[-1][1][9], int)}


def default_on(sink):
    """Without ``LOWBIT_ATTN_LAUNCH`` plans are on (the default since their GPU tests passed): a
    key is captured and replayed; ``triton`` turns them off (every call takes Triton's launch
    path, nothing captured); a value that is no mode raises."""
    from lowbit_attn.core.options import KernelOptions

    os.environ.pop("LOWBIT_ATTN_LAUNCH")
    try:
        table = plans.Table()
        found = {"rows": calls(table, "k", two_steps, sink), "state": str(table.state("k")),
                 "default": KernelOptions.from_env().launch,
                 "plannable": plans.plannable("triton")}
        os.environ["LOWBIT_ATTN_LAUNCH"] = "triton"
        table = plans.Table()
        found.update(off_rows=calls(table, "k", two_steps, sink), off_state=str(table.state("k")),
                     off_plannable=plans.plannable("triton"))
        os.environ["LOWBIT_ATTN_LAUNCH"] = "Plan"
        try:
            plans.plannable("triton")
        except ValueError as exc:
            found["bad"] = str(exc)
    finally:
        os.environ["LOWBIT_ATTN_LAUNCH"] = "plan"
    return found


def check_policy(sink):
    """Launches per call: the first use of a kernel signature in a table is checked (a normal
    call and a replay), once per table and signature, not per key or per process."""
    a, b = plans.Table(), plans.Table()
    return {"a": calls(a, "k1", two_steps, sink), "b": calls(b, "k1", two_steps, sink),
            "a_same_kernels": calls(a, "k2", two_steps, sink),
            "a_other_kernels": calls(a, "k3", one_copy, sink)}


def failing(fn, sink):
    table = plans.Table()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rows = calls(table, "k", fn, sink, n=4)
            rows += calls(plans.Table(), "k", fn, sink, n=3)  # plans are off in every table
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {exc}"}
    said = [str(w.message) for w in caught if "plans are off" in str(w.message)]
    return {"rows": rows, "warnings": said, "state": str(table.state("k"))}


def stale_address(sink):
    """The kernel writes through an address the plan cannot see as a pointer: a replay at the
    captured call's own addresses looks right, at other addresses it is not."""
    kept = []  # every output stays alive: the stale address is never freed memory

    def fn():
        y = torch.empty(N)
        kept.append(y)
        K.to_address[(1,)](x, y.data_ptr(), N, BLOCK=8)
        return y

    return failing(fn, sink)


def raising(sink):
    """The replay's launcher raises (in the first-use check)."""
    def fn():
        y = torch.empty(N)
        K.fragile[(1,)](x, y, N, BLOCK=8)
        return y

    return failing(fn, sink)


def unseen_launch(sink):
    """A launch outside Triton's JIT path (a compiled kernel launched directly) is not in the
    plan: the replay leaves its intermediate unwritten (a poisoned workspace shows it even
    where the workspace's memory still holds the normal call's bytes)."""
    def fn():
        w = torch.empty(N)
        stub = K.produce.warmup(x, w, N, BLOCK=8, grid=(1,))
        driver = jit.driver.active
        stub.run(1, 1, 1, driver.get_current_stream(), stub.function, stub.packed_metadata,
                 None, None, None, x, w, N, 8)
        y = torch.empty(N)
        K.consume[(1,)](w, y, N, BLOCK=8)
        return y

    return failing(fn, sink)


def poisoned(sink):
    """A kernel that reads an intermediate nobody wrote: in the first-use check the normal call
    and the replay read the same poison bytes (the normal call's allocations, the replay's
    workspace), so the check passes; the bytes each launch read are noted."""
    seen = []

    def peek(w, y, *_):
        bits = (ctypes.c_uint32 * N).from_address(w if isinstance(w, int) else w.data_ptr())
        seen.append([isinstance(w, int), list(bits)])
        EFFECTS["consume"](w, y)

    EFFECTS["peek"] = peek

    def fn():
        w = torch.empty(N)
        y = torch.empty(N)
        K.peek[(1,)](w, y, N, BLOCK=8)
        return y

    table = plans.Table()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            seen.clear()
            planned(table, "k", fn, (x,))
    return {"third": seen, "state": type(table.state("k")).__name__, "warnings": len(caught)}


def launch_context(sink):
    """After a plan is taken, what Triton's launch path reads at each launch changes: the
    current stream, the current device, the debug knob, a launch hook. Each call launches what
    Triton's path launches then (the same stubs, grids, streams, functions and metadata) and
    calls the hook as often."""
    table = plans.Table()
    calls(table, "k", two_steps, sink)
    driver = jit.driver.active
    hooked = []

    def hook(metadata):
        hooked.append(1)

    changes = {
        "stream": (lambda: setattr(driver, "stream", 11), lambda: setattr(driver, "stream", 7)),
        "device": (lambda: setattr(driver, "device", -2), lambda: setattr(driver, "device", -1)),
        "debug": (lambda: setattr(knobs.runtime, "debug", True),
                  lambda: setattr(knobs.runtime, "debug", False)),
        "hook": (lambda: knobs.runtime.launch_enter_hook.add(hook),
                 lambda: knobs.runtime.launch_enter_hook.remove(hook)),
    }
    out = {}
    for name, (change, undo) in changes.items():
        change()
        try:
            same = []
            for _ in range(4):  # the plan's way (if any), then Triton's own
                hooked.clear()
                sink.clear()
                got = planned(table, "k", two_steps, (x,))
                mine, my_hooks = list(sink), len(hooked)
                hooked.clear()
                sink.clear()
                want = two_steps()
                theirs = list(sink)
                same.append([s for s, _ in mine] == [s for s, _ in theirs]
                            and all(a[:6] == b[:6] for (_, a), (_, b) in zip(mine, theirs))
                            and my_hooks == len(hooked) and bool(torch.equal(got, want)))
            out[name] = same
        finally:
            undo()
    return out


def refused(sink):
    """Calls a plan cannot replay get none: a launch reads a tensor allocated before the call
    that is neither an input nor an output; an output is a view that does not fill its
    storage, is not contiguous, or is an input."""
    persistent = torch.empty(N)

    def reads_persistent():
        y = torch.empty(N)
        K.produce[(1,)](x, persistent, N, BLOCK=8)
        K.consume[(1,)](persistent, y, N, BLOCK=8)
        return y

    def partial_view():
        y = torch.empty(N + 1)
        K.copy[(1,)](x, y[1:], N, BLOCK=8)
        return y[1:]

    def transposed():
        y = torch.empty(2, N // 2)
        K.copy[(1,)](x, y, N, BLOCK=8)
        return y.t()

    def the_input():
        K.copy[(1,)](x, x, N, BLOCK=8)
        return x

    out = {}
    for fn in (reads_persistent, partial_view, transposed, the_input):
        table = plans.Table()
        for _ in range(4):
            planned(table, fn.__name__, fn, (x,))
        out[fn.__name__] = str(table.state(fn.__name__))
    return out


def lock(sink):
    """A capture that waits (as one running the Gluon admission's child process does) holds up
    no other thread's capture."""
    started, release = threading.Event(), threading.Event()

    def waits():
        started.set()
        release.wait(20)
        return one_copy()

    other = threading.Thread(target=lambda: plans.capture(waits, (x,)))
    other.start()
    started.wait(20)
    t0 = time.perf_counter()
    plans.capture(one_copy, (x,))
    seconds = time.perf_counter() - t0
    release.set()
    other.join()
    return {"seconds": seconds}


SCENARIOS = {f.__name__: f for f in (scratch, check_policy, stale_address, raising, unseen_launch,
                                     poisoned, launch_context, refused, lock, default_on)}
with host.stubbed_launches((9, 0), scratch={"scratchy": 128}) as sink:
    print_scenarios(SCENARIOS, json.loads(sys.argv[1]), sink, plans.reset)
'''


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    """Every scenario's result, from one child process."""
    where = tmp_path_factory.mktemp("plan_kernels")
    (where / "plan_kernels.py").write_text(KERNELS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOWBIT_ATTN_ARCH="sm_90", PLAN_KERNELS=str(where), LOWBIT_ATTN_LAUNCH="plan",
               LOWBIT_ATTN_TESTS=os.path.dirname(os.path.abspath(__file__)))
    names = ["scratch", "check_policy", "stale_address", "raising", "unseen_launch", "poisoned",
             "launch_context", "refused", "lock", "default_on"]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(names)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kernel_that_needs_scratch_replays_under_the_allocator_of_its_launch(scenarios):
    """Issue 37 (1): every call, replayed ones included, takes its global scratch from the
    allocator its launch saw (the Gluon forwards set one in a copy of the caller's context)."""
    row = scenarios["scratch"]
    assert "raised" not in row, row
    assert all(right for _, right in row["rows"]), row
    assert row["state"] == "Plan" and row["last_replayed"], row
    # every launch asked the allocator once (the launches of the calls, and a first normal call)
    assert row["asked"] == row["scratch_launches"] == 1 + sum(n for n, _ in row["rows"]), row


def test_first_use_is_checked_per_table_and_kernel_signature(scenarios):
    """Issue 37 (4): a key's third call is checked (a normal call and a replay: twice the
    launches) when its table has not checked that signature yet; every result is right."""
    rows = scenarios["check_policy"]
    assert "raised" not in rows, rows
    for name, want in (("a", [2, 2, 4, 2, 2]), ("b", [2, 2, 4, 2, 2]),
                       ("a_same_kernels", [2, 2, 2, 2, 2]), ("a_other_kernels", [1, 1, 2, 1, 1])):
        assert [n for n, _ in rows[name]] == want, (name, rows[name])
        assert all(right for _, right in rows[name]), (name, rows[name])


@pytest.mark.parametrize("scenario", ["stale_address", "raising", "unseen_launch"])
def test_a_failed_first_use_turns_plans_off_once_and_returns_the_normal_result(scenarios,
                                                                               scenario):
    """Issue 37 (4): a replay that writes where the captured call wrote (checked at other
    addresses), raises, or leaves an intermediate unwritten (a poisoned workspace) fails the
    check: one warning, plans off in every table, every call's result the normal one."""
    row = scenarios[scenario]
    assert "raised" not in row, row
    assert all(right for _, right in row["rows"]), row
    assert len(row["warnings"]) == 1, row
    assert "failed its check" in row["state"], row


def test_the_check_replays_into_a_poisoned_workspace(scenarios):
    """Issue 37 (4): in the first-use check (the key's third call), the normal call's
    allocations and the replay's workspace start as the same poison bytes (0xFF: NaN), so that
    a read before a write shows and does not pass for the bytes an earlier call left."""
    row = scenarios["poisoned"]
    assert "raised" not in row, row
    third = row["third"]
    assert [replayed for replayed, _ in third] == [False, True], row  # normal call, replay
    assert all(bits == [0xFFFFFFFF] * 8 for _, bits in third), row
    assert row["state"] == "Plan" and row["warnings"] == 0, row


@pytest.mark.parametrize("change", ["stream", "device", "debug", "hook"])
def test_replays_follow_what_triton_reads_at_each_launch(scenarios, change):
    """Issue 37 (7): after a change of the current stream or device, of Triton's debug knob, or
    a launch hook set, each call launches what Triton's path launches (or the plan is not
    taken)."""
    row = scenarios["launch_context"]
    assert "raised" not in row, row
    assert row[change] == [True] * 4, row[change]


@pytest.mark.parametrize("case", ["reads_persistent", "partial_view", "transposed", "the_input"])
def test_calls_a_plan_would_get_wrong_get_none(scenarios, case):
    """Issue 37 (7): what a plan assumes is asserted at capture: tensors that are neither input
    nor output were allocated by the call; outputs are fresh, contiguous, fill their storage."""
    row = scenarios["refused"]
    assert "raised" not in row, row
    assert row[case] not in ("Plan", "seen") and not row[case].startswith("Plan("), row[case]


def test_a_waiting_capture_holds_up_no_other_thread(scenarios):
    """Issue 37 (7): the plans' lock is not held across a captured call."""
    row = scenarios["lock"]
    assert "raised" not in row, row
    assert row["seconds"] < 5, row


def test_plans_are_on_by_default_and_off_with_triton(scenarios):
    """Issue 43 (4): plans are the default since their GPU tests passed (H200, 2026-11-30): a
    key's third call is checked and its later calls replayed; ``LOWBIT_ATTN_LAUNCH=triton``
    launches every call normally (two launches, the right result) and captures none."""
    row = scenarios["default_on"]
    assert "raised" not in row, row
    assert row["default"] == "plan" and row["plannable"] is True, row
    assert [n for n, _ in row["rows"]] == [2, 2, 4, 2, 2] and row["state"].startswith("Plan("), row
    assert all(right for _, right in row["rows"]), row
    assert row["off_plannable"] is False, row
    assert row["off_rows"] == [[2, True]] * 5 and row["off_state"] == "seen", row
    assert "LOWBIT_ATTN_LAUNCH must be one of ('plan', 'triton'), got 'Plan'" in row["bad"], row

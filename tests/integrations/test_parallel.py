"""Sequence parallelism (lowbit_attn.integrations.parallel) on gloo over CPU processes.

One world of 4 processes runs every distributed check, for the whole world (P = 4, the default
group) and for two 2-rank subgroups, global ranks {0, 2} and {1, 3} (P = 2, an explicit ``group``
whose ranks are not the global ones). The workers write what they measured to JSON files; the tests
below read and judge them. Starting processes is the slow part, so it happens once per module, by
fork where available (the children inherit the imports; spawn costs ~7 s of imports per process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lowbit_attn
from helpers import assert_close
from lowbit_attn.tools import inputs
from lowbit_attn.integrations import parallel

WORLD = 4
# P = 4 (group=None); P = 2 over global ranks {0, 2} and {1, 3}
GROUP_SIZES = {"world4": 4, "pair02": 2, "pair13": 2}
GROUPS = tuple(GROUP_SIZES)
METHODS = {"ulysses": parallel.ulysses_attention, "ring": parallel.ring_attention}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: whole-sequence shapes (``n`` tokens in all), recipe and layout."""

    name: str
    recipe: str = "exact"
    dtype: torch.dtype = torch.float32
    layout: str = "HND"
    is_causal: bool = False
    hq: int = 4
    hkv: int = 2
    n: int = 64
    d: int = 32
    batch: int = 2
    seed: int = 0


CASES = [
    Case("exact", seed=1),
    Case("exact-causal", is_causal=True, seed=2),
    Case("exact-mqa-causal", is_causal=True, hkv=1, seed=3),
    # Hkv = 3 neither divides P nor is a multiple of it: Ulysses replicates K/V heads
    Case("exact-gqa3-causal", is_causal=True, hq=12, hkv=3, seed=4),
    Case("exact-nhd-causal", layout="NHD", is_causal=True, seed=5),
    Case("exact-bf16-causal", dtype=torch.bfloat16, is_causal=True, n=128, seed=6),
    Case("int8-fp16", recipe="qk_int8_pv_fp16", n=256, d=64, seed=7),
    Case("int8-fp16-causal", recipe="qk_int8_pv_fp16", is_causal=True, n=256, d=64, seed=8),
    Case("int8-fp16-mqa-nhd-causal", recipe="qk_int8_pv_fp16", layout="NHD", is_causal=True,
         hkv=1, n=256, d=64, seed=9),
    Case("int8-fp8-causal", recipe="qk_int8_pv_fp8", is_causal=True, n=256, d=64, seed=10),
    Case("int8-fp16-bf16-causal", recipe="qk_int8_pv_fp16", dtype=torch.bfloat16,
         is_causal=True, n=256, d=64, seed=11),
]


def exact64(q, k, v, is_causal: bool) -> torch.Tensor:
    """Float64 attention of HND tensors (GQA, causal aligned bottom-right)."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if is_causal:
        nq, nk = q.shape[2], k.shape[2]
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def whole_inputs(case: Case):
    """The whole-sequence q, k, v in the case's layout (every rank draws the same)."""
    q, k, v = inputs.make(
        "channel_bias_k", seed=case.seed, batch=case.batch, heads_q=case.hq, heads_kv=case.hkv,
        n_q=case.n, n_k=case.n, head_dim=case.d, dtype=case.dtype,
    )
    if case.layout == "NHD":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return q, k, v


def shard(x: torch.Tensor, layout: str, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of the sequence dimension."""
    return x.chunk(world, dim=2 if layout == "HND" else 1)[rank].contiguous()


def gather_sequence(x: torch.Tensor, layout: str, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2 if layout == "HND" else 1)


def measure(case: Case, method: str, group, group_arg) -> dict | None:
    """Run ``method`` on this rank's shard; on the group's rank 0, compare the gathered output with
    single-process ``lowbit_attn.attention`` and float64 attention."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = whole_inputs(case)
    local = [shard(x, case.layout, rank, world) for x in (q, k, v)]
    out = METHODS[method](*local, group=group_arg, is_causal=case.is_causal, layout=case.layout,
                          recipe=case.recipe)
    assert out.shape == local[0].shape and out.dtype == case.dtype and out.is_contiguous()
    whole = gather_sequence(out, case.layout, group)
    if rank != 0:
        return None
    single = lowbit_attn.attention(q, k, v, is_causal=case.is_causal, layout=case.layout,
                                   recipe=case.recipe)
    to_hnd = (lambda x: x.transpose(1, 2)) if case.layout == "NHD" else (lambda x: x)
    ref = exact64(*(to_hnd(x) for x in (q, k, v)), case.is_causal)
    errors = lowbit_attn.errors(to_hnd(whole), ref)
    single_errors = lowbit_attn.errors(to_hnd(single), ref)
    tol = 1e-5 if case.dtype == torch.float32 else 1e-2
    try:
        assert_close(whole, single, atol=tol, rtol=tol, name=f"{method} vs single process")
        close = None
    except AssertionError as e:
        close = str(e)
    return {
        "close_to_single": close,
        "equal_to_single": torch.equal(whole, single),
        "cosine": errors.cosine, "rel_l1": errors.rel_l1,
        "single_cosine": single_errors.cosine, "single_rel_l1": single_errors.rel_l1,
        "finite": bool(torch.isfinite(whole).all()),
    }


def bad_calls(rank: int):
    """(name, call) pairs where one rank (or all) passes something wrong; ``call()`` must raise."""
    q, k, v = (shard(x, "HND", rank, WORLD) for x in whole_inputs(Case("bad", seed=12)))
    q6 = torch.zeros(2, 6, 16, 32)
    kv3 = torch.zeros(2, 3, 16, 32)
    return [
        ("ring-shape", lambda: parallel.ring_attention(q[:, :, :-1] if rank == 1 else q, k, v)),
        ("ulysses-shape",
         lambda: parallel.ulysses_attention(q[:, :, :-1] if rank == 1 else q, k, v)),
        ("ulysses-heads", lambda: parallel.ulysses_attention(q6, kv3, kv3)),
        ("ring-dtype", lambda: parallel.ring_attention(q.int() if rank == 2 else q, k, v)),
        ("ulysses-grad", lambda: parallel.ulysses_attention(
            q.clone().requires_grad_(rank == 3), k, v)),
        ("ring-causal-lengths", lambda: parallel.ring_attention(
            q, k[:, :, :-1] if rank == 0 else k, v[:, :, :-1] if rank == 0 else v,
            is_causal=True)),
        ("ring-flag", lambda: parallel.ring_attention(q, k, v, is_causal=rank == 1)),
        ("ulysses-recipe", lambda: parallel.ulysses_attention(
            q, k, v, recipe="qk_int8_pv_fp16" if rank == 0 else "exact")),
    ]


def worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["LOWBIT_ATTN_BACKEND"] = "reference"
    os.environ.pop("TRITON_INTERPRET", None)  # set by conftest; the reference path needs none
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    pairs = {"pair02": dist.new_group([0, 2]), "pair13": dist.new_group([1, 3])}
    mine = "pair02" if rank % 2 == 0 else "pair13"
    with torch.no_grad():
        for tag, group, group_arg in (("world4", dist.group.WORLD, None),
                                      (mine, pairs[mine], pairs[mine])):
            results = {}
            for case in CASES:
                for method in METHODS:
                    result = measure(case, method, group, group_arg)
                    if result is not None:
                        results[f"{method}-{case.name}"] = result
            if dist.get_rank(group) == 0:
                with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
                    json.dump(results, f)
    raised = {}
    for name, call in bad_calls(rank):  # with grad mode on, for the requires_grad check
        start = time.perf_counter()
        try:
            call()
            raised[name] = None
        except (ValueError, TypeError) as e:
            raised[name] = {"type": type(e).__name__, "message": str(e),
                            "seconds": time.perf_counter() - start}
    with torch.no_grad():  # the group still works after all those errors
        healthy = {m: measure(Case("after-errors", is_causal=True, seed=13), m, dist.group.WORLD,
                              None) for m in METHODS}
    with open(os.path.join(out_dir, f"raised-{rank}.json"), "w") as f:
        json.dump({"raised": raised, "healthy": healthy}, f)
    dist.destroy_process_group()


def run_processes(fn, nprocs: int, tmp, *args) -> dict:
    """Run ``fn(rank, init_file, out_dir, *args)`` in ``nprocs`` processes; returns
    ``{file stem: parsed JSON}`` of what they wrote to ``out_dir``."""
    out_dir = tmp / "out"
    out_dir.mkdir()
    # import what the first call imports (torch._dynamo, ~4 s) once, before forking
    lowbit_attn.attention(*(torch.zeros(1, 1, 1, 8) for _ in range(3)), recipe="exact")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(fn, args=(str(tmp / "store"), str(out_dir), *args), nprocs=nprocs,
                       join=True, start_method=method)
    return {p.stem: json.loads(p.read_text()) for p in out_dir.glob("*.json")}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Run the 4-process world once; returns ``{file stem: parsed JSON}``."""
    return run_processes(worker, WORLD, tmp_path_factory.mktemp("parallel"))


# Accuracy bars for channel_bias_k inputs at these small shapes (lowbit_attn.tools.accuracy.BARS are set
# at N=4096, D=128; FP8 P·V loses a little more here, one device included).
SMALL_SHAPE_BARS = {"qk_int8_pv_fp16": (0.9999, 0.015), "qk_int8_pv_fp8": (0.999, 0.04)}


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_single_process_attention(world, case, method, group):
    r = world[group][f"{method}-{case.name}"]
    assert r["finite"]
    if case.recipe == "exact":
        # the same function up to rounding (the ring's LSE merge rounds differently)
        assert r["close_to_single"] is None, r["close_to_single"]
        assert r["cosine"] >= (0.99999 if case.dtype == torch.float32 else 0.9999)
        return
    if method == "ulysses" and case.hkv % GROUP_SIZES[group] == 0:
        # each rank quantizes whole sequences of whole GQA groups, exactly as one device would
        # (with replicated K/V heads, Q·K balancing sees only the local query heads of a group)
        assert r["equal_to_single"]
    min_cosine, max_rel_l1 = SMALL_SHAPE_BARS[case.recipe]
    assert r["cosine"] >= min_cosine, r
    assert r["rel_l1"] <= max_rel_l1, r
    assert r["rel_l1"] <= 1.1 * r["single_rel_l1"], r  # no worse than one device


EXPECTED_ERRORS = {
    "ring-shape": (ValueError, "ring_attention: q shape must be the same on every rank of the "
                               "group, got (2, 4, 16, 32) on rank 0 and (2, 4, 15, 32) on rank 1"),
    "ulysses-shape": (ValueError, "ulysses_attention: q shape must be the same on every rank"),
    "ulysses-heads": (ValueError, "ulysses_attention: invalid inputs on rank 0 (and on rank(s) "
                                  "1, 2, 3): ulysses_attention needs the number of query heads (6) "
                                  "to be a multiple of the group size (4)"),
    "ring-dtype": (TypeError, "ring_attention: invalid inputs on rank 2: q must be float16, "
                              "bfloat16 or float32, got torch.int32"),
    "ulysses-grad": (ValueError, "invalid inputs on rank 3: q, k and v must not require grad"),
    "ring-causal-lengths": (ValueError, "invalid inputs on rank 0: causal ring_attention needs "
                                        "as many local query as key tokens"),
    "ring-flag": (ValueError, "ring_attention: is_causal must be the same on every rank of the "
                              "group, got False on rank 0 and True on rank 1"),
    "ulysses-recipe": (ValueError, "ulysses_attention: recipe must be the same on every rank"),
}


@pytest.mark.parametrize("name", list(EXPECTED_ERRORS))
def test_bad_input_on_one_rank_raises_on_every_rank(world, name):
    kind, message = EXPECTED_ERRORS[name]
    raised = [world[f"raised-{rank}"]["raised"][name] for rank in range(WORLD)]
    assert all(r is not None for r in raised), raised
    assert {r["type"] for r in raised} == {kind.__name__}
    assert len({r["message"] for r in raised}) == 1, [r["message"] for r in raised]
    assert message in raised[0]["message"]
    assert max(r["seconds"] for r in raised) < 5.0


def test_group_still_works_after_errors(world):
    healthy = world["raised-0"]["healthy"]
    for method in METHODS:
        assert healthy[method]["close_to_single"] is None, healthy[method]["close_to_single"]


def test_without_process_group_raises():
    assert not dist.is_initialized()
    q = torch.zeros(1, 2, 8, 16)
    for fn in METHODS.values():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            fn(q, q, q)


def test_group_of_one_process_is_single_device_attention(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        q, k, v = whole_inputs(Case("one", is_causal=True, seed=15))
        single = lowbit_attn.attention(q, k, v, is_causal=True)
        for fn in METHODS.values():
            assert_close(fn(q, k, v, is_causal=True), single, atol=1e-6, rtol=1e-6)
    finally:
        dist.destroy_process_group()


def test_merge_partial_matches_attention_over_all_keys():
    q, k, v = inputs.make("channel_bias_k", seed=14, batch=2, heads_q=4, heads_kv=2, n_q=16,
                          n_k=48, head_dim=32, dtype=torch.float32)
    full = lowbit_attn.attention(q, k, v, recipe="exact")
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    for part in (slice(32, 48), slice(0, 16), slice(16, 32)):
        o, o_lse = lowbit_attn.attention(q, k[:, :, part], v[:, :, part], recipe="exact",
                                         return_lse=True)
        parallel._merge_partial(out, lse, o, o_lse)
    _, full_lse = lowbit_attn.attention(q, k, v, recipe="exact", return_lse=True)
    assert_close(out, full, atol=1e-5, rtol=1e-5)
    assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


def test_merge_partial_rows_without_keys_stay_zero_without_nan():
    out = torch.zeros(1, 1, 3, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    o = torch.tensor([[[[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]]])
    o_lse = torch.tensor([[[float("-inf"), 0.5, float("-inf")]]])
    parallel._merge_partial(out, lse, o, o_lse)  # rows 0 and 2 have seen no key on either side
    assert torch.equal(out, torch.tensor([[[[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]]]))
    assert torch.equal(lse, torch.tensor([[[float("-inf"), 0.5, float("-inf")]]]))
    parallel._merge_partial(out, lse, torch.ones(1, 1, 3, 2), torch.zeros(1, 1, 3))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.equal(out[0, 0, 0], torch.ones(2))


# Exceptions other than ValueError/TypeError raised by one rank's checks (``FAILING_RANK``; the
# process group's timeout is short, so a rank left waiting fails the test instead of hanging it).
LONG_TEXT = "a long message with a character beyond the BMP \U0001F642 " * 4000
UNEXPECTED = {
    "runtime": ("ring", RuntimeError("the checks broke")),
    "overflow": ("ulysses", OverflowError("int too large to convert to float")),
    "long-assertion": ("ring", AssertionError(LONG_TEXT)),
    "long-value-error": ("ulysses", ValueError(LONG_TEXT + "END")),
}
FAILING_RANK = {2: 1, 4: 2}
LONG_RECIPE = lowbit_attn.get_recipe("exact").replace(name="r" * 5000)


@contextlib.contextmanager
def raising_in_checks(error: Exception | None):
    """Make this process's recipe resolution (one of the checks before the ranks exchange their
    reports) raise ``error``; no change for ``None``."""
    saved = parallel.resolve_for

    def fail(*args, **kwargs):
        raise error

    if error is not None:
        parallel.resolve_for = fail
    try:
        yield
    finally:
        parallel.resolve_for = saved


def failing_worker(rank: int, init_file: str, out_dir: str, world: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["LOWBIT_ATTN_BACKEND"] = "reference"
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    case = Case("unexpected", n=16, d=16, seed=16)
    q, k, v = (shard(x, "HND", rank, world) for x in whole_inputs(case))
    failing = rank == FAILING_RANK[world]
    calls = {name: (METHODS[method], {}, error if failing else None)
             for name, (method, error) in UNEXPECTED.items()}
    calls["long-recipe-same"] = (parallel.ring_attention, {"recipe": LONG_RECIPE}, None)
    calls["long-recipe-differs"] = (parallel.ulysses_attention, {
        "recipe": LONG_RECIPE.replace(name="r" * 5000 + ("b" if failing else "a"))}, None)
    calls["numpy-bool-causal"] = (parallel.ring_attention, {"is_causal": np.bool_(True)}, None)
    results = {}
    with torch.no_grad():
        for name, (fn, kwargs, error) in calls.items():
            start = time.perf_counter()
            try:
                with raising_in_checks(error):
                    out = fn(q, k, v, **kwargs)
                results[name] = {"type": None, "finite": bool(torch.isfinite(out).all())}
            except Exception as e:  # noqa: BLE001 -- the test judges whatever came out
                results[name] = {"type": type(e).__name__, "message": str(e)}
            results[name]["seconds"] = time.perf_counter() - start
        try:
            healthy = measure(Case("after-unexpected", is_causal=True, n=16, d=16, seed=17),
                              "ring", dist.group.WORLD, None)
        except Exception as e:  # noqa: BLE001
            healthy = {"close_to_single": f"raised {type(e).__name__}: {e}"}
    with open(os.path.join(out_dir, f"unexpected-{rank}.json"), "w") as f:
        json.dump({"results": results, "healthy": healthy}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=list(FAILING_RANK), ids=lambda p: f"P{p}")
def unexpected_world(request, tmp_path_factory):
    """``(P, [each rank's results])`` of :func:`failing_worker` in a world of ``P`` processes."""
    world = request.param
    files = run_processes(failing_worker, world, tmp_path_factory.mktemp(f"unexpected{world}"),
                          world)
    return world, [files[f"unexpected-{rank}"] for rank in range(world)]


@pytest.mark.parametrize("name", list(UNEXPECTED))
def test_unexpected_exception_on_one_rank_reaches_every_rank(unexpected_world, name):
    world, ranks = unexpected_world
    method, error = UNEXPECTED[name]
    failing = FAILING_RANK[world]
    fn_name = METHODS[method].__name__
    results = [r["results"][name] for r in ranks]
    assert max(r["seconds"] for r in results) < 1.0, results  # measured < 0.03 s; timeout 30 s
    if isinstance(error, ValueError):  # every rank raises the same ValueError, the message cut
        assert {r["type"] for r in results} == {"ValueError"}
        assert len({r["message"] for r in results}) == 1
        cut = str(error)[:parallel._MAX_TEXT_CHARS] + "… [cut: "
        assert results[0]["message"].startswith(f"{fn_name}: invalid inputs on rank {failing}: ")
        assert cut in results[0]["message"] and "END" not in results[0]["message"]
        return
    for rank, r in enumerate(results):
        if rank == failing:  # its own exception, whole
            assert (r["type"], r["message"]) == (type(error).__name__, str(error))
        else:
            assert r["type"] == "RuntimeError", r
            assert r["message"].startswith(
                f"{fn_name}: rank {failing} raised {type(error).__name__} before the ranks "
                f"exchanged their inputs: "), r["message"]
            assert r["message"].endswith(parallel._clip(str(error))), r["message"]
            assert len(r["message"]) < 400  # a long message is cut


def test_long_recipes_are_compared_whole(unexpected_world):
    world, ranks = unexpected_world
    same = [r["results"]["long-recipe-same"] for r in ranks]
    assert all(r["type"] is None and r["finite"] for r in same), same
    differs = [r["results"]["long-recipe-differs"] for r in ranks]
    assert {r["type"] for r in differs} == {"ValueError"}, differs
    assert differs[0]["message"].startswith(
        "ulysses_attention: recipe must be the same on every rank of the group, got ")
    assert f"on rank {FAILING_RANK[world]}" in differs[0]["message"]


def test_numpy_bool_flag_agrees(unexpected_world):
    _, ranks = unexpected_world
    results = [r["results"]["numpy-bool-causal"] for r in ranks]
    assert all(r["type"] is None and r["finite"] for r in results), results


def test_group_still_works_after_unexpected_exceptions(unexpected_world):
    healthy = unexpected_world[1][0]["healthy"]
    assert healthy["close_to_single"] is None, healthy["close_to_single"]

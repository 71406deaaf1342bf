"""Shared test utilities."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import lowbit_attn


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0,
                 name: str = "tensor") -> None:
    """Closeness with NaN/Inf checked on their own (same positions) and the worst element reported."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), (
        f"{name}: NaN positions differ ({int(nan_a.sum())} actual vs {int(nan_e.sum())} expected)"
    )
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{name}: Inf positions differ"
    finite = torch.isfinite(e)
    diff = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bound = atol + rtol * e.abs()
    excess = torch.where(finite, diff - bound, torch.full_like(a, -1.0))
    worst = int(excess.flatten().argmax())
    if excess.flatten()[worst] > 0:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(
            f"{name}: |actual - expected| = {float(diff.flatten()[worst]):.3e} > "
            f"{float(bound.flatten()[worst]):.3e} at index {idx} "
            f"(actual {float(a[idx]):.6g}, expected {float(e[idx]):.6g}); "
            f"{int((excess > 0).sum())} of {a.numel()} elements out of tolerance"
        )


def channel_biased(shape_q, shape_kv, *, seed: int = 0, dtype=torch.float32, bias: float = 4.0,
                   device: str = "cpu"):
    """q, k, v ~ N(0, 1) with ``k += bias·N(0, 1)`` per (batch, head, channel) (HND), drawn on
    the CPU (the same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g)
    k = torch.randn(shape_kv, generator=g)
    k = k + bias * torch.randn(shape_kv[0], shape_kv[1], 1, shape_kv[3], generator=g)
    v = torch.randn(shape_kv, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


@dataclass(frozen=True)
class Budget:
    """Worst error allowed on rows that see a key: ``max|out - ref| <= abs_v · max|V|`` (an output
    row is a convex combination of V's rows, so this holds however small N, D or the output are);
    cosine over those rows ``>= cos`` where their RMS is at least 2 % of ``max|V|`` (below that the
    output is mostly cancellation and its direction is noise); ``|lse - ref| <= lse``."""

    cos: float
    abs_v: float
    lse: float


def row_errors(out, ref, lse, ref_lse, vmax: float):
    """Errors of the rows that see a key, against the float64 oracle: ``(max|out - ref| / max|V|,
    cosine or None where the rows' RMS is under 2 % of max|V|, max|lse - ref| or None)``; None
    when no row sees a key. Rows that see no key must be exactly 0 with LSE ``-inf``."""
    seen = torch.isfinite(ref_lse)
    assert torch.all(out[~seen] == 0), "a row that sees no key is not 0"
    if lse is not None:
        assert lse.dtype == torch.float32
        assert torch.all(torch.isneginf(lse[~seen])), "a row that sees no key has LSE != -inf"
    if not seen.any():
        return None
    o, r = out[seen].double(), ref[seen].double()
    assert torch.isfinite(o).all(), "non-finite output from finite inputs"
    err = float((o - r).abs().max()) / vmax
    cos = lowbit_attn.errors(o, r).cosine if float(r.pow(2).mean().sqrt()) >= 0.02 * vmax else None
    lerr = None if lse is None else float((lse[seen].double() - ref_lse[seen]).abs().max())
    return err, cos, lerr


def check_rows(out, ref, lse, ref_lse, vmax: float, b: Budget) -> None:
    """``out [..., N, D]`` and ``lse [..., N]`` (or None) within the budget ``b``."""
    errs = row_errors(out, ref, lse, ref_lse, vmax)
    if errs is None:
        return
    err, cos, lerr = errs
    assert err <= b.abs_v, f"max |out - ref| = {err:.3g} · max|V| > {b.abs_v} · max|V|"
    assert cos is None or cos >= b.cos, f"cosine {cos:.6f} < {b.cos}"
    assert lerr is None or lerr <= b.lse, f"max |lse - ref| = {lerr:.3g} > {b.lse}"


# --- kernels against their twins on each target (the ``device`` fixture, tests/conftest.py) -------


@dataclass(frozen=True)
class Bound:
    """How close a kernel's result must be to its twin's: ``|got - want| <= atol + rtol·|want|``
    with NaN and Inf at the same places, relative L2 error ``< rel_l2``, cosine ``> cos``; a part
    that is ``None`` is not checked."""

    atol: float | None = None
    rtol: float = 0.0
    rel_l2: float | None = None
    cos: float | None = None

    def widened(self, other: Bound) -> Bound:
        """This bound with each part it checks no tighter than ``other``'s (the parts it does not
        check stay unchecked)."""
        def looser(mine, theirs, pick):
            return mine if mine is None or theirs is None else pick(mine, theirs)

        return Bound(atol=looser(self.atol, other.atol, max),
                     rtol=0.0 if self.atol is None else max(self.rtol, other.rtol),
                     rel_l2=looser(self.rel_l2, other.rel_l2, max),
                     cos=looser(self.cos, other.cos, min))

    def only(self, *parts: str) -> Bound:
        """The same bound checking ``parts`` alone (for a test that holds its parts to different
        references)."""
        return replace(self, **{p: None for p in ("atol", "rel_l2", "cos") if p not in parts})


@dataclass(frozen=True)
class Codes:
    """How far quantized codes may be from their twin's: a fraction ``< flipped`` of the elements
    differs, each by at most ``step`` codes (``None``: any; only integer codes are stepped)."""

    step: int | None
    flipped: float


# What tests/test_gpu.py allowed a compiled kernel against its twin on a CUDA GPU (2×8×1000×D
# inputs, D = 64 and 128) before its checks moved onto the interpreter tests' parameter lists. Fast
# exp2, fused multiply-adds, tensor-core accumulation and statistics summed in another order leave
# differences the interpreter, which runs a kernel's arithmetic in the twin's order, does not.
# Where a test compares what test_gpu.py did not, the nearest of its bounds is used: marked (*).
ON_CUDA = {
    # quantized Q and K (INT8 quantizer and attention kernel test): at most one code apart on
    # fewer than 1e-4 of the values; (*) their scales: differing on fewer than 1e-4 as well
    "int8 codes": Codes(step=1, flipped=1e-4),
    # packed FP4 operands (FP4 operands and kernel test): ``same > 0.999``; (*) scales and tensor
    # scales held to it too
    "fp4 codes": Codes(step=None, flipped=1e-3),
    # the INT8 attention kernel on the twin's operands, by P·V format, and its LSE (FP4's too;
    # (*) also the LSE where test_gpu.py compared outputs alone: varlen, KV statistics)
    "int8 out fp16": Bound(atol=1e-3, cos=0.99999),
    "int8 out fp8": Bound(atol=3e-3, cos=0.99999),
    "lse": Bound(atol=1e-3),
    # the FP4 attention kernel on the twin's operands
    "fp4 out": Bound(cos=0.9999),
    # the same statistics summed in another order (KV statistics in the quantizing launch against
    # the statistics launch): "the same output to within a few rounding flips"; (*) also a varlen
    # sequence against the same call alone
    "sum order": Bound(cos=0.99999),
    # the trainable kernels on the twin's operands (both dQ modes)
    "train lse": Bound(atol=5e-5),
    "train out": Bound(cos=0.99999),
    "train grad": Bound(cos=0.9999),
    # the video sparse attention fine stage: 16-bit (output and gradients) and 8-bit
    "vsa": Bound(cos=0.9999),
    "vsa 8bit": Bound(cos=0.99999),
    # a public call against exact attention (varlen and decode test; (*) the layouts test)
    "exact": Bound(cos=0.999),
}


@dataclass(frozen=True)
class Target:
    """Where a test runs the Triton kernels: ``"cpu"``, under the Triton interpreter (the tests'
    own bounds, bit for bit where they say so), or ``"cuda"``, compiled (the bounds of
    :data:`ON_CUDA`, widened to a test's own where that is looser: a case the interpreter needs more
    room for needs it on a GPU too). ``name`` is the torch device of the inputs."""

    name: str

    @property
    def interpreted(self) -> bool:
        return self.name == "cpu"

    def bound(self, kind: str, here: Bound) -> Bound:
        """``here`` (a test's bound under the interpreter) on this target."""
        return here if self.interpreted else ON_CUDA[kind].widened(here)

    def needs(self, recipe) -> None:
        """Skip a recipe this GPU cannot run: FP8 P·V needs compute capability 8.9."""
        recipe = lowbit_attn.get_recipe(recipe) if isinstance(recipe, str) else recipe
        if (not self.interpreted and recipe.pv == "fp8"
                and torch.cuda.get_device_capability() < (8, 9)):
            pytest.skip("FP8 P·V needs compute capability 8.9+")


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: Bound, *,
                  name: str = "tensor") -> None:
    """``got`` against ``want`` within ``bound`` (see :class:`Bound`)."""
    if bound.atol is not None:
        assert_close(got, want, atol=bound.atol, rtol=bound.rtol, name=name)
    if bound.rel_l2 is not None:
        rel = float((got.float() - want).norm() / want.norm())
        assert rel < bound.rel_l2, f"{name}: relative L2 error {rel:.2e}"
    if bound.cos is not None:
        cos = lowbit_attn.errors(got, want).cosine
        assert cos > bound.cos, f"{name}: cosine {cos:.7f} <= {bound.cos}"


def assert_same(got: torch.Tensor, want: torch.Tensor, device: Target, kind: str, *,
                name: str = "tensor") -> None:
    """The same bits under the interpreter; on a GPU within ``ON_CUDA[kind]``: a :class:`Codes`
    for quantized codes and their scales, a :class:`Bound` for anything else."""
    if device.interpreted:
        assert torch.equal(got, want), f"{name} differ"
        return
    spec = ON_CUDA[kind]
    if isinstance(spec, Bound):
        assert_within(got, want, spec, name=name)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if got.element_size() == 1 and got.is_floating_point():  # E4M3 scales: compare the bits
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if spec.step is not None and not got.is_floating_point() and got.numel():
        step = int((got.int() - want.int()).abs().max())
        assert step <= spec.step, f"{name}: codes {step} apart"
    flipped = float((got != want).float().mean()) if got.numel() else 0.0
    assert flipped < spec.flipped, f"{name}: {flipped:.2e} of the elements differ"


def mutant(jit, old: str, new: str):
    """A plain-Python copy of a ``@jit`` function with ``old`` (present exactly once in its source)
    replaced by ``new``, for the CPU schedule checks' mutation tests (run through
    ``tools.gluon_cpu``'s ``overrides``)."""
    import __future__
    import inspect
    import textwrap

    py = jit.fn
    src = textwrap.dedent(inspect.getsource(py))
    assert src.count(old) == 1, f"{py.__name__} no longer holds {old!r} once: update the mutation"
    lines = src.replace(old, new).splitlines()
    while lines[0].startswith("@"):
        lines.pop(0)
    ns = dict(py.__globals__)
    exec(compile("\n".join(lines), f"<{py.__name__}, mutated>", "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns[py.__name__]


@pytest.fixture
def one_torch_thread():
    """For the CPU schedule checks (tiles of 128 rows): torch's second thread only waits on a
    loaded machine (4x slower). A module imports it and marks its tests
    ``pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A token stride that puts row 128 of a view past 2^31 elements (rows 121 on): an output of
# H·D = 4096 channels per token at N >= 524288 tokens in 130 rows.
WIDE_ROW_STRIDE = 2**24 + 2**20


def wide_rows(shape: tuple[int, ...], dtype: torch.dtype, *,
              row_stride: int = WIDE_ROW_STRIDE) -> torch.Tensor:
    """A ``[B, H, N, D]`` view whose tokens are ``row_stride`` elements apart, over storage
    allocated and never written (the kernel writes a few of its 2^31 and more elements; the
    pages it does not touch are never committed): for the checks that a kernel's row offsets
    are computed in 64 bits on the CPU model (``gluon_cpu.Overflow``)."""
    b, h, n, d = shape
    strides = (h * d, d, row_stride, 1)  # batch and head inside one token's row (NHD-like)
    size = sum((x - 1) * s for x, s in zip(shape, strides)) + 1
    storage = torch.UntypedStorage(size * torch.tensor([], dtype=dtype).element_size())
    return torch.tensor([], dtype=dtype).set_(storage, 0, shape, strides)


def assert_bits(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal bit for bit (NaN where NaN), for the CPU schedule checks of the Gluon kernels."""
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        i = tuple(int(x) for x in (~same).nonzero()[0])
        raise AssertionError(f"{name}: {int((~same).sum())} of {got.numel()} differ; first at {i}: "
                             f"{got[i].item()!r} against the twin's {want[i].item()!r}")


def causal_offset_of(nq: int, nk: int, causal: bool, offset: int | None) -> int | None:
    """A shape's causal offset: None when not causal, the bottom-right ``nk - nq`` unless given."""
    if not causal:
        return None
    return nk - nq if offset is None else offset


def schedule_outcome(runs) -> str:
    """How ``tools.gluon_cpu`` answers a (mutated) kernel: ``runs`` yields, one run at a time,
    ``[(got, want), ...]`` (a run may raise); the first failure's kind ("hang", "race", "error": any
    other ``ScheduleError``, "wrong": a pair not equal bit for bit), or "passes"."""
    from lowbit_attn.tools import gluon_cpu

    try:
        for pairs in runs:
            if not all(bool(((g == w) | (g.isnan() & w.isnan())).all()) for g, w in pairs):
                return "wrong"
    except gluon_cpu.Hang:
        return "hang"
    except gluon_cpu.Race:
        return "race"
    except gluon_cpu.ScheduleError:  # e.g. an access outside a tensor
        return "error"
    return "passes"


def mutation_params(mutations) -> list:
    """``(id, jit, old, new, expected)`` rows as ``pytest.param(jit, old, new, expected, id=id)``
    for ``parametrize("jit,old,new,expected", ...)``."""
    return [pytest.param(*m[1:], id=m[0]) for m in mutations]


def assert_caught(got: str, expected: str) -> None:
    """A mutated kernel's :func:`schedule_outcome` ``got`` is a failure, of the ``expected`` kind
    unless that is "any"."""
    assert got != "passes", "the mutated kernel passes the CPU check"
    assert expected == "any" or got == expected, got


def record_launches(monkeypatch, module, names) -> list:
    """The kernels ``names`` of ``module`` replaced by recorders for the test: each launch is
    appended, as an ``aot.Launch``, to the list returned, and nothing runs."""
    from lowbit_attn.tools.aot import Launch

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(Launch(self.kernel, args, kwargs, grid))

    for name in names:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name)))
    return launches


def check_replayed_args(normal, replayed, inputs, out2, out3, slots: dict) -> None:
    """One launch's launcher arguments, Triton's path (``normal``, the call that returned
    ``out2``) against another call's (``replayed``, which returned ``out3``: a plan's replay,
    pointers as integers, or Triton's path again): the same grid, stream, compiled function and
    metadata, and values; each pointer at the same input, at the same place in the matching
    output, or (an intermediate) at one workspace buffer per intermediate (``slots``: storage →
    (base, bytes), filled across the launches of a call)."""
    assert len(normal) == len(replayed), (len(normal), len(replayed))
    assert normal[:3] == replayed[:3], "grid"
    assert normal[3] == replayed[3], "stream"
    assert normal[4:6] == replayed[4:6], "compiled function and metadata"
    owners_in = [t.untyped_storage().data_ptr() for t in inputs]
    owners_out = [t.untyped_storage().data_ptr() for t in out2]
    for a, b in zip(normal[9:], replayed[9:]):
        pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
        for x, y in pairs:
            if not isinstance(x, torch.Tensor):
                assert x == y and type(x) is type(y), (x, y)
                continue
            y = y.data_ptr() if isinstance(y, torch.Tensor) else y
            assert isinstance(y, int)
            owner = x.untyped_storage().data_ptr()
            if owner in owners_in:
                assert y == x.data_ptr()
            elif owner in owners_out:
                i = owners_out.index(owner)
                assert y - out3[i].data_ptr() == x.data_ptr() - out2[i].data_ptr()
            else:  # an intermediate: one place in the workspace per buffer
                base = y - (x.data_ptr() - owner)
                assert slots.setdefault(owner, (base, x.untyped_storage().nbytes()))[0] == base


def print_scenarios(scenarios: dict, names: list[str], sink: list, reset) -> None:
    """In a child process: ``scenarios[name](sink)`` for each of ``names``, each after
    ``reset()``, printed as one JSON line of ``{name: its result, or {"raised": the exception
    it raised}}``."""
    import json

    results = {}
    for name in names:
        reset()
        try:
            results[name] = scenarios[name](sink)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[name] = {"raised": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))


# (B, Hq, Hkv, Nq, Nk, D, causal offset or None for "nk - nq" when causal) that the schedule tests
# of the Hopper loops, forward (tests/inference/test_sm90_schedule.py) and backward
# (tests/training/test_bwd_sm90_schedule.py), both run: partial query and key tiles (counts not a
# multiple of 16: the permuted operands' last group), GQA, MQA, a causal diagonal at offset 0 and
# one past the bottom-right corner. Each test module puts its own shapes between the third and the
# fourth.
SM90_SHAPES = [
    pytest.param(1, 2, 2, 130, 130, 64, None, id="B1-H2-N130-D64"),
    pytest.param(2, 4, 2, 77, 200, 64, None, id="B2-GQA4:2-Nq77-Nk200-D64"),
    pytest.param(1, 3, 1, 200, 90, 128, None, id="B1-MQA3:1-Nq200-Nk90-D128"),
    pytest.param(1, 2, 2, 150, 100, 128, 0, id="B1-Nq150-Nk100-D128-offset0"),
    pytest.param(1, 1, 1, 130, 300, 64, 150, id="B1-Nq130-Nk300-D64-offset150"),
]


# Stand-in checks for gluon_check.isolated, run in a child process (which imports this module).
def check_passes(device, *args):
    return None


def check_fails(device, *args):
    return f"mismatch on {device} with {args}"


def check_crashes(device, *args):
    import os

    os._exit(3)


def check_hangs(device, *args):
    import time

    time.sleep(60)


def check_sleeps(device, seconds, verdict=""):
    """Passes (or fails with ``verdict``) after ``seconds``: a check that takes its time."""
    import time

    time.sleep(float(seconds))
    return verdict or None


def pinned_codegen() -> bool:
    """Whether the installed Triton is the pinned one, whose code generation the spill and
    instruction-count gates were measured on (other releases schedule and allocate differently;
    tests marked ``pinned_codegen`` are skipped there, mixed tests check those counts only
    here)."""
    from lowbit_attn.core import triton_support

    return triton_support.series() == triton_support.PINNED


def needs_gluon(api: str):
    """A mark that skips a test, with the one-line reason, unless the installed Triton has the
    Gluon ``api`` (a key of ``core.triton_support.GLUON_SERIES``)."""
    from lowbit_attn.core import triton_support

    return pytest.mark.skipif(not triton_support.gluon_available(api),
                              reason=triton_support.gluon_refusal(api, "the Gluon code"))


def require_gluon(*apis: str) -> None:
    """Skip the calling test module, with the one-line reason, unless the installed Triton has the
    Gluon API of each of ``apis`` (keys of ``core.triton_support.GLUON_SERIES``) the module's
    kernels are written for."""
    from lowbit_attn.core import triton_support

    for api in apis:
        if not triton_support.gluon_available(api):
            pytest.skip(triton_support.gluon_refusal(api, "this module's Gluon code"),
                        allow_module_level=True)


def independent_mask(nq, nk, *, causal=False, window=None, chunk=None):
    """lowbit_attn's window and chunk rule (issue 44's definition, FlashAttention 3's), written out
    one entry at a time: ``[nq, nk]`` bool, True where query ``i`` sees key ``j``."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    m = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        p = i + nk - nq
        for j in range(nk):
            ok = True
            if left != -1 and j < p - left:
                ok = False
            if right != -1 and j > p + right:
                ok = False
            if chunk is not None and (p < 0 or j // chunk != p // chunk):
                ok = False
            m[i, j] = ok
    return m


def exact64(q, k, v, mask, *, scale, softcap=None, sinks=None):
    """float64 attention with a given mask ``[Nq, Nk]``, soft-capping and sinks (gpt-oss: the
    sink column joins the softmax, then is dropped)."""
    hq = q.shape[1]
    g = hq // k.shape[1]
    kk, vv = (x.double().repeat_interleave(g, 1) for x in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(*s.shape[:3], 1)
        s = torch.cat([s, col], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if sinks is not None:
        p = p[..., :-1]
    return p @ vv, lse


def exact64_nhd(q, k, v, mask, *, scale=None, softcap=None):
    """:func:`exact64` of ``[B, N, H, D]`` tensors (scale ``D ** -0.5`` by default): the output
    ``[B, Nq, Hq, D]`` and the LSE ``[B, Hq, Nq]`` (-inf where a row sees nothing)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = exact64(*(x.transpose(1, 2) for x in (q, k, v)), mask, scale=scale,
                       softcap=softcap)
    return out.transpose(1, 2), lse


def poison(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with what no kernel writes (``conftest.py``'s ``nan_poisoned_allocations``):
    NaN, or for 8-bit integers a value the quantizers never produce. (A leaf made with
    ``requires_grad=True``, as Inductor's pattern set-up makes them, is left as it is.)"""
    if t.requires_grad:
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.int8:
        t.fill_(-128)  # never produced by the quantizers, which clamp to ±127
    elif t.dtype == torch.uint8:
        t.fill_(0xFF)  # packed FP4 (-6, -6) or an E8M0 NaN scale: loud in bit comparisons
    return t


def script_module(relative: str, name: str | None = None):
    """The script at ``relative`` (a path from the repository's root, e.g.
    ``"benchmarks/bench_vsa.py"``) as a module named ``name`` (its file's stem by default): the
    folders of scripts are not packages. Each call runs the script's top level afresh."""
    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def docs_hooks():
    """``docs/hooks.py``, the checks ``make docs`` runs, as a module (it is not a package)."""
    return script_module("docs/hooks.py", "docs_hooks")
